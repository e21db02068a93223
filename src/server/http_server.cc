#include "server/http_server.h"

#include <fmt/format.h>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http/chunk_encode.hpp>
#include <boost/beast/http/empty_body.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/serializer.hpp>
#include <boost/beast/http/write.hpp>

#include <algorithm>
#include <chrono>
#include <vector>

#include "common/clock.h"
#include "common/log.h"
#include "common/metrics.h"

namespace pd::server {

namespace beast = boost::beast;
using boost::system::error_code;
using net::use_awaitable;
using net::ip::tcp;

struct Connection {
  explicit Connection(tcp::socket socket) : stream(std::move(socket)) {}
  beast::tcp_stream stream;
};

namespace {

void count_request(const std::string& route, int status) {
  metrics::Registry::global()
      .counter("pd_http_requests_total", "HTTP requests answered, by route and status",
               {{"route", route}, {"status", std::to_string(status)}})
      .inc();
}

// Constant-time comparison so the API key cannot be guessed byte by byte.
bool equal_constant_time(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

}  // namespace

// ---- HttpExchange ----

struct HttpExchange::WatchState {
  explicit WatchState(const ConnectionExecutor& executor) : done(executor) {}
  std::function<void()> on_gone;
  bool armed = false;           // an async_wait is outstanding
  bool stop_requested = false;  // stop_watching() cancelled it
  net::steady_timer done;       // cancelled when the outstanding wait completes
};

HttpExchange::HttpExchange(std::shared_ptr<Connection> connection, HttpRequest request,
                           const HttpServerOptions& options)
    : connection_(std::move(connection)), request_(std::move(request)), options_(options) {
  std::string_view target(request_.target().data(), request_.target().size());
  path_ = std::string(target.substr(0, target.find('?')));
  keep_alive_ = request_.keep_alive();
}

HttpExchange::~HttpExchange() = default;

ConnectionExecutor HttpExchange::executor() const {
  // Every connection socket is created on a strand (see accept_loop).
  return *connection_->stream.get_executor().target<ConnectionExecutor>();
}

net::awaitable<bool> HttpExchange::write_with_timeout(std::string_view bytes) {
  if (broken_) co_return false;
  connection_->stream.expires_after(std::chrono::milliseconds(options_.write_timeout_ms));
  error_code ec;
  co_await net::async_write(connection_->stream, net::buffer(bytes.data(), bytes.size()),
                            net::redirect_error(use_awaitable, ec));
  if (ec) {
    broken_ = true;
    co_return false;
  }
  co_return true;
}

net::awaitable<void> HttpExchange::respond(http::status status, std::string body, const char* content_type) {
  status_code_ = static_cast<int>(status);
  http::response<http::string_body> response{status, request_.version()};
  response.set(http::field::server, "pdserve");
  response.set(http::field::content_type, content_type);
  response.keep_alive(keep_alive());
  response.body() = std::move(body);
  response.prepare_payload();
  if (broken_) co_return;
  connection_->stream.expires_after(std::chrono::milliseconds(options_.write_timeout_ms));
  error_code ec;
  co_await http::async_write(connection_->stream, response, net::redirect_error(use_awaitable, ec));
  if (ec) broken_ = true;
}

net::awaitable<void> HttpExchange::respond_json(http::status status, const nlohmann::json& body) {
  std::string text = body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  co_await respond(status, std::move(text), "application/json");
}

net::awaitable<void> HttpExchange::respond_error(const ApiError& error) {
  nlohmann::json body = error.to_json();
  co_await respond_json(static_cast<http::status>(error.http_status), body);
}

net::awaitable<bool> HttpExchange::start_event_stream() {
  status_code_ = 200;
  // HTTP/1.0 has no chunked encoding: such a client gets the events as they come and the end of the
  // stream is the end of the connection (Connection: close).
  if (!chunked_events()) keep_alive_ = false;
  http::response<http::empty_body> response{http::status::ok, request_.version()};
  response.set(http::field::server, "pdserve");
  response.set(http::field::content_type, "text/event-stream");
  response.set(http::field::cache_control, "no-cache");
  response.keep_alive(keep_alive());
  if (!chunked_events()) response.set(http::field::connection, "close");
  response.chunked(chunked_events());
  if (broken_) co_return false;
  http::response_serializer<http::empty_body> serializer{response};
  connection_->stream.expires_after(std::chrono::milliseconds(options_.write_timeout_ms));
  error_code ec;
  co_await http::async_write_header(connection_->stream, serializer, net::redirect_error(use_awaitable, ec));
  if (ec) broken_ = true;
  co_return !broken_;
}

net::awaitable<bool> HttpExchange::send_event(std::string_view data) {
  if (broken_ || data.empty()) co_return !broken_;
  if (!chunked_events()) co_return co_await write_with_timeout(data);
  // One chunk per event so the client sees each token as it is produced.
  std::string chunk = fmt::format("{:x}\r\n", data.size());
  chunk.append(data);
  chunk.append("\r\n");
  co_return co_await write_with_timeout(chunk);
}

net::awaitable<bool> HttpExchange::end_event_stream() {
  if (stream_ended_) co_return !broken_;
  stream_ended_ = true;
  if (!chunked_events()) co_return !broken_;  // the connection's close ends the body
  co_return co_await write_with_timeout("0\r\n\r\n");
}

void HttpExchange::watch_for_disconnect(std::function<void()> on_gone) {
  if (!watch_) watch_ = std::make_shared<WatchState>(executor());
  watch_->on_gone = std::move(on_gone);
  watch_->stop_requested = false;
  arm_watch();
}

// Waits for the socket to become readable without consuming anything: a
// streaming client sends nothing while it reads its response, so readable
// means it closed (recv peeks 0 bytes or fails) or it pipelined a request
// (bytes available; we stop watching and leave them for the next read).
void HttpExchange::arm_watch() {
  if (watch_->armed) return;
  watch_->armed = true;
  auto connection = connection_;
  auto watch = watch_;
  connection_->stream.socket().async_wait(
      tcp::socket::wait_read, [connection, watch, this_exchange = this](error_code ec) {
        watch->armed = false;
        watch->done.cancel();
        if (watch->stop_requested) return;
        bool gone = true;
        if (!ec) {
          auto& socket = connection->stream.socket();
          char byte = 0;
          error_code peek_ec;
          socket.non_blocking(true, peek_ec);
          size_t n = socket.receive(net::buffer(&byte, 1), tcp::socket::message_peek, peek_ec);
          error_code restore_ec;
          socket.non_blocking(false, restore_ec);
          if (peek_ec == net::error::would_block) {
            // Spurious readiness: watch again. The exchange is alive: it
            // cannot end before stop_watching() saw this handler finish.
            this_exchange->arm_watch();
            return;
          }
          if (!peek_ec && n > 0) gone = false;
        }
        if (gone && watch->on_gone) {
          auto on_gone = std::move(watch->on_gone);
          watch->on_gone = nullptr;
          on_gone();
        }
      });
}

net::awaitable<void> HttpExchange::stop_watching() {
  if (!watch_) co_return;
  watch_->stop_requested = true;
  watch_->on_gone = nullptr;
  if (watch_->armed) {
    error_code ec;
    connection_->stream.socket().cancel(ec);
    // The cancelled wait completes promptly; bound the wait anyway.
    watch_->done.expires_after(std::chrono::seconds(5));
    while (watch_->armed) {
      co_await watch_->done.async_wait(net::redirect_error(use_awaitable, ec));
      if (!ec) break;  // deadline passed: give up on the socket
    }
    if (watch_->armed) broken_ = true;
  }
}

// ---- HttpServer ----

HttpServer::HttpServer(HttpServerOptions options)
    : options_(std::move(options)), connection_gate_(options_.max_connections), acceptor_(io_context_) {}

HttpServer::~HttpServer() {
  stop();
}

void HttpServer::route(http::verb method, std::string path, Handler handler, bool requires_auth) {
  routes_.push_back(Route{method, std::move(path), std::move(handler), requires_auth});
}

Status HttpServer::start() {
  error_code ec;
  auto address = net::ip::make_address(options_.host, ec);
  if (ec) return invalid_argument("--host '{}' is not an IP address: {}", options_.host, ec.message());
  tcp::endpoint endpoint(address, options_.port);
  acceptor_.open(endpoint.protocol(), ec);
  if (!ec) acceptor_.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) acceptor_.bind(endpoint, ec);
  if (!ec) acceptor_.listen(net::socket_base::max_listen_connections, ec);
  if (ec) return unavailable("cannot listen on {}:{}: {}", options_.host, options_.port, ec.message());
  bound_port_ = acceptor_.local_endpoint().port();

