// PdConnector's READ-mode first-token hand-over, with a producer and a consumer
// connector in one process (real control sockets, real xfer reads over UCX),
// driven through the KvConnector calls an engine makes. The test thread is the
// consumer's engine thread: like an idle engine it polls only when the connector
// wakes it, and not at all while it would be inside a step.
#include <gtest/gtest.h>

#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <thread>

#include "common/clock.h"
#include "connector/pd_connector.h"
#include "engine/engine_request.h"
#include "engine/step_plan.h"

namespace pd::connector {
namespace {

constexpr int32_t kBlockSize = 4;
constexpr int32_t kNumBlocks = 16;
constexpr int32_t kPromptLen = 10;  // 3 blocks
constexpr int32_t kFirstToken = 42;
const std::string kTransferId = "0123456789abcdef0123456789abcdef";

// One layer of host KV, so a READ transfer is one xfer batch. Runs no steps.
class KvOnlyRunner : public engine::ModelRunner {
 public:
  explicit KvOnlyRunner(float fill) {
    spec_.num_layers = 1;
    spec_.num_kv_heads = 1;
    spec_.head_dim = 2;
    spec_.block_size = kBlockSize;
    spec_.dtype = engine::KvDtype::kFloat32;
    spec_.num_blocks = kNumBlocks;
    kv_.resize(spec_.bytes_per_layer() / sizeof(float));
    for (size_t i = 0; i < kv_.size(); ++i) kv_[i] = fill + static_cast<float>(i);
  }
  const engine::KvCacheSpec& kv_cache_spec() const override { return spec_; }
  int32_t vocab_size() const override { return 100; }
  Result<engine::StepOutput> execute(const engine::StepInput&) override { return internal_error("runs no steps"); }
  void* kv_layer_base(int32_t layer) override { return layer == 0 ? kv_.data() : nullptr; }
  bool kv_on_device() const override { return false; }
  // The floats of one block.
  std::vector<float> block(int32_t id) const {
    const size_t n = spec_.bytes_per_block() / sizeof(float);
    return {kv_.begin() + static_cast<std::ptrdiff_t>(n * static_cast<size_t>(id)),
            kv_.begin() + static_cast<std::ptrdiff_t>(n * static_cast<size_t>(id + 1))};
  }

 private:
  engine::KvCacheSpec spec_;
  std::vector<float> kv_;
};

// Counts a connector's engine wakeups.
class Wakeups {
 public:
  std::function<void()> callback() {
    return [this] {
      std::lock_guard lock(mutex_);
      ++count_;
      cv_.notify_all();
    };
  }
  // Waits (bounded) for a wakeup after the first `seen`; returns the count.
  int64_t wait_after(int64_t seen, int64_t timeout_ms) {
    std::unique_lock lock(mutex_);
    cv_.wait_until(lock, Deadline::after_ms(timeout_ms).when(), [&] { return count_ > seen; });
    return count_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int64_t count_ = 0;
};

// What reached the consumer's first-token sink.
class StreamedTokens {
 public:
  engine::FirstTokenSink sink() {
    return [this](const std::string& request_id, int32_t token_id) {
      std::lock_guard lock(mutex_);
      streamed_.emplace_back(request_id, token_id);
    };
  }
  std::vector<std::pair<std::string, int32_t>> get() {
    std::lock_guard lock(mutex_);
    return streamed_;
  }

 private:
  std::mutex mutex_;
  std::vector<std::pair<std::string, int32_t>> streamed_;
};

std::vector<int32_t> prompt() {
  std::vector<int32_t> p;
  for (int32_t i = 0; i < kPromptLen; ++i) p.push_back(3 + i);
  return p;
}

engine::SamplingParams greedy(int32_t max_tokens) {
  engine::SamplingParams s;
  s.temperature = 0.0f;
  s.max_tokens = max_tokens;
  return s;
}

std::unique_ptr<PdConnector> make_connector(KvRole role, const std::string& id, KvOnlyRunner* runner) {
  PdConnectorOptions options;
  options.config.role = role;
  options.config.read_mode = true;
  options.config.backend = TransferBackend::kUcx;
  options.config.transfer_timeout_ms = 10'000;
  options.instance_id = id;
  options.served_model_name = "m";
  auto created = PdConnector::create(std::move(options), runner);
  EXPECT_TRUE(created.ok()) << created.status().to_string();
  return created.ok() ? std::move(created).value() : nullptr;
}

// A producer that prefilled the prompt into blocks 0..2, sampled kFirstToken and
// holds the KV for a READ; its "engine thread" polls on every wakeup.
class HeldProducer {
 public:
  HeldProducer() : runner_(1000.0f), connector_(make_connector(KvRole::kProducer, "producer-t", &runner_)) {}
  ~HeldProducer() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wakeups_.callback()();
    if (thread_.joinable()) thread_.join();
  }

