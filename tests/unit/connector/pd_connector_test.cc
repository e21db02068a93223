// PdConnector as the engine drives it: a producer and a consumer in one process,
// real control plane (loopback ZeroMQ) and real transfers (xfer's UCX backend over
// loopback), with xfer's fault backend armed through PD_CONNECTOR_XFER_FAULT to fail
// the producer's writes. The engine's part (scheduler, runner) is played by the test:
// it calls the KvConnector hooks in the engine's order.
#include "connector/pd_connector.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>

namespace pd::connector {
namespace {

using nlohmann::json;

constexpr int32_t kBlockSize = 16;
constexpr int32_t kNumPromptTokens = 32;  // two full blocks
constexpr int32_t kFirstToken = 7;
const char* kTransferId = "0123456789abcdef0123456789abcdef";

// KV in host memory, filled with a pattern per (layer, block, instance).
class HostKvRunner final : public engine::ModelRunner {
 public:
  explicit HostKvRunner(uint8_t seed) {
    spec_.num_layers = 2;
    spec_.num_kv_heads = 2;
    spec_.head_dim = 8;
    spec_.block_size = kBlockSize;
    spec_.num_blocks = 8;
    for (int32_t l = 0; l < spec_.num_layers; ++l) {
      kv_.emplace_back(spec_.bytes_per_layer());
      for (size_t i = 0; i < kv_.back().size(); ++i) kv_.back()[i] = static_cast<uint8_t>(seed + l * 31 + i * 7);
    }
  }
  const engine::KvCacheSpec& kv_cache_spec() const override { return spec_; }
  int32_t vocab_size() const override { return 64; }
  Result<engine::StepOutput> execute(const engine::StepInput&) override {
    return internal_error("the test plays the runner");
  }
  void* kv_layer_base(int32_t layer) override { return kv_[static_cast<size_t>(layer)].data(); }
  bool kv_on_device() const override { return false; }

  std::vector<uint8_t> block(int32_t layer, int32_t block) const {
    const auto& region = kv_[static_cast<size_t>(layer)];
    const auto begin = region.begin() + static_cast<std::ptrdiff_t>(spec_.bytes_per_block() * block);
    return {begin, begin + static_cast<std::ptrdiff_t>(spec_.bytes_per_block())};
  }

 private:
  engine::KvCacheSpec spec_;
  std::vector<std::vector<uint8_t>> kv_;
};

// The engine's wakeup: the connectors call it from their threads when a poll has news.
class Wakeup {
 public:
  std::function<void()> callback() {
    return [this] {
      std::lock_guard lock(mutex_);
      woken_ = true;
      cv_.notify_all();
    };
  }
  void wait(std::chrono::milliseconds at_most) {
    std::unique_lock lock(mutex_);
    cv_.wait_for(lock, at_most, [this] { return woken_; });
    woken_ = false;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool woken_ = false;
};

struct Instance {
  std::unique_ptr<HostKvRunner> runner;
  std::unique_ptr<PdConnector> connector;
  engine::ConnectorEvents events;  // everything its polls reported

