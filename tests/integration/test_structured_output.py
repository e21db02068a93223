"""Structured output (vLLM's response_format, guided_*, structured_outputs) and forced tool choice
(tool_choice "required" / named) on a real pdserve with builtin:tiny, through the official client.

builtin:tiny's text is random, so every answer here is valid only because the grammar held the
sampler to it. JSON constraints ask for compact whitespace (structured_outputs.disable_any_whitespace)
so that a random model cannot pad an object forever; where a schema allows open-ended output
(extra keys, longer arrays), a logit_bias on the closing brackets ends it as soon as the grammar
allows, which unconstrained would have produced the bracket first.
"""

from __future__ import annotations

import json
import re

import openai
import pytest

from conftest import metric_value, start_pdserve, wait_for
from router_fixtures import TINY_MODEL, pdserve_flags, start_router

try:
    import jsonschema
except ImportError:  # checked by hand below
    jsonschema = None

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                   "size": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "color", "size"],
    "additionalProperties": False,
}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
        "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]
MESSAGES = [{"role": "user", "content": "What is the weather?"}]


def check_schema(value):
    if jsonschema is not None:
        jsonschema.validate(value, SCHEMA)
        return
    assert set(value) == {"ok", "color", "size"}
    assert isinstance(value["ok"], bool) and value["color"] in ("red", "green", "blue")
    assert isinstance(value["size"], int) and 0 <= value["size"] <= 9


@pytest.fixture(scope="module")
def server(module_procs):
    return start_pdserve(module_procs, "--model", TINY_MODEL, "--max-model-len", "2048", "--seed", "0")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def closing_bias(server):
    """logit_bias +100 on the single tokens that close JSON containers."""
    bias = {}
    for text in ("}", "]", "}]", "}}", "}}]"):
        status, raw, _ = server.post("/tokenize", {"prompt": text, "add_special_tokens": False})
        assert status == 200, raw
        tokens = json.loads(raw)["tokens"]
        if len(tokens) == 1:
            bias[str(tokens[0])] = 100
    assert bias
    return bias


@pytest.mark.parametrize("chat", [False, True])
def test_json_schema_output_validates(client, chat):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    if chat:
        out = client.chat.completions.create(model=TINY_MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                                             response_format=fmt, extra_body=COMPACT)
        text = out.choices[0].message.content
    else:
        out = client.completions.create(model=TINY_MODEL, prompt="A thing:", max_tokens=60, temperature=0,
                                        extra_body={"response_format": fmt, **COMPACT})
        text = out.choices[0].text
    assert out.choices[0].finish_reason == "stop", text
    check_schema(json.loads(text))


def test_json_object_parses_although_the_bias_favours_quotes_and_closing_brackets(server, client, closing_bias):
    # Quotes close every string at once, brackets every container: a short object, or {}.
    status, raw, _ = server.post("/tokenize", {"prompt": '"', "add_special_tokens": False})
    assert status == 200, raw
    bias = {**closing_bias, str(json.loads(raw)["tokens"][0]): 100}
    out = client.completions.create(model=TINY_MODEL, prompt="JSON:", max_tokens=40, temperature=0, logit_bias=bias,
                                    extra_body={"response_format": {"type": "json_object"}, **COMPACT})
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].text), dict)
    plain = client.completions.create(model=TINY_MODEL, prompt="JSON:", max_tokens=1, temperature=0, logit_bias=bias)
    assert plain.choices[0].text.startswith(('"', "}", "]"))  # what the bias alone produces


