"""Hardening of the P/D connector against callers and peers that misbehave, with real producer /
consumer processes on loopback: the explicit release a router calls for a request the consumer
will never take (POST /pd/release), duplicate transfer ids, malformed peer descriptors, dead
producers in READ mode, and the log volume of malformed frames. Every test ends with zero KV blocks
in use on every instance it started."""

from __future__ import annotations

import json
import time

import pytest

from conftest import http_request, wait_for
from test_pd_support import (BYTES_PER_LAYER_BLOCK, assert_no_blocks_in_use, completion, new_transfer_id, pd_generate,
                             start_instance, token_ids)

PROMPT = [101 + (i * 37) % 20000 for i in range(100)]  # 100 tokens: 6 full blocks + a partial one


@pytest.fixture(scope="module")
def plain(module_procs):
    return start_instance(module_procs, None)


def reference(plain, prompt, max_tokens):
    status, body = completion(plain.url, prompt, max_tokens)
    assert status == 200, body
    return token_ids(body)


def producer_leg(producer, transfer_id: str, read_mode: bool):
    params = {"transfer_id": transfer_id, "do_remote_decode": True, "mode": "read" if read_mode else "write"}
    status, body = completion(producer.url, PROMPT, 1, params)
    assert status == 200, body
    return body


def release(instance, body, headers=None):
    status, raw, _ = http_request(instance.url, "POST", "/pd/release", body, headers=headers)
    return status, json.loads(raw) if raw else {}


# ---- POST /pd/release ----------------------------------------------------------------------------

@pytest.mark.parametrize("read_mode", [False, True], ids=["write", "read"])
def test_release_frees_a_held_transfer_at_once(procs, read_mode):
    # Holds would last 60 s (WRITE: defer_timeout; READ: transfer_timeout) without the release.
    producer = start_instance(procs, "kv_producer", read_mode, defer_timeout=60, transfer_timeout=60)
    transfer_id = new_transfer_id()
    producer_leg(producer, transfer_id, read_mode)
    wait_for(lambda: producer.metric("pd_connector_blocks_held") > 0, 5, "producer holds the prompt's blocks")
    assert producer.metric("pd_kv_blocks_used") > 0
    start = time.monotonic()
    status, body = release(producer, {"transfer_id": transfer_id})
    assert status == 200, body
    assert body == {"transfer_id": transfer_id, "released": True}
    # The answer comes after the connector let go: its gauge is zero already.
    assert producer.metric("pd_connector_blocks_held") == 0
    assert_no_blocks_in_use(producer, timeout_s=5)
    assert time.monotonic() - start < 5
    # A second release finds nothing.
    status, body = release(producer, {"transfer_id": transfer_id})
    assert status == 200 and body["released"] is False, body


@pytest.mark.parametrize("read_mode", [False, True], ids=["write", "read"])
def test_release_before_the_producer_leg_makes_that_leg_hold_nothing(procs, read_mode):
    producer = start_instance(procs, "kv_producer", read_mode, defer_timeout=60, transfer_timeout=60)
    transfer_id = new_transfer_id()
    status, body = release(producer, {"transfer_id": transfer_id})
    assert status == 200 and body == {"transfer_id": transfer_id, "released": False}, body
    body = producer_leg(producer, transfer_id, read_mode)
    # The prompt was computed, but no KV is held for a consumer: no block ids to read.
    assert "block_ids" not in (body.get("kv_transfer_params") or {}), body
    assert producer.metric("pd_connector_blocks_held") == 0
    assert_no_blocks_in_use(producer, timeout_s=5)


def test_release_refuses_bad_bodies_by_field(procs):
    producer = start_instance(procs, "kv_producer")
    cases = [({}, "transfer_id"), ({"transfer_id": 7}, "transfer_id"), ({"transfer_id": "xyz"}, "transfer_id"),
             ({"transfer_id": "0" * 31}, "transfer_id"), ({"transfer_id": new_transfer_id(), "extra": 1}, "extra")]
    for body, param in cases:
        status, out = release(producer, body)
        assert status == 400, (body, out)
        assert out["error"]["param"] == param, out
    status, raw, _ = http_request(producer.url, "POST", "/pd/release", b"[1,2]")
    assert status == 400, raw
    status, raw, _ = http_request(producer.url, "POST", "/pd/release", b"{not json")
    assert status == 400, raw


