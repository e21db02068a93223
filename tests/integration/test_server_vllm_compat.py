"""pdserve as a drop-in for vLLM's clients: the sampling fields vLLM serves, the ones it refuses, and the
metrics a vLLM dashboard reads. A real pdserve on builtin:tiny, driven by the official openai client."""

from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest

from conftest import metric_value, start_pdserve

MODEL = "tiny"
DASHBOARD_SERIES = Path(__file__).resolve().parents[1] / "data" / "vllm_dashboard_series.txt"
# Long enough for full KV blocks (16 tokens each) that n > 1 choices can share.
LONG_PROMPT = "The quick brown fox jumps over the lazy dog while the cat watches from the garden wall. " * 3


@pytest.fixture(scope="module")
def server(module_procs):
    return start_pdserve(module_procs, "--model", "builtin:tiny", "--max-model-len", "1024",
                         "--served-model-name", MODEL, "--seed", "0")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def complete(client, **kwargs):
    kwargs.setdefault("model", MODEL)
    kwargs.setdefault("prompt", "vllm compat")
    kwargs.setdefault("max_tokens", 8)
    kwargs.setdefault("temperature", 0)
    extra = kwargs.pop("extra_body", {})
    extra.setdefault("ignore_eos", True)
    return client.completions.create(extra_body=extra, **kwargs)


def token_ids(choice) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def greedy_ids(client, **kwargs) -> list[int]:
    extra = kwargs.pop("extra_body", {})
    extra["return_tokens_as_token_ids"] = True
    return token_ids(complete(client, logprobs=0, extra_body=extra, **kwargs).choices[0])


# ---- n > 1 ----

def test_n_choices_are_seed_plus_index_streams_and_share_the_prompts_kv(client, server):
    hits_before = metric_value(server.metrics(), "pd_prefix_cache_hit_tokens_total") or 0.0
    out = complete(client, prompt=LONG_PROMPT, n=3, seed=7, temperature=1.0, max_tokens=12)
    assert [c.index for c in out.choices] == [0, 1, 2]
    prompt_tokens = out.usage.prompt_tokens
    assert prompt_tokens > 32
    assert out.usage.completion_tokens == 3 * 12  # the prompt counts once, every choice's tokens count
    # Choice j draws from seed + j, exactly as a single request with that seed.
    for j, choice in enumerate(out.choices):
        alone = complete(client, prompt=LONG_PROMPT, seed=7 + j, temperature=1.0, max_tokens=12)
        assert choice.text == alone.choices[0].text, j
    assert len({c.text for c in out.choices}) > 1
    # Choices 1 and 2 found the prompt's full blocks in the prefix cache (at least 2 blocks each).
    hits = metric_value(server.metrics(), "pd_prefix_cache_hit_tokens_total") - hits_before
    assert hits >= 2 * 32, hits


def test_n_with_a_batch_of_prompts_orders_choices_prompt_major(client):
    out = complete(client, prompt=["first prompt", "second prompt"], n=2, max_tokens=4)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    first = complete(client, prompt="first prompt", max_tokens=4).choices[0].text
    second = complete(client, prompt="second prompt", max_tokens=4).choices[0].text
    assert [c.text for c in out.choices] == [first, first, second, second]  # greedy: siblings agree


def test_n_streams_every_choice(client):
    chunks = list(complete(client, prompt=LONG_PROMPT, n=3, max_tokens=5, stream=True,
                           stream_options={"include_usage": True}))
    texts = {}
    finished = set()
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2}
    assert chunks[-1].usage.completion_tokens == 15
    whole = complete(client, prompt=LONG_PROMPT, max_tokens=5).choices[0].text
    assert texts == {0: whole, 1: whole, 2: whole}


def test_chat_n_gives_n_choices(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2,
                                         max_tokens=4, temperature=1.0, seed=3)
    assert [c.index for c in out.choices] == [0, 1]


# ---- logits processing ----

def test_logit_bias_forces_a_token_and_allowed_token_ids_restrict_them(client):
    baseline = greedy_ids(client)
    forced = baseline[0] + 1
    assert greedy_ids(client, logit_bias={str(forced): 100}) == [forced] * 8
    allowed = [11, 13]
    got = greedy_ids(client, temperature=1.0, seed=1, extra_body={"allowed_token_ids": allowed})
    assert set(got) <= set(allowed) and len(got) == 8


