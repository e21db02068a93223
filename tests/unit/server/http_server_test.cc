#include "server/http_server.h"

#include <gtest/gtest.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/read_until.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/asio/write.hpp>

#include <cctype>
#include <chrono>
#include <future>
#include <stdexcept>
#include <string>

#include "common/metrics.h"

namespace pd::server {
namespace {

using boost::asio::ip::tcp;

class HttpServerTest : public ::testing::Test {
 protected:
  void start(HttpServerOptions options = {}) {
    options.port = 0;
    options.keep_alive_timeout_ms = 5000;
    server_ = std::make_unique<HttpServer>(options);
    server_->route(http::verb::get, "/ping", [](HttpExchange& ex) -> net::awaitable<void> {
      // Built outside the co_await: g++ 12 rejects initializer lists in coroutine frames.
      nlohmann::json body = nlohmann::json::object();
      body["pong"] = true;
      co_await ex.respond_json(http::status::ok, body);
    });
    server_->route(http::verb::post, "/echo", [](HttpExchange& ex) -> net::awaitable<void> {
      co_await ex.respond(http::status::ok, ex.request().body(), "text/plain");
    });
    server_->route(
        http::verb::get, "/v1/secret",
        [](HttpExchange& ex) -> net::awaitable<void> { co_await ex.respond(http::status::ok, "ok", "text/plain"); },
        /*requires_auth=*/true);
    server_->route(http::verb::get, "/events", [](HttpExchange& ex) -> net::awaitable<void> {
      co_await ex.start_event_stream();
      co_await ex.send_event("data: 1\n\n");
      co_await ex.send_event("data: 2\n\n");
      co_await ex.end_event_stream();
    });
    server_->route(http::verb::get, "/throws", [](HttpExchange&) -> net::awaitable<void> {
      throw std::runtime_error("[json.exception.type_error.302] secret detail");
      co_return;
    });
    // Streams one event, then waits (up to a deadline) for the client to go.
    server_->route(http::verb::get, "/hold", [this](HttpExchange& ex) -> net::awaitable<void> {
      net::steady_timer wake(ex.executor());
      bool gone = false;
      co_await ex.start_event_stream();
      ex.watch_for_disconnect([&] {
        gone = true;
        wake.cancel();
      });
      co_await ex.send_event("data: first\n\n");
      // The client may read the event and close while send_event is still
      // completing: then the disconnect was seen before there was a wait to cancel.
      if (!gone) {
        wake.expires_after(std::chrono::seconds(10));
        boost::system::error_code ec;
        co_await wake.async_wait(net::redirect_error(net::use_awaitable, ec));
      }
      co_await ex.stop_watching();
      hold_result_.set_value(gone);
    });
    ASSERT_TRUE(server_->start().ok());
    ASSERT_NE(server_->port(), 0);
  }

  void TearDown() override {
    if (server_) server_->stop();
  }

  tcp::socket connect() {
    tcp::socket socket(client_context_);
    socket.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), server_->port()));
    return socket;
  }

  // Sends raw bytes and reads until the server closes or a full response with
  // Content-Length arrived.
  std::string exchange(const std::string& raw) {
    auto socket = connect();
    net::write(socket, net::buffer(raw));
    return read_response(socket);
  }

  static std::string read_response(tcp::socket& socket) {
    std::string data;
    boost::system::error_code ec;
    net::read_until(socket, net::dynamic_buffer(data), "\r\n\r\n", ec);
    auto header_end = data.find("\r\n\r\n");
    if (header_end == std::string::npos) return data;
    auto cl = data.find("Content-Length: ");
    if (cl != std::string::npos && cl < header_end) {
      size_t length = std::stoul(data.substr(cl + 16));
      size_t have = data.size() - header_end - 4;
      if (have < length) net::read(socket, net::dynamic_buffer(data), net::transfer_exactly(length - have), ec);
    }
    return data;
  }

  std::unique_ptr<HttpServer> server_;
  net::io_context client_context_;
  std::promise<bool> hold_result_;
};

TEST_F(HttpServerTest, RoutesAGetAndKeepsTheConnectionAlive) {
  start();
  auto socket = connect();
  for (int i = 0; i < 2; ++i) {
    net::write(socket, net::buffer(std::string("GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")));
    auto response = read_response(socket);
    EXPECT_EQ(response.rfind("HTTP/1.1 200", 0), 0u) << response;
    EXPECT_NE(response.find("{\"pong\":true}"), std::string::npos);
  }
}

