// Tool calls in generated chat text: a pure parser per model family (no I/O,
// no engine), used by the chat handler for whole replies and for streams.
//
//   kHermes     Qwen2.5 / Qwen3: each call is a `<tool_call>{"name": ...,
//               "arguments": {...}}</tool_call>` block; text outside the blocks
//               is content. A block whose JSON is not a call stays content.
//   kLlama3Json Llama 3: the whole reply (after optional whitespace and
//               `<|python_tag|>`) is `{"name": ..., "parameters": {...}}`, or
//               several such objects separated by ';'. Anything else, or JSON
//               that is not a call, is content.
//
// Streams: feed() takes each text delta and returns what can be said now.
// Hermes holds back text that may be the start of `<tool_call>` and emits a
// call (first its id, type and name, then its arguments) once its closing tag
// arrives; Llama 3 decides on its first non-space character and, when that is
// '{', holds the reply until finish(). Whitespace right before or between calls
// is not content.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "server/openai_protocol.h"

namespace pd::server {

enum class ToolCallFormat { kNone, kHermes, kLlama3Json };

// The format a chat template instructs its model to use: kHermes when it
// writes `<tool_call>` with JSON inside, kLlama3Json for Llama 3's
// header-tagged template that asks for {"name", "parameters"}; kNone otherwise.
ToolCallFormat tool_call_format_for_template(std::string_view source);

// One piece of a streamed call: the first carries id and name (arguments
// empty), later ones carry argument text.
struct ToolCallDelta {
  int32_t index = 0;
  std::optional<std::string> id;
  std::optional<std::string> name;
  std::string arguments;
};

struct ToolCallStreamDelta {
  std::string content;
  std::vector<ToolCallDelta> calls;
  bool empty() const { return content.empty() && calls.empty(); }
};

using ToolCallIdFn = std::function<std::string()>;
// vLLM's id shape: "chatcmpl-tool-" and 32 random hex digits.
std::string random_tool_call_id();

class ToolCallStreamParser {
 public:
  ToolCallStreamParser(ToolCallFormat format, ToolCallIdFn new_id);
  ToolCallStreamDelta feed(std::string_view text);
  // The generation ended: flushes what was held back.
  ToolCallStreamDelta finish();
  int32_t num_calls() const { return num_calls_; }

 private:
  void feed_hermes(ToolCallStreamDelta& out, bool final);
  void feed_llama(ToolCallStreamDelta& out, bool final);
  void emit_text(ToolCallStreamDelta& out, std::string_view text);
  bool emit_call(ToolCallStreamDelta& out, std::string_view json_text);

  enum class State { kText, kInCall, kUndecided, kJson };
  ToolCallFormat format_;
  ToolCallIdFn new_id_;
  State state_;
  std::string buffer_;       // received, not yet decided
  size_t json_start_ = 0;    // Llama 3: where the JSON starts in buffer_
  std::string pending_ws_;   // whitespace at a call boundary: dropped if a call follows
  bool at_boundary_ = true;  // at the start or right after a call
  int32_t num_calls_ = 0;
};

// A whole reply: the calls and the text outside them (nullopt when empty).
struct ParsedToolCalls {
  std::optional<std::string> content;
  std::vector<ToolCall> calls;
};
ParsedToolCalls parse_tool_calls(ToolCallFormat format, std::string_view text, const ToolCallIdFn& new_id);

// The handler's steps, shared with tests: a finished choice's text becomes
// content + tool_calls (finish_reason "tool_calls" when any were found), and a
// stream delta becomes a chat chunk's delta object.
void apply_tool_calls(ChoiceResult& result, ToolCallFormat format, const ToolCallIdFn& new_id);
nlohmann::ordered_json tool_call_stream_delta_json(const ToolCallStreamDelta& delta);

// tool_choice "required" / named (vLLM): the reply was held to tool_choice_schema, so it is
// the call itself. Named: one call of that function whose arguments are the reply's text,
// content "", finish_reason the engine's ("stop", as OpenAI and vLLM give a named call).
// Required: the reply is a JSON array of {"name", "parameters"}; each item becomes a call
// (arguments spelled as Python's json.dumps), content "", finish_reason "tool_calls". A reply
// cut short (max_tokens) that does not parse stays content.
void apply_forced_tool_calls(ChoiceResult& result, ChatRequest::ForcedTool forced, const std::string& name,
                             const ToolCallIdFn& new_id);

// The same for a stream: a named call opens with the first text (id, type, name, arguments
// so far) and streams its arguments as they come; a "required" reply is held to the end and
// sent as calls (each: id, type and name, then arguments), or as content if it does not parse.
class ForcedToolCallStream {
 public:
  ForcedToolCallStream(ChatRequest::ForcedTool forced, std::string name, ToolCallIdFn new_id);
  ToolCallStreamDelta feed(std::string_view text, bool finished);
  // finish_reason "tool_calls" (required, and its calls parsed) rather than the engine's.
  bool finishes_with_tool_calls() const { return forced_ == ChatRequest::ForcedTool::kRequired && num_calls_ > 0; }

 private:
  ChatRequest::ForcedTool forced_;
  std::string name_;
  ToolCallIdFn new_id_;
  bool opened_ = false;
  std::string held_;
  int32_t num_calls_ = 0;
};

}  // namespace pd::server
