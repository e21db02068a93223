"""pdrouter with real P/D deployments: a producer and a consumer pdserve with the connector,
discovered through their own registration heartbeats. WRITE and READ flows, stream and
not, with the greedy answer equal to a collocated engine's; prefill failure falls back to
collocated decode with the answer still correct; client disconnect frees blocks on both
sides."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import openai
import pytest

from conftest import http_request, metric_value, start_pdserve, wait_for
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


# Well below CONNECTOR_TIMEOUTS: a hold that ends only at defer_timeout (WRITE) or transfer_timeout (READ)
# is seen as held here.
RELEASED_WITHIN_S = 2.0


def producer_requests(producer) -> float:
    """Completion requests the engine answered, whatever their status."""
    samples = re.findall(r'^pd_http_requests_total\{([^}]*)\}\s+(\S+)$', producer.metrics(), re.M)
    return sum(float(value) for labels, value in samples if 'route="/v1/completions"' in labels)


def test_a_request_the_engine_refuses_is_refused_by_the_router_before_any_leg(deployment):
    """max_tokens: -1 would pass on the producer leg (rewritten to 1) and be refused by the consumer."""
    mode, router, producer, consumer = deployment
    direct = http_request(consumer.base_url, "POST", "/v1/completions",
                          body={"model": TINY_MODEL, "prompt": PROMPT, "max_tokens": -1})
    before = producer_requests(producer)
    status, body, _ = http_request(router.base_url, "POST", "/v1/completions",
                                   body={"model": TINY_MODEL, "prompt": PROMPT, "max_tokens": -1})
    assert status == direct[0] == 400
    error, engine_error = json.loads(body)["error"], json.loads(direct[1])["error"]
    # The engine's error: same fields; the message's upper bound is the engine's context length there.
    assert {k: error[k] for k in ("type", "param", "code")} == {k: engine_error[k] for k in ("type", "param", "code")}
    assert error["message"].startswith("'max_tokens' must be an integer between 1 and")
    status, body, _ = http_request(router.base_url, "POST", "/v1/completions",
                                   body={"model": TINY_MODEL, "prompt": PROMPT, "temperature": -1})
    direct = http_request(consumer.base_url, "POST", "/v1/completions",
                          body={"model": TINY_MODEL, "prompt": PROMPT, "temperature": -1})
    assert status == direct[0] == 400 and json.loads(body) == json.loads(direct[1])
    chat_status, chat_body, _ = http_request(router.base_url, "POST", "/v1/chat/completions",
                                             body={"model": TINY_MODEL, "messages": [], "max_tokens": 4})
    assert chat_status == 400 and json.loads(chat_body)["error"]["param"] == "messages"
    assert producer_requests(producer) == before
    assert router.metric("pd_router_requests_invalid_total") >= 2


def test_requests_the_consumer_refuses_release_the_producers_blocks_at_once(deployment):
    """Beyond the consumer's context length (a bound only the engine knows): the producer computed the
    prompt for a consumer that refused it. Its blocks must come back now, not at its timeout."""
    mode, router, producer, consumer = deployment
    wait_for(lambda: blocks_used(producer) == 0, 30, "an idle producer")
    client = client_for(router.base_url)

    async def refused(i: int):
        async_client = openai.AsyncOpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0,
                                          timeout=60)
        async with async_client:
            with pytest.raises(openai.BadRequestError):
                await async_client.completions.create(model=TINY_MODEL, prompt=f"{i} " + "word " * 100,
                                                      max_tokens=100_000)

    async def all_refused():
        await asyncio.gather(*(refused(i) for i in range(24)))

    asyncio.run(all_refused())
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=TINY_MODEL, prompt=PROMPT, max_tokens=100_000, stream=True)
    wait_for(lambda: blocks_used(producer) == 0, RELEASED_WITHIN_S,
             "the producer's blocks released right after the consumer refused")
    assert router.metric("pd_router_transfer_releases_total", {"outcome": "failed"}) == 0


def test_clients_that_abort_early_leave_no_blocks_held_on_the_producer(deployment):
    """Clients that close within the first 50 ms, at every point of the P/D exchange."""
    mode, router, producer, consumer = deployment
    wait_for(lambda: blocks_used(producer) == 0 and blocks_used(consumer) == 0, 30, "idle engines")
    body = (b'{"model":"%s","prompt":"%s","max_tokens":64,"ignore_eos":true,"stream":true}'
            % (TINY_MODEL.encode(), b"word " * 200))
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    sockets = []
    for i in range(25):
        sock = socket.create_connection((router.host, router.port), timeout=30)
        sock.sendall(request)
        sockets.append((time.monotonic() + i * 0.002, sock))
    for abort_at, sock in sockets:  # the stimulus: each client closes at its own moment in 0..50 ms
        time.sleep(max(0.0, abort_at - time.monotonic()))
        sock.close()
    wait_for(lambda: all(i["outstanding"] == 0 for i in router.instances()), 30, "router legs released")
    wait_for(lambda: blocks_used(producer) == 0, RELEASED_WITHIN_S,
             "the producer's blocks released right after the clients went away")
    wait_for(lambda: blocks_used(consumer) == 0, 10, "the consumer's blocks released")


def test_batched_prompts_are_served_through_pd_like_one_pdserve(deployment, reference):
    """`prompt` as a list of strings or of token-id lists: one answer, choice per prompt, summed usage."""
    mode, router, producer, consumer = deployment
    for prompt in (["The capital of", "Once upon a time", "Tiny models"], [[1, 2, 3, 4], [5, 6, 7]]):
        expected = client_for(reference.base_url).completions.create(model=TINY_MODEL, prompt=prompt, max_tokens=6,
                                                                     temperature=0, extra_body={"ignore_eos": True})
        answer = client_for(router.base_url).completions.create(model=TINY_MODEL, prompt=prompt, max_tokens=6,
                                                                temperature=0, extra_body={"ignore_eos": True})
        assert [c.index for c in answer.choices] == list(range(len(prompt)))
        assert [c.text for c in answer.choices] == [c.text for c in expected.choices]
        assert answer.usage.prompt_tokens == expected.usage.prompt_tokens
        assert answer.usage.completion_tokens == 6 * len(prompt)
        chunks = list(client_for(router.base_url).completions.create(
            model=TINY_MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        texts = ["" for _ in prompt]
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        assert texts == [c.text for c in expected.choices]
        assert chunks[-1].usage.completion_tokens == 6 * len(prompt)
    assert router.metric("pd_router_fallbacks_total", {"reason": "batched_prompts"}) == 4