def test_release_requires_the_api_key_when_one_is_set(procs):
    producer = start_instance(procs, "kv_producer", flags=["--api-key", "sesame"])
    transfer_id = new_transfer_id()
    status, _ = release(producer, {"transfer_id": transfer_id})
    assert status == 401
    status, body = release(producer, {"transfer_id": transfer_id}, headers={"Authorization": "Bearer sesame"})
    assert status == 200 and body["released"] is False, body


def test_plain_instance_has_no_release_endpoint(procs):
    plain = start_instance(procs, None)
    status, _, _ = http_request(plain.url, "POST", "/pd/release", {"transfer_id": new_transfer_id()})
    assert status == 404


# ---- a peer's UCX blobs are checked before UCX parses them ---------------------------------------

# builtin:tiny's KV layout, as its meta frames carry it.
FINGERPRINT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "dtype": "float32", "block_size": 16,
               "tp_size": 1}
NUM_BLOCKS = 1024
LAYER_BYTES = NUM_BLOCKS * BYTES_PER_LAYER_BLOCK


def meta_frame(kind: str, name: str, nonce: int, ucx_endpoint: bytes, ucx_key: bytes = b"\x00" * 16) -> bytes:
    """A well-formed meta / meta_ok whose engine descriptor carries `ucx_endpoint` as its UCX address."""
    import msgpack
    engine = msgpack.packb({"v": 1, "t": "engine", "name": name, "nonce": nonce, "host": "elsewhere",
                            "ep": {"ucx": ucx_endpoint}, "gpus": []}, use_bin_type=True)
    layers = [msgpack.packb({"v": 1, "t": "mem", "engine": name, "nonce": nonce, "region": i + 1,
                             "base": 1 << 20, "bytes": LAYER_BYTES, "kind": 0, "device": -1,
                             "keys": {"ucx": ucx_key}}, use_bin_type=True) for i in range(2)]
    return msgpack.packb({"v": 2, "type": kind, "instance_id": name, "boot_nonce": nonce, "tp_rank": 0,
                          "engine_desc": engine, "layer_descs": layers, "fingerprint": FINGERPRINT,
                          "num_blocks": NUM_BLOCKS}, use_bin_type=True)


GARBAGE_ENDPOINTS = [b"\xff" * 16, bytes(range(0x0f, 0x1f)), b"\x00" * 16, b"\x01" + b"\xee" * 15]


def test_a_meta_with_a_garbage_ucx_endpoint_is_refused_and_the_producer_keeps_serving(procs, plain):
    import zmq
    producer = start_instance(procs, "kv_producer")
    consumer = start_instance(procs, "kv_consumer")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(f"tcp://{producer.info['control']}")
    try:
        for i, endpoint in enumerate(GARBAGE_ENDPOINTS):
            sock.send(meta_frame("meta", f"forger-{i}", 1000 + i, endpoint))
            import msgpack
            answer = msgpack.unpackb(sock.recv(), raw=False)  # an error, not a crash
            assert answer["type"] == "error", answer
            assert "ucx" in answer["text"].lower(), answer
    finally:
        sock.close()
        ctx.term()
    assert producer.server.healthy()
    assert producer.metric("pd_xfer_peer_blobs_refused_total", {"kind": "ucx_address"}) == len(GARBAGE_ENDPOINTS)
    assert producer.metric("pd_connector_handshakes_refused_total") >= len(GARBAGE_ENDPOINTS)
    # Real consumers still get served.
    assert pd_generate(producer, consumer, PROMPT, 4, read_mode=False) == reference(plain, PROMPT, 4)
    assert_no_blocks_in_use(producer, consumer)


@pytest.mark.parametrize("read_mode", [False, True], ids=["write", "read"])
def test_a_producer_answering_meta_ok_with_a_garbage_ucx_endpoint_costs_a_recompute_not_the_process(
        procs, plain, read_mode):
    import msgpack
    import threading
    import zmq
    consumer = start_instance(procs, "kv_consumer", read_mode, handshake_timeout=5)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()
    seen = []

    def fake_producer():
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not stop.is_set():
            if not poller.poll(100):
                continue
            identity, payload = router.recv_multipart()
            msg = msgpack.unpackb(payload, raw=False)
            seen.append(msg["type"])
            if msg["type"] == "meta":
                router.send_multipart([identity, meta_frame("meta_ok", "fake-producer", 4242, b"\xff" * 16)])

    thread = threading.Thread(target=fake_producer, daemon=True)
    thread.start()
    try:
        params = {"transfer_id": new_transfer_id(), "do_remote_prefill": True, "mode": "read" if read_mode else "write",
                  "remote_instance_id": "fake-producer", "remote_control": f"127.0.0.1:{port}",
                  "remote_boot_nonce": 4242}
        if read_mode:
            params["block_ids"] = list(range(7))
            params["num_tokens"] = len(PROMPT)
        start = time.monotonic()
        status, body = completion(consumer.url, PROMPT, 4, params)
        assert status == 200, body
        assert time.monotonic() - start < 5, "refused at the handshake, not at a timeout"
        assert token_ids(body) == reference(plain, PROMPT, 4)
    finally:
        stop.set()
        thread.join(timeout=5)
        router.close()
        ctx.term()
    assert "meta" in seen
    assert consumer.server.healthy()
    assert consumer.metric("pd_xfer_peer_blobs_refused_total", {"kind": "ucx_address"}) >= 1
    assert consumer.metric("pd_connector_recomputes_total") >= 1
    assert_no_blocks_in_use(consumer)


