"""Tool calls on /v1/chat/completions against a real pdserve on builtin:tiny (Qwen3 chat template, so the
Hermes <tool_call> format), driven by the official client.

builtin:tiny generates random text, so this covers the request path end to end (tools and tool-call
history validated and rendered into the prompt, tool_choice rules, the reply's shape with tools) and
leaves the parsing of replies to the unit tests of server/tool_calls, which the handler runs unchanged.
"""

from __future__ import annotations

import json

import openai
import pytest

from conftest import start_pdserve

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(module_procs):
    return start_pdserve(module_procs, "--model", "builtin:tiny", "--max-model-len", "2048",
                         "--served-model-name", "tiny", "--seed", "0")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def rendered(server, **body) -> tuple[list[int], str]:
    status, raw, _ = server.post("/tokenize", body)
    assert status == 200, raw
    tokens = json.loads(raw)["tokens"]
    status, raw, _ = server.post("/detokenize", {"tokens": tokens})
    assert status == 200, raw
    return tokens, json.loads(raw)["prompt"]


def test_tools_are_rendered_into_the_prompt(server):
    plain_tokens, plain = rendered(server, messages=MESSAGES)
    tool_tokens, text = rendered(server, messages=MESSAGES, tools=TOOLS)
    assert "<tools>" not in plain and "get_weather" not in plain
    assert "<tools>" in text and "get_weather" in text and "Current weather of a city" in text
    assert len(tool_tokens) > len(plain_tokens)


@pytest.mark.parametrize("tool_choice", [None, "auto", "none"])
def test_chat_with_tools_counts_the_rendered_prompt(client, server, tool_choice):
    kwargs = {} if tool_choice is None else {"tool_choice": tool_choice}
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                         temperature=0, **kwargs)
    tokens, _ = rendered(server, messages=MESSAGES, tools=TOOLS)
    # "none" renders the tools too (as vLLM does); only the reply is left unparsed.
    assert out.usage.prompt_tokens == len(tokens)
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.finish_reason == "tool_calls":
        assert choice.message.tool_calls
    else:
        assert isinstance(choice.message.content, str) and not choice.message.tool_calls


def test_streamed_chat_with_tools_says_what_the_whole_reply_says(client):
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=24, temperature=0,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == (whole.choices[0].message.content or "")
    names = [tc.function.name for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])
             if tc.function and tc.function.name]
    assert names == [tc.function.name for tc in whole.choices[0].message.tool_calls or []]
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_tool_call_history_is_rendered(server):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "chatcmpl-tool-0123", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-0123", "content": "sunny, 21 C"},
    ]
    _, text = rendered(server, messages=history, tools=TOOLS)
    assert "<tool_call>" in text and '"name": "get_weather"' in text and "Paris" in text
    assert "<tool_response>" in text and "sunny, 21 C" in text


def test_a_named_tool_choice_must_name_one_of_the_tools(client):
    # "required" and named functions are served (tests/integration/test_structured_output.py).
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    error = caught.value.body
    assert error["param"] == "tool_choice"
    assert "get_time" in error["message"]


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": "get_weather"}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"messages": MESSAGES + [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tool_fields_are_400_naming_the_field(server, body, param):
    status, raw, _ = server.post("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, **body})
    assert status == 400, raw
    assert json.loads(raw)["error"]["param"] == param
