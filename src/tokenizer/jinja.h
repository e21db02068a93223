// A Jinja2 interpreter for the subset real HF chat templates use, configured as transformers
// configures jinja2 (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols,
// tojson = json.dumps(ensure_ascii=False), raise_exception, strftime_now, namespace, dict).
//
// A Template is parsed once (at model load) and is immutable; render() keeps all state on its own
// stack, so one Template renders from any number of threads at once.
#pragma once

#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace pd::tokenizer::jinja {

struct Node;

// Bounds on one render, so a hostile or buggy template cannot hang or exhaust a server thread.
struct RenderLimits {
  uint64_t max_steps = 2'000'000;  // evaluation steps; real templates need well under 100k
  size_t max_output_bytes = 64u << 20;
  int max_call_depth = 100;  // macro recursion
};

class Template {
 public:
  // Errors: kInvalidArgument for a syntax error, kUnimplemented for a construct, filter or test this
  // interpreter does not support; both name it and give line:column.
  static Result<std::shared_ptr<const Template>> parse(std::string_view source);
  ~Template();

  // context: the template's top-level variables (messages, tools, add_generation_prompt, ...).
  // Errors: kInvalidArgument for raise_exception (with its message) and for runtime type errors
  // (what went wrong, at which line), kResourceExhausted past the output / step limits.
  Result<std::string> render(const nlohmann::ordered_json& context, const RenderLimits& limits = {}) const;

 private:
  Template() = default;
  std::unique_ptr<Node> root_;
};

}  // namespace pd::tokenizer::jinja
