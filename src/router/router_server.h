// pdrouter's handlers and request flows (collocated, P/D READ, P/D WRITE) behind the HTTP front end
// (src/frontend: listener, connection cap, request reading, error shape) it shares with pdserve.
//
// Threads: `num_io_threads` io threads, each running its own io_context. A
// client connection and every leg it causes run on one io thread, so the
// state of one request (struct Exchange in router_server.cc) needs no locks;
// cancelling a leg is closing its socket from the same thread.
#pragma once

#include <memory>
#include <thread>
#include <vector>

#include "common/status.h"
#include "frontend/listener.h"
#include "router/asio.h"
#include "router/config.h"
#include "router/discovery.h"

namespace pd::router {

class RouterServer {
 public:
  // A client connection holds its own socket and, during a P/D request, a producer and a
  // consumer leg's connections.
  static constexpr int64_t kFdsPerClientConnection = 3;
  // Refused connections being answered at once; more are closed without an answer, so a
  // flood of them costs at most this many file descriptors beyond the cap.
  static constexpr int64_t kMaxRefusalsInFlight = frontend::Listener::kMaxRefusalsInFlight;

  explicit RouterServer(RouterConfig config);
  ~RouterServer();
  RouterServer(const RouterServer&) = delete;
  RouterServer& operator=(const RouterServer&) = delete;

  // Binds the HTTP listener and the registration socket, starts all threads.
  Status start();
  // Stops accepting, stops every thread and joins them.
  void stop();

  uint16_t http_port() const { return http_port_; }
  int registration_port() const { return discovery_.registration_port(); }

  struct Impl;

 private:
  RouterConfig config_;
  Discovery discovery_;
  std::vector<std::unique_ptr<net::io_context>> io_contexts_;
  std::vector<std::thread> io_threads_;
  std::unique_ptr<Impl> impl_;
  uint16_t http_port_ = 0;
  bool stopped_ = false;
};

}  // namespace pd::router
