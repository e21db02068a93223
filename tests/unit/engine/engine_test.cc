#include "engine/engine.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <set>

#include "common/clock.h"
#include "common/metrics.h"
#include "paged_kv_test_runner.h"
#include "tokenizer/tokenizer.h"

namespace pd::engine {
namespace {

using testing::PagedKvTestRunner;
using testing::reference_greedy;
using testing::reference_logits;

constexpr int32_t kVocab = 300;
constexpr int64_t kWaitMs = 20'000;

// Collects every request's outputs and checks the stream protocol: in order,
// exactly one final output, nothing after it.
class Collector {
 public:
  OutputCallback callback() {
    return [this](RequestOutput out) {
      std::lock_guard lock(mutex_);
      auto& stream = outputs_[out.request_id];
      if (!stream.empty() && stream.back().finished) violations_ += "output after finish for " + out.request_id + "\n";
      if (!stream.empty() && out.num_output_tokens < stream.back().num_output_tokens) {
        violations_ += "output count went back for " + out.request_id + "\n";
      }
      const bool fin = out.finished;
      stream.push_back(std::move(out));
      if (fin) ++num_finished_;
      cv_.notify_all();
    };
  }
  bool wait_finished(size_t n, int64_t timeout_ms = kWaitMs) {
    std::unique_lock lock(mutex_);
    return cv_.wait_until(lock, Deadline::after_ms(timeout_ms).when(), [&] { return num_finished_ >= n; });
  }
  // Waits until the request has at least n output tokens (or finished).
  bool wait_tokens(const std::string& id, int32_t n) {
    std::unique_lock lock(mutex_);
    return cv_.wait_until(lock, Deadline::after_ms(kWaitMs).when(), [&] {
      auto it = outputs_.find(id);
      return it != outputs_.end() && !it->second.empty() &&
             (it->second.back().num_output_tokens >= n || it->second.back().finished);
    });
  }
  std::vector<int32_t> tokens(const std::string& id) {
    std::lock_guard lock(mutex_);
    std::vector<int32_t> all;
    for (const auto& o : outputs_[id]) all.insert(all.end(), o.new_token_ids.begin(), o.new_token_ids.end());
    return all;
  }
  std::string text(const std::string& id) {
    std::lock_guard lock(mutex_);
    std::string all;
    for (const auto& o : outputs_[id]) all += o.text_delta;
    return all;
  }
  std::vector<RequestOutput> stream(const std::string& id) {
    std::lock_guard lock(mutex_);
    return outputs_[id];
  }
  RequestOutput last(const std::string& id) {
    std::lock_guard lock(mutex_);
    return outputs_.at(id).back();
  }
  std::string violations() {
    std::lock_guard lock(mutex_);
    return violations_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<RequestOutput>> outputs_;
  size_t num_finished_ = 0;
  std::string violations_;
};

EngineConfig small_engine_config() {
  EngineConfig c;
  c.max_num_seqs = 8;
  c.max_num_batched_tokens = 64;
  c.max_model_len = 256;
  return c;
}

struct EngineUnderTest {
  PagedKvTestRunner* runner = nullptr;
  std::unique_ptr<Engine> engine;
};

EngineUnderTest make_engine(EngineConfig config, int32_t num_blocks, int32_t block_size = 4,
                            std::shared_ptr<const tokenizer::Tokenizer> tok = nullptr,
                            PagedKvTestRunner::LogitsFn logits_fn = nullptr) {
  auto runner = std::make_unique<PagedKvTestRunner>(num_blocks, block_size, kVocab, std::move(logits_fn));
  EngineUnderTest e;
  e.runner = runner.get();
  auto created = Engine::create(std::move(config), std::move(runner), std::move(tok));
  EXPECT_TRUE(created.ok()) << created.status().to_string();
  if (created.ok()) e.engine = std::move(created).value();
  return e;
}

GenerateRequest make_request(const std::string& id, std::vector<int32_t> prompt, int32_t max_tokens) {
  GenerateRequest r;
  r.request_id = id;
  r.prompt_token_ids = std::move(prompt);
  r.sampling.temperature = 0.0f;
  r.sampling.max_tokens = max_tokens;
  return r;
}

std::vector<int32_t> tokens_from(int32_t n, int32_t start) {
  std::vector<int32_t> t;
  for (int32_t i = 0; i < n; ++i) t.push_back((start + i) % kVocab);
  return t;
}

SamplingParams greedy_params_for_engine(int32_t max_tokens) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = max_tokens;
  return p;
}

// ---------------------------------------------------------------------------

TEST(Engine, ConcurrentRequestsWithSharedPrefixesAndPreemptionMatchTheReference) {
  // 40 blocks of 4 tokens for 24 requests of up to ~60 tokens: preemption is
  // certain; prompts share three prefixes: prefix hits are certain.
  auto e = make_engine(small_engine_config(), 40);
  Collector c;
  std::mt19937 rng(7);
  std::map<std::string, std::pair<std::vector<int32_t>, int32_t>> specs;
  const std::vector<std::vector<int32_t>> prefixes = {tokens_from(17, 1), tokens_from(24, 100), tokens_from(9, 200)};
  // All requests queue up before the first step completes: the load (and so
  // preemption) does not depend on thread timing.
  e.runner->hold_steps();
  for (int i = 0; i < 24; ++i) {
    std::vector<int32_t> prompt = prefixes[static_cast<size_t>(i % 3)];
    for (uint32_t k = rng() % 6; k > 0; --k) prompt.push_back(static_cast<int32_t>(rng() % kVocab));
    const int32_t max_tokens = 8 + static_cast<int32_t>(rng() % 24);
    const std::string id = "req-" + std::to_string(i);
    specs[id] = {prompt, max_tokens};
    ASSERT_TRUE(e.engine->add_request(make_request(id, prompt, max_tokens), c.callback()).ok());
  }
  e.runner->release();
  ASSERT_TRUE(c.wait_finished(specs.size()));
  for (const auto& [id, spec] : specs) {
    EXPECT_EQ(c.tokens(id), reference_greedy(spec.first, spec.second, kVocab)) << id;
    const RequestOutput last = c.last(id);
    EXPECT_TRUE(last.finished);
    EXPECT_EQ(last.finish_reason, FinishReason::kLength);
    EXPECT_EQ(last.num_output_tokens, spec.second);
    EXPECT_EQ(last.num_prompt_tokens, static_cast<int32_t>(spec.first.size()));
  }
  EXPECT_EQ(c.violations(), "");
  e.engine->shutdown();
  const EngineStats s = e.engine->stats();
  EXPECT_GT(s.scheduler.num_preemptions, 0);
  EXPECT_GT(s.scheduler.num_prefix_cache_hit_tokens, 0);
  EXPECT_EQ(s.num_blocks_free, 40);
  EXPECT_EQ(s.num_blocks_in_use, 0);
  EXPECT_EQ(s.num_running, 0);
  EXPECT_EQ(s.num_waiting, 0);
  EXPECT_EQ(e.runner->num_kv_mismatches(), 0);
}

TEST(Engine, PrefixCacheHitReusesKvAndGivesTheSameOutput) {
  auto e = make_engine(small_engine_config(), 64);
  Collector c;
  const std::vector<int32_t> prompt = tokens_from(21, 5);
  ASSERT_TRUE(e.engine->add_request(make_request("first", prompt, 6), c.callback()).ok());
  ASSERT_TRUE(c.wait_finished(1));
  ASSERT_TRUE(e.engine->add_request(make_request("second", prompt, 6), c.callback()).ok());
  ASSERT_TRUE(c.wait_finished(2));
  EXPECT_EQ(c.tokens("first"), reference_greedy(prompt, 6, kVocab));
  EXPECT_EQ(c.tokens("second"), c.tokens("first"));
  EXPECT_EQ(c.last("second").num_cached_tokens, 20) << "5 full blocks of 4 from the cache, the last token computed";
  EXPECT_EQ(c.last("first").num_cached_tokens, 0);
}

TEST(Engine, SeededSamplingIsReproducibleAcrossBatchingAndPreemption) {
  auto run = [](int32_t num_blocks, int32_t budget) {
    EngineConfig config = small_engine_config();
    config.max_num_batched_tokens = budget;
    auto e = make_engine(config, num_blocks);
    Collector c;
    e.runner->hold_steps();
    for (int i = 0; i < 6; ++i) {
      GenerateRequest r = make_request("s" + std::to_string(i), tokens_from(15 + i, 30 * i), 30);
      r.sampling.temperature = 0.9f;
      r.sampling.top_p = 0.95f;
      r.sampling.seed = 1000 + static_cast<uint64_t>(i);
      EXPECT_TRUE(e.engine->add_request(std::move(r), c.callback()).ok());
    }
    e.runner->release();
    EXPECT_TRUE(c.wait_finished(6));
    std::vector<std::vector<int32_t>> all;
    for (int i = 0; i < 6; ++i) all.push_back(c.tokens("s" + std::to_string(i)));
    e.engine->shutdown();
    return std::make_pair(all, e.engine->stats().scheduler.num_preemptions);
  };
  const auto [roomy, roomy_preemptions] = run(256, 256);
  const auto [tight, tight_preemptions] = run(30, 16);
  EXPECT_EQ(roomy_preemptions, 0);
  EXPECT_GT(tight_preemptions, 0);
  EXPECT_EQ(roomy, tight);
}

TEST(Engine, AbortMidGenerationEndsTheStreamWithAbortAndFreesItsBlocks) {
  auto e = make_engine(small_engine_config(), 64);
  Collector c;
  e.runner->hold_at_step(3);  // the engine stops inside its 4th step until release()
  ASSERT_TRUE(e.engine->add_request(make_request("long", tokens_from(10, 3), 200), c.callback()).ok());
  ASSERT_TRUE(e.runner->wait_blocked());
  e.engine->abort("long");
  e.runner->release();
  ASSERT_TRUE(c.wait_finished(1));
  const RequestOutput last = c.last("long");
  EXPECT_EQ(last.finish_reason, FinishReason::kAbort);
  EXPECT_EQ(last.num_output_tokens, 4) << "the step in flight completes, then the abort is handled";
  EXPECT_EQ(c.violations(), "");
  // Tokens before the abort are still the right ones.
  const std::vector<int32_t> got = c.tokens("long");
  const std::vector<int32_t> want = reference_greedy(tokens_from(10, 3), static_cast<int32_t>(got.size()), kVocab);
  EXPECT_EQ(got, want);
  // Aborting again, or an unknown id, is harmless; the id is reusable.
  e.engine->abort("long");
  e.engine->abort("never-existed");
  ASSERT_TRUE(e.engine->add_request(make_request("long", tokens_from(10, 3), 2), c.callback()).ok());
  ASSERT_TRUE(c.wait_finished(2));
  e.engine->shutdown();
  EXPECT_EQ(e.engine->stats().num_blocks_in_use, 0);
}

TEST(Engine, AbortOfAWaitingRequestFinishesIt) {
  EngineConfig config = small_engine_config();
  config.max_num_seqs = 1;  // b cannot run while a does
  auto e = make_engine(config, 64);
  Collector c;
  e.runner->hold_at_step(1);
  ASSERT_TRUE(e.engine->add_request(make_request("a", tokens_from(8, 1), 50), c.callback()).ok());
  ASSERT_TRUE(e.runner->wait_blocked());
  ASSERT_TRUE(e.engine->add_request(make_request("b", tokens_from(8, 50), 50), c.callback()).ok());
  e.engine->abort("b");
  e.engine->abort("a");
  e.runner->release();
  ASSERT_TRUE(c.wait_finished(2));
  EXPECT_EQ(c.last("a").finish_reason, FinishReason::kAbort);
  EXPECT_EQ(c.last("a").num_output_tokens, 2);
  EXPECT_EQ(c.last("b").finish_reason, FinishReason::kAbort);
  EXPECT_EQ(c.last("b").num_output_tokens, 0);
  EXPECT_EQ(c.stream("b").size(), 1u) << "a waiting request gets exactly its final output";
  EXPECT_EQ(c.violations(), "");
  e.engine->shutdown();
  EXPECT_EQ(e.engine->stats().num_blocks_in_use, 0);
}

TEST(Engine, ShutdownAbortsEveryLiveRequestAndJoins) {
  auto e = make_engine(small_engine_config(), 64);
  Collector c;
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(
        e.engine->add_request(make_request("r" + std::to_string(i), tokens_from(6, i), 250 - 8), c.callback()).ok());
  }
  ASSERT_TRUE(c.wait_tokens("r0", 1));
  e.engine->shutdown();
  ASSERT_TRUE(c.wait_finished(4, 0));
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(c.last("r" + std::to_string(i)).finished);
  EXPECT_EQ(e.engine->stats().num_blocks_in_use, 0);
  e.engine->shutdown();  // idempotent
  EXPECT_EQ(e.engine->add_request(make_request("late", tokens_from(4, 1), 2), c.callback()).code(),
            ErrorCode::kUnavailable);
}

TEST(Engine, RunnerErrorFailsThatStepsRequestsAndTheEngineKeepsServing) {
  auto e = make_engine(small_engine_config(), 64);
  Collector c;
  e.runner->fail_step(0);
  ASSERT_TRUE(e.engine->add_request(make_request("doomed", tokens_from(5, 1), 4), c.callback()).ok());
  ASSERT_TRUE(c.wait_finished(1));
  EXPECT_EQ(c.last("doomed").finish_reason, FinishReason::kError);
  EXPECT_NE(c.last("doomed").error.find("injected failure"), std::string::npos);
  ASSERT_TRUE(e.engine->add_request(make_request("fine", tokens_from(5, 1), 4), c.callback()).ok());
  ASSERT_TRUE(c.wait_finished(2));
  EXPECT_EQ(c.tokens("fine"), reference_greedy(tokens_from(5, 1), 4, kVocab));
  e.engine->shutdown();
  EXPECT_EQ(e.engine->stats().engine.num_step_errors, 1);
  EXPECT_EQ(e.engine->stats().num_blocks_in_use, 0);
}

TEST(Engine, InvalidRequestsAreRejectedAndNeverCallBack) {
  auto e = make_engine(small_engine_config(), 64);
  bool called = false;
  OutputCallback cb = [&called](RequestOutput) { called = true; };
  EXPECT_EQ(e.engine->add_request(make_request("", {1}, 1), cb).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(e.engine->add_request(make_request("x", {}, 1), cb).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(e.engine->add_request(make_request("x", {1, kVocab}, 1), cb).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(e.engine->add_request(make_request("x", {-1}, 1), cb).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(e.engine->add_request(make_request("x", tokens_from(256, 0), 1), cb).code(), ErrorCode::kInvalidArgument);
  GenerateRequest bad_sampling = make_request("x", {1}, 1);
  bad_sampling.sampling.top_p = 0.0f;
  EXPECT_EQ(e.engine->add_request(bad_sampling, cb).code(), ErrorCode::kInvalidArgument);
  GenerateRequest stop_without_tokenizer = make_request("x", {1}, 1);
  stop_without_tokenizer.sampling.stop = {"x"};
  EXPECT_EQ(e.engine->add_request(stop_without_tokenizer, cb).code(), ErrorCode::kInvalidArgument);
  // Never fits: 64 blocks of 4 tokens = 256 tokens is the whole cache, but max_model_len 256 needs 64: ok;
  // a 10-block cache cannot hold a request that may grow to 200 tokens.
  auto tiny = make_engine(small_engine_config(), 10);
  EXPECT_EQ(tiny.engine->add_request(make_request("x", {1}, 200), cb).code(), ErrorCode::kInvalidArgument);
  e.runner->hold_steps();
  ASSERT_TRUE(e.engine->add_request(make_request("dup", {1, 2}, 100), cb).ok());
  EXPECT_EQ(e.engine->add_request(make_request("dup", {1, 2}, 1), cb).code(), ErrorCode::kInvalidArgument);
  e.runner->release();
  e.engine->shutdown();
  EXPECT_TRUE(called) << "the accepted request got its final output";
}

// The engine thread is parked inside a step with one request running, so the
// bound alone decides: exactly max_waiting_requests more are accepted.
TEST(Engine, WaitingQueueIsBounded) {
  EngineConfig config = small_engine_config();
  config.max_waiting_requests = 3;
  auto e = make_engine(config, 64);
  Collector c;
  e.runner->hold_steps();
  ASSERT_TRUE(e.engine->add_request(make_request("q0", tokens_from(4, 0), 2), c.callback()).ok());
  ASSERT_TRUE(e.runner->wait_blocked());
  size_t accepted = 1;
  for (int i = 1; i < 12; ++i) {
    const Status s = e.engine->add_request(make_request("q" + std::to_string(i), tokens_from(4, i), 2), c.callback());
    if (i <= 3) {
      EXPECT_TRUE(s.ok()) << "q" << i << ": " << s.to_string();
    } else {
      EXPECT_EQ(s.code(), ErrorCode::kResourceExhausted) << "q" << i;
    }
    accepted += s.ok();
  }
  e.runner->release();
  ASSERT_TRUE(c.wait_finished(accepted));
}

// Requests the engine thread took from its inbox into the scheduler's queue stay
// counted while the next step runs: the bound covers what waits there too.
TEST(Engine, TheWaitingBoundCountsRequestsTakenIntoTheSchedulerWhileAStepRuns) {
  EngineConfig config = small_engine_config();
  config.max_num_seqs = 1;
  config.max_waiting_requests = 3;
  auto e = make_engine(config, 64);
  Collector c;
  e.runner->hold_at_step(0);
  ASSERT_TRUE(e.engine->add_request(make_request("run", tokens_from(4, 0), 8), c.callback()).ok());
  ASSERT_TRUE(e.runner->wait_blocked_in_step(0));
  for (int i = 1; i <= 3; ++i) {
    ASSERT_TRUE(e.engine->add_request(make_request("w" + std::to_string(i), tokens_from(4, i), 2), c.callback()).ok());
  }
  EXPECT_EQ(e.engine->add_request(make_request("over", tokens_from(4, 9), 2), c.callback()).code(),
            ErrorCode::kResourceExhausted);
  // Step 0 ends; the next iteration moves w1..w3 into the scheduler (max_num_seqs 1:
  // they wait behind "run") and holds in step 1.
  e.runner->hold_at_step(1);
  ASSERT_TRUE(e.runner->wait_blocked_in_step(1));
  EXPECT_EQ(e.engine->add_request(make_request("later", tokens_from(4, 10), 2), c.callback()).code(),
            ErrorCode::kResourceExhausted)
      << "three requests wait in the scheduler";
  e.runner->release();
  ASSERT_TRUE(c.wait_finished(4));
  EXPECT_EQ(c.violations(), "");
}

TEST(Engine, MaxModelLenFinishesWithLength) {
  EngineConfig config = small_engine_config();
  config.max_model_len = 12;
  auto e = make_engine(config, 64);
  Collector c;
  ASSERT_TRUE(e.engine->add_request(make_request("a", tokens_from(9, 1), 100), c.callback()).ok());
  ASSERT_TRUE(c.wait_finished(1));
  EXPECT_EQ(c.last("a").finish_reason, FinishReason::kLength);
  EXPECT_EQ(c.tokens("a").size(), 3u);
}

TEST(Engine, LogprobsAccompanyEveryToken) {
  auto e = make_engine(small_engine_config(), 64);
  Collector c;
  GenerateRequest r = make_request("lp", tokens_from(7, 1), 4);
  r.sampling.logprobs = 3;
  ASSERT_TRUE(e.engine->add_request(r, c.callback()).ok());
  ASSERT_TRUE(c.wait_finished(1));
  for (const RequestOutput& o : c.stream("lp")) {
    ASSERT_EQ(o.logprobs.size(), o.new_token_ids.size());
    for (size_t i = 0; i < o.logprobs.size(); ++i) {
      EXPECT_EQ(o.logprobs[i].token_id, o.new_token_ids[i]);
      ASSERT_EQ(o.logprobs[i].top.size(), 3u);
      EXPECT_EQ(o.logprobs[i].top[0].token_id, o.new_token_ids[i]) << "greedy picks the most likely token";
      EXPECT_FLOAT_EQ(o.logprobs[i].top[0].logprob, o.logprobs[i].logprob);
    }
  }
}

// The engine's prompt logprobs for one prompt: entry i is the reference model's
// distribution after prompt[0..i], taken at prompt[i + 1].
std::vector<PromptPositionLogprobs> reference_prompt_logprobs(const std::vector<int32_t>& prompt, int32_t k) {
  std::vector<PromptPositionLogprobs> out;
  for (size_t i = 0; i + 1 < prompt.size(); ++i) {
    const std::vector<int32_t> context(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(i) + 1);
    out.push_back(prompt_position_logprobs(reference_logits(context, kVocab), prompt[i + 1], k));
  }
  return out;
}

void expect_prompt_logprobs(const RequestOutput& first, const std::vector<int32_t>& prompt, int32_t k) {
  const auto want = reference_prompt_logprobs(prompt, k);
  ASSERT_EQ(first.prompt_logprobs.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const PromptTokenLogprob& got = first.prompt_logprobs[i];
    EXPECT_EQ(got.token_id, want[i].token_id) << "position " << i;
    EXPECT_FLOAT_EQ(got.logprob, want[i].logprob) << "position " << i;
    EXPECT_EQ(got.rank, want[i].rank) << "position " << i;
    ASSERT_EQ(got.top.size(), static_cast<size_t>(k));
    for (size_t j = 0; j < got.top.size(); ++j) EXPECT_EQ(got.top[j].token_id, want[i].top_logprobs[j].first);
  }
}

// A 150-token prompt in 64-token chunks, twice: the second request finds the
// first one's blocks cached but reads none of them, and both get every position.
TEST(EnginePromptLogprobs, ComeWithTheFirstTokenAcrossChunksAndIgnoreThePrefixCache) {
  auto e = make_engine(small_engine_config(), 128);
  Collector c;
  const std::vector<int32_t> prompt = tokens_from(150, 3);
  for (const char* id : {"p1", "p2"}) {
    GenerateRequest r = make_request(id, prompt, 3);
    r.sampling.prompt_logprobs = 2;
    ASSERT_TRUE(e.engine->add_request(r, c.callback()).ok());
    ASSERT_TRUE(c.wait_finished(id == std::string("p1") ? 1 : 2));
    const std::vector<RequestOutput> stream = c.stream(id);
    expect_prompt_logprobs(stream.front(), prompt, 2);
    for (size_t i = 1; i < stream.size(); ++i) EXPECT_TRUE(stream[i].prompt_logprobs.empty()) << "sent once";
    EXPECT_EQ(c.tokens(id), reference_greedy(prompt, 3, kVocab));
    EXPECT_EQ(stream.back().num_cached_tokens, 0) << "no prefix hit";
  }
  e.engine->shutdown();
  EXPECT_EQ(e.runner->num_kv_mismatches(), 0);
  EXPECT_EQ(e.engine->stats().scheduler.num_prefix_cache_hit_tokens, 0);
}

TEST(EnginePromptLogprobs, ARequestWithoutThemHasNoneAndHitsTheCache) {
  auto e = make_engine(small_engine_config(), 128);
  Collector c;
  const std::vector<int32_t> prompt = tokens_from(40, 3);
  ASSERT_TRUE(e.engine->add_request(make_request("a", prompt, 2), c.callback()).ok());
  ASSERT_TRUE(c.wait_finished(1));
  ASSERT_TRUE(e.engine->add_request(make_request("b", prompt, 2), c.callback()).ok());
  ASSERT_TRUE(c.wait_finished(2));
  for (const char* id : {"a", "b"})
    for (const RequestOutput& o : c.stream(id)) EXPECT_TRUE(o.prompt_logprobs.empty());
  EXPECT_GT(c.last("b").num_cached_tokens, 0);
}

TEST(EnginePromptLogprobs, ARunnerThatLeavesThemOutFailsTheStepsRequests) {
  auto e = make_engine(small_engine_config(), 64);
  Collector c;
  e.runner->drop_prompt_logprobs();
  GenerateRequest r = make_request("short", tokens_from(9, 1), 2);
  r.sampling.prompt_logprobs = 0;
  ASSERT_TRUE(e.engine->add_request(r, c.callback()).ok());
  ASSERT_TRUE(c.wait_finished(1));
  EXPECT_EQ(c.last("short").finish_reason, FinishReason::kError);
  EXPECT_NE(c.last("short").error.find("prompt logprobs"), std::string::npos) << c.last("short").error;
  ASSERT_TRUE(e.engine->add_request(make_request("plain", tokens_from(9, 1), 2), c.callback()).ok());
  ASSERT_TRUE(c.wait_finished(2));
  EXPECT_EQ(c.tokens("plain"), reference_greedy(tokens_from(9, 1), 2, kVocab));
}

TEST(Engine, MetricsAreExported) {
  auto e = make_engine(small_engine_config(), 64);
  Collector c;
  ASSERT_TRUE(e.engine->add_request(make_request("m", tokens_from(7, 1), 3), c.callback()).ok());
  ASSERT_TRUE(c.wait_finished(1));
  e.engine->shutdown();
  const std::string text = metrics::Registry::global().render_prometheus();
  for (const char* name :
       {"pd_num_requests_running", "pd_num_requests_waiting", "pd_kv_blocks_used", "pd_kv_blocks_free",
        "pd_prompt_tokens_total", "pd_generation_tokens_total", "pd_time_to_first_token_seconds_bucket",
        "pd_inter_token_latency_seconds_bucket", "pd_preemptions_total", "pd_prefix_cache_hit_tokens_total",
        "pd_recomputed_tokens_total", "pd_remote_admissions_deferred_total", "pd_num_requests_waiting_for_remote_kv"}) {
    EXPECT_NE(text.find(name), std::string::npos) << name;
  }
}

// The value of one rendered series ("name{labels} value"), or -1 when absent.
double series_value(const std::string& text, const std::string& series) {
  const std::string prefix = series + " ";
  for (size_t at = text.find(prefix); at != std::string::npos; at = text.find(prefix, at + 1)) {
    if (at == 0 || text[at - 1] == '\n') return std::stod(text.substr(at + prefix.size()));
  }
  return -1.0;
}

TEST(Engine, VllmSeriesCountAFinishedRequestUnderItsModelName) {
  EngineConfig config = small_engine_config();
  config.model_name = "vllm-series-test";
  auto e = make_engine(config, 64);
  Collector c;
  ASSERT_TRUE(e.engine->add_request(make_request("v", tokens_from(7, 1), 3), c.callback()).ok());
  ASSERT_TRUE(c.wait_finished(1));
  e.engine->shutdown();
  const std::string text = metrics::Registry::global().render_prometheus();
  const std::string m = R"(model_name="vllm-series-test")";
  EXPECT_EQ(series_value(text, "vllm:request_success_total{" + m + R"(,finished_reason="length"})"), 1.0) << text;
  EXPECT_EQ(series_value(text, "vllm:request_success_total{" + m + R"(,finished_reason="stop"})"), 0.0);
  EXPECT_EQ(series_value(text, "vllm:prompt_tokens_total{" + m + "}"), 7.0);
  EXPECT_EQ(series_value(text, "vllm:generation_tokens_total{" + m + "}"), 3.0);
  EXPECT_EQ(series_value(text, "vllm:request_prompt_tokens_sum{" + m + "}"), 7.0);
  EXPECT_EQ(series_value(text, "vllm:request_generation_tokens_sum{" + m + "}"), 3.0);
  EXPECT_EQ(series_value(text, "vllm:request_generation_tokens_bucket{" + m + R"(,le="2"})"), 0.0);
  EXPECT_EQ(series_value(text, "vllm:request_generation_tokens_bucket{" + m + R"(,le="5"})"), 1.0);
  for (const char* histogram :
       {"vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
        "vllm:request_time_per_output_token_seconds"}) {
    EXPECT_EQ(series_value(text, std::string(histogram) + "_count{" + m + "}"), 1.0) << histogram;
    EXPECT_GE(series_value(text, std::string(histogram) + "_sum{" + m + "}"), 0.0) << histogram;
  }
  EXPECT_EQ(series_value(text, "vllm:inter_token_latency_seconds_count{" + m + "}"), 2.0);
  EXPECT_EQ(series_value(text, "vllm:time_per_output_token_seconds_count{" + m + "}"), 2.0);
  EXPECT_EQ(series_value(text, "vllm:num_requests_running{" + m + "}"), 0.0);
  EXPECT_EQ(series_value(text, "vllm:num_requests_waiting{" + m + "}"), 0.0);
  EXPECT_GE(series_value(text, "vllm:kv_cache_usage_perc{" + m + "}"), 0.0);
  EXPECT_EQ(series_value(text, "vllm:num_preemptions_total{" + m + "}"), 0.0);
}

// The counters' one owner is the engine (or its scheduler); stats() and /metrics
// show the same counts, already when the request's final output arrives.
TEST(Engine, CountersOfAFinishedRequestAreInStatsAndMetricsWithItsFinalOutput) {
  EngineConfig config = small_engine_config();
  config.model_name = "counters-test";
  auto e = make_engine(config, 64);
  const std::string m = R"({model_name="counters-test"})";
  const std::string before = metrics::Registry::global().render_prometheus();
  Collector c;
  ASSERT_TRUE(e.engine->add_request(make_request("a", tokens_from(7, 1), 3), c.callback()).ok());
  ASSERT_TRUE(c.wait_finished(1));
  ASSERT_TRUE(e.engine->add_request(make_request("b", tokens_from(7, 1), 2), c.callback()).ok());
  ASSERT_TRUE(c.wait_finished(2));
  const std::string text = metrics::Registry::global().render_prometheus();
  const EngineStats s = e.engine->stats();
  EXPECT_EQ(s.engine.num_prompt_tokens, 14);
  EXPECT_EQ(s.engine.num_generation_tokens, 5);
  EXPECT_GE(s.engine.num_steps, 4);
  EXPECT_EQ(s.engine.num_step_errors, 0);
  EXPECT_EQ(s.scheduler.num_preemptions, 0);
  // "b" repeats "a"'s prompt: its one full block (block size 4) comes from the prefix cache.
  EXPECT_EQ(s.scheduler.num_prefix_cache_hit_tokens, 4);
  auto delta = [&](const std::string& series) {
    return series_value(text, series) - std::max(0.0, series_value(before, series));
  };
  EXPECT_EQ(delta("pd_prompt_tokens_total"), 14.0);
  EXPECT_EQ(delta("pd_generation_tokens_total"), 5.0);
  EXPECT_EQ(delta("pd_prefix_cache_hit_tokens_total"), 4.0);
  EXPECT_EQ(delta("pd_preemptions_total"), 0.0);
  EXPECT_EQ(series_value(text, "vllm:prompt_tokens_total" + m), 14.0);
  EXPECT_EQ(series_value(text, "vllm:generation_tokens_total" + m), 5.0);
  EXPECT_EQ(series_value(text, "vllm:num_requests_running" + m), 0.0);
}

TEST(Engine, AbortedRequestCountsUnderFinishedReasonAbort) {
  EngineConfig config = small_engine_config();
  config.model_name = "vllm-abort-test";
  auto e = make_engine(config, 64);
  Collector c;
  ASSERT_TRUE(e.engine->add_request(make_request("a", tokens_from(7, 1), 200), c.callback()).ok());
  e.engine->abort("a");
  ASSERT_TRUE(c.wait_finished(1));
  e.engine->shutdown();
  const std::string text = metrics::Registry::global().render_prometheus();
  EXPECT_EQ(series_value(text, R"(vllm:request_success_total{model_name="vllm-abort-test",finished_reason="abort"})"),
            1.0)
      << text;
}

// A model whose logits never change: token 5 first, then 6, then 7 (by a
// margin of 1 each). What comes out depends only on the logits processing.
PagedKvTestRunner::LogitsFn fixed_preferences() {
  return [](std::span<const int32_t>, int32_t vocab) {
    std::vector<float> logits(static_cast<size_t>(vocab), 0.0f);
    logits[5] = 3.0f;
    logits[6] = 2.0f;
    logits[7] = 1.0f;
    return logits;
  };
}

std::vector<int32_t> run_processed(SamplingParams sampling, std::vector<int32_t> prompt = {1, 2, 3}) {
  auto e = make_engine(small_engine_config(), 64, 4, nullptr, fixed_preferences());
  Collector c;
  GenerateRequest r = make_request("p", std::move(prompt), sampling.max_tokens);
  r.sampling = std::move(sampling);
  EXPECT_TRUE(e.engine->add_request(std::move(r), c.callback()).ok());
  EXPECT_TRUE(c.wait_finished(1));
  return c.tokens("p");
}

TEST(EngineLogitsProcessing, PenaltiesSeeTheTokensGeneratedSoFar) {
  SamplingParams p = greedy_params_for_engine(4);
  EXPECT_EQ(run_processed(p), (std::vector<int32_t>{5, 5, 5, 5}));
  p.presence_penalty = 1.5f;  // 5 generated: 1.5 < 2 -> 6; both generated: 5 (1.5) beats 7 (1) and 6 (0.5)
  EXPECT_EQ(run_processed(p), (std::vector<int32_t>{5, 6, 5, 5}));
  p = greedy_params_for_engine(4);
  p.frequency_penalty = 0.6f;  // 5: 3, 2.4, 1.8 (< 2 -> 6), ...
  EXPECT_EQ(run_processed(p), (std::vector<int32_t>{5, 5, 6, 5}));
}

TEST(EngineLogitsProcessing, RepetitionPenaltyCountsThePrompt) {
  SamplingParams p = greedy_params_for_engine(2);
  p.repetition_penalty = 2.0f;  // 5 in the prompt: 1.5 < 2 -> 6 first; then 6 generated: 1 < 1.5 -> 5
  EXPECT_EQ(run_processed(p, {5, 9}), (std::vector<int32_t>{6, 5}));
}

TEST(EngineLogitsProcessing, BiasAllowedIdsAndBadWordsReachTheSampler) {
  SamplingParams p = greedy_params_for_engine(3);
  p.logit_bias = {{9, 10.0f}};
  EXPECT_EQ(run_processed(p), (std::vector<int32_t>{9, 9, 9}));
  p = greedy_params_for_engine(3);
  p.allowed_token_ids = {7, 11};
  EXPECT_EQ(run_processed(p), (std::vector<int32_t>{7, 7, 7}));
  p = greedy_params_for_engine(3);
  p.bad_words_token_ids = {{5, 5}};  // 5 may not follow 5
  EXPECT_EQ(run_processed(p), (std::vector<int32_t>{5, 6, 5}));
}

TEST(EngineLogitsProcessing, MinTokensHoldsBackAStopIdThatTheBiasFavours) {
  SamplingParams p = greedy_params_for_engine(6);
  p.stop_token_ids = {9};
  p.logit_bias = {{9, 10.0f}};
  p.min_tokens = 3;
  auto tokens = run_processed(p);
  EXPECT_EQ(tokens, (std::vector<int32_t>{5, 5, 5, 9}));
}

// --- text, stop strings, EOS: a byte-level tokenizer (token id = byte) ------

// GPT-2's byte-to-unicode table, so vocab.json can map every byte to its id.
std::string byte_level_char(int b) {
  int code = b;
  if (!((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255))) {
    int n = 0;
    for (int x = 0; x < b; ++x) {
      if (!((x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255))) ++n;
    }
    code = 256 + n;
  }
  std::string s;
  if (code < 0x80) {
    s += static_cast<char>(code);
  } else {
    s += static_cast<char>(0xC0 | (code >> 6));
    s += static_cast<char>(0x80 | (code & 0x3F));
  }
  return s;
}

constexpr int32_t kEos = 256;

std::shared_ptr<const tokenizer::Tokenizer> byte_tokenizer() {
  static std::shared_ptr<const tokenizer::Tokenizer> tok = [] {
    const auto dir = std::filesystem::temp_directory_path() / ("pd_engine_test_tok_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    nlohmann::json vocab = nlohmann::json::object();
    for (int b = 0; b < 256; ++b) vocab[byte_level_char(b)] = b;
    std::ofstream(dir / "vocab.json") << vocab.dump();
    std::ofstream(dir / "merges.txt") << "#version: 0.2\n";
    nlohmann::json config = {{"eos_token", "<|end|>"},
                             {"added_tokens_decoder", {{"256", {{"content", "<|end|>"}, {"special", true}}}}}};
    std::ofstream(dir / "tokenizer_config.json") << config.dump();
    auto loaded = tokenizer::Tokenizer::load(dir);
    std::filesystem::remove_all(dir);
    EXPECT_TRUE(loaded.ok()) << loaded.status().to_string();
    return loaded.ok() ? std::shared_ptr<const tokenizer::Tokenizer>(loaded.value()) : nullptr;
  }();
  return tok;
}

// A "model" that spells `script` after the prompt (then repeats its last
// byte), still reading the context back from the paged cache.
PagedKvTestRunner::LogitsFn spell(std::string script, int32_t prompt_len) {
  return [script, prompt_len](std::span<const int32_t> context, int32_t vocab) {
    std::vector<float> logits(static_cast<size_t>(vocab), 0.0f);
    const size_t i = std::min(context.size() - static_cast<size_t>(prompt_len), script.size() - 1);
    const int32_t want = script[i] == '$' ? kEos : static_cast<unsigned char>(script[i]);
    logits[static_cast<size_t>(want)] = 10.0f;
    return logits;
  };
}

struct TextRun {
  std::vector<RequestOutput> stream;
  std::string text;
  RequestOutput last;
};

TextRun run_text(const std::string& script, SamplingParams sampling) {
  const std::vector<int32_t> prompt = {'>', ' '};
  auto e = make_engine(small_engine_config(), 64, 4, byte_tokenizer(), spell(script, 2));
  Collector c;
  GenerateRequest r = make_request("t", prompt, sampling.max_tokens);
  r.sampling = std::move(sampling);
  EXPECT_TRUE(e.engine->add_request(std::move(r), c.callback()).ok());
  EXPECT_TRUE(c.wait_finished(1));
  EXPECT_EQ(c.violations(), "");
  return TextRun{c.stream("t"), c.text("t"), c.last("t")};
}

SamplingParams greedy(int32_t max_tokens) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.max_tokens = max_tokens;
  return p;
}

TEST(EngineText, TextDeltasConcatenateToTheDecodedOutput) {
  TextRun run = run_text("Hello, world", greedy(12));
  EXPECT_EQ(run.text, "Hello, world");
  EXPECT_EQ(run.last.finish_reason, FinishReason::kLength);
}

TEST(EngineText, StopStringTruncatesTheOutput) {
  SamplingParams p = greedy(30);
  p.stop = {"lo W"};
  TextRun run = run_text("Hello World and more", p);
  EXPECT_EQ(run.text, "Hel");
  EXPECT_EQ(run.last.finish_reason, FinishReason::kStop);
  EXPECT_EQ(run.last.stop_string, std::optional<std::string>("lo W"));
}

TEST(EngineText, StopStringIncludedWhenAskedFor) {
  SamplingParams p = greedy(30);
  p.stop = {"lo W"};
  p.include_stop_str_in_output = true;
  TextRun run = run_text("Hello World and more", p);
  EXPECT_EQ(run.text, "Hello W");
}

TEST(EngineText, PossibleStopPrefixIsHeldBackUntilResolved) {
  SamplingParams p = greedy(12);
  p.stop = {"World"};
  TextRun run = run_text("Hello Wonder", p);
  EXPECT_EQ(run.text, "Hello Wonder");
  EXPECT_EQ(run.last.finish_reason, FinishReason::kLength);
  // When "W" and "Wo" were generated they could start "World": not emitted yet.
  std::string so_far;
  for (const RequestOutput& o : run.stream) {
    so_far += o.text_delta;
    if (o.num_output_tokens == 7 || o.num_output_tokens == 8) {
      EXPECT_EQ(so_far, "Hello ");
    }
  }
}

TEST(EngineText, EosStopsAndItsTextIsNotShown) {
  TextRun run = run_text("ab$cd", greedy(10));
  EXPECT_EQ(run.text, "ab");
  EXPECT_EQ(run.last.finish_reason, FinishReason::kStop);
  EXPECT_EQ(run.last.num_output_tokens, 3);
  EXPECT_FALSE(run.last.stop_token_id.has_value());
}

TEST(EngineText, IgnoreEosRunsToMaxTokens) {
  SamplingParams p = greedy(5);
  p.ignore_eos = true;
  TextRun run = run_text("ab$cd", p);
  EXPECT_EQ(run.last.finish_reason, FinishReason::kLength);
  EXPECT_EQ(run.last.num_output_tokens, 5);
}

TEST(EngineText, MinTokensSuppressesEos) {
  SamplingParams p = greedy(6);
  p.min_tokens = 4;
  TextRun run = run_text("ab$$$$$$", p);
  std::vector<int32_t> tokens;
  for (const auto& o : run.stream) tokens.insert(tokens.end(), o.new_token_ids.begin(), o.new_token_ids.end());
  ASSERT_GE(tokens.size(), 5u);
  for (size_t i = 0; i < 4; ++i) EXPECT_NE(tokens[i], kEos) << "position " << i;
  EXPECT_EQ(tokens[4], kEos);
  EXPECT_EQ(run.last.finish_reason, FinishReason::kStop);
}

TEST(EngineText, StopTokenIdEndsTheRequestAndIsReported) {
  SamplingParams p = greedy(10);
  p.stop_token_ids = {'x'};
  TextRun run = run_text("abxcd", p);
  EXPECT_EQ(run.text, "ab");
  EXPECT_EQ(run.last.finish_reason, FinishReason::kStop);
  EXPECT_EQ(run.last.stop_token_id, std::optional<int32_t>('x'));
}

}  // namespace
}  // namespace pd::engine