  void poll() {
    engine::ConnectorEvents e = connector->poll();
    for (auto& id : e.finished_recving) events.finished_recving.push_back(id);
    for (auto& id : e.finished_sending) events.finished_sending.push_back(id);
    for (auto& error : e.load_errors) events.load_errors.push_back(error);
    for (auto& failed : e.failed_requests) events.failed_requests.push_back(failed);
    for (auto& token : e.first_tokens) events.first_tokens.push_back(token);
  }
};

Instance start(KvRole role, const std::string& id, uint8_t seed, Wakeup& wakeup, const char* xfer_fault) {
  if (xfer_fault != nullptr)
    setenv("PD_CONNECTOR_XFER_FAULT", xfer_fault, 1);
  else
    unsetenv("PD_CONNECTOR_XFER_FAULT");
  PdConnectorOptions options;
  options.config.role = role;
  options.config.kv_ip = "127.0.0.1";
  options.config.backend = TransferBackend::kUcx;
  options.config.transfer_timeout_ms = 5'000;
  options.instance_id = id;
  Instance out;
  out.runner = std::make_unique<HostKvRunner>(seed);
  auto connector = PdConnector::create(options, out.runner.get());
  unsetenv("PD_CONNECTOR_XFER_FAULT");
  EXPECT_TRUE(connector.ok()) << connector.status().to_string();
  if (!connector.ok()) return out;
  out.connector = std::move(connector).value();
  out.connector->bind_engine_wakeup(wakeup.callback());
  return out;
}

std::unique_ptr<engine::Request> make_request(const std::string& id, PdConnector& connector, const json& params) {
  auto parsed = connector.parse_request_params(params, kNumPromptTokens);
  EXPECT_TRUE(parsed.ok()) << parsed.status().to_string();
  engine::SamplingParams sampling;
  sampling.temperature = 0.0f;
  std::vector<int32_t> prompt(kNumPromptTokens);
  for (int32_t i = 0; i < kNumPromptTokens; ++i) prompt[static_cast<size_t>(i)] = i % 50;
  auto r = std::make_unique<engine::Request>(id, 0, std::move(prompt), sampling,
                                             parsed.ok() ? std::optional(*parsed) : std::nullopt, 0, 1, 16);
  r->external_kv_eligible = true;
  return r;
}

// Admission as the scheduler does it: ask, allocate, tell.
engine::ExternalMatch admit(PdConnector& connector, engine::Request& request, std::vector<int32_t> blocks) {
  auto match = connector.get_num_new_matched_tokens(request, 0);
  EXPECT_TRUE(match.ok()) << match.status().to_string();
  if (!match.ok()) return {};
  request.block_ids = std::move(blocks);
  if (match->num_external_tokens > 0)
    connector.update_state_after_alloc(request, request.block_ids, match->num_external_tokens);
  return std::move(match).value();
}

// The producer's one prefill step over the whole prompt, then its first token and finish.
engine::FinishDecision prefill_and_finish(PdConnector& connector, engine::Request& request) {
  engine::StepPlan plan;
  plan.seqs.push_back(engine::ScheduledSeq{&request, 0, kNumPromptTokens, true, 0, true});
  engine::StepInput input;
  engine::LayerKvHooks* hooks = connector.build_step_hooks(input, plan);
  EXPECT_NE(hooks, nullptr) << "the step that completes the prompt saves its KV";
  for (int32_t layer = 0; hooks != nullptr && layer < 2; ++layer) hooks->save_layer(layer);
  connector.after_step(plan, Status::Ok());
  request.num_computed_tokens = kNumPromptTokens;
  request.append_output_token(kFirstToken);
  connector.first_token_sampled(request, kFirstToken);
  EXPECT_TRUE(request.transition_to(engine::RequestState::kRunning).ok());
  EXPECT_TRUE(request.transition_to(engine::RequestState::kFinishedLength).ok());
  return connector.request_finished(request, request.block_ids);
}

// Polls both instances (as their engine threads do) until `done` holds or 10 s pass.
template <typename Done>
bool poll_until(Instance& a, Instance& b, Wakeup& wakeup, Done done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    a.poll();
    b.poll();
    if (done()) return true;
    wakeup.wait(std::chrono::milliseconds(50));
  }
  return false;
}

json producer_params() {
  return json{{"transfer_id", kTransferId}, {"do_remote_decode", true}, {"mode", "write"}};
}
json consumer_params(const PdConnector& producer) {
  return json{{"transfer_id", kTransferId},
              {"do_remote_prefill", true},
              {"mode", "write"},
              {"remote_instance_id", producer.instance_id()},
              {"remote_control", producer.control_address()},
              {"remote_boot_nonce", producer.boot_nonce()}};
}

TEST(PdConnectorAdapter, AWriteMovesThePromptsKvAndHandsOverTheFirstToken) {
  Wakeup wakeup;
  Instance producer = start(KvRole::kProducer, "adapter-p", 1, wakeup, nullptr);
  Instance consumer = start(KvRole::kConsumer, "adapter-c", 100, wakeup, nullptr);
  ASSERT_TRUE(producer.connector && consumer.connector);
  std::mutex streamed_mutex;
  std::vector<std::pair<std::string, int32_t>> streamed;
  consumer.connector->bind_first_token_sink([&](const std::string& id, int32_t token) {
    std::lock_guard lock(streamed_mutex);
    streamed.emplace_back(id, token);
  });

  auto c_req = make_request("c-req", *consumer.connector, consumer_params(*producer.connector));
  const engine::ExternalMatch c_match = admit(*consumer.connector, *c_req, {5, 6});
  EXPECT_EQ(c_match.num_external_tokens, kNumPromptTokens);
  EXPECT_TRUE(c_match.load_async);
  EXPECT_TRUE(c_match.includes_last_prompt_token);
  EXPECT_NE(c_req->connector_state.get(), nullptr) << "the connector keeps its state on the request";

  auto p_req = make_request("p-req", *producer.connector, producer_params());
  admit(*producer.connector, *p_req, {1, 2});
  ASSERT_NE(p_req->connector_state.get(), nullptr);
  const engine::FinishDecision decision = prefill_and_finish(*producer.connector, *p_req);
  EXPECT_TRUE(decision.delay_free_blocks) << "the blocks stay until the writes completed";
  ASSERT_TRUE(decision.kv_transfer_params.has_value());
  EXPECT_EQ(decision.kv_transfer_params->transfer_id, kTransferId);

  ASSERT_TRUE(poll_until(
      producer, consumer, wakeup,
      [&] { return !consumer.events.finished_recving.empty() && !producer.events.finished_sending.empty(); }))
      << "consumer got " << consumer.events.finished_recving.size() << " loads, producer released "
      << producer.events.finished_sending.size() << " holds";
  EXPECT_EQ(consumer.events.finished_recving, std::vector<std::string>{"c-req"});
  EXPECT_TRUE(consumer.events.load_errors.empty());
  ASSERT_EQ(consumer.events.first_tokens.size(), 1u);
  EXPECT_EQ(consumer.events.first_tokens[0].request_id, "c-req");
  EXPECT_EQ(consumer.events.first_tokens[0].token_id, kFirstToken);
  EXPECT_EQ(producer.events.finished_sending, std::vector<std::string>{"p-req"});
  {
    std::lock_guard lock(streamed_mutex);
    EXPECT_EQ(streamed, (std::vector<std::pair<std::string, int32_t>>{{"c-req", kFirstToken}}))
        << "the token is streamed as its done arrives";
  }
  // Producer blocks 1, 2 landed in consumer blocks 5, 6 for every layer.
  for (int32_t layer = 0; layer < 2; ++layer) {
    EXPECT_EQ(consumer.runner->block(layer, 5), producer.runner->block(layer, 1)) << "layer " << layer;
    EXPECT_EQ(consumer.runner->block(layer, 6), producer.runner->block(layer, 2)) << "layer " << layer;
  }
  EXPECT_FALSE(consumer.connector->request_finished(*c_req, c_req->block_ids).delay_free_blocks)
      << "nothing moves into a loaded request's blocks";
}

TEST(PdConnectorAdapter, FailedWritesBecomeALoadErrorAndEveryHoldIsReleased) {
  Wakeup wakeup;
  Instance producer = start(KvRole::kProducer, "adapter-p", 1, wakeup, "fail");
  Instance consumer = start(KvRole::kConsumer, "adapter-c", 100, wakeup, nullptr);
  ASSERT_TRUE(producer.connector && consumer.connector);
  std::atomic<int> num_streamed{0};
  consumer.connector->bind_first_token_sink([&](const std::string&, int32_t) { ++num_streamed; });

  auto c_req = make_request("c-req", *consumer.connector, consumer_params(*producer.connector));
  admit(*consumer.connector, *c_req, {5, 6});
  const std::vector<uint8_t> before = consumer.runner->block(0, 5);
  auto p_req = make_request("p-req", *producer.connector, producer_params());
  admit(*producer.connector, *p_req, {1, 2});
  EXPECT_TRUE(prefill_and_finish(*producer.connector, *p_req).delay_free_blocks);

  ASSERT_TRUE(poll_until(producer, consumer, wakeup, [&] {
    return !consumer.events.load_errors.empty() && !producer.events.finished_sending.empty();
  }));
  ASSERT_EQ(consumer.events.load_errors.size(), 1u);
  EXPECT_EQ(consumer.events.load_errors[0].request_id, "c-req");
  EXPECT_EQ(consumer.events.load_errors[0].failed_block_ids, (std::vector<int32_t>{5, 6}));
  EXPECT_EQ(consumer.events.finished_recving, std::vector<std::string>{"c-req"});
  EXPECT_TRUE(consumer.events.first_tokens.empty()) << "no token without its KV";
  EXPECT_EQ(num_streamed.load(), 0);
  EXPECT_EQ(producer.events.finished_sending, std::vector<std::string>{"p-req"});
  EXPECT_EQ(consumer.runner->block(0, 5), before) << "the fault backend posted nothing";
}

}  // namespace
}  // namespace pd::connector
