// The listening socket of pdserve and pdrouter and its accept loop: every accepted connection
// is served (a slot of --max-connections), answered 503 at once (over the cap), or closed (over
// the cap while kMaxRefusalsInFlight answers are being written). The loop never ends on an
// accept error (EMFILE, ENFILE, ...): it logs at most once a second, waits kAcceptRetryDelay
// and accepts again; only closing the acceptor ends it.
//
// Threads: the accept loop runs on the executor given to bind(); each connection runs on the
// executor the place function picks for it. stop_accepting() may be called from any thread.
//
// Lifetime: the listener must outlive every connection coroutine it started (their slots are
// released into its gate), and close() must run before the io_context of bind()'s executor is
// destroyed. So: stop the io threads, close(), destroy the io_contexts, then the listener.
#pragma once

// g++ 12 + Boost 1.74: <utility> must precede the Asio headers.
#include <utility>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/ip/tcp.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "common/connection_limit.h"
#include "common/log_throttle.h"
#include "common/metrics.h"
#include "common/status.h"

namespace pd::frontend {

namespace net = boost::asio;
using tcp = net::ip::tcp;

struct ListenerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;  // 0 = any free port; port() reports the bound one
  int64_t max_connections = 1024;
  int64_t write_timeout_ms = 30'000;  // writing a refusal
  std::string log_name = "pdserve";   // starts the listener's log lines
  std::string server_header;          // the refusal's Server header; empty: none
};

// Where an accepted connection runs: the executor of its socket and coroutine, and a number
// handed back to the serve function with it (pdrouter: the index of its io thread).
struct Placement {
  net::any_io_executor executor;
  size_t index = 0;
};

class Listener {
 public:
  // Refused connections being answered at once; more are closed without an answer, so a flood
  // of them costs at most this many file descriptors beyond the cap.
  static constexpr int64_t kMaxRefusalsInFlight = ConnectionGate::kMaxRefusalsInFlight;
  // The wait after a failed accept, so an error that repeats (EMFILE) does not spin the loop.
  static constexpr std::chrono::milliseconds kAcceptRetryDelay{10};

  using PlaceFn = std::function<Placement()>;
  // Serves one connection; `slot` is held in its coroutine frame until the connection ends.
  using ServeFn = std::function<net::awaitable<void>(tcp::socket socket, size_t index, ConnectionSlot slot)>;

  // `refused` counts connections answered 503 or closed at the cap.
  Listener(ListenerOptions options, metrics::Counter& refused);
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  // Opens, binds and listens on options.host:port; the accept loop will run on `executor`.
  Status bind(const net::any_io_executor& executor);
  uint16_t port() const { return bound_port_; }
  // Starts the accept loop (after bind()). Every accepted socket gets TCP_NODELAY.
  void start(PlaceFn place, ServeFn serve);
  // Stops accepting; connections already open continue. Thread-safe.
  void stop_accepting();
  // Closes and destroys the acceptor. Only once no thread runs the accept loop's executor.
  void close();

 private:
  net::awaitable<void> accept_loop();
  net::awaitable<void> refuse(tcp::socket socket, ConnectionSlot refusal_slot);

  ListenerOptions options_;
  metrics::Counter& refused_;
  ConnectionGate gate_;
  std::optional<tcp::acceptor> acceptor_;
  PlaceFn place_;
  ServeFn serve_;
  uint16_t bound_port_ = 0;
  LogThrottle accept_error_log_{1'000'000'000};  // touched by the accept loop only
};

}  // namespace pd::frontend
