// The engine's own request validation, applied once at the router before any
// leg exists. A request an engine would refuse must not reach a producer: the
// producer leg carries max_tokens = 1 and would accept what the consumer then
// refuses, leaving the prompt's KV held on the producer for nothing.
//
// This is pdserve's parser (server::parse_completion_request /
// parse_chat_request, which fills engine::SamplingParams), linked, not a copy.
// The router does not know an instance's max_model_len, so that one
// model-dependent bound (max_tokens, min_tokens against the context length) is
// left to the engine; everything else is checked with pdserve's default limits.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include <nlohmann/json.hpp>

#include "router/prompt_tokens.h"
#include "server/api_error.h"

namespace pd::router {

enum class GenerationRoute { kCompletions, kChat };

struct ValidatedRequest {
  size_t num_prompts = 1;  // /v1/completions: prompts in a batched `prompt`; chat: 1
  int32_t n = 1;           // choices per prompt
  // How to get the prompt's token ids, from what the parser read (the body is parsed once).
  PromptTokensPlan prompt;
};

// The engine's verdict on a client body (without the client's kv_transfer_params): the
// ApiError pdserve would answer (same message, type, param and code), or what the router needs.
std::optional<server::ApiError> validate_generation_request(GenerationRoute route, const nlohmann::ordered_json& body,
                                                            ValidatedRequest& out);

// The ApiError pdserve answers for a body the router could not read (`reason` is the router's
// own message): not JSON or not an object as pdserve words it, a mistyped field named in `param`
// by pdserve's parser, and otherwise a 400 with `reason`.
server::ApiError unreadable_request_error(GenerationRoute route, std::string_view body, std::string reason);

// Errors the router itself answers, in pdserve's shape (server::ApiError).
// An instance could not be reached or failed mid-request: 504 timeout_error when `timed_out`,
// else 502 service_unavailable with code "upstream_error".
server::ApiError upstream_error(std::string message, bool timed_out);
// No instance can serve the request now: 503 service_unavailable, code "no_instance_available".
server::ApiError no_instance_available(std::string message);

}  // namespace pd::router
