"""pdserve's OpenAI API against a real process on builtin:tiny, driven by the official client."""

from __future__ import annotations

import concurrent.futures
import json
import socket

import openai
import pytest

from conftest import http_request, metric_value, start_pdserve, wait_for

# Long enough that a max-length generation (~1 s on builtin:tiny) outlives a client that closes early.
MAX_MODEL_LEN = 2048
MAX_BODY_BYTES = 1 << 20


@pytest.fixture(scope="module")
def server(module_procs):
    return start_pdserve(module_procs, "--model", "builtin:tiny", "--max-model-len", str(MAX_MODEL_LEN),
                         "--max-body-bytes", str(MAX_BODY_BYTES), "--served-model-name", "tiny",
                         "--io-threads", "2", "--seed", "0")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def tokenize(server, **body) -> list[int]:
    status, raw, _ = server.post("/tokenize", body)
    assert status == 200, raw
    return json.loads(raw)["tokens"]


def kv_blocks_used(server) -> float | None:
    return metric_value(server.metrics(), "pd_kv_blocks_used")


def wait_idle(server, timeout_s: float = 30.0):
    """All requests finished and every KV block back in the pool."""
    def idle():
        text = server.metrics()
        return (metric_value(text, "pd_kv_blocks_used") == 0 and metric_value(text, "pd_num_requests_running") == 0
                and metric_value(text, "pd_num_requests_waiting") == 0)
    wait_for(idle, timeout_s, "pd_kv_blocks_used == 0 and no running/waiting requests")


# ---- completions ----

def test_completion_returns_text_and_usage_consistent_with_tokenize(client, server):
    prompt = "The quick brown fox"
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
    assert out.object == "text_completion"
    assert out.id.startswith("cmpl-")
    assert out.model == "tiny"
    assert len(out.choices) == 1 and isinstance(out.choices[0].text, str)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.prompt_tokens == len(tokenize(server, prompt=prompt))
    assert 1 <= out.usage.completion_tokens <= 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_completion_ignore_eos_generates_exactly_max_tokens(client):
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 12
    assert out.choices[0].finish_reason == "length"


def test_batch_of_prompts_gives_one_choice_each(client, server):
    prompts = ["one", "two two", "three three three"]
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.prompt_tokens == sum(len(tokenize(server, prompt=p)) for p in prompts)
    assert out.usage.completion_tokens == 12
    single = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert out.choices[1].text == single.choices[0].text


def test_token_id_prompt_matches_text_prompt(client, server):
    text = "Paged attention keeps the cache in blocks"
    ids = tokenize(server, prompt=text)
    by_text = client.completions.create(model="tiny", prompt=text, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=8, temperature=0)
    assert [c.text for c in batch.choices] == [by_text.choices[0].text] * 2


def test_stop_string_truncates_and_is_reported(client):
    base = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) >= 8, base
    stop = base[len(base) // 2: len(base) // 2 + 2]
    expected = base[: base.find(stop)]
    out = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=24, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.text == expected
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop


def test_stop_token_id_ends_generation(client):
    base = client.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    ids = [int(t.split(":")[1]) for t in base.choices[0].logprobs.tokens]
    assert len(ids) == 6
    target = ids[3]
    first = ids.index(target)
    out = client.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [target]})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == target
    assert out.usage.completion_tokens == first + 1


def test_min_tokens_delays_stop_token(client):
    base = client.completions.create(model="tiny", prompt="xyz", max_tokens=6, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    first_id = int(base.choices[0].logprobs.tokens[0].split(":")[1])
    stopped = client.completions.create(model="tiny", prompt="xyz", max_tokens=6, temperature=0,
                                        extra_body={"ignore_eos": True, "stop_token_ids": [first_id]})
    assert stopped.usage.completion_tokens == 1
    out = client.completions.create(model="tiny", prompt="xyz", max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True, "stop_token_ids": [first_id], "min_tokens": 6})
    assert out.usage.completion_tokens == 6


