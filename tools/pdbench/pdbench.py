#!/usr/bin/env python3
"""pdbench: serving benchmark for OpenAI-compatible endpoints (pdserve, pdrouter or any
other server): random token-id prompts, Poisson/gamma arrivals or fixed concurrency,
TTFT / TPOT / ITL / end-to-end latency, SLO attainment and DistServe goodput.

Standard library only at run time (asyncio streams, HTTP/1.1 and SSE by hand); `plot`
imports matplotlib. Docs: tools/pdbench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pdbenchlib import report  # noqa: E402
from pdbenchlib.http_stream import Endpoint, PdbenchError, fetch_json  # noqa: E402
from pdbenchlib.runner import ClientOptions, execute_run, rate_label  # noqa: E402
from pdbenchlib.server_metrics import MetricsSampler  # noqa: E402
from pdbenchlib.stats import (SLO_VARIANTS, Slo, attainment_interval, goodput, goodput_interval,  # noqa: E402
                              lifetime_share_after, littles_law_check, measured_spans, next_search_rate,
                              realised_rate, run_rate, summarize_run, within_slo)
from pdbenchlib.workload import PlannedRequest, WorkloadSpec, length_bounds, plan_requests  # noqa: E402

JSON_FORMAT_VERSION = 2  # 2: SLO variants renamed (stats.LEGACY_SLO_VARIANTS), realised rates
# Qwen2/2.5/3 tokenizers (and builtin:tiny, which uses Qwen3's) have their first special
# token at 151643; Llama 3's is 128000.
DEFAULT_VOCAB_SIZE = 151643
PREFLIGHT_TIMEOUT_S = 10.0

EXIT_OK, EXIT_RUN_FAILED, EXIT_USAGE = 0, 1, 2

DESCRIPTION = """\
Serving benchmark for OpenAI-compatible endpoints (pdserve, pdrouter, or any server).

