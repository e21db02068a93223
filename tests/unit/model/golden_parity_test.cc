// Logits parity with HF transformers. tests/data/golden/<family>/ holds a small
// random model (config.json + safetensors) and the logits HF computed for a fixed
// prompt and 32 greedy steps (tools/golden/make_golden.py). We load the folder
// with our own reader, run the CPU runner over a paged cache with a scattered
// block table, and require identical greedy tokens and logits within 1e-4
// relative per row (qwen3_moe: Qwen3-MoE; qwen3_fp8, qwen3_moe_fp8: block-FP8
// checkpoints). qwen3_long does the same at head_dim 128 over a 1.5k-token
// prompt (some of its prompt rows are stored, 8 greedy steps).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <vector>

#include "engine/runner/cpu_model_runner.h"
#include "model/config.h"
#include "model/weights.h"

namespace pd::engine {
namespace {

constexpr double kMaxRelativeError = 1e-4;
constexpr int32_t kBlockSize = 4;  // small, so the 53-token sequence spans 14 blocks
constexpr int32_t kNumBlocks = 64;

std::filesystem::path golden_root() {
  const char* src = std::getenv("PDSERVE_SOURCE_DIR");
  return std::filesystem::path(src != nullptr ? src : PDSERVE_TEST_SOURCE_DIR) / "tests" / "data" / "golden";
}

struct Golden {
  std::vector<int32_t> prompt;
  std::vector<int32_t> greedy;
  int32_t vocab = 0;
  std::vector<int32_t> prompt_positions;  // prompt positions whose logits are stored, ascending
  std::vector<float> prompt_logits;       // [prompt_positions][vocab]
  std::vector<float> decode_logits;       // [greedy][vocab]
  // The stored logits of a prompt position, or nullptr when that row is not stored.
  const float* prompt_row(size_t position) const {
    auto it = std::lower_bound(prompt_positions.begin(), prompt_positions.end(), static_cast<int32_t>(position));
    if (it == prompt_positions.end() || *it != static_cast<int32_t>(position)) return nullptr;
    return prompt_logits.data() + static_cast<size_t>(it - prompt_positions.begin()) * vocab;
  }
  const float* decode_row(size_t i) const { return decode_logits.data() + i * vocab; }
};

std::vector<float> read_f32(const std::filesystem::path& p, size_t count) {
  std::ifstream in(p, std::ios::binary);
  std::vector<float> v(count);
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(count * sizeof(float)));
  EXPECT_TRUE(in.good()) << p << " is shorter than " << count << " floats";
  return v;
}

Golden load_golden(const std::filesystem::path& dir) {
  std::ifstream in(dir / "golden.json");
  nlohmann::json meta = nlohmann::json::parse(in);
  Golden g;
  g.prompt = meta["prompt_token_ids"].get<std::vector<int32_t>>();
  g.greedy = meta["greedy_token_ids"].get<std::vector<int32_t>>();
  g.vocab = meta["vocab_size"].get<int32_t>();
  if (meta.contains("prompt_logits_positions")) {
    g.prompt_positions = meta["prompt_logits_positions"].get<std::vector<int32_t>>();
  } else {
    g.prompt_positions.resize(g.prompt.size());
    std::iota(g.prompt_positions.begin(), g.prompt_positions.end(), 0);
  }
  g.prompt_logits = read_f32(dir / meta["prompt_logits_file"].get<std::string>(), g.prompt_positions.size() * g.vocab);
  g.decode_logits = read_f32(dir / meta["decode_logits_file"].get<std::string>(), g.greedy.size() * g.vocab);
  return g;
}

// Scattered, non-monotonic block ids so that a layout bug cannot hide.
std::vector<int32_t> scattered_block_table(int32_t num_blocks, int32_t salt) {
  std::vector<int32_t> table(static_cast<size_t>(num_blocks));
  for (int32_t i = 0; i < num_blocks; ++i) table[static_cast<size_t>(i)] = (i * 37 + salt) % num_blocks;
  return table;
}

struct RowStats {
  double max_rel = 0.0;
  double max_abs = 0.0;
};

void compare_row(const float* ours, const float* ref, int32_t vocab, const std::string& what, RowStats* stats) {
  double diff2 = 0.0, ref2 = 0.0, max_abs = 0.0;
  for (int32_t i = 0; i < vocab; ++i) {
    const double d = static_cast<double>(ours[i]) - ref[i];
    diff2 += d * d;
    ref2 += static_cast<double>(ref[i]) * ref[i];
    max_abs = std::max(max_abs, std::abs(d));
  }
  const double rel = std::sqrt(diff2) / std::max(std::sqrt(ref2), 1e-30);
  stats->max_rel = std::max(stats->max_rel, rel);
  stats->max_abs = std::max(stats->max_abs, max_abs);
  EXPECT_LE(rel, kMaxRelativeError) << what << ": relative error " << rel << ", max abs diff " << max_abs;
}

int32_t argmax(const float* row, int32_t n) {
  return static_cast<int32_t>(std::max_element(row, row + n) - row);
}

std::unique_ptr<CpuModelRunner> make_runner(const std::string& family, int32_t block_size = kBlockSize,
                                            int32_t num_blocks = kNumBlocks, int32_t max_model_len = 256) {
  const auto dir = golden_root() / family;
  auto config = model::load_model_config(dir);
  EXPECT_TRUE(config.ok()) << config.status().to_string();
  auto weights = model::load_safetensors_weights(*config, dir);
  EXPECT_TRUE(weights.ok()) << weights.status().to_string();
  auto runner = CpuModelRunner::create(*config, std::move(*weights), block_size, num_blocks, max_model_len);
  EXPECT_TRUE(runner.ok()) << runner.status().to_string();
  return std::move(*runner);
}

SeqStep seq_step(int32_t offset, int32_t num_new, int32_t num_computed, const std::vector<int32_t>& table, bool sample,
                 int32_t block_size = kBlockSize) {
  SeqStep s;
  s.token_offset = offset;
  s.num_new_tokens = num_new;
  s.num_computed_tokens = num_computed;
  const int32_t blocks = (num_computed + num_new + block_size - 1) / block_size;
  s.block_table.assign(table.begin(), table.begin() + blocks);
  s.sample = sample;
  s.sampling.temperature = 0.0f;
  return s;
}

// Runs the prompt in chunks of the given sizes over `table`, checking every stored
// prompt row (sparse goldens store some rows only; returns how many were checked);
// then the greedy decode steps through the cache, checking logits and the sampled token.
int32_t check_prompt_then_decode(CpuModelRunner& runner, const Golden& g, const std::string& family,
                                 const std::vector<int32_t>& chunks, const std::vector<int32_t>& table,
                                 int32_t block_size, RowStats* stats) {
  int32_t done = 0, rows_checked = 0;
  for (int32_t chunk : chunks) {
    StepInput in;
    in.token_ids.assign(g.prompt.begin() + done, g.prompt.begin() + done + chunk);
    const bool last = done + chunk == static_cast<int32_t>(g.prompt.size());
    in.seqs.push_back(seq_step(0, chunk, done, table, last, block_size));
    auto logits = runner.forward(in, CpuModelRunner::LogitsRows::kAll);
    EXPECT_TRUE(logits.ok()) << logits.status().to_string();
    if (!logits.ok()) return rows_checked;
    for (int32_t r = 0; r < chunk; ++r) {
      const float* ref = g.prompt_row(static_cast<size_t>(done + r));
      if (ref == nullptr) continue;
      compare_row(logits->data() + static_cast<size_t>(r) * g.vocab, ref, g.vocab,
                  family + " prompt position " + std::to_string(done + r), stats);
      ++rows_checked;
    }
    done += chunk;
  }
  EXPECT_EQ(done, static_cast<int32_t>(g.prompt.size()));
  const float* last_row = g.prompt_row(g.prompt.size() - 1);
  EXPECT_NE(last_row, nullptr) << "the golden must store the last prompt row";
  if (last_row != nullptr) {
    EXPECT_EQ(argmax(last_row, g.vocab), g.greedy[0]);
  }

  for (size_t step = 1; step < g.greedy.size(); ++step) {
    StepInput in;
    in.token_ids = {g.greedy[step - 1]};
    const int32_t computed = static_cast<int32_t>(g.prompt.size() + step - 1);
    in.seqs.push_back(seq_step(0, 1, computed, table, true, block_size));
    auto logits = runner.forward(in, CpuModelRunner::LogitsRows::kSampled);
    EXPECT_TRUE(logits.ok()) << logits.status().to_string();
    if (!logits.ok()) return rows_checked;
    compare_row(logits->data(), g.decode_row(step), g.vocab, family + " decode step " + std::to_string(step), stats);
    // The same step through execute(): the engine's greedy sampler must pick HF's token.
    auto out = runner.execute(in);
    EXPECT_TRUE(out.ok()) << out.status().to_string();
    if (!out.ok()) return rows_checked;
    EXPECT_EQ(out->sampled.size(), 1u);
    if (out->sampled.size() != 1u) return rows_checked;
    EXPECT_EQ(out->sampled[0].token_id, g.greedy[step]) << family << " greedy step " << step;
  }
  return rows_checked;
}

// The whole prompt in chunks of the given sizes (one chunk = the whole prompt when
// chunks == {prompt size}) over a scattered table, then 32 greedy decode steps.
void run_parity(const std::string& family, const std::vector<int32_t>& chunks) {
  const Golden g = load_golden(golden_root() / family);
  ASSERT_EQ(g.greedy.size(), 32u);
  auto runner = make_runner(family);
  ASSERT_NE(runner, nullptr);
  ASSERT_EQ(runner->vocab_size(), g.vocab);
  RowStats stats;
  const int32_t rows =
      check_prompt_then_decode(*runner, g, family, chunks, scattered_block_table(kNumBlocks, 11), kBlockSize, &stats);
  EXPECT_EQ(rows, static_cast<int32_t>(g.prompt.size()));
  std::printf("%s chunks=%zu: max relative row error %.3g, max abs diff %.3g\n", family.c_str(), chunks.size(),
              stats.max_rel, stats.max_abs);
  ::testing::Test::RecordProperty(family + "_max_rel", std::to_string(stats.max_rel));
  ::testing::Test::RecordProperty(family + "_max_abs", std::to_string(stats.max_abs));
}

class GoldenParity : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenParity, WholePromptThenGreedyDecodeMatchesTransformers) {
  run_parity(GetParam(), {21});
}

