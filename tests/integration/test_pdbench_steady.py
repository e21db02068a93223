"""pdbench's steady-state measurement: independent draws per window, realised rates, plateaus
with the Little's law check, bootstrap intervals, the bisection search and the servers'
/metrics per window. Pure parts on synthetic data; `search` against `pdserve --model builtin:tiny`."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import start_pdserve

PDBENCH_DIR = Path(__file__).resolve().parents[2] / "tools" / "pdbench"
PDBENCH = PDBENCH_DIR / "pdbench.py"
sys.path.insert(0, str(PDBENCH_DIR))

from pdbenchlib.server_metrics import WINDOW_COUNTERS, parse_prometheus, window_report  # noqa: E402
from pdbenchlib.stats import (attainment_interval, goodput_interval, littles_law_check,  # noqa: E402
                              mean_in_flight, next_search_rate, realised_rate)


def _cli():
    spec = importlib.util.spec_from_file_location("pdbench_cli", PDBENCH)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


# ---------------------------------------------------------------- pure


def test_staircase_windows_do_not_replay_one_gap_sequence():
    cli = _cli()
    args = argparse.Namespace(staircase_window_s=20.0, warmup_requests=0, input_len=8, output_len=4,
                              range_ratio=0.0, vocab_size=1000, min_token_id=10, seed=1, burstiness=1.0,
                              staircase_tail_s=None)
    rates = [1.0, 1.5, 2.0]
    plan = cli.staircase_plan(args, rates)
    # Each window's arrivals in units of its own mean gap: a replayed sequence would give the
    # same numbers (and the same opening burst) in every window.
    scaled = []
    for k, rate in enumerate(rates):
        window = [p.arrival_s for tag, p in plan if tag == k]
        scaled.append([(t - window[0]) * rate for t in window[:6]])
    assert scaled[0] != pytest.approx(scaled[1]) and scaled[1] != pytest.approx(scaled[2])


def test_realised_rate_from_a_window_or_from_the_arrivals():
    assert realised_rate([1.0, 2.0, 3.5], window_s=2.0) == 1.5
    assert realised_rate([0.0, 1.0, 4.0]) == pytest.approx(2 / 4.0)
    assert realised_rate([3.0]) is None and realised_rate([1.0, 1.0]) is None
    assert realised_rate([], window_s=2.0) == 0.0


def test_attainment_interval_is_seeded_and_narrows_with_more_requests():
    assert attainment_interval([True] * 50) == [1.0, 1.0]
    small = attainment_interval([True] * 9 + [False], seed=3)
    assert small == attainment_interval([True] * 9 + [False], seed=3)  # reproducible
    large = attainment_interval(([True] * 9 + [False]) * 40, seed=3)
    assert small[0] <= 0.9 <= small[1] and large[0] <= 0.9 <= large[1]
    assert large[1] - large[0] < (small[1] - small[0]) / 2
    assert attainment_interval([]) is None


def test_goodput_interval_brackets_the_interpolated_crossing():
    # 200 requests per point: 100 % at 1 req/s, 95 % at 2, 70 % at 3: the crossing is ~2.2.
    points = [(1.0, [True] * 200), (2.0, [True] * 190 + [False] * 10), (3.0, [True] * 140 + [False] * 60)]
    result = goodput_interval(points, 0.9, num_resamples=400, seed=1)
    lo, hi = result["interval"]
    assert 2.0 <= lo < 2.2 < hi <= 3.0
    assert result["unbracketed_share"] < 0.05
    # A point that is not bracketed in most resamples says so.
    undecided = goodput_interval([(1.0, [True] * 9 + [False]), (2.0, [True] * 9 + [False])], 0.9,
                                 num_resamples=200, seed=1)
    assert undecided["unbracketed_share"] > 0.5


def test_mean_in_flight_and_littles_law():
    # One arrival per second, each living 5 s: 5 alive on average in [10, 20).
    steady = [(float(t), t + 5.0) for t in range(30)]
    assert mean_in_flight(steady, 10.0, 20.0) == pytest.approx(5.0)
    measured = [5.0] * 10
    check = littles_law_check(steady, (10.0, 20.0), measured, rate=1.0, tolerance=0.15)
    assert check["ratio"] == pytest.approx(1.0) and check["holds"]
    # A server that was idle before the window and fills during it: the window's requests live
    # 5 s but few were alive when it opened, so the mean in flight is far below rate x lifetime.
    filling = [(float(t), t + 5.0) for t in range(10, 20)]
    check = littles_law_check(filling, (10.0, 20.0), measured, rate=1.0, tolerance=0.15)
    assert not check["holds"] and check["ratio"] < 0.85
    # Falling behind: lifetimes of requests alive in the window grow with their arrival.
    growing = [(float(t), t + 5.0 + t) for t in range(30)]
    lifetimes = [5.0 + t for t in range(10, 20)]
    check = littles_law_check(growing, (10.0, 20.0), lifetimes, rate=1.0, tolerance=0.15)
    assert not check["holds"]
    assert littles_law_check(steady, (10.0, 20.0), [], rate=1.0, tolerance=0.1)["holds"] is False


def test_bisection_search_is_bounded_and_converges_on_the_crossing():
    def attainment(rate: float) -> float:  # a server whose attainment crosses 90 % at 2.7 req/s
        return 1.0 if rate < 2.7 else 0.5

    points: list[tuple[float, float]] = []
    while (rate := next_search_rate(points, 0.9, 1.0, 5.0, 0.05)) is not None:
        assert 1.0 <= rate <= 5.0
        points.append((rate, attainment(rate)))
        assert len(points) < 20
    assert [r for r, _ in points[:3]] == [1.0, 5.0, 3.0]
    passing = max(r for r, a in points if a >= 0.9)
    failing = min(r for r, a in points if a < 0.9)
    assert passing < 2.7 <= failing and failing - passing <= 0.05 * passing
    # An end decides it: the lowest rate misses, or the highest passes.
    assert next_search_rate([(1.0, 0.5)], 0.9, 1.0, 5.0, 0.1) is None
    assert next_search_rate([(1.0, 1.0), (5.0, 0.95)], 0.9, 1.0, 5.0, 0.1) is None


def test_plateau_plan_has_lead_window_hold_and_enough_measured_requests():
    cli = _cli()
    args = argparse.Namespace(input_len=8, output_len=4, range_ratio=0.0, vocab_size=1000, min_token_id=10, seed=2,
                              burstiness=1.0, min_requests=200, window_s=10.0)
    plan, start, end = cli.plateau_plan(args, rate=4.0, lead_s=30.0, hold_s=30.0, run_index=1)
    measured = [p for p in plan if not p.warmup]
    assert start == 30.0 and end >= 40.0
    assert len(measured) >= 200  # the window stayed open until 200 had arrived (~50 s at 4 req/s)
    assert all(start <= p.arrival_s < end for p in measured)
    assert [p.index for p in plan] == list(range(len(plan)))
    lead = [p for p in plan if p.arrival_s < start]
    hold = [p for p in plan if p.arrival_s >= end]
    assert all(p.warmup for p in lead + hold)
    assert abs(len(lead) - 120) < 4 * math.sqrt(120) and abs(len(hold) - 120) < 4 * math.sqrt(120)
    assert max(p.arrival_s for p in plan) < end + 30.0
    # Another point draws its own arrivals.
    other, _, _ = cli.plateau_plan(args, rate=4.0, lead_s=30.0, hold_s=30.0, run_index=2)
    assert [p.arrival_s for p in other[:20]] != [p.arrival_s for p in plan[:20]]


def test_prometheus_parsing_and_window_report():
    before = parse_prometheus('# HELP pd_preemptions_total x\n# TYPE pd_preemptions_total counter\n'
                              'pd_preemptions_total 3\npd_kv_blocks_used 10\n'
                              'pd_connector_transfers_failed_total{role="consumer"} 1\n'
                              'pd_connector_transfers_failed_total{role="producer"} 2\n'
                              'pd_time_to_first_token_seconds_bucket{le="+Inf"} 7\nbad line\n')
    assert before["pd_connector_transfers_failed_total"] == 3.0
    assert before["pd_time_to_first_token_seconds_bucket"] == 7.0
    after = {"pd_preemptions_total": 5.0, "pd_kv_blocks_used": 30.0, "pd_connector_transfers_failed_total": 3.0}
    report = window_report(before, after, [before, {"pd_kv_blocks_used": 20.0}, after])
    assert report["counters"]["pd_preemptions_total"] == 2.0
    assert report["counters"]["pd_connector_transfers_failed_total"] == 0.0
    assert report["counters"]["pd_recomputed_tokens_total"] is None  # not exported by that server
    assert report["gauges"]["pd_kv_blocks_used"] == {"mean": 20.0, "max": 30.0}
    assert report["gauges"]["pd_num_requests_waiting"] is None
    assert report["num_samples"] == 3


def test_search_flags_are_checked():
    for flags, complaint in ((["--rate-lo", "2", "--rate-hi", "1", "--slo-ttft-ms", "1"], "--rate-lo < --rate-hi"),
                             (["--rate-lo", "1", "--rate-hi", "2"], "search needs an SLO"),
                             (["--rate-lo", "1", "--rate-hi", "2", "--slo-ttft-ms", "1", "--lifetime-factor", "0.5"],
                              "--lifetime-factor must be >= 1"),
                             (["--rate-lo", "1", "--rate-hi", "2", "--slo-ttft-ms", "1", "--max-points", "1"],
                              "--max-points must be >= 2")):
        done = subprocess.run([sys.executable, str(PDBENCH), "search", "--base-url", "http://127.0.0.1:9", *flags],
                              capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        assert done.returncode == 2 and complaint in done.stderr, (flags, done.stderr)


# ---------------------------------------------------------------- against pdserve


@pytest.fixture(scope="module")
def server(module_procs):
    return start_pdserve(module_procs, "--model", "builtin:tiny")


def test_search_measures_plateaus_with_checks_intervals_and_server_counters(server, tmp_path):
    out = tmp_path / "search.json"
    done = subprocess.run(
        [sys.executable, str(PDBENCH), "search", "--base-url", server.base_url, "--rate-lo", "4", "--rate-hi", "8",
         "--min-requests", "24", "--lifetime-factor", "1", "--lead-s", "0.5", "--hold-s", "0.5",
         "--probe-requests", "2", "--input-len", "16", "--output-len", "4", "--slo-ttft-ms", "60000",
         "--slo-itl-ms", "60000", "--metrics-interval-s", "0.5", "--bootstrap-resamples", "200",
         "--save-requests", "--json-out", str(out), "--quiet"],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr + done.stdout
    doc = json.loads(out.read_text())
    assert doc["kind"] == "search" and doc["pdbench"]["format_version"] == 2
    assert doc["probe"]["mean_lifetime_s"] > 0
    # Both ends pass a loose SLO: the crossing lies above the range and the search stops after two.
    assert [r["request_rate"] for r in doc["runs"]] == [4.0, 8.0]
    assert doc["search"]["stopped"] == "decided" and doc["search"]["lowest_failing_rate"] is None
    for run in doc["runs"]:
        plateau = run["plateau"]
        assert plateau["lead_s"] >= 0.5 and plateau["hold_s"] >= 0.5
        assert plateau["lead_s"] >= plateau["lifetime_estimate_s"] > 0
        measured = [r for r in run["requests"] if not r["warmup"]]
        assert len(measured) == run["num_requests"] >= 24
        assert run["realised_rate"] == pytest.approx(len(measured) / plateau["window_s"])
        assert all(plateau["lead_s"] <= r["scheduled_s"] < plateau["lead_s"] + plateau["window_s"] for r in measured)
        little = run["littles_law"]
        assert little["mean_in_flight"] > 0 and little["expected"] > 0 and "holds" in little
        assert run["steady_state"] == (little["holds"] and plateau["hold_covers_lifetime"])
        assert run["slo"]["ttft_tpot"]["attainment"] == 1.0 and run["slo"]["ttft_tpot"]["interval"] == [1.0, 1.0]
        (window,) = run["server_metrics"].values()
        assert set(window["counters"]) == set(WINDOW_COUNTERS)
        assert window["counters"]["pd_preemptions_total"] == 0.0
        assert window["counters"]["pd_recomputed_tokens_total"] == 0.0
        assert window["gauges"]["pd_kv_blocks_used"]["max"] >= 0 and window["num_samples"] >= 2
    assert doc["goodput"]["ttft_tpot"]["bound"] == "at_least_highest"
    assert doc["goodput"]["ttft_tpot"]["value"] == max(r["realised_rate"] for r in doc["runs"])
    assert "Little's law" in done.stdout