  net::co_spawn(acceptor_.get_executor(), accept_loop(), [](std::exception_ptr error) {
    if (!error) return;
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      PD_LOG_ERROR("accept loop ended: {}", e.what());
    }
  });
  for (int32_t i = 0; i < options_.num_io_threads; ++i) {
    threads_.emplace_back([this] {
      // Handlers catch their own errors; this keeps a stray throw from
      // taking an I/O thread (and the process) down.
      for (;;) {
        try {
          io_context_.run();
          return;
        } catch (const std::exception& e) {
          PD_LOG_ERROR("I/O thread caught: {}", e.what());
        }
      }
    });
  }
  return Status::Ok();
}

void HttpServer::stop_accepting() {
  net::post(acceptor_.get_executor(), [this] {
    error_code ec;
    acceptor_.close(ec);
  });
}

void HttpServer::stop() {
  if (stopped_.exchange(true)) return;
  io_context_.stop();
  for (auto& thread : threads_) thread.join();
  threads_.clear();
  error_code ec;
  acceptor_.close(ec);
}

net::awaitable<void> HttpServer::accept_loop() {
  net::steady_timer backoff(acceptor_.get_executor());
  metrics::Counter& refused_connections = metrics::Registry::global().counter(
      "pd_http_connections_refused_total", "Connections answered 503 (or closed) because --max-connections were open");
  while (acceptor_.is_open()) {
    error_code ec;
    tcp::socket socket(net::make_strand(io_context_));
    co_await acceptor_.async_accept(socket, net::redirect_error(use_awaitable, ec));
    if (ec == net::error::operation_aborted || !acceptor_.is_open()) break;
    if (ec) {
      // EMFILE/ENFILE (or any other failure) must not end the loop: back off briefly
      // instead of spinning on the error, then accept again.
      if (accept_error_log_.admit(now_ns()))
        PD_LOG_WARN("accept failed: {} (retrying every 50 ms; {} more failures since the last report)", ec.message(),
                    accept_error_log_.num_held_back());
      backoff.expires_after(std::chrono::milliseconds(50));
      co_await backoff.async_wait(net::redirect_error(use_awaitable, ec));
      continue;
    }
    auto executor = socket.get_executor();
    auto log_failure = [](std::exception_ptr error) {
      if (!error) return;
      try {
        std::rethrow_exception(error);
      } catch (const std::exception& e) {
        PD_LOG_WARN("connection ended with: {}", e.what());
      }
    };
    ConnectionGate::Admission admission = connection_gate_.admit(now_ns());
    if (admission.verdict != ConnectionGate::Verdict::kServe) {
      refused_connections.inc();
      if (admission.log_now)
        PD_LOG_WARN(
            "{} connections open, the limit (--max-connections): answering new ones 503 ({} more refused "
            "since the last report)",
            options_.max_connections, admission.num_held_back);
      if (admission.verdict == ConnectionGate::Verdict::kDrop) {
        socket.close(ec);
        continue;
      }
      net::co_spawn(executor, refuse_connection(std::move(socket), std::move(*admission.slot)), log_failure);
      continue;
    }
    socket.set_option(tcp::no_delay(true), ec);
    net::co_spawn(executor, serve_connection(std::move(socket), std::move(*admission.slot)), log_failure);
  }
}

