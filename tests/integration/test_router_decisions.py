"""pdrouter deciding per request (--pd-policy auto) with real pdserve processes on CPU: a long
prompt is prefilled by the producer, a short one where it decodes, one whose prefix the
decoding instance caches stays there, a loaded producer keeps long prompts local, and two
kv_both instances split long prompts between them. The router learns loads and prefix caches
from the instances' own heartbeats (load reports and KV cache events)."""

from __future__ import annotations

import json

import openai
import pytest

from conftest import metric_value, start_pdserve, wait_for
from router_fixtures import TINY_MODEL, Heartbeat, free_port, pdserve_flags, registration_record, start_router

# Small thresholds so that the tiny model's prompts fall on both sides of them.
MIN_TOKENS = 64
AUTO = ("--pd-policy", "auto", "--pd-min-prefill-tokens", str(MIN_TOKENS))
SHORT_PROMPT = "Hello there"


def long_prompt(tag: str) -> str:
    return f"{tag}: " + " ".join(f"word{i}" for i in range(80))


def client_for(router):
    return openai.OpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def decisions(router) -> dict:
    text = router.metrics()
    out = {}
    for line in text.splitlines():
        if line.startswith("pd_router_decisions_total{"):
            labels, value = line[len("pd_router_decisions_total{"):].split("} ")
            pairs = dict(item.split("=") for item in labels.split(","))
            out[(pairs["flow"].strip('"'), pairs["reason"].strip('"'))] = float(value)
    return out


def decided(router, before: dict, flow: str, reason: str) -> bool:
    after = decisions(router)
    changed = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    return changed == {(flow, reason): 1.0}


def completions_served(engine) -> float:
    return metric_value(engine.metrics(), "pd_http_requests_total",
                        {"route": "/v1/completions", "status": "200"}) or 0.0


def instance(router, role: str) -> dict:
    return next(i for i in router.instances() if i["role"] == role)


@pytest.fixture(scope="module")
def pd(module_procs):
    router = start_router(module_procs, *AUTO)
    producer = start_pdserve(module_procs, "--kv-role", "kv_producer", *pdserve_flags("producer", router=router))
    consumer = start_pdserve(module_procs, "--kv-role", "kv_consumer", *pdserve_flags("consumer", router=router))
    # Both report their load and a known (empty) prefix cache.
    wait_for(lambda: all("load" in i and i["kv_cached_blocks"] is not None for i in router.instances())
             and len(router.instances()) == 2, 20, "load reports of producer and consumer")
    return router, producer, consumer


def test_a_long_prompt_is_prefilled_by_the_producer(pd):
    router, producer, consumer = pd
    before, served = decisions(router), completions_served(producer)
    out = client_for(router).completions.create(model=TINY_MODEL, prompt=long_prompt("a"), max_tokens=3,
                                                temperature=0)
    assert out.usage.prompt_tokens >= MIN_TOKENS
    assert decided(router, before, "write", "long_prompt")
    assert completions_served(producer) == served + 1


def test_a_short_prompt_is_prefilled_where_it_decodes(pd):
    router, producer, consumer = pd
    before, served = decisions(router), completions_served(producer)
    out = client_for(router).completions.create(model=TINY_MODEL, prompt=SHORT_PROMPT, max_tokens=3)
    assert out.usage.prompt_tokens < MIN_TOKENS
    assert decided(router, before, "local", "short_prompt")
    assert completions_served(producer) == served


def test_a_chat_is_tokenized_by_an_engine_and_decided_on_its_templated_length(pd):
    router, producer, consumer = pd
    before = decisions(router)
    client_for(router).chat.completions.create(model=TINY_MODEL, max_tokens=2,
                                               messages=[{"role": "user", "content": long_prompt("chat")}])
    assert decided(router, before, "write", "long_prompt")
    before = decisions(router)
    client_for(router).chat.completions.create(model=TINY_MODEL, max_tokens=2,
                                               messages=[{"role": "user", "content": "hi"}])
    assert decided(router, before, "local", "short_prompt")


def plan(router, body: dict, route: str = "/v1/completions") -> dict:
    """What the router would do with this request now (POST /pd/plan/...: nothing is served)."""
    status, text, _ = router.post("/pd/plan" + route, body)
    assert status == 200, text
    return json.loads(text)


