// The OpenAI service's generation endpoints over a scripted engine: how each way a
// launched generation fails reaches the client (streamed and not), and that every
// engine request the service added is aborted when the client goes away.
#include "server/openai_service.h"

#include <gtest/gtest.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/read_until.hpp>
#include <boost/asio/write.hpp>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "common/metrics.h"

namespace pd::server {
namespace {

using boost::asio::ip::tcp;

// An engine whose outputs the test writes. add_request refuses while `refusals`
// holds statuses (one each), as the real engine refuses a full queue.
class ScriptedEngine final : public engine::Engine {
 public:
  ScriptedEngine() {
    spec_.block_size = 4;
    spec_.num_blocks = 64;
  }

  Status add_request(engine::GenerateRequest request, engine::OutputCallback on_output) override {
    std::lock_guard lock(mutex_);
    if (!refusals_.empty() && added_.size() >= refuse_after_) {
      Status refusal = refusals_.front();
      refusals_.pop_front();
      return refusal;
    }
    added_.push_back(Added{request.request_id, std::move(on_output)});
    cv_.notify_all();
    return Status::Ok();
  }
  void abort(const std::string& request_id) override {
    std::lock_guard lock(mutex_);
    aborted_.push_back(request_id);
    cv_.notify_all();
  }
  engine::EngineStats stats() const override { return {}; }
  const engine::EngineConfig& config() const override { return config_; }
  const engine::KvCacheSpec& kv_cache_spec() const override { return spec_; }
  // As the real engine does at shutdown: no callback (each holds its generation) outlives it.
  void shutdown() override {
    std::lock_guard lock(mutex_);
    for (auto& a : added_) a.callback = nullptr;
  }

  // The next add_request calls after the first `after` ones are refused with `status`.
  void refuse(Status status, size_t after) {
    std::lock_guard lock(mutex_);
    refusals_.push_back(std::move(status));
    refuse_after_ = after;
  }
  // Waits (bounded) until `n` requests were added; returns their ids.
  std::vector<std::string> wait_added(size_t n) {
    std::unique_lock lock(mutex_);
    cv_.wait_for(lock, std::chrono::seconds(10), [&] { return added_.size() >= n; });
    std::vector<std::string> ids;
    for (const auto& a : added_) ids.push_back(a.id);
    return ids;
  }
  std::vector<std::string> wait_aborted(size_t n) {
    std::unique_lock lock(mutex_);
    cv_.wait_for(lock, std::chrono::seconds(10), [&] { return aborted_.size() >= n; });
    return aborted_;
  }
  // Delivers an output to request `index` as the engine thread would.
  void emit(size_t index, engine::RequestOutput out) {
    engine::OutputCallback callback;
    {
      std::lock_guard lock(mutex_);
      callback = added_.at(index).callback;
      out.request_id = added_.at(index).id;
    }
    const bool finished = out.finished;
    callback(std::move(out));
    if (!finished) return;
    std::lock_guard lock(mutex_);
    added_.at(index).callback = nullptr;  // a final output is the last one
  }

 private:
  struct Added {
    std::string id;
    engine::OutputCallback callback;
  };
  engine::EngineConfig config_;
  engine::KvCacheSpec spec_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Added> added_;
  std::vector<std::string> aborted_;
  std::deque<Status> refusals_;
  size_t refuse_after_ = 0;
};

engine::RequestOutput tokens(std::vector<int32_t> ids, int32_t num_output_tokens) {
  engine::RequestOutput out;
  out.new_token_ids = std::move(ids);
  out.num_prompt_tokens = 6;
  out.num_output_tokens = num_output_tokens;
  return out;
}

engine::RequestOutput failure(std::string error, bool invalid_request = false, bool conflict = false) {
  engine::RequestOutput out;
  out.finished = true;
  out.finish_reason = engine::FinishReason::kError;
  out.error = std::move(error);
  out.invalid_request = invalid_request;
  out.conflict = conflict;
  out.num_prompt_tokens = 6;
  return out;
}

engine::RequestOutput finished(int32_t token, int32_t num_output_tokens) {
  engine::RequestOutput out = tokens({token}, num_output_tokens);
  out.finished = true;
  out.finish_reason = engine::FinishReason::kLength;
  return out;
}

class OpenAiServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    config_.request_timeout_ms = 10'000;
    service_ = std::make_unique<OpenAiService>(config_, engine_, nullptr, 256);
    HttpServerOptions options;
    options.port = 0;
    options.keep_alive_timeout_ms = 5000;
    server_ = std::make_unique<HttpServer>(options);
    service_->register_routes(*server_);
    ASSERT_TRUE(server_->start().ok());
  }
  void TearDown() override {
    engine_.shutdown();
    server_->stop();
  }

