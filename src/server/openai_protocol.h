// The OpenAI wire format at the HTTP edge: request bodies are parsed and
// validated into native structs here, and responses/stream chunks are shaped
// here. JSON stays at this edge (STYLE.md: native types inside). Pure
// functions, no I/O: unit-tested directly (tests/unit/server).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "engine/generate_api.h"
#include "engine/sampling_params.h"
#include "server/api_error.h"

namespace pd::server {

// A value or the error a client gets for its request.
template <typename T>
using Parsed = std::variant<T, ApiError>;

template <typename T>
bool failed(const Parsed<T>& parsed) {
  return std::holds_alternative<ApiError>(parsed);
}

// Limits the parser enforces that do not need the model or the tokenizer.
struct RequestLimits {
  int32_t max_model_len = 4096;
  int32_t max_logprobs = 20;
  size_t max_stop_strings = 16;
  size_t max_stop_string_bytes = 1024;
  size_t max_stop_token_ids = 256;
  size_t max_batch_prompts = 64;
  size_t max_json_depth = 64;
  int32_t max_n = 64;            // choices per prompt
  size_t max_choices = 256;      // prompts x n
  size_t max_logit_bias = 1024;  // entries
  size_t max_allowed_token_ids = 1 << 18;
  size_t max_bad_words = 64;
  size_t max_bad_word_bytes = 256;
};

// Parses a request body as a JSON object. Malformed JSON, a non-object and
// nesting deeper than max_depth are 400s.
Parsed<nlohmann::ordered_json> parse_json_object(std::string_view body, size_t max_depth);

// One prompt of a completion request: text (tokenized by the server) or ids.
struct PromptInput {
  std::optional<std::string> text;
  std::vector<int32_t> token_ids;  // used when text is empty
};

// Structured output as a request asks for it (vLLM's fields; at most one per request). The
// service compiles it (src/grammar) into the constraint every choice of the request obeys.
struct StructuredOutput {
  enum class Kind { kJsonSchema, kJsonObject, kRegex, kChoice, kGrammar };
  Kind kind = Kind::kJsonSchema;
  std::string source;                // kJsonSchema: the schema as JSON text; kRegex: the regex; kGrammar: Lark
  std::vector<std::string> choices;  // kChoice
  std::string field;                 // the request field it came from, for errors (error.param)
};

// Fields shared by /v1/completions and /v1/chat/completions.
struct GenerationFields {
  std::string model;  // empty = the default served model
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  // stream_options.continuous_usage_stats: with include_usage, every chunk carries usage so far.
  bool continuous_usage_stats = false;
  int32_t n = 1;  // choices per prompt; choice j of a prompt is seeded with seed + j (vLLM)
  // Keep only the last k prompt tokens (vLLM's truncate_prompt_tokens; -1 = max_model_len).
  std::optional<int32_t> truncate_prompt_tokens;
  std::vector<std::string> bad_words;  // tokenized by the service into SamplingParams::bad_words_token_ids
  engine::SamplingParams sampling;     // max_tokens left at its default; see max_tokens below
  std::optional<int32_t> max_tokens;   // as requested; resolved against the prompt length later
  std::optional<nlohmann::ordered_json> kv_transfer_params;
  std::optional<std::string> request_id;    // vLLM extension: a client-chosen id prefix
  bool return_tokens_as_token_ids = false;  // vLLM extension: logprobs name tokens "token_id:<id>"
  bool return_token_ids = false;            // vLLM extension: each choice (and chunk) lists its token ids
  // response_format json_object / json_schema, guided_json / guided_regex / guided_choice /
  // guided_grammar, structured_outputs, or (chat) tool_choice "required" / a named function.
  std::optional<StructuredOutput> structured_output;
  // Whitespace a JSON constraint allows between tokens (structured_outputs.disable_any_whitespace,
  // guided_whitespace_pattern): llguidance's JSON options; ignored by regex, choice and grammar.
  bool json_compact_whitespace = false;
  std::optional<std::string> json_whitespace_pattern;
};

struct CompletionRequest {
  GenerationFields fields;
  std::vector<PromptInput> prompts;  // >= 1; each becomes n choices
  bool echo = false;                 // the prompt's text precedes each choice's text
  bool add_special_tokens = true;    // when tokenizing text prompts
};

struct ChatRequest {
  GenerationFields fields;
  nlohmann::ordered_json messages;  // validated; every content normalized to a string (or null)
  bool add_generation_prompt = true;
  nlohmann::ordered_json tools;  // validated; null when absent; rendered by the chat template
  // "auto" (the default with tools): the reply is parsed for tool calls; "none":
  // tools are rendered (as vLLM does) but the reply is plain text.
  bool parse_tool_calls = false;
  // tool_choice "required" / {"type": "function", ...}: the reply is held to a JSON schema
  // (fields.structured_output, field "tool_choice") and returned as tool calls, as vLLM does.
  enum class ForcedTool { kNone, kRequired, kNamed };
  ForcedTool forced_tool = ForcedTool::kNone;
  std::string forced_tool_name;  // kNamed
  nlohmann::ordered_json chat_template_kwargs = nlohmann::ordered_json::object();
  bool logprobs = false;
  bool add_special_tokens = false;  // the template writes its own special tokens
};

struct TokenizeRequest {
  std::string model;
  std::optional<std::string> prompt;  // completion-style
  nlohmann::ordered_json messages;    // chat-style (null when prompt is set)
  bool add_special_tokens = true;
  bool add_generation_prompt = true;
  bool return_token_strs = false;
  nlohmann::ordered_json tools;
  nlohmann::ordered_json chat_template_kwargs = nlohmann::ordered_json::object();
};

struct DetokenizeRequest {
  std::string model;
  std::vector<int32_t> tokens;
};

Parsed<CompletionRequest> parse_completion_request(const nlohmann::ordered_json& body, const RequestLimits& limits);
Parsed<ChatRequest> parse_chat_request(const nlohmann::ordered_json& body, const RequestLimits& limits);
// vLLM's schema for tool_choice: a named function's `parameters` (an object schema when it
// has none); "required": a non-empty array of {"name": one of the tools, "parameters": its
// schema}, with the tools' `$defs` lifted to the top so their `$ref`s still resolve.
Parsed<nlohmann::ordered_json> tool_choice_schema(const nlohmann::ordered_json& tools, ChatRequest::ForcedTool forced,
                                                  const std::string& name);

Parsed<TokenizeRequest> parse_tokenize_request(const nlohmann::ordered_json& body, const RequestLimits& limits);
Parsed<DetokenizeRequest> parse_detokenize_request(const nlohmann::ordered_json& body, const RequestLimits& limits);

// vLLM's rule: an explicit max_tokens must fit beside the prompt in
// max_model_len; without one, completions default to 16 (clamped to the room
// left) and chat to all the room left. A prompt that leaves no room is a 400.
Parsed<int32_t> resolve_max_tokens(int32_t num_prompt_tokens, std::optional<int32_t> requested,
                                   int32_t default_max_tokens, int32_t max_model_len);

// ---- responses ----

// Responses keep their keys in insertion order (OpenAI's field order; top
// logprobs in rank order).
using ResponseJson = nlohmann::ordered_json;

// Text of one token for logprobs ("token" fields).
using TokenTextFn = std::function<std::string(int32_t)>;

// Length of UTF-8 text in code points (what Python's len() gives vLLM).
int64_t utf8_length(std::string_view text);

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  int64_t cached_tokens = 0;
};
ResponseJson usage_json(const Usage& usage);

