// The engine loop with a P/D connector: a test connector that really moves KV
// (it writes the prompt's KV into the consumer's blocks, laid out as
// model_runner.h says), wakes the engine from another thread, and holds
// blocks. Outputs are checked against the reference computed on the plain
// sequence, so KV that never arrived, or arrived in the wrong blocks, fails.
#include <gtest/gtest.h>

#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "common/clock.h"
#include "engine/engine.h"
#include "paged_kv_test_runner.h"

namespace pd::engine {
namespace {

using testing::PagedKvTestRunner;
using testing::reference_greedy;

constexpr int32_t kVocab = 300;
constexpr int32_t kBlockSize = 4;

class LoopbackConnector : public KvConnector {
 public:
  explicit LoopbackConnector(PagedKvTestRunner* runner) : runner_(runner) {}

  // Test-thread side.
  ExternalMatch match;
  Status refusal = Status::Ok();  // answered instead of `match` when set
  bool delay_free = false;
  RemoteKvTimeoutAction timeout_action = RemoteKvTimeoutAction::kFail;

  // Writes the external tokens' KV into the blocks the engine allocated, then
  // reports the load complete and wakes the engine.
  void deliver(const std::string& id) {
    std::lock_guard lock(mutex_);
    const Pending& p = pending_.at(id);
    const KvCacheSpec& spec = runner_->kv_cache_spec();
    for (int32_t layer = 0; layer < spec.num_layers; ++layer) {
      auto* base = static_cast<float*>(runner_->kv_layer_base(layer));
      for (int32_t pos = p.first_pos; pos < p.first_pos + p.num_tokens; ++pos) {
        const size_t per_token = static_cast<size_t>(spec.num_kv_heads * spec.head_dim);
        const size_t block_floats = 2 * static_cast<size_t>(spec.block_size) * per_token;
        float* k = base + static_cast<size_t>(p.block_ids[static_cast<size_t>(pos / spec.block_size)]) * block_floats +
                   static_cast<size_t>(pos % spec.block_size) * per_token;
        float* v = k + static_cast<size_t>(spec.block_size) * per_token;
        k[0] = static_cast<float>(p.tokens[static_cast<size_t>(pos)]);
        k[1] = static_cast<float>(pos);
        v[0] = k[0] + static_cast<float>(layer);
        v[1] = k[1];
      }
    }
    events_.finished_recving.push_back(id);
    polls_at_report_ = num_polls_;
    if (wakeup_) wakeup_();
  }
  // deliver() plus the producer's first output token (first-token hand-over).
  void deliver_with_token(const std::string& id, int32_t token) {
    {
      std::lock_guard lock(mutex_);
      events_.first_tokens.push_back(HandedOverToken{id, token});
    }
    deliver(id);
  }
  // Calls the engine's first-token sink only.
  void stream(const std::string& id, int32_t token) {
    FirstTokenSink sink;
    {
      std::lock_guard lock(mutex_);
      sink = sink_;
    }
    ASSERT_TRUE(sink) << "the engine bound no first-token sink";
    sink(id, token);
  }
  // What a connector does on its receive thread when the KV and the producer's
  // token have both arrived: stream the token now, report them at the next poll.
  void stream_then_deliver(const std::string& id, int32_t token) {
    stream(id, token);
    deliver_with_token(id, token);
  }
  void report_failed(const std::string& id, const std::string& message) {
    std::lock_guard lock(mutex_);
    events_.failed_requests.push_back({id, message});
    if (wakeup_) wakeup_();
  }
  void report_sent(const std::string& id) {
    std::lock_guard lock(mutex_);
    events_.finished_sending.push_back(id);
    polls_at_report_ = num_polls_;
    if (wakeup_) wakeup_();
  }
  bool wait_allocated(const std::string& id) {
    std::unique_lock lock(mutex_);
    return cv_.wait_until(lock, Deadline::after_ms(20'000).when(), [&] { return pending_.contains(id); });
  }
  // Waits until the engine has polled (and so applied) the reported events.
  bool wait_drained() {
    std::unique_lock lock(mutex_);
    return cv_.wait_until(lock, Deadline::after_ms(20'000).when(), [&] { return num_polls_ > polls_at_report_; });
  }
  std::vector<std::string> finished_ids() {
    std::lock_guard lock(mutex_);
    return finished_;
  }

  // Caller-thread side: rejects params without a transfer_id.
  Status validate_request(const GenerateRequest& request) const override {
    if (request.kv_transfer_params && request.kv_transfer_params->transfer_id.empty()) {
      return invalid_argument("kv_transfer_params without transfer_id");
    }
    return Status::Ok();
  }

  // Engine-thread side.
  void bind_engine_wakeup(std::function<void()> wakeup) override { wakeup_ = std::move(wakeup); }
  void bind_first_token_sink(FirstTokenSink sink) override {
    std::lock_guard lock(mutex_);
    sink_ = std::move(sink);
  }
  Result<ExternalMatch> get_num_new_matched_tokens(const Request&, int32_t) override {
    std::lock_guard lock(mutex_);
    if (!refusal.ok()) return refusal;
    return match;
  }
  void update_state_after_alloc(const Request& r, std::span<const int32_t> block_ids, int32_t num_external) override {
    std::lock_guard lock(mutex_);
    pending_[r.request_id()] =
        Pending{r.num_computed_tokens, num_external, {block_ids.begin(), block_ids.end()}, r.token_ids()};
    cv_.notify_all();
  }
  LayerKvHooks* build_step_hooks(const StepInput&, const StepPlan&) override { return nullptr; }
  void after_step(const StepPlan&, const Status&) override {}
  ConnectorEvents poll() override {
    std::lock_guard lock(mutex_);
    ConnectorEvents out = std::move(events_);
    events_ = {};
    ++num_polls_;
    cv_.notify_all();
    return out;
  }
  bool request_preempted(const Request&, std::span<const int32_t>) override { return false; }
  FinishDecision request_finished(const Request& r, std::span<const int32_t>) override {
    std::lock_guard lock(mutex_);
    finished_.push_back(r.request_id());
    contract::ProducerAnswer answer;
    answer.transfer_id = "x-" + r.request_id();
    return FinishDecision{delay_free, answer};
  }
  RemoteKvTimeoutAction on_remote_kv_timeout(const Request&) override {
    std::lock_guard lock(mutex_);
    return timeout_action;
  }

 private:
  struct Pending {
    int32_t first_pos = 0;
    int32_t num_tokens = 0;
    std::vector<int32_t> block_ids;
    std::vector<int32_t> tokens;
  };
  PagedKvTestRunner* runner_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::function<void()> wakeup_;
  FirstTokenSink sink_;
  std::map<std::string, Pending> pending_;
  ConnectorEvents events_;
  int64_t num_polls_ = 0;
  int64_t polls_at_report_ = 0;
  std::vector<std::string> finished_;
};

struct Rig {
  PagedKvTestRunner* runner = nullptr;
  LoopbackConnector* connector = nullptr;
  std::unique_ptr<Engine> engine;
};

Rig make_rig(int32_t num_blocks, ExternalMatch match, bool delay_free = false,
             RemoteKvTimeoutAction action = RemoteKvTimeoutAction::kFail) {
  Rig rig;
  auto runner = std::make_unique<PagedKvTestRunner>(num_blocks, kBlockSize, kVocab);
  rig.runner = runner.get();
  auto connector = std::make_unique<LoopbackConnector>(runner.get());
  connector->match = match;
  connector->delay_free = delay_free;
  connector->timeout_action = action;
  rig.connector = connector.get();
  EngineConfig config;
  config.max_num_batched_tokens = 64;
  config.max_model_len = 128;
  auto created = Engine::create(config, std::move(runner), nullptr, std::move(connector));
  EXPECT_TRUE(created.ok()) << created.status().to_string();
  rig.engine = std::move(created).value();
  return rig;
}

class Outputs {
 public:
  OutputCallback callback() {
    return [this](RequestOutput out) {
      std::lock_guard lock(mutex_);
      auto& s = streams_[out.request_id];
      s.push_back(std::move(out));
      cv_.notify_all();
    };
  }
  bool wait_finished(const std::string& id) {
    std::unique_lock lock(mutex_);
    return cv_.wait_until(lock, Deadline::after_ms(20'000).when(), [&] {
      auto it = streams_.find(id);
      return it != streams_.end() && !it->second.empty() && it->second.back().finished;
    });
  }
  bool wait_first_token(const std::string& id, int64_t timeout_ms) {
    std::unique_lock lock(mutex_);
    return cv_.wait_until(lock, Deadline::after_ms(timeout_ms).when(), [&] {
      auto it = streams_.find(id);
      if (it == streams_.end()) return false;
      for (const auto& o : it->second)
        if (!o.new_token_ids.empty()) return true;
      return false;
    });
  }
  std::vector<int32_t> tokens(const std::string& id) {
    std::lock_guard lock(mutex_);
    std::vector<int32_t> all;
    for (const auto& o : streams_[id]) all.insert(all.end(), o.new_token_ids.begin(), o.new_token_ids.end());
    return all;
  }
  RequestOutput last(const std::string& id) {
    std::lock_guard lock(mutex_);
    return streams_.at(id).back();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<RequestOutput>> streams_;
};

std::vector<int32_t> prompt_of(int32_t n) {
  std::vector<int32_t> t;
  for (int32_t i = 0; i < n; ++i) t.push_back((7 * i + 3) % kVocab);
  return t;
}

GenerateRequest pd_request(const std::string& id, int32_t prompt_len, int32_t max_tokens, bool with_params = true) {
  GenerateRequest r;
  r.request_id = id;
  r.prompt_token_ids = prompt_of(prompt_len);
  r.sampling.temperature = 0.0f;
  r.sampling.max_tokens = max_tokens;
  if (with_params) {
    r.kv_transfer_params.emplace();
    r.kv_transfer_params->side = contract::TransferSide::kConsumer;
    r.kv_transfer_params->transfer_id = "t";
  }
  return r;
}

TEST(EngineConnector, ConsumerDecodesOnKvWrittenByTheConnector) {
  Rig rig = make_rig(64, ExternalMatch{24, true, 60'000});
  Outputs out;
  ASSERT_TRUE(rig.engine->add_request(pd_request("c", 26, 5), out.callback()).ok());
  ASSERT_TRUE(rig.connector->wait_allocated("c"));
  rig.connector->deliver("c");
  ASSERT_TRUE(out.wait_finished("c"));
  EXPECT_EQ(out.tokens("c"), reference_greedy(prompt_of(26), 5, kVocab));
  EXPECT_EQ(out.last("c").num_cached_tokens, 24);
  EXPECT_EQ(rig.runner->num_kv_mismatches(), 0);
  rig.engine->shutdown();
  EXPECT_EQ(rig.engine->stats().num_blocks_in_use, 0);
}

TEST(EngineConnector, RemoteKvDeadlineFailsTheWaitingRequestWithoutHanging) {
  Rig rig = make_rig(64, ExternalMatch{24, true, 30});
  Outputs out;
  ASSERT_TRUE(rig.engine->add_request(pd_request("c", 26, 5), out.callback()).ok());
  ASSERT_TRUE(out.wait_finished("c"));
  EXPECT_EQ(out.last("c").finish_reason, FinishReason::kError);
  EXPECT_NE(out.last("c").error.find("remote KV"), std::string::npos);
  rig.engine->shutdown();
  EXPECT_EQ(rig.engine->stats().num_blocks_in_use, 0);
}

TEST(EngineConnector, RemoteKvDeadlineWithRecomputePolicyStillGivesTheRightOutput) {
  Rig rig = make_rig(64, ExternalMatch{24, true, 30}, false, RemoteKvTimeoutAction::kRecomputeLocally);
  Outputs out;
  ASSERT_TRUE(rig.engine->add_request(pd_request("c", 26, 5), out.callback()).ok());
  ASSERT_TRUE(out.wait_finished("c"));
  EXPECT_EQ(out.tokens("c"), reference_greedy(prompt_of(26), 5, kVocab));
}

TEST(EngineConnector, AbortWhileWaitingForRemoteKvReturnsAllBlocks) {
  Rig rig = make_rig(64, ExternalMatch{24, true, 60'000});
  Outputs out;
  ASSERT_TRUE(rig.engine->add_request(pd_request("c", 26, 5), out.callback()).ok());
  ASSERT_TRUE(rig.connector->wait_allocated("c"));
  rig.engine->abort("c");
  ASSERT_TRUE(out.wait_finished("c"));
  EXPECT_EQ(out.last("c").finish_reason, FinishReason::kAbort);
  rig.engine->shutdown();
  EXPECT_EQ(rig.engine->stats().num_blocks_in_use, 0);
  EXPECT_EQ(rig.engine->stats().num_blocks_free, 64);
}

TEST(EngineConnector, ProducerKeepsBlocksAndIdUntilSendingIsReported) {
  Rig rig = make_rig(64, ExternalMatch{0, false, 0}, /*delay_free=*/true);
  Outputs out;
  ASSERT_TRUE(rig.engine->add_request(pd_request("p", 20, 1), out.callback()).ok());
  ASSERT_TRUE(out.wait_finished("p"));
  ASSERT_TRUE(out.last("p").kv_transfer_params.has_value());
  EXPECT_EQ(out.last("p").kv_transfer_params->transfer_id, "x-p");
  // Held: the id cannot be reused while a transfer may read its blocks.
  EXPECT_EQ(rig.engine->add_request(pd_request("p", 20, 1), out.callback()).code(), ErrorCode::kInvalidArgument);
  rig.connector->report_sent("p");
  ASSERT_TRUE(rig.connector->wait_drained());
  rig.engine->shutdown();
  EXPECT_EQ(rig.engine->stats().num_blocks_in_use, 0);
}

TEST(EngineConnector, TransferFailureReportedByTheConnectorFailsTheWaitingRequest) {
  Rig rig = make_rig(64, ExternalMatch{24, true, 60'000});
  Outputs out;
  ASSERT_TRUE(rig.engine->add_request(pd_request("c", 26, 5), out.callback()).ok());
  ASSERT_TRUE(rig.connector->wait_allocated("c"));
  rig.connector->report_failed("c", "producer aborted transfer t");
  ASSERT_TRUE(out.wait_finished("c"));
  EXPECT_EQ(out.last("c").finish_reason, FinishReason::kError);
  EXPECT_EQ(out.last("c").error, "producer aborted transfer t");
  EXPECT_TRUE(out.tokens("c").empty());
  rig.engine->shutdown();
  EXPECT_EQ(rig.engine->stats().num_blocks_in_use, 0);
}

TEST(EngineConnector, AConnectorRefusingARequestAsAConflictMarksItsOutputSo) {
  Rig rig = make_rig(64, ExternalMatch{24, true, 60'000});
  rig.connector->refusal = failed_precondition("transfer t is already active");
  Outputs out;
  ASSERT_TRUE(rig.engine->add_request(pd_request("dup", 26, 5), out.callback()).ok());
  ASSERT_TRUE(out.wait_finished("dup"));
  EXPECT_EQ(out.last("dup").finish_reason, FinishReason::kError);
  EXPECT_TRUE(out.last("dup").conflict);
  EXPECT_NE(out.last("dup").error.find("already active"), std::string::npos);
  // Any other refusal is not a conflict.
  rig.connector->refusal = internal_error("connector bug");
  ASSERT_TRUE(rig.engine->add_request(pd_request("bug", 26, 5), out.callback()).ok());
  ASSERT_TRUE(out.wait_finished("bug"));
  EXPECT_FALSE(out.last("bug").conflict);
  rig.engine->shutdown();
  EXPECT_EQ(rig.engine->stats().num_blocks_in_use, 0);
}

TEST(EngineConnector, ConnectorValidationRejectsBadTransferParamsUpFront) {
  Rig rig = make_rig(64, ExternalMatch{24, true, 60'000});
  Outputs out;
  GenerateRequest r = pd_request("bad", 26, 4);
  r.kv_transfer_params = contract::TransferParams{};  // no transfer_id
  EXPECT_EQ(rig.engine->add_request(r, out.callback()).code(), ErrorCode::kInvalidArgument);
}

TEST(EngineConnector, PlainRequestsIgnoreTheConnectorsOffer) {
  Rig rig = make_rig(64, ExternalMatch{24, true, 60'000});
  Outputs out;
  ASSERT_TRUE(rig.engine->add_request(pd_request("plain", 26, 4, /*with_params=*/false), out.callback()).ok());
  ASSERT_TRUE(out.wait_finished("plain"));
  EXPECT_EQ(out.tokens("plain"), reference_greedy(prompt_of(26), 4, kVocab));
  EXPECT_EQ(out.last("plain").num_cached_tokens, 0);
}

// First-token hand-over: the connector brings all 26 prompt tokens' KV and the
// producer's token; the engine emits that token and decodes from there.
ExternalMatch handover_match() {
  ExternalMatch m{26, true, 60'000};
  m.includes_last_prompt_token = true;
  return m;
}

TEST(EngineConnector, HandedOverFirstTokenIsEmittedAndDecodingContinuesFromIt) {
  Rig rig = make_rig(64, handover_match());
  Outputs out;
  ASSERT_TRUE(rig.engine->add_request(pd_request("c", 26, 5), out.callback()).ok());
  ASSERT_TRUE(rig.connector->wait_allocated("c"));
  const std::vector<int32_t> reference = reference_greedy(prompt_of(26), 5, kVocab);
  rig.connector->deliver_with_token("c", reference[0]);
  ASSERT_TRUE(out.wait_finished("c"));
  EXPECT_EQ(out.tokens("c"), reference);
  EXPECT_EQ(out.last("c").num_cached_tokens, 26) << "no prompt token was computed here";
  EXPECT_EQ(rig.runner->num_kv_mismatches(), 0);
  EXPECT_EQ(rig.runner->num_steps(), 4) << "four decode steps for the four tokens after the handed-over one";
  rig.engine->shutdown();
  EXPECT_EQ(rig.engine->stats().engine.num_handed_over_tokens, 1);
  EXPECT_EQ(rig.engine->stats().num_blocks_in_use, 0);
}

TEST(EngineConnector, TheHandedOverTokenIsTakenAsIsNotRecomputed) {
  // A token the model would not pick: the rest of the output must follow it.
  Rig rig = make_rig(64, handover_match());
  Outputs out;
  ASSERT_TRUE(rig.engine->add_request(pd_request("c", 26, 4), out.callback()).ok());
  ASSERT_TRUE(rig.connector->wait_allocated("c"));
  const int32_t forced = (reference_greedy(prompt_of(26), 1, kVocab)[0] + 1) % kVocab;
  rig.connector->deliver_with_token("c", forced);
  ASSERT_TRUE(out.wait_finished("c"));
  std::vector<int32_t> extended = prompt_of(26);
  extended.push_back(forced);
  std::vector<int32_t> expected{forced};
  for (int32_t t : reference_greedy(extended, 3, kVocab)) expected.push_back(t);
  EXPECT_EQ(out.tokens("c"), expected);
  EXPECT_EQ(rig.runner->num_kv_mismatches(), 0);
}

TEST(EngineConnector, WholePromptWithoutATokenRecomputesTheLastPromptToken) {
  Rig rig = make_rig(64, handover_match());
  Outputs out;
  ASSERT_TRUE(rig.engine->add_request(pd_request("c", 26, 5), out.callback()).ok());
  ASSERT_TRUE(rig.connector->wait_allocated("c"));
  rig.connector->deliver("c");
  ASSERT_TRUE(out.wait_finished("c"));
  EXPECT_EQ(out.tokens("c"), reference_greedy(prompt_of(26), 5, kVocab));
  EXPECT_EQ(rig.runner->num_kv_mismatches(), 0);
  EXPECT_EQ(rig.runner->num_steps(), 5) << "one step for the last prompt token, four decode steps";
  rig.engine->shutdown();
  EXPECT_EQ(rig.engine->stats().engine.num_handed_over_tokens, 0);
  EXPECT_EQ(rig.engine->stats().num_blocks_in_use, 0);
}

TEST(EngineConnector, AHandedOverTokenThatEndsTheRequestFinishesItWithoutAStep) {
  Rig rig = make_rig(64, handover_match());
  Outputs out;
  ASSERT_TRUE(rig.engine->add_request(pd_request("c", 26, 1), out.callback()).ok());
  ASSERT_TRUE(rig.connector->wait_allocated("c"));
  rig.connector->deliver_with_token("c", 11);
  ASSERT_TRUE(out.wait_finished("c"));
  EXPECT_EQ(out.tokens("c"), std::vector<int32_t>{11});
  EXPECT_EQ(out.last("c").finish_reason, FinishReason::kLength);
  EXPECT_EQ(rig.runner->num_steps(), 0);
  rig.engine->shutdown();
  EXPECT_EQ(rig.engine->stats().num_blocks_in_use, 0);
  EXPECT_EQ(rig.engine->stats().num_blocks_free, 64);
}

// A runner whose steps wait at a gate the test opens one step at a time, so
// the test knows which step is in flight when something arrives.
class GatedRunner : public PagedKvTestRunner {
 public:
  using PagedKvTestRunner::PagedKvTestRunner;
  Result<StepOutput> execute(const StepInput& input) override {
    {
      std::unique_lock lock(mutex_);
      const int64_t mine = ++num_started_;
      cv_.notify_all();
      if (!cv_.wait_until(lock, Deadline::after_ms(20'000).when(), [&] { return num_released_ >= mine; })) {
        return internal_error("gate never opened for step {}", mine);
      }
    }
    return PagedKvTestRunner::execute(input);
  }
  int64_t num_started() {
    std::lock_guard lock(mutex_);
    return num_started_;
  }
  bool wait_started(int64_t n) {
    std::unique_lock lock(mutex_);
    return cv_.wait_until(lock, Deadline::after_ms(20'000).when(), [&] { return num_started_ >= n; });
  }
  void release(int64_t n) {
    std::lock_guard lock(mutex_);
    num_released_ += n;
    cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  int64_t num_started_ = 0;
  int64_t num_released_ = 0;
};

TEST(EngineConnector, AHandedOverTokenArrivingDuringAStepIsEmittedBeforeTheNextStepStarts) {
  auto owned = std::make_unique<GatedRunner>(64, kBlockSize, kVocab);
  GatedRunner* runner = owned.get();
  auto connector = std::make_unique<LoopbackConnector>(runner);
  connector->match = handover_match();
  LoopbackConnector* conn = connector.get();
  EngineConfig config;
  config.max_num_batched_tokens = 64;
  config.max_model_len = 128;
  auto created = Engine::create(config, std::move(owned), nullptr, std::move(connector));
  ASSERT_TRUE(created.ok()) << created.status().to_string();
  std::unique_ptr<Engine> engine = std::move(created).value();

  // The steps already started when the consumer's first token reached the client.
  std::mutex mutex;
  std::optional<int64_t> steps_at_first_token;
  Outputs out;
  OutputCallback record = out.callback();
  auto on_c = [&](RequestOutput o) {
    {
      std::lock_guard lock(mutex);
      if (!steps_at_first_token && !o.new_token_ids.empty()) steps_at_first_token = runner->num_started();
    }
    record(std::move(o));
  };
  ASSERT_TRUE(engine->add_request(pd_request("c", 26, 3), on_c).ok());
  ASSERT_TRUE(conn->wait_allocated("c"));
  // Another request keeps the engine busy: its prefill is step 1, held at the gate.
  ASSERT_TRUE(engine->add_request(pd_request("busy", 20, 4, /*with_params=*/false), out.callback()).ok());
  ASSERT_TRUE(runner->wait_started(1));
  // The KV and the producer's token arrive while step 1 runs.
  const std::vector<int32_t> reference = reference_greedy(prompt_of(26), 3, kVocab);
  conn->deliver_with_token("c", reference[0]);
  runner->release(1);
  // Step 2 (the first with "c" decoding) waits at the gate; the token must be out by then.
  ASSERT_TRUE(runner->wait_started(2));
  {
    std::lock_guard lock(mutex);
    ASSERT_TRUE(steps_at_first_token.has_value()) << "the handed-over token waited for a later step";
    EXPECT_EQ(*steps_at_first_token, 1) << "emitted after the step in flight, before the next one";
  }
  runner->release(100);
  ASSERT_TRUE(out.wait_finished("c"));
  ASSERT_TRUE(out.wait_finished("busy"));
  EXPECT_EQ(out.tokens("c"), reference);
  EXPECT_EQ(out.tokens("busy"), reference_greedy(prompt_of(20), 4, kVocab));
  engine->shutdown();
  EXPECT_EQ(engine->stats().num_blocks_in_use, 0);
}

TEST(EngineConnector, AHandedOverTokenIsStreamedWhileTheStepInFlightStillRuns) {
  auto owned = std::make_unique<GatedRunner>(64, kBlockSize, kVocab);
  GatedRunner* runner = owned.get();
  auto connector = std::make_unique<LoopbackConnector>(runner);
  connector->match = handover_match();
  LoopbackConnector* conn = connector.get();
  EngineConfig config;
  config.max_num_batched_tokens = 64;
  config.max_model_len = 128;
  auto created = Engine::create(config, std::move(owned), nullptr, std::move(connector));
  ASSERT_TRUE(created.ok()) << created.status().to_string();
  std::unique_ptr<Engine> engine = std::move(created).value();

  Outputs out;
  ASSERT_TRUE(engine->add_request(pd_request("c", 26, 4), out.callback()).ok());
  ASSERT_TRUE(conn->wait_allocated("c"));
  // Another request's prefill is step 1, held at the gate: the engine thread is busy.
  ASSERT_TRUE(engine->add_request(pd_request("busy", 20, 3, /*with_params=*/false), out.callback()).ok());
  ASSERT_TRUE(runner->wait_started(1));
  const std::vector<int32_t> reference = reference_greedy(prompt_of(26), 4, kVocab);
  conn->stream_then_deliver("c", reference[0]);
  // The gate stays shut until the token is out: it must not wait for step 1.
  const bool streamed = out.wait_first_token("c", 10'000);
  EXPECT_EQ(runner->num_started(), 1);
  runner->release(100);
  ASSERT_TRUE(streamed) << "the handed-over token waited for the step in flight";
  ASSERT_TRUE(out.wait_finished("c"));
  ASSERT_TRUE(out.wait_finished("busy"));
  EXPECT_EQ(out.tokens("c"), reference) << "streamed once, then decoding continued from it";
  EXPECT_EQ(out.last("c").num_output_tokens, 4);
  EXPECT_EQ(out.tokens("busy"), reference_greedy(prompt_of(20), 3, kVocab));
  engine->shutdown();
  EXPECT_EQ(engine->stats().engine.num_handed_over_tokens, 1);
  EXPECT_EQ(engine->stats().num_first_tokens_streamed_on_arrival, 1);
  EXPECT_EQ(engine->stats().num_blocks_in_use, 0);
}

TEST(EngineConnector, AStreamedTokenForARequestAlreadyFinishedIsDropped) {
  Rig rig = make_rig(64, handover_match());
  Outputs out;
  ASSERT_TRUE(rig.engine->add_request(pd_request("c", 26, 4), out.callback()).ok());
  ASSERT_TRUE(rig.connector->wait_allocated("c"));
  rig.engine->abort("c");
  ASSERT_TRUE(out.wait_finished("c"));
  rig.connector->stream_then_deliver("c", 5);
  ASSERT_TRUE(rig.connector->wait_drained());
  EXPECT_TRUE(out.tokens("c").empty()) << "nothing follows a final output";
  EXPECT_EQ(out.last("c").finish_reason, FinishReason::kAbort);
  rig.engine->shutdown();
  EXPECT_EQ(rig.engine->stats().num_first_tokens_streamed_on_arrival, 0);
}

TEST(EngineConnector, AStreamedTokenThatWouldEndTheRequestIsLeftToTheEngineThread) {
  Rig rig = make_rig(64, handover_match());
  Outputs out;
  ASSERT_TRUE(rig.engine->add_request(pd_request("c", 26, 1), out.callback()).ok());
  ASSERT_TRUE(rig.connector->wait_allocated("c"));
  rig.connector->stream_then_deliver("c", 11);
  ASSERT_TRUE(out.wait_finished("c"));
  EXPECT_EQ(out.tokens("c"), std::vector<int32_t>{11});
  EXPECT_EQ(out.last("c").finish_reason, FinishReason::kLength);
  EXPECT_EQ(out.last("c").new_token_ids, std::vector<int32_t>{11}) << "one output, the final one, carries it";
  rig.engine->shutdown();
  EXPECT_EQ(rig.engine->stats().num_first_tokens_streamed_on_arrival, 0);
  EXPECT_EQ(rig.engine->stats().num_blocks_in_use, 0);
}

// A producer request never receives a producer's token: it has no slot, so a
// token named for it is not streamed (its own engine samples it).
TEST(EngineConnector, NoFirstTokenIsStreamedForAProducerRequest) {
  Rig rig = make_rig(64, ExternalMatch{});
  Outputs out;
  GenerateRequest p = pd_request("p", 26, 3);
  p.kv_transfer_params->side = contract::TransferSide::kProducer;
  rig.runner->hold_at_step(0);
  ASSERT_TRUE(rig.engine->add_request(p, out.callback()).ok());
  ASSERT_TRUE(rig.runner->wait_blocked());
  rig.connector->stream("p", 5);
  EXPECT_TRUE(out.tokens("p").empty());
  rig.runner->release();
  ASSERT_TRUE(out.wait_finished("p"));
  EXPECT_EQ(out.tokens("p"), reference_greedy(prompt_of(26), 3, kVocab));
  rig.engine->shutdown();
  EXPECT_EQ(rig.engine->stats().num_first_tokens_streamed_on_arrival, 0);
}

// A client callback that blocks on its first call, until let go (bounded).
class BlockingFirstCall {
 public:
  OutputCallback wrap(OutputCallback inner) {
    return [this, inner = std::move(inner)](RequestOutput o) {
      {
        std::unique_lock lock(mutex_);
        if (++num_running_ > 1) overlapped_ = true;
        if (!entered_) {
          entered_ = true;
          cv_.notify_all();
          cv_.wait_until(lock, Deadline::after_ms(20'000).when(), [&] { return let_go_; });
        }
      }
      inner(std::move(o));
      std::lock_guard lock(mutex_);
      --num_running_;
    };
  }
  bool wait_entered() {
    std::unique_lock lock(mutex_);
    return cv_.wait_until(lock, Deadline::after_ms(20'000).when(), [&] { return entered_; });
  }
  void let_go() {
    std::lock_guard lock(mutex_);
    let_go_ = true;
    cv_.notify_all();
  }
  bool overlapped() {
    std::lock_guard lock(mutex_);
    return overlapped_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool entered_ = false;
  bool let_go_ = false;
  int32_t num_running_ = 0;
  bool overlapped_ = false;
};

TEST(EngineConnector, AStreamingCallbackStillRunningHoldsUpNoOtherRequest) {
  Rig rig = make_rig(64, handover_match());
  Outputs out;
  BlockingFirstCall slow;
  ASSERT_TRUE(rig.engine->add_request(pd_request("c", 26, 3), slow.wrap(out.callback())).ok());
  ASSERT_TRUE(rig.connector->wait_allocated("c"));
  const std::vector<int32_t> reference = reference_greedy(prompt_of(26), 3, kVocab);
  std::thread streamer([&] { rig.connector->stream_then_deliver("c", reference[0]); });
  ASSERT_TRUE(slow.wait_entered());
  // While the client of "c" is busy with its token: another consumer request is
  // armed on the engine thread, and a plain one is served to the end.
  ASSERT_TRUE(rig.engine->add_request(pd_request("d", 26, 2), out.callback()).ok());
  ASSERT_TRUE(rig.engine->add_request(pd_request("plain", 20, 3, /*with_params=*/false), out.callback()).ok());
  const bool plain_served = out.wait_finished("plain");
  slow.let_go();
  streamer.join();
  EXPECT_TRUE(plain_served) << "the engine thread waited for another request's streaming callback";
  ASSERT_TRUE(out.wait_finished("c"));
  EXPECT_EQ(out.tokens("c"), reference);
  rig.engine->abort("d");
  ASSERT_TRUE(out.wait_finished("d"));
  rig.engine->shutdown();
  EXPECT_EQ(rig.engine->stats().num_first_tokens_streamed_on_arrival, 1);
}

// The engine thread takes a streamed token at its poll while the client's
// callback for it still runs: it emits nothing of that request until the callback
// returned, and the token reaches the client once.
TEST(EngineConnector, TheEngineThreadWaitsForAStreamingCallbackOfTheSameRequest) {
  Rig rig = make_rig(64, handover_match());
  Outputs out;
  BlockingFirstCall slow;
  ASSERT_TRUE(rig.engine->add_request(pd_request("c", 26, 4), slow.wrap(out.callback())).ok());
  ASSERT_TRUE(rig.connector->wait_allocated("c"));
  const std::vector<int32_t> reference = reference_greedy(prompt_of(26), 4, kVocab);
  std::thread streamer([&] { rig.connector->stream("c", reference[0]); });
  ASSERT_TRUE(slow.wait_entered());
  rig.connector->deliver_with_token("c", reference[0]);
  ASSERT_TRUE(rig.connector->wait_drained());
  slow.let_go();
  streamer.join();
  ASSERT_TRUE(out.wait_finished("c"));
  EXPECT_FALSE(slow.overlapped()) << "an output of the request was delivered during its streaming callback";
  EXPECT_EQ(out.tokens("c"), reference) << "the streamed token once, then the decoded ones";
  EXPECT_EQ(out.last("c").num_output_tokens, 4);
  rig.engine->shutdown();
  EXPECT_EQ(rig.engine->stats().num_first_tokens_streamed_on_arrival, 1);
  EXPECT_EQ(rig.engine->stats().num_blocks_in_use, 0);
}

}  // namespace
}  // namespace pd::engine