  tcp::socket post(const std::string& body) {
    tcp::socket socket(client_context_);
    socket.connect(tcp::endpoint(net::ip::make_address("127.0.0.1"), server_->port()));
    const std::string raw =
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        "Content-Length: " +
        std::to_string(body.size()) + "\r\n\r\n" + body;
    net::write(socket, net::buffer(raw));
    return socket;
  }
  // Reads until `end` arrived (or the server closed the connection).
  static std::string read_until(tcp::socket& socket, const std::string& end) {
    std::string data;
    boost::system::error_code ec;
    net::read_until(socket, net::dynamic_buffer(data), end, ec);
    return data;
  }
  // A whole response with Content-Length.
  static std::string read_response(tcp::socket& socket) {
    std::string data = read_until(socket, "\r\n\r\n");
    const size_t header_end = data.find("\r\n\r\n");
    const size_t cl = data.find("Content-Length: ");
    if (header_end == std::string::npos || cl == std::string::npos) return data;
    const size_t length = std::stoul(data.substr(cl + 16));
    const size_t have = data.size() - header_end - 4;
    boost::system::error_code ec;
    if (have < length) net::read(socket, net::dynamic_buffer(data), net::transfer_exactly(length - have), ec);
    return data;
  }

  ServerConfig config_;
  ScriptedEngine engine_;
  std::unique_ptr<OpenAiService> service_;
  std::unique_ptr<HttpServer> server_;
  net::io_context client_context_;
};

constexpr const char* kStreamed = R"({"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 8, "stream": true})";
constexpr const char* kNotStreamed = R"({"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 8})";

TEST_F(OpenAiServiceTest, StreamedChoiceTheEngineFailsAfterItsFirstTokensEndsWithAnInternalErrorEvent) {
  auto socket = post(kStreamed);
  engine_.wait_added(1);
  engine_.emit(0, tokens({7}, 1));
  std::string data = read_until(socket, "\"index\"");  // the first token's chunk is out: the 200 with it
  engine_.emit(0, failure("model execution failed: device lost"));
  data += read_until(socket, "data: [DONE]");
  EXPECT_EQ(data.rfind("HTTP/1.1 200", 0), 0u) << data;
  const size_t error_at = data.find(R"("message":"model execution failed: device lost")");
  ASSERT_NE(error_at, std::string::npos) << data;
  EXPECT_NE(data.find(R"("type":"internal_error")", error_at), std::string::npos) << data;
  EXPECT_LT(error_at, data.find("data: [DONE]"));
  EXPECT_TRUE(engine_.wait_aborted(0).empty()) << "a finished request is not aborted";
}

TEST_F(OpenAiServiceTest, StreamedRequestTheEngineRefusesBeforeAnyOutputIsAnsweredWithItsOwnStatus) {
  auto socket = post(kStreamed);
  engine_.wait_added(1);
  engine_.emit(0, failure("transfer_id 'ab' is already active here", /*invalid_request=*/false, /*conflict=*/true));
  const std::string conflict = read_response(socket);
  EXPECT_EQ(conflict.rfind("HTTP/1.1 409", 0), 0u) << conflict;
  EXPECT_NE(conflict.find(R"("param":"kv_transfer_params")"), std::string::npos) << conflict;
  EXPECT_NE(conflict.find(R"("code":"conflict")"), std::string::npos) << conflict;

  auto second = post(kStreamed);
  engine_.wait_added(2);
  engine_.emit(1, failure("block_ids do not belong to this transfer", /*invalid_request=*/true));
  const std::string invalid = read_response(second);
  EXPECT_EQ(invalid.rfind("HTTP/1.1 400", 0), 0u) << invalid;
  EXPECT_NE(invalid.find("block_ids do not belong to this transfer"), std::string::npos) << invalid;
}

