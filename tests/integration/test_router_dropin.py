"""pdrouter as a drop-in front for OpenAI clients: every error it answers has pdserve's shape
({"error": {"message", "type", "param", "code"}}), and the same bad request sent straight to pdserve
and through the router gets the same status, type, code and param; n > 1 through a P/D deployment
answers every choice, as one pdserve does."""

from __future__ import annotations

import json

import openai
import pytest

from conftest import start_pdserve, wait_for
from router_fixtures import TINY_MODEL, free_port, pdserve_flags, start_router

KEY = "s3cret"
BODY_LIMIT = 4096
ENGINE_FLAGS = ["--model", TINY_MODEL, "--max-model-len", "256", "--api-key", KEY,
                "--max-body-bytes", str(BODY_LIMIT)]
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def engine(module_procs):
    return start_pdserve(module_procs, *ENGINE_FLAGS)


@pytest.fixture(scope="module")
def router(module_procs, engine):
    router = start_router(module_procs, "--collocated", engine.base_url, "--api-key", KEY, "--backend-api-key", KEY,
                          "--max-body-bytes", str(BODY_LIMIT), registration=False)
    router.wait_for_instances(1)
    return router


def error_of(status: int, body: bytes) -> tuple[int, str, str | None, str | None]:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] is None or isinstance(error["code"], str), error
    return status, error["type"], error["param"], error["code"]


BAD_REQUESTS = {
    "unknown_model": ("POST", "/v1/completions", {"model": "no-such-model", "prompt": "x", "max_tokens": 1}, AUTH),
    "missing_key": ("POST", "/v1/completions", {"model": TINY_MODEL, "prompt": "x", "max_tokens": 1}, {}),
    "wrong_key": ("POST", "/v1/chat/completions", {"model": TINY_MODEL, "messages": []},
                  {"Authorization": "Bearer nope"}),
    "not_json": ("POST", "/v1/completions", b"{not json", AUTH),
    "not_an_object": ("POST", "/v1/chat/completions", b"[1, 2]", AUTH),
    "stream_not_bool": ("POST", "/v1/completions", {"model": TINY_MODEL, "prompt": "x", "stream": "yes"}, AUTH),
    "model_not_string": ("POST", "/v1/completions", {"model": 7, "prompt": "x"}, AUTH),
    "bad_temperature": ("POST", "/v1/completions",
                        {"model": TINY_MODEL, "prompt": "x", "max_tokens": 1, "temperature": -1}, AUTH),
    "unsupported_field": ("POST", "/v1/completions",
                          {"model": TINY_MODEL, "prompt": "x", "max_tokens": 1, "suffix": "y"}, AUTH),
    "body_too_large": ("POST", "/v1/completions",
                       {"model": TINY_MODEL, "prompt": "x" * (2 * BODY_LIMIT), "max_tokens": 1}, AUTH),
    "unknown_route": ("GET", "/v1/nothing-here", None, AUTH),
    "wrong_method": ("GET", "/v1/completions", None, AUTH),
    "tokenize_without_key": ("POST", "/tokenize", {"model": TINY_MODEL, "prompt": "x"}, {}),
    "tokenize_not_json": ("POST", "/tokenize", b"{oops", AUTH),
}


@pytest.mark.parametrize("name", sorted(BAD_REQUESTS))
def test_same_error_straight_and_through_router(name, engine, router):
    method, path, body, headers = BAD_REQUESTS[name]
    from conftest import http_request

    direct = error_of(*http_request(engine.base_url, method, path, body, headers=headers)[:2])
    routed = error_of(*http_request(router.base_url, method, path, body, headers=headers)[:2])
    assert routed == direct, (name, direct, routed)
    assert direct[0] >= 400


def test_codes_name_the_failure(engine, router):
    from conftest import http_request

    cases = {
        "unknown_model": (404, "invalid_request_error", "model", "model_not_found"),
        "missing_key": (401, "authentication_error", None, "invalid_api_key"),
        "stream_not_bool": (400, "invalid_request_error", "stream", "invalid_value"),
        "body_too_large": (413, "invalid_request_error", None, "request_too_large"),
        "wrong_method": (405, "invalid_request_error", None, "method_not_allowed"),
    }
    for name, expected in cases.items():
        method, path, body, headers = BAD_REQUESTS[name]
        assert error_of(*http_request(router.base_url, method, path, body, headers=headers)[:2]) == expected, name


def test_no_instance_is_service_unavailable(procs):
    dead = f"http://127.0.0.1:{free_port()}"
    router = start_router(procs, "--collocated", dead, registration=False)
    status, body, _ = router.post("/v1/completions", {"model": TINY_MODEL, "prompt": "x", "max_tokens": 1})
    assert error_of(status, body) == (503, "service_unavailable", None, "no_instance_available")