namespace {

// A minimal error response for when there is no exchange to own it (the
// request never parsed, or was never read). The connection closes afterwards.
http::response<http::string_body> raw_error_response(const ApiError& error) {
  http::response<http::string_body> response{static_cast<http::status>(error.http_status), 11};
  response.set(http::field::server, "pdserve");
  response.set(http::field::content_type, "application/json");
  response.keep_alive(false);
  response.body() = error.to_json().dump();
  response.prepare_payload();
  return response;
}

net::awaitable<void> write_raw_response(beast::tcp_stream& stream, const http::response<http::string_body>& response,
                                        int64_t timeout_ms) {
  stream.expires_after(std::chrono::milliseconds(timeout_ms));
  error_code ec;
  co_await http::async_write(stream, response, net::redirect_error(use_awaitable, ec));
}

net::awaitable<void> write_raw_error(beast::tcp_stream& stream, const ApiError& error, int64_t timeout_ms) {
  http::response<http::string_body> response = raw_error_response(error);
  co_await write_raw_response(stream, response, timeout_ms);
}

// Lingering close after an early error response: a client still sending its
// request would otherwise get a reset instead of our answer (unread bytes at
// close() make the kernel send RST, and the client's next send or read fails
// before it sees the response). Reads and discards for a bounded time and byte
// count, then the caller closes.
net::awaitable<void> drain_before_close(beast::tcp_stream& stream, size_t max_drain_bytes,
                                        std::chrono::milliseconds max_drain_time) {
  error_code ec;
  stream.socket().shutdown(tcp::socket::shutdown_send, ec);
  std::vector<char> sink(std::min<size_t>(max_drain_bytes, 64 * 1024));
  size_t drained = 0;
  stream.expires_after(max_drain_time);
  while (!ec && drained < max_drain_bytes) {
    drained += co_await stream.async_read_some(net::buffer(sink), net::redirect_error(use_awaitable, ec));
  }
}

}  // namespace

