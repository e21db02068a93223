#include "server/http_server.h"

#include <fmt/format.h>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http/chunk_encode.hpp>
#include <boost/beast/http/empty_body.hpp>
#include <boost/beast/http/serializer.hpp>
#include <boost/beast/http/write.hpp>

#include <chrono>

#include "common/log.h"
#include "common/metrics.h"
#include "frontend/connection.h"
#include "frontend/wire.h"

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

std::string_view authorization_of(const HttpRequest& request) {
  auto header = request[http::field::authorization];
  return {header.data(), header.size()};
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
  path_ = std::string(frontend::path_of(std::string_view(request_.target().data(), request_.target().size())));
  keep_alive_ = request_.keep_alive();
}

HttpExchange::~HttpExchange() = default;

ConnectionExecutor HttpExchange::executor() const {
  // Every connection socket is created on a strand (see start()).
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
  std::string body = error.to_text();
  co_await respond(static_cast<http::status>(error.http_status), std::move(body), "application/json");
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

namespace {

frontend::ListenerOptions listener_options(const HttpServerOptions& options) {
  frontend::ListenerOptions listener;
  listener.host = options.host;
  listener.port = options.port;
  listener.max_connections = options.max_connections;
  listener.write_timeout_ms = options.write_timeout_ms;
  listener.log_name = "pdserve";
  listener.server_header = "pdserve";
  return listener;
}

metrics::Counter& refused_connections_counter() {
  return metrics::Registry::global().counter(
      "pd_http_connections_refused_total", "Connections answered 503 (or closed) because --max-connections were open");
}

}  // namespace

HttpServer::HttpServer(HttpServerOptions options)
    : options_(std::move(options)), listener_(listener_options(options_), refused_connections_counter()) {}

HttpServer::~HttpServer() {
  stop();
}

void HttpServer::route(http::verb method, std::string path, Handler handler, bool requires_auth) {
  routes_.push_back(Route{method, std::move(path), std::move(handler), requires_auth});
}

Status HttpServer::start() {
  PD_RETURN_IF_ERROR(listener_.bind(io_context_.get_executor()));
  bound_port_ = listener_.port();
  listener_.start(
      // Every connection runs on its own strand (HttpExchange::executor()).
      [this] {
        return frontend::Placement{net::make_strand(io_context_), 0};
      },
      [this](tcp::socket socket, size_t, ConnectionSlot slot) {
        return serve_connection(std::move(socket), std::move(slot));
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
  listener_.stop_accepting();
}

void HttpServer::stop() {
  if (stopped_.exchange(true)) return;
  io_context_.stop();
  for (auto& thread : threads_) thread.join();
  threads_.clear();
  listener_.close();
}

net::awaitable<void> HttpServer::serve_connection(tcp::socket socket, [[maybe_unused]] ConnectionSlot slot) {
  auto connection = std::make_shared<Connection>(std::move(socket));
  auto& stream = connection->stream;
  beast::flat_buffer buffer;
  frontend::RequestLimits limits;
  limits.max_header_bytes = options_.max_header_bytes;
  limits.max_body_bytes = options_.max_body_bytes;
  limits.idle_timeout_ms = options_.keep_alive_timeout_ms;
  limits.write_timeout_ms = options_.write_timeout_ms;
  limits.server_header = "pdserve";
  for (;;) {
    HttpRequest request;
    const frontend::ReadResult read = co_await frontend::read_request(stream, buffer, limits, request);
    if (read.outcome == frontend::ReadOutcome::kAnswered) count_request("invalid", read.status);
    if (read.outcome != frontend::ReadOutcome::kRequest) break;

    HttpExchange exchange(connection, std::move(request), options_);
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
  } else if (match->requires_auth &&
             !frontend::bearer_authorized(authorization_of(exchange.request()), options_.api_key)) {
    ApiError error = unauthorized();
    co_await exchange.respond_error(error);
  } else {
    co_await match->handler(exchange);
  }
  count_request(route_label, exchange.status_code());
}

}  // namespace pd::server
