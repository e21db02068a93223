#include "router/request_validation.h"

#include <limits>
#include <variant>

#include "server/openai_protocol.h"

namespace pd::router {

namespace {

server::RequestLimits router_limits() {
  server::RequestLimits limits;  // pdserve's defaults
  // The one model-dependent bound: each engine checks it against its own context length.
  limits.max_model_len = std::numeric_limits<int32_t>::max();
  return limits;
}

}  // namespace

std::optional<server::ApiError> validate_generation_request(GenerationRoute route, const nlohmann::ordered_json& body,
                                                            ValidatedRequest& out) {
  static const server::RequestLimits limits = router_limits();
  if (route == GenerationRoute::kCompletions) {
    auto parsed = server::parse_completion_request(body, limits);
    if (auto* error = std::get_if<server::ApiError>(&parsed)) return std::move(*error);
    out.num_prompts = std::get<server::CompletionRequest>(parsed).prompts.size();
    return std::nullopt;
  }
  auto parsed = server::parse_chat_request(body, limits);
  if (auto* error = std::get_if<server::ApiError>(&parsed)) return std::move(*error);
  out.num_prompts = 1;
  return std::nullopt;
}

}  // namespace pd::router
