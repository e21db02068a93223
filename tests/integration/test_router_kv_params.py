"""Client-supplied kv_transfer_params never reach an engine (DESIGN.md §6 item 9), and the
legs the router writes follow docs/pd_contract.md. The engines here are RecordingBackends:
tiny HTTP servers that only record the bodies they receive (the one place these tests
use a stand-in, because the assertion is about exactly what arrives at an engine)."""

from __future__ import annotations

import json
import re

import openai
import pytest

from conftest import wait_for
from router_fixtures import TINY_MODEL, RecordingBackend, Registrar, registration_record, start_router

EVIL = {"transfer_id": "f" * 32, "remote_control": "10.66.66.66:6666", "remote_instance_id": "evil",
        "remote_boot_nonce": 666, "do_remote_prefill": True, "block_ids": [1, 2], "num_tokens": 9, "mode": "read"}
HEX32 = re.compile(r"^[0-9a-f]{32}$")


@pytest.fixture
def backends():
    made = []

    def make(role, instance_id, mode="write"):
        backend = RecordingBackend(role, instance_id, mode)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        backend.stop()


def assert_nothing_of_the_client(body: dict):
    text = repr(body)
    # Substrings that cannot occur by chance (router-minted ids are random hex: a short
    # decimal needle such as the nonce would sometimes match one).
    for needle in ["10.66.66.66", "evil", "f" * 32]:
        assert needle not in text, f"client kv_transfer_params leaked into an engine body: {body}"
    params = body.get("kv_transfer_params") or {}
    for key, value in EVIL.items():
        assert params.get(key) != value or key in ("do_remote_prefill", "mode"), \
            f"client kv_transfer_params leaked into an engine body: {key}={value!r} in {body}"


def client_for(router):
    return openai.OpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.mark.parametrize("stream", [False, True])
def test_collocated_leg_drops_client_kv_transfer_params(procs, backends, stream):
    engine = backends("both", "c0")
    router = start_router(procs, "--collocated", engine.url, registration=False)
    router.wait_for_instances(1)
    client = client_for(router)
    result = client.completions.create(model=TINY_MODEL, prompt="hi", max_tokens=3, stream=stream,
                                       extra_body={"kv_transfer_params": EVIL})
    if stream:
        assert "".join(chunk.choices[0].text for chunk in result if chunk.choices)
    assert len(engine.bodies) == 1
    assert "kv_transfer_params" not in engine.bodies[0]
    assert engine.bodies[0]["prompt"] == "hi"
    assert router.metric("pd_router_client_kv_transfer_params_dropped_total") == 1


@pytest.mark.parametrize("mode", ["write", "read"])
@pytest.mark.parametrize("stream", [False, True])
def test_pd_legs_carry_only_router_minted_params(procs, backends, mode, stream):
    producer = backends("producer", "p0", mode)
    consumer = backends("consumer", "d0", mode)
    router = start_router(procs)
    registrar = Registrar(router.registration_port)
    try:
        registrar.send_record(registration_record("p0", "producer", producer.http, control="127.0.0.1:9",
                                                  boot_nonce=1, mode=mode))
        registrar.send_record(registration_record("d0", "consumer", consumer.http, control="127.0.0.1:19",
                                                  mode=mode))
        wait_for(lambda: router.instance_ids() == {"p0", "d0"}, 10, "producer and consumer registered")
        client = client_for(router)
        result = client.chat.completions.create(
            model=TINY_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=stream,
            stream_options={"include_usage": True} if stream else None, extra_body={"kv_transfer_params": EVIL})
        if stream:
            list(result)
    finally:
        registrar.close()

    # WRITE sends both legs at once: the client can have its answer from the consumer
    # before the producer's leg has reached its engine.
    wait_for(lambda: len(producer.bodies) == 1 and len(consumer.bodies) == 1, 10, "both legs recorded")
    p_body, d_body = producer.bodies[0], consumer.bodies[0]
    assert_nothing_of_the_client(p_body)
    assert_nothing_of_the_client(d_body)
    p_params, d_params = p_body["kv_transfer_params"], d_body["kv_transfer_params"]
    assert HEX32.match(p_params["transfer_id"])
    assert p_params == {"transfer_id": p_params["transfer_id"], "do_remote_decode": True, "mode": mode}
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False and "stream_options" not in p_body
    assert d_params["transfer_id"] == p_params["transfer_id"]
    assert d_params["do_remote_prefill"] is True and d_params["mode"] == mode
    assert d_params["remote_instance_id"] == "p0"
    assert d_params["remote_control"] == "127.0.0.1:9"
    assert d_params["remote_boot_nonce"] == 1
    if mode == "read":
        assert d_params["block_ids"] == [0] and d_params["num_tokens"] == 1
    assert d_body["max_tokens"] == 5
    assert d_body.get("stream", False) is stream
    if stream:
        assert d_body["stream_options"] == {"include_usage": True}


