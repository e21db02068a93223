#include "frontend/listener.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/read_until.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/http/write.hpp>

#include <sys/socket.h>
#include <sys/time.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "frontend/connection.h"

namespace pd::frontend {
namespace {

// A listener over two io threads, as pdrouter runs it: each connection answers every request with
// "served on <index>" until the client closes; requests are read by read_request.
class ListenerTest : public ::testing::Test {
 protected:
  void start(int64_t max_connections, size_t max_body_bytes = 1024) {
    ListenerOptions options;
    options.max_connections = max_connections;
    options.write_timeout_ms = 2000;
    options.log_name = "listener_test";
    options.server_header = "test";
    listener_ = std::make_unique<Listener>(options, refused_);
    limits_.max_body_bytes = max_body_bytes;
    limits_.idle_timeout_ms = 5000;
    limits_.write_timeout_ms = 2000;
    ASSERT_TRUE(listener_->bind(contexts_[0].get_executor()).ok());
    listener_->start(
        [this] {
          const size_t index = next_++ % contexts_.size();
          return Placement{contexts_[index].get_executor(), index};
        },
        [this](tcp::socket socket, size_t index, ConnectionSlot slot) {
          return serve(std::move(socket), index, std::move(slot));
        });
    for (auto& context : contexts_) {
      threads_.emplace_back([&context] {
        auto work = net::make_work_guard(context);
        context.run();
      });
    }
  }

  net::awaitable<void> serve(tcp::socket socket, size_t index, [[maybe_unused]] ConnectionSlot slot) {
    beast::tcp_stream stream(std::move(socket));
    beast::flat_buffer buffer;
    for (;;) {
      Request request;
      const ReadResult read = co_await read_request(stream, buffer, limits_, request);
      if (read.outcome == ReadOutcome::kAnswered) num_answered_by_reader_.fetch_add(1);
      if (read.outcome != ReadOutcome::kRequest) break;
      Response response{http::status::ok, request.version()};
      response.keep_alive(request.keep_alive());
      response.body() = "served on " + std::to_string(index);
      response.prepare_payload();
      if (!co_await write_response(stream, response, 2000) || !request.keep_alive()) break;
    }
    boost::system::error_code ec;
    stream.socket().shutdown(tcp::socket::shutdown_send, ec);
    stream.socket().close(ec);
  }

  void TearDown() override {
    for (auto& context : contexts_) context.stop();
    for (auto& thread : threads_) thread.join();
    if (listener_) listener_->close();
  }

  tcp::socket connect() {
    tcp::socket socket(client_context_);
    socket.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), listener_->port()));
    // A server that never answers or never closes fails the test instead of hanging it.
    const timeval timeout{5, 0};
    ::setsockopt(socket.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    return socket;
  }

  // One response on a kept-alive connection (header, then Content-Length bytes).
  static std::string read_response(tcp::socket& socket) {
    std::string data;
    boost::system::error_code ec;
    const size_t header_end = net::read_until(socket, net::dynamic_buffer(data), "\r\n\r\n", ec);
    if (ec) return data;
    const size_t at = data.find("Content-Length: ");
    const size_t length = at == std::string::npos ? 0 : std::stoul(data.substr(at + 16));
    if (data.size() < header_end + length) {
      net::read(socket, net::dynamic_buffer(data), net::transfer_exactly(header_end + length - data.size()), ec);
    }
    return data;
  }

  // Everything until the server closes.
  static std::string read_all(tcp::socket& socket) {
    std::string data;
    boost::system::error_code ec;
    net::read(socket, net::dynamic_buffer(data), ec);
    return data;
  }

  // Declared before the io_contexts: connection coroutines destroyed with them use these.
  metrics::Counter refused_;
  RequestLimits limits_;
  std::unique_ptr<Listener> listener_;
  std::atomic<size_t> next_{0};
  std::atomic<int> num_answered_by_reader_{0};
  std::vector<net::io_context> contexts_ = std::vector<net::io_context>(2);
  std::vector<std::thread> threads_;
  net::io_context client_context_;
};