  // Engine-thread calls, then the polling thread starts. The answer's block ids.
  std::vector<int32_t> prefill_and_hold() {
    connector_->bind_engine_wakeup(wakeups_.callback());
    contract::TransferParams params;
    params.side = contract::TransferSide::kProducer;
    params.read_mode = true;
    params.transfer_id = kTransferId;
    request_ = std::make_unique<engine::Request>("p", 0, prompt(), greedy(1), params, now_ns(), 0, 1);
    EXPECT_TRUE(connector_->get_num_new_matched_tokens(*request_, 0).ok());
    request_->block_ids = {0, 1, 2};
    engine::StepPlan plan;
    engine::ScheduledSeq seq;
    seq.request = request_.get();
    seq.num_new_tokens = kPromptLen;
    seq.sample = true;
    plan.seqs.push_back(seq);
    connector_->build_step_hooks(engine::StepInput{}, plan);
    connector_->after_step(plan, Status::Ok());
    request_->num_computed_tokens = kPromptLen;
    connector_->first_token_sampled(*request_, kFirstToken);
    engine::FinishDecision decision = connector_->request_finished(*request_, request_->block_ids);
    EXPECT_TRUE(decision.delay_free_blocks);
    EXPECT_TRUE(decision.kv_transfer_params.has_value());
    thread_ = std::thread([this] { run(); });
    if (!decision.kv_transfer_params || !decision.kv_transfer_params->block_ids) return {};
    return *decision.kv_transfer_params->block_ids;
  }

  PdConnector& connector() { return *connector_; }
  const KvOnlyRunner& runner() const { return runner_; }

 private:
  void run() {
    int64_t seen = 0;
    while (true) {
      {
        std::lock_guard lock(mutex_);
        if (stop_) return;
      }
      connector_->poll();
      seen = wakeups_.wait_after(seen, 50);
    }
  }

  KvOnlyRunner runner_;
  std::unique_ptr<PdConnector> connector_;
  std::unique_ptr<engine::Request> request_;
  Wakeups wakeups_;
  std::mutex mutex_;
  bool stop_ = false;
  std::thread thread_;
};

struct Consumer {
  KvOnlyRunner runner{0.0f};
  std::unique_ptr<PdConnector> connector;
  std::unique_ptr<engine::Request> request;
  Wakeups wakeups;
  StreamedTokens streamed;

  // Admits the request (blocks 5..7) the way the engine thread does.
  void admit(HeldProducer& producer, const std::vector<int32_t>& producer_blocks) {
    connector = make_connector(KvRole::kConsumer, "consumer-t", &runner);
    ASSERT_NE(connector, nullptr);
    connector->bind_engine_wakeup(wakeups.callback());
    connector->bind_first_token_sink(streamed.sink());
    contract::TransferParams params;
    params.side = contract::TransferSide::kConsumer;
    params.read_mode = true;
    params.transfer_id = kTransferId;
    params.remote_instance_id = producer.connector().instance_id();
    params.remote_control = producer.connector().control_address();
    params.remote_boot_nonce = producer.connector().boot_nonce();
    params.remote_block_ids = producer_blocks;
    params.num_tokens = kPromptLen;
    request = std::make_unique<engine::Request>("c", 0, prompt(), greedy(8), params, now_ns(), 0, 8);
    auto match = connector->get_num_new_matched_tokens(*request, 0);
    ASSERT_TRUE(match.ok()) << match.status().to_string();
    ASSERT_EQ(match->num_external_tokens, kPromptLen);
    ASSERT_TRUE(match->includes_last_prompt_token);
    request->block_ids = {5, 6, 7};
    connector->update_state_after_alloc(*request, request->block_ids, kPromptLen);
  }