Every request is POST /v1/completions with a random token-id prompt, stream=true,
stream_options.include_usage=true, ignore_eos=true, max_tokens = the sampled output length,
temperature 0. Per request it records TTFT, every inter-token gap (ITL; a chunk carrying
several tokens counts as one gap), TPOT = (e2e - TTFT) / (output_tokens - 1) and the
end-to-end latency; per run: throughput, mean/p50/p90/p99 and, with --slo-ttft-ms and/or
--slo-itl-ms, SLO attainment in two variants (mean ITL: TTFT and TPOT within limits;
p99 ITL: TTFT and the p99 of the request's own gaps within limits; errors are misses).

subcommands:
  run     one run at one request rate (or fixed concurrency with --max-concurrency)
  sweep   one run per rate in --rates, then DistServe goodput
  plot    PNGs from one or more sweep JSON files (needs matplotlib)

examples:
  pdbench.py run --base-url http://127.0.0.1:8000 --max-concurrency 8 --num-requests 64
  pdbench.py sweep --rates 0.5,1,2,4 --input-len 2000 --output-len 1000 --num-requests 100 \\
      --warmup-requests 10 --slo-ttft-ms 1000 --slo-itl-ms 50 --label pd-write \\
      --save-requests --json-out pd-write.json
  pdbench.py plot pd-write.json collocated.json --out-dir plots/ --cdf-rate 4

exit status: 0 ok; 1 a run finished with no successful request; 2 bad flags or the
endpoint could not be used (unreachable, unauthorised, unknown model)."""

GOODPUT_HELP = """\
goodput rule (DistServe): the highest rate whose attainment is >= --goodput-target,
linearly interpolated towards the next rate up (whose attainment is below the target):
rate_lo + (att_lo - target) / (att_lo - att_hi) * (rate_hi - rate_lo). Reported as
"< LOWEST" when no rate reaches the target and ">= HIGHEST" when the highest rate does.
Both SLO variants get a goodput."""


SEARCH_HELP = """\
Measures steady-state plateaus and bisects over the rate for the point where the attainment of
--search-variant crosses --goodput-target, inside [--rate-lo, --rate-hi].

A plateau is one run at one rate from an idle server: a lead-in, the measured window, a hold,
all arriving at that rate (Poisson/gamma, drawn for that point alone); only the window's
requests are measured, and they live their whole life among requests of the same rate. Lead and
hold are at least --lifetime-factor x the request lifetime, estimated by a low-load probe and
then by the plateau measured just below. The window stays open until --min-requests requests
have arrived. Each plateau records its realised rate (arrivals / window), the Little's law
check (mean requests in flight during the window vs realised rate x mean lifetime; `steady_state`
is false when it fails), bootstrap 95% intervals of every attainment, and the servers' /metrics
counters (preemptions, recomputed tokens, transfer failures, ...) and gauges (KV blocks, queues)
over the window. Bisection: measure both ends; if --rate-lo misses or --rate-hi passes, stop
(the crossing is outside); else halve the bracket between the highest passing and the lowest
failing nominal rate until it is within --search-tolerance or --max-points are spent. Goodput:
DistServe's interpolation over the realised rates of all plateaus, with a bootstrap interval."""


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or math.isnan(value):
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be > 0 (or inf), got {text}")
    return value


def _rate_list(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not rates or any(not (r > 0 and math.isfinite(r)) for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be finite numbers > 0, got {text!r}")
    if len(set(rates)) != len(rates):
        raise argparse.ArgumentTypeError(f"rates must be distinct, got {text!r}")
    return sorted(rates)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _add_load_flags(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("endpoint")
    target.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="server URL; requests go to BASE_URL/v1/completions (default: %(default)s)")
    target.add_argument("--model", help="model name sent in requests (default: the first one GET /v1/models lists)")
    target.add_argument("--api-key", default=os.environ.get("PDBENCH_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: $PDBENCH_API_KEY)")
    target.add_argument("--request-timeout-s", type=_positive_float, default=600.0,
                        help="a request without a complete answer by then is a failure (default: %(default)s)")
    target.add_argument("--no-keep-alive", dest="keep_alive", action="store_false",
                        help="open a new connection per request (default: reuse idle keep-alive connections)")
    target.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0)")
    target.add_argument("--extra-body", type=_json_object, default={},
                        help="JSON object merged into every request body, e.g. '{\"top_k\": 1}'")

    data = parser.add_argument_group("dataset (random token ids, seeded)")
    data.add_argument("--input-len", type=_positive_int, default=1024, help="prompt tokens (default: %(default)s)")
    data.add_argument("--output-len", type=_positive_int, default=128,
                      help="output tokens = max_tokens, with ignore_eos (default: %(default)s)")
    data.add_argument("--range-ratio", type=float, default=0.0,
                      help="lengths uniform in [len*(1-R), len*(1+R)], 0 <= R < 1 (default: 0, fixed lengths)")
    data.add_argument("--seed", type=int, default=0,
                      help="seeds lengths and arrivals (identical for every rate of a sweep) and token ids "
                           "(different per rate, so no prefix-cache reuse across rates) (default: 0)")
    data.add_argument("--vocab-size", type=_positive_int, default=DEFAULT_VOCAB_SIZE,
                      help="token ids are drawn uniformly from [--min-token-id, VOCAB_SIZE): set it to the first "
                           "special token id (default: %(default)s = Qwen2/2.5/3 and builtin:tiny; Llama 3: 128000)")
    data.add_argument("--min-token-id", type=int, default=100,
                      help="lowest token id drawn, to skip low special ids some tokenizers have (default: %(default)s)")

    load = parser.add_argument_group("load")
    load.add_argument("--num-requests", type=_positive_int, default=100,
                      help="measured requests per run (default: %(default)s)")
    load.add_argument("--warmup-requests", type=int, default=0,
                      help="requests sent first, on the same schedule, and excluded from every statistic "
                           "(default: %(default)s)")
    load.add_argument("--burstiness", type=_positive_float, default=1.0,
                      help="gamma shape of inter-arrival gaps: 1 = Poisson, < 1 burstier, > 1 more regular "
                           "(default: 1)")
    load.add_argument("--max-concurrency", type=_positive_int,
                      help="at most this many requests in flight; later arrivals wait for a slot")

    slo = parser.add_argument_group("SLO")
    slo.add_argument("--slo-ttft-ms", type=_positive_float, help="TTFT limit in ms")
    slo.add_argument("--slo-itl-ms", type=_positive_float, help="inter-token latency limit in ms")
    slo.add_argument("--goodput-target", type=float, default=0.9,
                     help="attainment that defines goodput (sweep, search; default: %(default)s)")
    slo.add_argument("--bootstrap-resamples", type=_positive_int, default=1000,
                     help="resamples of the bootstrap 95%% intervals of attainment and goodput "
                          "(default: %(default)s)")

    out = parser.add_argument_group("output")
    out.add_argument("--label", default="", help="name of this configuration in the JSON and in plots")
    out.add_argument("--json-out", type=Path, help="write the results as JSON (rewritten after every rate)")
    out.add_argument("--save-requests", action="store_true",
                     help="include per-request data (TTFT, every gap, ...) in the JSON; plot's CDFs need it")
    out.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdbench.py", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{run,sweep,search,plot}")

    run = commands.add_parser("run", help="one run at one rate or fixed concurrency",
                              description="One run: --num-requests requests at --request-rate (default inf: all "
                                          "at once, usually with --max-concurrency).",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("--request-rate", type=_rate, default=math.inf,
                     help="mean requests/s of the arrival process (default: inf)")
    _add_load_flags(run)

    sweep = commands.add_parser("sweep", help="one run per rate, attainment per rate, DistServe goodput",
                                description="One run per rate of --rates, in increasing order, same seed.\n\n" +
                                            GOODPUT_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sweep.add_argument("--rates", type=_rate_list, required=True, help="comma-separated request rates, req/s")
    sweep.add_argument("--staircase-window-s", type=_positive_float, default=None,
                       help="one continuous run instead of one run per rate: rate k's requests arrive in the "
                            "k-th window of this many seconds while earlier windows' requests still run, so "
                            "each rate starts loaded (closer to steady state than a run from idle when "
                            "requests outlive a window); requests per rate = rate x window (--num-requests "
                            "is ignored); warm-up requests, if any, come before the first window")
    sweep.add_argument("--staircase-tail-s", type=_positive_float, default=None,
                       help="with --staircase-window-s: keep the top rate arriving this many more seconds, "
                            "unmeasured, so the last window is not measured in a draining server")
    sweep.add_argument("--staircase-lead-s", type=_positive_float, default=None,
                       help="with --staircase-window-s: before each window opens, its rate arrives for this "
                            "many seconds, unmeasured, so the window starts at that rate's load")
    sweep.add_argument("--staircase-hold-s", type=_positive_float, default=None,
                       help="with --staircase-window-s: after each window closes, its rate keeps arriving for "
                            "this many seconds, unmeasured, before the next rate's lead; with a hold as long "
                            "as a request lives, each window's requests live at their own rate only (a "
                            "plateau per rate instead of a rising staircase)")
    _add_load_flags(sweep)

    search = commands.add_parser(
        "search", help="steady-state plateaus, bisection for the rate where attainment crosses the target",
        description=SEARCH_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    search.add_argument("--rate-lo", type=_positive_float, required=True, help="lowest rate measured, req/s")
    search.add_argument("--rate-hi", type=_positive_float, required=True, help="highest rate measured, req/s")
    search.add_argument("--search-variant", choices=SLO_VARIANTS, default="ttft_tpot",
                        help="SLO variant whose crossing is searched (all are reported; default: %(default)s)")
    search.add_argument("--max-points", type=_positive_int, default=6,
                        help="plateaus measured at most, the two ends included (default: %(default)s)")
    search.add_argument("--search-tolerance", type=_positive_float, default=0.1,
                        help="stop when the crossing is bracketed within this fraction of the rate "
                             "(default: %(default)s)")
    search.add_argument("--min-requests", type=_positive_int, default=200,
                        help="measured requests per plateau at least: the window stays open until that many "
                             "have arrived (default: %(default)s)")
    search.add_argument("--window-s", type=float, default=0.0,
                        help="shortest measured window, s (default: rate-driven, see --min-requests)")
    search.add_argument("--lead-s", type=float, default=0.0,
                        help="shortest unmeasured lead-in before the window, s; the lead is at least "
                             "--lifetime-factor x the estimated request lifetime (default: 0)")
    search.add_argument("--hold-s", type=float, default=0.0,
                        help="shortest unmeasured hold after the window, s; at least --lifetime-factor x the "
                             "estimated lifetime too (default: 0)")
    search.add_argument("--lifetime-factor", type=float, default=1.5,
                        help="lead and hold = this x the estimated request lifetime: the mean end-to-end "
                             "latency of the plateau measured below this rate, else of the probe "
                             "(default: %(default)s; at least 1)")
    search.add_argument("--probe-requests", type=_positive_int, default=4,
                        help="requests of the low-load probe (one at a time) that gives the first lifetime "
                             "estimate (default: %(default)s)")
    search.add_argument("--little-tolerance", type=_positive_float, default=0.15,
                        help="Little's law check: a plateau whose mean requests in flight differ from "
                             "realised rate x mean lifetime by more than this fraction is flagged "
                             "(default: %(default)s)")
    search.add_argument("--metrics-url", action="append", default=None,
                        help="a server whose /metrics is read at each window's start and end and every "
                             "--metrics-interval-s inside it (repeatable; default: --base-url)")
    search.add_argument("--metrics-interval-s", type=_positive_float, default=1.0,
                        help="gauge sampling interval inside a window (default: %(default)s)")
    search.add_argument("--no-metrics", action="store_true", help="do not read /metrics")
    _add_load_flags(search)

    plot = commands.add_parser("plot", help="PNGs from sweep JSON files",
                               description="Writes attainment.png (attainment vs rate, both SLO variants, one "
                                           "line per file), ttft_cdf.png and itl_cdf.png (one curve per file at "
                                           "the rate closest to --cdf-rate; needs --save-requests data).")
    plot.add_argument("files", nargs="+", type=Path, help="sweep JSON files, one per configuration")
    plot.add_argument("--labels", help="comma-separated labels, one per file (default: each file's --label, "
                                       "else its name)")
    plot.add_argument("--out-dir", type=Path, default=Path("."), help="where the PNGs go (default: .)")
    plot.add_argument("--cdf-rate", type=_rate,
                      help="rate of the CDF plots (default: the middle rate of the first file)")
    return parser


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not 0.0 <= args.range_ratio < 1.0:
        parser.error(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    if args.warmup_requests < 0:
        parser.error(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
    if not 0 <= args.min_token_id < args.vocab_size:
        parser.error(f"need 0 <= --min-token-id < --vocab-size, got {args.min_token_id} and {args.vocab_size}")
    if not 0.0 < args.goodput_target <= 1.0:
        parser.error(f"--goodput-target must be in (0, 1], got {args.goodput_target}")
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.command == "search":
        if args.slo_ttft_ms is None and args.slo_itl_ms is None:
            parser.error("search needs an SLO: --slo-ttft-ms and/or --slo-itl-ms")
        if not args.rate_lo < args.rate_hi or not math.isfinite(args.rate_hi):
            parser.error(f"need --rate-lo < --rate-hi (finite), got {args.rate_lo:g} and {args.rate_hi:g}")
        if args.max_points < 2:
            parser.error("--max-points must be >= 2 (the two ends)")
        if args.lifetime_factor < 1.0:
            parser.error(f"--lifetime-factor must be >= 1 (a hold of at least one lifetime), got "
                         f"{args.lifetime_factor:g}")
        for flag in ("window_s", "lead_s", "hold_s"):
            if not getattr(args, flag) >= 0:
                parser.error(f"--{flag.replace('_', '-')} must be >= 0")
    for flag in ("staircase_tail_s", "staircase_lead_s", "staircase_hold_s"):
        if getattr(args, flag, None) and not getattr(args, "staircase_window_s", None):
            parser.error(f"--{flag.replace('_', '-')} needs --staircase-window-s")


async def _preflight(endpoint: Endpoint, model: str | None, max_total_len: int) -> str:
    """Checks the endpoint answers GET /v1/models, resolves the model name, checks the
    longest request fits the model's max_model_len when the server reports one."""
    status, models, error = await fetch_json(endpoint, "/v1/models", PREFLIGHT_TIMEOUT_S)
    if status == 401:
        raise PdbenchError(f"GET {endpoint.url}/v1/models: HTTP 401 ({error}); pass the server's key with --api-key")
    if status != 200:
        raise PdbenchError(f"GET {endpoint.url}/v1/models: HTTP {status}: {error}")
    served = [m for m in (models.get("data") or []) if isinstance(m, dict) and "id" in m] \
        if isinstance(models, dict) else []
    if model is None:
        if not served:
            raise PdbenchError(f"GET {endpoint.url}/v1/models lists no model; name one with --model")
        model = served[0]["id"]
    entry = next((m for m in served if m["id"] == model), None)
    if served and entry is None:
        raise PdbenchError(f"model {model!r} is not served by {endpoint.url}; it serves "
                           f"{', '.join(m['id'] for m in served)}")
    limit = entry.get("max_model_len") if entry else None
    if isinstance(limit, int) and max_total_len > limit:
        raise PdbenchError(f"the longest request needs {max_total_len} tokens (prompt + output) but {model!r} "
                           f"has max_model_len {limit}; lower --input-len/--output-len/--range-ratio")
    return model


def _write_json(path: Path, document: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(document, indent=1) + "\n")
    temporary.replace(path)


def _run_entry(args: argparse.Namespace, rate: float, results: list, slo: Slo, loop_lag_ms: dict,
               window_s: float | None = None) -> tuple[dict, dict[str, list[bool]]]:
    """One rate's record of the JSON document (per-request data with --save-requests), and the
    per-request SLO outcomes of its measured requests (for the goodput's bootstrap).
    `window_s`: the window the measured arrivals were drawn in (staircase, plateau), for the
    realised rate."""
    measured = [r for r in results if not r.warmup]
    run = {"label": rate_label(rate, args.max_concurrency), "request_rate": rate if math.isfinite(rate) else None,
           "realised_rate": realised_rate([r.scheduled_s for r in measured], window_s)
           if math.isfinite(rate) else None,
           "max_concurrency": args.max_concurrency, **summarize_run(results, slo), "client_loop_lag_ms": loop_lag_ms}
    flags: dict[str, list[bool]] = {}
    if slo.enabled:
        for variant in SLO_VARIANTS:
            flags[variant] = [within_slo(r, slo, variant) for r in measured]
            run["slo"][variant]["interval"] = attainment_interval(flags[variant], args.bootstrap_resamples,
                                                                  seed=args.seed)
    if args.save_requests:
        run["requests"] = [r.to_json() for r in results]
    return run, flags


def _set_goodput(document: dict, target: float, flags_per_run: list[dict[str, list[bool]]],
                 num_resamples: int, seed: int) -> None:
    """Goodput per variant over the runs' realised rates, with its bootstrap interval."""
    document["goodput"] = {}
    for variant in SLO_VARIANTS:
        points = [(run_rate(r), r["slo"][variant]["attainment"]) for r in document["runs"]]
        entry = goodput([(x, a) for x, a in points if x is not None], target)
        entry["bootstrap"] = goodput_interval(
            [(run_rate(r), flags[variant]) for r, flags in zip(document["runs"], flags_per_run)], target,
            num_resamples, seed=seed)
        document["goodput"][variant] = entry


async def _benchmark(args: argparse.Namespace, rates: list[float], is_sweep: bool) -> int:
    endpoint = Endpoint.parse(args.base_url, args.api_key)
    longest = (length_bounds(args.input_len, args.range_ratio)[1] + length_bounds(args.output_len, args.range_ratio)[1])
    model = await _preflight(endpoint, args.model, longest)
    slo = Slo(None if args.slo_ttft_ms is None else args.slo_ttft_ms / 1000.0,
              None if args.slo_itl_ms is None else args.slo_itl_ms / 1000.0)
    options = ClientOptions(endpoint=endpoint, model=model, max_concurrency=args.max_concurrency,
                            request_timeout_s=args.request_timeout_s, keep_alive=args.keep_alive,
                            temperature=args.temperature, extra_body=args.extra_body, show_progress=not args.quiet)
    document = {
        "pdbench": {"format_version": JSON_FORMAT_VERSION},
        "kind": args.command,
        "label": args.label,
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "config": {
            "base_url": endpoint.url, "model": model, "input_len": args.input_len, "output_len": args.output_len,
            "range_ratio": args.range_ratio, "seed": args.seed, "vocab_size": args.vocab_size,
            "min_token_id": args.min_token_id, "num_requests": args.num_requests,
            "warmup_requests": args.warmup_requests, "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency, "temperature": args.temperature,
            "request_timeout_s": args.request_timeout_s, "keep_alive": args.keep_alive,
            "extra_body": args.extra_body, "slo": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms},
            "goodput_target": args.goodput_target,
        },
        "runs": [],
    }
    if not args.quiet:
        print(f"[pdbench] {endpoint.url} model {model!r}: {args.num_requests} requests per run "
              f"(+{args.warmup_requests} warm-up), input {args.input_len}, output {args.output_len}, "
              f"range ratio {args.range_ratio:g}", file=sys.stderr, flush=True)
    exit_code = EXIT_OK
    if args.command == "search":
        return await _search(args, options, slo, document)
    if is_sweep and args.staircase_window_s:
        return await _staircase(args, rates, options, slo, document)
    flags_per_run: list[dict[str, list[bool]]] = []
    for run_index, rate in enumerate(rates):
        spec = WorkloadSpec(input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
                            vocab_size=args.vocab_size, min_token_id=args.min_token_id, seed=args.seed,
                            num_requests=args.num_requests, num_warmup=args.warmup_requests, request_rate=rate,
                            burstiness=args.burstiness)
        label = rate_label(rate, args.max_concurrency)
        outcome = await execute_run(options, plan_requests(spec, run_index), label)
        run, flags = _run_entry(args, rate, outcome.results, slo, outcome.client_loop_lag_ms)
        if run["completed"] == 0:
            exit_code = EXIT_RUN_FAILED
        document["runs"].append(run)
        flags_per_run.append(flags)
        if is_sweep and slo.enabled:
            _set_goodput(document, args.goodput_target, flags_per_run, args.bootstrap_resamples, args.seed)
        if args.json_out:
            _write_json(args.json_out, document)
        print(report.run_table(run, document["config"]["slo"]), flush=True)
        print(flush=True)
    if is_sweep:
        print(report.sweep_table(document), flush=True)
    if exit_code != EXIT_OK:
        print("pdbench: error: a run finished without one successful request (see the errors above)",
              file=sys.stderr)
    return exit_code


def staircase_plan(args: argparse.Namespace, rates: list[float]) -> list[tuple[int, PlannedRequest]]:
    """(rate index, request) in send order. Step k lasts lead + W + hold seconds at rate k (after
    the warm-up requests, before step 0); its measured requests arrive in [lead, lead + W) of it,
    the lead's and the hold's are warm-ups (unmeasured) of the same rate. Each step has its own
    seeded prompts. Lead and hold 0: rate k's measured requests arrive in [k*W, (k+1)*W)."""
    window = args.staircase_window_s
    lead = getattr(args, "staircase_lead_s", None) or 0.0
    hold = getattr(args, "staircase_hold_s", None) or 0.0
    span = lead + window + hold
    plan: list[tuple[int, PlannedRequest]] = []
    offset = 0.0
    for k, rate in enumerate(rates):
        if not math.isfinite(rate):
            raise PdbenchError("--staircase-window-s needs finite --rates")
        warmup = args.warmup_requests if k == 0 else 0
        # Poisson arrivals: draw more than rate x span and keep those inside the step.
        spec = WorkloadSpec(input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
                            vocab_size=args.vocab_size, min_token_id=args.min_token_id, seed=args.seed,
                            num_requests=max(1, math.ceil(2 * rate * span) + 10), num_warmup=warmup,
                            request_rate=rate, burstiness=args.burstiness)
        requests = plan_requests(spec, k)
        lead_in = requests[warmup].arrival_s  # the warm-ups arrive before the step starts
        for r in requests:
            step_s = r.arrival_s - lead_in
            if not r.warmup and step_s >= span:
                continue
            measured = not r.warmup and lead <= step_s < lead + window
            plan.append((k, dataclasses.replace(r, index=len(plan), warmup=not measured,
                                                arrival_s=offset + r.arrival_s)))
        offset += lead_in + span
    tail = args.staircase_tail_s or 0.0
    if tail > 0:
        # The top rate keeps arriving for `tail` seconds, excluded from every statistic, so the
        # last window's requests live their whole life under that load instead of a draining server.
        rate = rates[-1]
        spec = WorkloadSpec(input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
                            vocab_size=args.vocab_size, min_token_id=args.min_token_id, seed=args.seed,
                            num_requests=max(1, math.ceil(2 * rate * tail) + 10), num_warmup=0,
                            request_rate=rate, burstiness=args.burstiness)
        for r in plan_requests(spec, len(rates)):
            if r.arrival_s < tail:
                plan.append((len(rates) - 1, dataclasses.replace(r, index=len(plan), warmup=True,
                                                                 arrival_s=offset + r.arrival_s)))
    return plan


async def _staircase(args: argparse.Namespace, rates: list[float], options: ClientOptions, slo: Slo,
                     document: dict) -> int:
    plan = staircase_plan(args, rates)
    label = f"staircase {','.join(f'{r:g}' for r in rates)} req/s, {args.staircase_window_s:g} s windows"
    document["config"]["staircase_window_s"] = args.staircase_window_s
    document["config"]["staircase_tail_s"] = args.staircase_tail_s
    document["config"]["staircase_lead_s"] = args.staircase_lead_s
    document["config"]["staircase_hold_s"] = args.staircase_hold_s
    outcome = await execute_run(options, [p for _, p in plan], label)
    exit_code = EXIT_OK
    last_arrival_s = max(p.arrival_s for _, p in plan)
    flags_per_run: list[dict[str, list[bool]]] = []
    for k, rate in enumerate(rates):
        results = [res for (tag, _), res in zip(plan, outcome.results) if tag == k]
        run, flags = _run_entry(args, rate, results, slo, outcome.client_loop_lag_ms,
                                window_s=args.staircase_window_s)
        run["lifetime_after_arrivals_end"] = lifetime_share_after(measured_spans(results), last_arrival_s)
        if run["completed"] == 0:
            exit_code = EXIT_RUN_FAILED
        document["runs"].append(run)
        flags_per_run.append(flags)
        print(report.run_table(run, document["config"]["slo"]), flush=True)
        print(flush=True)
    if slo.enabled:
        _set_goodput(document, args.goodput_target, flags_per_run, args.bootstrap_resamples, args.seed)
    if args.json_out:
        _write_json(args.json_out, document)
    print(report.sweep_table(document), flush=True)
    return exit_code


def plateau_plan(args: argparse.Namespace, rate: float, lead_s: float, hold_s: float,
                 run_index: int) -> tuple[list[PlannedRequest], float, float]:
    """One plateau's requests in send order and its measured window [start, end) in run time.
    Arrivals at `rate` from 0; those in [lead_s, end) are measured, where end is lead_s +
    --window-s, or later until --min-requests have arrived; then hold_s more of arrivals,
    unmeasured. The draws depend on (--seed, run_index) only."""
    num_drawn = args.min_requests + math.ceil(rate * (lead_s + max(args.window_s, 0.0) + hold_s) * 1.5) + 20
    while True:
        spec = WorkloadSpec(input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
                            vocab_size=args.vocab_size, min_token_id=args.min_token_id, seed=args.seed,
                            num_requests=num_drawn, num_warmup=0, request_rate=rate, burstiness=args.burstiness)
        drawn = plan_requests(spec, run_index)
        in_window = [r.arrival_s for r in drawn if r.arrival_s >= lead_s]
        if len(in_window) >= args.min_requests:
            # Open until the min_requests-th arrival has come (just past it), if --window-s is shorter.
            end = max(lead_s + args.window_s, math.nextafter(in_window[args.min_requests - 1], math.inf))
            if drawn[-1].arrival_s >= end + hold_s:
                break
        num_drawn *= 2  # the draw did not reach the hold's end: draw more (the same sequence, longer)
    plan = []
    for r in drawn:
        if r.arrival_s >= end + hold_s:
            break
        plan.append(dataclasses.replace(r, index=len(plan), warmup=not lead_s <= r.arrival_s < end))
    return plan, lead_s, end


def _lifetime_below(points: list[dict], rate: float, probe_s: float) -> float:
    """The lifetime estimate for a plateau at `rate`: the mean end-to-end latency of the plateau
    measured at the highest nominal rate below it, else the probe's; never below the probe's."""
    below = [p for p in points if p["request_rate"] < rate and p["e2e_ms"]["mean"] is not None]
    if not below:
        return probe_s
    return max(probe_s, max(below, key=lambda p: p["request_rate"])["e2e_ms"]["mean"] / 1000.0)


async def _search(args: argparse.Namespace, options: ClientOptions, slo: Slo, document: dict) -> int:
    config = document["config"]
    config["search"] = {key: getattr(args, key) for key in (
        "rate_lo", "rate_hi", "search_variant", "max_points", "search_tolerance", "min_requests", "window_s",
        "lead_s", "hold_s", "lifetime_factor", "probe_requests", "little_tolerance", "metrics_interval_s")}
    metrics_urls = [] if args.no_metrics else (args.metrics_url or [args.base_url])
    config["search"]["metrics_urls"] = metrics_urls
    sampler_endpoints = [Endpoint.parse(url, args.api_key) for url in metrics_urls]

    # Low-load probe: one request at a time, for the first lifetime estimate.
    probe_spec = WorkloadSpec(input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
                              vocab_size=args.vocab_size, min_token_id=args.min_token_id, seed=args.seed,
                              num_requests=args.probe_requests, num_warmup=0, request_rate=math.inf,
                              burstiness=args.burstiness)
    probe = await execute_run(dataclasses.replace(options, max_concurrency=1), plan_requests(probe_spec, 0),
                              "lifetime probe")
    lifetimes = [r.e2e_s for r in probe.results if r.ok and r.e2e_s is not None]
    if not lifetimes:
        raise PdbenchError("the lifetime probe had no successful request: "
                           + "; ".join(sorted({r.error or "unknown error" for r in probe.results})))
    probe_lifetime_s = sum(lifetimes) / len(lifetimes)
    document["probe"] = {"num_requests": len(probe.results), "mean_lifetime_s": probe_lifetime_s}

    flags_per_run: list[dict[str, list[bool]]] = []
    exit_code = EXIT_OK
    target = args.goodput_target
    variant = args.search_variant
    stop_reason = "max_points"
    while len(document["runs"]) < args.max_points:
        measured = [(r["request_rate"], r["slo"][variant]["attainment"]) for r in document["runs"]]
        rate = next_search_rate(measured, target, args.rate_lo, args.rate_hi, args.search_tolerance)
        if rate is None:
            stop_reason = "decided"
            break
        lifetime_s = _lifetime_below(document["runs"], rate, probe_lifetime_s)
        lead_s = max(args.lead_s, args.lifetime_factor * lifetime_s)
        hold_s = max(args.hold_s, args.lifetime_factor * lifetime_s)
        plan, start_s, end_s = plateau_plan(args, rate, lead_s, hold_s, run_index=1 + len(document["runs"]))
        sampler = MetricsSampler(sampler_endpoints, args.metrics_interval_s)
        observers = [lambda zero: sampler.observe(zero + start_s, zero + end_s)] if sampler_endpoints else []
        outcome = await execute_run(options, plan, f"plateau at {rate:.3g} req/s", observers)
        run, flags = _run_entry(args, rate, outcome.results, slo, outcome.client_loop_lag_ms,
                                window_s=end_s - start_s)
        spans = [(r.sent_s, r.finished_s) for r in outcome.results if r.finished_s is not None]
        window_lifetimes = [r.e2e_s for r in outcome.results if not r.warmup and r.e2e_s is not None]
        run["plateau"] = {"lifetime_estimate_s": lifetime_s, "lead_s": lead_s, "window_s": end_s - start_s,
                          "hold_s": hold_s}
        run["littles_law"] = littles_law_check(spans, (start_s, end_s), window_lifetimes, run["realised_rate"],
                                               args.little_tolerance)
        mean_lifetime_s = sum(window_lifetimes) / len(window_lifetimes) if window_lifetimes else None
        run["plateau"]["hold_covers_lifetime"] = mean_lifetime_s is not None and mean_lifetime_s <= hold_s
        run["steady_state"] = run["littles_law"]["holds"] and run["plateau"]["hold_covers_lifetime"]
        if sampler_endpoints:
            run["server_metrics"] = outcome.observed[0]
            if sampler.errors:
                run["server_metrics_errors"] = sampler.errors[:10]
        if run["completed"] == 0:
            exit_code = EXIT_RUN_FAILED
        document["runs"].append(run)
        flags_per_run.append(flags)
        _set_goodput(document, target, flags_per_run, args.bootstrap_resamples, args.seed)
        if args.json_out:
            _write_json(args.json_out, document)
        print(report.run_table(run, config["slo"]), flush=True)
        print(flush=True)
    passing = [r["request_rate"] for r in document["runs"] if r["slo"][variant]["attainment"] >= target]
    failing = [r["request_rate"] for r in document["runs"] if r["slo"][variant]["attainment"] < target]
    document["search"] = {"variant": variant, "target": target, "stopped": stop_reason,
                          "highest_passing_rate": max(passing, default=None),
                          "lowest_failing_rate": min(failing, default=None),
                          "num_not_steady": sum(1 for r in document["runs"] if not r["steady_state"])}
    order = sorted(range(len(document["runs"])), key=lambda i: run_rate(document["runs"][i]) or 0.0)
    document["runs"] = [document["runs"][i] for i in order]
    _set_goodput(document, target, [flags_per_run[i] for i in order], args.bootstrap_resamples, args.seed)
    if args.json_out:
        _write_json(args.json_out, document)
    print(report.sweep_table(document), flush=True)
    if document["search"]["num_not_steady"]:
        print(f"WARNING: {document['search']['num_not_steady']} plateaus failed the steady-state checks "
              "(Little's law or a hold shorter than the lifetime): their attainment is not a steady state's",
              flush=True)
    return exit_code


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "plot":
            from pdbenchlib import plot  # matplotlib is imported only here

            written = plot.plot_files(args.files, args.labels.split(",") if args.labels else None, args.out_dir,
                                      args.cdf_rate)
            for path in written:
                print(path)
            return EXIT_OK
        _check_args(parser, args)
        rates = {"sweep": getattr(args, "rates", None), "run": [getattr(args, "request_rate", None)],
                 "search": [getattr(args, "rate_lo", None), getattr(args, "rate_hi", None)]}[args.command]
        return asyncio.run(_benchmark(args, rates, args.command in ("sweep", "search")))
    except PdbenchError as error:
        print(f"pdbench: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("pdbench: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
