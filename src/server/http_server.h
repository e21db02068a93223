// A small HTTP/1.1 server on Boost.Beast + Asio C++20 coroutines.
//
// Threads: N I/O threads run one io_context. Each connection is one coroutine
// on its own strand, so everything about a connection (its socket, its
// exchange, state the handler keeps for it) is touched by one thread at a
// time without locks. Other threads (the engine) reach a connection only by
// posting to HttpExchange::executor().
//
// Owns: routing (404/405), auth on routes that ask for it, keep-alive and write
// timeouts, responses and event streams, and the pd_http_requests_total /
// pd_http_connections_refused_total counters. The listening socket, the
// connection cap (503 beyond it), body limits (413) and malformed HTTP (400)
// are the front end's (src/frontend), shared with pdrouter. Knows nothing about
// OpenAI or the engine.
#pragma once

// g++ 12 + Boost 1.74: <utility> must precede the Asio headers.
#include <utility>

#include <boost/asio/awaitable.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/string_body.hpp>
#include <boost/beast/http/verb.hpp>
#include <nlohmann/json.hpp>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/connection_limit.h"
#include "common/status.h"
#include "frontend/listener.h"
#include "server/api_error.h"

namespace pd::server {

namespace net = boost::asio;
namespace http = boost::beast::http;

using HttpRequest = http::request<http::string_body>;
using ConnectionExecutor = net::strand<net::io_context::executor_type>;

struct HttpServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;  // 0 = any free port; port() reports the bound one
  int32_t num_io_threads = 2;
  size_t max_body_bytes = 8u << 20;
  size_t max_header_bytes = 16u << 10;
  int64_t keep_alive_timeout_ms = 60'000;  // idle wait for the next request
  int64_t write_timeout_ms = 30'000;       // one write to a slow client
  std::string api_key;                     // checked on routes registered with requires_auth
  // Connections served at once. Each holds a file descriptor, a coroutine and its buffers;
  // without a cap, clients that keep sockets open exhaust RLIMIT_NOFILE and accept() then
  // fails for everyone, health checks included. A connection beyond the cap is answered 503
  // at once and closed. pdserve derives its default from the engine's capacity
  // (server_config.h) and checks it against RLIMIT_NOFILE at start-up.
  int64_t max_connections = 1024;
};

struct Connection;

// One request and its response. Lives on its connection's strand; a handler
// must call exactly one of respond_*() or the event-stream trio.
class HttpExchange {
 public:
  HttpExchange(std::shared_ptr<Connection> connection, HttpRequest request, const HttpServerOptions& options);
  ~HttpExchange();
  HttpExchange(const HttpExchange&) = delete;
  HttpExchange& operator=(const HttpExchange&) = delete;

  const HttpRequest& request() const { return request_; }
  const std::string& path() const { return path_; }  // target without the query string
  ConnectionExecutor executor() const;

  net::awaitable<void> respond(http::status status, std::string body, const char* content_type);
  net::awaitable<void> respond_json(http::status status, const nlohmann::json& body);
  net::awaitable<void> respond_error(const ApiError& error);

  // Server-sent events over chunked encoding. Each returns false once the
  // client is unreachable (write failed or timed out); later calls are no-ops.
  net::awaitable<bool> start_event_stream();
  net::awaitable<bool> send_event(std::string_view data);
  net::awaitable<bool> end_event_stream();

  // Notices a client that closes its connection while the handler waits on
  // something else (the engine). on_gone runs on this exchange's strand, at
  // most once. stop_watching() must be awaited before the exchange ends.
  void watch_for_disconnect(std::function<void()> on_gone);
  net::awaitable<void> stop_watching();

  // The client left before a response could be written: nothing more is
  // sent, the connection closes, and the request counts as status 499.
  void abandon() {
    status_code_ = 499;
    broken_ = true;
  }

  bool responded() const { return status_code_ != 0; }
  int status_code() const { return status_code_; }
  // False after a failed write or when the request asked to close.
  bool keep_alive() const { return keep_alive_ && !broken_; }

 private:
  struct WatchState;
  net::awaitable<bool> write_with_timeout(std::string_view bytes);
  // Chunked transfer encoding exists from HTTP/1.1 on.
  bool chunked_events() const { return request_.version() >= 11; }
  void arm_watch();

  std::shared_ptr<Connection> connection_;
  HttpRequest request_;
  std::string path_;
  const HttpServerOptions& options_;
  int status_code_ = 0;
  bool keep_alive_ = true;
  bool broken_ = false;
  bool stream_ended_ = false;
  std::shared_ptr<WatchState> watch_;
};

using Handler = std::function<net::awaitable<void>(HttpExchange&)>;

class HttpServer {
 public:
  // Refused connections being answered at once; more are closed without an answer, so
  // a flood of them costs at most this many file descriptors beyond the cap.
  static constexpr int64_t kMaxRefusalsInFlight = frontend::Listener::kMaxRefusalsInFlight;

  explicit HttpServer(HttpServerOptions options);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Register before start(). A path may have one handler per method.
  void route(http::verb method, std::string path, Handler handler, bool requires_auth = false);

  // Binds, listens and starts the I/O threads. After it returns, port() is the bound port.
  Status start();
  uint16_t port() const { return bound_port_; }
  // Stops accepting new connections; existing ones continue. Thread-safe.
  void stop_accepting();
  // Stops accepting, stops the io_context and joins the I/O threads. Idempotent.
  void stop();

 private:
  struct Route {
    http::verb method;
    std::string path;
    Handler handler;
    bool requires_auth;
  };
  net::awaitable<void> serve_connection(net::ip::tcp::socket socket, ConnectionSlot slot);
  net::awaitable<void> dispatch(HttpExchange& exchange);

  HttpServerOptions options_;
  // Declared before io_context_: connection coroutines destroyed with it release their slots here.
  frontend::Listener listener_;
  net::io_context io_context_;
  std::vector<Route> routes_;
  std::vector<std::thread> threads_;
  uint16_t bound_port_ = 0;
  std::atomic<bool> stopped_{false};
};

}  // namespace pd::server
