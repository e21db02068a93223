"""prompt_logprobs as vLLM serves them, driven by the official openai client (extra_body): the list's
shape, its consistency with the logprobs of generated tokens, the prefix cache left unread, chunked
prefill, n > 1, and the same answer through a P/D deployment (the producer computes them) as from one
pdserve. Also the router's per-instance leg latency and leg failure metrics."""

from __future__ import annotations

import math
import re
import socket
import time

import openai
import pytest

from conftest import metric_value, start_pdserve, wait_for
from router_fixtures import TINY_MODEL, Registrar, pdserve_flags, registration_record, start_router

# 16-token steps: a 40-token prompt is prefilled in three chunks.
ENGINE_FLAGS = ("--model", TINY_MODEL, "--max-model-len", "512", "--max-num-batched-tokens", "16")
PROMPT_IDS = [(7 * i + 3) % 200 + 10 for i in range(40)]


@pytest.fixture(scope="module")
def server(module_procs):
    return start_pdserve(module_procs, *ENGINE_FLAGS)


def client_for(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def prompt_logprobs_of(obj) -> list:
    return obj.model_extra["prompt_logprobs"]


def complete(client, prompt, prompt_logprobs, **kwargs):
    extra = {"ignore_eos": True, **kwargs.pop("extra_body", {})}
    if prompt_logprobs is not None:
        extra["prompt_logprobs"] = prompt_logprobs
    kwargs.setdefault("max_tokens", 1)
    kwargs.setdefault("temperature", 0)
    return client.completions.create(model=TINY_MODEL, prompt=prompt, extra_body=extra, **kwargs)


def check_shape(entries: list, prompt: list[int], k: int):
    """vLLM's list: null, then per prompt token {id: {logprob, rank, decoded_token}}: the prompt token
    first (its vocabulary rank), then the top-k (ranks 1..k, descending logprobs)."""
    assert len(entries) == len(prompt)
    assert entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        own_key = str(prompt[position])
        assert list(entry)[0] == own_key, (position, entry)
        own = entry[own_key]
        assert own["logprob"] <= 0 and own["rank"] >= 1 and isinstance(own["decoded_token"], str)
        by_rank = sorted(entry.values(), key=lambda v: v["rank"])
        ranks = [v["rank"] for v in by_rank]
        assert ranks == list(range(1, k + 1)) + ([] if own["rank"] <= k else [own["rank"]]), (position, entry)
        logprobs = [v["logprob"] for v in by_rank]
        assert logprobs == sorted(logprobs, reverse=True), (position, entry)


def test_completion_prompt_logprobs_have_vllms_shape(server):
    out = complete(client_for(server.base_url), PROMPT_IDS, 3)
    check_shape(prompt_logprobs_of(out.choices[0]), PROMPT_IDS, 3)
    zero = complete(client_for(server.base_url), PROMPT_IDS[:5], 0)
    entries = prompt_logprobs_of(zero.choices[0])
    assert entries[0] is None and all(list(e) == [str(t)] for e, t in zip(entries[1:], PROMPT_IDS[1:5]))
    plain = complete(client_for(server.base_url), PROMPT_IDS[:5], None)
    assert prompt_logprobs_of(plain.choices[0]) is None


def test_a_generated_tokens_logprob_is_the_prompt_logprob_of_that_token_after_the_prompt(server):
    """Greedy t after P with logprob l: P + [t] sent with prompt_logprobs gives t, at the last position, l.
    P spans three prefill chunks, so the rows of every chunk line up with their positions."""
    client = client_for(server.base_url)
    generated = complete(client, PROMPT_IDS, None, max_tokens=3, logprobs=0,
                         extra_body={"return_tokens_as_token_ids": True})
    steps = generated.choices[0].logprobs
    tokens = [int(t.removeprefix("token_id:")) for t in steps.tokens]
    extended = PROMPT_IDS + tokens
    entries = prompt_logprobs_of(complete(client, extended, 1).choices[0])
    for i, (token, logprob) in enumerate(zip(tokens, steps.token_logprobs)):
        entry = entries[len(PROMPT_IDS) + i][str(token)]
        assert math.isclose(entry["logprob"], logprob, abs_tol=2e-3), (i, entry, logprob)
        assert entry["rank"] == 1, "a greedy token is the most likely one"


def test_the_prefix_cache_is_not_read_and_the_answer_repeats(server):
    """Stats are published after each step, so a request's hits show once a later request has run: each
    reading of the hit counter follows a request of a prompt never seen (its own hits are 0)."""
    client = client_for(server.base_url)
    prompt = [t + 300 for t in PROMPT_IDS]
    complete(client, prompt, None)  # caches the prompt's two full blocks
    hits = metric_value(server.metrics(), "pd_prefix_cache_hit_tokens_total") or 0.0
    first = prompt_logprobs_of(complete(client, prompt, 2).choices[0])
    second = prompt_logprobs_of(complete(client, prompt, 2).choices[0])
    complete(client, [t + 600 for t in PROMPT_IDS], None)
    assert (metric_value(server.metrics(), "pd_prefix_cache_hit_tokens_total") or 0.0) == hits
    assert second == first
    complete(client, prompt, None)
    complete(client, [t + 900 for t in PROMPT_IDS], None)
    assert metric_value(server.metrics(), "pd_prefix_cache_hit_tokens_total") == hits + 32, \
        "without prompt_logprobs the same prompt hits its cached blocks"


def test_n_choices_share_their_prompts_logprobs_and_chat_has_them_at_the_top(server):
    client = client_for(server.base_url)
    out = complete(client, PROMPT_IDS, 2, n=2, seed=3, temperature=0.8, max_tokens=4)
    assert prompt_logprobs_of(out.choices[0]) == prompt_logprobs_of(out.choices[1])
    check_shape(prompt_logprobs_of(out.choices[1]), PROMPT_IDS, 2)
    chat = client.chat.completions.create(model=TINY_MODEL, messages=[{"role": "user", "content": "hello there"}],
                                          max_tokens=2, extra_body={"prompt_logprobs": 1})
    entries = prompt_logprobs_of(chat)
    assert entries[0] is None and len(entries) == chat.usage.prompt_tokens
    assert all(len(e) in (1, 2) for e in entries[1:])


def test_stream_and_out_of_range_are_refused_naming_the_field(server):
    client = client_for(server.base_url)
    for prompt_logprobs, kwargs in ((1, {"stream": True}), (21, {})):
        with pytest.raises(openai.BadRequestError) as info:
            complete(client, PROMPT_IDS[:4], prompt_logprobs, **kwargs)
        assert info.value.body["param"] == "prompt_logprobs"


# ---- through the P/D router ----

@pytest.fixture(scope="module", params=["write", "read"])
def pd_deployment(request, module_procs):
    router = start_router(module_procs)
    for role, kv_role in (("producer", "kv_producer"), ("consumer", "kv_consumer")):
        start_pdserve(module_procs, "--kv-role", kv_role, "--max-num-batched-tokens", "16",
                      *pdserve_flags(role, router=router, mode=request.param))
    wait_for(lambda: {i["role"] for i in router.instances()} >= {"producer", "consumer"}, 20,
             "producer and consumer registered")
    return request.param, router


def test_pd_answers_the_prompt_logprobs_one_pdserve_gives(pd_deployment, server):
    mode, router = pd_deployment
    expected = complete(client_for(server.base_url), PROMPT_IDS, 2, max_tokens=4)
    answer = complete(client_for(router.base_url), PROMPT_IDS, 2, max_tokens=4)
    assert router.metric("pd_router_decisions_total", {"flow": mode, "reason": "always"}) >= 1
    assert answer.choices[0].text == expected.choices[0].text
    got, want = prompt_logprobs_of(answer.choices[0]), prompt_logprobs_of(expected.choices[0])
    assert [sorted(e) if e else e for e in got] == [sorted(e) if e else e for e in want]
    for g, w in zip(got[1:], want[1:]):
        for key in w:
            assert g[key]["rank"] == w[key]["rank"] and math.isclose(g[key]["logprob"], w[key]["logprob"],
                                                                      abs_tol=1e-4)
    messages = [{"role": "user", "content": "hello there"}]
    chat_want = client_for(server.base_url).chat.completions.create(
        model=TINY_MODEL, messages=messages, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1})
    chat_got = client_for(router.base_url).chat.completions.create(
        model=TINY_MODEL, messages=messages, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 1})
    assert [sorted(e) if e else e for e in prompt_logprobs_of(chat_got)] == \
        [sorted(e) if e else e for e in prompt_logprobs_of(chat_want)]


