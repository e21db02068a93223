"""pdserve as a process: flags, authentication, start-up errors and clean shutdown."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
import signal
import socket
import subprocess
import time

import openai
import pytest

from conftest import (assert_accept_survives_fd_exhaustion, bin_path, metric_value, open_keep_alive_connection,
                      start_pdserve, wait_for)


def run_to_exit(*flags: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(bin_path("pdserve")), "--port", "0", *flags], capture_output=True, text=True,
                          timeout=timeout_s, stdin=subprocess.DEVNULL)


def test_help_lists_vllm_flags():
    result = run_to_exit("--help")
    assert result.returncode == 0
    for flag in ["--model", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--block-size",
                 "--gpu-memory-utilization", "--tensor-parallel-size", "--load-format", "--served-model-name",
                 "--api-key", "--kv-transfer-config"]:
        assert flag in result.stdout


@pytest.mark.parametrize("flags, needle", [
    (["--tensor-parallel-size", "2", "--device", "cuda", "--kv-role", "kv_producer"],
     "--tensor-parallel-size 2 with --device cuda and --kv-transfer-config"),
    (["--tensor-parallel-size", "3"], "must divide the number of attention heads (4)"),
    (["--kv-transfer-config", "{not json"], "--kv-transfer-config must be a JSON object"),
    (["--model", "/nonexistent/model/dir"], "/nonexistent/model/dir"),
    (["--no-such-flag"], "no-such-flag"),
    (["--max-connections", "0"], "--max-connections must be"),
    # More than any open-file limit allows (Linux caps RLIMIT_NOFILE at fs.nr_open, 1048576 by default).
    (["--max-connections", "16000000"], "--max-connections 16000000 needs"),
])
def test_bad_start_up_flags_exit_non_zero_with_a_clear_message(flags, needle):
    result = run_to_exit(*flags)
    assert result.returncode != 0
    assert needle in result.stdout + result.stderr


def test_api_key_guards_v1_routes_only(procs):
    server = start_pdserve(procs, "--model", "builtin:tiny", "--api-key", "s3cret", "--max-model-len", "128")
    denied = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        denied.completions.create(model="builtin:tiny", prompt="a", max_tokens=1)
    allowed = openai.OpenAI(base_url=server.base_url + "/v1", api_key="s3cret", max_retries=0, timeout=30)
    out = allowed.completions.create(model="builtin:tiny", prompt="a", max_tokens=2, temperature=0)
    assert out.usage.prompt_tokens >= 1
    assert server.get("/health")[0] == 200  # health stays open for load balancers
    assert server.get("/v1/models")[0] == 401


def test_sigterm_with_a_live_stream_shuts_down_cleanly(procs):
    server = start_pdserve(procs, "--model", "builtin:tiny", "--max-model-len", "4096")
    sock = socket.create_connection((server.host, server.port), timeout=30)
    body = json.dumps({"model": "builtin:tiny", "prompt": "long", "max_tokens": 4000, "stream": True,
                       "ignore_eos": True})
    sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
    received = b""
    while b"data: " not in received:
        data = sock.recv(65536)
        assert data
        received += data
    server.process.proc.send_signal(signal.SIGTERM)
    # The stream ends (the request is aborted) and the process exits 0.
    sock.settimeout(30)
    while True:
        data = sock.recv(65536)
        if not data:
            break
        received += data
    sock.close()
    assert server.process.proc.wait(timeout=30) == 0, server.process.text()
    # The aborted request's last event says so, and the stream is closed properly.
    assert b'"finish_reason":"abort"' in received
    assert b"data: [DONE]" in received
    assert "pdserve stopped" in server.process.text()


def test_port_zero_prints_the_real_port(procs):
    server = start_pdserve(procs, "--model", "builtin:tiny", "--max-model-len", "128")
    assert server.port > 0
    assert f"listening on http://127.0.0.1:{server.port}" in server.process.text()
    wait_for(server.healthy, 10, "health")


def open_stream(server, prompt: str, max_tokens: int) -> socket.socket:
    """Sends a raw streaming completion; the caller closes the socket (which aborts the request)."""
    sock = socket.create_connection((server.host, server.port), timeout=30)
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True})
    sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
    return sock


def test_full_engine_queue_answers_503_and_recovers(procs):
    server = start_pdserve(procs, "--model", "builtin:tiny", "--max-model-len", "4096", "--max-num-seqs", "1",
                           "--max-waiting-requests", "1")
    running = open_stream(server, "first", 4000)
    wait_for(lambda: metric_value(server.metrics(), "pd_num_requests_running") == 1, 30, "one running request")
    waiting = open_stream(server, "second", 4000)
    wait_for(lambda: metric_value(server.metrics(), "pd_num_requests_waiting") == 1, 30, "one waiting request")
    status, raw, _ = server.post("/v1/completions", {"prompt": "third", "max_tokens": 4})
    assert status == 503, raw
    assert json.loads(raw)["error"]["type"] == "service_unavailable"
    running.close()
    waiting.close()
    wait_for(lambda: metric_value(server.metrics(), "pd_kv_blocks_used") == 0
             and metric_value(server.metrics(), "pd_num_requests_waiting") == 0, 30, "the queue to drain")
    status, raw, _ = server.post("/v1/completions", {"prompt": "fourth", "max_tokens": 4})
    assert status == 200, raw


def test_model_without_tokenizer_streams_a_chunk_per_token(procs):
    # tests/data/golden/qwen3 holds config + safetensors and no tokenizer: only token-id
    # prompts work, the text is empty, and each step must still reach the client as a chunk.
    model_dir = Path(__file__).resolve().parents[1] / "data" / "golden" / "qwen3"
    server = start_pdserve(procs, "--model", str(model_dir))
    body = {"model": str(model_dir), "prompt": [11, 12, 13, 14], "max_tokens": 6, "ignore_eos": True,
            "stream": True, "temperature": 0}
    req = urllib.request.Request(
        f"{server.base_url}/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as response:
        events = [line[6:] for line in response.read().decode().splitlines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    with_choices = [c for c in chunks if c.get("choices")]
    # One chunk per generated token (the last one also carries finish_reason).
    assert len(with_choices) == 6, chunks
    assert with_choices[-1]["choices"][0]["finish_reason"] == "length"


def test_connections_beyond_max_connections_get_503_until_one_closes(procs):
    # The contract: the cap counts open connections, and one beyond it is answered 503 before its
    # request is read, so while the cap is reached /health is refused too (a load balancer sees
    # the instance as full, which it is). Connections already open keep being served.
    server = start_pdserve(procs, "--model", "builtin:tiny", "--max-model-len", "128", "--max-connections", "4")
    idle = [open_keep_alive_connection(server, "/health") for _ in range(4)]
    first_refusal_s = time.monotonic()
    status, raw, headers = server.post("/v1/completions", {"prompt": "a", "max_tokens": 1})
    assert status == 503, raw
    assert headers.get("Retry-After") == "1"
    error = json.loads(raw)["error"]
    assert error["type"] == "service_unavailable" and error["code"] == "too_many_connections", error
    assert "--max-connections" in error["message"]
    status, raw, headers = server.get("/health")
    assert status == 503 and headers.get("Retry-After") == "1"
    assert json.loads(raw)["error"]["code"] == "too_many_connections"

    idle[0].request("GET", "/health")
    response = idle[0].getresponse()
    response.read()
    assert response.status == 200, "a connection opened before the cap was reached is still served"

    idle.pop().close()
    wait_for(server.healthy, 10, "a new connection admitted once an idle one closed")
    for conn in idle:
        conn.close()

    def refused_connections():
        try:
            status, body, _ = server.get("/metrics", timeout_s=5)
        except OSError:
            return None
        return status == 200 and metric_value(body.decode(), "pd_http_connections_refused_total")
    assert wait_for(refused_connections, 10, "/metrics with the refusals counted") >= 2
    last_refusal_s = time.monotonic()  # the polls above may have been refused too
    # Logged at most once per second, however many were refused.
    log_lines = wait_for(lambda: [line for line in server.process.text().splitlines()
                                  if "answering new ones 503" in line], 10, "the refusals logged")
    assert len(log_lines) <= 1 + int(last_refusal_s - first_refusal_s), log_lines


def test_accept_loop_survives_running_out_of_file_descriptors(procs):
    server = start_pdserve(procs, "--model", "builtin:tiny", "--max-model-len", "128")
    assert_accept_survives_fd_exhaustion(server, server.process, "/health")
    assert server.healthy()
