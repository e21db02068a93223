#include "frontend/wire.h"

#include <boost/asio/error.hpp>
#include <boost/beast/core/error.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/field.hpp>

namespace pd::frontend {

namespace net = boost::asio;

std::string_view path_of(std::string_view target) {
  return target.substr(0, target.find('?'));
}

bool bearer_authorized(std::string_view authorization, std::string_view api_key) {
  if (api_key.empty()) return true;
  static constexpr std::string_view kBearer = "Bearer ";
  if (authorization.size() != kBearer.size() + api_key.size()) return false;
  if (authorization.substr(0, kBearer.size()) != kBearer) return false;
  const std::string_view presented = authorization.substr(kBearer.size());
  unsigned char diff = 0;
  for (size_t i = 0; i < api_key.size(); ++i) diff |= static_cast<unsigned char>(presented[i] ^ api_key[i]);
  return diff == 0;
}

ReadFailure classify_read_error(const boost::system::error_code& ec) {
  if (ec == http::error::body_limit) return ReadFailure::kTooLarge;
  if (ec == http::error::end_of_stream || ec == net::error::eof || ec == boost::beast::error::timeout ||
      ec == net::error::connection_reset || ec == net::error::operation_aborted) {
    return ReadFailure::kClosed;
  }
  return ReadFailure::kMalformed;
}

Response error_response(const ApiError& error, unsigned http_version, bool keep_alive, std::string_view server_header) {
  Response response{static_cast<http::status>(error.http_status), http_version};
  if (!server_header.empty()) {
    response.set(http::field::server, boost::beast::string_view(server_header.data(), server_header.size()));
  }
  response.set(http::field::content_type, "application/json");
  response.keep_alive(keep_alive);
  response.body() = error.to_text();
  response.prepare_payload();
  return response;
}

}  // namespace pd::frontend