TEST_F(HttpServerTest, UnknownRouteIs404WithOpenAiErrorShape) {
  start();
  auto response = exchange("GET /nope HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(response.rfind("HTTP/1.1 404", 0), 0u) << response;
  EXPECT_NE(response.find("\"error\":{"), std::string::npos);
  EXPECT_NE(response.find("\"type\":\"invalid_request_error\""), std::string::npos);
}

TEST_F(HttpServerTest, WrongMethodIs405) {
  start();
  auto response = exchange("POST /ping HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n");
  EXPECT_EQ(response.rfind("HTTP/1.1 405", 0), 0u) << response;
}

TEST_F(HttpServerTest, QueryStringDoesNotChangeTheRoute) {
  start();
  EXPECT_EQ(exchange("GET /ping?x=1 HTTP/1.1\r\nHost: x\r\n\r\n").rfind("HTTP/1.1 200", 0), 0u);
}

TEST_F(HttpServerTest, BodyOverLimitIs413AndServerKeepsServing) {
  HttpServerOptions options;
  options.max_body_bytes = 1024;
  start(options);
  std::string body(4096, 'x');
  auto response = exchange("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4096\r\n\r\n" + body);
  EXPECT_EQ(response.rfind("HTTP/1.1 413", 0), 0u) << response;
  EXPECT_NE(response.find("request_too_large"), std::string::npos);
  auto chunked =
      exchange("POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1000\r\n" + body + "\r\n0\r\n\r\n");
  EXPECT_EQ(chunked.rfind("HTTP/1.1 413", 0), 0u) << chunked;
  EXPECT_EQ(exchange("GET /ping HTTP/1.1\r\nHost: x\r\n\r\n").rfind("HTTP/1.1 200", 0), 0u);
}

TEST_F(HttpServerTest, BodyWithinLimitIsDelivered) {
  start();
  auto response = exchange("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello");
  EXPECT_EQ(response.rfind("HTTP/1.1 200", 0), 0u);
  EXPECT_EQ(response.substr(response.size() - 5), "hello");
}

TEST_F(HttpServerTest, ExpectContinueGets100BeforeTheBody) {
  start();
  auto socket = connect();
  net::write(
      socket,
      net::buffer(std::string("POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n")));
  std::string data;
  net::read_until(socket, net::dynamic_buffer(data), "\r\n\r\n");
  EXPECT_EQ(data.rfind("HTTP/1.1 100", 0), 0u) << data;
  net::write(socket, net::buffer(std::string("abc")));
  data.erase(0, data.find("\r\n\r\n") + 4);
  std::string rest = read_response(socket);
  EXPECT_EQ((data + rest).rfind("HTTP/1.1 200", 0), 0u) << data << rest;
}

TEST_F(HttpServerTest, MalformedRequestIs400AndServerKeepsServing) {
  start();
  auto response = exchange("THIS IS NOT HTTP\r\n\r\n");
  EXPECT_EQ(response.rfind("HTTP/1.1 400", 0), 0u) << response;
  EXPECT_EQ(exchange("GET /ping HTTP/1.1\r\nHost: x\r\n\r\n").rfind("HTTP/1.1 200", 0), 0u);
}

TEST_F(HttpServerTest, HandlerThatThrowsIs500WithoutTheExceptionTextAndServerKeepsServing) {
  start();
  auto socket = connect();
  net::write(socket, net::buffer(std::string("GET /throws HTTP/1.1\r\nHost: x\r\n\r\n")));
  auto response = read_response(socket);
  EXPECT_EQ(response.rfind("HTTP/1.1 500", 0), 0u) << response;
  EXPECT_NE(response.find("\"message\":\"internal error\""), std::string::npos) << response;
  EXPECT_EQ(response.find("secret detail"), std::string::npos) << response;
  EXPECT_EQ(response.find("json.exception"), std::string::npos) << response;
  net::write(socket, net::buffer(std::string("GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")));
  EXPECT_EQ(read_response(socket).rfind("HTTP/1.1 200", 0), 0u);
}

TEST_F(HttpServerTest, ApiKeyIsCheckedOnlyOnProtectedRoutes) {
  HttpServerOptions options;
  options.api_key = "sekret";
  start(options);
  EXPECT_EQ(exchange("GET /v1/secret HTTP/1.1\r\nHost: x\r\n\r\n").rfind("HTTP/1.1 401", 0), 0u);
  EXPECT_EQ(
      exchange("GET /v1/secret HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong!\r\n\r\n").rfind("HTTP/1.1 401", 0),
      0u);
  EXPECT_EQ(
      exchange("GET /v1/secret HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\n\r\n").rfind("HTTP/1.1 200", 0),
      0u);
  EXPECT_EQ(exchange("GET /ping HTTP/1.1\r\nHost: x\r\n\r\n").rfind("HTTP/1.1 200", 0), 0u);
}

TEST_F(HttpServerTest, EventStreamIsChunkedAndEnds) {
  start();
  auto socket = connect();
  net::write(socket, net::buffer(std::string("GET /events HTTP/1.1\r\nHost: x\r\n\r\n")));
  std::string data;
  boost::system::error_code ec;
  net::read_until(socket, net::dynamic_buffer(data), "0\r\n\r\n", ec);
  EXPECT_FALSE(ec) << ec.message();
  EXPECT_NE(data.find("text/event-stream"), std::string::npos);
  EXPECT_NE(data.find("chunked"), std::string::npos);
  EXPECT_LT(data.find("data: 1"), data.find("data: 2"));
}

TEST_F(HttpServerTest, EventStreamToAnHttp10ClientIsUnchunkedAndEndedByClose) {
  // HTTP/1.0 has no chunked encoding: the events go as they are and the close ends the body.
  start();
  auto socket = connect();
  net::write(socket, net::buffer(std::string("GET /events HTTP/1.0\r\n\r\n")));
  std::string data;
  boost::system::error_code ec;
  net::read(socket, net::dynamic_buffer(data), ec);  // until the server closes
  EXPECT_EQ(ec, net::error::eof) << ec.message();
  const size_t header_end = data.find("\r\n\r\n");
  ASSERT_NE(header_end, std::string::npos) << data;
  std::string header = data.substr(0, header_end);
  for (char& c : header) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  EXPECT_EQ(header.rfind("http/1.0 200", 0), 0u) << header;
  EXPECT_EQ(header.find("chunked"), std::string::npos) << header;
  EXPECT_NE(header.find("connection: close"), std::string::npos) << header;
  EXPECT_EQ(data.substr(header_end + 4), "data: 1\n\ndata: 2\n\n");
}

TEST_F(HttpServerTest, ClientThatClosesMidStreamIsNoticed) {
  start();
  auto result = hold_result_.get_future();
  {
    auto socket = connect();
    net::write(socket, net::buffer(std::string("GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")));
    std::string data;
    net::read_until(socket, net::dynamic_buffer(data), "data: first");
    socket.close();
  }
  ASSERT_EQ(result.wait_for(std::chrono::seconds(8)), std::future_status::ready);
  EXPECT_TRUE(result.get());
}

TEST_F(HttpServerTest, RequestsAreCountedByRouteAndStatus) {
  start();
  auto& counter =
      metrics::Registry::global().counter("pd_http_requests_total", "", {{"route", "/ping"}, {"status", "200"}});
  double before = counter.value();
  exchange("GET /ping HTTP/1.1\r\nHost: x\r\n\r\n");
  // The counter is bumped after the response is written; wait for it with a deadline.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (counter.value() < before + 1 && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  EXPECT_EQ(counter.value(), before + 1);
}

TEST_F(HttpServerTest, ConnectionBeyondTheCapIs503WithRetryAfterAndExistingOnesKeepServing) {
  HttpServerOptions options;
  options.max_connections = 2;
  start(options);
  auto& refused = metrics::Registry::global().counter("pd_http_connections_refused_total", "");
  const double refused_before = refused.value();
  const std::string ping = "GET /ping HTTP/1.1\r\nHost: x\r\n\r\n";
  // Each completes a request, so both are accepted and counted before the third arrives.
  auto first = connect();
  net::write(first, net::buffer(ping));
  ASSERT_EQ(read_response(first).rfind("HTTP/1.1 200", 0), 0u);
  auto second = connect();
  net::write(second, net::buffer(ping));
  ASSERT_EQ(read_response(second).rfind("HTTP/1.1 200", 0), 0u);

  auto third = exchange(ping);
  EXPECT_EQ(third.rfind("HTTP/1.1 503", 0), 0u) << third;
  EXPECT_NE(third.find("Retry-After: 1\r\n"), std::string::npos) << third;
  EXPECT_NE(third.find("Connection: close\r\n"), std::string::npos) << third;
  auto body = nlohmann::json::parse(third.substr(third.find("\r\n\r\n") + 4));
  EXPECT_EQ(body["error"]["type"], "service_unavailable") << third;
  EXPECT_EQ(body["error"]["code"], "too_many_connections") << third;
  EXPECT_EQ(refused.value(), refused_before + 1);

  net::write(first, net::buffer(ping));
  EXPECT_EQ(read_response(first).rfind("HTTP/1.1 200", 0), 0u) << "an existing connection is unaffected";
}

TEST_F(HttpServerTest, ClosingAConnectionAtTheCapLetsTheNextOneIn) {
  HttpServerOptions options;
  options.max_connections = 1;
  start(options);
  const std::string ping = "GET /ping HTTP/1.1\r\nHost: x\r\n\r\n";
  auto held = connect();
  net::write(held, net::buffer(ping));
  ASSERT_EQ(read_response(held).rfind("HTTP/1.1 200", 0), 0u);
  ASSERT_EQ(exchange(ping).rfind("HTTP/1.1 503", 0), 0u);
  held.close();
  // The server releases the slot when it reads the EOF: poll, with a deadline, until it has.
  std::string response;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  do {
    response = exchange(ping);
  } while (response.rfind("HTTP/1.1 200", 0) != 0 && std::chrono::steady_clock::now() < deadline);
  EXPECT_EQ(response.rfind("HTTP/1.1 200", 0), 0u) << response;
}

}  // namespace
}  // namespace pd::server