# A tool-calling request whose keys are not in alphabetical order, at the top level and in the
# tool's JSON schema ("properties": city, unit, days). Chat templates (Qwen2.5 and others) render
# tools with tojson in the order given, and pdserve keeps that order, so an engine must receive
# the client's order on every leg or the P/D prompt differs from the collocated one. ASCII only
# and no floats, so the router's compact serialisation matches json.dumps byte for byte.
TOOL_CALLING_REQUEST = {
    "model": TINY_MODEL,
    "messages": [{"role": "user", "content": "weather in Paris?"}],
    "tools": [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]},
                                      "days": {"type": "integer"}},
                       "required": ["city"]}}}],
    "tool_choice": "none",  # tools still rendered; "auto" needs a tool-call format the tiny template lacks
    "max_tokens": 5,
    "stream": False,
    "temperature": 0,
}


def compact(body: dict) -> bytes:
    """The bytes of `body` in its insertion order, without spaces, as the router serialises JSON."""
    return json.dumps(body, separators=(",", ":")).encode()


def with_router_params(body: dict) -> bytes:
    """What a leg starts with when the router appends kv_transfer_params to `body`."""
    return compact(body)[:-1] + b',"kv_transfer_params":'


@pytest.mark.parametrize("mode", ["write", "read"])
def test_pd_legs_keep_the_clients_key_order(procs, backends, mode):
    producer = backends("producer", "p0", mode)
    consumer = backends("consumer", "d0", mode)
    router = start_router(procs, "--prefill", producer.url, "--decode", consumer.url, registration=False)
    router.wait_for_instances(2)
    status, answer, _ = router.post("/v1/chat/completions", compact(TOOL_CALLING_REQUEST))
    assert status == 200, answer
    wait_for(lambda: len(producer.raw_bodies) == 1 and len(consumer.raw_bodies) == 1, 10, "both legs recorded")

    # Keys the router sets on the producer leg keep the client's place for them.
    producer_expected = with_router_params({**TOOL_CALLING_REQUEST, "max_tokens": 1, "stream": False})
    assert producer.raw_bodies[0][:len(producer_expected)] == producer_expected
    consumer_expected = with_router_params(TOOL_CALLING_REQUEST)
    assert consumer.raw_bodies[0][:len(consumer_expected)] == consumer_expected


def test_collocated_leg_keeps_the_clients_key_order_when_it_drops_kv_transfer_params(procs, backends):
    engine = backends("both", "c0")
    router = start_router(procs, "--collocated", engine.url, registration=False)
    router.wait_for_instances(1)
    # The dropped key sits mid-body, so the router must re-serialise rather than pass the bytes through.
    with_client_params = dict(list(TOOL_CALLING_REQUEST.items())[:3] + [("kv_transfer_params", EVIL)] +
                              list(TOOL_CALLING_REQUEST.items())[3:])
    status, answer, _ = router.post("/v1/chat/completions", compact(with_client_params))
    assert status == 200, answer
    assert engine.raw_bodies == [compact(TOOL_CALLING_REQUEST)]


def test_transfer_ids_are_fresh_per_request(procs, backends):
    producer = backends("producer", "p0")
    consumer = backends("consumer", "d0")
    router = start_router(procs, "--prefill", producer.url, "--decode", consumer.url, registration=False)
    router.wait_for_instances(2)
    client = client_for(router)
    for _ in range(20):
        client.completions.create(model=TINY_MODEL, prompt="x", max_tokens=2)
    # WRITE runs the producer leg concurrently with the decode leg, so the client's answer can
    # come back before the producer has received the last request.
    wait_for(lambda: len(producer.bodies) >= 20, 10, "every producer leg recorded")
    ids = [b["kv_transfer_params"]["transfer_id"] for b in producer.bodies]
    assert len(ids) == 20 and len(set(ids)) == 20
    assert all(HEX32.match(i) for i in ids)