# ---- a transfer id already active here is the caller's error: 409 --------------------------------

@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_duplicate_transfer_id_on_the_producer_is_a_409(procs, stream):
    producer = start_instance(procs, "kv_producer", defer_timeout=60)
    transfer_id = new_transfer_id()
    producer_leg(producer, transfer_id, read_mode=False)  # held for its consumer
    body = {"model": "builtin:tiny", "prompt": PROMPT, "max_tokens": 1, "stream": stream,
            "kv_transfer_params": {"transfer_id": transfer_id, "do_remote_decode": True, "mode": "write"}}
    status, raw, _ = http_request(producer.url, "POST", "/v1/completions", body)
    assert status == 409, raw[:300]
    error = json.loads(raw)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "conflict", error
    assert error["param"] == "kv_transfer_params", error
    assert transfer_id in error["message"], error
    assert producer.server.healthy()
    status, body = release(producer, {"transfer_id": transfer_id})
    assert status == 200 and body["released"] is True, body
    assert_no_blocks_in_use(producer, timeout_s=5)


def test_a_duplicate_transfer_id_on_the_consumer_is_a_409(procs):
    import concurrent.futures
    producer = start_instance(procs, "kv_producer")
    consumer = start_instance(procs, "kv_consumer", transfer_timeout=30, recv_abort_timeout=30)
    transfer_id = new_transfer_id()
    params = {"transfer_id": transfer_id, "do_remote_prefill": True, "mode": "write",
              "remote_instance_id": producer.info["instance_id"], "remote_control": producer.info["control"],
              "remote_boot_nonce": producer.info["boot_nonce"]}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # The first consumer leg waits for KV whose producer leg comes only at the end.
        first = pool.submit(completion, consumer.url, PROMPT, 3, params)
        wait_for(lambda: consumer.metric("pd_connector_transfers_started_total", {"side": "consumer"}) >= 1, 10,
                 "the first leg admitted")
        status, raw, _ = http_request(consumer.url, "POST", "/v1/completions",
                                      {"model": "builtin:tiny", "prompt": PROMPT, "max_tokens": 3,
                                       "kv_transfer_params": params})
        assert status == 409, raw[:300]
        assert json.loads(raw)["error"]["code"] == "conflict"
        producer_leg(producer, transfer_id, read_mode=False)
        status, body = first.result(timeout=60)
        assert status == 200, body
    assert_no_blocks_in_use(producer, consumer)


# ---- a producer that stops answering costs transfer_timeout, not recv_abort_timeout --------------

def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def consumer_params(producer_info: dict, transfer_id: str, read_mode: bool, prefill: dict | None = None) -> dict:
    if read_mode:
        params = dict(prefill["kv_transfer_params"])
        params.update({"do_remote_prefill": True, "mode": "read"})
        return params
    return {"transfer_id": transfer_id, "do_remote_prefill": True, "mode": "write",
            "remote_instance_id": producer_info["instance_id"], "remote_control": producer_info["control"],
            "remote_boot_nonce": producer_info["boot_nonce"]}


