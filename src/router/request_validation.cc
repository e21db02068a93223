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
    const auto& request = std::get<server::CompletionRequest>(parsed);
    out.num_prompts = request.prompts.size();
    out.n = request.fields.n;
    out.prompt = plan_prompt_tokens(request);
    return std::nullopt;
  }
  auto parsed = server::parse_chat_request(body, limits);
  if (auto* error = std::get_if<server::ApiError>(&parsed)) return std::move(*error);
  const auto& request = std::get<server::ChatRequest>(parsed);
  out.num_prompts = 1;
  out.n = request.fields.n;
  out.prompt = plan_prompt_tokens(request);
  return std::nullopt;
}

server::ApiError unreadable_request_error(GenerationRoute route, std::string_view body, std::string reason) {
  static const server::RequestLimits limits = router_limits();
  auto object = server::parse_json_object(body, limits.max_json_depth);
  if (auto* error = std::get_if<server::ApiError>(&object)) return std::move(*error);
  ValidatedRequest ignored;
  if (std::optional<server::ApiError> invalid =
          validate_generation_request(route, std::get<nlohmann::ordered_json>(object), ignored)) {
    return std::move(*invalid);
  }
  return server::bad_request(std::move(reason));
}

server::ApiError upstream_error(std::string message, bool timed_out) {
  if (timed_out) return server::request_timeout(std::move(message));
  return server::ApiError{502, std::move(message), "service_unavailable", "", "upstream_error"};
}

server::ApiError no_instance_available(std::string message) {
  return server::ApiError{503, std::move(message), "service_unavailable", "", "no_instance_available"};
}

}  // namespace pd::router