def test_completion_logprobs_shape(client):
    out = client.completions.create(model="tiny", prompt="logprobs please", max_tokens=5, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(v <= 0.0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    # Greedy: the sampled token is the most likely one.
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert token_lp == pytest.approx(max(top.values()), abs=1e-5)


def test_return_token_ids_lists_the_generated_ids_streamed_and_not(client, server):
    # vLLM's return_token_ids: the ids of the completion, the same as logprobs name them.
    kwargs = dict(model="tiny", prompt="token ids please", max_tokens=7, temperature=0)
    reference = client.completions.create(
        logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, **kwargs)
    expected = [int(t.removeprefix("token_id:")) for t in reference.choices[0].logprobs.tokens]
    whole = client.completions.create(extra_body={"ignore_eos": True, "return_token_ids": True}, **kwargs)
    assert whole.choices[0].model_extra["token_ids"] == expected
    assert whole.choices[0].logprobs is None
    chunks = list(client.completions.create(stream=True, extra_body={"ignore_eos": True, "return_token_ids": True},
                                            **kwargs))
    streamed = [i for c in chunks if c.choices for i in (c.choices[0].model_extra or {}).get("token_ids", [])]
    assert streamed == expected
    plain = client.completions.create(extra_body={"ignore_eos": True}, **kwargs)
    assert "token_ids" not in (plain.choices[0].model_extra or {})


def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        return client.completions.create(model="tiny", prompt="random", max_tokens=16, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text
    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


# ---- chat ----

def test_chat_completion_uses_the_template_and_counts_usage(client, server):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    assert out.object == "chat.completion"
    assert out.id.startswith("chatcmpl-")
    message = out.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str)
    assert out.usage.prompt_tokens == len(tokenize(server, messages=messages))
    assert 1 <= out.usage.completion_tokens <= 6


def test_chat_template_kwargs_reach_the_template(server):
    messages = [{"role": "user", "content": "Think?"}]
    plain = tokenize(server, messages=messages)
    no_think = tokenize(server, messages=messages, chat_template_kwargs={"enable_thinking": False})
    # builtin:tiny carries a Qwen3 template: enable_thinking=False adds an empty think block.
    assert len(no_think) > len(plain)


def test_chat_logprobs_shape(client):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 2
        assert entry.bytes == list(entry.token.encode("utf-8"))


# ---- streaming ----

def test_streamed_completion_matches_non_streamed_and_ends_with_usage(client):
    kwargs = dict(model="tiny", prompt="Streaming test", max_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in text_chunks)
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == 10
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens


def test_streamed_chat_opens_with_role_and_carries_content(client):
    messages = [{"role": "user", "content": "Stream me"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_stream_without_include_usage_has_no_usage_chunk(client):
    chunks = list(client.completions.create(model="tiny", prompt="p", max_tokens=3, temperature=0, stream=True))
    assert chunks and all(c.choices for c in chunks)


def test_sixty_four_concurrent_streams_all_complete(server, client):
    def one(i):
        # One shared client (httpx pools connections; each stream holds its own).
        n_tokens, finish = 0, None
        stream = client.completions.create(model="tiny", prompt=f"request number {i}", max_tokens=8,
                                           temperature=0.8, seed=i, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.usage:
                n_tokens = chunk.usage.completion_tokens
        return finish, n_tokens

    with concurrent.futures.ThreadPoolExecutor(max_workers=64) as pool:
        results = list(pool.map(one, range(64)))
    assert results == [("length", 8)] * 64
    wait_idle(server)


# ---- client disconnects ----

def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server):
    wait_idle(server)
    before = metric_value(server.metrics(), "pd_http_client_disconnects_total") or 0.0
    sock = socket.create_connection((server.host, server.port), timeout=30)
    body = json.dumps({"model": "tiny", "prompt": "never ending", "max_tokens": MAX_MODEL_LEN - 16,
                       "stream": True, "ignore_eos": True})
    sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
    received = b""
    while received.count(b"data: ") < 2:
        data = sock.recv(65536)
        assert data, "server closed the stream early"
        received += data
    assert b"200 OK" in received
    assert kv_blocks_used(server) > 0
    sock.close()
    wait_idle(server)
    wait_for(lambda: (metric_value(server.metrics(), "pd_http_client_disconnects_total") or 0) >= before + 1, 10,
             "the disconnect to be counted")
    assert server.healthy()


def test_client_disconnect_while_waiting_for_non_streamed_response_frees_blocks(server):
    wait_idle(server)
    sock = socket.create_connection((server.host, server.port), timeout=30)
    body = json.dumps({"model": "tiny", "prompt": "slow one", "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True})
    sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
    wait_for(lambda: (kv_blocks_used(server) or 0) > 0, 30, "the request to hold KV blocks")
    sock.close()
    wait_idle(server)


# ---- other endpoints ----

def test_models_lists_the_served_name(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_tokenize_and_detokenize_round_trip(server):
    status, raw, _ = server.post("/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert status == 200
    body = json.loads(raw)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    assert len(body["token_strs"]) == body["count"]
    status, raw, _ = server.post("/detokenize", {"tokens": body["tokens"]})
    assert status == 200
    assert json.loads(raw)["prompt"] == "Hello world"


def test_health_version_and_metrics_series(server, client):
    client.completions.create(model="tiny", prompt="warm", max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    assert server.get("/health")[0] == 200
    status, raw, _ = server.get("/version")
    assert status == 200 and "version" in json.loads(raw)
    text = server.metrics()
    for name in ["pd_num_requests_running", "pd_num_requests_waiting", "pd_kv_blocks_used", "pd_kv_blocks_free",
                 "pd_prompt_tokens_total", "pd_generation_tokens_total"]:
        assert metric_value(text, name) is not None, name
    assert metric_value(text, "pd_generation_tokens_total") >= 3
    for hist in ["pd_time_to_first_token_seconds", "pd_inter_token_latency_seconds"]:
        assert metric_value(text, hist + "_count") >= 1, hist
        assert metric_value(text, hist + "_bucket", {"le": "+Inf"}) >= 1, hist
    assert metric_value(text, "pd_http_requests_total", {"route": "/v1/completions", "status": "200"}) >= 1


def test_token_and_request_counters_advance_by_exactly_the_requests_served(server, client):
    # Known traffic: a non-streamed and a streamed request of known prompt and output lengths.
    # Each counter has one owner in the engine; /metrics shows its count already when the
    # client has its answer (no wait).
    wait_idle(server)
    series = [("pd_prompt_tokens_total", None), ("pd_generation_tokens_total", None),
              ("vllm:prompt_tokens_total", {"model_name": "tiny"}),
              ("vllm:generation_tokens_total", {"model_name": "tiny"}),
              ("vllm:request_success_total", {"model_name": "tiny", "finished_reason": "length"}),
              ("pd_preemptions_total", None)]
    before = server.metrics()
    client.completions.create(model="tiny", prompt=list(range(1, 8)), max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    stream = client.completions.create(model="tiny", prompt=list(range(1, 6)), max_tokens=4, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    assert sum(len(chunk.choices) for chunk in stream) >= 1
    after = server.metrics()
    delta = {name: (metric_value(after, name, labels) or 0.0) - (metric_value(before, name, labels) or 0.0)
             for name, labels in series}
    assert delta == {"pd_prompt_tokens_total": 12.0, "pd_generation_tokens_total": 7.0,
                     "vllm:prompt_tokens_total": 12.0, "vllm:generation_tokens_total": 7.0,
                     "vllm:request_success_total": 2.0, "pd_preemptions_total": 0.0}


def test_kv_transfer_params_are_accepted(server):
    status, raw, _ = server.post("/v1/completions", {"model": "tiny", "prompt": "kv", "max_tokens": 2,
                                                     "kv_transfer_params": {"do_remote_decode": False}})
    assert status == 200, raw
    assert "kv_transfer_params" in json.loads(raw)


# ---- errors: each answered with the right status and an OpenAI-shaped body; the server keeps serving ----

LONG_PROMPT = list(range(1, MAX_MODEL_LEN + 10))

ERROR_CASES = [
    ("malformed json", "POST", "/v1/completions", '{"model": "tiny", "prompt": ', 400, None),
    ("body not an object", "POST", "/v1/completions", "[1, 2, 3]", 400, None),
    ("prompt wrong type", "POST", "/v1/completions", {"model": "tiny", "prompt": 12}, 400, "prompt"),
    ("max_tokens wrong type", "POST", "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": "9"}, 400,
     "max_tokens"),
    ("messages wrong type", "POST", "/v1/chat/completions", {"model": "tiny", "messages": "hi"}, 400, "messages"),
    ("bad role", "POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "x", "content": "y"}]}, 400,
     "messages[0].role"),
    ("unknown model", "POST", "/v1/completions", {"model": "gpt-9", "prompt": "a"}, 404, "model"),
    ("unknown model chat", "POST", "/v1/chat/completions",
     {"model": "gpt-9", "messages": [{"role": "user", "content": "a"}]}, 404, "model"),
    ("prompt longer than max-model-len", "POST", "/v1/completions", {"model": "tiny", "prompt": LONG_PROMPT}, 400,
     "prompt"),
    ("text prompt longer than max-model-len", "POST", "/v1/completions",
     {"model": "tiny", "prompt": "word " * (MAX_MODEL_LEN * 2)}, 400, "prompt"),
    ("max_tokens past max-model-len", "POST", "/v1/completions",
     {"model": "tiny", "prompt": "a", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("negative max_tokens", "POST", "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": -5}, 400,
     "max_tokens"),
    ("negative temperature", "POST", "/v1/completions", {"model": "tiny", "prompt": "a", "temperature": -1}, 400,
     "temperature"),
    ("absurd temperature", "POST", "/v1/completions", {"model": "tiny", "prompt": "a", "temperature": 1e9}, 400,
     "temperature"),
    ("top_p zero", "POST", "/v1/completions", {"model": "tiny", "prompt": "a", "top_p": 0}, 400, "top_p"),
    ("absurd logprobs", "POST", "/v1/completions", {"model": "tiny", "prompt": "a", "logprobs": 1000}, 400,
     "logprobs"),
    ("n too large", "POST", "/v1/completions", {"model": "tiny", "prompt": "a", "n": 1000}, 400, "n"),
    ("echo with logprobs", "POST", "/v1/completions", {"model": "tiny", "prompt": "a", "echo": True, "logprobs": 1},
     400, "echo"),
    ("invalid guided_json", "POST", "/v1/completions", {"model": "tiny", "prompt": "a", "guided_json": {"type": 5}},
     400, "guided_json"),
    ("logit_bias outside vocab", "POST", "/v1/completions",
     {"model": "tiny", "prompt": "a", "logit_bias": {"2000000000": 1}}, 400, None),
    ("token id outside vocab", "POST", "/v1/completions", {"model": "tiny", "prompt": [2_000_000_000]}, 400, None),
    ("stop_token_ids outside vocab", "POST", "/v1/completions",
     {"model": "tiny", "prompt": "a", "stop_token_ids": [2_000_000_000]}, 400, None),
    ("detokenize outside vocab", "POST", "/detokenize", {"tokens": [2_000_000_000]}, 400, "tokens"),
    ("body over --max-body-bytes", "POST", "/v1/completions",
     {"model": "tiny", "prompt": "x" * (MAX_BODY_BYTES + 1)}, 413, None),
    ("unknown route", "GET", "/v2/nothing", None, 404, None),
    ("wrong method", "GET", "/v1/completions", None, 405, None),
]


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_bad_input_gets_openai_error_and_server_survives(server, case):
    _, method, path, body, want_status, want_param = case
    status, raw, headers = http_request(server.base_url, method, path, body)
    assert status == want_status, raw
    error = json.loads(raw)["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert set(error) >= {"message", "type", "param", "code"}
    if want_param is not None:
        assert error["param"] == want_param
    assert server.healthy()
    wait_idle(server)


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="a", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="a", max_tokens=1, extra_body={"use_beam_search": True})
    assert "beam search" in str(info.value)
