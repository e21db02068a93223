// The engine with structured-output constraints (engine/token_constraint.h): each constrained row
// is sampled under its mask, every taken token advances the constraint, the request ends when the
// constraint allows only the end, and a failing constraint ends only its own request.
#include <gtest/gtest.h>

#include <condition_variable>
#include <map>
#include <mutex>

#include "common/clock.h"
#include "engine/engine.h"
#include "engine/token_constraint.h"
#include "paged_kv_test_runner.h"

namespace pd::engine {
namespace {

using testing::PagedKvTestRunner;
using testing::reference_greedy;

constexpr int32_t kVocab = 300;
constexpr int64_t kWaitMs = 20'000;

// Allows exactly one scripted token at each position; finished after the script.
class ScriptConstraint final : public TokenConstraint {
 public:
  explicit ScriptConstraint(std::vector<int32_t> script, int32_t fail_mask_at = -1)
      : script_(std::move(script)), fail_mask_at_(fail_mask_at) {}
  Status fill_allowed_mask(std::span<uint32_t> words) override {
    if (static_cast<int32_t>(next_) == fail_mask_at_) return internal_error("mask failed at {}", next_);
    std::fill(words.begin(), words.end(), 0u);
    const int32_t id = script_.at(next_);
    words[static_cast<size_t>(id) / 32] |= 1u << (id % 32);
    ++num_masks_;
    return Status::Ok();
  }
  Status consume_token(int32_t token_id) override {
    if (next_ >= script_.size() || token_id != script_[next_])
      return invalid_argument("token {} is not the scripted one", token_id);
    ++next_;
    return Status::Ok();
  }
  bool is_finished() const override { return next_ == script_.size(); }
  int32_t num_masks() const { return num_masks_; }

 private:
  std::vector<int32_t> script_;
  int32_t fail_mask_at_;
  size_t next_ = 0;
  int32_t num_masks_ = 0;
};

class Outputs {
 public:
  OutputCallback callback() {
    return [this](RequestOutput out) {
      std::lock_guard lock(mutex_);
      if (out.finished) ++num_finished_;
      outputs_[out.request_id].push_back(std::move(out));
      cv_.notify_all();
    };
  }
  bool wait_finished(size_t n) {
    std::unique_lock lock(mutex_);
    return cv_.wait_until(lock, Deadline::after_ms(kWaitMs).when(), [&] { return num_finished_ >= n; });
  }
  std::vector<int32_t> tokens(const std::string& id) {
    std::lock_guard lock(mutex_);
    std::vector<int32_t> all;
    for (const auto& o : outputs_[id]) all.insert(all.end(), o.new_token_ids.begin(), o.new_token_ids.end());
    return all;
  }
  RequestOutput last(const std::string& id) {
    std::lock_guard lock(mutex_);
    return outputs_.at(id).back();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<RequestOutput>> outputs_;
  size_t num_finished_ = 0;
};

std::unique_ptr<Engine> make_engine() {
  EngineConfig c;
  c.max_num_seqs = 8;
  c.max_num_batched_tokens = 64;
  c.max_model_len = 256;
  auto created = Engine::create(std::move(c), std::make_unique<PagedKvTestRunner>(64, 4, kVocab), nullptr);
  EXPECT_TRUE(created.ok()) << created.status().to_string();
  return created.ok() ? std::move(created).value() : nullptr;
}

GenerateRequest request(const std::string& id, std::vector<int32_t> prompt, int32_t max_tokens,
                        std::shared_ptr<TokenConstraint> constraint = nullptr) {
  GenerateRequest r;
  r.request_id = id;
  r.prompt_token_ids = std::move(prompt);
  r.sampling.temperature = 0.0f;
  r.sampling.max_tokens = max_tokens;
  r.constraint = std::move(constraint);
  return r;
}

TEST(EngineConstraint, SamplesOnlyAllowedTokensAndStopsWhenTheConstraintIsComplete) {
  auto engine = make_engine();
  ASSERT_NE(engine, nullptr);
  const std::vector<int32_t> prompt = {5, 6, 7, 8, 9};
  const std::vector<int32_t> script = {42, 17, 250};
  auto constraint = std::make_shared<ScriptConstraint>(script);
  Outputs outputs;
  ASSERT_TRUE(engine->add_request(request("c", prompt, 20, constraint), outputs.callback()).ok());
  ASSERT_TRUE(engine->add_request(request("free", prompt, 6), outputs.callback()).ok());
  ASSERT_TRUE(outputs.wait_finished(2));
  EXPECT_EQ(outputs.tokens("c"), script);  // greedy would pick other ids: the mask decided
  EXPECT_NE(reference_greedy(prompt, 3, kVocab), script);
  EXPECT_EQ(outputs.last("c").finish_reason, FinishReason::kStop);
  EXPECT_FALSE(outputs.last("c").stop_token_id.has_value());
  EXPECT_EQ(constraint->num_masks(), 3);
  // The unconstrained request in the same steps is untouched.
  EXPECT_EQ(outputs.tokens("free"), reference_greedy(prompt, 6, kVocab));
}

TEST(EngineConstraint, AFailingMaskEndsOnlyItsRequestWithAnError) {
  auto engine = make_engine();
  ASSERT_NE(engine, nullptr);
  const std::vector<int32_t> prompt = {1, 2, 3};
  Outputs outputs;
  auto failing = std::make_shared<ScriptConstraint>(std::vector<int32_t>{7, 8, 9}, /*fail_mask_at=*/1);
  ASSERT_TRUE(engine->add_request(request("bad", prompt, 10, failing), outputs.callback()).ok());
  ASSERT_TRUE(engine->add_request(request("good", prompt, 4), outputs.callback()).ok());
  ASSERT_TRUE(outputs.wait_finished(2));
  const RequestOutput bad = outputs.last("bad");
  EXPECT_EQ(bad.finish_reason, FinishReason::kError);
  EXPECT_NE(bad.error.find("mask failed at 1"), std::string::npos) << bad.error;
  EXPECT_EQ(outputs.tokens("bad"), std::vector<int32_t>{7});
  EXPECT_EQ(outputs.last("good").finish_reason, FinishReason::kLength);
  EXPECT_EQ(outputs.tokens("good"), reference_greedy(prompt, 4, kVocab));
}

// Refuses every token it sees: as a P/D consumer's constraint would a handed-over token it
// does not allow. The request ends with the constraint's error instead of taking the token.
class RefusingConstraint final : public TokenConstraint {
 public:
  Status fill_allowed_mask(std::span<uint32_t> words) override {
    std::fill(words.begin(), words.end(), ~0u);
    return Status::Ok();
  }
  Status consume_token(int32_t token_id) override { return invalid_argument("token {} refused", token_id); }
  bool is_finished() const override { return false; }
};

TEST(EngineConstraint, ATokenTheConstraintRefusesEndsTheRequestWithItsMessage) {
  auto engine = make_engine();
  ASSERT_NE(engine, nullptr);
  Outputs outputs;
  ASSERT_TRUE(
      engine->add_request(request("r", {4, 5}, 5, std::make_shared<RefusingConstraint>()), outputs.callback()).ok());
  ASSERT_TRUE(outputs.wait_finished(1));
  EXPECT_EQ(outputs.last("r").finish_reason, FinishReason::kError);
  EXPECT_NE(outputs.last("r").error.find("refused"), std::string::npos);
  EXPECT_TRUE(outputs.tokens("r").empty());
}

}  // namespace
}  // namespace pd::engine
