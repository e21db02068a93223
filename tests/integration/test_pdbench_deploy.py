"""tools/pdbench/deploy.py: a whole deployment (router + instances) around a command."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import bin_path

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "tools" / "pdbench" / "deploy.py"
PDBENCH = ROOT / "tools" / "pdbench" / "pdbench.py"


def deploy(*args: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DEPLOY), "--bin-dir", str(Path(bin_path("pdserve")).parent), *args],
                          capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("config", ["pd-write", "pd-read"])
def test_pd_deployment_moves_kv_and_ends_clean(config, tmp_path):
    proc = deploy("--config", config, "--log-dir", str(tmp_path), "--",
                  sys.executable, str(PDBENCH), "run", "--base-url", "{url}", "--max-concurrency", "4",
                  "--num-requests", "8", "--input-len", "40", "--output-len", "4", "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    moved = [int(m.replace(",", "")) for m in re.findall(r"KV bytes moved ([0-9,]+)", proc.stderr)]
    assert len(moved) == 2 and sum(moved) > 0, proc.stderr
    assert re.findall(r"KV blocks in use (\d+)", proc.stderr) == ["0", "0"]
    assert (tmp_path / "producer.log").stat().st_size > 0 and (tmp_path / "consumer.log").stat().st_size > 0
    # Through pdrouter, every consumer request took the producer's first token (no logprobs asked for).
    assert re.findall(r"consumer: .*first tokens handed over (\d+)", proc.stderr) == ["8"], proc.stderr


def test_kv_extra_reaches_the_instances_and_can_switch_the_hand_over_off(tmp_path):
    proc = deploy("--config", "pd-write", "--log-dir", str(tmp_path), "--kv-extra", '{"first_token_handover": false}',
                  "--", sys.executable, str(PDBENCH), "run", "--base-url", "{url}", "--max-concurrency", "4",
                  "--num-requests", "8", "--input-len", "40", "--output-len", "4", "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "first tokens handed over" not in proc.stderr, proc.stderr
    assert re.findall(r"KV blocks in use (\d+)", proc.stderr) == ["0", "0"]
    bad = deploy("--config", "pd-write", "--kv-extra", "[1]", "--", "true")
    assert bad.returncode != 0 and "--kv-extra must be a JSON object" in bad.stderr


def test_collocated_deployment_passes_the_command_status_through(tmp_path):
    ok = deploy("--config", "collocated", "--num-collocated", "2", "--log-dir", str(tmp_path), "--",
                sys.executable, "-c", "import os, sys, urllib.request; "
                "urllib.request.urlopen(os.environ['PDBENCH_URL'] + '/v1/models', timeout=10); sys.exit(3)")
    assert ok.returncode == 3, ok.stderr[-3000:]
    assert len(re.findall(r"collocated\d: KV blocks in use 0", ok.stderr)) == 2


def _consumer_counts(stderr: str) -> tuple[int, int]:
    (match,) = re.findall(r"consumer: .*preemptions (\d+), remote admissions deferred (\d+)", stderr)
    return int(match[0]), int(match[1])


def test_a_consumer_short_of_kv_defers_admissions_instead_of_preempting(tmp_path):
    # 40 blocks of 16 tokens on the consumer; a request needs 4 for its prompt and 8 at its end,
    # and 16 arrive at once. With the reserve (the default) at most 5 hold blocks; without it
    # 10 prompts fit, their decodes outgrow the cache and received prompts are recomputed.
    bench = [sys.executable, str(PDBENCH), "run", "--base-url", "{url}", "--max-concurrency", "16",
             "--num-requests", "32", "--input-len", "64", "--output-len", "64", "--quiet"]
    reserved = deploy("--config", "pd-write", "--log-dir", str(tmp_path / "reserved"), "--consumer-args",
                      "--num-kv-blocks 40", "--", *bench)
    assert reserved.returncode == 0, reserved.stderr[-3000:]
    preemptions, deferred = _consumer_counts(reserved.stderr)
    assert preemptions == 0 and deferred > 0, reserved.stderr[-2000:]
    unreserved = deploy("--config", "pd-write", "--log-dir", str(tmp_path / "unreserved"), "--consumer-args",
                        "--num-kv-blocks 40 --remote-output-reserve -1", "--", *bench)
    assert unreserved.returncode == 0, unreserved.stderr[-3000:]
    preemptions, deferred = _consumer_counts(unreserved.stderr)
    assert preemptions > 0 and deferred == 0, unreserved.stderr[-2000:]


def test_metrics_args_name_the_router_and_every_instance(tmp_path):
    proc = deploy("--config", "collocated", "--num-collocated", "2", "--log-dir", str(tmp_path), "--",
                  sys.executable, "-c", "import sys; print('ARGS', sys.argv[1:])", "{metrics_args}", "{url}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("ARGS")]
    args = ast.literal_eval(line[len("ARGS "):])  # the list the child printed
    assert args[0:6:2] == ["--metrics-url"] * 3 and len(args) == 7
    router, *instances = args[1:6:2]
    assert args[6] == router and len(set(instances)) == 2 and router not in instances
    assert all(re.fullmatch(r"http://127\.0\.0\.1:\d+", url) for url in args[1:7:2])
    # Inside a longer argument (a bash -c line) it becomes text.
    proc = deploy("--config", "collocated", "--num-collocated", "2", "--log-dir", str(tmp_path), "--",
                  "bash", "-c", "echo LINE {url} {metrics_args}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("LINE")]
    words = line.split()[1:]
    assert len(words) == 7 and words[1:7:2] == ["--metrics-url"] * 3 and words[2] == words[0]


def test_missing_command_and_bad_model_are_clear_errors(tmp_path):
    usage = deploy("--config", "pd-write")
    assert usage.returncode == 2 and "give the command to run" in usage.stderr
    bad = deploy("--config", "pd-write", "--model", str(tmp_path / "no-such-model"), "--log-dir", str(tmp_path),
                 "--ready-timeout-s", "60", "--", "true")
    assert bad.returncode == 1 and "exited with" in bad.stderr and "before it was ready" in bad.stderr