def test_regex_choice_and_grammar_hold(client):
    out = client.completions.create(model=TINY_MODEL, prompt="Code:", max_tokens=20, temperature=0.8, seed=3,
                                    extra_body={"guided_regex": "(ab|cd){2,4}x"})
    assert re.fullmatch("(ab|cd){2,4}x", out.choices[0].text), out.choices[0].text
    assert out.choices[0].finish_reason == "stop"
    colors = ["red", "green", "dark blue"]
    out = client.completions.create(model=TINY_MODEL, prompt="Color:", max_tokens=10, n=3, seed=1,
                                    extra_body={"guided_choice": colors})
    assert all(c.text in colors for c in out.choices), [c.text for c in out.choices]
    grammar = 'start: greeting " " name\ngreeting: "hello" | "hi"\nname: "bob" | "alice"\n'
    out = client.chat.completions.create(model=TINY_MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                         extra_body={"guided_grammar": grammar})
    assert re.fullmatch("(hello|hi) (bob|alice)", out.choices[0].message.content)
    out = client.completions.create(model=TINY_MODEL, prompt="Digits:", max_tokens=10, temperature=0,
                                    extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert re.fullmatch("[0-9]{3}", out.choices[0].text)


def test_logprobs_n_and_max_tokens_with_a_constraint(client):
    out = client.completions.create(model=TINY_MODEL, prompt="Yes or no?", max_tokens=5, n=2, seed=7, logprobs=2,
                                    extra_body={"guided_choice": ["yes", "no"]})
    for choice in out.choices:
        assert choice.text in ("yes", "no")
        # The mask applies before logprobs (as in vLLM): the chosen token is among the top 2.
        for token, top in zip(choice.logprobs.tokens, choice.logprobs.top_logprobs):
            assert token in top
    cut = client.completions.create(model=TINY_MODEL, prompt="A thing:", max_tokens=3, temperature=0,
                                    extra_body={"guided_json": SCHEMA, **COMPACT})
    assert cut.choices[0].finish_reason == "length"
    assert cut.choices[0].text.startswith("{") and cut.usage.completion_tokens == 3


def test_named_tool_choice_returns_a_call_with_valid_arguments(client):
    out = client.chat.completions.create(model=TINY_MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=40,
                                         temperature=0, extra_body=COMPACT,
                                         tool_choice={"type": "function", "function": {"name": "get_time"}})
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "stop"  # OpenAI's and vLLM's for a named call
    assert len(message.tool_calls) == 1 and message.tool_calls[0].function.name == "get_time"
    assert json.loads(message.tool_calls[0].function.arguments)["zone"] in ("utc", "cet")
    assert message.tool_calls[0].id.startswith("chatcmpl-tool-")


def test_required_tool_choice_returns_calls_of_the_given_tools(client, closing_bias):
    out = client.chat.completions.create(model=TINY_MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=80,
                                         temperature=0, tool_choice="required", logit_bias=closing_bias,
                                         extra_body=COMPACT)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls"
    assert message.tool_calls, message
    for call in message.tool_calls:
        params = TOOLS[0 if call.function.name == "get_weather" else 1]["function"]["parameters"]
        assert call.function.name in ("get_weather", "get_time")
        args = json.loads(call.function.arguments)
        key = next(iter(params["properties"]))
        assert args[key] in params["properties"][key]["enum"]


def test_streaming_equals_non_streaming_for_greedy(client, closing_bias):
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}, **COMPACT}
    whole = client.completions.create(model=TINY_MODEL, prompt="Stream:", max_tokens=60, temperature=0,
                                      extra_body=body)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=TINY_MODEL, prompt="Stream:", max_tokens=60, temperature=0, extra_body=body, stream=True))
    assert streamed == whole.choices[0].text
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(model=TINY_MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=40,
                                           temperature=0, tool_choice=named, extra_body=COMPACT)
    args, names, finish = "", [], None
    for chunk in client.chat.completions.create(model=TINY_MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=40,
                                                temperature=0, tool_choice=named, extra_body=COMPACT, stream=True):
        for call in chunk.choices[0].delta.tool_calls or []:
            names += [call.function.name] if call.function.name else []
            args += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["get_weather"] and args == whole.choices[0].message.tool_calls[0].function.arguments
    assert finish == "stop"
    required = client.chat.completions.create(model=TINY_MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=80,
                                              temperature=0, tool_choice="required", logit_bias=closing_bias,
                                              extra_body=COMPACT, stream=True)
    calls, finish = {}, None
    for chunk in required:
        for call in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": None, "arguments": ""})
            entry["name"] = call.function.name or entry["name"]
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls
    assert all(json.loads(c["arguments"]) for c in calls.values())


@pytest.mark.parametrize("extra,param", [
    ({"guided_json": {"type": 5}}, "guided_json"),
    ({"guided_regex": "(ab"}, "guided_regex"),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_invalid_or_conflicting_constraints_are_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=TINY_MODEL, prompt="x", max_tokens=5, extra_body=extra)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param, err.value.body


def test_pd_constrained_output_is_valid_and_equals_collocated(procs, client):
    router = start_router(procs)
    extra = {"defer_timeout": 5, "transfer_timeout": 10}
    start_pdserve(procs, "--kv-role", "kv_producer", *pdserve_flags("producer", router=router, extra=extra))
    consumer = start_pdserve(procs, "--kv-role", "kv_consumer", *pdserve_flags("consumer", router=router, extra=extra))
    wait_for(lambda: {i["role"] for i in router.instances()} >= {"producer", "consumer"}, 20,
             "producer and consumer registered")
    pd = openai.OpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    body = {"guided_json": SCHEMA, **COMPACT}
    expected = client.completions.create(model=TINY_MODEL, prompt="A P/D thing:", max_tokens=60, temperature=0,
                                         extra_body=body)
    got = pd.completions.create(model=TINY_MODEL, prompt="A P/D thing:", max_tokens=60, temperature=0,
                                extra_body=body)
    check_schema(json.loads(got.choices[0].text))
    assert got.choices[0].text == expected.choices[0].text
    assert got.choices[0].finish_reason == "stop"
    # The consumer took the producer's first token (same constraint, same key) and advanced its own
    # matcher past it before sampling the rest.
    accepted = metric_value(consumer.metrics(), "pd_connector_first_tokens_total", {"result": "accepted"})
    assert accepted and accepted >= 1


def test_without_the_grammar_library_the_server_runs_and_says_why(procs):
    server = start_pdserve(procs, "--model", TINY_MODEL, "--max-model-len", "512",
                           env={"PDSERVE_LLGUIDANCE_LIBRARY": "/nonexistent/llguidance/_lib.abi3.so"})
    status, raw, _ = server.post("/v1/completions", {"prompt": "a", "max_tokens": 2, "guided_regex": "a+"})
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert error["param"] == "guided_regex"
    assert "unavailable" in error["message"] and "/nonexistent/llguidance/_lib.abi3.so" in error["message"]
    status, raw, _ = server.post("/v1/completions", {"prompt": "a", "max_tokens": 2})
    assert status == 200, raw
    assert sum("structured output disabled" in line for line in server.process.output) == 1