  // Polls until a poll reports the load ended (bounded).
  engine::ConnectorEvents poll_until_reported() {
    const Deadline deadline = Deadline::after_ms(10'000);
    int64_t seen = 0;
    while (!deadline.expired()) {
      engine::ConnectorEvents events = connector->poll();
      if (!events.finished_recving.empty()) return events;
      seen = wakeups.wait_after(seen, 100);
    }
    return {};
  }

  void finish() {
    connector->request_finished(*request, request->block_ids);
    connector->poll();
  }
};

TEST(PdConnectorFirstToken, ReadModeStreamsTheTokenWhenTheLastReadCompletesWithoutWaitingForAPoll) {
  HeldProducer producer;
  const std::vector<int32_t> producer_blocks = producer.prefill_and_hold();
  ASSERT_EQ(producer_blocks.size(), 3u);
  Consumer c;
  c.admit(producer, producer_blocks);
  if (HasFatalFailure()) return;

  // The engine thread polls on each wakeup (handshake done, read_ok), which posts the
  // read; after that it would be busy in a step and polls no more. The token must
  // reach the client then, from the read's completion, not at a later poll.
  const Deadline deadline = Deadline::after_ms(10'000);
  int64_t seen = 0;
  std::optional<engine::ConnectorEvents> reported_early;
  while (c.streamed.get().empty() && !deadline.expired()) {
    seen = c.wakeups.wait_after(seen, 1'000);
    if (!c.streamed.get().empty()) break;
    engine::ConnectorEvents events = c.connector->poll();
    if (!events.finished_recving.empty()) {
      reported_early = std::move(events);
      break;
    }
  }
  EXPECT_FALSE(reported_early.has_value()) << "the load was reported by a poll before the token was streamed";
  ASSERT_EQ(c.streamed.get(), (std::vector<std::pair<std::string, int32_t>>{{"c", kFirstToken}}));

  // The next poll reports the same token with the completed load.
  engine::ConnectorEvents events = reported_early ? std::move(*reported_early) : c.poll_until_reported();
  EXPECT_EQ(events.finished_recving, std::vector<std::string>{"c"});
  ASSERT_EQ(events.first_tokens.size(), 1u);
  EXPECT_EQ(events.first_tokens[0].request_id, "c");
  EXPECT_EQ(events.first_tokens[0].token_id, kFirstToken);
  EXPECT_TRUE(events.load_errors.empty());
  for (size_t i = 0; i < producer_blocks.size(); ++i) {
    EXPECT_EQ(c.runner.block(c.request->block_ids[i]), producer.runner().block(producer_blocks[i])) << "block " << i;
  }
  c.finish();
}

TEST(PdConnectorFirstToken, ReadModeStreamsNothingWhenTheReadFails) {
  HeldProducer producer;
  const std::vector<int32_t> producer_blocks = producer.prefill_and_hold();
  ASSERT_EQ(producer_blocks.size(), 3u);
  Consumer c;
  ASSERT_EQ(setenv("PD_CONNECTOR_XFER_FAULT", "fail", 1), 0);  // read by the consumer's start-up only
  c.admit(producer, producer_blocks);
  unsetenv("PD_CONNECTOR_XFER_FAULT");
  if (HasFatalFailure()) return;

  engine::ConnectorEvents events = c.poll_until_reported();
  EXPECT_EQ(events.finished_recving, std::vector<std::string>{"c"});
  EXPECT_TRUE(events.first_tokens.empty()) << "a failed read hands over no token";
  ASSERT_EQ(events.load_errors.size(), 1u) << "the engine recomputes the prompt";
  EXPECT_EQ(events.load_errors[0].request_id, "c");
  EXPECT_TRUE(c.streamed.get().empty()) << "nothing reached the client before the recompute";
  c.finish();
}

}  // namespace
}  // namespace pd::connector