def sample_sum(text: str, name: str, labels: dict) -> float:
    """Sum of a family's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}\s+(\S+)$", line)
        if not match or match.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2)))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
    return total


def test_router_exports_leg_latency_per_instance_and_failures_by_reason(pd_deployment):
    mode, router = pd_deployment
    ids = {i["role"]: i["instance_id"] for i in router.instances()}
    count = "pd_router_leg_latency_seconds_count"
    before = router.metrics()
    client = client_for(router.base_url)
    complete(client, PROMPT_IDS[:8], None, max_tokens=2)
    complete(client, PROMPT_IDS[:8], None, max_tokens=2, n=2, seed=1, temperature=0.5)  # sent whole: collocated
    for instance, leg in ((ids["producer"], "prefill"), (ids["consumer"], "decode"), (ids["consumer"], "collocated")):
        labels = {"instance": instance, "leg": leg}
        # A WRITE producer's leg may end after the client got its answer.
        wait_for(lambda: metric_value(router.metrics(), count, labels) == (metric_value(before, count, labels) or 0.0)
                 + 1, 10, f"one more {leg} leg on {instance}")
        assert metric_value(router.metrics(), "pd_router_leg_latency_seconds_sum", labels) > 0

    # A registered producer whose port refuses: its legs fail, counted against it by reason.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    live = {i["role"]: i for i in router.instances()}["producer"]
    dead = registration_record(f"dead-producer-{mode}", "producer", f"127.0.0.1:{dead_port}",
                               control=live["control"], mode=mode)
    registrar = Registrar(router.registration_port)
    try:
        registrar.send_record(dead)
        wait_for(lambda: dead["instance_id"] in router.instance_ids(), 10, "dead producer registered")
        failures = {"instance": dead["instance_id"], "leg": "prefill"}
        deadline = time.monotonic() + 20
        while sample_sum(router.metrics(), "pd_router_instance_leg_failures_total", failures) == 0:
            assert time.monotonic() < deadline, "the dead producer was never tried"
            registrar.send_record(dead)
            complete(client, PROMPT_IDS[:8], None, max_tokens=2)
        text = router.metrics()
        assert sample_sum(text, "pd_router_instance_leg_failures_total", {**failures, "reason": "transport"}) + \
            sample_sum(text, "pd_router_instance_leg_failures_total", {**failures, "reason": "connect"}) >= 1
        assert sample_sum(text, "pd_router_leg_failures_total", {"leg": "prefill"}) >= 1
        assert metric_value(text, count, {"instance": dead["instance_id"], "leg": "prefill"}) is None, \
            "a failed leg has no latency sample"
    finally:
        registrar.close()
