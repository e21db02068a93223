// OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with
// the HTTP status that goes with them. Every failure pdserve and pdrouter answer
// goes through ApiError, one factory per kind of error, so the shape, the type,
// the code and the status stay the same wherever the error is raised.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

#include "common/status.h"

namespace pd::frontend {

struct ApiError {
  int http_status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // the offending request field, empty when none
  std::string code;   // machine-readable reason, empty when none

  nlohmann::json to_json() const;
  // to_json() as response text. Messages can quote what a client or a peer sent (a path, a
  // field): invalid UTF-8 becomes U+FFFD instead of failing the answer.
  std::string to_text() const;
};

ApiError bad_request(std::string message, std::string param = {});
// A request field (or value) this server does not implement: 400 with code
// "unsupported_parameter", as OpenAI answers one it does not know.
ApiError unsupported(std::string message, std::string param);
// The request ran past --request-timeout-ms (or another deadline): 504.
ApiError request_timeout(std::string message);
// The request names state already in flight here (e.g. a duplicate transfer id): 409.
ApiError conflict(std::string message, std::string param);
ApiError model_not_found(const std::string& model);
ApiError route_not_found(const std::string& target);
ApiError method_not_allowed(const std::string& method, const std::string& target);
ApiError body_too_large(size_t max_body_bytes);
// The connection arrived while --max-connections others were open (503).
ApiError too_many_connections(int64_t max_connections);
ApiError unauthorized();
ApiError overloaded(std::string message);
ApiError internal(std::string message);

// Maps a Status from another module (engine, tokenizer) to the status a client
// should see: caller mistakes are 400, capacity is 503, everything else 500.
ApiError api_error_from_status(const Status& status, std::string param = {});

}  // namespace pd::frontend
