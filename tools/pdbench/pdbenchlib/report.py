"""Human tables on stdout, from the same dicts that go into the JSON output."""

from __future__ import annotations

import math

from .stats import SLO_VARIANT_TEXT, SLO_VARIANTS

MAX_ERROR_LINES = 5


def _num(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}"


def _rate(value) -> str:
    return "inf" if value is None or (isinstance(value, float) and math.isinf(value)) else f"{value:g}"


def run_table(run: dict, slo: dict) -> str:
    """One run, vLLM-style block."""
    lines = [f"============ pdbench: {run['label']} ============"]
    rows = [
        ("measured requests", run["num_requests"]),
        ("warm-up requests (excluded)", run["num_warmup"]),
        ("completed", run["completed"]),
        ("failed", run["failed"]),
        ("duration (s)", _num(run["duration_s"], 2)),
        ("request throughput (req/s)", _num(run["request_throughput"], 2)),
        ("output token throughput (tok/s)", _num(run["output_throughput"], 1)),
        ("total input / output tokens", f"{run['total_input_tokens']} / {run['total_output_tokens']}"),
    ]
    lines += [f"{name:<34}{value}" for name, value in rows]
    lines.append(f"{'(ms)':<10}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'count':>9}")
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        s = run[key]
        lines.append(f"{name:<10}{_num(s['mean']):>10}{_num(s['p50']):>10}{_num(s['p90']):>10}"
                     f"{_num(s['p99']):>10}{s['count']:>9}")
    if "slo" in run:
        limits = f"TTFT <= {_num(slo.get('ttft_ms'), 0)} ms, ITL <= {_num(slo.get('itl_ms'), 0)} ms"
        for variant in SLO_VARIANTS:
            v = run["slo"][variant]
            interval = v.get("interval")
            ci = f" (95% CI {100.0 * interval[0]:.1f}-{100.0 * interval[1]:.1f}%)" if interval else ""
            lines.append(f"SLO {SLO_VARIANT_TEXT[variant]} ({limits}): {v['num_within']}/{run['num_requests']} "
                         f"within = {100.0 * (v['attainment'] or 0.0):.1f}%{ci}")
    if run.get("realised_rate") is not None:
        lines.append(f"realised arrival rate (req/s)     {run['realised_rate']:.3g}")
    little = run.get("littles_law")
    if little:
        verdict = "holds" if little["holds"] else "FAILS: not a steady state"
        lines.append(f"Little's law: {_num(little['mean_in_flight'], 2)} in flight vs rate x lifetime "
                     f"{_num(little['expected'], 2)} (ratio {_num(little['ratio'], 3)}): {verdict}")
    for url, window in (run.get("server_metrics") or {}).items():
        if window is None:
            lines.append(f"server {url}: /metrics not read")
            continue
        counters = ", ".join(f"{name.removeprefix('pd_')} {value:g}" for name, value in window["counters"].items()
                             if value)
        lines.append(f"server {url}: {counters or 'no preemptions, recomputes or transfer failures'}")
    drain = run.get("lifetime_after_arrivals_end")
    if drain:
        lines.append(f"staircase: {100.0 * drain:.1f}% of these requests' lifetime came after the last arrival "
                     "(load falling: optimistic)")
    lag = run.get("client_loop_lag_ms") or {}
    lines.append(f"client event-loop lag (ms): p99 {_num(lag.get('p99'), 2)}, max {_num(lag.get('max'), 2)}")
    if run["num_short_outputs"]:
        lines.append(f"WARNING: {run['num_short_outputs']} requests returned fewer tokens than max_tokens "
                     "(the server may ignore ignore_eos)")
    if run["num_without_usage"]:
        lines.append(f"WARNING: {run['num_without_usage']} streams had no usage chunk; their token count is the "
                     "number of chunks")
    errors = list(run["errors"].items())
    for message, count in errors[:MAX_ERROR_LINES]:
        lines.append(f"error x{count}: {message}")
    if len(errors) > MAX_ERROR_LINES:
        lines.append(f"... {len(errors) - MAX_ERROR_LINES} more distinct errors in the JSON output")
    return "\n".join(lines)


def sweep_table(report: dict) -> str:
    """One line per rate, then goodput."""
    has_slo = "goodput" in report
    header = (f"{'rate':>8}{'done':>6}{'fail':>6}{'req/s':>8}{'tok/s':>9}{'TTFTp50':>9}{'TTFTp99':>9}"
              f"{'TPOTp50':>9}{'TPOTp99':>9}{'ITLp99':>9}")
    header = f"{'realised':>9}" + header
    if has_slo:
        header += "".join(f"{'att(' + v.removeprefix('ttft_') + ')':>16}" for v in SLO_VARIANTS)
    lines = ["============ pdbench sweep" + (f": {report['label']}" if report.get("label") else "") +
             " (latencies in ms) ============", header]
    for run in report["runs"]:
        line = (f"{_num(run.get('realised_rate'), 3):>9}{_rate(run['request_rate']):>8}"
                f"{run['completed']:>6}{run['failed']:>6}"
                f"{_num(run['request_throughput'], 2):>8}{_num(run['output_throughput'], 0):>9}"
                f"{_num(run['ttft_ms']['p50']):>9}{_num(run['ttft_ms']['p99']):>9}"
                f"{_num(run['tpot_ms']['p50']):>9}{_num(run['tpot_ms']['p99']):>9}{_num(run['itl_ms']['p99']):>9}")
        if has_slo:
            line += "".join(f"{100.0 * (run['slo'][v]['attainment'] or 0.0):>15.1f}%" for v in SLO_VARIANTS)
        lines.append(line)
    if has_slo:
        target = 100.0 * report["config"]["goodput_target"]
        for variant in SLO_VARIANTS:
            g = report["goodput"][variant]
            note = " (attainment is not monotonic in rate: look at the table)" if g["non_monotonic"] else ""
            interval = (g.get("bootstrap") or {}).get("interval")
            ci = f" (95% CI {interval[0]:.3g}-{interval[1]:.3g})" if interval else ""
            lines.append(f"goodput ({SLO_VARIANT_TEXT[variant]}, >= {target:g}% within SLO, realised rates): "
                         f"{g['text']}{ci}{note}")
    return "\n".join(lines)
