"""tools/pdbench/capacity_model.py: the steady-state model against the session-4 measurements
it was calibrated on (docs/perf/goodput.md) and its own invariants. Pure Python, no server."""

import subprocess
import sys
from pathlib import Path

import pytest

TOOL_DIR = Path(__file__).resolve().parents[2] / "tools" / "pdbench"
sys.path.insert(0, str(TOOL_DIR))

import capacity_model as cm  # noqa: E402

COSTS = cm.StepCosts()
WORKLOAD = cm.Workload()


def test_matches_the_measured_tpot_at_two_req_per_s():
    # Measured TPOT p50 at 2 req/s on 2xH200 (goodput.md, 2026-11-30 22:50–23:18 UTC), windows followed by higher rates.
    measured = {("c", 256): 28.5, ("c", 512): 30.8, ("c", 2048): 32.7, ("pd", 1): 32.0}
    for (kind, arg), tpot in measured.items():
        point = (cm.collocated(COSTS, WORKLOAD, 2, arg, 2.0) if kind == "c"
                 else cm.disaggregated(COSTS, WORKLOAD, 1, 1, 2.0))
        assert point.limit == ""
        assert point.tpot_ms == pytest.approx(tpot, rel=0.05), (kind, arg)


def test_one_to_one_split_runs_out_of_consumer_kv_first():
    rate = cm.saturation_rate(lambda r: cm.disaggregated(COSTS, WORKLOAD, 1, 1, r))
    # Measured: 90 % of requests within SLO up to 2.35 req/s; the mean request leaves it a little later.
    assert 2.35 <= rate <= 3.0
    assert cm.disaggregated(COSTS, WORKLOAD, 1, 1, rate * 1.01).limit == "KV"


def test_model_orders_the_two_gpu_configurations_as_measured():
    def sat(point_at, strict=False):
        return cm.saturation_rate(point_at, strict=strict, itl_slo_ms=WORKLOAD.itl_slo_ms)

    c256 = sat(lambda r: cm.collocated(COSTS, WORKLOAD, 2, 256, r))
    c2048 = sat(lambda r: cm.collocated(COSTS, WORKLOAD, 2, 2048, r))
    pd = sat(lambda r: cm.disaggregated(COSTS, WORKLOAD, 1, 1, r))
    assert c256 > c2048 > pd
    # Strict (every regular gap within 50 ms): a 2,048- or 512-token chunk never fits, 256 does.
    assert sat(lambda r: cm.collocated(COSTS, WORKLOAD, 2, 2048, r), strict=True) == 0.0
    assert sat(lambda r: cm.collocated(COSTS, WORKLOAD, 2, 512, r), strict=True) == 0.0
    assert sat(lambda r: cm.collocated(COSTS, WORKLOAD, 2, 256, r), strict=True) > pd


def test_tpot_and_ttft_grow_with_rate():
    for point_at in (lambda r: cm.collocated(COSTS, WORKLOAD, 2, 512, r),
                     lambda r: cm.disaggregated(COSTS, WORKLOAD, 1, 3, r)):
        points = [point_at(r) for r in (0.5, 1.0, 2.0, 3.0)]
        assert all(a.tpot_ms < b.tpot_ms for a, b in zip(points, points[1:]))
        assert all(a.ttft_ms <= b.ttft_ms for a, b in zip(points, points[1:]))


def test_single_producer_bounds_one_to_three():
    # One producer prefills 2,000 tokens in 220 ms: utilisation reaches 1 at 4.55 req/s, and the
    # queue pushes TTFT past 1 s before that.
    rate = cm.saturation_rate(lambda r: cm.disaggregated(COSTS, WORKLOAD, 1, 3, r))
    assert 3.5 < rate < 1000.0 / 220.0
    assert cm.disaggregated(COSTS, WORKLOAD, 1, 3, rate * 1.01).limit == "TTFT"
    assert cm.disaggregated(COSTS, WORKLOAD, 1, 3, 4.6).limit is None  # no steady state


def test_unmeasured_budget_is_refused():
    with pytest.raises(ValueError, match="no measured chunk cost for budget 384"):
        cm.collocated(COSTS, WORKLOAD, 2, 384, 1.0)
    proc = subprocess.run([sys.executable, str(TOOL_DIR / "capacity_model.py"), "--budgets", "384"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "no measured chunk cost" in proc.stderr


def test_cli_table():
    proc = subprocess.run([sys.executable, str(TOOL_DIR / "capacity_model.py"), "--gpus", "4", "--at", "2"],
                          capture_output=True, text=True, check=True)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("4 GPUs, ISL 2000, OSL 1000")
    names = [line.split("  ")[0] for line in lines[2:] if not line.startswith(" ")]
    assert names == ["collocated x4, budget 256", "collocated x4, budget 512", "collocated x4, budget 2048",
                     "P/D 1P:3D", "P/D 2P:2D", "P/D 3P:1D"]
    assert sum("at 2 req/s" in line for line in lines) == 6


def test_collocated_prefill_queues_and_ttft_grows_faster_than_the_service():
    points = [cm.collocated(COSTS, WORKLOAD, 2, 256, r) for r in (0.5, 1.5, 2.5, 3.0)]
    # The prompt's service (its chunk steps) grows only with the decode step; the M/D/1 wait in
    # front of it grows with the utilisation, so TTFT more than doubles from 0.5 to 3 req/s.
    assert points[-1].ttft_ms > 2.0 * points[0].ttft_ms
    assert all(a.ttft_ms < b.ttft_ms for a, b in zip(points, points[1:]))
    rate = cm.saturation_rate(lambda r: cm.collocated(COSTS, WORKLOAD, 2, 256, r))
    assert cm.collocated(COSTS, WORKLOAD, 2, 256, rate * 1.01).limit == "TTFT"  # the queue, not TPOT


def test_decodes_share_the_chunk_budget():
    # More running requests leave fewer prompt tokens per step: a smaller chunk step (shorter
    # longest gap) and more of them per prompt.
    low, high = (cm.collocated(COSTS, WORKLOAD, 2, 256, r) for r in (0.5, 3.0))
    assert high.running_per_gpu > low.running_per_gpu
    assert high.worst_gap_ms - _decode_part(high) < low.worst_gap_ms - _decode_part(low)
    # When the decodes take the whole budget no prompt advances: no steady state.
    small = cm.StepCosts(chunk_extra_ms=((64, 4.0),))
    assert cm.collocated(small, WORKLOAD, 2, 64, 0.5).limit == ""
    assert cm.collocated(small, WORKLOAD, 2, 64, 4.0).limit is None


def _decode_part(point) -> float:
    return cm._decode_ms(COSTS, point.running_per_gpu, WORKLOAD.isl + WORKLOAD.osl / 2.0)
