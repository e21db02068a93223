// Server-sent-events helpers for the streaming passthrough. Pure.
#pragma once

#include <optional>
#include <string_view>

namespace pd::router {

// Offset just past the first complete event ("\n\n" or "\r\n\r\n") in `data`; nullopt if none yet.
std::optional<size_t> find_event_end(std::string_view data);

// If `event` is a `data:` event whose JSON payload is an OpenAI error object
// ({"error": {...}}), the HTTP status that error stands for: for one of
// pdserve's string codes (frontend/api_error.cc, e.g. "timeout"), the status
// pdserve gives it; for an integer code 400..599, that integer; else 502.
// nullopt for every other event.
std::optional<int> error_event_status(std::string_view event);

// The HTTP status pdserve answers with for an error of this string code
// (frontend/api_error.cc); nullopt for a code pdserve does not use.
std::optional<int> pdserve_error_code_status(std::string_view code);

}  // namespace pd::router
