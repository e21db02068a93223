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
from pdbenchlib.stats import Slo, goodput, lifetime_share_after, measured_spans, summarize_run  # noqa: E402
from pdbenchlib.workload import PlannedRequest, WorkloadSpec, length_bounds, plan_requests  # noqa: E402

JSON_FORMAT_VERSION = 1
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
                     help="attainment that defines goodput (sweep; default: %(default)s)")

    out = parser.add_argument_group("output")
    out.add_argument("--label", default="", help="name of this configuration in the JSON and in plots")
    out.add_argument("--json-out", type=Path, help="write the results as JSON (rewritten after every rate)")
    out.add_argument("--save-requests", action="store_true",
                     help="include per-request data (TTFT, every gap, ...) in the JSON; plot's CDFs need it")
    out.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdbench.py", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{run,sweep,plot}")

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


def _run_entry(args: argparse.Namespace, rate: float, results: list, slo: Slo, loop_lag_ms: dict) -> dict:
    """One rate's record of the JSON document (per-request data with --save-requests)."""
    run = {"label": rate_label(rate, args.max_concurrency), "request_rate": rate if math.isfinite(rate) else None,
           "max_concurrency": args.max_concurrency, **summarize_run(results, slo), "client_loop_lag_ms": loop_lag_ms}
    if args.save_requests:
        run["requests"] = [r.to_json() for r in results]
    return run


def _set_goodput(document: dict, target: float) -> None:
    document["goodput"] = {
        variant: goodput([(r["request_rate"], r["slo"][variant]["attainment"]) for r in document["runs"]], target)
        for variant in ("mean_itl", "p99_itl")}


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
        "kind": "sweep" if is_sweep else "run",
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
    if is_sweep and args.staircase_window_s:
        return await _staircase(args, rates, options, slo, document)
    for run_index, rate in enumerate(rates):
        spec = WorkloadSpec(input_len=args.input_len, output_len=args.output_len, range_ratio=args.range_ratio,
                            vocab_size=args.vocab_size, min_token_id=args.min_token_id, seed=args.seed,
                            num_requests=args.num_requests, num_warmup=args.warmup_requests, request_rate=rate,
                            burstiness=args.burstiness)
        label = rate_label(rate, args.max_concurrency)
        outcome = await execute_run(options, plan_requests(spec, run_index), label)
        run = _run_entry(args, rate, outcome.results, slo, outcome.client_loop_lag_ms)
        if run["completed"] == 0:
            exit_code = EXIT_RUN_FAILED
        document["runs"].append(run)
        if is_sweep and slo.enabled:
            _set_goodput(document, args.goodput_target)
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
    for k, rate in enumerate(rates):
        results = [res for (tag, _), res in zip(plan, outcome.results) if tag == k]
        run = _run_entry(args, rate, results, slo, outcome.client_loop_lag_ms)
        run["lifetime_after_arrivals_end"] = lifetime_share_after(measured_spans(results), last_arrival_s)
        if run["completed"] == 0:
            exit_code = EXIT_RUN_FAILED
        document["runs"].append(run)
        print(report.run_table(run, document["config"]["slo"]), flush=True)
        print(flush=True)
    if slo.enabled:
        _set_goodput(document, args.goodput_target)
    if args.json_out:
        _write_json(args.json_out, document)
    print(report.sweep_table(document), flush=True)
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
        rates = args.rates if args.command == "sweep" else [args.request_rate]
        return asyncio.run(_benchmark(args, rates, args.command == "sweep"))
    except PdbenchError as error:
        print(f"pdbench: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("pdbench: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
