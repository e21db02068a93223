"""The random dataset and the arrival schedule of one run (pure, seeded).

Everything comes from (`seed`, `run_index`): each rate of a sweep (each window of a staircase,
each point of a search) draws its own lengths, arrival gaps and token ids, independently of
the others, so no two rates replay one gap sequence (the same opening burst scaled by 1/rate)
and a server's prefix cache cannot serve one rate's prompts from an earlier rate's KV. A run
carries the rate it drew, not exactly the nominal one: the results record the realised rate
(stats.realised_rate) and use it.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkloadSpec:
    input_len: int
    output_len: int
    range_ratio: float  # lengths uniform in [len*(1-r), len*(1+r)]
    vocab_size: int  # token ids are drawn from [min_token_id, vocab_size)
    min_token_id: int
    seed: int
    num_requests: int
    num_warmup: int
    request_rate: float  # requests/s; math.inf sends everything at t=0
    burstiness: float  # gamma shape of inter-arrival gaps; 1 = Poisson

    def validate(self) -> None:
        """Raises ValueError naming the bad flag."""
        if self.input_len < 1:
            raise ValueError(f"--input-len must be >= 1, got {self.input_len}")
        if self.output_len < 1:
            raise ValueError(f"--output-len must be >= 1, got {self.output_len}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if not 0 <= self.min_token_id < self.vocab_size:
            raise ValueError(f"need 0 <= --min-token-id < --vocab-size, got {self.min_token_id} and {self.vocab_size}")
        if self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")
        if self.num_warmup < 0:
            raise ValueError(f"--warmup-requests must be >= 0, got {self.num_warmup}")
        if not self.request_rate > 0:
            raise ValueError(f"request rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")


@dataclass(frozen=True)
class PlannedRequest:
    index: int  # 0.. in send order; the first num_warmup are warm-up requests
    warmup: bool
    prompt_ids: list[int]
    output_len: int
    arrival_s: float  # offset from the run's start


def length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive bounds of a sampled length (at least 1)."""
    return max(1, math.floor(length * (1.0 - range_ratio))), max(1, math.ceil(length * (1.0 + range_ratio)))


def plan_requests(spec: WorkloadSpec, run_index: int) -> list[PlannedRequest]:
    spec.validate()
    shape_rng = random.Random(f"pdbench-shape-{spec.seed}-{run_index}")
    token_rng = random.Random(f"pdbench-tokens-{spec.seed}-{run_index}")
    in_lo, in_hi = length_bounds(spec.input_len, spec.range_ratio)
    out_lo, out_hi = length_bounds(spec.output_len, spec.range_ratio)
    total = spec.num_warmup + spec.num_requests
    token_ids = range(spec.min_token_id, spec.vocab_size)
    planned = []
    arrival_s = 0.0
    for index in range(total):
        input_len = shape_rng.randint(in_lo, in_hi)
        output_len = shape_rng.randint(out_lo, out_hi)
        # A gamma(shape=k, scale=1/k) gap has mean 1; dividing by the rate gives mean 1/rate.
        # k = 1 is exponential (Poisson arrivals); k < 1 is burstier, k > 1 more regular.
        unit_gap = shape_rng.gammavariate(spec.burstiness, 1.0 / spec.burstiness)
        planned.append(PlannedRequest(index=index, warmup=index < spec.num_warmup,
                                      prompt_ids=token_rng.choices(token_ids, k=input_len),
                                      output_len=output_len, arrival_s=arrival_s))
        if math.isfinite(spec.request_rate):
            arrival_s += unit_gap / spec.request_rate
    return planned
