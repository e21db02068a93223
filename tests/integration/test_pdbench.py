"""pdbench (tools/pdbench): the command line against a real `pdserve --model builtin:tiny`,
and its pure parts (goodput rule, percentiles, SLO checks, SSE parsing, the dataset) on
synthetic data."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import start_pdserve

PDBENCH_DIR = Path(__file__).resolve().parents[2] / "tools" / "pdbench"
PDBENCH = PDBENCH_DIR / "pdbench.py"
sys.path.insert(0, str(PDBENCH_DIR))

from pdbenchlib.http_stream import Endpoint, SseParser  # noqa: E402
from pdbenchlib.runner import ClientOptions, request_body  # noqa: E402
from pdbenchlib.stats import (RequestResult, Slo, goodput, lifetime_share_after, measured_spans,  # noqa: E402
                              percentile, staircase_drain_shares, summarize_run, within_slo)
from pdbenchlib.workload import WorkloadSpec, plan_requests  # noqa: E402

CLI_TIMEOUT_S = 60


def run_pdbench(*args: str, timeout_s: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PDBENCH), *args], capture_output=True, text=True, timeout=timeout_s,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def server(module_procs):
    return start_pdserve(module_procs, "--model", "builtin:tiny")


@pytest.fixture(scope="module")
def loose_sweep(server, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """A Poisson sweep over two small rates with an SLO nothing can miss."""
    out = tmp_path_factory.mktemp("pdbench") / "sweep.json"
    done = run_pdbench("sweep", "--base-url", server.base_url, "--rates", "4,8", "--num-requests", "8",
                       "--warmup-requests", "2", "--input-len", "32", "--output-len", "6", "--seed", "3",
                       "--slo-ttft-ms", "1e6", "--slo-itl-ms", "1e6", "--label", "tiny-loose", "--save-requests",
                       "--json-out", str(out))
    return done, out


# ---------------------------------------------------------------- against pdserve


def test_fixed_concurrency_run_returns_every_requested_token_with_consistent_timings(server, tmp_path):
    out = tmp_path / "run.json"
    done = run_pdbench("run", "--base-url", server.base_url, "--max-concurrency", "4", "--num-requests", "12",
                       "--input-len", "48", "--output-len", "12", "--range-ratio", "0.5", "--json-out", str(out),
                       "--save-requests")
    assert done.returncode == 0, done.stderr
    assert "TTFT" in done.stdout and "completed                         12" in done.stdout
    document = json.loads(out.read_text())
    assert document["config"]["model"] == "builtin:tiny"  # resolved through GET /v1/models
    (run,) = document["runs"]
    assert run["completed"] == 12 and run["failed"] == 0 and run["num_short_outputs"] == 0
    requests = run["requests"]
    assert len({r["output_len"] for r in requests}) > 1  # the range ratio varies the lengths
    for r in requests:
        assert r["ok"] and r["usage_reported"]
        assert r["output_tokens"] == r["output_len"]  # ignore_eos honoured: exactly max_tokens
        assert 0 < r["ttft_ms"] <= r["e2e_ms"]
        assert len(r["itl_ms"]) == r["num_chunks"] - 1
        assert all(gap >= 0 for gap in r["itl_ms"]) and sum(r["itl_ms"]) <= r["e2e_ms"] - r["ttft_ms"] + 1e-6
        assert r["tpot_ms"] == pytest.approx((r["e2e_ms"] - r["ttft_ms"]) / (r["output_tokens"] - 1))
    assert run["total_output_tokens"] == sum(r["output_len"] for r in requests)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert 0 < run[key]["p50"] <= run[key]["p90"] <= run[key]["p99"], key
    assert run["ttft_ms"]["p99"] <= run["e2e_ms"]["p99"]
    assert run["request_throughput"] > 0 and run["output_throughput"] > 0
    assert "[pdbench] rate inf, concurrency 4: 12/12 done, 0 errors" in done.stderr  # progress


def test_poisson_sweep_writes_attainment_per_rate_and_goodput(loose_sweep):
    done, out = loose_sweep
    assert done.returncode == 0, done.stderr
    document = json.loads(out.read_text())
    assert document["kind"] == "sweep" and document["label"] == "tiny-loose"
    assert [run["request_rate"] for run in document["runs"]] == [4.0, 8.0]
    for run in document["runs"]:
        assert run["num_requests"] == 8 and run["num_warmup"] == 2
        assert sum(1 for r in run["requests"] if r["warmup"]) == 2
        for variant in ("ttft_tpot", "ttft_p99_gap", "ttft_every_gap"):
            assert {k: run["slo"][variant][k] for k in ("num_within", "attainment")} == \
                {"num_within": 8, "attainment": 1.0}
            assert run["slo"][variant]["interval"] == [1.0, 1.0]  # every resample is all-within
        # The realised rate: (arrivals - 1) / (last - first arrival) of the measured requests.
        arrivals = [r["scheduled_s"] for r in run["requests"] if not r["warmup"]]
        assert run["realised_rate"] == pytest.approx((len(arrivals) - 1) / (max(arrivals) - min(arrivals)))
    assert document["runs"][0]["realised_rate"] != document["runs"][1]["realised_rate"] / 2  # own draws per rate
    first, second = (run["requests"] for run in document["runs"])
    # Each rate draws its own gaps: the second is not the first's schedule scaled by 1/2.
    assert [r["scheduled_s"] for r in second] != pytest.approx([r["scheduled_s"] / 2 for r in first])
    for variant in ("ttft_tpot", "ttft_p99_gap", "ttft_every_gap"):
        assert document["goodput"][variant]["bound"] == "at_least_highest"
        assert document["goodput"][variant]["value"] == document["runs"][1]["realised_rate"]
    assert "goodput (TTFT + TPOT (DistServe/vLLM), >= 90% within SLO, realised rates): >= " in done.stdout


def test_an_impossible_slo_gives_zero_attainment_and_no_goodput(server, tmp_path):
    out = tmp_path / "tight.json"
    done = run_pdbench("sweep", "--base-url", server.base_url, "--rates", "20,40", "--num-requests", "4",
                       "--input-len", "16", "--output-len", "4", "--slo-ttft-ms", "0.001", "--slo-itl-ms", "0.001",
                       "--no-keep-alive", "--quiet", "--json-out", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # --quiet
    document = json.loads(out.read_text())
    for run in document["runs"]:
        assert run["completed"] == 4
        for variant in ("ttft_tpot", "ttft_p99_gap", "ttft_every_gap"):
            assert run["slo"][variant]["num_within"] == 0 and run["slo"][variant]["attainment"] == 0.0
    lowest = f"< {document['runs'][0]['realised_rate']:g} req/s"
    g = document["goodput"]["ttft_tpot"]
    assert {k: g[k] for k in ("value", "bound", "text", "non_monotonic")} == \
        {"value": None, "bound": "below_lowest", "text": lowest, "non_monotonic": False}
    assert g["bootstrap"] == {"interval": None, "unbracketed_share": 1.0}


def test_server_errors_are_recorded_with_their_body_and_fail_the_run(server, tmp_path):
    out = tmp_path / "errors.json"
    # Ids from [151936, 160000) are outside builtin:tiny's vocabulary: pdserve answers 400.
    done = run_pdbench("run", "--base-url", server.base_url, "--num-requests", "3", "--input-len", "4",
                       "--output-len", "2", "--min-token-id", "151936", "--vocab-size", "160000",
                       "--slo-ttft-ms", "1e6", "--json-out", str(out))
    assert done.returncode == 1
    (run,) = json.loads(out.read_text())["runs"]
    assert run["failed"] == 3 and run["completed"] == 0
    assert sum(run["errors"].values()) == 3
    for message in run["errors"]:
        assert message.startswith("HTTP 400: ") and "outside the vocabulary" in message
    assert run["slo"]["ttft_tpot"]["attainment"] == 0.0  # errors are SLO misses
    assert "outside the vocabulary" in done.stdout


def test_request_timeout_ends_a_slow_stream_as_a_failure(server):
    done = run_pdbench("run", "--base-url", server.base_url, "--num-requests", "1", "--input-len", "8",
                       "--output-len", "3000", "--request-timeout-s", "0.3", "--quiet")
    assert done.returncode == 1
    assert "no complete answer within --request-timeout-s 0.3" in done.stdout


def test_unreachable_endpoint_is_a_clear_error(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    done = run_pdbench("run", "--base-url", f"http://127.0.0.1:{port}", "--num-requests", "1")
    assert done.returncode == 2
    assert f"cannot connect to 127.0.0.1:{port}: connection refused" in done.stderr
    assert "Traceback" not in done.stderr


def test_api_key_is_sent_and_its_absence_is_explained(procs):
    guarded = start_pdserve(procs, "--model", "builtin:tiny", "--api-key", "s3cret")
    refused = run_pdbench("run", "--base-url", guarded.base_url, "--num-requests", "1")
    assert refused.returncode == 2 and "HTTP 401" in refused.stderr and "--api-key" in refused.stderr
    accepted = run_pdbench("run", "--base-url", guarded.base_url, "--api-key", "s3cret", "--num-requests", "2",
                           "--input-len", "8", "--output-len", "2", "--quiet")
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr


@pytest.mark.parametrize("flags, complaint", [
    (["run", "--range-ratio", "1.5"], "--range-ratio must be in [0, 1)"),
    (["sweep", "--rates", "1,x"], "expected comma-separated numbers"),
    (["run", "--request-rate", "0"], "must be > 0"),
    (["run", "--base-url", "https://example.invalid"], "must be an http:// URL"),
    (["run", "--extra-body", "[1]"], "must be a JSON object"),
])
def test_bad_flags_are_refused_with_the_reason(flags, complaint):
    done = run_pdbench(*flags)
    assert done.returncode == 2
    assert complaint in done.stderr


def test_help_describes_the_subcommands_and_measurements():
    done = run_pdbench("--help")
    assert done.returncode == 0
    for phrase in ("run ", "sweep ", "plot ", "TTFT", "TPOT", "ignore_eos", "goodput"):
        assert phrase in done.stdout
    sweep_help = run_pdbench("sweep", "--help").stdout
    assert "interpolated" in sweep_help and "--rates" in sweep_help


def test_plot_writes_attainment_and_cdf_pngs(loose_sweep, tmp_path):
    pytest.importorskip("matplotlib")
    _, sweep_json = loose_sweep
    done = run_pdbench("plot", str(sweep_json), str(sweep_json), "--labels", "a,b", "--out-dir", str(tmp_path),
                       "--cdf-rate", "8")
    assert done.returncode == 0, done.stderr
    for name in ("attainment.png", "ttft_cdf.png", "itl_cdf.png"):
        png = (tmp_path / name).read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000, name


def test_plot_marks_optimistic_staircase_windows(tmp_path):
    pytest.importorskip("matplotlib")
    from pdbenchlib import plot

    def run(rate, attainment, drain):
        within = {"num_within": 1, "attainment": attainment}
        return {"request_rate": rate, "slo": {"mean_itl": within, "p99_itl": within},  # a first-format file
                "lifetime_after_arrivals_end": drain}

    doc = {"pdbench": {"format_version": 1}, "config": {"staircase_window_s": 20.0, "slo": {"ttft_ms": 1000,
                                                                                          "itl_ms": 50}},
           "runs": [run(1.0, 1.0, 0.0), run(2.0, 0.9, 0.05), run(3.0, 1.0, 0.35)]}
    assert plot.optimistic_rates(doc) == {3.0}
    path = tmp_path / "stair.json"
    path.write_text(json.dumps(doc))
    done = run_pdbench("plot", str(path), "--out-dir", str(tmp_path / "png"), "--cdf-rate", "1")
    # The CDFs need per-request data this document lacks: the attainment plot is written first.
    assert done.returncode == 2 and "--save-requests" in done.stderr
    png = (tmp_path / "png" / "attainment.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000


# ---------------------------------------------------------------- pure functions


def test_goodput_interpolates_between_the_last_passing_and_the_next_rate():
    g = goodput([(1, 1.0), (2, 0.95), (4, 0.75), (8, 0.2)], target=0.9)
    # 2 + (0.95 - 0.9) / (0.95 - 0.75) * (4 - 2) = 2.5
    assert g["bound"] == "interpolated" and g["value"] == pytest.approx(2.5)
    assert g["between"] == [2.0, 4.0] and not g["non_monotonic"]


def test_goodput_takes_the_highest_passing_rate_and_flags_a_dip_below_it():
    g = goodput([(4, 0.95), (1, 1.0), (2, 0.8), (8, 0.5)], target=0.9)  # unsorted on purpose
    assert g["value"] == pytest.approx(4 + 0.05 / 0.45 * 4)
    assert g["non_monotonic"]


def test_goodput_exactly_at_the_target_counts_as_passing():
    assert goodput([(1, 0.9), (2, 0.0)])["value"] == pytest.approx(1.0)


def test_goodput_reports_unbracketed_sweeps_as_bounds():
    assert goodput([(1, 0.5), (2, 0.1)]) == {"value": None, "bound": "below_lowest", "text": "< 1 req/s",
                                             "non_monotonic": False}
    high = goodput([(1, 1.0), (2, 0.93)])
    assert high["bound"] == "at_least_highest" and high["value"] == 2.0 and high["text"] == ">= 2 req/s"
    assert goodput([])["bound"] == "no_data"


def test_percentile_interpolates_linearly_between_ranks():
    values = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile(values, 99) == pytest.approx(4.96)
    assert percentile([7.0], 99) == 7.0


def _result(ttft_s: float, chunk_gaps_s: list[float], output_tokens: int, ok: bool = True) -> RequestResult:
    times = [ttft_s]
    for gap in chunk_gaps_s:
        times.append(times[-1] + gap)
    return RequestResult(index=0, warmup=False, input_len=8, output_len=output_tokens, ok=ok, ttft_s=ttft_s,
                         e2e_s=times[-1], chunk_times_s=times, output_tokens=output_tokens, usage_reported=True)


def test_strict_variant_fails_a_request_whose_mean_itl_hides_one_long_stall():
    # 99 gaps: mean ~20 ms, but the two largest are 500 ms stalls, so the p99 gap is 500 ms.
    stalled = _result(0.1, [0.01] * 50 + [0.5] + [0.01] * 47 + [0.5], output_tokens=100)
    slo = Slo(ttft_s=0.2, itl_s=0.05)
    assert stalled.tpot_s == pytest.approx((0.97 + 1.0) / 99)
    assert within_slo(stalled, slo, "ttft_tpot")
    assert not within_slo(stalled, slo, "ttft_p99_gap")
    assert not within_slo(stalled, slo, "ttft_every_gap")
    # A single stall among 99 gaps sits above the p99 rank (position 97.02 of 0..98): still within
    # the p99 variant, but not within "every gap".
    one_stall = _result(0.1, [0.01] * 98 + [0.5], output_tokens=100)
    assert within_slo(one_stall, slo, "ttft_p99_gap")
    assert not within_slo(one_stall, slo, "ttft_every_gap")
    assert within_slo(_result(0.1, [0.01] * 98 + [0.049], output_tokens=100), slo, "ttft_every_gap")


def test_ttft_limit_errors_and_single_token_requests():
    slo = Slo(ttft_s=0.2, itl_s=0.05)
    for variant in ("ttft_tpot", "ttft_p99_gap", "ttft_every_gap"):
        assert not within_slo(_result(0.3, [0.01], 2), slo, variant)
        assert not within_slo(_result(0.1, [0.01], 2, ok=False), slo, variant)
        assert within_slo(_result(0.1, [], 1), slo, variant)


def test_run_summary_excludes_warmups_and_counts_errors_as_misses():
    results = [_result(0.1, [0.01, 0.01], 3), _result(5.0, [1.0], 2), _result(0.1, [0.01], 2, ok=False)]
    warm = _result(9.0, [9.0], 2)
    warm.warmup = True
    for i, r in enumerate(results):
        r.sent_s = float(i)
    summary = summarize_run(results + [warm], Slo(ttft_s=1.0, itl_s=0.1))
    assert summary["num_requests"] == 3 and summary["num_warmup"] == 1
    assert summary["completed"] == 2 and summary["failed"] == 1
    assert summary["slo"]["ttft_tpot"] == {"num_within": 1, "attainment": pytest.approx(1 / 3)}
    assert summary["itl_ms"]["count"] == 3 and summary["ttft_ms"]["p99"] < 9000.0
    assert summary["duration_s"] == pytest.approx(1.0 + 6.0)  # from the first send to the last end


def test_sse_parser_reassembles_events_split_across_reads_and_crlf():
    parser = SseParser()
    assert parser.feed(b'data: {"a":') == []
    assert parser.feed(b' 1}\r\n\r\n: comment\n\ndata: x\ndata: y\n\nda') == ['{"a": 1}', "x\ny"]
    assert parser.feed(b"ta: [DONE]\n\n") == ["[DONE]"]


def test_dataset_draws_each_rate_independently():
    spec = dict(input_len=100, output_len=20, range_ratio=0.2, vocab_size=1000, min_token_id=100, seed=7,
                num_requests=50, num_warmup=5, burstiness=1.0)
    slow = plan_requests(WorkloadSpec(request_rate=1.0, **spec), run_index=0)
    fast = plan_requests(WorkloadSpec(request_rate=4.0, **spec), run_index=1)
    # No rate replays another's gap sequence scaled by 1/rate (nor its lengths).
    assert [p.arrival_s for p in slow] != pytest.approx([4.0 * p.arrival_s for p in fast])
    assert [len(p.prompt_ids) for p in slow] != [len(p.prompt_ids) for p in fast]
    assert all(s.prompt_ids != f.prompt_ids for s, f in zip(slow, fast))  # no prefix-cache reuse across rates
    # The same rate index at another rate is the same draw scaled (the rate only scales gaps).
    same_draw = plan_requests(WorkloadSpec(request_rate=4.0, **spec), run_index=0)
    assert [p.arrival_s for p in slow] == pytest.approx([4.0 * p.arrival_s for p in same_draw])
    assert all(80 <= len(p.prompt_ids) <= 120 and 16 <= p.output_len <= 24 for p in slow)
    assert all(100 <= t < 1000 for p in slow for t in p.prompt_ids)
    assert [p.warmup for p in slow] == [True] * 5 + [False] * 50
    assert plan_requests(WorkloadSpec(request_rate=1.0, **spec), 0) == slow  # seeded
    burst = plan_requests(WorkloadSpec(request_rate=math.inf, **spec), 0)
    assert all(p.arrival_s == 0.0 for p in burst)


def test_request_body_asks_for_exact_lengths_and_usage():
    options = ClientOptions(endpoint=Endpoint.parse("http://127.0.0.1:9/v1"), model="m", max_concurrency=None,
                            request_timeout_s=1.0, keep_alive=True, temperature=0.0, extra_body={"top_k": 1})
    planned = plan_requests(WorkloadSpec(input_len=5, output_len=7, range_ratio=0.0, vocab_size=1000,
                                         min_token_id=100, seed=0, num_requests=1, num_warmup=0, request_rate=1.0,
                                         burstiness=1.0), 0)[0]
    body = json.loads(request_body(options, planned))
    assert body == {"model": "m", "prompt": planned.prompt_ids, "max_tokens": 7, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True, "top_k": 1}
    assert options.endpoint.path_prefix == ""  # a trailing /v1 in --base-url is accepted


def test_lifetime_share_after():
    def req(sent_s, e2e_s, warmup=False, ok=True):
        return RequestResult(index=0, warmup=warmup, input_len=8, output_len=4, sent_s=sent_s, ok=ok, e2e_s=e2e_s)

    # Lives 10 s from t=0 and 10 s from t=15; arrivals end at t=20: 0 + 5 of 20 s after the end.
    assert lifetime_share_after(measured_spans([req(0.0, 10.0), req(15.0, 10.0)]), 20.0) == pytest.approx(0.25)
    # Sent after the end: all of its life counts; warm-ups and unfinished requests do not count.
    spans = measured_spans([req(25.0, 4.0), req(0.0, 100.0, warmup=True), req(1.0, None, ok=False)])
    assert spans == [(25.0, 29.0)]
    assert lifetime_share_after(spans, 20.0) == pytest.approx(1.0)
    assert lifetime_share_after([(0.0, 5.0)], 20.0) == 0.0
    assert lifetime_share_after([], 20.0) is None


def test_staircase_drain_shares_from_the_field_or_the_requests():
    def q(scheduled, sent, e2e_ms, warmup=False):
        return {"scheduled_s": scheduled, "sent_s": sent, "e2e_ms": e2e_ms, "warmup": warmup}

    runs = [{"requests": [q(0.0, 0.0, 5000.0)]},
            {"requests": [q(9.0, 9.0, 4000.0), q(12.0, 12.0, 1000.0, warmup=True)]}]
    doc = {"config": {"staircase_window_s": 10.0}, "runs": runs}
    # Last arrival at 12 s: run 0 finished at 5 s (0 %), run 1 lived 9-13 s (1 of 4 s after).
    assert staircase_drain_shares(doc) == [0.0, pytest.approx(0.25)]
    with_field = {"config": {"staircase_window_s": 10.0},
                  "runs": [{"lifetime_after_arrivals_end": 0.0}, {"lifetime_after_arrivals_end": 0.5}]}
    assert staircase_drain_shares(with_field) == [0.0, 0.5]
    assert staircase_drain_shares({"config": {}, "runs": runs}) is None  # one run per rate: no staircase
    assert staircase_drain_shares({"config": {"staircase_window_s": 10.0}, "runs": [{"slo": {}}]}) is None


def test_staircase_plan_windows():
    import argparse
    import importlib.util
    spec = importlib.util.spec_from_file_location("pdbench_cli", PDBENCH)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    args = argparse.Namespace(staircase_window_s=20.0, warmup_requests=3, input_len=64, output_len=16,
                              range_ratio=0.0, vocab_size=1000, min_token_id=10, seed=1, burstiness=1.0,
                              staircase_tail_s=None)
    rates = [1.0, 4.0]
    plan = cli.staircase_plan(args, rates)
    with_tail = cli.staircase_plan(argparse.Namespace(**{**vars(args), "staircase_tail_s": 10.0}), rates)
    tail = with_tail[len(plan):]
    assert with_tail[:len(plan)] == plan and tail
    assert all(tag == 1 and p.warmup and p.arrival_s >= plan[-1][1].arrival_s for tag, p in tail)
    assert [p.index for _, p in plan] == list(range(len(plan)))
    arrivals = [p.arrival_s for _, p in plan]
    assert arrivals == sorted(arrivals)
    warmups = [p for _, p in plan if p.warmup]
    assert len(warmups) == 3 and all(tag == 0 for tag, p in plan if p.warmup)
    lead_in = plan[3][1].arrival_s
    for k, rate in enumerate(rates):
        measured = [p for tag, p in plan if tag == k and not p.warmup]
        start, end = lead_in + k * 20.0, lead_in + (k + 1) * 20.0
        assert all(start <= p.arrival_s < end for p in measured)
        # Poisson counts: mean rate x window, well inside 4 standard deviations.
        expected = rate * 20.0
        assert abs(len(measured) - expected) < 4 * math.sqrt(expected) + 1
    # Each window has its own prompts (no prefix-cache reuse across rates).
    first = {tuple(p.prompt_ids) for tag, p in plan if tag == 0}
    assert not first & {tuple(p.prompt_ids) for tag, p in plan if tag == 1}


def test_staircase_plan_lead_and_hold():
    import argparse
    import importlib.util
    spec = importlib.util.spec_from_file_location("pdbench_cli", PDBENCH)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    base = dict(staircase_window_s=20.0, warmup_requests=2, input_len=64, output_len=16, range_ratio=0.0,
                vocab_size=1000, min_token_id=10, seed=1, burstiness=1.0, staircase_tail_s=None)
    rates = [1.0, 3.0]
    plain = cli.staircase_plan(argparse.Namespace(**base, staircase_lead_s=None, staircase_hold_s=None), rates)
    plateau = cli.staircase_plan(argparse.Namespace(**base, staircase_lead_s=10.0, staircase_hold_s=30.0), rates)
    # No lead and no hold is the plain staircase.
    assert cli.staircase_plan(argparse.Namespace(**base), rates) == plain
    assert [p.index for _, p in plateau] == list(range(len(plateau)))
    arrivals = [p.arrival_s for _, p in plateau]
    assert arrivals == sorted(arrivals)
    step_zero = plateau[2][1].arrival_s  # the first arrival after the 2 initial warm-ups
    for k, rate in enumerate(rates):
        start = step_zero + k * 60.0
        step = [p for tag, p in plateau if tag == k and p.arrival_s >= start - 1e-9]
        measured = [p for p in step if not p.warmup]
        # Measured arrivals only inside [lead, lead + window) of the step; lead and hold arrive
        # at the same rate, unmeasured, and nothing of step k arrives after its 60 s.
        assert measured and all(start + 10.0 <= p.arrival_s < start + 30.0 for p in measured)
        assert any(p.warmup and p.arrival_s < start + 10.0 for p in step)
        assert any(p.warmup and p.arrival_s >= start + 30.0 for p in step)
        assert all(p.arrival_s < start + 60.0 for p in step)
        expected = rate * 20.0
        assert abs(len(measured) - expected) < 4 * math.sqrt(expected) + 1
        hold = [p for p in step if p.warmup and p.arrival_s >= start + 30.0]
        assert abs(len(hold) - rate * 30.0) < 4 * math.sqrt(rate * 30.0) + 1


def test_staircase_hold_needs_window():
    proc = run_pdbench("sweep", "--base-url", "http://127.0.0.1:9", "--rates", "1", "--staircase-hold-s", "5")
    assert proc.returncode == 2
    assert "--staircase-hold-s needs --staircase-window-s" in proc.stderr


def test_staircase_sweep_against_server(server, tmp_path):
    out = tmp_path / "stair.json"
    proc = run_pdbench("sweep", "--base-url", server.base_url, "--rates", "4,8", "--staircase-window-s", "1.5",
                       "--input-len", "32", "--output-len", "8", "--slo-ttft-ms", "60000", "--slo-itl-ms", "60000",
                       "--json-out", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["config"]["staircase_window_s"] == 1.5
    assert [r["request_rate"] for r in doc["runs"]] == [4.0, 8.0]
    for run in doc["runs"]:
        assert run["completed"] >= 1 and run["failed"] == 0
        assert run["slo"]["ttft_tpot"]["attainment"] == 1.0
        assert 0.0 <= run["lifetime_after_arrivals_end"] <= 1.0
    # Without a tail the top window's requests finish after the last arrival: some of their life is drain.
    assert doc["runs"][-1]["lifetime_after_arrivals_end"] > 0.0
    assert doc["runs"][-1]["lifetime_after_arrivals_end"] >= doc["runs"][0]["lifetime_after_arrivals_end"]
    assert "after the last arrival" in proc.stdout
    assert doc["goodput"]["ttft_tpot"]
    # A plateau per rate: lead and hold arrivals are warm-ups of their window, the measured ones
    # are counted as in a plain window, and the top window's requests do not outlive the arrivals.
    out2 = tmp_path / "plateau.json"
    proc = run_pdbench("sweep", "--base-url", server.base_url, "--rates", "4,8", "--staircase-window-s", "1.5",
                       "--staircase-lead-s", "0.5", "--staircase-hold-s", "2", "--input-len", "32",
                       "--output-len", "8", "--slo-ttft-ms", "60000", "--slo-itl-ms", "60000",
                       "--json-out", str(out2), "--quiet")
    assert proc.returncode == 0, proc.stderr
    plateau = json.loads(out2.read_text())
    assert plateau["config"]["staircase_lead_s"] == 0.5 and plateau["config"]["staircase_hold_s"] == 2.0
    for run in plateau["runs"]:
        assert run["completed"] >= 1 and run["failed"] == 0 and run["num_warmup"] >= 1
    assert plateau["runs"][-1]["lifetime_after_arrivals_end"] < doc["runs"][-1]["lifetime_after_arrivals_end"]