TEST_F(OpenAiServiceTest, StreamedChoiceTheEngineFailsBeforeAnyOutputStartsTheStreamWithTheErrorEvent) {
  auto socket = post(kStreamed);
  engine_.wait_added(1);
  engine_.emit(0, failure(""));
  const std::string data = read_until(socket, "data: [DONE]");
  EXPECT_EQ(data.rfind("HTTP/1.1 200", 0), 0u) << data;
  EXPECT_NE(data.find(R"("message":"the engine failed this request")"), std::string::npos) << data;
}

TEST_F(OpenAiServiceTest, NonStreamedChoiceTheEngineFailsIsA500WithTheEnginesMessage) {
  auto socket = post(kNotStreamed);
  engine_.wait_added(1);
  engine_.emit(0, tokens({7}, 1));
  engine_.emit(0, failure("model execution failed: device lost"));
  const std::string data = read_response(socket);
  EXPECT_EQ(data.rfind("HTTP/1.1 500", 0), 0u) << data;
  EXPECT_NE(data.find(R"("message":"model execution failed: device lost")"), std::string::npos) << data;
}

// n = 2 over a prompt with a full KV block (block size 4): the second choice goes to the
// engine after the first one's first output; the engine refusing it ends the request.
TEST_F(OpenAiServiceTest, DeferredSiblingTheEngineRefusesFailsTheRequestAndAbortsTheFirstChoice) {
  engine_.refuse(resource_exhausted("4096 requests already waiting"), /*after=*/1);
  auto socket = post(R"({"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 8, "n": 2})");
  const std::vector<std::string> ids = engine_.wait_added(1);
  engine_.emit(0, tokens({7}, 1));
  const std::string data = read_response(socket);
  EXPECT_EQ(data.rfind("HTTP/1.1 503", 0), 0u) << data;
  EXPECT_NE(data.find("the engine's queue is full; retry later (4096 requests already waiting)"), std::string::npos)
      << data;
  EXPECT_EQ(engine_.wait_aborted(1), std::vector<std::string>{ids.at(0)});
}

TEST_F(OpenAiServiceTest, DeferredSiblingTheEngineRefusesEndsAStreamWithAnErrorEvent) {
  engine_.refuse(resource_exhausted("4096 requests already waiting"), /*after=*/1);
  auto socket = post(R"({"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 8, "n": 2, "stream": true})");
  const std::vector<std::string> ids = engine_.wait_added(1);
  engine_.emit(0, tokens({7}, 1));
  const std::string data = read_until(socket, "data: [DONE]");
  EXPECT_EQ(data.rfind("HTTP/1.1 200", 0), 0u) << data;
  EXPECT_NE(data.find(R"("type":"internal_error")"), std::string::npos) << data;
  EXPECT_NE(data.find("the engine's queue is full"), std::string::npos) << data;
  EXPECT_EQ(engine_.wait_aborted(1), std::vector<std::string>{ids.at(0)});
}

TEST_F(OpenAiServiceTest, ClientGoneMidStreamAbortsItsRequestAndIsCounted) {
  auto& disconnects = metrics::Registry::global().counter(
      "pd_http_client_disconnects_total", "Generations aborted because the client went away mid-request");
  const double before = disconnects.value();
  {
    auto socket = post(kStreamed);
    const std::vector<std::string> ids = engine_.wait_added(1);
    engine_.emit(0, tokens({7}, 1));
    read_until(socket, "\"index\"");
    socket.close();
    EXPECT_EQ(engine_.wait_aborted(1), std::vector<std::string>{ids.at(0)});
  }
  ASSERT_TRUE(service_->wait_until_idle(10'000));
  EXPECT_EQ(disconnects.value(), before + 1);
}

TEST_F(OpenAiServiceTest, StreamWithoutFailureEndsWithItsUsageChunk) {
  auto socket = post(
      R"({"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 2, "stream": true, "stream_options": {"include_usage": true}})");
  engine_.wait_added(1);
  engine_.emit(0, tokens({7}, 1));
  engine_.emit(0, finished(8, 2));
  const std::string data = read_until(socket, "data: [DONE]");
  EXPECT_EQ(data.rfind("HTTP/1.1 200", 0), 0u) << data;
  EXPECT_NE(data.find(R"("finish_reason":"length")"), std::string::npos) << data;
  EXPECT_NE(data.find(R"("usage":{"prompt_tokens":6,"completion_tokens":2,"total_tokens":8)"), std::string::npos)
      << data;
  EXPECT_EQ(data.find("error"), std::string::npos) << data;
}

}  // namespace
}  // namespace pd::server