@pytest.mark.parametrize("read_mode", [False, True], ids=["write", "read"])
def test_a_stopped_producer_costs_the_transfer_timeout_then_a_recompute(procs, plain, read_mode):
    import signal
    producer = start_instance(procs, "kv_producer", read_mode, transfer_timeout=2)
    consumer = start_instance(procs, "kv_consumer", read_mode, transfer_timeout=2, handshake_timeout=1,
                              recv_abort_timeout=60)
    expected = reference(plain, PROMPT, 4)
    # One transfer end to end, so the consumer holds a finished handshake with this producer.
    assert pd_generate(producer, consumer, PROMPT, 4, read_mode) == expected
    transfer_id = new_transfer_id()
    prefill = producer_leg(producer, transfer_id, read_mode) if read_mode else None
    failed_before = consumer.metric("pd_connector_transfers_failed_total", {"side": "consumer"})
    producer.server.process.proc.send_signal(signal.SIGSTOP)  # alive, connected, silent
    try:
        start = time.monotonic()
        status, body = completion(consumer.url, PROMPT, 4, consumer_params(producer.info, transfer_id, read_mode,
                                                                           prefill))
        elapsed = time.monotonic() - start
    finally:
        producer.server.process.proc.send_signal(signal.SIGCONT)
    assert status == 200, body
    assert token_ids(body) == expected
    assert 1.5 <= elapsed < 15, elapsed  # handshake (1 s) + transfer (2 s) bound, not recv_abort (60 s)
    assert consumer.metric("pd_connector_timeouts_total") >= 1
    assert consumer.metric("pd_connector_recomputes_total") >= 1
    assert consumer.metric("pd_connector_transfers_failed_total", {"side": "consumer"}) == failed_before + 1
    assert "got no KV within" in consumer.server.process.text()
    assert_no_blocks_in_use(producer, consumer)


def test_a_restarted_producer_fails_the_old_incarnations_transfers_at_its_first_message(procs, plain):
    import concurrent.futures
    import signal
    port = free_port()
    producer = start_instance(procs, "kv_producer", True, handshake_port=port)
    consumer = start_instance(procs, "kv_consumer", True, transfer_timeout=60, recv_abort_timeout=60)
    expected = reference(plain, PROMPT, 4)
    assert pd_generate(producer, consumer, PROMPT, 4, read_mode=True) == expected
    old_info = producer.info
    prefill = producer_leg(producer, new_transfer_id(), read_mode=True)
    producer.server.process.proc.send_signal(signal.SIGSTOP)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        started = consumer.metric("pd_connector_transfers_started_total", {"side": "consumer"})
        # Its `read` reaches a process that will never answer.
        waiting = pool.submit(completion, consumer.url, PROMPT, 4, consumer_params(old_info, "", True, prefill))
        wait_for(lambda: consumer.metric("pd_connector_transfers_started_total", {"side": "consumer"}) > started, 10,
                 "the consumer leg admitted")
        producer.server.process.proc.send_signal(signal.SIGKILL)
        producer.server.process.proc.wait(timeout=10)
        restarted = start_instance(procs, "kv_producer", True, handshake_port=port)
        assert restarted.info["boot_nonce"] != old_info["boot_nonce"]
        # A request still naming the old incarnation (router lag): its `read` reaches the new
        # process, whose refusal names the new identity.
        stale = {**prefill["kv_transfer_params"], "transfer_id": new_transfer_id(), "do_remote_prefill": True,
                 "mode": "read"}
        start = time.monotonic()
        status, body = completion(consumer.url, PROMPT, 4, stale)
        assert status == 200, body
        assert token_ids(body) == expected
        status, body = waiting.result(timeout=30)
        assert status == 200, body
        assert token_ids(body) == expected
        assert time.monotonic() - start < 15, "failed at the new identity, not at the 60 s timeouts"
    assert "restarted" in consumer.server.process.text()
    # The next request naming the new incarnation is served by it.
    assert pd_generate(restarted, consumer, PROMPT, 4, read_mode=True) == expected
    assert_no_blocks_in_use(restarted, consumer)


# ---- malformed frames: every one counted, the log rate-limited -----------------------------------

def test_twenty_thousand_malformed_frames_are_counted_but_log_a_handful_of_lines(procs):
    import zmq
    producer = start_instance(procs, "kv_producer")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 10_000)
    sock.connect(f"tcp://{producer.info['control']}")
    label = {"instance": producer.info["instance_id"]}
    try:
        for i in range(20_000):
            sock.send(b"\xc1" + i.to_bytes(4, "little"))
        wait_for(lambda: producer.metric("pd_connector_control_frames_malformed_total", label) >= 20_000, 60,
                 "every malformed frame counted")
    finally:
        sock.close()
        ctx.term()
    assert producer.metric("pd_connector_control_frames_malformed_total", label) == 20_000
    lines = [line for line in producer.server.process.text().splitlines() if "malformed" in line]
    assert 1 <= len(lines) <= 30, f"{len(lines)} log lines for 20,000 malformed frames"
    assert producer.server.healthy()