def test_frequency_and_repetition_penalties_break_a_repetition(client):
    # Two tokens biased far above the rest; without penalties greedy keeps picking one of them.
    baseline = greedy_ids(client, logit_bias={"11": 50, "13": 50})
    assert set(baseline) <= {11, 13}
    repeated = max(set(baseline), key=baseline.count)
    assert baseline.count(repeated) >= 5, baseline
    got = greedy_ids(client, logit_bias={"11": 50, "13": 50}, frequency_penalty=2.0)
    assert {11, 13} <= set(got), got  # each repeat costs 2 more: the other one gets its turn
    got = greedy_ids(client, logit_bias={"11": 50, "13": 50}, extra_body={"repetition_penalty": 2.0})
    assert {11, 13} <= set(got), got  # about 50 / 2 once generated: the other one wins


def test_presence_penalty_pushes_a_generated_token_below_a_close_rival(client, server):
    prompt = json.loads(server.post("/tokenize", {"prompt": "presence of mind"})[1])["tokens"]
    first = greedy_ids(client, prompt=prompt, max_tokens=1)[0]
    context = prompt + [first]
    # Raw logprobs (before any processing) of the next token after `first`.
    own = complete(client, prompt=context, max_tokens=1, logprobs=0,
                   extra_body={"allowed_token_ids": [first]}).choices[0].logprobs.token_logprobs[0]
    top = complete(client, prompt=context, max_tokens=1, logprobs=20,
                   extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs.top_logprobs[0]
    rival, rival_lp = next((int(k.removeprefix("token_id:")), v) for k, v in top.items()
                           if k != f"token_id:{first}")
    # Biases that leave `first` the step-1 argmax (it already is, and its bias is the larger)
    # and make it lead `rival` by exactly 1 at step 2: less than the penalty of 2.
    bias = {str(first): 50.0, str(rival): 50.0 + (own - rival_lp) - 1.0}
    assert greedy_ids(client, prompt=prompt, max_tokens=2, logit_bias=bias) == [first, first]
    assert greedy_ids(client, prompt=prompt, max_tokens=2, logit_bias=bias, presence_penalty=2.0) == [first, rival]


def test_repetition_penalty_counts_prompt_tokens(client):
    # The prompt holds token 11: its biased logit is halved before anything is generated.
    first = greedy_ids(client, prompt=[11, 11, 11], max_tokens=1, logit_bias={"11": 50, "13": 40},
                       extra_body={"repetition_penalty": 2.0})
    assert first == [13]


def test_bad_words_ban_the_word(client, server):
    baseline = complete(client, prompt="bad words", max_tokens=6, logprobs=0)
    first = baseline.choices[0].logprobs.tokens[0]
    assert first.strip(), "the test needs a first token with visible text"
    out = complete(client, prompt="bad words", max_tokens=6, logprobs=0, extra_body={"bad_words": [first.strip()]})
    assert out.choices[0].logprobs.tokens[0] != first


def test_min_tokens_holds_back_eos_and_stop_ids(client):
    base = greedy_ids(client, max_tokens=6)
    out = complete(client, max_tokens=6, extra_body={"stop_token_ids": [base[0]], "min_tokens": 4})
    assert out.usage.completion_tokens >= 4


# ---- echo, truncate_prompt_tokens, continuous usage ----

def test_echo_prefixes_the_prompt_streamed_and_not(client):
    out = complete(client, prompt="echo me", max_tokens=4, echo=True)
    plain = complete(client, prompt="echo me", max_tokens=4)
    assert out.choices[0].text == "echo me" + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in complete(client, prompt="echo me", max_tokens=4, echo=True,
                                                          stream=True) if c.choices)
    assert streamed == out.choices[0].text



def test_echo_of_a_token_prompt_is_its_decoded_text(client, server):
    prompt_text = json.loads(server.post("/detokenize", {"tokens": [40, 41, 42]})[1])["prompt"]
    out = complete(client, prompt=[40, 41, 42], max_tokens=2, echo=True)
    plain = complete(client, prompt=[40, 41, 42], max_tokens=2)
    assert out.choices[0].text == prompt_text + plain.choices[0].text


def test_echo_with_logprobs_is_refused(client):
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, echo=True, logprobs=1)
    assert info.value.body["param"] == "echo"


