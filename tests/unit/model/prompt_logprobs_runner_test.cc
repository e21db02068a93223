// Prompt logprobs from the CPU runner's execute(): the rows a chunked prefill
// returns are, position by position, the log-softmax of the logits a one-step
// forward pass gives for the whole prompt, taken at the next prompt token.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "engine/runner/cpu_model_runner.h"
#include "engine/runner/load_model.h"
#include "engine/sampler.h"
#include "model/config.h"
#include "model/weights.h"

namespace pd::engine {
namespace {

constexpr int32_t kBlockSize = 4;
constexpr int32_t kNumBlocks = 64;

std::filesystem::path golden_dir() {
  const char* src = std::getenv("PDSERVE_SOURCE_DIR");
  return std::filesystem::path(src != nullptr ? src : PDSERVE_TEST_SOURCE_DIR) / "tests" / "data" / "golden" / "qwen3";
}

std::unique_ptr<CpuModelRunner> make_runner() {
  auto config = model::load_model_config(golden_dir());
  EXPECT_TRUE(config.ok()) << config.status().to_string();
  auto weights = model::load_safetensors_weights(*config, golden_dir());
  EXPECT_TRUE(weights.ok()) << weights.status().to_string();
  auto runner = CpuModelRunner::create(*config, std::move(weights).value(), kBlockSize, kNumBlocks, 256);
  EXPECT_TRUE(runner.ok()) << runner.status().to_string();
  return std::move(runner).value();
}

SeqStep step_of(const std::vector<int32_t>& prompt, int32_t computed, int32_t num_new, int32_t prompt_logprobs) {
  SeqStep s;
  s.num_computed_tokens = computed;
  s.num_new_tokens = num_new;
  for (int32_t b = 0; b * kBlockSize < computed + num_new; ++b) s.block_table.push_back(b);
  s.sample = computed + num_new == static_cast<int32_t>(prompt.size());
  s.sampling.temperature = 0.0f;
  s.prompt_logprobs = prompt_logprobs;
  s.prompt_token_ids = prompt;
  return s;
}

TEST(CpuRunnerPromptLogprobs, ChunkedRowsEqualTheLogSoftmaxOfAOneStepPass) {
  std::vector<int32_t> prompt;
  for (int32_t i = 0; i < 23; ++i) prompt.push_back((i * 37 + 5) % 200 + 3);
  auto reference = make_runner();
  auto chunked = make_runner();
  ASSERT_TRUE(reference && chunked);
  const int32_t vocab = reference->vocab_size();

  StepInput whole;
  whole.token_ids = prompt;
  whole.seqs.push_back(step_of(prompt, 0, static_cast<int32_t>(prompt.size()), -1));
  auto logits = reference->forward(whole, CpuModelRunner::LogitsRows::kAll);
  ASSERT_TRUE(logits.ok()) << logits.status().to_string();

  std::vector<PromptPositionLogprobs> rows;
  for (auto [computed, num_new] : {std::pair{0, 9}, std::pair{9, 10}, std::pair{19, 4}}) {
    StepInput in;
    in.token_ids.assign(prompt.begin() + computed, prompt.begin() + computed + num_new);
    in.seqs.push_back(step_of(prompt, computed, num_new, 3));
    auto out = chunked->execute(in);
    ASSERT_TRUE(out.ok()) << out.status().to_string();
    ASSERT_EQ(out->prompt_logprobs.size(), 1u);
    EXPECT_EQ(out->prompt_logprobs[0].seq_index, 0);
    EXPECT_EQ(out->prompt_logprobs[0].first_position, computed);
    EXPECT_EQ(static_cast<int32_t>(out->prompt_logprobs[0].rows.size()), num_prompt_logprob_rows(in.seqs[0]));
    EXPECT_EQ(out->sampled.size(), in.seqs[0].sample ? 1u : 0u);
    rows.insert(rows.end(), out->prompt_logprobs[0].rows.begin(), out->prompt_logprobs[0].rows.end());
  }
  ASSERT_EQ(rows.size(), prompt.size() - 1) << "one row per prompt token after the first";
  for (size_t p = 0; p < rows.size(); ++p) {
    const std::span<const float> row(logits->data() + p * static_cast<size_t>(vocab), static_cast<size_t>(vocab));
    const PromptPositionLogprobs want = prompt_position_logprobs(row, prompt[p + 1], 3);
    EXPECT_EQ(rows[p].token_id, prompt[p + 1]);
    EXPECT_NEAR(rows[p].logprob, want.logprob, 1e-4) << "position " << p;
    EXPECT_EQ(rows[p].rank, want.rank) << "position " << p;
    ASSERT_EQ(rows[p].top_logprobs.size(), 3u);
    for (size_t k = 0; k < 3; ++k) {
      EXPECT_EQ(rows[p].top_logprobs[k].first, want.top_logprobs[k].first) << "position " << p;
      EXPECT_NEAR(rows[p].top_logprobs[k].second, want.top_logprobs[k].second, 1e-4);
    }
  }
}

TEST(CpuRunnerPromptLogprobs, AStepWithoutThemReturnsNone) {
  auto runner = make_runner();
  ASSERT_TRUE(runner);
  const std::vector<int32_t> prompt = {5, 6, 7, 8, 9};
  StepInput in;
  in.token_ids = prompt;
  in.seqs.push_back(step_of(prompt, 0, 5, -1));
  auto out = runner->execute(in);
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  EXPECT_TRUE(out->prompt_logprobs.empty());
  EXPECT_EQ(out->sampled.size(), 1u);
}

}  // namespace
}  // namespace pd::engine
