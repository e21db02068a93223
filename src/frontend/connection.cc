#include "frontend/connection.h"

#include <fmt/format.h>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/string.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/write.hpp>

#include <algorithm>
#include <string_view>
#include <vector>

namespace pd::frontend {

using boost::system::error_code;
using net::use_awaitable;
using tcp = net::ip::tcp;

namespace {

// The bytes a client may still send after a 413 that we read and discard: enough for the body it
// declared (or a few times the limit), bounded.
size_t drain_bytes_after_413(size_t max_body_bytes) {
  return std::max<size_t>(4 * max_body_bytes, 16u << 20);
}

}  // namespace

net::awaitable<ReadResult> read_request(beast::tcp_stream& stream, beast::flat_buffer& buffer,
                                        const RequestLimits& limits, Request& request) {
  http::request_parser<http::string_body> parser;
  parser.header_limit(static_cast<std::uint32_t>(limits.max_header_bytes));
  parser.body_limit(limits.max_body_bytes);
  stream.expires_after(std::chrono::milliseconds(limits.idle_timeout_ms));
  error_code ec;
  co_await http::async_read_header(stream, buffer, parser, net::redirect_error(use_awaitable, ec));
  if (!ec && !parser.is_done()) {
    if (beast::iequals(parser.get()[http::field::expect], "100-continue")) {
      static constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
      stream.expires_after(std::chrono::milliseconds(limits.write_timeout_ms));
      co_await net::async_write(stream, net::buffer(kContinue.data(), kContinue.size()),
                                net::redirect_error(use_awaitable, ec));
    }
    if (!ec) {
      stream.expires_after(std::chrono::milliseconds(limits.idle_timeout_ms));
      co_await http::async_read(stream, buffer, parser, net::redirect_error(use_awaitable, ec));
    }
  }
  if (!ec) {
    stream.expires_never();
    request = parser.release();
    co_return ReadResult{ReadOutcome::kRequest, 0};
  }
  switch (classify_read_error(ec)) {
    case ReadFailure::kClosed:
      co_return ReadResult{ReadOutcome::kClosed, 0};
    case ReadFailure::kTooLarge: {
      const Response response = error_response(body_too_large(limits.max_body_bytes), 11, false, limits.server_header);
      if (co_await write_response(stream, response, limits.write_timeout_ms)) {
        co_await drain_before_close(stream, drain_bytes_after_413(limits.max_body_bytes), std::chrono::seconds(2));
      }
      co_return ReadResult{ReadOutcome::kAnswered, 413};
    }
    case ReadFailure::kMalformed:
      break;
  }
  const ApiError error = bad_request(fmt::format("malformed HTTP request: {}", ec.message()));
  const Response response = error_response(error, 11, false, limits.server_header);
  co_await write_response(stream, response, limits.write_timeout_ms);
  co_return ReadResult{ReadOutcome::kAnswered, 400};
}

net::awaitable<bool> write_response(beast::tcp_stream& stream, const Response& response, int64_t timeout_ms) {
  stream.expires_after(std::chrono::milliseconds(timeout_ms));
  error_code ec;
  co_await http::async_write(stream, response, net::redirect_error(use_awaitable, ec));
  stream.expires_never();
  co_return !ec;
}

net::awaitable<void> drain_before_close(beast::tcp_stream& stream, size_t max_drain_bytes,
                                        std::chrono::milliseconds max_drain_time) {
  error_code ec;
  stream.socket().shutdown(tcp::socket::shutdown_send, ec);
  std::vector<char> sink(std::min<size_t>(max_drain_bytes, 64 * 1024));
  size_t num_drained = 0;
  stream.expires_after(max_drain_time);
  while (!ec && num_drained < max_drain_bytes) {
    num_drained += co_await stream.async_read_some(net::buffer(sink), net::redirect_error(use_awaitable, ec));
  }
}

}  // namespace pd::frontend