def test_truncate_prompt_tokens_keeps_the_last_k(client, server):
    out = complete(client, prompt=LONG_PROMPT, max_tokens=3, extra_body={"truncate_prompt_tokens": 5})
    assert out.usage.prompt_tokens == 5
    ids = json.loads(server.post("/tokenize", {"prompt": LONG_PROMPT})[1])["tokens"]
    same = complete(client, prompt=ids[-5:], max_tokens=3)
    assert out.choices[0].text == same.choices[0].text


def test_continuous_usage_stats_puts_usage_on_every_chunk(client):
    chunks = list(complete(client, max_tokens=5, stream=True,
                           stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts and all(c.usage is not None for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1].usage.completion_tokens == 5 and not chunks[-1].choices


# ---- logprobs as vLLM writes them ----

def test_sampled_token_is_always_in_top_logprobs(client):
    out = complete(client, prompt="sampled", max_tokens=12, temperature=1.5, seed=5, logprobs=1)
    lp = out.choices[0].logprobs
    for token, top in zip(lp.tokens, lp.top_logprobs):
        assert token in top
        assert 1 <= len(top) <= 2
        values = list(top.values())
        assert values == sorted(values, reverse=True)  # rank order
    zero = complete(client, prompt="sampled", max_tokens=4, logprobs=0).choices[0].logprobs
    assert all(list(top) == [token] for token, top in zip(zero.tokens, zero.top_logprobs))


def test_text_offset_counts_characters(client):
    out = complete(client, prompt="offsets", max_tokens=10, logprobs=0)
    lp = out.choices[0].logprobs
    expected, at = [], 0
    for token in lp.tokens:
        expected.append(at)
        at += len(token)  # Python counts code points, as vLLM does
    assert lp.text_offset == expected


# ---- refused, never ignored ----

REFUSED = [
    ("use_beam_search", True), ("guided_decoding_backend", "xgrammar"), ("structural_tag", "x"),
    ("response_format", {"type": "structural_tag"}), ("length_penalty", 0.5), ("logits_processors", ["x"]),
    ("priority", 1), ("cache_salt", "s"), ("spaces_between_special_tokens", False),
    ("tool_choice", "required"), ("best_of", 3),
]


@pytest.mark.parametrize("field,value", REFUSED, ids=[f for f, _ in REFUSED])
def test_unimplemented_fields_are_refused_naming_the_field(client, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, extra_body={field: value})
    assert info.value.body["param"] == field
    assert info.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as chat_info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       extra_body={field: value})
    assert chat_info.value.body["param"] == field


def test_chat_tools_are_served_and_completion_tools_refused(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, extra_body={"tools": tools})
    assert info.value.body["param"] == "tools"
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], tools=tools,
                                         tool_choice="none", max_tokens=2)
    assert out.choices[0].message.tool_calls in (None, [])
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], tools=tools,
                                         max_tokens=2)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_errors_share_one_shape(server):
    for path, body in [("/v1/completions", {"model": MODEL, "prompt": "a", "guided_decoding_backend": "outlines"}),
                       ("/v1/completions", {"model": MODEL, "prompt": "a", "structural_tag": "x"}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "a"}],
                                                 "use_beam_search": True})]:
        status, raw, _ = server.post(path, body)
        assert status == 400, raw
        error = json.loads(raw)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_parameter"


# ---- metrics a vLLM dashboard reads ----

def dashboard_series() -> list[str]:
    names = [line.strip() for line in DASHBOARD_SERIES.read_text().splitlines()]
    return [n for n in names if n and not n.startswith("#")]


def test_metrics_export_every_series_of_the_vllm_dashboard(client, server):
    complete(client, max_tokens=4)
    complete(client, prompt="n", n=2, max_tokens=3)
    text = server.metrics()
    exported = {}
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}\s", line)
        if match:
            exported.setdefault(match.group(1), []).append(match.group(2))
    series = dashboard_series()
    assert len(series) >= 15
    for name in series:
        assert name in exported, f"{name} is not exported"
        assert any(f'model_name="{MODEL}"' in labels for labels in exported[name]), name
    assert metric_value(text, "vllm:request_success_total", {"model_name": MODEL, "finished_reason": "length"}) >= 3
    assert metric_value(text, "vllm:generation_tokens_total", {"model_name": MODEL}) >= 10
    assert metric_value(text, "vllm:e2e_request_latency_seconds_count", {"model_name": MODEL}) >= 3
    for name in ["vllm:num_preemptions_total", "vllm:time_per_output_token_seconds_count",
                 "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count"]:
        assert metric_value(text, name, {"model_name": MODEL}) is not None, name
