#!/usr/bin/env python3
"""A steady-state capacity model of collocated and P/D serving, from measured step costs.

It answers "at what request rate does each deployment stop meeting the SLO" from a handful of
numbers measured on one GPU (decode step time against batch and context, the extra time a
prefill chunk adds to a step, a dedicated prefill's time per token, KV capacity), so a split
can be compared before it is run. Means only: it gives the rate where the *mean* request
leaves the SLO (saturation), which is above the rate where 90 % of requests still meet it.
docs/perf/goodput.md checks it against the 2×H200 measurements and uses it for 4 GPUs.

    python3 tools/pdbench/capacity_model.py                    # the defaults: Qwen3-32B shape on H200
    python3 tools/pdbench/capacity_model.py --gpus 4 --itl-slo-ms 50 --isl 2000 --osl 1000

Standard library only.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Measured on one GPU (defaults: Qwen3-32B shape, bf16, one H200; docs/perf/engine.md and
    goodput.md, 2026-11-30 22:50–23:18 UTC)."""

    # A decode step's fixed part (weights) as served: the mode of the decode-only gaps at 1 req/s
    # (18-22 ms, goodput.md, 2026-11-30 22:50–23:18 UTC) rather than engine_bench's execute() at b1 (17.4 ms): the
    # server adds scheduling, per-row sampling and streaming to every step.
    decode_base_ms: float = 19.5
    decode_ms_per_ctx_token: float = 10.1 / (64 * 2048)  # (b64 27.5 ms - b1) / (64 x 2,048) KV tokens read
    # Extra time of a step that carries a prefill chunk of `budget` tokens, over the decode-only
    # step around it (modes of the measured inter-token gaps: 256 -> +15 ms, 512 -> +42 ms,
    # 2,048 -> +190 ms for a 2,000-token prompt).
    chunk_extra_ms: tuple[tuple[int, float], ...] = ((256, 15.0), (512, 42.0), (2048, 190.0))
    prefill_ms_per_token: float = 0.110  # a producer's whole-prompt prefill: 220 ms for 2,000 tokens
    handoff_ms: float = 10.0  # P/D: the KV transfer's last layer, control messages, hand-over
    kv_tokens_per_gpu: int = 269_504  # --gpu-memory-utilization 0.92 with 65.5 GB of weights

    def chunk_extra(self, budget: int) -> float:
        for b, extra in self.chunk_extra_ms:
            if b == budget:
                return extra
        known = ", ".join(str(b) for b, _ in self.chunk_extra_ms)
        raise ValueError(f"no measured chunk cost for budget {budget} (measured: {known})")


@dataclasses.dataclass(frozen=True)
class Workload:
    isl: int = 2000
    osl: int = 1000
    ttft_slo_ms: float = 1000.0
    itl_slo_ms: float = 50.0


@dataclasses.dataclass(frozen=True)
class Point:
    """The model's steady state at one rate."""

    rate: float
    ttft_ms: float
    tpot_ms: float
    worst_gap_ms: float  # the longest regular gap: a chunk step (collocated) or a decode step (P/D)
    running_per_gpu: float  # decoding requests on one decode GPU
    kv_tokens_per_gpu: float
    limit: str | None  # why it fails the SLO ("" = it meets it); None = no steady state


def _decode_ms(costs: StepCosts, running: float, mean_context: float) -> float:
    return costs.decode_base_ms + costs.decode_ms_per_ctx_token * running * mean_context


