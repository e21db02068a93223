#include "server/openai_protocol.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "common/json_depth.h"

namespace pd::server {
namespace {

using nlohmann::json;
using ojson = nlohmann::ordered_json;  // requests keep their key order for chat templates

const char* json_type_name(const ojson& value) {
  switch (value.type()) {
    case ojson::value_t::null:
      return "null";
    case ojson::value_t::boolean:
      return "boolean";
    case ojson::value_t::number_integer:
    case ojson::value_t::number_unsigned:
      return "integer";
    case ojson::value_t::number_float:
      return "number";
    case ojson::value_t::string:
      return "string";
    case ojson::value_t::array:
      return "array";
    case ojson::value_t::object:
      return "object";
    default:
      return "value";
  }
}

// Reads typed optional fields from a request object. A field that is absent
// or null reads as std::nullopt; the first type or range error is kept and
// every later read is a no-op, so parsers read straight down their fields
// and check error() once.
class FieldReader {
 public:
  explicit FieldReader(const ojson& object) : object_(object) {}

  const std::optional<ApiError>& error() const { return error_; }
  void fail(ApiError error) {
    if (!error_) error_ = std::move(error);
  }

  const ojson* raw(const char* key) const {
    auto it = object_.find(key);
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  std::optional<bool> boolean(const char* key) {
    const ojson* value = present(key);
    if (!value) return std::nullopt;
    if (!value->is_boolean()) return type_error(key, "a boolean", *value), std::nullopt;
    return value->get<bool>();
  }

  std::optional<std::string> string(const char* key) {
    const ojson* value = present(key);
    if (!value) return std::nullopt;
    if (!value->is_string()) return type_error(key, "a string", *value), std::nullopt;
    return value->get<std::string>();
  }

  std::optional<double> number(const char* key, double lo, double hi) {
    const ojson* value = present(key);
    if (!value) return std::nullopt;
    if (!value->is_number()) return type_error(key, "a number", *value), std::nullopt;
    double x = value->get<double>();
    if (!std::isfinite(x) || x < lo || x > hi) {
      fail(bad_request(fmt::format("'{}' must be between {} and {}, got {}", key, lo, hi, x), key));
      return std::nullopt;
    }
    return x;
  }

  // Integers, also accepting integral floats (16.0) as pydantic does.
  std::optional<int64_t> integer(const char* key, int64_t lo, int64_t hi) {
    const ojson* value = present(key);
    if (!value) return std::nullopt;
    return integer_value(key, *value, lo, hi);
  }

  std::optional<int64_t> integer_value(const char* key, const ojson& value, int64_t lo, int64_t hi) {
    int64_t x = 0;
    if (value.is_number_integer() && !value.is_number_unsigned()) {
      x = value.get<int64_t>();
    } else if (value.is_number_unsigned()) {
      uint64_t u = value.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return range_error(key, lo, hi, value);
      x = static_cast<int64_t>(u);
    } else if (value.is_number_float()) {
      double d = value.get<double>();
      if (!std::isfinite(d) || std::floor(d) != d || std::fabs(d) > 9.0e18) {
        if (std::isfinite(d) && std::floor(d) == d) return range_error(key, lo, hi, value);
        return type_error(key, "an integer", value), std::nullopt;
      }
      x = static_cast<int64_t>(d);
    } else {
      return type_error(key, "an integer", value), std::nullopt;
    }
    if (x < lo || x > hi) return range_error(key, lo, hi, value);
    return x;
  }

  std::optional<int64_t> range_error(const char* key, int64_t lo, int64_t hi, const ojson& value) {
    fail(bad_request(fmt::format("'{}' must be an integer between {} and {}, got {}", key, lo, hi, value.dump()), key));
    return std::nullopt;
  }

  void type_error(const char* key, const char* expected, const ojson& value) {
    fail(bad_request(fmt::format("'{}' must be {}, got {}", key, expected, json_type_name(value)), key));
  }

 private:
  const ojson* present(const char* key) { return error_ ? nullptr : raw(key); }

  const ojson& object_;
  std::optional<ApiError> error_;
};

template <typename T>
Parsed<T> finish(FieldReader& reader, T value) {
  if (reader.error()) return *reader.error();
  return value;
}

void parse_stop(FieldReader& reader, const RequestLimits& limits, engine::SamplingParams& sampling) {
  const ojson* stop = reader.raw("stop");
  if (!stop) return;
  std::vector<std::string> strings;
  if (stop->is_string()) {
    strings.push_back(stop->get<std::string>());
  } else if (stop->is_array()) {
    for (const auto& item : *stop) {
      if (!item.is_string()) return reader.fail(bad_request("'stop' must be a string or a list of strings", "stop"));
      strings.push_back(item.get<std::string>());
    }
  } else {
    return reader.fail(bad_request("'stop' must be a string or a list of strings", "stop"));
  }
  if (strings.size() > limits.max_stop_strings)
    return reader.fail(bad_request(
        fmt::format("'stop' has {} entries; at most {} are allowed", strings.size(), limits.max_stop_strings), "stop"));
  for (const auto& s : strings) {
    if (s.empty()) return reader.fail(bad_request("'stop' strings must not be empty", "stop"));
    if (s.size() > limits.max_stop_string_bytes)
      return reader.fail(bad_request(
          fmt::format("a 'stop' string is {} bytes; at most {} are allowed", s.size(), limits.max_stop_string_bytes),
          "stop"));
  }
  sampling.stop = std::move(strings);
}

void parse_stop_token_ids(FieldReader& reader, const RequestLimits& limits, engine::SamplingParams& sampling) {
  const ojson* ids = reader.raw("stop_token_ids");
  if (!ids) return;
  if (!ids->is_array())
    return reader.fail(bad_request("'stop_token_ids' must be a list of integers", "stop_token_ids"));
  if (ids->size() > limits.max_stop_token_ids)
    return reader.fail(bad_request(
        fmt::format("'stop_token_ids' has {} entries; at most {} are allowed", ids->size(), limits.max_stop_token_ids),
        "stop_token_ids"));
  for (const auto& item : *ids) {
    auto id = reader.integer_value("stop_token_ids", item, 0, std::numeric_limits<int32_t>::max());
    if (!id) return;
    sampling.stop_token_ids.push_back(static_cast<int32_t>(*id));
  }
}

// logit_bias: {"<token id>": bias}; biases are clamped to [-100, 100] as
// vLLM does (the vocabulary bound is the engine's check).
void parse_logit_bias(FieldReader& reader, const RequestLimits& limits, engine::SamplingParams& sampling) {
  const ojson* bias = reader.raw("logit_bias");
  if (!bias || reader.error()) return;
  if (!bias->is_object()) return reader.type_error("logit_bias", "an object of token id -> bias", *bias);
  if (bias->size() > limits.max_logit_bias)
    return reader.fail(bad_request(
        fmt::format("'logit_bias' has {} entries; at most {} are allowed", bias->size(), limits.max_logit_bias),
        "logit_bias"));
  for (auto it = bias->begin(); it != bias->end(); ++it) {
    const std::string& key = it.key();
    int64_t id = -1;
    bool numeric = !key.empty() && key.size() <= 10 &&
                   std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (numeric) id = std::stoll(key);
    if (!numeric || id > std::numeric_limits<int32_t>::max())
      return reader.fail(
          bad_request(fmt::format("'logit_bias' keys must be token ids, got \"{}\"", key.substr(0, 32)), "logit_bias"));
    if (!it.value().is_number()) return reader.fail(bad_request("'logit_bias' values must be numbers", "logit_bias"));
    const double value = it.value().get<double>();
    if (!std::isfinite(value)) return reader.fail(bad_request("'logit_bias' values must be finite", "logit_bias"));
    sampling.logit_bias.emplace_back(static_cast<int32_t>(id), static_cast<float>(std::clamp(value, -100.0, 100.0)));
  }
}

void parse_allowed_token_ids(FieldReader& reader, const RequestLimits& limits, engine::SamplingParams& sampling) {
  const ojson* ids = reader.raw("allowed_token_ids");
  if (!ids || reader.error()) return;
  if (!ids->is_array()) return reader.type_error("allowed_token_ids", "a list of integers", *ids);
  if (ids->empty()) return reader.fail(bad_request("'allowed_token_ids' must not be empty", "allowed_token_ids"));
  if (ids->size() > limits.max_allowed_token_ids)
    return reader.fail(bad_request(fmt::format("'allowed_token_ids' has {} entries; at most {} are allowed",
                                               ids->size(), limits.max_allowed_token_ids),
                                   "allowed_token_ids"));
  for (const auto& item : *ids) {
    auto id = reader.integer_value("allowed_token_ids", item, 0, std::numeric_limits<int32_t>::max());
    if (!id) return;
    sampling.allowed_token_ids.push_back(static_cast<int32_t>(*id));
  }
}

void parse_bad_words(FieldReader& reader, const RequestLimits& limits, std::vector<std::string>& out) {
  const ojson* words = reader.raw("bad_words");
  if (!words || reader.error()) return;
  if (!words->is_array()) return reader.type_error("bad_words", "a list of strings", *words);
  if (words->size() > limits.max_bad_words)
    return reader.fail(bad_request(
        fmt::format("'bad_words' has {} entries; at most {} are allowed", words->size(), limits.max_bad_words),
        "bad_words"));
  for (const auto& item : *words) {
    if (!item.is_string()) return reader.fail(bad_request("'bad_words' must be a list of strings", "bad_words"));
    const auto& word = item.get_ref<const std::string&>();
    if (word.find_first_not_of(" \t\n\r") == std::string::npos)
      return reader.fail(bad_request("'bad_words' entries must not be empty or blank", "bad_words"));
    if (word.size() > limits.max_bad_word_bytes)
      return reader.fail(bad_request(fmt::format("a 'bad_words' entry is {} bytes; at most {} are allowed", word.size(),
                                                 limits.max_bad_word_bytes),
                                     "bad_words"));
    out.push_back(word);
  }
}

// vLLM request fields this server does not implement. A request that sets one
// to anything but its "off" value is refused with a 400 naming it, never
// served as if the field were absent. `off` is the JSON a client may send
// meaning "not used" (null is always accepted; so are [] and {} for lists
// and objects).
struct UnsupportedField {
  const char* name;
  const char* off;  // JSON literal, or nullptr when only null (or an empty list/object, below) means off
  const char* why;
  bool empty_is_off = false;  // [] / {} ask for nothing (a list of processors); not so for a schema
};
constexpr UnsupportedField kUnsupportedFields[] = {
    {"use_beam_search", "false", "beam search is not supported by this server"},
    {"length_penalty", "1.0", "'length_penalty' applies to beam search, which this server does not support"},
    {"structural_tag", nullptr, "structured output with 'structural_tag' is not supported by this server"},
    {"logits_processors", nullptr, "request-supplied logits processors are not supported by this server", true},
    {"vllm_xargs", nullptr, "'vllm_xargs' is not supported by this server", true},
    {"spaces_between_special_tokens", "true", "only 'spaces_between_special_tokens' true is supported"},
    {"priority", "0", "request priorities are not supported by this server (only 0)"},
    {"cache_salt", nullptr, "'cache_salt' is not supported by this server"},
    {"prompt_embeds", nullptr, "'prompt_embeds' is not supported by this server"},
    {"mm_processor_kwargs", nullptr, "multimodal inputs are not supported by this server", true},
    {"documents", nullptr, "'documents' is not supported by this server", true},
    {"parallel_tool_calls", "true", "'parallel_tool_calls' false is not supported (replies may hold several calls)"},
    {"functions", nullptr, "function calling is not supported by this server", true},
    {"function_call", nullptr, "function calling is not supported by this server"},
    {"reasoning_effort", nullptr, "'reasoning_effort' is not supported by this server"},
    {"include_reasoning", "true", "reasoning output is not supported by this server"},
    {"prediction", nullptr, "predicted outputs are not supported by this server"},
    {"audio", nullptr, "audio output is not supported by this server"},
    {"modalities", nullptr, "only text output is supported by this server"},
    {"web_search_options", nullptr, "web search is not supported by this server"},
};

bool is_off(const ojson& value, const char* off, bool empty_is_off) {
  if (value.is_null()) return true;
  if (empty_is_off && (value.is_array() || value.is_object()) && value.empty()) return true;
  if (off == nullptr) return false;
  const ojson expected = ojson::parse(off);
  if (expected.is_number() && value.is_number()) return value.get<double>() == expected.get<double>();
  return value == expected;
}

void refuse_unsupported_fields(FieldReader& reader, bool is_chat) {
  for (const UnsupportedField& field : kUnsupportedFields) {
    const ojson* value = reader.raw(field.name);
    if (value && !is_off(*value, field.off, field.empty_is_off)) return reader.fail(unsupported(field.why, field.name));
  }
  if (!is_chat) {
    if (const ojson* tools = reader.raw("tools"); tools && !is_off(*tools, nullptr, true))
      return reader.fail(unsupported("tool calling is not supported by this server", "tools"));
    if (const ojson* choice = reader.raw("tool_choice"); choice && !is_off(*choice, "\"none\"", false))
      return reader.fail(unsupported("tool calling is not supported by this server", "tool_choice"));
  }
}

// ---- structured output (vLLM's fields) ----

void add_constraint(FieldReader& reader, std::optional<StructuredOutput>& out, StructuredOutput next) {
  if (reader.error()) return;
  if (out) {
    return reader.fail(bad_request(fmt::format("a request may hold one structured-output constraint; it sets both "
                                               "'{}' and '{}'",
                                               out->field, next.field),
                                   next.field));
  }
  out = std::move(next);
}

// A JSON schema given as an object, or (guided_json) as a string holding one.
std::optional<std::string> schema_source(FieldReader& reader, const ojson& value, const std::string& field,
                                         const RequestLimits& limits, bool string_allowed) {
  const char* shape = string_allowed ? "a JSON schema object (or a string holding one)" : "a JSON schema object";
  if (value.is_object()) return value.dump();
  if (string_allowed && value.is_string()) {
    const auto& text = value.get_ref<const std::string&>();
    if (json_nesting_depth(text) <= limits.max_json_depth) {
      ojson parsed = ojson::parse(text, nullptr, /*allow_exceptions=*/false);
      if (!parsed.is_discarded() && parsed.is_object()) return parsed.dump();
    }
  }
  reader.fail(bad_request(fmt::format("'{}' must be {}", field, shape), field));
  return std::nullopt;
}

std::optional<std::string> nonempty_string(FieldReader& reader, const ojson& value, const std::string& field) {
  if (value.is_string() && !value.get_ref<const std::string&>().empty()) return value.get<std::string>();
  reader.fail(bad_request(fmt::format("'{}' must be a non-empty string", field), field));
  return std::nullopt;
}

std::optional<std::vector<std::string>> choice_list(FieldReader& reader, const ojson& value, const std::string& field) {
  std::vector<std::string> out;
  if (value.is_array() && !value.empty()) {
    for (const auto& item : value) {
      if (!item.is_string()) break;
      out.push_back(item.get<std::string>());
    }
    if (out.size() == value.size()) return out;
  }
  reader.fail(bad_request(fmt::format("'{}' must be a non-empty list of strings", field), field));
  return std::nullopt;
}

// One of json / regex / choice / grammar, under its wire name.
void add_keyed_constraint(FieldReader& reader, const RequestLimits& limits, std::optional<StructuredOutput>& out,
                          const std::string& field, const std::string& key, const ojson& value) {
  StructuredOutput next;
  next.field = field;
  if (key == "json") {
    auto source = schema_source(reader, value, field, limits, /*string_allowed=*/true);
    if (!source) return;
    next.kind = StructuredOutput::Kind::kJsonSchema;
    next.source = std::move(*source);
  } else if (key == "regex" || key == "grammar") {
    auto source = nonempty_string(reader, value, field);
    if (!source) return;
    next.kind = key == "regex" ? StructuredOutput::Kind::kRegex : StructuredOutput::Kind::kGrammar;
    next.source = std::move(*source);
  } else {
    auto choices = choice_list(reader, value, field);
    if (!choices) return;
    next.kind = StructuredOutput::Kind::kChoice;
    next.choices = std::move(*choices);
  }
  add_constraint(reader, out, std::move(next));
}

void parse_response_format(FieldReader& reader, const RequestLimits& limits, std::optional<StructuredOutput>& out) {
  const ojson* format = reader.raw("response_format");
  if (format == nullptr || format->is_null()) return;
  // Not value("type", ""): it throws when the client sends a non-string type.
  auto type = format->is_object() ? format->find("type") : format->end();
  if (!format->is_object() || type == format->end() || !type->is_string()) {
    return reader.fail(bad_request(
        "'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}", "response_format"));
  }
  const auto& kind = type->get_ref<const std::string&>();
  if (kind == "text") return;
  if (kind == "json_object") {
    return add_constraint(reader, out,
                          StructuredOutput{StructuredOutput::Kind::kJsonObject, "", {}, "response_format"});
  }
  if (kind != "json_schema") {
    return reader.fail(unsupported(
        fmt::format("'response_format' type \"{}\" is not supported (text, json_object, json_schema are)", kind),
        "response_format"));
  }
  auto spec = format->find("json_schema");
  if (spec == format->end() || !spec->is_object()) {
    return reader.fail(bad_request("'response_format.json_schema' must be an object with 'name' and 'schema'",
                                   "response_format.json_schema"));
  }
  auto name = spec->find("name");
  if (name == spec->end() || !name->is_string() || name->get_ref<const std::string&>().empty())
    return reader.fail(bad_request("'response_format.json_schema.name' must be a non-empty string",
                                   "response_format.json_schema.name"));
  if (auto strict = spec->find("strict"); strict != spec->end() && !strict->is_null() && !strict->is_boolean())
    return reader.fail(
        bad_request("'response_format.json_schema.strict' must be a boolean", "response_format.json_schema.strict"));
  auto schema = spec->find("schema");
  if (schema == spec->end() || schema->is_null())
    return reader.fail(
        bad_request("'response_format.json_schema.schema' is required", "response_format.json_schema.schema"));
  auto source = schema_source(reader, *schema, "response_format.json_schema.schema", limits, /*string_allowed=*/false);
  if (!source) return;
  StructuredOutput next{StructuredOutput::Kind::kJsonSchema, std::move(*source), {}, "response_format"};
  add_constraint(reader, out, std::move(next));
}

// vLLM's structured_outputs object: json, regex, choice, grammar, json_object; the JSON
// whitespace keys (disable_any_whitespace, whitespace_pattern); disable_fallback (there is no
// other backend to fall back to); disable_additional_properties only false.
void parse_structured_outputs_object(FieldReader& reader, const RequestLimits& limits, GenerationFields& fields) {
  std::optional<StructuredOutput>& out = fields.structured_output;
  const ojson* params = reader.raw("structured_outputs");
  if (params == nullptr || params->is_null()) return;
  if (!params->is_object()) return reader.type_error("structured_outputs", "an object", *params);
  for (const auto& [key, value] : params->items()) {
    const std::string field = "structured_outputs." + key;
    if (value.is_null()) continue;
    if (key == "json" || key == "regex" || key == "choice" || key == "grammar") {
      add_keyed_constraint(reader, limits, out, field, key, value);
    } else if (key == "json_object") {
      if (!value.is_boolean()) return reader.fail(bad_request("'" + field + "' must be a boolean", field));
      if (value.get<bool>())
        add_constraint(reader, out, StructuredOutput{StructuredOutput::Kind::kJsonObject, "", {}, field});
    } else if (key == "disable_fallback" || key == "disable_any_whitespace" || key == "disable_additional_properties") {
      if (!value.is_boolean()) return reader.fail(bad_request("'" + field + "' must be a boolean", field));
      if (key == "disable_any_whitespace") fields.json_compact_whitespace = value.get<bool>();
      if (value.get<bool>() && key == "disable_additional_properties")
        return reader.fail(unsupported("'" + field + "' true is not supported by this server", field));
    } else if (key == "whitespace_pattern") {
      auto pattern = nonempty_string(reader, value, field);
      if (pattern) fields.json_whitespace_pattern = std::move(*pattern);
    } else if (key == "structural_tag") {
      return reader.fail(unsupported("'" + field + "' is not supported by this server", field));
    } else {
      return reader.fail(bad_request(fmt::format("unknown field '{}'", field), field));
    }
    if (reader.error()) return;
  }
}

// Every structured-output field of a request, into at most one constraint.
void parse_structured_output(FieldReader& reader, const RequestLimits& limits, GenerationFields& fields) {
  std::optional<StructuredOutput>& out = fields.structured_output;
  parse_response_format(reader, limits, out);
  for (const char* key : {"guided_json", "guided_regex", "guided_choice", "guided_grammar"}) {
    const ojson* value = reader.raw(key);
    if (value == nullptr || value->is_null()) continue;
    add_keyed_constraint(reader, limits, out, key, std::string(key).substr(7), *value);
  }
  parse_structured_outputs_object(reader, limits, fields);
  if (const ojson* pattern = reader.raw("guided_whitespace_pattern"); pattern && !pattern->is_null()) {
    if (auto value = nonempty_string(reader, *pattern, "guided_whitespace_pattern"))
      fields.json_whitespace_pattern = std::move(*value);
  }
  if (const ojson* backend = reader.raw("guided_decoding_backend"); backend && !backend->is_null()) {
    if (!backend->is_string()) return reader.type_error("guided_decoding_backend", "a string", *backend);
    const auto& name = backend->get_ref<const std::string&>();
    if (name != "auto" && name != "guidance" && name != "llguidance")
      reader.fail(unsupported(fmt::format("structured output here is llguidance's; 'guided_decoding_backend' \"{}\" "
                                          "is not available (\"auto\" or \"guidance\" are)",
                                          name),
                              "guided_decoding_backend"));
  }
}

// Reads everything GenerationFields holds plus the sampling knobs common to
// both endpoints.
GenerationFields parse_generation_fields(FieldReader& reader, const ojson& body, const RequestLimits& limits,
                                         bool is_chat) {
  GenerationFields fields;
  if (auto model = reader.string("model")) fields.model = *model;
  fields.stream = reader.boolean("stream").value_or(false);
  if (const ojson* options = reader.raw("stream_options")) {
    if (!options->is_object()) {
      reader.type_error("stream_options", "an object", *options);
    } else {
      FieldReader options_reader(*options);
      fields.include_usage = options_reader.boolean("include_usage").value_or(false);
      fields.continuous_usage_stats = options_reader.boolean("continuous_usage_stats").value_or(false);
      if (options_reader.error()) reader.fail(*options_reader.error());
      if (!fields.stream && !reader.error())
        reader.fail(bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options"));
    }
  }

  auto& sampling = fields.sampling;
  if (auto t = reader.number("temperature", 0.0, 100.0)) sampling.temperature = static_cast<float>(*t);
  if (auto p = reader.number("top_p", 0.0, 1.0)) {
    if (*p <= 0.0) reader.fail(bad_request("'top_p' must be in (0, 1], got 0", "top_p"));
    sampling.top_p = static_cast<float>(*p);
  }
  if (auto k = reader.integer("top_k", -1, std::numeric_limits<int32_t>::max()))
    sampling.top_k = static_cast<int32_t>(*k);
  if (auto m = reader.number("min_p", 0.0, 1.0)) sampling.min_p = static_cast<float>(*m);
  if (const ojson* seed = reader.raw("seed")) {
    if (seed->is_number_unsigned())
      sampling.seed = seed->get<uint64_t>();
    else if (auto s = reader.integer("seed", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()))
      sampling.seed = static_cast<uint64_t>(*s);  // negative seeds wrap, as a bit pattern
  }

  // max_completion_tokens is the newer chat name and wins when both are set.
  std::optional<int64_t> max_tokens = reader.integer("max_tokens", 1, limits.max_model_len);
  if (is_chat) {
    if (auto mct = reader.integer("max_completion_tokens", 1, limits.max_model_len)) max_tokens = mct;
  }
  if (max_tokens) fields.max_tokens = static_cast<int32_t>(*max_tokens);
  if (auto min_tokens = reader.integer("min_tokens", 0, limits.max_model_len))
    sampling.min_tokens = static_cast<int32_t>(*min_tokens);
  if (fields.max_tokens && sampling.min_tokens > *fields.max_tokens)
    reader.fail(bad_request(
        fmt::format("'min_tokens' ({}) must not exceed 'max_tokens' ({})", sampling.min_tokens, *fields.max_tokens),
        "min_tokens"));
  sampling.ignore_eos = reader.boolean("ignore_eos").value_or(false);
  sampling.skip_special_tokens = reader.boolean("skip_special_tokens").value_or(true);
  sampling.include_stop_str_in_output = reader.boolean("include_stop_str_in_output").value_or(false);
  parse_stop(reader, limits, sampling);
  parse_stop_token_ids(reader, limits, sampling);

  if (auto n = reader.integer("n", 1, limits.max_n)) fields.n = static_cast<int32_t>(*n);
  if (const ojson* best_of = reader.raw("best_of")) {
    // vLLM v1 samples n candidates and returns them all: best_of may only name that same n.
    auto value = reader.integer("best_of", 1, limits.max_n);
    if (value && *value != fields.n)
      reader.fail(bad_request(
          fmt::format("'best_of' ({}) other than 'n' ({}) is not supported by this server", best_of->dump(), fields.n),
          "best_of"));
  }
  if (auto p = reader.number("presence_penalty", -2.0, 2.0)) sampling.presence_penalty = static_cast<float>(*p);
  if (auto f = reader.number("frequency_penalty", -2.0, 2.0)) sampling.frequency_penalty = static_cast<float>(*f);
  if (auto r = reader.number("repetition_penalty", 0.0, 2.0)) {
    if (*r <= 0.0) reader.fail(bad_request("'repetition_penalty' must be in (0, 2], got 0", "repetition_penalty"));
    sampling.repetition_penalty = static_cast<float>(*r);
  }
  parse_logit_bias(reader, limits, sampling);
  parse_allowed_token_ids(reader, limits, sampling);
  parse_bad_words(reader, limits, fields.bad_words);
  if (const ojson* truncate = reader.raw("truncate_prompt_tokens")) {
    if (auto k = reader.integer("truncate_prompt_tokens", -1, std::numeric_limits<int32_t>::max())) {
      if (*k == 0)
        reader.fail(bad_request("'truncate_prompt_tokens' must be -1 or at least 1, got 0", "truncate_prompt_tokens"));
      else if (*k > limits.max_model_len)
        reader.fail(bad_request(
            fmt::format("'truncate_prompt_tokens' ({}) is greater than max_model_len ({})", *k, limits.max_model_len),
            "truncate_prompt_tokens"));
      else
        fields.truncate_prompt_tokens = static_cast<int32_t>(*k == -1 ? limits.max_model_len : *k);
    }
    (void)truncate;
  }
  parse_structured_output(reader, limits, fields);
  refuse_unsupported_fields(reader, is_chat);
  reader.string("user");

  if (const ojson* params = reader.raw("kv_transfer_params")) {
    if (!params->is_object())
      reader.type_error("kv_transfer_params", "an object", *params);
    else
      fields.kv_transfer_params = *params;
  }
  if (auto k = reader.integer("prompt_logprobs", 0, limits.max_logprobs)) {
    sampling.prompt_logprobs = static_cast<int32_t>(*k);
    // As vLLM: a stream has no place for them (they would precede every token).
    if (fields.stream)
      reader.fail(bad_request("'prompt_logprobs' are not available when 'stream' is true", "prompt_logprobs"));
    const ojson* prefill = fields.kv_transfer_params ? &*fields.kv_transfer_params : nullptr;
    if (prefill && prefill->contains("do_remote_prefill") && (*prefill)["do_remote_prefill"] == true)
      reader.fail(
          bad_request("'prompt_logprobs' cannot be computed by a P/D consumer: its prompt's KV comes from the "
                      "producer, which computes them (the router sends them to the producer)",
                      "prompt_logprobs"));
  }
  fields.return_tokens_as_token_ids = reader.boolean("return_tokens_as_token_ids").value_or(false);
  fields.return_token_ids = reader.boolean("return_token_ids").value_or(false);
  if (auto id = reader.string("request_id")) {
    if (id->empty() || id->size() > 256)
      reader.fail(bad_request("'request_id' must be 1 to 256 characters", "request_id"));
    fields.request_id = *id;
  }
  (void)body;
  return fields;
}

// Token ids from the wire: non-negative 32-bit integers (the vocabulary
// bound is checked by the engine, which knows the model).
bool read_token_ids(FieldReader& reader, const char* key, const ojson& array, std::vector<int32_t>& out) {
  out.reserve(array.size());
  for (const auto& item : array) {
    auto id = reader.integer_value(key, item, 0, std::numeric_limits<int32_t>::max());
    if (!id) return false;
    out.push_back(static_cast<int32_t>(*id));
  }
  return true;
}

void parse_prompts(FieldReader& reader, const RequestLimits& limits, std::vector<PromptInput>& prompts) {
  const ojson* prompt = reader.raw("prompt");
  const char* kShapes = "'prompt' must be a string, a list of strings, a list of token ids or a list of such lists";
  if (!prompt) return reader.fail(bad_request("'prompt' is required", "prompt"));
  if (prompt->is_string()) {
    if (prompt->get_ref<const std::string&>().empty())
      return reader.fail(bad_request("'prompt' must not be empty", "prompt"));
    prompts.push_back({prompt->get<std::string>(), {}});
    return;
  }
  if (!prompt->is_array()) return reader.fail(bad_request(kShapes, "prompt"));
  if (prompt->empty()) return reader.fail(bad_request("'prompt' must not be empty", "prompt"));
  const ojson& first = prompt->front();
  if (first.is_number()) {
    PromptInput input;
    if (!read_token_ids(reader, "prompt", *prompt, input.token_ids)) return;
    prompts.push_back(std::move(input));
    return;
  }
  if (prompt->size() > limits.max_batch_prompts)
    return reader.fail(bad_request(
        fmt::format("'prompt' holds {} prompts; at most {} are allowed", prompt->size(), limits.max_batch_prompts),
        "prompt"));
  for (const auto& item : *prompt) {
    if (item.is_string() && first.is_string()) {
      if (item.get_ref<const std::string&>().empty())
        return reader.fail(bad_request("'prompt' must not contain empty prompts", "prompt"));
      prompts.push_back({item.get<std::string>(), {}});
    } else if (item.is_array() && first.is_array()) {
      if (item.empty()) return reader.fail(bad_request("'prompt' must not contain empty prompts", "prompt"));
      PromptInput input;
      if (!read_token_ids(reader, "prompt", item, input.token_ids)) return;
      prompts.push_back(std::move(input));
    } else {
      return reader.fail(bad_request(kShapes, "prompt"));
    }
  }
}

// A message's content as the chat template sees it: a string (text parts
// joined by newlines, as vLLM does) or null where the role allows it.
std::optional<ApiError> normalize_content(ojson& message, size_t index) {
  auto param = fmt::format("messages[{}].content", index);
  auto it = message.find("content");
  if (it == message.end() || it->is_null()) {
    const std::string& role = message["role"].get_ref<const std::string&>();
    if (role == "assistant") {
      message["content"] = nullptr;
      return std::nullopt;
    }
    return bad_request(fmt::format("'{}' is required for role '{}'", param, role), param);
  }
  if (it->is_string()) return std::nullopt;
  if (!it->is_array())
    return bad_request(fmt::format("'{}' must be a string or a list of content parts", param), param);
  std::string text;
  bool first = true;
  for (const auto& part : *it) {
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
      return bad_request(fmt::format("'{}' parts must be objects with a 'type'", param), param);
    const auto& type = part["type"].get_ref<const std::string&>();
    if (type != "text")
      return bad_request(fmt::format("content part type '{}' is not supported (only 'text')", type), param);
    if (!part.contains("text") || !part["text"].is_string())
      return bad_request(fmt::format("'{}' text parts need a string 'text'", param), param);
    if (!first) text += "\n";
    text += part["text"].get<std::string>();
    first = false;
  }
  *it = std::move(text);
  return std::nullopt;
}

std::optional<ApiError> normalize_tool_calls(ojson& message, const std::string& param);

// More tool definitions than any template sensibly renders.
constexpr size_t kMaxTools = 256;

std::optional<ApiError> validate_messages(const ojson* messages, ojson& out) {
  if (!messages) return bad_request("'messages' is required", "messages");
  if (!messages->is_array()) return bad_request("'messages' must be a list of message objects", "messages");
  if (messages->empty()) return bad_request("'messages' must not be empty", "messages");
  out = *messages;
  for (size_t i = 0; i < out.size(); ++i) {
    ojson& message = out[i];
    auto param = fmt::format("messages[{}]", i);
    if (!message.is_object()) return bad_request(fmt::format("'{}' must be an object", param), param);
    auto role = message.find("role");
    if (role == message.end() || !role->is_string())
      return bad_request(fmt::format("'{}.role' must be a string", param), param + ".role");
    const auto& r = role->get_ref<const std::string&>();
    if (r != "system" && r != "user" && r != "assistant" && r != "tool" && r != "developer")
      return bad_request(
          fmt::format("'{}.role' must be one of system, developer, user, assistant, tool; got '{}'", param, r),
          param + ".role");
    if (auto error = normalize_content(message, i)) return error;
    if (auto name = message.find("name"); name != message.end() && !name->is_null() && !name->is_string())
      return bad_request(fmt::format("'{}.name' must be a string", param), param + ".name");
    if (auto id = message.find("tool_call_id"); id != message.end() && !id->is_null() && !id->is_string())
      return bad_request(fmt::format("'{}.tool_call_id' must be a string", param), param + ".tool_call_id");
    if (auto error = normalize_tool_calls(message, param)) return error;
  }
  return std::nullopt;
}

// An assistant message's tool_calls as the chat template sees them: each
// {id, type: "function", function: {name, arguments}} with arguments parsed
// from its JSON string into an object (vLLM does the same; templates print
// them with tojson).
std::optional<ApiError> normalize_tool_calls(ojson& message, const std::string& param) {
  auto calls = message.find("tool_calls");
  if (calls == message.end() || calls->is_null()) return std::nullopt;
  const std::string field = param + ".tool_calls";
  if (message["role"] != "assistant")
    return bad_request(fmt::format("'{}' is only allowed on assistant messages", field), field);
  if (!calls->is_array()) return bad_request(fmt::format("'{}' must be a list", field), field);
  for (size_t j = 0; j < calls->size(); ++j) {
    ojson& call = (*calls)[j];
    const std::string at = fmt::format("{}[{}]", field, j);
    if (!call.is_object()) return bad_request(fmt::format("'{}' must be an object", at), at);
    if (auto id = call.find("id"); id != call.end() && !id->is_string())
      return bad_request(fmt::format("'{}.id' must be a string", at), at + ".id");
    if (auto type = call.find("type"); type != call.end() && *type != "function")
      return bad_request(fmt::format("'{}.type' must be \"function\"", at), at + ".type");
    auto function = call.find("function");
    if (function == call.end() || !function->is_object())
      return bad_request(fmt::format("'{}.function' must be an object", at), at + ".function");
    auto name = function->find("name");
    if (name == function->end() || !name->is_string())
      return bad_request(fmt::format("'{}.function.name' must be a string", at), at + ".function.name");
    auto arguments = function->find("arguments");
    if (arguments == function->end() || !arguments->is_string())
      return bad_request(fmt::format("'{}.function.arguments' must be a JSON string", at), at + ".function.arguments");
    ojson parsed = ojson::parse(arguments->get_ref<const std::string&>(), nullptr, /*allow_exceptions=*/false);
    if (parsed.is_discarded() || !parsed.is_object())
      return bad_request(fmt::format("'{}.function.arguments' must hold a JSON object", at),
                         at + ".function.arguments");
    *arguments = std::move(parsed);
  }
  return std::nullopt;
}

// tools: [{type: "function", function: {name, description?, parameters?}}].
std::optional<ApiError> validate_tools(const ojson& tools) {
  if (!tools.is_array()) return bad_request("'tools' must be a list of tool objects", "tools");
  if (tools.size() > kMaxTools)
    return bad_request(fmt::format("'tools' holds {} tools; at most {} are allowed", tools.size(), kMaxTools), "tools");
  for (size_t i = 0; i < tools.size(); ++i) {
    const ojson& tool = tools[i];
    const std::string at = fmt::format("tools[{}]", i);
    if (!tool.is_object()) return bad_request(fmt::format("'{}' must be an object", at), at);
    auto type = tool.find("type");
    if (type == tool.end() || *type != "function")
      return bad_request(fmt::format("'{}.type' must be \"function\"", at), at + ".type");
    auto function = tool.find("function");
    if (function == tool.end() || !function->is_object())
      return bad_request(fmt::format("'{}.function' must be an object", at), at + ".function");
    auto name = function->find("name");
    if (name == function->end() || !name->is_string() || name->get_ref<const std::string&>().empty())
      return bad_request(fmt::format("'{}.function.name' must be a non-empty string", at), at + ".function.name");
    if (auto d = function->find("description"); d != function->end() && !d->is_null() && !d->is_string())
      return bad_request(fmt::format("'{}.function.description' must be a string", at), at + ".function.description");
    if (auto p = function->find("parameters"); p != function->end() && !p->is_null() && !p->is_object())
      return bad_request(fmt::format("'{}.function.parameters' must be a JSON schema object", at),
                         at + ".function.parameters");
  }
  return std::nullopt;
}

void parse_template_extras(FieldReader& reader, ojson& tools, ojson& kwargs) {
  if (const ojson* t = reader.raw("tools"); t && !t->is_null()) {
    if (auto error = validate_tools(*t))
      reader.fail(*error);
    else
      tools = *t;
  }
  if (const ojson* k = reader.raw("chat_template_kwargs")) {
    if (!k->is_object())
      reader.type_error("chat_template_kwargs", "an object", *k);
    else
      kwargs = *k;
  }
  if (reader.raw("chat_template"))
    reader.fail(unsupported("a request-supplied 'chat_template' is not supported", "chat_template"));
}

// tool_choice as vLLM takes it: "none", "auto" (the default with tools),
// "required" or {"type": "function", "function": {"name"}}. The last two hold
// the reply to a JSON schema (tool_choice_schema) with structured output.
void parse_tool_choice(FieldReader& reader, ChatRequest& request) {
  const bool has_tools = !request.tools.is_null() && !request.tools.empty();
  const ojson* choice = reader.raw("tool_choice");
  if (!choice || choice->is_null()) {
    request.parse_tool_calls = has_tools;
    return;
  }
  if (choice->is_string()) {
    const auto& value = choice->get_ref<const std::string&>();
    if (value == "none") return;
    if (value != "auto" && value != "required")
      return reader.fail(bad_request(
          fmt::format("'tool_choice' must be \"none\", \"auto\", \"required\" or a named function; got \"{}\"", value),
          "tool_choice"));
  } else if (!choice->is_object() || !choice->contains("function") || !(*choice)["function"].is_object() ||
             !(*choice)["function"].contains("name") || !(*choice)["function"]["name"].is_string()) {
    return reader.fail(
        bad_request("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": "
                    "{\"name\": ...}}",
                    "tool_choice"));
  }
  if (!has_tools) return reader.fail(bad_request("'tool_choice' needs 'tools'", "tool_choice"));
  if (choice->is_string() && choice->get_ref<const std::string&>() == "auto") {
    request.parse_tool_calls = true;
    return;
  }
  if (choice->is_string()) {
    request.forced_tool = ChatRequest::ForcedTool::kRequired;
  } else {
    request.forced_tool = ChatRequest::ForcedTool::kNamed;
    request.forced_tool_name = (*choice)["function"]["name"].get<std::string>();
  }
  auto schema = tool_choice_schema(request.tools, request.forced_tool, request.forced_tool_name);
  if (failed(schema)) return reader.fail(std::get<ApiError>(std::move(schema)));
  add_constraint(
      reader, request.fields.structured_output,
      StructuredOutput{StructuredOutput::Kind::kJsonSchema, std::get<ojson>(schema).dump(), {}, "tool_choice"});
}

}  // namespace

Parsed<ojson> tool_choice_schema(const ojson& tools, ChatRequest::ForcedTool forced, const std::string& name) {
  const ojson kAnyObject = {{"type", "object"}};
  auto parameters_of = [&](const ojson& function) {
    auto p = function.find("parameters");
    return p != function.end() && p->is_object() ? *p : kAnyObject;
  };
  if (forced == ChatRequest::ForcedTool::kNamed) {
    for (const auto& tool : tools) {
      const ojson& function = tool["function"];
      if (function["name"] == name) return parameters_of(function);
    }
    return bad_request(fmt::format("'tool_choice' names function '{}', which is not among 'tools'", name),
                       "tool_choice");
  }
  ojson defs = ojson::object();
  ojson alternatives = ojson::array();
  for (const auto& tool : tools) {
    const ojson& function = tool["function"];
    ojson parameters = parameters_of(function);
    if (auto d = parameters.find("$defs"); d != parameters.end()) {
      if (!d->is_object()) return bad_request("a tool's 'parameters.$defs' must be an object", "tools");
      for (const auto& [key, value] : d->items()) {
        if (defs.contains(key) && defs[key] != value)
          return bad_request(fmt::format("tools define '$defs.{}' differently; 'tool_choice' \"required\" needs "
                                         "one definition per name",
                                         key),
                             "tools");
        defs[key] = value;
      }
      parameters.erase("$defs");
    }
    ojson alternative = {{"properties",
                          {{"name", {{"type", "string"}, {"enum", ojson::array({function["name"]})}}},
                           {"parameters", std::move(parameters)}}},
                         {"required", ojson::array({"name", "parameters"})}};
    alternatives.push_back(std::move(alternative));
  }
  ojson schema = {
      {"type", "array"}, {"minItems", 1}, {"items", {{"type", "object"}, {"anyOf", std::move(alternatives)}}}};
  if (!defs.empty()) schema["$defs"] = std::move(defs);
  return schema;
}

Parsed<ojson> parse_json_object(std::string_view body, size_t max_depth) {
  if (json_nesting_depth(body) > max_depth)
    return bad_request(fmt::format("request body nests deeper than {} levels", max_depth));
  ojson value = ojson::parse(body, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) return bad_request("request body is not valid JSON");
  if (!value.is_object()) return bad_request("request body must be a JSON object");
  return value;
}

Parsed<CompletionRequest> parse_completion_request(const ojson& body, const RequestLimits& limits) {
  FieldReader reader(body);
  CompletionRequest request;
  request.fields = parse_generation_fields(reader, body, limits, /*is_chat=*/false);
  if (auto logprobs = reader.integer("logprobs", 0, limits.max_logprobs))
    request.fields.sampling.logprobs = static_cast<int32_t>(*logprobs);
  request.echo = reader.boolean("echo").value_or(false);
  if (request.echo && request.fields.sampling.logprobs >= 0)
    reader.fail(
        unsupported("'echo' with 'logprobs' needs logprobs of the prompt tokens, which this server does not "
                    "compute",
                    "echo"));
  request.add_special_tokens = reader.boolean("add_special_tokens").value_or(true);
  if (auto suffix = reader.string("suffix"); suffix && !suffix->empty())
    reader.fail(unsupported("'suffix' is not supported", "suffix"));
  parse_prompts(reader, limits, request.prompts);
  if (!reader.error() && request.prompts.size() * static_cast<size_t>(request.fields.n) > limits.max_choices)
    reader.fail(bad_request(fmt::format("{} prompts x n={} is more than {} choices", request.prompts.size(),
                                        request.fields.n, limits.max_choices),
                            "n"));
  // The params name one transfer (one transfer_id, one prompt's KV); every
  // prompt of a batch would carry the same ones, and the connector refuses
  // the second request with an id already in use.
  if (request.fields.kv_transfer_params && request.prompts.size() > 1)
    reader.fail(bad_request(
        fmt::format("kv_transfer_params needs exactly one prompt; 'prompt' holds {}", request.prompts.size()),
        "kv_transfer_params"));
  if (request.fields.kv_transfer_params && request.fields.n > 1)
    reader.fail(bad_request("kv_transfer_params needs exactly one choice; 'n' is more than 1", "kv_transfer_params"));
  return finish(reader, std::move(request));
}

Parsed<ChatRequest> parse_chat_request(const ojson& body, const RequestLimits& limits) {
  FieldReader reader(body);
  ChatRequest request;
  request.fields = parse_generation_fields(reader, body, limits, /*is_chat=*/true);
  request.logprobs = reader.boolean("logprobs").value_or(false);
  auto top = reader.integer("top_logprobs", 0, limits.max_logprobs);
  if (top && *top > 0 && !request.logprobs)
    reader.fail(bad_request("'top_logprobs' needs 'logprobs' to be true", "top_logprobs"));
  if (request.logprobs) request.fields.sampling.logprobs = static_cast<int32_t>(top.value_or(0));
  if (reader.boolean("echo").value_or(false))
    reader.fail(unsupported("'echo' is not supported for chat on this server", "echo"));
  request.add_generation_prompt = reader.boolean("add_generation_prompt").value_or(true);
  request.add_special_tokens = reader.boolean("add_special_tokens").value_or(false);
  if (reader.boolean("continue_final_message").value_or(false))
    reader.fail(unsupported("'continue_final_message' is not supported", "continue_final_message"));
  parse_template_extras(reader, request.tools, request.chat_template_kwargs);
  parse_tool_choice(reader, request);
  if (!reader.error()) {
    if (auto error = validate_messages(reader.raw("messages"), request.messages)) reader.fail(*error);
  }
  return finish(reader, std::move(request));
}

Parsed<TokenizeRequest> parse_tokenize_request(const ojson& body, const RequestLimits& limits) {
  FieldReader reader(body);
  TokenizeRequest request;
  if (auto model = reader.string("model")) request.model = *model;
  request.return_token_strs = reader.boolean("return_token_strs").value_or(false);
  if (reader.raw("messages")) {
    if (auto error = validate_messages(reader.raw("messages"), request.messages)) reader.fail(*error);
    // Chat prompts carry their special tokens in the template.
    request.add_special_tokens = reader.boolean("add_special_tokens").value_or(false);
    request.add_generation_prompt = reader.boolean("add_generation_prompt").value_or(true);
    parse_template_extras(reader, request.tools, request.chat_template_kwargs);
  } else {
    request.prompt = reader.string("prompt");
    if (!reader.error() && !request.prompt) reader.fail(bad_request("'prompt' or 'messages' is required", "prompt"));
    request.add_special_tokens = reader.boolean("add_special_tokens").value_or(true);
  }
  (void)limits;
  return finish(reader, std::move(request));
}

Parsed<DetokenizeRequest> parse_detokenize_request(const ojson& body, const RequestLimits& limits) {
  FieldReader reader(body);
  DetokenizeRequest request;
  if (auto model = reader.string("model")) request.model = *model;
  const ojson* tokens = reader.raw("tokens");
  if (!tokens)
    reader.fail(bad_request("'tokens' is required", "tokens"));
  else if (!tokens->is_array())
    reader.type_error("tokens", "a list of integers", *tokens);
  else
    read_token_ids(reader, "tokens", *tokens, request.tokens);
  (void)limits;
  return finish(reader, std::move(request));
}

Parsed<int32_t> resolve_max_tokens(int32_t num_prompt_tokens, std::optional<int32_t> requested,
                                   int32_t default_max_tokens, int32_t max_model_len) {
  if (num_prompt_tokens >= max_model_len)
    return bad_request(fmt::format("This model's maximum context length is {} tokens. However, your prompt has {} "
                                   "tokens, which leaves no room for output.",
                                   max_model_len, num_prompt_tokens),
                       "prompt");
  int32_t room = max_model_len - num_prompt_tokens;
  if (!requested) return std::min(default_max_tokens, room);
  if (*requested > room)
    return bad_request(
        fmt::format("This model's maximum context length is {} tokens. However, you requested {} "
                    "tokens ({} in the prompt, {} for the completion).",
                    max_model_len, static_cast<int64_t>(num_prompt_tokens) + *requested, num_prompt_tokens, *requested),
        "max_tokens");
  return *requested;
}

ResponseJson usage_json(const Usage& usage) {
  return {{"prompt_tokens", usage.prompt_tokens},
          {"completion_tokens", usage.completion_tokens},
          {"total_tokens", usage.prompt_tokens + usage.completion_tokens}};
}

double json_logprob(float logprob) {
  if (std::isnan(logprob)) return -9999.0;
  return std::max(static_cast<double>(logprob), -9999.0);
}

ResponseJson completion_logprobs_json(const std::vector<engine::TokenLogprob>& logprobs, const TokenTextFn& token_text,
                                      int64_t& text_offset) {
  ResponseJson tokens = ResponseJson::array(), token_logprobs = ResponseJson::array(),
               top_logprobs = ResponseJson::array(), offsets = ResponseJson::array();
  for (const auto& entry : logprobs) {
    std::string text = token_text(entry.token_id);
    tokens.push_back(text);
    token_logprobs.push_back(json_logprob(entry.logprob));
    // The candidates in rank order, the sampled token placed by its logprob
    // when the top-n do not hold it (ties: after the candidates that share its value).
    std::vector<engine::TopLogprob> ranked = entry.top;
    const bool listed = std::any_of(ranked.begin(), ranked.end(),
                                    [&](const engine::TopLogprob& c) { return c.token_id == entry.token_id; });
    if (!listed) {
      auto at = std::find_if(ranked.begin(), ranked.end(),
                             [&](const engine::TopLogprob& c) { return c.logprob < entry.logprob; });
      ranked.insert(at, engine::TopLogprob{entry.token_id, entry.logprob});
    }
    ResponseJson top = ResponseJson::object();
    for (const auto& candidate : ranked) {
      std::string candidate_text = token_text(candidate.token_id);
      if (!top.contains(candidate_text)) top[candidate_text] = json_logprob(candidate.logprob);
    }
    top_logprobs.push_back(std::move(top));
    offsets.push_back(text_offset);
    text_offset += utf8_length(text);
  }
  return {{"tokens", std::move(tokens)},
          {"token_logprobs", std::move(token_logprobs)},
          {"top_logprobs", std::move(top_logprobs)},
          {"text_offset", std::move(offsets)}};
}

int64_t utf8_length(std::string_view text) {
  int64_t n = 0;
  for (unsigned char c : text) n += (c & 0xC0) != 0x80;
  return n;
}

namespace {
ResponseJson utf8_bytes(const std::string& text) {
  ResponseJson bytes = ResponseJson::array();
  for (unsigned char c : text) bytes.push_back(static_cast<int>(c));
  return bytes;
}
}  // namespace

ResponseJson chat_logprobs_json(const std::vector<engine::TokenLogprob>& logprobs, const TokenTextFn& token_text) {
  ResponseJson content = ResponseJson::array();
  for (const auto& entry : logprobs) {
    std::string text = token_text(entry.token_id);
    ResponseJson top = ResponseJson::array();
    for (const auto& candidate : entry.top) {
      std::string candidate_text = token_text(candidate.token_id);
      top.push_back({{"token", candidate_text},
                     {"logprob", json_logprob(candidate.logprob)},
                     {"bytes", utf8_bytes(candidate_text)}});
    }
    content.push_back({{"token", text},
                       {"logprob", json_logprob(entry.logprob)},
                       {"bytes", utf8_bytes(text)},
                       {"top_logprobs", std::move(top)}});
  }
  return {{"content", std::move(content)}};
}

ResponseJson prompt_logprobs_json(const std::vector<engine::PromptTokenLogprob>& logprobs,
                                  const TokenTextFn& token_text) {
  ResponseJson out = ResponseJson::array();
  out.push_back(nullptr);
  for (const auto& entry : logprobs) {
    ResponseJson position = ResponseJson::object();
    auto put = [&](int32_t id, float logprob, int32_t rank) {
      position[std::to_string(id)] = {
          {"logprob", json_logprob(logprob)}, {"rank", rank}, {"decoded_token", token_text(id)}};
    };
    put(entry.token_id, entry.logprob, entry.rank);
    for (size_t i = 0; i < entry.top.size(); ++i)
      put(entry.top[i].token_id, entry.top[i].logprob, static_cast<int32_t>(i + 1));
    out.push_back(std::move(position));
  }
  return out;
}

ResponseJson finish_reason_json(engine::FinishReason reason) {
  switch (reason) {
    case engine::FinishReason::kNone:
      return nullptr;
    case engine::FinishReason::kStop:
      return "stop";
    case engine::FinishReason::kLength:
      return "length";
    case engine::FinishReason::kAbort:
      return "abort";
    case engine::FinishReason::kError:
      return "error";
  }
  return nullptr;
}

ResponseJson stop_reason_json(const std::optional<std::string>& stop_string, const std::optional<int32_t>& stop_id) {
  if (stop_string) return *stop_string;
  if (stop_id) return *stop_id;
  return nullptr;
}

namespace {
ResponseJson kv_params_or_null(const std::optional<ResponseJson>& params) {
  return params ? *params : ResponseJson(nullptr);
}
}  // namespace

ResponseJson completion_response(const ResponseHeader& header, const std::vector<ChoiceResult>& choices,
                                 const Usage& usage, const std::optional<ResponseJson>& kv_transfer_params) {
  ResponseJson out_choices = ResponseJson::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const auto& c = choices[i];
    out_choices.push_back({{"index", i},
                           {"text", c.text},
                           {"logprobs", c.logprobs},
                           {"finish_reason", finish_reason_json(c.finish_reason)},
                           {"stop_reason", c.stop_reason},
                           {"prompt_logprobs", c.prompt_logprobs ? *c.prompt_logprobs : ResponseJson(nullptr)}});
    if (c.token_ids) out_choices.back()["token_ids"] = *c.token_ids;
  }
  return {{"id", header.id},
          {"object", "text_completion"},
          {"created", header.created},
          {"model", header.model},
          {"choices", std::move(out_choices)},
          {"usage", usage_json(usage)},
          {"kv_transfer_params", kv_params_or_null(kv_transfer_params)}};
}

ResponseJson chat_response(const ResponseHeader& header, const std::vector<ChoiceResult>& choices, const Usage& usage,
                           const std::optional<ResponseJson>& kv_transfer_params) {
  ResponseJson out_choices = ResponseJson::array();
  for (size_t i = 0; i < choices.size(); ++i) {
    const auto& c = choices[i];
    ResponseJson calls = ResponseJson::array();
    for (const auto& call : c.tool_calls) calls.push_back(tool_call_json(call));
    ResponseJson content = c.content_is_null ? ResponseJson(nullptr) : ResponseJson(c.text);
    // vLLM: a reply whose tool calls were parsed finishes with "tool_calls".
    ResponseJson finish =
        c.tool_calls.empty() || c.keep_finish_reason ? finish_reason_json(c.finish_reason) : ResponseJson("tool_calls");
    out_choices.push_back(
        {{"index", i},
         {"message", {{"role", "assistant"}, {"content", std::move(content)}, {"tool_calls", std::move(calls)}}},
         {"logprobs", c.logprobs},
         {"finish_reason", std::move(finish)},
         {"stop_reason", c.stop_reason}});
    if (c.token_ids) out_choices.back()["token_ids"] = *c.token_ids;
  }
  return {{"id", header.id},
          {"object", "chat.completion"},
          {"created", header.created},
          {"model", header.model},
          {"choices", std::move(out_choices)},
          {"usage", usage_json(usage)},
          {"prompt_logprobs",
           choices.empty() || !choices[0].prompt_logprobs ? ResponseJson(nullptr) : *choices[0].prompt_logprobs},
          {"kv_transfer_params", kv_params_or_null(kv_transfer_params)}};
}

ResponseJson tool_call_json(const ToolCall& call) {
  return {{"id", call.id}, {"type", "function"}, {"function", {{"name", call.name}, {"arguments", call.arguments}}}};
}

ResponseJson completion_chunk(const ResponseHeader& header, int32_t index, const std::string& text,
                              ResponseJson logprobs, ResponseJson finish_reason, ResponseJson stop_reason) {
  ResponseJson choice = {{"index", index},
                         {"text", text},
                         {"logprobs", std::move(logprobs)},
                         {"finish_reason", std::move(finish_reason)},
                         {"stop_reason", std::move(stop_reason)}};
  return {{"id", header.id},
          {"object", "text_completion"},
          {"created", header.created},
          {"model", header.model},
          {"choices", ResponseJson::array({std::move(choice)})}};
}

ResponseJson chat_chunk(const ResponseHeader& header, int32_t index, ResponseJson delta, ResponseJson logprobs,
                        ResponseJson finish_reason, ResponseJson stop_reason) {
  ResponseJson choice = {{"index", index},
                         {"delta", std::move(delta)},
                         {"logprobs", std::move(logprobs)},
                         {"finish_reason", std::move(finish_reason)},
                         {"stop_reason", std::move(stop_reason)}};
  return {{"id", header.id},
          {"object", "chat.completion.chunk"},
          {"created", header.created},
          {"model", header.model},
          {"choices", ResponseJson::array({std::move(choice)})}};
}

ResponseJson usage_chunk(const ResponseHeader& header, const char* object, const Usage& usage) {
  return {{"id", header.id},
          {"object", object},
          {"created", header.created},
          {"model", header.model},
          {"choices", ResponseJson::array()},
          {"usage", usage_json(usage)}};
}

std::string sse_event(const ResponseJson& payload) {
  // error_handler::replace keeps a stream alive when generated text holds an
  // invalid UTF-8 sequence; the engine promises none, this is the backstop.
  return "data: " + payload.dump(-1, ' ', false, ResponseJson::error_handler_t::replace) + "\n\n";
}

}  // namespace pd::server