// JSON cannot hold -inf; like vLLM, clamp to -9999.
double json_logprob(float logprob);

// Completions logprobs object for a run of tokens, as vLLM writes it: each
// step's top_logprobs holds the top-n candidates and the sampled token (n + 1
// entries when it is not among them; logprobs 0 = the sampled token only), in
// rank order; text_offset advances by each token's length in characters
// (Unicode code points), not bytes.
ResponseJson completion_logprobs_json(const std::vector<engine::TokenLogprob>& logprobs, const TokenTextFn& token_text,
                                      int64_t& text_offset);
// Chat logprobs object {"content": [...]} for a run of tokens.
ResponseJson chat_logprobs_json(const std::vector<engine::TokenLogprob>& logprobs, const TokenTextFn& token_text);

// vLLM's prompt_logprobs list: null for the first prompt token (nothing
// precedes it), then per prompt token an object keyed by token id (as a string)
// holding {logprob, rank, decoded_token} for the prompt token itself (first, with
// its vocabulary rank) and for the top-n there (ranks 1..n, in rank order).
ResponseJson prompt_logprobs_json(const std::vector<engine::PromptTokenLogprob>& logprobs,
                                  const TokenTextFn& token_text);

// finish_reason / stop_reason as OpenAI and vLLM spell them.
ResponseJson finish_reason_json(engine::FinishReason reason);
ResponseJson stop_reason_json(const std::optional<std::string>& stop_string, const std::optional<int32_t>& stop_id);

struct ResponseHeader {
  std::string id;
  int64_t created = 0;
  std::string model;
};

// A parsed tool call of a chat reply (server/tool_calls.h finds them).
struct ToolCall {
  std::string id;  // "chatcmpl-tool-<32 hex digits>"
  std::string name;
  std::string arguments;  // a JSON object as a string
};
ResponseJson tool_call_json(const ToolCall& call);

// One finished choice of a non-streamed response.
struct ChoiceResult {
  std::string text;
  ResponseJson logprobs;  // null or the logprobs object
  engine::FinishReason finish_reason = engine::FinishReason::kNone;
  ResponseJson stop_reason;
  std::optional<std::vector<int32_t>> token_ids;  // return_token_ids
  bool content_is_null = false;                   // chat: "content": null (a reply of tool calls only)
  std::vector<ToolCall> tool_calls{};             // chat: finish_reason becomes "tool_calls" when any
  bool keep_finish_reason = false;                // ... unless set (tool_choice named: the engine's, as vLLM)
  // prompt_logprobs_json of the choice's prompt when asked for: per choice in
  // completions, once at the top of a chat response (from its first choice).
  std::optional<ResponseJson> prompt_logprobs{};
};

ResponseJson completion_response(const ResponseHeader& header, const std::vector<ChoiceResult>& choices,
                                 const Usage& usage, const std::optional<ResponseJson>& kv_transfer_params);
ResponseJson chat_response(const ResponseHeader& header, const std::vector<ChoiceResult>& choices, const Usage& usage,
                           const std::optional<ResponseJson>& kv_transfer_params);

ResponseJson completion_chunk(const ResponseHeader& header, int32_t index, const std::string& text,
                              ResponseJson logprobs, ResponseJson finish_reason, ResponseJson stop_reason);
ResponseJson chat_chunk(const ResponseHeader& header, int32_t index, ResponseJson delta, ResponseJson logprobs,
                        ResponseJson finish_reason, ResponseJson stop_reason);
// The final stream_options.include_usage chunk: no choices, usage set.
ResponseJson usage_chunk(const ResponseHeader& header, const char* object, const Usage& usage);

// "data: <json>\n\n" and the terminator.
std::string sse_event(const ResponseJson& payload);
inline constexpr std::string_view kSseDone = "data: [DONE]\n\n";

}  // namespace pd::server
