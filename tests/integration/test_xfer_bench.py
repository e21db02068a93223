"""xferbench over UCX on this machine: two processes, every transfer byte-exact verified.

A smoke run of the benchmark with a tiny KV shape, so that CI exercises the tool, the
engine's UCX path between two processes and the verification protocol. Performance
figures live in docs/perf/xfer.md, not here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import bin_path


def run_xferbench(*flags: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    argv = [str(bin_path("xferbench")), *flags]
    # Own process group: on a timeout the forked target dies with the initiator.
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"xferbench ran past {timeout_s} s:\n{out}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, None)


def parse_json(text: str) -> dict:
    start = text.index("{")
    end = text.rindex("}")
    return json.loads(text[start:end + 1])


TINY_KV = ["--layers", "2", "--prompt-tokens", "64", "--small-ops", "256", "--iters", "2", "--warmup", "1"]


@pytest.mark.timeout(180)
def test_ucx_two_process_batches_are_byte_exact_and_reported_beside_perftest():
    if shutil.which("ucx_perftest") is None:
        pytest.skip("ucx_perftest (Debian ucx-utils) is not installed")
    result = run_xferbench("--backend", "ucx", *TINY_KV, "--json")
    assert result.returncode == 0, result.stdout
    report = parse_json(result.stdout)
    assert report["all_verified_byte_exact"] is True
    names = [s["name"] for s in report["scenarios"]]
    # "mixed": odd sizes at unaligned offsets, some mergeable (byte paths and merging, not a target).
    assert names == ["contiguous", "kv", "kv_layers", "small_4k", "mixed"]
    for scenario in report["scenarios"]:
        assert scenario["error"] == ""
        assert scenario["mismatched_bytes"] == 0
        assert scenario["verified_iterations"] == 3
        assert scenario["gbps"] > 0
        assert scenario["reference"].startswith("ucx_perftest")
    kv_layers = next(s for s in report["scenarios"] if s["name"] == "kv_layers")
    assert kv_layers["batches"] == 2 and kv_layers["ops"] == 2 * 4


@pytest.mark.timeout(180)
def test_ucx_over_tcp_with_registered_malloc_memory_is_byte_exact():
    result = run_xferbench("--backend", "ucx", "--ucx-tls", "tcp", "--host-malloc", "--scenarios", "kv,kv_layers",
                           "--no-b2b", *TINY_KV, "--perftest", "/nonexistent/ucx_perftest", "--json")
    # The reference is missing on purpose: the transfers must still be verified exact.
    report = parse_json(result.stdout)
    assert report["all_verified_byte_exact"] is True, result.stdout
    assert result.returncode == 0, result.stdout


@pytest.mark.timeout(180)
def test_ucx_staging_protocol_between_two_processes_is_byte_exact():
    # Host memory registered as GPU memory: the staging protocol (chunks, buffers, acks)
    # moves it, with memcpy as the device copy (what a GPU machine does with cudaMemcpy).
    result = run_xferbench("--backend", "ucx", "--memory", "staged-host", *TINY_KV, "--no-b2b",
                           "--perftest", "/nonexistent/ucx_perftest", "--json")
    report = parse_json(result.stdout)
    assert report["all_verified_byte_exact"] is True, result.stdout
    assert result.returncode == 0, result.stdout
    assert report["memory"] == "staged-host"
    assert [s["verified_iterations"] for s in report["scenarios"]] == [3] * 5


def can_make_network_namespaces() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    return subprocess.run(["ip", "netns", "list"], capture_output=True, timeout=10).returncode == 0


@pytest.mark.timeout(240)
def test_ucx_tcp_between_network_namespaces_goes_over_the_veth_beside_perftest():
    if not can_make_network_namespaces():
        pytest.skip("needs root and ip netns to build two namespaces joined by a veth")
    script = Path(__file__).resolve().parents[2] / "tools" / "xferbench" / "netns_bench.sh"
    perftest = shutil.which("ucx_perftest") or "/nonexistent/ucx_perftest"
    argv = ["bash", str(script), str(bin_path("xferbench")), *TINY_KV, "--scenarios", "kv,kv_layers", "--no-b2b",
            "--perftest", perftest, "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=200)
    report = parse_json(proc.stdout)
    assert report["all_verified_byte_exact"] is True, proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Our session travels over TCP on the veth (netns_bench.sh names it xbh<pid>), nothing else.
    assert report["transports"].startswith("tcp/xbh") and "," not in report["transports"], report["transports"]
    if perftest != "/nonexistent/ucx_perftest":
        assert all(s["reference_gbps"] > 0 for s in report["scenarios"]), proc.stdout