def collocated(costs: StepCosts, wl: Workload, gpus: int, budget: int, rate: float) -> Point:
    """`gpus` instances, each prefilling in chunks between its decodes, under one token budget
    per step (`budget`, vLLM's max_num_batched_tokens) shared with the decoding requests: each
    takes one token of it, so a step carries at most budget - running prompt tokens.

    - running = decoding requests on one GPU = rate/GPU x OSL x TPOT (Little's law);
    - a chunk step carries c = min(ISL, budget - running) prompt tokens; a prompt spans ISL / c
      such steps (a step may finish one prompt and start the next); no steady state when the
      decodes fill the budget;
    - a prompt token adds chunk_extra(budget) / min(budget, ISL) ms to its step (the measured
      extra of a step carrying a full chunk, per token);
    - TPOT = decode step / (1 - rate/GPU x ISL x that per-token extra): the chunk steps stretch
      the mean gap; the longest regular gap is a chunk step;
    - prefill is one FCFS server per GPU: service S = ISL / c x (decode step + c x extra per
      token), utilisation u = rate/GPU x S, an M/D/1 queue in front of it, so
      TTFT = S x (1 + u / (2 (1 - u))); no steady state at u >= 1;
    - KV = running x (ISL + OSL / 2) + u x ISL (the prompt in prefill)."""
    per_gpu = rate / gpus
    extra_per_token = costs.chunk_extra(budget) / min(budget, wl.isl)
    mean_context = wl.isl + wl.osl / 2.0
    unsteady = Point(rate, math.inf, math.inf, math.inf, math.inf, math.inf, None)
    busy = per_gpu * wl.isl * extra_per_token / 1000.0  # share of wall time the chunks add
    if busy >= 1.0:
        return unsteady
    tpot = costs.decode_base_ms
    running = 0.0
    for _ in range(200):  # fixed point: more running requests -> slower steps -> longer lives
        new_tpot = _decode_ms(costs, running, mean_context) / (1.0 - busy)
        if new_tpot > 1e6:
            return unsteady
        running = per_gpu * wl.osl * new_tpot / 1000.0
        if abs(new_tpot - tpot) < 1e-9:
            break
        tpot = new_tpot
    chunk = min(wl.isl, budget - running)
    if chunk < 1.0:
        return unsteady
    decode_ms = tpot * (1.0 - busy)
    extra = chunk * extra_per_token
    service_ms = wl.isl / chunk * (decode_ms + extra)
    utilization = per_gpu * service_ms / 1000.0
    if utilization >= 1.0:
        return unsteady
    ttft = service_ms * (1.0 + utilization / (2.0 * (1.0 - utilization)))
    kv = running * mean_context + utilization * wl.isl
    return Point(rate, ttft, tpot, decode_ms + extra, running, kv,
                 _limit(wl, ttft, tpot, kv, costs.kv_tokens_per_gpu))


def disaggregated(costs: StepCosts, wl: Workload, producers: int, consumers: int, rate: float) -> Point:
    """`producers` GPUs prefill whole prompts (one queue each, round-robin), `consumers` decode."""
    service_ms = wl.isl * costs.prefill_ms_per_token
    utilization = rate / producers * service_ms / 1000.0
    if utilization >= 1.0:
        return Point(rate, math.inf, math.inf, math.inf, math.inf, math.inf, None)
    # M/D/1 queue per producer: mean wait u / (2 (1 - u)) x service.
    ttft = service_ms * (1.0 + utilization / (2.0 * (1.0 - utilization))) + costs.handoff_ms
    per_gpu = rate / consumers
    mean_context = wl.isl + wl.osl / 2.0
    tpot = costs.decode_base_ms
    for _ in range(200):
        running = per_gpu * wl.osl * tpot / 1000.0
        new_tpot = _decode_ms(costs, running, mean_context)
        if new_tpot > 1e6:
            return Point(rate, math.inf, math.inf, math.inf, math.inf, math.inf, None)
        if abs(new_tpot - tpot) < 1e-9:
            break
        tpot = new_tpot
    kv = running * mean_context
    return Point(rate, ttft, tpot, tpot, running, kv, _limit(wl, ttft, tpot, kv, costs.kv_tokens_per_gpu))


def _limit(wl: Workload, ttft: float, tpot: float, kv: float, kv_cap: float) -> str:
    if kv > kv_cap:
        return "KV"
    if ttft > wl.ttft_slo_ms:
        return "TTFT"
    if tpot > wl.itl_slo_ms:
        return "TPOT"
    return ""


