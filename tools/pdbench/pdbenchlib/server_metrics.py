"""The servers' own view of a measured window: their Prometheus /metrics read when the window
opens, while it runs and when it closes. Counters give what happened inside the window
(preemptions, recomputed tokens, transfers that failed, ...), gauges how full the servers were
(KV blocks, queue lengths). Parsing is pure; `MetricsSampler` does the reading.
"""

from __future__ import annotations

import asyncio
import math
import re
import time

from .http_stream import Endpoint, PdbenchError, fetch_text

# Counters whose change over the window is reported (summed over their label sets).
WINDOW_COUNTERS = (
    "pd_preemptions_total",                # requests whose KV was dropped for lack of blocks
    "pd_recomputed_tokens_total",          # tokens those drops threw away (computed again)
    "pd_remote_admissions_deferred_total",  # P/D consumer: requests that waited for the KV reserve
    "pd_connector_load_errors_total",
    "pd_connector_transfers_failed_total",
    "pd_connector_timeouts_total",
    "pd_connector_recomputes_total",
    "pd_router_leg_failures_total",
    "pd_router_fallbacks_total",
)
# Gauges sampled through the window (mean and max of the samples).
WINDOW_GAUGES = (
    "pd_num_requests_running",
    "pd_num_requests_waiting",
    "pd_num_requests_waiting_for_remote_kv",
    "pd_kv_blocks_used",
    "pd_kv_blocks_free",
    "pd_connector_blocks_held",
)
METRICS_TIMEOUT_S = 5.0
_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum of every sample of each metric name (labels summed over; comments skipped;
    histogram series keep their _bucket/_sum/_count names)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE_RE.match(line)
        if not match:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        if math.isnan(value):
            continue
        totals[match.group(1)] = totals.get(match.group(1), 0.0) + value
    return totals


def window_report(before: dict[str, float], after: dict[str, float], samples: list[dict[str, float]]) -> dict:
    """Counter deltas (None when the server does not export it) and gauge mean/max over the
    samples (None when absent), for one server."""
    counters = {name: (after[name] - before[name]) if name in before and name in after else None
                for name in WINDOW_COUNTERS}
    gauges = {}
    for name in WINDOW_GAUGES:
        values = [s[name] for s in samples if name in s]
        gauges[name] = {"mean": sum(values) / len(values), "max": max(values)} if values else None
    return {"counters": counters, "gauges": gauges, "num_samples": len(samples)}


class MetricsSampler:
    """Reads /metrics of each endpoint at the window's start, every `interval_s` inside it, and
    at its end. A server that cannot be read is reported in `errors` (the run goes on)."""

    def __init__(self, endpoints: list[Endpoint], interval_s: float):
        self.endpoints = endpoints
        self.interval_s = interval_s
        self.errors: list[str] = []

    async def _read(self, endpoint: Endpoint) -> dict[str, float] | None:
        try:
            status, text = await fetch_text(endpoint, "/metrics", METRICS_TIMEOUT_S)
        except PdbenchError as error:
            self.errors.append(str(error))
            return None
        if status != 200:
            self.errors.append(f"GET {endpoint.url}/metrics: HTTP {status}")
            return None
        return parse_prometheus(text)

    async def _read_all(self) -> list[dict[str, float] | None]:
        return list(await asyncio.gather(*(self._read(e) for e in self.endpoints)))

    async def observe(self, start_s: float, end_s: float) -> dict:
        """Waits for the window (time.perf_counter() clock), samples it, returns
        {url: window_report or None}."""
        await asyncio.sleep(max(0.0, start_s - time.perf_counter()))
        before = await self._read_all()
        samples: list[list[dict[str, float] | None]] = [before]
        while time.perf_counter() + self.interval_s < end_s:
            await asyncio.sleep(self.interval_s)
            samples.append(await self._read_all())
        await asyncio.sleep(max(0.0, end_s - time.perf_counter()))
        after = await self._read_all()
        samples.append(after)
        reports = {}
        for i, endpoint in enumerate(self.endpoints):
            if before[i] is None or after[i] is None:
                reports[endpoint.url] = None
                continue
            reports[endpoint.url] = window_report(before[i], after[i], [s[i] for s in samples if s[i] is not None])
        return reports