// refusal_slot (like serve_connection's slot) lives in the coroutine frame: released when it ends.
net::awaitable<void> HttpServer::refuse_connection(tcp::socket socket, [[maybe_unused]] ConnectionSlot refusal_slot) {
  beast::tcp_stream stream(std::move(socket));
  ApiError error = too_many_connections(options_.max_connections);
  http::response<http::string_body> response = raw_error_response(error);
  response.set(http::field::retry_after, "1");
  // Answered before the request is read (its route does not matter: /health is refused too).
  co_await write_raw_response(stream, response, options_.write_timeout_ms);
  // The request the client sends meanwhile is discarded, bounded well below a body limit: a
  // refused connection must stay cheap. A client sending more than this may see a reset.
  co_await drain_before_close(stream, 64 * 1024, std::chrono::seconds(1));
  error_code ec;
  stream.socket().close(ec);
}

net::awaitable<void> HttpServer::serve_connection(tcp::socket socket, [[maybe_unused]] ConnectionSlot slot) {
  auto connection = std::make_shared<Connection>(std::move(socket));
  auto& stream = connection->stream;
  beast::flat_buffer buffer;
  for (;;) {
    http::request_parser<http::string_body> parser;
    parser.header_limit(static_cast<std::uint32_t>(options_.max_header_bytes));
    parser.body_limit(options_.max_body_bytes);
    stream.expires_after(std::chrono::milliseconds(options_.keep_alive_timeout_ms));
    error_code ec;
    co_await http::async_read_header(stream, buffer, parser, net::redirect_error(use_awaitable, ec));
    if (!ec && parser.get()[http::field::expect] == "100-continue" && !parser.is_done()) {
      // curl and others wait for this before sending a large body.
      static constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
      stream.expires_after(std::chrono::milliseconds(options_.write_timeout_ms));
      co_await net::async_write(stream, net::buffer(kContinue.data(), kContinue.size()),
                                net::redirect_error(use_awaitable, ec));
    }
    if (!ec && !parser.is_done()) {
      stream.expires_after(std::chrono::milliseconds(options_.keep_alive_timeout_ms));
      co_await http::async_read(stream, buffer, parser, net::redirect_error(use_awaitable, ec));
    }
    if (ec == http::error::body_limit) {
      count_request("invalid", 413);
      ApiError error = body_too_large(options_.max_body_bytes);
      co_await write_raw_error(stream, error, options_.write_timeout_ms);
      co_await drain_before_close(stream, std::max<size_t>(4 * options_.max_body_bytes, 16u << 20),
                                  std::chrono::seconds(2));
      break;
    }
    if (ec == http::error::end_of_stream || ec == net::error::eof || ec == beast::error::timeout ||
        ec == net::error::connection_reset || ec == net::error::operation_aborted) {
      break;
    }
    if (ec) {
      // Anything else is a malformed request: answer it, then close, since
      // the framing of whatever follows is unknown.
      count_request("invalid", 400);
      ApiError error = bad_request(fmt::format("malformed HTTP request: {}", ec.message()));
      co_await write_raw_error(stream, error, options_.write_timeout_ms);
      break;
    }

    HttpExchange exchange(connection, parser.release(), options_);
    bool handler_threw = false;
    try {
      co_await dispatch(exchange);
    } catch (const std::exception& e) {
      // The detail stays in the log: an exception's text can name internals
      // or echo the request, and is no contract a client could rely on.
      PD_LOG_ERROR("handler for {} threw: {}", exchange.path(), e.what());
      handler_threw = true;
    }
    co_await exchange.stop_watching();
    if (!exchange.responded()) {
      ApiError error = internal(handler_threw ? "internal error" : "handler produced no response");
      co_await exchange.respond_error(error);
      count_request(exchange.path(), exchange.status_code());
    }
    if (!exchange.keep_alive()) break;
  }
  error_code ec;
  stream.socket().shutdown(tcp::socket::shutdown_send, ec);
  stream.close();
}

