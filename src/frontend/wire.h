// The pure parts of the HTTP front end: what a request's path is, whether it carries the API
// key, what a failed read means, and the error response every refusal and failure is written
// as. No sockets; unit-tested directly (tests/unit/frontend).
#pragma once

// g++ 12 + Boost 1.74: <utility> must precede the Asio headers.
#include <utility>

#include <boost/beast/http/message.hpp>
#include <boost/beast/http/string_body.hpp>
#include <boost/system/error_code.hpp>

#include <cstdint>
#include <string_view>

#include "frontend/api_error.h"

namespace pd::frontend {

namespace http = boost::beast::http;

using Request = http::request<http::string_body>;
using Response = http::response<http::string_body>;

// A request target without its query string ("/v1/models?x=1" -> "/v1/models").
std::string_view path_of(std::string_view target);

// True when `authorization` (the header's value) is exactly "Bearer <api_key>", or when no key
// is configured (`api_key` empty). Compared in constant time, so the key cannot be guessed byte
// by byte from response times.
bool bearer_authorized(std::string_view authorization, std::string_view api_key);

// What a failed read of a request (header or body) means for the connection.
enum class ReadFailure : uint8_t {
  kClosed,     // the client closed, reset or idled out, or the read was cancelled: close silently
  kTooLarge,   // the body is over the limit: answer 413, drain, close
  kMalformed,  // anything else breaks the framing: answer 400, close
};
ReadFailure classify_read_error(const boost::system::error_code& ec);

// `error` as an HTTP response: its status, a JSON body (to_text()), and `Connection: close`
// unless `keep_alive`. `server_header` names the Server header; empty: none.
Response error_response(const ApiError& error, unsigned http_version, bool keep_alive, std::string_view server_header);

}  // namespace pd::frontend