TEST_P(GoldenParity, ChunkedPrefillThenGreedyDecodeMatchesTransformers) {
  run_parity(GetParam(), {5, 7, 1, 8});
}

// Two sequences in one step: the second reuses the first's two full blocks as a
// prefix hit (num_computed_tokens = 8, KV read from the cache, not recomputed)
// and is batched with the first sequence's decode step.
TEST_P(GoldenParity, PrefixHitBatchedWithDecodeReadsCachedKv) {
  const std::string family = GetParam();
  const Golden g = load_golden(golden_root() / family);
  auto runner = make_runner(family);
  ASSERT_NE(runner, nullptr);
  const std::vector<int32_t> table_a = scattered_block_table(kNumBlocks, 3);
  const int32_t n = static_cast<int32_t>(g.prompt.size());
  {
    StepInput in;
    in.token_ids = g.prompt;
    in.seqs.push_back(seq_step(0, n, 0, table_a, true));
    ASSERT_TRUE(runner->forward(in, CpuModelRunner::LogitsRows::kSampled).ok());
  }
  // Sequence B: blocks 0-1 shared with A, the rest its own (ids A does not use).
  const int32_t num_blocks_a = (n + 1 + kBlockSize - 1) / kBlockSize;
  std::vector<int32_t> table_b(table_a.begin(), table_a.begin() + 2);
  for (int32_t i = num_blocks_a; static_cast<int32_t>(table_b.size()) < num_blocks_a; ++i)
    table_b.push_back(table_a[static_cast<size_t>(i)]);

  StepInput in;
  in.token_ids = {g.greedy[0]};                                                   // A: decode step 1
  in.token_ids.insert(in.token_ids.end(), g.prompt.begin() + 8, g.prompt.end());  // B: prompt from position 8
  in.seqs.push_back(seq_step(0, 1, n, table_a, true));
  in.seqs.push_back(seq_step(1, n - 8, 8, table_b, true));
  auto logits = runner->forward(in, CpuModelRunner::LogitsRows::kAll);
  ASSERT_TRUE(logits.ok()) << logits.status().to_string();
  RowStats stats;
  compare_row(logits->data(), g.decode_row(1), g.vocab, family + " batched decode of A", &stats);
  for (int32_t r = 0; r < n - 8; ++r)
    compare_row(logits->data() + static_cast<size_t>(1 + r) * g.vocab, g.prompt_row(static_cast<size_t>(8 + r)),
                g.vocab, family + " prefix-hit B position " + std::to_string(8 + r), &stats);
}

