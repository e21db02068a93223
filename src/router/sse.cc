#include "router/sse.h"

#include <nlohmann/json.hpp>

#include <algorithm>

namespace pd::router {

std::optional<size_t> find_event_end(std::string_view data) {
  size_t lf = data.find("\n\n");
  size_t crlf = data.find("\r\n\r\n");
  std::optional<size_t> end;
  if (lf != std::string_view::npos) end = lf + 2;
  if (crlf != std::string_view::npos) end = std::min(end.value_or(crlf + 4), crlf + 4);
  return end;
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
    if (code != error->end() && code->is_number_integer()) {
      int status = code->get<int>();
      if (status >= 400 && status <= 599) return status;
    }
  }
  return 502;
}

}  // namespace pd::router