def saturation_rate(point_at, strict: bool = False, itl_slo_ms: float = 50.0, hi: float = 1000.0) -> float:
    """The highest rate whose steady state meets the SLO (bisection on a monotone model);
    strict also needs the longest regular gap within the ITL limit. 0 if none does."""

    def ok(rate: float) -> bool:
        p = point_at(rate)
        return p.limit == "" and (not strict or p.worst_gap_ms <= itl_slo_ms)

    lo = 1e-6
    if not ok(lo):
        return 0.0
    for _ in range(100):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def configurations(gpus: int, budgets: list[int]) -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = []
    for b in budgets:
        rows.append((f"collocated x{gpus}, budget {b}", ("c", gpus, b)))
    for p in range(1, gpus):
        rows.append((f"P/D {p}P:{gpus - p}D", ("pd", p, gpus - p)))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--isl", type=int, default=2000)
    parser.add_argument("--osl", type=int, default=1000)
    parser.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    parser.add_argument("--itl-slo-ms", type=float, default=50.0)
    parser.add_argument("--budgets", default="256,512,2048", help="chunked-prefill budgets with a measured cost")
    parser.add_argument("--at", default=None,
                        help="comma-separated rates: print the model's TTFT / TPOT / running requests there "
                             "(to set beside measured TTFT and TPOT p50s)")
    args = parser.parse_args(argv)
    if args.gpus < 2 or args.isl < 1 or args.osl < 1:
        parser.error("need --gpus >= 2, --isl >= 1, --osl >= 1")
    costs = StepCosts()
    wl = Workload(args.isl, args.osl, args.ttft_slo_ms, args.itl_slo_ms)
    try:
        budgets = [int(b) for b in args.budgets.split(",")]
        for b in budgets:
            costs.chunk_extra(b)
        at_rates = [float(r) for r in args.at.split(",")] if args.at else []
    except ValueError as error:
        parser.error(str(error))
    if any(not 0 < r < 1000 for r in at_rates):
        parser.error("--at rates must be in (0, 1000)")
    print(f"{args.gpus} GPUs, ISL {args.isl}, OSL {args.osl}, TTFT <= {args.ttft_slo_ms:g} ms, "
          f"ITL <= {args.itl_slo_ms:g} ms (model saturation rates, req/s)")
    print(f"{'configuration':<28}{'mean ITL':>10}{'strict':>10}  at the mean-ITL rate")
    for name, spec in configurations(args.gpus, budgets):
        if spec[0] == "c":
            point_at = lambda r, g=spec[1], b=spec[2]: collocated(costs, wl, g, b, r)  # noqa: E731
        else:
            point_at = lambda r, p=spec[1], d=spec[2]: disaggregated(costs, wl, p, d, r)  # noqa: E731
        mean_rate = saturation_rate(point_at, itl_slo_ms=args.itl_slo_ms)
        strict_rate = saturation_rate(point_at, strict=True, itl_slo_ms=args.itl_slo_ms)
        p = point_at(mean_rate * 1.001 if mean_rate > 0 else 1e-6)
        what = (f"then {p.limit or 'ok'}: TTFT {p.ttft_ms:.0f} ms, TPOT {p.tpot_ms:.1f} ms, "
                f"{p.running_per_gpu:.0f} running/GPU, KV {p.kv_tokens_per_gpu / 1000:.0f}k")
        print(f"{name:<28}{mean_rate:>10.2f}{strict_rate:>10.2f}  {what}")
        for rate in at_rates:
            q = point_at(rate)
            print(f"{'':<6}at {rate:g} req/s: TTFT {q.ttft_ms:.0f} ms, TPOT {q.tpot_ms:.1f} ms, "
                  f"{q.running_per_gpu:.0f} running/GPU, KV {q.kv_tokens_per_gpu / 1000:.0f}k"
                  f"{', fails on ' + q.limit if q.limit else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