INSTANTIATE_TEST_SUITE_P(Families, GoldenParity,
                         ::testing::Values("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_fp8", "qwen3_moe_fp8"));

// Qwen3 at head_dim 128 (bf16 weights, RoPE theta 1e6) over a 1500-token prompt run as
// two chunks, then 7 greedy decode steps at positions up to 1507. RoPE angles reach
// ~1.5k radians here: RoPE frequencies off by one bf16 rounding (what
// model.to(torch.bfloat16) does to HF's inv_freq buffer) move the checked rows by up to
// 4% relative (golden.json: rope_frequencies_rounded_to_bf16_row_relative_error), far
// beyond the 1e-4 allowed, so this pins the fp32 frequencies that HF's from_pretrained
// uses; the short goldens above reach position 52 only.
TEST(GoldenParityLong, Qwen3HeadDim128LongPromptChunkedThenGreedyDecode) {
  constexpr int32_t kLongBlockSize = 16;
  constexpr int32_t kLongNumBlocks = 128;  // 2048 positions
  const std::string family = "qwen3_long";
  const Golden g = load_golden(golden_root() / family);
  ASSERT_EQ(g.prompt.size(), 1500u);
  ASSERT_GE(g.greedy.size(), 2u);
  ASSERT_FALSE(g.prompt_positions.empty());
  ASSERT_EQ(g.prompt_positions.back(), 1499);
  auto runner = make_runner(family, kLongBlockSize, kLongNumBlocks, kLongBlockSize * kLongNumBlocks);
  ASSERT_NE(runner, nullptr);
  ASSERT_EQ(runner->vocab_size(), g.vocab);
  RowStats stats;
  const int32_t rows = check_prompt_then_decode(*runner, g, family, {1024, 476},
                                                scattered_block_table(kLongNumBlocks, 5), kLongBlockSize, &stats);
  EXPECT_EQ(rows, static_cast<int32_t>(g.prompt_positions.size()));
  std::printf("%s: max relative row error %.3g, max abs diff %.3g\n", family.c_str(), stats.max_rel, stats.max_abs);
}

}  // namespace
}  // namespace pd::engine
