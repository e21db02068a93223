#include "server/tool_calls.h"

#include <algorithm>
#include <random>
#include <variant>

#include <fmt/format.h>

#include "common/json_depth.h"
#include "server/openai_protocol.h"

namespace pd::server {

using ojson = nlohmann::ordered_json;

namespace {

constexpr std::string_view kCallOpen = "<tool_call>";
constexpr std::string_view kCallClose = "</tool_call>";
constexpr std::string_view kPythonTag = "<|python_tag|>";
// Deeper model output is not a call (the request parser's default bound).
constexpr size_t kMaxCallJsonDepth = 64;

bool is_space(char c) {
  return c == ' ' || c == '\n' || c == '\t' || c == '\r';
}

bool all_space(std::string_view text) {
  return std::all_of(text.begin(), text.end(), is_space);
}

// Length of the longest suffix of text that is a proper prefix of tag.
size_t partial_tag_suffix(std::string_view text, std::string_view tag) {
  for (size_t k = std::min(text.size(), tag.size() - 1); k > 0; --k)
    if (text.substr(text.size() - k) == tag.substr(0, k)) return k;
  return 0;
}

// JSON as Python's json.dumps(value, ensure_ascii=False) writes it (", " and
// ": " separators), which is how vLLM spells arguments.
void python_dumps(const ojson& value, std::string& out) {
  if (value.is_object()) {
    out += '{';
    bool first = true;
    for (const auto& [key, item] : value.items()) {
      if (!first) out += ", ";
      first = false;
      out += ojson(key).dump();
      out += ": ";
      python_dumps(item, out);
    }
    out += '}';
  } else if (value.is_array()) {
    out += '[';
    bool first = true;
    for (const auto& item : value) {
      if (!first) out += ", ";
      first = false;
      python_dumps(item, out);
    }
    out += ']';
  } else {
    out += value.dump(-1, ' ', false, ojson::error_handler_t::replace);
  }
}

// A call object: {"name": string, "arguments"|"parameters": object}.
std::optional<std::pair<std::string, std::string>> read_call(std::string_view json_text) {
  // Depth-bounded like a request body: python_dumps recurses once per level of model output.
  auto parsed = parse_json_object(json_text, kMaxCallJsonDepth);
  if (!std::holds_alternative<ojson>(parsed)) return std::nullopt;
  ojson value = std::move(std::get<ojson>(parsed));
  auto name = value.find("name");
  if (name == value.end() || !name->is_string() || name->get_ref<const std::string&>().empty()) return std::nullopt;
  auto args = value.find("arguments");
  if (args == value.end()) args = value.find("parameters");
  std::string arguments;
  if (args == value.end() || args->is_null())
    arguments = "{}";
  else if (args->is_object())
    python_dumps(*args, arguments);
  else
    return std::nullopt;
  return std::make_pair(name->get<std::string>(), std::move(arguments));
}

// End (one past the closing brace) of the JSON object starting at text[pos]
// ('{'), or npos when it does not close.
size_t object_end(std::string_view text, size_t pos) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = pos; i < text.size(); ++i) {
    char c = text[i];
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      ++depth;
    } else if (c == '}' || c == ']') {
      if (--depth == 0) return i + 1;
    }
  }
  return std::string_view::npos;
}

}  // namespace

ToolCallFormat tool_call_format_for_template(std::string_view source) {
  // Qwen3-Coder's template also writes <tool_call>, but with XML inside.
  if (source.find("<tool_call>") != std::string_view::npos && source.find("<function=") == std::string_view::npos)
    return ToolCallFormat::kHermes;
  if (source.find("<|start_header_id|>") != std::string_view::npos &&
      source.find("\"parameters\"") != std::string_view::npos)
    return ToolCallFormat::kLlama3Json;
  return ToolCallFormat::kNone;
}

std::string random_tool_call_id() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return fmt::format("chatcmpl-tool-{:016x}{:016x}", rng(), rng());
}

ToolCallStreamParser::ToolCallStreamParser(ToolCallFormat format, ToolCallIdFn new_id)
    : format_(format),
      new_id_(std::move(new_id)),
      state_(format == ToolCallFormat::kLlama3Json ? State::kUndecided : State::kText) {}

ToolCallStreamDelta ToolCallStreamParser::feed(std::string_view text) {
  ToolCallStreamDelta out;
  if (format_ == ToolCallFormat::kNone) {
    out.content = std::string(text);
    return out;
  }
  buffer_ += text;
  if (format_ == ToolCallFormat::kHermes)
    feed_hermes(out, false);
  else
    feed_llama(out, false);
  return out;
}

