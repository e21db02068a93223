"""pdrouter's HTTP edge against oversized, hostile or odd input. No engine is needed: the router
answers these itself. Body size limit (413, --max-body-bytes), deeply nested JSON (400, the
router survives), non-UTF-8 request paths (404) and registrations (refused and counted;
/health and /v1/models keep answering), connections beyond --max-connections (503)."""

from __future__ import annotations

import json
import socket

import msgpack

from conftest import (assert_accept_survives_fd_exhaustion, bin_path, metric_value, open_keep_alive_connection,
                      wait_for)
from router_fixtures import Heartbeat, Registrar, registration_record, start_router

MIB = 1024 * 1024


def json_body_of_size(num_bytes: int) -> bytes:
    """A valid completions body of exactly num_bytes bytes."""
    head, tail = b'{"prompt":"', b'"}'
    return head + b"a" * (num_bytes - len(head) - len(tail)) + tail


def raw_exchange(router, request: bytes, timeout_s: float = 30.0) -> bytes:
    """Sends raw request bytes and reads until the router closes the connection."""
    with socket.create_connection((router.host, router.port), timeout=timeout_s) as sock:
        sock.sendall(request)
        received = b""
        while True:
            data = sock.recv(65536)
            if not data:
                return received
            received += data


def assert_openai_error(body: bytes, code: str) -> dict:
    """pdserve's error shape: OpenAI's nested object with a string code."""
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == code and error["message"], error
    return error


def test_body_over_the_default_limit_of_8_mib_is_413(procs):
    router = start_router(procs)  # no instance: a body within the limit gets the router's 503
    status, body, _ = router.post("/v1/completions", json_body_of_size(8 * MIB + 1), timeout_s=60)
    assert status == 413
    assert "8388608" in assert_openai_error(body, "request_too_large")["message"]
    status, body, _ = router.post("/v1/completions", json_body_of_size(8 * MIB), timeout_s=60)
    assert status == 503, body[:200]
    assert router.metric("pd_router_requests_total", {"route": "invalid", "status": "413"}) == 1


def test_max_body_bytes_flag_sets_the_limit(procs):
    router = start_router(procs, "--max-body-bytes", "4096")
    status, body, _ = router.post("/v1/completions", json_body_of_size(4097))
    assert status == 413
    assert_openai_error(body, "request_too_large")
    assert router.post("/v1/completions", json_body_of_size(4096))[0] == 503


def test_max_body_bytes_below_1024_is_refused_at_startup(procs):
    managed = procs.spawn([bin_path("pdrouter"), "--port", "0", "--registration-port", "0", "--max-body-bytes", "100"])
    assert managed.proc.wait(timeout=30) != 0


def test_deeply_nested_body_is_400_and_the_router_survives(procs):
    router = start_router(procs)
    # A collocated instance (nothing listens there): the body would be re-serialised for it,
    # since the router removes the client's kv_transfer_params.
    heartbeat = Heartbeat(router.registration_port,
                          registration_record("c0", "both", "127.0.0.1:9", control="127.0.0.1:10"))
    try:
        router.wait_for_instances(1)
        levels = 1_000_000
        body = (b'{"prompt":"a","kv_transfer_params":{},"x":' + b"[" * levels + b"]" * levels + b"}")
        status, answer, _ = router.post("/v1/completions", body, timeout_s=60)
        assert status == 400
        assert "deeper than 64" in assert_openai_error(answer, "invalid_value")["message"]
        assert router.get("/health")[0] == 200, "the router is still up"
    finally:
        heartbeat.stop()


def test_non_utf8_request_path_is_a_404(procs):
    router = start_router(procs)
    answer = raw_exchange(router, b"GET /v1/\xff\xfe HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 404"), answer[:200]
    assert_openai_error(body, "not_found")
    assert router.get("/health")[0] == 503, "the router is still up"


def test_non_utf8_registration_is_refused_and_health_and_models_keep_answering(procs):
    router = start_router(procs)
    registrar = Registrar(router.registration_port)
    try:
        bad = registration_record("bad", "consumer", "127.0.0.1:12", control="127.0.0.1:13")
        # use_bin_type=False packs bytes as a msgpack str, so the model is a str holding invalid UTF-8.
        registrar.send_frames([msgpack.packb({**bad, "model": b"tiny-\xff"}, use_bin_type=False)])
        wait_for(lambda: router.metric("pd_router_registrations_malformed_total") == 1, 10,
                 "the non-UTF-8 registration counted as malformed")
        assert router.instance_ids() == set()
        registrar.send_record(registration_record("good", "consumer", "127.0.0.1:14", control="127.0.0.1:15",
                                                  model="caf\u00e9-\u6a21\u578b"))
        wait_for(lambda: router.instance_ids() == {"good"}, 10, "a UTF-8 model name admitted")
        status, body, _ = router.get("/v1/models")
        assert status == 200
        assert [m["id"] for m in json.loads(body)["data"]] == ["caf\u00e9-\u6a21\u578b"]
        assert router.get("/health")[0] == 200
    finally:
        registrar.close()


def test_connections_beyond_max_connections_get_503_until_one_closes(procs):
    # The contract: the cap counts open client connections, and one beyond it is answered 503 before
    # its request is read, so while the cap is reached /health is refused too. Connections already
    # open keep being served. (No instance: /v1/models answers 200 with an empty list.)
    router = start_router(procs, "--max-connections", "4")
    idle = [open_keep_alive_connection(router, "/v1/models") for _ in range(4)]
    status, body, headers = router.post("/v1/completions", {"model": "m", "prompt": "a"})
    assert status == 503 and headers.get("Retry-After") == "1"
    assert "--max-connections" in assert_openai_error(body, "too_many_connections")["message"]
    status, body, headers = router.get("/health")
    assert status == 503 and headers.get("Retry-After") == "1"
    assert "--max-connections" in assert_openai_error(body, "too_many_connections")["message"]

    idle[0].request("GET", "/v1/models")
    response = idle[0].getresponse()
    response.read()
    assert response.status == 200, "a connection opened before the cap was reached is still served"

    idle.pop().close()
    def models_answered():
        try:
            return router.get("/v1/models", timeout_s=5)[0] == 200
        except OSError:
            return False
    wait_for(models_answered, 10, "a new connection admitted once an idle one closed")
    for conn in idle:
        conn.close()

    def refused_connections():
        try:
            status, body, _ = router.get("/metrics", timeout_s=5)
        except OSError:
            return None
        return status == 200 and metric_value(body.decode(), "pd_router_connections_refused_total")
    assert wait_for(refused_connections, 10, "/metrics with the refusals counted") >= 2
    wait_for(lambda: "answering new ones 503" in router.process.text(), 10, "the refusals logged")


def test_max_connections_beyond_the_open_file_limit_is_refused_at_startup(procs):
    managed = procs.spawn([bin_path("pdrouter"), "--port", "0", "--registration-port", "0",
                           "--max-connections", "16000000"])
    assert managed.proc.wait(timeout=30) != 0
    wait_for(lambda: "--max-connections 16000000 needs" in managed.text(), 10, "the reason on stderr")


def test_accept_loop_survives_running_out_of_file_descriptors(procs):
    router = start_router(procs)  # no instance: /v1/models answers 200 with an empty list
    assert_accept_survives_fd_exhaustion(router, router.process, "/v1/models")
    assert router.get("/v1/models")[0] == 200
