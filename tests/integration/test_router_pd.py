"""pdrouter with real P/D deployments: a producer and a consumer pdserve with the connector,
discovered through their own registration heartbeats. WRITE and READ flows, stream and
not, with the greedy answer equal to a collocated engine's; prefill failure falls back to
collocated decode with the answer still correct; client disconnect frees blocks on both
sides."""

from __future__ import annotations

import socket
import time

import openai
import pytest

from conftest import metric_value, start_pdserve, wait_for
from router_fixtures import TINY_MODEL, Heartbeat, Registrar, pdserve_flags, registration_record, start_router

PROMPT = "The capital of the land of tiny models is"


def client_for(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def blocks_used(engine) -> float:
    return metric_value(engine.metrics(), "pd_kv_blocks_used") or 0.0


@pytest.fixture(scope="module")
def reference(module_procs):
    """A plain collocated engine: the greedy answers P/D must reproduce."""
    return start_pdserve(module_procs, "--model", TINY_MODEL, "--max-model-len", "2048")


# A producer whose consumer never calls (the consumer refused the request) holds its blocks until
# defer_timeout: short here so the tests can see every block come back.
CONNECTOR_TIMEOUTS = {"defer_timeout": 5, "transfer_timeout": 10}


def deploy(procs, mode: str, router_flags: tuple = (), engine_flags: tuple = ()):
    router = start_router(procs, *router_flags)
    producer = start_pdserve(procs, "--kv-role", "kv_producer", *engine_flags,
                             *pdserve_flags("producer", router=router, mode=mode, extra=CONNECTOR_TIMEOUTS))
    consumer = start_pdserve(procs, "--kv-role", "kv_consumer", *engine_flags,
                             *pdserve_flags("consumer", router=router, mode=mode, extra=CONNECTOR_TIMEOUTS))
    wait_for(lambda: {i["role"] for i in router.instances()} >= {"producer", "consumer"}, 20,
             "producer and consumer registered through their heartbeats")
    return router, producer, consumer


@pytest.fixture(scope="module", params=["write", "read"])
def deployment(request, module_procs):
    router, producer, consumer = deploy(module_procs, request.param)
    return request.param, router, producer, consumer


def transfers_done(engine) -> float:
    text = engine.metrics()
    return sum(metric_value(text, "pd_connector_transfers_done_total", {"side": side}) or 0.0
               for side in ("producer", "consumer"))


def test_registered_instances_carry_contract_fields(deployment):
    mode, router, producer, consumer = deployment
    by_role = {i["role"]: i for i in router.instances()}
    assert by_role["producer"]["mode"] == mode and by_role["consumer"]["mode"] == mode
    assert by_role["producer"]["http"].endswith(f":{producer.port}")
    assert by_role["consumer"]["http"].endswith(f":{consumer.port}")
    assert by_role["producer"]["model"] == TINY_MODEL


@pytest.mark.parametrize("stream", [False, True])
def test_pd_completion_equals_collocated_greedy(deployment, reference, stream):
    mode, router, producer, consumer = deployment
    expected = client_for(reference.base_url).completions.create(model=TINY_MODEL, prompt=PROMPT, max_tokens=16,
                                                                 temperature=0, extra_body={"ignore_eos": True})
    before = transfers_done(consumer) + transfers_done(producer)
    fallbacks_before = router.metric("pd_router_fallbacks_total", {"reason": "prefill_failed"})
    client = client_for(router.base_url)
    if stream:
        chunks = list(client.completions.create(model=TINY_MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens == 16
    else:
        text = client.completions.create(model=TINY_MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
    assert text == expected.choices[0].text
    wait_for(lambda: transfers_done(consumer) + transfers_done(producer) > before, 10, "a KV transfer completed")
    assert router.metric("pd_router_fallbacks_total", {"reason": "prefill_failed"}) == fallbacks_before


def test_pd_serves_min_tokens_above_one_with_the_collocated_answer(deployment, reference):
    """The producer leg has max_tokens=1: the router must not send it a min_tokens pdserve refuses."""
    mode, router, producer, consumer = deployment
    expected = client_for(reference.base_url).completions.create(model=TINY_MODEL, prompt=PROMPT, max_tokens=8,
                                                                 temperature=0, extra_body={"min_tokens": 4})
    answer = client_for(router.base_url).completions.create(model=TINY_MODEL, prompt=PROMPT, max_tokens=8,
                                                            temperature=0, extra_body={"min_tokens": 4})
    assert answer.choices[0].text == expected.choices[0].text
    assert answer.usage.completion_tokens == expected.usage.completion_tokens >= 4


def test_pd_chat_stream(deployment, reference):
    mode, router, producer, consumer = deployment
    messages = [{"role": "user", "content": "Hello there"}]
    expected = client_for(reference.base_url).chat.completions.create(model=TINY_MODEL, messages=messages,
                                                                      max_tokens=8, temperature=0)
    chunks = list(client_for(router.base_url).chat.completions.create(model=TINY_MODEL, messages=messages,
                                                                      max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        expected.choices[0].message.content


def test_client_disconnect_frees_blocks_on_both_sides(deployment):
    mode, router, producer, consumer = deployment
    body = (b'{"model":"%s","prompt":"%s","max_tokens":1900,"ignore_eos":true,"stream":true}'
            % (TINY_MODEL.encode(), b"word " * 60))
    sock = socket.create_connection((router.host, router.port), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    wait_for(lambda: blocks_used(consumer) > 0, 30, "the consumer holds the request's blocks")
    sock.close()
    wait_for(lambda: blocks_used(consumer) == 0 and blocks_used(producer) == 0, 60,
             "blocks back to 0 on producer and consumer after the client went away")
    wait_for(lambda: all(i["outstanding"] == 0 for i in router.instances()), 10, "router legs released")


@pytest.mark.parametrize("mode", ["write", "read"])
def test_prefill_failure_falls_back_to_collocated_decode_with_the_same_answer(procs, reference, mode):
    router, producer, consumer = deploy(procs, mode)
    expected = client_for(reference.base_url).completions.create(model=TINY_MODEL, prompt=PROMPT, max_tokens=12,
                                                                 temperature=0, extra_body={"ignore_eos": True})
    producer.process.proc.kill()  # the producer dies; the router still lists it until it expires
    producer.process.proc.wait(timeout=10)
    answer = client_for(router.base_url).completions.create(model=TINY_MODEL, prompt=PROMPT, max_tokens=12,
                                                            temperature=0, extra_body={"ignore_eos": True})
    assert answer.choices[0].text == expected.choices[0].text
    assert router.metric("pd_router_fallbacks_total", {"reason": "prefill_failed"}) == 1
    assert router.metric("pd_router_leg_failures_total", {"leg": "prefill", "reason": "transport"}) >= 1


def test_prefill_failure_retries_on_another_producer(procs, reference):
    """A registered producer that is dead (its port refuses) is skipped for a live one: retry, no fallback."""
    router, producer, consumer = deploy(procs, "write")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]  # closed again on exit: connecting to it is refused
    registrar = Registrar(router.registration_port)
    try:
        live = {i["role"]: i for i in router.instances()}["producer"]
        dead = registration_record("dead-producer", "producer", f"127.0.0.1:{dead_port}", control=live["control"],
                                   mode="write")
        # Keep it registered for the duration of the test.
        deadline = time.monotonic() + 60
        registrar.send_record(dead)
        wait_for(lambda: "dead-producer" in router.instance_ids(), 10, "dead producer registered")
        expected = client_for(reference.base_url).completions.create(model=TINY_MODEL, prompt=PROMPT, max_tokens=8,
                                                                     temperature=0, extra_body={"ignore_eos": True})
        client = client_for(router.base_url)
        for _ in range(4):  # least_outstanding with equal loads rotates: the dead one is chosen at least once
            registrar.send_record(dead)
            text = client.completions.create(model=TINY_MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
            assert text == expected.choices[0].text
            assert time.monotonic() < deadline
        assert router.metric("pd_router_retries_total") >= 1
        assert router.metric("pd_router_fallbacks_total", {"reason": "prefill_failed"}) == 0
    finally:
        registrar.close()


def test_consumer_error_reaches_the_client_as_an_error_status_not_a_200_stream(deployment):
    """max_tokens beyond the model length: the producer leg (max_tokens=1) is fine, the consumer refuses.
    The client must see the consumer's 400, even when it asked for a stream."""
    mode, router, producer, consumer = deployment
    client = client_for(router.base_url)
    with pytest.raises(openai.BadRequestError):
        stream = client.completions.create(model=TINY_MODEL, prompt=PROMPT, max_tokens=100_000, stream=True)
        list(stream)
    wait_for(lambda: all(i["outstanding"] == 0 for i in router.instances()), 10, "legs released")
    wait_for(lambda: blocks_used(producer) == 0 and blocks_used(consumer) == 0, 30,
             "no blocks left held (the producer's hold ends at defer_timeout)")


@pytest.mark.parametrize("mode", ["write", "read"])
def test_backend_api_key_serves_engines_run_with_api_key(procs, reference, mode):
    router, producer, consumer = deploy(procs, mode, router_flags=("--backend-api-key", "engine-key"),
                                        engine_flags=("--api-key", "engine-key"))
    expected = client_for(reference.base_url).completions.create(model=TINY_MODEL, prompt=PROMPT, max_tokens=8,
                                                                 temperature=0, extra_body={"ignore_eos": True})
    answer = client_for(router.base_url).completions.create(model=TINY_MODEL, prompt=PROMPT, max_tokens=8,
                                                            temperature=0, extra_body={"ignore_eos": True})
    assert answer.choices[0].text == expected.choices[0].text
    assert router.metric("pd_router_fallbacks_total", {"reason": "prefill_failed"}) == 0

    # The same engines behind a router without the key: the engine's 401 reaches the client.
    keyless = start_router(procs)
    heartbeats = [Heartbeat(keyless.registration_port,
                            registration_record(i["instance_id"], i["role"], i["http"], control=i["control"],
                                                boot_nonce=i["boot_nonce"], mode=i["mode"], model=i["model"]))
                  for i in router.instances()]
    try:
        keyless.wait_for_instances(2)
        with pytest.raises(openai.AuthenticationError):
            client_for(keyless.base_url).completions.create(model=TINY_MODEL, prompt=PROMPT, max_tokens=8)
    finally:
        for heartbeat in heartbeats:
            heartbeat.stop()