ToolCallStreamDelta ToolCallStreamParser::finish() {
  ToolCallStreamDelta out;
  if (format_ == ToolCallFormat::kHermes)
    feed_hermes(out, true);
  else if (format_ == ToolCallFormat::kLlama3Json)
    feed_llama(out, true);
  // Whitespace held at a boundary is content only in a reply without calls.
  if (num_calls_ == 0) out.content += pending_ws_;
  pending_ws_.clear();
  return out;
}

void ToolCallStreamParser::emit_text(ToolCallStreamDelta& out, std::string_view text) {
  if (text.empty()) return;
  if (at_boundary_) {
    pending_ws_ += text;
    if (all_space(pending_ws_)) return;
    at_boundary_ = false;
    out.content += pending_ws_;
    pending_ws_.clear();
    return;
  }
  out.content += text;
}

bool ToolCallStreamParser::emit_call(ToolCallStreamDelta& out, std::string_view json_text) {
  auto call = read_call(json_text);
  if (!call) return false;
  pending_ws_.clear();
  at_boundary_ = true;
  const int32_t index = num_calls_++;
  out.calls.push_back(ToolCallDelta{index, new_id_(), call->first, ""});
  out.calls.push_back(ToolCallDelta{index, std::nullopt, std::nullopt, std::move(call->second)});
  return true;
}

void ToolCallStreamParser::feed_hermes(ToolCallStreamDelta& out, bool final) {
  while (true) {
    if (state_ == State::kText) {
      size_t open = buffer_.find(kCallOpen);
      if (open != std::string::npos) {
        emit_text(out, std::string_view(buffer_).substr(0, open));
        buffer_.erase(0, open + kCallOpen.size());
        state_ = State::kInCall;
        continue;
      }
      size_t keep = final ? 0 : partial_tag_suffix(buffer_, kCallOpen);
      emit_text(out, std::string_view(buffer_).substr(0, buffer_.size() - keep));
      buffer_.erase(0, buffer_.size() - keep);
      return;
    }
    // Inside a block: wait for its closing tag (an unclosed block at the end
    // is still a call when its JSON is one).
    size_t close = buffer_.find(kCallClose);
    if (close == std::string::npos && !final) return;
    std::string body = buffer_.substr(0, close);
    buffer_.erase(0, close == std::string::npos ? buffer_.size() : close + kCallClose.size());
    state_ = State::kText;
    if (!emit_call(out, body)) {
      std::string raw = std::string(kCallOpen) + body;
      if (close != std::string::npos) raw += kCallClose;
      emit_text(out, raw);
    }
  }
}

void ToolCallStreamParser::feed_llama(ToolCallStreamDelta& out, bool final) {
  if (state_ == State::kUndecided) {
    size_t start = 0;
    while (start < buffer_.size() && is_space(buffer_[start])) ++start;
    std::string_view rest = std::string_view(buffer_).substr(start);
    if (rest.starts_with(kPythonTag)) {
      rest.remove_prefix(kPythonTag.size());
      while (!rest.empty() && is_space(rest.front())) rest.remove_prefix(1);
    } else if (!rest.empty() && kPythonTag.starts_with(rest) && !final) {
      return;  // may still become the tag
    }
    if (rest.empty() && !final) return;
    if (!rest.empty() && rest.front() == '{') {
      json_start_ = buffer_.size() - rest.size();
      state_ = State::kJson;
    } else {
      state_ = State::kText;
    }
  }
  if (state_ == State::kText) {
    emit_text(out, buffer_);
    buffer_.clear();
    return;
  }
  if (!final) return;
  // The held reply: one or more call objects separated by ';'.
  std::vector<std::string_view> objects;
  std::string_view text = buffer_;
  size_t pos = json_start_;
  bool valid = true;
  while (valid) {
    while (pos < text.size() && is_space(text[pos])) ++pos;
    if (pos == text.size()) break;
    if (!objects.empty()) {
      if (text[pos] != ';') {
        valid = false;
        break;
      }
      ++pos;
      while (pos < text.size() && is_space(text[pos])) ++pos;
    }
    if (pos == text.size() || text[pos] != '{') {
      valid = false;
      break;
    }
    size_t end = object_end(text, pos);
    if (end == std::string_view::npos) {
      valid = false;
      break;
    }
    objects.push_back(text.substr(pos, end - pos));
    pos = end;
  }
  valid = valid && !objects.empty() && std::all_of(objects.begin(), objects.end(), [](std::string_view object) {
            return read_call(object).has_value();
          });
  if (valid) {
    for (std::string_view object : objects) emit_call(out, object);
  } else {
    emit_text(out, buffer_);
  }
  buffer_.clear();
}

