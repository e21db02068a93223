// Fuzzes the chat-template parser and evaluator: the input is a template source; when it parses,
// it is rendered against a fixed conversation. Errors are fine; crashes, hangs, leaks and sanitizer
// reports are not.
#include <string_view>

#include "tokenizer/jinja.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const nlohmann::ordered_json context = nlohmann::ordered_json::parse(R"({
    "bos_token": "<s>", "eos_token": "</s>", "add_generation_prompt": true, "enable_thinking": false,
    "tools": [{"type": "function", "function": {"name": "f", "description": "d",
               "parameters": {"type": "object", "properties": {"a": {"type": "string", "enum": ["x", "y"]}},
                              "required": ["a"]}}}],
    "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi 中文 😀"},
                 {"role": "assistant", "content": null, "tool_calls": [{"type": "function",
                  "function": {"name": "f", "arguments": {"a": "x"}}}]},
                 {"role": "tool", "content": "{\"r\": 1}"}, {"role": "assistant", "content": "<think>r</think>ok"}]
  })");
  const std::string_view source(reinterpret_cast<const char*>(data), size);
  auto parsed = pd::tokenizer::jinja::Template::parse(source);
  if (!parsed.ok()) return 0;
  auto rendered = (*parsed)->render(context);
  (void)rendered;
  return 0;
}
