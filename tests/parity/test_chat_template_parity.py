"""Rendered chat prompts of pd_tokenizer's Jinja interpreter vs transformers' own jinja2 rendering
(ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, its tojson / raise_exception /
strftime_now) for every chat template the project carries."""
import copy
import json

import pytest

from conftest import ASSETS, TokenizerCli

transformers = pytest.importorskip("transformers")
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

TEMPLATE_DIRS = {
    "qwen2.5": ASSETS / "qwen2.5",
    "qwen3": ASSETS / "qwen3",
    **{p.name: p for p in sorted((ASSETS / "chat_templates").iterdir()) if p.is_dir()},
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a given city.\n  Returns Celsius.  ",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. \"Paris\""},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Unit"},
                "days": {"type": "integer", "description": "Days ahead", "default": 0, "minimum": 0},
                "tags": {"type": "array", "items": {"type": "string"}, "description": "Tags"},
                "opts": {"type": "object", "description": "Options", "properties": {"x": {"type": "number"}}},
            },
            "required": ["city"],
        },
    },
}
# gpt-oss's template cannot render a nested object parameter (it applies unary minus to a string), so
# the flat variant is what lets its tool rendering be compared.
WEATHER_TOOL_FLAT = copy.deepcopy(WEATHER_TOOL)
del WEATHER_TOOL_FLAT["function"]["parameters"]["properties"]["opts"]
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web",
        "parameters": {"type": "object", "properties": {"q": {"type": "string", "description": "query"}}, "required": ["q"]},
    },
}

UNICODE = "中文 😀 \"quotes\" 'single' back\\slash\ttab\nnew line  <|im_end|> é"

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "Hello!"}],
    "system_user": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}],
    "multi_turn": [
        {"role": "system", "content": "Be helpful."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    "no_system_multi_turn": [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ],
    "thinking_in_content": [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "<think>\nLet me see.\n</think>\n\nThe answer is 42."},
        {"role": "user", "content": "Again?"},
    ],
    "reasoning_field": [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "because"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2", "reasoning": "r2"},
    ],
    "unicode": [{"role": "system", "content": UNICODE}, {"role": "user", "content": UNICODE + "  \n\n"}],
    "tool_calls_dict_args": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "tags": ["a", 1, True, None], "opts": {"x": 1.5}}}}
            ],
        },
        {"role": "tool", "content": "{\"temp\": 20}"},
        {"role": "tool", "content": "second result"},
        {"role": "assistant", "content": "It is 20C."},
    ],
    "tool_calls_string_args": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "Weather in Rome and Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}},
                {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}},
            ],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rain"},
        {"role": "user", "content": "<tool_response>x</tool_response>"},
    ],
    "gpt_oss_channels": [
        {"role": "developer", "content": "Follow the rules."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "thinking": "greet"},
        {"role": "assistant", "content": "Call", "tool_calls": [{"name": "search", "arguments": {"q": "x"}}]},
        {"role": "tool", "content": "found"},
        {"role": "user", "content": "thanks"},
    ],
    "final_channel": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "channel": "final"},
        {"role": "user", "content": "Bye"},
    ],
    "empty": [],
    "system_only": [{"role": "system", "content": "only system"}],
}

EXTRAS = [
    {},
    {"enable_thinking": False},
    {"enable_thinking": True, "reasoning_effort": "high", "builtin_tools": ["browser", "python"], "model_identity": "You are X."},
]


def config_of(folder):
    return json.loads((folder / "tokenizer_config.json").read_text())


def template_of(folder):
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text()
    return config_of(folder)["chat_template"]


def special_token(value):
    if isinstance(value, dict):
        return value.get("content")
    return value


def reference(folder, messages, add_generation_prompt, tools, extra):
    """transformers' render with the special tokens map (bos/eos when set) and extra kwargs."""
    config = config_of(folder)
    kwargs = {}
    for key in ("bos_token", "eos_token"):
        token = special_token(config.get(key))
        if token:
            kwargs[key] = token
    kwargs.update(extra)
    try:
        rendered, _ = render_jinja_template(
            conversations=[copy.deepcopy(messages)],
            tools=copy.deepcopy(tools),
            chat_template=template_of(folder),
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
        return rendered[0], None
    except Exception as e:  # the template raised, or jinja2 failed: ours must fail too
        return None, f"{type(e).__name__}: {e}"


@pytest.fixture(scope="module", params=sorted(TEMPLATE_DIRS))
def template_cli(request):
    name = request.param
    cli = TokenizerCli("--template-dir", str(TEMPLATE_DIRS[name]))
    yield name, TEMPLATE_DIRS[name], cli
    cli.close()


def test_every_template_renders_like_jinja2(template_cli):
    name, folder, cli = template_cli
    checked = 0
    failures = []
    for conv_name, messages in CONVERSATIONS.items():
        for tools in (None, [WEATHER_TOOL, SEARCH_TOOL], [WEATHER_TOOL_FLAT]):
            for extra in EXTRAS:
                for add_generation_prompt in (False, True):
                    expected, ref_error = reference(folder, messages, add_generation_prompt, tools, extra)
                    got = cli.ask(
                        {"op": "render", "messages": messages, "add_generation_prompt": add_generation_prompt, "tools": tools, "extra": extra}
                    )
                    case = f"{name}/{conv_name} tools={tools is not None} extra={extra} gen={add_generation_prompt}"
                    if ref_error is not None:
                        if "error" not in got:
                            failures.append(f"{case}: jinja2 failed ({ref_error}) but ours rendered {got.get('text')!r}")
                    elif got.get("text") != expected:
                        failures.append(f"{case}:\n expected {expected!r}\n got      {got!r}")
                    checked += 1
    assert checked > 0
    assert not failures, f"{len(failures)}/{checked} differ; first:\n" + "\n".join(failures[:3])


def test_raise_exception_is_an_invalid_argument_naming_the_message(cli_factory):
    cli = cli_factory("--template-dir", str(TEMPLATE_DIRS["gpt-oss"]))
    got = cli.ask({"op": "render", "messages": [{"role": "tool", "content": "x"}], "add_generation_prompt": True})
    assert got["code"] == "INVALID_ARGUMENT"
    assert "Message has tool role, but there was no previous assistant message with a tool call!" in got["error"]


def test_tokenizer_folder_renders_the_same_as_template_only_load(cli_factory):
    full = cli_factory("--dir", str(ASSETS / "qwen3"))
    only = cli_factory("--template-dir", str(ASSETS / "qwen3"))
    for messages in CONVERSATIONS.values():
        req = {"op": "render", "messages": messages, "add_generation_prompt": True, "extra": {"enable_thinking": False}}
        assert full.ask(req) == only.ask(req)