bool HttpServer::authorized(const HttpRequest& request) const {
  if (options_.api_key.empty()) return true;
  auto header = request[http::field::authorization];
  std::string_view value(header.data(), header.size());
  static constexpr std::string_view kBearer = "Bearer ";
  if (value.size() < kBearer.size() || value.substr(0, kBearer.size()) != kBearer) return false;
  return equal_constant_time(value.substr(kBearer.size()), options_.api_key);
}

net::awaitable<void> HttpServer::dispatch(HttpExchange& exchange) {
  const Route* match = nullptr;
  bool path_known = false;
  std::string allowed;
  for (const auto& route : routes_) {
    if (route.path != exchange.path()) continue;
    path_known = true;
    if (!allowed.empty()) allowed += ", ";
    allowed += std::string(http::to_string(route.method));
    if (route.method == exchange.request().method()) match = &route;
  }
  std::string route_label = path_known ? exchange.path() : "unmatched";
  // Errors are built into locals before co_await: g++ 12 mishandles
  // temporaries (notably from ?:) that live across a suspension point.
  if (!match) {
    std::string method(exchange.request().method_string());
    ApiError error = path_known ? method_not_allowed(method, exchange.path()) : route_not_found(exchange.path());
    co_await exchange.respond_error(error);
  } else if (match->requires_auth && !authorized(exchange.request())) {
    ApiError error = unauthorized();
    co_await exchange.respond_error(error);
  } else {
    co_await match->handler(exchange);
  }
  count_request(route_label, exchange.status_code());
}

}  // namespace pd::server