def test_a_prompt_the_consumer_caches_stays_on_the_consumer(pd):
    router, producer, consumer = pd
    prompt = long_prompt("cached")
    # A P/D request just before: its KV lands on the consumer, whose cache events for it may reach the
    # router after the ones below.
    client_for(router).completions.create(model=TINY_MODEL, prompt=long_prompt("earlier"), max_tokens=2)
    # The consumer computes this prompt itself (a request sent to it directly) and caches its blocks.
    direct = openai.OpenAI(base_url=consumer.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    answer = direct.completions.create(model=TINY_MODEL, prompt=prompt, max_tokens=1)
    # Every full block of this prompt in the router's view of the consumer (pdserve's default block size,
    # 16). A count of the view's blocks is no proof: events of earlier requests (the P/D ones above, whose
    # KV landed on the consumer) may still be on their way, up to one heartbeat after them.
    full_blocks = answer.usage.prompt_tokens // 16
    body = {"model": TINY_MODEL, "prompt": prompt, "max_tokens": 2}

    def consumer_cached_tokens():
        planned = plan(router, body)
        return next(i["cached_tokens"] for i in planned["instances"] if i["role"] == "consumer") >= full_blocks * 16

    wait_for(consumer_cached_tokens, 10, "the consumer's KV cache events for the whole prompt reach the router")
    assert plan(router, body)["flow"] == "local"
    before, served = decisions(router), completions_served(producer)
    client_for(router).completions.create(model=TINY_MODEL, prompt=prompt, max_tokens=2)
    assert decided(router, before, "local", "cached_prefix")
    assert completions_served(producer) == served


def test_the_plan_of_a_request_is_shown_without_serving_it(pd):
    router, producer, consumer = pd
    before, served = decisions(router), completions_served(producer) + completions_served(consumer)
    planned = plan(router, {"model": TINY_MODEL, "prompt": long_prompt("plan"), "max_tokens": 2})
    assert planned["flow"] == "write" and planned["reason"] == "long_prompt"
    assert planned["prompt_tokens"] >= MIN_TOKENS
    assert planned["decoder"] == instance(router, "consumer")["instance_id"]
    assert planned["producer"] == instance(router, "producer")["instance_id"]
    assert {i["role"] for i in planned["instances"]} == {"producer", "consumer"}
    chat = plan(router, {"model": TINY_MODEL, "messages": [{"role": "user", "content": "hi"}]},
                "/v1/chat/completions")
    assert (chat["flow"], chat["reason"]) == ("local", "short_prompt")
    # Nothing was served or counted as a decision.
    assert decisions(router) == before
    assert completions_served(producer) + completions_served(consumer) == served
    status, text, _ = router.post("/pd/plan/v1/completions", {"model": TINY_MODEL, "max_tokens": -1})
    assert status == 400, text


def test_a_loaded_producer_keeps_a_long_prompt_local(module_procs):
    router = start_router(module_procs, *AUTO)
    consumer = start_pdserve(module_procs, "--kv-role", "kv_consumer", *pdserve_flags("consumer", router=router))
    # A producer whose heartbeat reports a long prefill queue (nothing ever connects to it).
    record = registration_record("busy-producer", "producer", f"127.0.0.1:{free_port()}")
    record["load"] = {"running": 4, "waiting": 30, "kv_blocks_free": 10, "kv_blocks_total": 1000,
                      "queued_prefill_tokens": 1_000_000}
    heartbeat = Heartbeat(router.registration_port, record, period_s=0.5)
    try:
        wait_for(lambda: {i["role"] for i in router.instances() if "load" in i} == {"producer", "consumer"}, 20,
                 "consumer and loaded producer registered")
        before = decisions(router)
        client_for(router).completions.create(model=TINY_MODEL, prompt=long_prompt("busy"), max_tokens=2)
        assert decided(router, before, "local", "producer_busy")
        assert instance(router, "producer")["load"]["queued_prefill_tokens"] == 1_000_000
    finally:
        heartbeat.stop()


def test_two_kv_both_instances_split_long_prompts_and_keep_short_ones_local(module_procs):
    router = start_router(module_procs, *AUTO)
    first = start_pdserve(module_procs, "--kv-role", "kv_both", *pdserve_flags("both", router=router))
    second = start_pdserve(module_procs, "--kv-role", "kv_both", *pdserve_flags("both", router=router))
    wait_for(lambda: len([i for i in router.instances() if "load" in i]) == 2, 20, "both instances reporting")
    client = client_for(router)
    before = decisions(router)
    reference = client.completions.create(model=TINY_MODEL, prompt=long_prompt("pair"), max_tokens=4,
                                          temperature=0)
    assert decided(router, before, "write", "long_prompt")
    served = completions_served(first) + completions_served(second)
    assert served == 2  # one prefilled, the other decoded
    before = decisions(router)
    client.completions.create(model=TINY_MODEL, prompt=SHORT_PROMPT, max_tokens=2)
    assert decided(router, before, "local", "short_prompt")
    assert completions_served(first) + completions_served(second) == served + 1
    # The split answer is the one a single instance gives for the same greedy request.
    alone = openai.OpenAI(base_url=first.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    direct = alone.completions.create(model=TINY_MODEL, prompt=long_prompt("pair"), max_tokens=4, temperature=0)
    assert direct.choices[0].text == reference.choices[0].text
    assert json.loads(router.get("/health")[1])["status"] == "ok"


def test_a_restarted_router_gets_each_cache_whole_by_asking_for_it(module_procs):
    """A new router sees an instance's event stream mid-way (a gap): it asks for a snapshot and gets one."""
    port = free_port()
    first = start_router(module_procs, *AUTO, "--registration-port", str(port))
    engine = start_pdserve(module_procs, "--kv-role", "kv_consumer", *pdserve_flags("consumer", router=first))
    direct = openai.OpenAI(base_url=engine.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    direct.completions.create(model=TINY_MODEL, prompt=long_prompt("restart"), max_tokens=1)
    wait_for(lambda: (instance(first, "consumer").get("kv_cached_blocks") or 0) > 0, 10, "the first router's view")
    cached = instance(first, "consumer")["kv_cached_blocks"]
    first.process.stop()
    second = start_router(module_procs, *AUTO, "--registration-port", str(port))
    wait_for(lambda: second.instances() and instance(second, "consumer").get("kv_cached_blocks") == cached, 15,
             "the second router's view after its resync request")
    assert second.metric("pd_router_kv_resyncs_total") >= 1
