"""One run: planned requests sent on their arrival schedule (and under the concurrency cap),
one asyncio task per request, a progress line on stderr at most once per second, and a
monitor of the client's own event-loop lag (a busy client inflates TTFT and ITL; the lag
tells the reader whether the numbers are the server's or the client's).
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field

from .http_stream import ConnectionPool, Endpoint, stream_completion
from .stats import RequestResult, summarize_ms
from .workload import PlannedRequest

LAG_PROBE_INTERVAL_S = 0.01
PROGRESS_INTERVAL_S = 1.0


@dataclass(frozen=True)
class ClientOptions:
    endpoint: Endpoint
    model: str
    max_concurrency: int | None
    request_timeout_s: float
    keep_alive: bool
    temperature: float
    extra_body: dict = field(default_factory=dict)
    show_progress: bool = True


def request_body(options: ClientOptions, planned: PlannedRequest) -> bytes:
    body = {
        "model": options.model,
        "prompt": planned.prompt_ids,
        "max_tokens": planned.output_len,
        "temperature": options.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        **options.extra_body,
    }
    return json.dumps(body, separators=(",", ":")).encode()


class Progress:
    def __init__(self, label: str, total: int, num_warmup: int, enabled: bool):
        self.label = label
        self.total = total
        self.num_warmup = num_warmup
        self.enabled = enabled
        self.started = time.perf_counter()
        self.done = 0
        self.errors = 0
        self.in_flight = 0

    def line(self) -> str:
        warmup = f" (incl. {self.num_warmup} warm-up)" if self.num_warmup else ""
        return (f"[pdbench] {self.label}: {self.done}/{self.total} done{warmup}, {self.errors} errors, "
                f"{self.in_flight} in flight, {time.perf_counter() - self.started:.0f} s")

    def print(self) -> None:
        if self.enabled:
            print(self.line(), file=sys.stderr, flush=True)

    async def report_periodically(self) -> None:
        while True:
            await asyncio.sleep(PROGRESS_INTERVAL_S)
            self.print()


async def _measure_loop_lag(lags_s: list[float]) -> None:
    while True:
        before = time.perf_counter()
        await asyncio.sleep(LAG_PROBE_INTERVAL_S)
        lags_s.append(max(0.0, time.perf_counter() - before - LAG_PROBE_INTERVAL_S))


@dataclass
class RunOutcome:
    results: list[RequestResult]
    client_loop_lag_ms: dict
    observed: list = field(default_factory=list)  # what each observer returned, in order


async def execute_run(options: ClientOptions, planned: list[PlannedRequest], label: str,
                      observers: list | None = None) -> RunOutcome:
    """`observers`: callables taking the run's clock zero (time.perf_counter()) and returning
    a coroutine that runs beside the requests (e.g. reads the servers' /metrics in a window);
    the run ends when the requests and the observers are done."""
    bodies = [request_body(options, p) for p in planned]  # serialised before the clock starts
    results = [RequestResult(index=p.index, warmup=p.warmup, input_len=len(p.prompt_ids), output_len=p.output_len,
                             scheduled_s=p.arrival_s) for p in planned]
    pool = ConnectionPool(options.endpoint, options.keep_alive)
    slots = asyncio.Semaphore(options.max_concurrency) if options.max_concurrency else None
    progress = Progress(label, len(planned), sum(p.warmup for p in planned), options.show_progress)
    clock_zero = time.perf_counter()

    async def send_one(request: PlannedRequest, body: bytes, result: RequestResult) -> None:
        delay = clock_zero + request.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if slots is not None:
            await slots.acquire()
        progress.in_flight += 1
        try:
            async with asyncio.timeout(options.request_timeout_s):
                await stream_completion(pool, body, result, clock_zero)
        except TimeoutError:
            result.ok = False
            result.error = (f"no complete answer within --request-timeout-s {options.request_timeout_s:g} "
                            f"({len(result.chunk_times_s)} chunks received)")
        finally:
            progress.in_flight -= 1
            progress.done += 1
            progress.errors += 0 if result.ok else 1
            if slots is not None:
                slots.release()

    lags_s: list[float] = []
    helpers = [asyncio.create_task(_measure_loop_lag(lags_s)), asyncio.create_task(progress.report_periodically())]
    observed: list = []
    watching = None
    try:
        watching = asyncio.gather(*(observe(clock_zero) for observe in observers or []))
        await asyncio.gather(*(send_one(p, b, r) for p, b, r in zip(planned, bodies, results)))
        observed = list(await watching)
    finally:
        if watching is not None and not watching.done():
            watching.cancel()
        for helper in helpers:
            helper.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        pool.close_all()
    progress.print()
    lag = summarize_ms(lags_s)
    lag["max"] = 1000.0 * max(lags_s) if lags_s else None
    return RunOutcome(results, lag, observed)


def rate_label(rate: float, max_concurrency: int | None) -> str:
    parts = ["rate inf" if math.isinf(rate) else f"rate {rate:g} req/s"]
    if max_concurrency:
        parts.append(f"concurrency {max_concurrency}")
    return ", ".join(parts)