ParsedToolCalls parse_tool_calls(ToolCallFormat format, std::string_view text, const ToolCallIdFn& new_id) {
  ToolCallStreamParser parser(format, new_id);
  ToolCallStreamDelta all = parser.feed(text);
  ToolCallStreamDelta tail = parser.finish();
  all.content += tail.content;
  all.calls.insert(all.calls.end(), tail.calls.begin(), tail.calls.end());
  ParsedToolCalls parsed;
  for (auto& delta : all.calls) {
    if (delta.id)
      parsed.calls.push_back(ToolCall{std::move(*delta.id), std::move(*delta.name), ""});
    else
      parsed.calls.back().arguments += delta.arguments;
  }
  if (!all.content.empty()) parsed.content = std::move(all.content);
  return parsed;
}

void apply_tool_calls(ChoiceResult& result, ToolCallFormat format, const ToolCallIdFn& new_id) {
  ParsedToolCalls parsed = parse_tool_calls(format, result.text, new_id);
  if (parsed.calls.empty()) return;
  result.tool_calls = std::move(parsed.calls);
  result.content_is_null = !parsed.content.has_value();
  result.text = parsed.content.value_or("");
}

ojson tool_call_stream_delta_json(const ToolCallStreamDelta& delta) {
  ojson out = ojson::object();
  if (!delta.content.empty()) out["content"] = delta.content;
  if (delta.calls.empty()) return out;
  ojson calls = ojson::array();
  for (const auto& call : delta.calls) {
    ojson item = {{"index", call.index}};
    ojson function = ojson::object();
    if (call.id) {
      item["id"] = *call.id;
      item["type"] = "function";
      function["name"] = *call.name;
    }
    function["arguments"] = call.arguments;
    item["function"] = std::move(function);
    calls.push_back(std::move(item));
  }
  out["tool_calls"] = std::move(calls);
  return out;
}

namespace {

// The calls of a "required" reply: a JSON array of {"name": string, "parameters": object}.
std::optional<std::vector<ToolCall>> read_required_calls(std::string_view text, const ToolCallIdFn& new_id) {
  if (json_nesting_depth(text) > kMaxCallJsonDepth) return std::nullopt;
  ojson value = ojson::parse(text, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded() || !value.is_array() || value.empty()) return std::nullopt;
  std::vector<ToolCall> calls;
  for (const ojson& item : value) {
    if (!item.is_object()) return std::nullopt;
    auto name = item.find("name");
    auto parameters = item.find("parameters");
    if (name == item.end() || !name->is_string() || parameters == item.end()) return std::nullopt;
    ToolCall call{new_id(), name->get<std::string>(), ""};
    python_dumps(*parameters, call.arguments);
    calls.push_back(std::move(call));
  }
  return calls;
}

}  // namespace

void apply_forced_tool_calls(ChoiceResult& result, ChatRequest::ForcedTool forced, const std::string& name,
                             const ToolCallIdFn& new_id) {
  if (forced == ChatRequest::ForcedTool::kNamed) {
    result.tool_calls = {ToolCall{new_id(), name, std::move(result.text)}};
    result.text.clear();
    result.keep_finish_reason = true;
    return;
  }
  if (forced != ChatRequest::ForcedTool::kRequired) return;
  auto calls = read_required_calls(result.text, new_id);
  if (!calls) return;
  result.tool_calls = std::move(*calls);
  result.text.clear();
}

ForcedToolCallStream::ForcedToolCallStream(ChatRequest::ForcedTool forced, std::string name, ToolCallIdFn new_id)
    : forced_(forced), name_(std::move(name)), new_id_(std::move(new_id)) {}

ToolCallStreamDelta ForcedToolCallStream::feed(std::string_view text, bool finished) {
  ToolCallStreamDelta out;
  if (forced_ == ChatRequest::ForcedTool::kNamed) {
    if (text.empty() && opened_) return out;
    ToolCallDelta delta;
    if (!opened_) {
      opened_ = true;
      num_calls_ = 1;
      delta.id = new_id_();
      delta.name = name_;
    }
    delta.arguments = std::string(text);
    out.calls.push_back(std::move(delta));
    return out;
  }
  held_ += text;
  if (!finished) return out;
  auto calls = read_required_calls(held_, new_id_);
  if (!calls) {
    out.content = std::move(held_);
    held_.clear();
    return out;
  }
  for (ToolCall& call : *calls) {
    const auto index = num_calls_++;
    out.calls.push_back(ToolCallDelta{index, std::move(call.id), std::move(call.name), ""});
    out.calls.push_back(ToolCallDelta{index, std::nullopt, std::nullopt, std::move(call.arguments)});
  }
  held_.clear();
  return out;
}

}  // namespace pd::server
