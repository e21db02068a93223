"""pdrouter with instances that do not answer as they should, next to a real pdserve on CPU: an
engine's /tokenize is bounded by --tokenize-timeout-ms from connect to answer and its answer by size,
and GET /v1/models and /version ask every instance at once under one deadline (--info-timeout-ms),
leaving out those that do not answer in time.

The misbehaving instances are registered with the router's own registration protocol (Heartbeat) and
point at sockets of this test: one whose connects hang (its listen backlog is full), one that accepts and
never answers, and one that answers /tokenize with an oversized body."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest

from conftest import start_pdserve, wait_for
from router_fixtures import TINY_MODEL, Heartbeat, pdserve_flags, registration_record, start_router

CONNECT_TIMEOUT_MS = 4000
TOKENIZE_TIMEOUT_MS = 300
INFO_TIMEOUT_MS = 500
# A bound of the answers below that the old behaviour (a connect of CONNECT_TIMEOUT_MS, or one per
# instance in turn) cannot meet.
ANSWER_WITHIN_S = 2.5


class HangingConnects:
    """A listening socket whose accept queue is full: a connect to it gets no answer (SYN dropped)."""

    def __init__(self):
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(0)
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.filler = socket.create_connection(self.server.getsockname(), timeout=2)

    def close(self):
        self.filler.close()
        self.server.close()


class NeverAnswers:
    """Accepts connections (the kernel does, from the backlog) and never answers a request."""

    def __init__(self):
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(64)
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"

    def close(self):
        self.server.close()


class OversizedTokenizeAnswer:
    """Answers POST /tokenize with a valid answer padded past the router's 16 MiB bound."""

    BODY = b'{"tokens": [1], "count": 1' + b" " * (17 << 20) + b"}"

    def __init__(self):
        body = self.BODY

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", "0")))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def deployment(module_procs):
    router = start_router(module_procs, "--connect-timeout-ms", str(CONNECT_TIMEOUT_MS), "--tokenize-timeout-ms",
                          str(TOKENIZE_TIMEOUT_MS), "--info-timeout-ms", str(INFO_TIMEOUT_MS))
    engine = start_pdserve(module_procs, "--kv-role", "kv_both", *pdserve_flags("both", router=router))
    # Its prefix cache is known, so a scored placement asks for the prompt's tokens.
    wait_for(lambda: any(i.get("kv_cached_blocks") is not None for i in router.instances()), 20,
             "the engine's load report and cache view")
    stand_ins, heartbeats = [], []

    def register(instance_id: str, stand_in):
        stand_ins.append(stand_in)
        heartbeats.append(Heartbeat(router.registration_port,
                                    registration_record(instance_id, "consumer", stand_in.address), period_s=0.5))
        wait_for(lambda: instance_id in router.instance_ids(), 10, f"{instance_id} registered")

    yield router, engine, register
    for heartbeat in heartbeats:
        heartbeat.stop()
    for stand_in in stand_ins:
        stand_in.close()


def tokenize_failures(router) -> float:
    return router.metric("pd_router_tokenize_failures_total")


def complete(router):
    client = openai.OpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
    started = time.monotonic()
    out = client.completions.create(model=TINY_MODEL, prompt="Tell me about the sea", max_tokens=2)
    return out, time.monotonic() - started


# The stand-ins' ids sort before the engine's, so each is the first instance asked for a prompt's tokens
# (the least busy instance that decodes; ties go to the first); with no producer, the engine serves.

def test_a_tokenize_connect_that_hangs_ends_at_the_tokenize_deadline(deployment):
    router, engine, register = deployment
    register("0-hanging-connects", HangingConnects())
    before = tokenize_failures(router)
    out, elapsed = complete(router)
    assert out.usage.completion_tokens == 2
    assert tokenize_failures(router) == before + 1
    assert elapsed < ANSWER_WITHIN_S, f"{elapsed:.2f}s: the connect waited --connect-timeout-ms"


def test_an_oversized_tokenize_answer_is_not_read(deployment):
    router, engine, register = deployment
    register("0+oversized-tokenize", OversizedTokenizeAnswer())
    before = tokenize_failures(router)
    out, _ = complete(router)
    assert out.usage.completion_tokens == 2
    assert tokenize_failures(router) == before + 1


def test_models_and_version_ask_every_instance_at_once_under_one_deadline(deployment):
    router, engine, register = deployment
    for i in range(3):
        register(f"0-never-answers-{i}", NeverAnswers())
    before = router.metric("pd_router_fanout_unanswered_total", {"route": "/v1/models"})
    started = time.monotonic()
    status, body, _ = router.get("/v1/models")
    elapsed = time.monotonic() - started
    assert status == 200
    entry = next(m for m in json.loads(body)["data"] if m["id"] == TINY_MODEL)
    # The engine's own entry, although instances of the same model before it never answer.
    assert entry["max_model_len"] == 2048
    assert elapsed < ANSWER_WITHIN_S
    # The three that never answer, the hanging one and the one without /v1/models are left out.
    assert router.metric("pd_router_fanout_unanswered_total", {"route": "/v1/models"}) == before + 5

    started = time.monotonic()
    status, body, _ = router.get("/version")
    assert status == 200
    assert json.loads(body) == json.loads(engine.get("/version")[1])
    assert time.monotonic() - started < ANSWER_WITHIN_S
