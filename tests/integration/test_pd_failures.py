"""Failure modes of DESIGN.md §6 (items 1-7 and 9) against real producer / consumer processes on
loopback, plus the prefix-cache partial transfer. Every test ends with zero KV blocks in use on
every instance it started."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import pytest
import zmq

from conftest import http_request, start_pdserve
from test_pd_support import (BYTES_PER_LAYER_BLOCK, MODEL, NUM_LAYERS, assert_no_blocks_in_use, completion,
                             consumer_params_write, mixed_prompts, new_transfer_id, pd_generate, start_instance,
                             token_ids)

MAX_TOKENS = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def plain(module_procs):
    return start_instance(module_procs, None)


def reference(plain, prompt, max_tokens=MAX_TOKENS):
    status, body = completion(plain.url, prompt, max_tokens)
    assert status == 200, body
    return token_ids(body)


PROMPT = mixed_prompts(20)[12]  # 100 tokens: 6 full blocks + a partial one


# ---- §6.1 requests without transfer params; preemption -----------------------------------------

def test_consumer_request_without_transfer_params_runs_as_a_normal_request(procs, plain):
    consumer = start_instance(procs, "kv_consumer")
    status, body = completion(consumer.url, PROMPT, MAX_TOKENS)
    assert status == 200
    assert token_ids(body) == reference(plain, PROMPT)
    assert consumer.metric("pd_connector_transfers_started_total", {"side": "consumer"}) == 0
    assert_no_blocks_in_use(consumer)


@pytest.mark.parametrize("read_mode", [False, True], ids=["write", "read"])
def test_preempted_pd_requests_recompute_instead_of_hanging(procs, plain, read_mode):
    # 48 blocks for 24 concurrent 100-token prompts generating 40 tokens: without the admission
    # reserve (on by default, which would defer them instead) the consumer must preempt.
    producer = start_instance(procs, "kv_producer", read_mode)
    consumer = start_instance(procs, "kv_consumer", read_mode,
                              flags=["--num-kv-blocks", "48", "--remote-output-reserve", "-1"])
    prompts = [p for p in mixed_prompts(60, seed=3) if 60 <= len(p) <= 150][:24]
    expected = [reference(plain, p, 40) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(48) as legs, concurrent.futures.ThreadPoolExecutor(24) as pool:
        got = list(pool.map(lambda p: pd_generate(producer, consumer, p, 40, read_mode, pool=legs), prompts))
    assert got == expected
    assert consumer.metric("pd_preemptions_total") > 0, "the test must actually preempt"
    assert_no_blocks_in_use(producer, consumer)


# ---- §6.2 WRITE wait: abort frees, timeout recomputes -------------------------------------------

def test_aborted_write_wait_frees_its_blocks(procs):
    producer = start_instance(procs, "kv_producer")
    consumer = start_instance(procs, "kv_consumer", transfer_timeout=20, recv_abort_timeout=60)
    # A consumer leg whose producer leg never comes: it waits in WaitingForRemoteKv.
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True,
                       "kv_transfer_params": consumer_params_write(producer, new_transfer_id())})
    sock = socket.create_connection((consumer.server.host, consumer.server.port), timeout=30)
    sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n{body}").encode())
    from conftest import wait_for
    wait_for(lambda: consumer.metric("pd_kv_blocks_used") > 0, 30, "consumer blocks allocated for the wait")
    start = time.monotonic()
    sock.close()  # client disconnect -> abort while waiting
    assert_no_blocks_in_use(consumer, timeout_s=10)
    # Released on the producer's acknowledgement, well before transfer_timeout (20 s).
    assert time.monotonic() - start < 10
    assert_no_blocks_in_use(producer)


def test_write_wait_past_recv_abort_timeout_recomputes(procs, plain):
    producer = start_instance(procs, "kv_producer")
    consumer = start_instance(procs, "kv_consumer", recv_abort_timeout=2)
    start = time.monotonic()
    status, body = completion(consumer.url, PROMPT, MAX_TOKENS, consumer_params_write(producer, new_transfer_id()))
    elapsed = time.monotonic() - start
    assert status == 200, body
    assert token_ids(body) == reference(plain, PROMPT)
    assert 1.5 <= elapsed < 15, elapsed
    assert consumer.metric("pd_connector_timeouts_total") >= 1
    assert consumer.metric("pd_connector_recomputes_total") >= 1
    assert_no_blocks_in_use(producer, consumer)


# ---- §6.3 producer keeps blocks while writes are in flight, even when its one token is a stop token --

def test_producer_holds_blocks_until_write_done_even_on_eos(procs, plain):
    expected = reference(plain, PROMPT)
    # Every write takes >= 1.5 s, so the producer request finishes long before its writes do.
    producer = start_instance(procs, "kv_producer", env={"PD_CONNECTOR_XFER_FAULT": "delay:1500"})
    consumer = start_instance(procs, "kv_consumer")
    transfer_id = new_transfer_id()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        decode = pool.submit(completion, consumer.url, PROMPT, MAX_TOKENS,
                             consumer_params_write(producer, transfer_id))
        status, prefill = completion(producer.url, PROMPT, 1,
                                     {"transfer_id": transfer_id, "do_remote_decode": True, "mode": "write"},
                                     ignore_eos=False, stop_token_ids=[expected[0]])
        assert status == 200
        assert prefill["choices"][0]["finish_reason"] == "stop"
        # The request is finished, its writes are not (>= 1.5 s): its blocks must stay in use. The
        # gauge is published by the engine loop, so give it one idle period to refresh.
        from conftest import wait_for
        wait_for(lambda: producer.metric("pd_kv_blocks_used") > 0, 1.2, "producer blocks held after EOS")
        d_status, d_body = decode.result(timeout=60)
    assert d_status == 200
    assert token_ids(d_body) == expected
    assert consumer.metric("pd_connector_load_errors_total") == 0
    # The done (with the first token) was settled while the writes were in flight: the completion thread
    # sent it as the last write completed, and the consumer streamed the token as the done arrived.
    assert producer.metric("pd_connector_dones_on_completion_total") == 1
    assert consumer.metric("pd_connector_first_tokens_streamed_total") == 1
    assert_no_blocks_in_use(producer, consumer)


def test_write_batch_past_its_deadline_fails_the_transfer_and_frees_the_producer(procs, plain):
    # Every write batch is swallowed (a consumer that stopped answering): xfer fails it at its own
    # deadline (transfer_timeout, 2 s). The producer must then report the failure, so the consumer
    # recomputes long before its own 60 s wait ends, and free its blocks (a producer that re-queued
    # the failed batch would never send `done` and never free them).
    producer = start_instance(procs, "kv_producer", env={"PD_CONNECTOR_XFER_FAULT": "drop"}, transfer_timeout=2)
    consumer = start_instance(procs, "kv_consumer", recv_abort_timeout=60)
    start = time.monotonic()
    got = pd_generate(producer, consumer, PROMPT, MAX_TOKENS, read_mode=False)
    elapsed = time.monotonic() - start
    assert got == reference(plain, PROMPT)
    assert elapsed < 30, elapsed
    assert consumer.metric("pd_connector_recomputes_total") >= 1
    assert_no_blocks_in_use(producer, consumer)


@pytest.mark.parametrize("read_mode", [False, True], ids=["write", "read"])
def test_producer_takes_an_explicit_null_mode_as_its_default(procs, read_mode):
    # "mode": null passes validation (absent = the instance's mode); the producer used to read the
    # raw JSON again when the request finished, and a null there threw on the engine thread.
    producer = start_instance(procs, "kv_producer", read_mode)
    status, body = completion(producer.url, PROMPT, 1,
                              {"transfer_id": new_transfer_id(), "do_remote_decode": True, "mode": None})
    assert status == 200, body
    assert body["kv_transfer_params"]["mode"] == ("read" if read_mode else "write")
    assert producer.server.healthy()


# ---- §6.4 a failed READ reaches the scheduler and is recomputed ---------------------------------

def test_failed_read_is_recomputed_locally(procs, plain):
    producer = start_instance(procs, "kv_producer", read_mode=True)
    consumer = start_instance(procs, "kv_consumer", read_mode=True, env={"PD_CONNECTOR_XFER_FAULT": "fail"})
    got = pd_generate(producer, consumer, PROMPT, MAX_TOKENS, read_mode=True)
    assert got == reference(plain, PROMPT)
    assert consumer.metric("pd_connector_load_errors_total") >= 1
    assert consumer.metric("pd_connector_recomputes_total") >= 1
    assert_no_blocks_in_use(producer, consumer)


# ---- §6.5 malformed / forged control frames ------------------------------------------------------

def test_malformed_and_forged_control_frames_are_counted_and_the_listener_keeps_serving(procs, plain):
    producer = start_instance(procs, "kv_producer")
    consumer = start_instance(procs, "kv_consumer")
    import msgpack
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{producer.info['control']}")
    frames = [b"\xc1\xc1", b"", b"\x91" * 200, msgpack.packb({"v": 9, "type": "meta"}),
              msgpack.packb({"v": 2, "type": "blocks", "instance_id": "x", "boot_nonce": 1, "tp_rank": 0,
                             "transfer_id": "0" * 32, "block_ids": [-1], "num_tokens": 1, "kv_tokens": 0,
                             "num_skip_blocks": 0}),
              msgpack.packb({"v": 2, "type": "meta", "instance_id": "x", "boot_nonce": 1, "tp_rank": 0,
                             "engine_desc": b"junk", "layer_descs": [b"a"], "num_blocks": 4,
                             "fingerprint": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "dtype": "float32",
                                             "block_size": 16, "tp_size": 1}})]
    for frame in frames:
        sock.send(frame)
    sock.send_multipart([b"a", b"b", b"c"])
    # A well-formed release for a transfer the sender has no part in: refused (no handshake).
    sock.send(msgpack.packb({"v": 2, "type": "release", "instance_id": "x", "boot_nonce": 1, "tp_rank": 0,
                             "transfer_id": "0" * 32}))
    from conftest import wait_for
    wait_for(lambda: producer.metric("pd_connector_control_frames_malformed_total",
                                     {"instance": producer.info["instance_id"]}) >= 5, 10, "malformed count")
    wait_for(lambda: producer.metric("pd_connector_control_messages_refused_total") >= 1, 10, "refused count")
    assert producer.metric("pd_connector_handshakes_refused_total") >= 1  # layout mismatch / junk descriptor
    sock.close()
    ctx.term()
    assert pd_generate(producer, consumer, PROMPT, MAX_TOKENS, read_mode=False) == reference(plain, PROMPT)
    assert_no_blocks_in_use(producer, consumer)


# ---- §6.6 dead peers time out; restarted peers are re-handshaken ---------------------------------

def test_dead_producer_times_out_within_the_handshake_bound(procs, plain):
    consumer = start_instance(procs, "kv_consumer", handshake_timeout=1)
    params = {"transfer_id": new_transfer_id(), "do_remote_prefill": True, "mode": "write",
              "remote_instance_id": "gone", "remote_control": f"127.0.0.1:{free_port()}", "remote_boot_nonce": 1}
    start = time.monotonic()
    status, body = completion(consumer.url, PROMPT, MAX_TOKENS, params)
    assert status == 200, body
    assert time.monotonic() - start < 8
    assert token_ids(body) == reference(plain, PROMPT)
    assert consumer.metric("pd_connector_load_errors_total") >= 1
    assert_no_blocks_in_use(consumer)


def test_a_request_timing_out_before_its_first_token_is_answered_in_both_response_kinds(procs):
    """A consumer request whose KV never comes (the producer never gets its leg) outlives
    --request-timeout-ms before any token: non-streamed it is a 504; streamed, the 200 goes out with the
    timeout event (pdserve sends a stream's headers with its first event). Either way it is aborted and
    its blocks come back."""
    producer = start_instance(procs, "kv_producer")
    consumer = start_instance(procs, "kv_consumer", flags=("--request-timeout-ms", "400"), transfer_timeout=2)
    for stream in (False, True):
        params = consumer_params_write(producer, new_transfer_id())
        start = time.monotonic()
        status, raw, _ = http_request(consumer.url, "POST", "/v1/completions",
                                      {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": stream,
                                       "kv_transfer_params": params})
        assert time.monotonic() - start < 5
        if not stream:
            assert status == 504, raw[:300]
            assert json.loads(raw)["error"]["type"] == "timeout_error"
        else:
            assert status == 200, raw[:300]
            events = [line[len("data: "):] for line in raw.decode().splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]", events
            assert json.loads(events[-2])["error"]["type"] == "timeout_error", events
    assert_no_blocks_in_use(producer, consumer)


def test_restarted_producer_is_re_handshaken(procs, plain):
    port = free_port()
    producer = start_instance(procs, "kv_producer", handshake_port=port)
    consumer = start_instance(procs, "kv_consumer", handshake_timeout=2)
    expected = reference(plain, PROMPT)
    assert pd_generate(producer, consumer, PROMPT, MAX_TOKENS, read_mode=False) == expected
    old_nonce = producer.info["boot_nonce"]
    producer.server.process.stop()
    producer = start_instance(procs, "kv_producer", handshake_port=port)
    assert producer.info["boot_nonce"] != old_nonce
    assert producer.info["control"] == f"127.0.0.1:{port}"
    loads_before = consumer.metric("pd_connector_load_errors_total")
    assert pd_generate(producer, consumer, PROMPT, MAX_TOKENS, read_mode=False) == expected
    assert consumer.metric("pd_connector_load_errors_total") == loads_before, "the new incarnation must serve"
    assert_no_blocks_in_use(producer, consumer)


# ---- §6.7 no port arithmetic: every instance has its own ROUTER ----------------------------------

def test_instances_on_one_host_never_collide(procs, plain):
    producers = [start_instance(procs, "kv_producer") for _ in range(2)]
    consumer = start_instance(procs, "kv_consumer")
    controls = {p.info["control"] for p in producers} | {consumer.info["control"]}
    assert len(controls) == 3
    assert len({p.info["instance_id"] for p in producers}) == 2
    expected = reference(plain, PROMPT)
    for producer in producers:
        assert pd_generate(producer, consumer, PROMPT, MAX_TOKENS, read_mode=False) == expected
    assert_no_blocks_in_use(*producers, consumer)


# ---- §6.9 authentication, peer policy, malformed kv_transfer_params --------------------------------

def test_control_plane_requires_the_shared_secret(procs, plain, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("a deployment secret of decent length\n")
    other = tmp_path / "other"
    other.write_text("some other secret, also long enough\n")
    producer = start_instance(procs, "kv_producer", control_secret_file=str(secret))
    consumer = start_instance(procs, "kv_consumer", control_secret_file=str(secret))
    intruder = start_instance(procs, "kv_consumer", control_secret_file=str(other), handshake_timeout=1)
    expected = reference(plain, PROMPT)
    assert pd_generate(producer, consumer, PROMPT, MAX_TOKENS, read_mode=False) == expected
    assert consumer.metric("pd_connector_load_errors_total") == 0
    # The intruder never completes a handshake: it recomputes, and no KV leaves the producer for it.
    written = producer.metric("pd_connector_bytes_total", {"direction": "write"})
    assert pd_generate(producer, intruder, PROMPT, MAX_TOKENS, read_mode=False) == expected
    assert intruder.metric("pd_connector_load_errors_total") >= 1
    assert producer.metric("pd_connector_bytes_total", {"direction": "write"}) == written
    assert_no_blocks_in_use(producer, consumer, intruder, timeout_s=90)


def bad_params_cases(producer):
    good = consumer_params_write(producer, new_transfer_id())
    cases = {
        "not an object": [1, 2],
        "short transfer id": {**good, "transfer_id": "abc"},
        "transfer id of the wrong type": {**good, "transfer_id": 12},
        "both sides": {**good, "do_remote_decode": True},
        "string boolean": {**good, "do_remote_prefill": "yes"},
        "negative nonce": {**good, "remote_boot_nonce": -5},
        "peer outside the policy": {**good, "remote_control": "203.0.113.7:7000"},
        "peer by name": {**good, "remote_control": "localhost:7000"},
        "read without block ids": {**good, "mode": "read"},
        "read with foreign block count": {**good, "mode": "read", "num_tokens": len(PROMPT), "block_ids": [1]},
    }
    return cases


def test_malformed_kv_transfer_params_get_a_400(procs):
    producer = start_instance(procs, "kv_producer")
    consumer = start_instance(procs, "kv_consumer")
    for name, params in bad_params_cases(producer).items():
        status, raw, _ = http_request(consumer.url, "POST", "/v1/completions",
                                     {"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                      "kv_transfer_params": params})
        assert status == 400, f"{name}: {status} {raw[:300]!r}"
    # The producer refuses consumer-side params and vice versa.
    status, _, _ = http_request(producer.url, "POST", "/v1/completions",
                                {"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                                 "kv_transfer_params": consumer_params_write(producer, new_transfer_id())})
    assert status == 400
    assert consumer.server.healthy() and producer.server.healthy()
    assert_no_blocks_in_use(producer, consumer)


def test_read_with_block_ids_of_another_transfer_gets_a_400(procs, plain):
    """READ-mode block ids are the client's to send; ids that do not belong to the named transfer can only be
    told apart by the producer. Its refusal reaches the client as a 400 (streamed or not), nothing is
    recomputed, and the transfers the ids were taken from are still read by their own requests."""
    producer = start_instance(procs, "kv_producer", read_mode=True)
    consumer = start_instance(procs, "kv_consumer", read_mode=True)
    other_prompt = [t + 1 for t in PROMPT]  # same length, no shared prefix: blocks of its own
    held = []
    for prompt in (PROMPT, other_prompt):
        status, prefill = completion(producer.url, prompt, 1,
                                     {"transfer_id": new_transfer_id(), "do_remote_decode": True, "mode": "read"})
        assert status == 200, prefill
        held.append((prompt, {**prefill["kv_transfer_params"], "do_remote_prefill": True, "mode": "read"}))
    (prompt_a, params_a), (prompt_b, params_b) = held
    assert set(params_a["block_ids"]).isdisjoint(params_b["block_ids"])
    forged = {**params_a, "block_ids": params_b["block_ids"]}
    for stream in (False, True):
        status, raw, _ = http_request(consumer.url, "POST", "/v1/completions",
                                      {"model": MODEL, "prompt": prompt_a, "max_tokens": 3, "stream": stream,
                                       "kv_transfer_params": forged})
        assert status == 400, f"stream={stream}: {status} {raw[:300]!r}"
        body = json.loads(raw)
        assert "does not belong" in body["error"]["message"], body
        assert body["error"]["param"] == "kv_transfer_params", body
    assert consumer.metric("pd_connector_recomputes_total") == 0
    assert producer.metric("pd_connector_control_messages_refused_total") >= 2
    for prompt, params in held:
        status, decode = completion(consumer.url, prompt, MAX_TOKENS, params)
        assert status == 200, decode
        assert token_ids(decode) == reference(plain, prompt)
    assert consumer.metric("pd_connector_recomputes_total") == 0
    assert_no_blocks_in_use(producer, consumer)


# ---- prefix cache: only the missing blocks move -----------------------------------------------

def test_consumer_prefix_hit_receives_only_the_missing_blocks(procs, plain):
    producer = start_instance(procs, "kv_producer")
    consumer = start_instance(procs, "kv_consumer")
    prefix = mixed_prompts(30, seed=11)[10][:64]  # 4 full blocks
    assert len(prefix) == 64
    prompt = prefix + [777 + i for i in range(40)]  # 104 tokens
    status, _ = completion(consumer.url, prefix + [5], MAX_TOKENS)  # warms the consumer's prefix cache
    assert status == 200
    before = producer.metric("pd_connector_bytes_total", {"direction": "write"})
    assert pd_generate(producer, consumer, prompt, MAX_TOKENS, read_mode=False) == reference(plain, prompt)
    moved = producer.metric("pd_connector_bytes_total", {"direction": "write"}) - before
    # KV for 103 tokens = 7 blocks; the consumer had 4: 3 blocks per layer move.
    assert moved == 3 * NUM_LAYERS * BYTES_PER_LAYER_BLOCK, moved
    assert_no_blocks_in_use(producer, consumer)
