#include "frontend/api_error.h"

#include <fmt/format.h>

namespace pd::frontend {

nlohmann::json ApiError::to_json() const {
  nlohmann::json error = {{"message", message}, {"type", type}};
  error["param"] = param.empty() ? nlohmann::json(nullptr) : nlohmann::json(param);
  error["code"] = code.empty() ? nlohmann::json(nullptr) : nlohmann::json(code);
  return {{"error", std::move(error)}};
}

std::string ApiError::to_text() const {
  return to_json().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

ApiError bad_request(std::string message, std::string param) {
  return ApiError{400, std::move(message), "invalid_request_error", std::move(param), "invalid_value"};
}

ApiError unsupported(std::string message, std::string param) {
  return ApiError{400, std::move(message), "invalid_request_error", std::move(param), "unsupported_parameter"};
}

ApiError request_timeout(std::string message) {
  return ApiError{504, std::move(message), "timeout_error", "", "timeout"};
}

ApiError conflict(std::string message, std::string param) {
  return ApiError{409, std::move(message), "invalid_request_error", std::move(param), "conflict"};
}

ApiError model_not_found(const std::string& model) {
  return ApiError{404, fmt::format("The model `{}` does not exist.", model), "invalid_request_error", "model",
                  "model_not_found"};
}

ApiError route_not_found(const std::string& target) {
  return ApiError{404, fmt::format("No route for {}", target), "invalid_request_error", "", "not_found"};
}

ApiError method_not_allowed(const std::string& method, const std::string& target) {
  return ApiError{405, fmt::format("Method {} is not allowed for {}", method, target), "invalid_request_error", "",
                  "method_not_allowed"};
}

ApiError body_too_large(size_t max_body_bytes) {
  return ApiError{413, fmt::format("Request body is larger than the limit of {} bytes", max_body_bytes),
                  "invalid_request_error", "", "request_too_large"};
}

ApiError too_many_connections(int64_t max_connections) {
  return ApiError{503,
                  fmt::format("The server is serving its limit of {} connections (--max-connections); retry shortly",
                              max_connections),
                  "service_unavailable", "", "too_many_connections"};
}

ApiError unauthorized() {
  return ApiError{401, "Missing or invalid API key (expected 'Authorization: Bearer <key>')", "authentication_error",
                  "", "invalid_api_key"};
}

ApiError overloaded(std::string message) {
  return ApiError{503, std::move(message), "service_unavailable", "", "engine_overloaded"};
}

ApiError internal(std::string message) {
  return ApiError{500, std::move(message), "internal_error", "", "internal_error"};
}

ApiError api_error_from_status(const Status& status, std::string param) {
  switch (status.code()) {
    case ErrorCode::kInvalidArgument:
    case ErrorCode::kOutOfRange:
    case ErrorCode::kUnimplemented:
      return bad_request(status.message(), std::move(param));
    case ErrorCode::kResourceExhausted:
      return overloaded(status.message());
    case ErrorCode::kUnavailable:
      return ApiError{503, status.message(), "service_unavailable", "", "unavailable"};
    case ErrorCode::kPermissionDenied:
      return ApiError{403, status.message(), "permission_error", "", "permission_denied"};
    case ErrorCode::kNotFound:
      return ApiError{404, status.message(), "invalid_request_error", std::move(param), "not_found"};
    case ErrorCode::kDeadlineExceeded:
      return request_timeout(status.message());
    default:
      return internal(status.to_string());
  }
}

}  // namespace pd::frontend
