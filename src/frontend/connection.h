// Reading requests off one client connection, and closing it without a reset after an early
// answer. Used by every connection coroutine of pdserve and pdrouter, on that connection's
// executor.
#pragma once

// g++ 12 + Boost 1.74: <utility> must precede the Asio headers.
#include <utility>

#include <boost/asio/awaitable.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "frontend/wire.h"

namespace pd::frontend {

namespace net = boost::asio;
namespace beast = boost::beast;

struct RequestLimits {
  size_t max_header_bytes = 16u << 10;
  size_t max_body_bytes = 8u << 20;  // a larger declared or sent body is answered 413
  int64_t idle_timeout_ms = 60'000;  // the wait for a request's header, then for its body
  int64_t write_timeout_ms = 30'000;
  std::string server_header;  // on the 400 / 413 answers; empty: none
};

enum class ReadOutcome : uint8_t {
  kRequest,   // a complete request: serve it
  kClosed,    // the client closed, reset or idled out: close the connection
  kAnswered,  // malformed or over the body limit: answered (status in ReadResult), close the connection
};

struct ReadResult {
  ReadOutcome outcome = ReadOutcome::kClosed;
  int status = 0;  // kAnswered: 400 or 413
};

// Reads the next request into `request`. Sends "100 Continue" to a client that asks for it
// before its body (curl does, for bodies over 1 KiB; it waits a second otherwise). A body over
// the limit is refused as soon as its header declares it: 413, then drain_before_close. A
// request whose framing is broken is answered 400 (what follows it cannot be framed). Every
// wait is bounded by `limits` (idle for reads, write for writes).
net::awaitable<ReadResult> read_request(beast::tcp_stream& stream, beast::flat_buffer& buffer,
                                        const RequestLimits& limits, Request& request);

// Writes a whole response within `timeout_ms`. False when the write failed or timed out.
net::awaitable<bool> write_response(beast::tcp_stream& stream, const Response& response, int64_t timeout_ms);

// Lingering close after answering a request early (a body over the limit, a connection over
// the cap): a client still sending would otherwise get a connection reset instead of the
// answer (unread bytes at close() make the kernel send RST, and the client's next send or read
// fails before it sees the response). Shuts down our sending side, then reads and discards for
// at most `max_drain_time` and `max_drain_bytes`; the caller then closes.
net::awaitable<void> drain_before_close(beast::tcp_stream& stream, size_t max_drain_bytes,
                                        std::chrono::milliseconds max_drain_time);

}  // namespace pd::frontend
