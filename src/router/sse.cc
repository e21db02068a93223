#include "router/sse.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <utility>

namespace pd::router {

std::optional<size_t> find_event_end(std::string_view data) {
  size_t lf = data.find("\n\n");
  size_t crlf = data.find("\r\n\r\n");
  std::optional<size_t> end;
  if (lf != std::string_view::npos) end = lf + 2;
  if (crlf != std::string_view::npos) end = std::min(end.value_or(crlf + 4), crlf + 4);
  return end;
}

std::optional<int> pdserve_error_code_status(std::string_view code) {
  // Kept in step with frontend/api_error.cc and the ApiErrors built in server/openai_service.cc.
  static constexpr std::pair<std::string_view, int> kStatusByCode[] = {
      {"invalid_value", 400},   {"invalid_api_key", 401},    {"permission_denied", 403}, {"not_found", 404},
      {"model_not_found", 404}, {"method_not_allowed", 405}, {"request_too_large", 413}, {"internal_error", 500},
      {"unavailable", 503},     {"engine_overloaded", 503},  {"timeout", 504},           {"deadline_exceeded", 504},
  };
  for (const auto& [known_code, status] : kStatusByCode) {
    if (known_code == code) return status;
  }
  return std::nullopt;
}

std::optional<int> error_event_status(std::string_view event) {
  constexpr std::string_view kData = "data:";
  size_t start = event.find(kData);
  if (start == std::string_view::npos) return std::nullopt;
  std::string_view payload = event.substr(start + kData.size());
  size_t line_end = payload.find('\n');
  if (line_end != std::string_view::npos) payload = payload.substr(0, line_end);
  nlohmann::json parsed = nlohmann::json::parse(payload, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded() || !parsed.is_object()) return std::nullopt;
  auto error = parsed.find("error");
  if (error == parsed.end() || error->is_null()) return std::nullopt;
  if (error->is_object()) {
    auto code = error->find("code");
    if (code != error->end() && code->is_string()) {
      if (std::optional<int> status = pdserve_error_code_status(code->get_ref<const std::string&>())) return status;
    }
    if (code != error->end() && code->is_number_integer()) {
      const int64_t status = code->get<int64_t>();
      if (status >= 400 && status <= 599) return static_cast<int>(status);
    }
  }
  return 502;
}

}  // namespace pd::router
