"""Pure statistics of pdbench: percentiles, per-request SLO checks, per-run summaries,
DistServe goodput. No I/O, no clocks; every function is unit-tested on synthetic data.

Times are seconds inside this module; summaries convert to milliseconds at the edge
(the `*_ms` keys).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)
# Error texts often carry request ids; a run keeps this many distinct ones, counting the rest together.
MAX_DISTINCT_ERRORS = 20
OTHER_ERRORS = "(other errors)"


def percentile(sorted_values: list[float], q: float) -> float:
    """q-th percentile (0..100) of an ascending list, linear interpolation between closest
    ranks (numpy's default method). Precondition: sorted_values is non-empty."""
    if not sorted_values:
        raise ValueError("percentile of an empty list")
    position = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(position)
    high = math.ceil(position)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def summarize_ms(values_s: list[float]) -> dict:
    """mean/p50/p90/p99 in milliseconds and the count; values are null when there are none."""
    if not values_s:
        return {"count": 0, "mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ordered = sorted(values_s)
    summary = {"count": len(ordered), "mean": 1000.0 * sum(ordered) / len(ordered)}
    for q in PERCENTILES:
        summary[f"p{q}"] = 1000.0 * percentile(ordered, q)
    return summary


@dataclass
class RequestResult:
    """One request as the client saw it. Times are seconds relative to the run's start
    (`scheduled_s`, `sent_s`) or to the request's own send (`ttft_s`, `e2e_s`, `chunk_times_s`)."""

    index: int
    warmup: bool
    input_len: int
    output_len: int  # requested (max_tokens)
    scheduled_s: float = 0.0
    sent_s: float = 0.0
    ok: bool = False
    error: str | None = None
    http_status: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    # Arrival time of every content chunk (an SSE event with a non-empty `choices`).
    chunk_times_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    usage_reported: bool = False

    @property
    def gaps_s(self) -> list[float]:
        """Inter-token gaps: time between successive content chunks (one gap per chunk after
        the first, however many tokens a chunk carries)."""
        times = self.chunk_times_s
        return [later - earlier for earlier, later in zip(times, times[1:])]

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first: (e2e - ttft) / (output_tokens - 1)."""
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def finished_s(self) -> float | None:
        return None if self.e2e_s is None else self.sent_s + self.e2e_s

    def to_json(self) -> dict:
        gaps = self.gaps_s
        return {
            "index": self.index,
            "warmup": self.warmup,
            "input_len": self.input_len,
            "output_len": self.output_len,
            "output_tokens": self.output_tokens,
            "usage_reported": self.usage_reported,
            "ok": self.ok,
            "error": self.error,
            "http_status": self.http_status,
            "scheduled_s": self.scheduled_s,
            "sent_s": self.sent_s,
            "ttft_ms": None if self.ttft_s is None else 1000.0 * self.ttft_s,
            "e2e_ms": None if self.e2e_s is None else 1000.0 * self.e2e_s,
            "tpot_ms": None if self.tpot_s is None else 1000.0 * self.tpot_s,
            "num_chunks": len(self.chunk_times_s),
            "itl_ms": [1000.0 * gap for gap in gaps],
        }


@dataclass(frozen=True)
class Slo:
    """Latency limits in seconds; None means that limit is not checked."""

    ttft_s: float | None
    itl_s: float | None

    @property
    def enabled(self) -> bool:
        return self.ttft_s is not None or self.itl_s is not None


# The attainment variants, named for what each checks (every one also needs TTFT <= limit):
# "ttft_tpot": the request's TPOT (its mean inter-token time) <= limit: DistServe's and vLLM's
#   per-request SLO; one long stall can hide in the mean.
# "ttft_p99_gap": the p99 of the request's own inter-token gaps <= limit (a few stalls fail it).
# "ttft_every_gap": every gap of the request <= limit (one stall fails it).
SLO_VARIANTS = ("ttft_tpot", "ttft_p99_gap", "ttft_every_gap")
SLO_VARIANT_TEXT = {"ttft_tpot": "TTFT + TPOT (DistServe/vLLM)", "ttft_p99_gap": "TTFT + p99 of own gaps",
                    "ttft_every_gap": "TTFT + every gap"}
# Names the first JSON format used for two of them.
LEGACY_SLO_VARIANTS = {"mean_itl": "ttft_tpot", "p99_itl": "ttft_p99_gap"}


def within_slo(result: RequestResult, slo: Slo, variant: str) -> bool:
    """A failed request is never within SLO. A request with one output token (no TPOT) or
    one chunk (no gap) passes the ITL part."""
    if not result.ok:
        return False
    if slo.ttft_s is not None and (result.ttft_s is None or result.ttft_s > slo.ttft_s):
        return False
    if slo.itl_s is None:
        return True
    if variant == "ttft_tpot":
        tpot = result.tpot_s
        return tpot is None or tpot <= slo.itl_s
    if variant == "ttft_p99_gap":
        gaps = sorted(result.gaps_s)
        return not gaps or percentile(gaps, 99) <= slo.itl_s
    if variant == "ttft_every_gap":
        return all(gap <= slo.itl_s for gap in result.gaps_s)
    raise ValueError(f"unknown SLO variant {variant!r}")


def summarize_run(results: list[RequestResult], slo: Slo) -> dict:
    """Per-run numbers over the measured (non-warm-up) requests.

    Duration: from the first measured request's send to the last measured request's end,
    so warm-up requests and the idle tail do not dilute throughput."""
    measured = [r for r in results if not r.warmup]
    succeeded = [r for r in measured if r.ok]
    failed = [r for r in measured if not r.ok]
    ends = [r.finished_s for r in measured if r.finished_s is not None]
    start = min((r.sent_s for r in measured), default=0.0)
    duration_s = max(ends, default=start) - start
    output_tokens = sum(r.output_tokens for r in succeeded)
    input_tokens = sum(r.input_len for r in succeeded)
    errors: dict[str, int] = {}
    for r in failed:
        message = r.error or "unknown error"
        if message not in errors and len(errors) >= MAX_DISTINCT_ERRORS:
            message = OTHER_ERRORS
        errors[message] = errors.get(message, 0) + 1
    summary = {
        "num_requests": len(measured),
        "num_warmup": len(results) - len(measured),
        "completed": len(succeeded),
        "failed": len(failed),
        "errors": errors,
        "num_short_outputs": sum(1 for r in succeeded if r.output_tokens < r.output_len),
        "num_without_usage": sum(1 for r in succeeded if not r.usage_reported),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(succeeded) / duration_s if duration_s > 0 else None,
        "output_throughput": output_tokens / duration_s if duration_s > 0 else None,
        "ttft_ms": summarize_ms([r.ttft_s for r in succeeded if r.ttft_s is not None]),
        "tpot_ms": summarize_ms([r.tpot_s for r in succeeded if r.tpot_s is not None]),
        "itl_ms": summarize_ms([gap for r in succeeded for gap in r.gaps_s]),
        "e2e_ms": summarize_ms([r.e2e_s for r in succeeded if r.e2e_s is not None]),
    }
    if slo.enabled:
        summary["slo"] = {}
        for variant in SLO_VARIANTS:
            num_within = sum(1 for r in measured if within_slo(r, slo, variant))
            summary["slo"][variant] = {
                "num_within": num_within,
                "attainment": num_within / len(measured) if measured else None,
            }
    return summary


def lifetime_share_after(spans: list[tuple[float, float]], t_end_s: float) -> float | None:
    """Share of the summed lifetime of `spans` (send, last token) of measured, finished requests
    that came after `t_end_s` (same clock). In a staircase sweep, with `t_end_s` the last arrival,
    it says how much of a window's life was spent in a draining server, where load only falls:
    0 for a window whose requests all finished while arrivals went on."""
    total = after = 0.0
    for sent, finished in spans:
        total += finished - sent
        after += max(0.0, finished - max(sent, t_end_s))
    return after / total if total > 0 else None


def measured_spans(results: list[RequestResult]) -> list[tuple[float, float]]:
    """(send, last token) of the measured requests that finished."""
    return [(r.sent_s, r.finished_s) for r in results if not r.warmup and r.finished_s is not None]


def staircase_drain_shares(document: dict) -> list[float | None] | None:
    """`lifetime_after_arrivals_end` of each run of a staircase sweep document, computed from
    its per-request data when the document predates the field; None if it is no staircase or
    has no per-request data."""
    runs = document.get("runs") or []
    if not (document.get("config") or {}).get("staircase_window_s"):
        return None
    if all("lifetime_after_arrivals_end" in r for r in runs):
        return [r["lifetime_after_arrivals_end"] for r in runs]
    if not all("requests" in r for r in runs):
        return None
    last_arrival = max((q["scheduled_s"] for r in runs for q in r["requests"]), default=0.0)
    return [lifetime_share_after([(q["sent_s"], q["sent_s"] + q["e2e_ms"] / 1000.0) for q in r["requests"]
                                  if not q["warmup"] and q["e2e_ms"] is not None], last_arrival) for r in runs]


def goodput(points: list[tuple[float, float]], target: float = 0.9) -> dict:
    """DistServe goodput from (request rate, SLO attainment) points.

    Rule: sort by rate; take the HIGHEST rate whose attainment is >= target. If no rate
    reaches the target, goodput is below the lowest rate measured ("below_lowest", value
    null). If that rate is the highest one measured, goodput is at least that rate
    ("at_least_highest", value = that rate). Otherwise interpolate linearly between it
    (attainment a_lo >= target) and the next rate up (a_hi < target by construction):
        rate_lo + (a_lo - target) / (a_lo - a_hi) * (rate_hi - rate_lo).
    `non_monotonic` is true when a rate below the chosen one missed the target (noise or
    a real dip the reader should look at)."""
    ordered = sorted((float(rate), float(att)) for rate, att in points if att is not None)
    if not ordered:
        return {"value": None, "bound": "no_data", "text": "no data", "non_monotonic": False}
    passing = [i for i, (_, att) in enumerate(ordered) if att >= target]
    if not passing:
        lowest = ordered[0][0]
        return {"value": None, "bound": "below_lowest", "text": f"< {lowest:g} req/s", "non_monotonic": False}
    best = passing[-1]
    non_monotonic = any(att < target for _, att in ordered[:best])
    rate_lo, att_lo = ordered[best]
    if best == len(ordered) - 1:
        return {"value": rate_lo, "bound": "at_least_highest", "text": f">= {rate_lo:g} req/s",
                "non_monotonic": non_monotonic}
    rate_hi, att_hi = ordered[best + 1]
    value = rate_lo + (att_lo - target) / (att_lo - att_hi) * (rate_hi - rate_lo)
    return {"value": value, "bound": "interpolated", "text": f"{value:.3g} req/s",
            "non_monotonic": non_monotonic, "between": [rate_lo, rate_hi]}


def realised_rate(arrivals_s: list[float], window_s: float | None = None) -> float | None:
    """The arrival rate a run actually carried. With the window the arrivals were drawn for
    (a staircase or plateau window): their count / the window. Without (a run per rate): the
    mean gap between the first and the last arrival, (n - 1) / (last - first). None when
    that is undefined (no window and fewer than two arrivals, or all at once)."""
    if window_s is not None:
        return len(arrivals_s) / window_s if window_s > 0 else None
    if len(arrivals_s) < 2:
        return None
    span = max(arrivals_s) - min(arrivals_s)
    return (len(arrivals_s) - 1) / span if span > 0 else None


def bootstrap_interval(values: list[float], statistic, num_resamples: int = 1000, confidence: float = 0.95,
                       seed: int = 0) -> list[float] | None:
    """Percentile-bootstrap interval [lo, hi] of statistic(values), resampling values with
    replacement (seeded, so a document is reproducible). None for no values."""
    if not values:
        return None
    rng = random.Random(f"pdbench-bootstrap-{seed}")
    n = len(values)
    estimates = sorted(statistic([values[rng.randrange(n)] for _ in range(n)]) for _ in range(num_resamples))
    tail = (1.0 - confidence) / 2.0 * 100.0
    return [percentile(estimates, tail), percentile(estimates, 100.0 - tail)]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def attainment_interval(within: list[bool], num_resamples: int = 1000, confidence: float = 0.95,
                        seed: int = 0) -> list[float] | None:
    """Bootstrap interval of an attainment from its per-request outcomes."""
    return bootstrap_interval([1.0 if w else 0.0 for w in within], _mean, num_resamples, confidence, seed)


def goodput_interval(points: list[tuple[float, list[bool]]], target: float, num_resamples: int = 1000,
                     confidence: float = 0.95, seed: int = 0) -> dict:
    """Bootstrap of the goodput: each resample redraws every point's requests (with
    replacement), recomputes its attainment and the interpolated goodput. Returns the
    [lo, hi] interval over the resamples that bracket the target, and the share that did not
    (below the lowest or at least the highest rate): a large share means the points do not
    pin the crossing down."""
    usable = [(rate, flags) for rate, flags in points if flags and rate is not None]
    if not usable:
        return {"interval": None, "unbracketed_share": None}
    rng = random.Random(f"pdbench-goodput-{seed}")
    values: list[float] = []
    unbracketed = 0
    for _ in range(num_resamples):
        resampled = []
        for rate, flags in usable:
            n = len(flags)
            resampled.append((rate, sum(1 for _ in range(n) if flags[rng.randrange(n)]) / n))
        g = goodput(resampled, target)
        if g["bound"] == "interpolated":
            values.append(g["value"])
        else:
            unbracketed += 1
    tail = (1.0 - confidence) / 2.0 * 100.0
    values.sort()
    return {"interval": [percentile(values, tail), percentile(values, 100.0 - tail)] if values else None,
            "unbracketed_share": unbracketed / num_resamples}


def mean_in_flight(spans: list[tuple[float, float]], start_s: float, end_s: float) -> float:
    """Time-average number of requests alive (send <= t < last token) over [start_s, end_s)."""
    if end_s <= start_s:
        raise ValueError("empty interval")
    alive = sum(max(0.0, min(finished, end_s) - max(sent, start_s)) for sent, finished in spans)
    return alive / (end_s - start_s)


def littles_law_check(all_spans: list[tuple[float, float]], window: tuple[float, float],
                      measured_lifetimes_s: list[float], rate: float | None, tolerance: float) -> dict:
    """Steady state means L = lambda x W: the mean number of requests alive during the window
    (every request, lead and hold included) equals the realised rate times the mean lifetime of
    the window's requests. A ratio outside 1 +- tolerance means the window was no plateau (the
    server was filling, draining or falling behind): `holds` is false."""
    mean_alive = mean_in_flight(all_spans, *window)
    if not measured_lifetimes_s or not rate:
        return {"mean_in_flight": mean_alive, "expected": None, "ratio": None, "holds": False,
                "tolerance": tolerance}
    expected = rate * _mean(measured_lifetimes_s)
    ratio = mean_alive / expected if expected > 0 else None
    return {"mean_in_flight": mean_alive, "expected": expected, "ratio": ratio,
            "holds": ratio is not None and abs(ratio - 1.0) <= tolerance, "tolerance": tolerance}


def next_search_rate(points: list[tuple[float, float]], target: float, lo: float, hi: float,
                     relative_tolerance: float) -> float | None:
    """Bisection for the rate where attainment crosses `target`, bounded to [lo, hi].
    `points` are (nominal rate, attainment) measured so far. Returns the next nominal rate to
    measure, or None when the crossing is bracketed within relative_tolerance, or when an end
    of [lo, hi] decides it (lo misses: the crossing is below the range; hi passes: above it)."""
    done = dict(points)
    if lo not in done:
        return lo
    if done[lo] < target:
        return None
    if hi not in done:
        return hi
    if done[hi] >= target:
        return None
    passing = max(r for r, a in done.items() if a >= target)
    failing = min((r for r, a in done.items() if a < target and r > passing), default=hi)
    if failing - passing <= relative_tolerance * passing:
        return None
    return (passing + failing) / 2.0


def run_rate(run: dict) -> float | None:
    """A run's x-axis rate: the realised one, else (files without it) the nominal one."""
    realised = run.get("realised_rate")
    return realised if realised is not None else run.get("request_rate")