const std::string kGet = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";

TEST_F(ListenerTest, ConnectionsRunWhereThePlaceFunctionPutsThem) {
  start(8);
  auto first = connect();
  net::write(first, net::buffer(kGet));
  const std::string a = read_response(first);
  auto second = connect();
  net::write(second, net::buffer(kGet));
  const std::string b = read_response(second);
  EXPECT_NE(a.find("served on 0"), std::string::npos) << a;
  EXPECT_NE(b.find("served on 1"), std::string::npos) << b;
}

TEST_F(ListenerTest, AConnectionOverTheCapIsAnswered503AndCountedWhileOpenOnesKeepServing) {
  start(1);
  auto held = connect();
  net::write(held, net::buffer(kGet));
  ASSERT_EQ(read_response(held).rfind("HTTP/1.1 200", 0), 0u);

  auto refused = connect();
  net::write(refused, net::buffer(kGet));
  const std::string answer = read_all(refused);
  EXPECT_EQ(answer.rfind("HTTP/1.1 503", 0), 0u) << answer;
  EXPECT_NE(answer.find("Retry-After: 1\r\n"), std::string::npos) << answer;
  EXPECT_NE(answer.find("Server: test\r\n"), std::string::npos) << answer;
  const nlohmann::json body = nlohmann::json::parse(answer.substr(answer.find("\r\n\r\n") + 4));
  EXPECT_EQ(body["error"]["code"], "too_many_connections");
  EXPECT_EQ(refused_.value(), 1.0);

  net::write(held, net::buffer(kGet));
  EXPECT_EQ(read_response(held).rfind("HTTP/1.1 200", 0), 0u) << "an open connection is unaffected";
}

TEST_F(ListenerTest, ABodyOverTheLimitIs413BeforeTheBodyIsSentAndNotAReset) {
  start(8, /*max_body_bytes=*/100);
  auto socket = connect();
  const std::string header = "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n";
  net::write(socket, net::buffer(header));
  // The client keeps sending its body after the answer: the drain reads it, so no reset.
  boost::system::error_code ec;
  net::write(socket, net::buffer(std::string(100000, 'x')), ec);
  const std::string answer = read_all(socket);
  EXPECT_EQ(answer.rfind("HTTP/1.1 413", 0), 0u) << answer;
  EXPECT_NE(answer.find("\"request_too_large\""), std::string::npos) << answer;
  EXPECT_NE(answer.find("Connection: close\r\n"), std::string::npos) << answer;
}

TEST_F(ListenerTest, MalformedHttpIsAnswered400AndClosed) {
  start(8);
  auto socket = connect();
  net::write(socket, net::buffer(std::string("NOT HTTP AT ALL\r\n\r\n")));
  const std::string answer = read_all(socket);
  EXPECT_EQ(answer.rfind("HTTP/1.1 400", 0), 0u) << answer;
  EXPECT_NE(answer.find("malformed HTTP request"), std::string::npos) << answer;
  EXPECT_EQ(num_answered_by_reader_.load(), 1);
}

TEST_F(ListenerTest, ExpectContinueIsAnsweredWhateverItsCase) {
  start(8);
  auto socket = connect();
  net::write(
      socket,
      net::buffer(std::string("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-Continue\r\n\r\n")));
  std::string interim;
  net::read_until(socket, net::dynamic_buffer(interim), "\r\n\r\n");
  EXPECT_EQ(interim.rfind("HTTP/1.1 100 Continue\r\n\r\n", 0), 0u) << interim;
  net::write(socket, net::buffer(std::string("ok")));
  std::string rest = interim.substr(interim.find("\r\n\r\n") + 4);
  std::string response = read_response(socket);
  EXPECT_NE((rest + response).find("HTTP/1.1 200"), std::string::npos) << rest + response;
}

}  // namespace
}  // namespace pd::frontend
