// Server-sent-events helpers for the streaming passthrough. Pure.
#pragma once

#include <optional>
#include <string_view>

namespace pd::router {

// Offset just past the first complete event ("\n\n" or "\r\n\r\n") in `data`; nullopt if none yet.
std::optional<size_t> find_event_end(std::string_view data);

// If `event` is a `data:` event whose JSON payload is an OpenAI error object
// ({"error": {...}}), the HTTP status that error stands for: error.code when
// it is an integer 400..599, else 502. nullopt for every other event.
std::optional<int> error_event_status(std::string_view event);

}  // namespace pd::router