@pytest.fixture(scope="module", params=["write", "read"])
def pd_deployment(request, module_procs):
    router = start_router(module_procs)
    for role, kv_role in (("producer", "kv_producer"), ("consumer", "kv_consumer")):
        start_pdserve(module_procs, "--kv-role", kv_role, *pdserve_flags(role, router=router, mode=request.param))
    wait_for(lambda: {i["role"] for i in router.instances()} >= {"producer", "consumer"}, 20,
             "producer and consumer registered")
    return router


@pytest.fixture(scope="module")
def reference(module_procs):
    return start_pdserve(module_procs, "--model", TINY_MODEL, "--max-model-len", "2048")


def openai_client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_n_above_one_through_pd_answers_every_choice(pd_deployment, reference):
    router = pd_deployment
    before = router.metric("pd_router_fallbacks_total", {"reason": "several_choices"})
    args = dict(model=TINY_MODEL, n=2, max_tokens=8, temperature=0.9, seed=11, extra_body={"ignore_eos": True})
    expected = openai_client(reference.base_url).completions.create(prompt="Once upon a time", **args)
    answer = openai_client(router.base_url).completions.create(prompt="Once upon a time", **args)
    assert [c.index for c in answer.choices] == [0, 1]
    assert [c.text for c in answer.choices] == [c.text for c in expected.choices]
    assert answer.usage.completion_tokens == 16

    messages = [{"role": "user", "content": "Tell me a story"}]
    expected_chat = openai_client(reference.base_url).chat.completions.create(messages=messages, **args)
    chat = openai_client(router.base_url).chat.completions.create(messages=messages, **args)
    assert [c.index for c in chat.choices] == [0, 1]
    assert [c.message.content for c in chat.choices] == [c.message.content for c in expected_chat.choices]

    chunks = list(openai_client(router.base_url).completions.create(prompt="Once upon a time", stream=True, **args))
    texts = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in expected.choices]
    assert router.metric("pd_router_fallbacks_total", {"reason": "several_choices"}) - before == 3


def test_tokenize_and_detokenize_are_forwarded(engine, router):
    from conftest import http_request

    for path, body in (("/tokenize", {"model": TINY_MODEL, "prompt": "The quick brown fox"}),
                       ("/detokenize", {"model": TINY_MODEL, "tokens": [1, 2, 3, 4]})):
        direct = http_request(engine.base_url, "POST", path, body, headers=AUTH)
        routed = http_request(router.base_url, "POST", path, body, headers=AUTH)
        assert direct[0] == routed[0] == 200, (path, direct, routed)
        assert json.loads(routed[1]) == json.loads(direct[1])
    assert router.metric("pd_router_requests_total", {"route": "/tokenize", "status": "200"}) >= 1


def test_ping_answers_like_health(router):
    assert router.get("/ping")[0] == router.get("/health")[0] == 200
    status, body, _ = router.post("/ping", {})
    assert error_of(status, body)[3] == "method_not_allowed"


def test_models_are_what_the_engine_reports(engine, router):
    from conftest import http_request

    direct = json.loads(http_request(engine.base_url, "GET", "/v1/models", headers=AUTH)[1])
    status, body, _ = http_request(router.base_url, "GET", "/v1/models", headers=AUTH)
    assert status == 200
    routed = json.loads(body)
    assert routed["data"] == direct["data"]
    assert routed["data"][0]["max_model_len"] == 256 and "root" in routed["data"][0]


def test_version_is_the_engines(engine, router):
    direct = engine.get("/version")
    routed = router.get("/version")
    assert direct[0] == routed[0] == 200
    assert json.loads(routed[1]) == json.loads(direct[1]) and json.loads(routed[1])["version"]


def test_decisions_are_counted_by_flow(pd_deployment):
    router = pd_deployment
    flows = ("read", "write", "several_choices")
    before = {flow: router.metric("pd_router_decisions_total", {"flow": flow, "reason": "always"}) for flow in flows}
    client = openai_client(router.base_url)
    client.completions.create(model=TINY_MODEL, prompt="x", max_tokens=2)
    client.completions.create(model=TINY_MODEL, prompt="x", max_tokens=2, n=2, seed=1)
    after = {flow: router.metric("pd_router_decisions_total", {"flow": flow, "reason": "always"}) for flow in flows}
    assert after["read"] + after["write"] - before["read"] - before["write"] == 1
    assert after["several_choices"] - before["several_choices"] == 1
