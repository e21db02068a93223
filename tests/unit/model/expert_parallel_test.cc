// Expert parallelism on the CPU runner: the plan (each rank holds a contiguous
// range of whole experts; the refusals), the token slices of the exchange, and
// parity: TP 2 and TP 4 with expert parallelism give the same greedy tokens as
// TP 1 and logits within fp32 rounding on the tiny Qwen3-MoE golden model
// (bf16 weights) and on a block-FP8 MoE model, which is also run with
// tensor-parallel experts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "engine/runner/cpu_model_runner.h"
#include "engine/runner/load_model.h"
#include "model/config.h"
#include "model/tp_shard.h"
#include "model/weights.h"
#include "runner_test_util.h"

namespace pd::engine {
namespace {

constexpr int32_t kBlockSize = 4;
constexpr int32_t kNumBlocks = 48;
constexpr int32_t kDecodeSteps = 10;
// The ranks' expert outputs are summed in rank order instead of one running
// sum over the experts; the logits may differ by fp32 rounding only.
constexpr double kMaxRelativeError = 1e-5;

using runner_test::golden_dir;

model::ModelConfig moe_config() {
  auto c = model::load_model_config(golden_dir("qwen3_moe"));  // 8 experts, 4 heads, 2 KV heads
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  return c.ok() ? *c : model::ModelConfig{};
}

// A block-FP8 Qwen3-MoE whose attention and dense MLP split on 128-column
// boundaries at TP 2 and TP 4 (4 heads of 128, 2 KV heads, intermediate 512),
// with 8 experts of width `moe_intermediate` in layer 1 (layer 0 dense).
model::ModelConfig fp8_moe_config(int32_t moe_intermediate) {
  auto loaded = model::load_model_config(golden_dir("qwen3_moe_fp8"));
  EXPECT_TRUE(loaded.ok()) << loaded.status().to_string();
  if (!loaded.ok()) return {};
  model::ModelConfig c = *loaded;
  c.hidden_size = 128;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 128;
  c.intermediate_size = 512;
  c.num_layers = 2;
  c.moe.num_experts = 8;
  c.moe.num_experts_per_tok = 2;
  c.moe.moe_intermediate_size = moe_intermediate;
  EXPECT_TRUE(c.quant.fp8());
  EXPECT_TRUE(c.validate().ok()) << c.validate().to_string();
  return c;
}

TEST(ExpertParallelPlan, RanksHoldContiguousRangesOfWholeExperts) {
  const model::ModelConfig c = moe_config();
  for (int32_t tp : {1, 2, 4, 8}) {
    if (c.num_heads % tp != 0) continue;
    auto split = model::plan_tensor_parallel(c, tp, /*expert_parallel=*/true);
    ASSERT_TRUE(split.ok()) << "tp " << tp << ": " << split.status().to_string();
    EXPECT_TRUE(split->expert_parallel);
    EXPECT_EQ(split->experts_per_rank, 8 / tp);
    EXPECT_EQ(split->moe_intermediate_per_rank, c.moe.moe_intermediate_size) << "experts are not cut";
    EXPECT_EQ(split->heads_per_rank, c.num_heads / tp) << "attention stays tensor-parallel";
    for (int32_t r = 0; r < tp; ++r) EXPECT_EQ(split->expert_begin(r), r * (8 / tp)) << "tp " << tp << " rank " << r;
  }
  // Without expert parallelism every rank holds a slice of every expert.
  auto sliced = model::plan_tensor_parallel(c, 2);
  ASSERT_TRUE(sliced.ok());
  EXPECT_FALSE(sliced->expert_parallel);
  EXPECT_EQ(sliced->experts_per_rank, 8);
  EXPECT_EQ(sliced->expert_begin(1), 0);
  EXPECT_EQ(sliced->moe_intermediate_per_rank, c.moe.moe_intermediate_size / 2);
}

TEST(ExpertParallelPlan, RefusesADenseModel) {
  auto split = model::plan_tensor_parallel(model::builtin_tiny_config(), 2, true);
  EXPECT_EQ(split.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(split.status().message().find("needs a MoE model"), std::string::npos) << split.status().to_string();
  EXPECT_EQ(model::plan_tensor_parallel(model::builtin_tiny_config(), 1, true).status().code(),
            ErrorCode::kInvalidArgument);
}

TEST(ExpertParallelPlan, RefusesExpertsThatDoNotDivideOverTheRanks) {
  model::ModelConfig c = moe_config();
  c.moe.num_experts = 6;
  auto split = model::plan_tensor_parallel(c, 4, true);
  EXPECT_EQ(split.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(split.status().message().find("must divide the number of experts (6)"), std::string::npos)
      << split.status().to_string();
  EXPECT_TRUE(model::plan_tensor_parallel(c, 2, true).ok());
}

// Whole experts need no divisible expert width: a width tensor parallelism
// cannot split is fine with expert parallelism.
TEST(ExpertParallelPlan, DoesNotCutTheExpertIntermediateDimension) {
  model::ModelConfig c = moe_config();
  c.moe.moe_intermediate_size = 30;
  EXPECT_EQ(model::plan_tensor_parallel(c, 4).status().code(), ErrorCode::kInvalidArgument);
  auto split = model::plan_tensor_parallel(c, 4, true);
  ASSERT_TRUE(split.ok()) << split.status().to_string();
  EXPECT_EQ(split->moe_intermediate_per_rank, 30);
}

// Expert width 192: two ranks of tensor-parallel experts would take 96
// columns each, cutting the 128x128 scale blocks; whole experts keep them.
TEST(ExpertParallelPlan, Fp8ExpertsKeepTheirScaleBlocksWhole) {
  const model::ModelConfig c = fp8_moe_config(192);
  auto sliced = model::plan_tensor_parallel(c, 2);
  EXPECT_EQ(sliced.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(sliced.status().message().find("'model.layers.1.mlp.experts.0.gate_proj.weight'"), std::string::npos)
      << sliced.status().to_string();
  EXPECT_TRUE(model::plan_tensor_parallel(c, 2, true).ok());
  // Attention is still split: 2 heads of 64 would cut q_proj's blocks, with or without expert parallelism.
  auto golden = model::load_model_config(golden_dir("qwen3_moe_fp8"));
  ASSERT_TRUE(golden.ok());
  auto attention = model::plan_tensor_parallel(*golden, 2, true);
  EXPECT_NE(attention.status().message().find("'model.layers.0.self_attn.q_proj.weight'"), std::string::npos)
      << attention.status().to_string();
}

TEST(ExpertParallelPlan, TokenSlicesTileTheRowsInRankOrder) {
  for (int32_t ranks : {1, 2, 3, 4}) {
    for (int32_t t : {0, 1, 2, 3, 5, 17, 64}) {
      int32_t next = 0;
      for (int32_t r = 0; r < ranks; ++r) {
        const auto [begin, end] = model::token_slice(r, ranks, t);
        EXPECT_EQ(begin, next) << ranks << " ranks, " << t << " rows, rank " << r;
        EXPECT_GE(end, begin);
        EXPECT_LE(end - begin, (t + ranks - 1) / ranks);
        EXPECT_GE(end - begin, t / ranks);
        next = end;
      }
      EXPECT_EQ(next, t) << ranks << " ranks, " << t << " rows";
    }
  }
}

TEST(ExpertParallelLoadModel, RefusesADenseModelAndOtherDevices) {
  ModelLoadOptions options;  // builtin:tiny is dense
  options.num_kv_blocks = 8;
  options.tensor_parallel_size = 2;
  options.enable_expert_parallel = true;
  auto dense = load_model(options);
  EXPECT_EQ(dense.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(dense.status().message().find("needs a MoE model"), std::string::npos) << dense.status().to_string();

  options.model = golden_dir("qwen3_moe").string();
  options.device = "cuda";
  options.tensor_parallel_size = 1;  // whole experts on one rank: still the CPU runner's feature only
  auto cuda = load_model(options);
  EXPECT_EQ(cuda.status().code(), ErrorCode::kUnimplemented);
  EXPECT_NE(cuda.status().message().find("expert parallelism runs on the cpu device only"), std::string::npos)
      << cuda.status().to_string();

  options.device = "cpu";
  options.tensor_parallel_size = 2;
  auto moe = load_model(options);
  ASSERT_TRUE(moe.ok()) << moe.status().to_string();
  auto* runner = dynamic_cast<CpuModelRunner*>(moe->runner.get());
  ASSERT_NE(runner, nullptr);
  EXPECT_TRUE(runner->tp_split().expert_parallel);
  EXPECT_EQ(runner->tp_split().experts_per_rank, 4);
}

SeqStep seq_step(int32_t offset, int32_t num_new, int32_t num_computed, const std::vector<int32_t>& table) {
  return runner_test::seq_step(offset, num_new, num_computed, table, kBlockSize);
}

void expect_close(const std::vector<float>& want, const std::vector<float>& got, int32_t vocab,
                  const std::string& what) {
  runner_test::expect_rows_close(want, got, vocab, kMaxRelativeError, what);
}

struct EpCase {
  std::string model;  // "qwen3_moe" (golden, bf16 weights) or "fp8_moe"
  int32_t tp;
  bool expert_parallel;
};

void PrintTo(const EpCase& c, std::ostream* os) {
  *os << c.model << " tp " << c.tp << (c.expert_parallel ? " expert parallel" : "");
}

Result<std::unique_ptr<CpuModelRunner>> make_runner(const std::string& model, int32_t tp, bool expert_parallel) {
  model::ModelConfig config;
  model::ModelWeights weights;
  if (model == "qwen3_moe") {
    config = moe_config();
    PD_ASSIGN_OR_RETURN(weights, model::load_safetensors_weights(config, golden_dir(model)));
  } else {
    config = fp8_moe_config(512);
    weights = model::dummy_weights(config, 11, 0.1f);
  }
  return CpuModelRunner::create(std::move(config), std::move(weights), kBlockSize, kNumBlocks, 256, KvDtype::kFloat32,
                                tp, expert_parallel);
}

class ExpertParallelParity : public ::testing::TestWithParam<EpCase> {};

// Two sequences on a TP 1 and a TP N runner: A's prefill in two chunks, the
// second batched with B's whole prefill, then 10 steps decoding A and B
// together (two rows: at TP 4 two ranks own no row of the exchange). Every
// step's logits match and the TP N runner samples the TP 1 runner's tokens.
TEST_P(ExpertParallelParity, SameGreedyTokensAndLogitsAsOneRank) {
  const EpCase tc = GetParam();
  auto one = make_runner(tc.model, 1, false);
  ASSERT_TRUE(one.ok()) << one.status().to_string();
  auto many = make_runner(tc.model, tc.tp, tc.expert_parallel);
  ASSERT_TRUE(many.ok()) << many.status().to_string();
  ASSERT_EQ((*many)->tp_split().expert_parallel, tc.expert_parallel);
  ASSERT_EQ((*many)->tensor_parallel_size(), tc.tp);
  const int32_t vocab = (*one)->vocab_size();

  std::mt19937 rng(23);
  std::uniform_int_distribution<int32_t> token(3, vocab - 1);
  std::vector<int32_t> prompt_a(19), prompt_b(13);
  for (int32_t& id : prompt_a) id = token(rng);
  for (int32_t& id : prompt_b) id = token(rng);
  std::vector<int32_t> table_a, table_b;
  for (int32_t i = 0; i < kNumBlocks / 2; ++i) {
    table_a.push_back((i * 7 + 3) % kNumBlocks);
    table_b.push_back((i * 7 + 3 + kNumBlocks / 2 * 7) % kNumBlocks);
  }
  ASSERT_TRUE(std::none_of(table_a.begin(), table_a.end(),
                           [&](int32_t b) { return std::find(table_b.begin(), table_b.end(), b) != table_b.end(); }));

  auto both = [&](const StepInput& in, const std::string& what) {
    auto a = (*one)->forward(in, CpuModelRunner::LogitsRows::kAll);
    auto b = (*many)->forward(in, CpuModelRunner::LogitsRows::kAll);
    EXPECT_TRUE(a.ok() && b.ok()) << what;
    if (!a.ok() || !b.ok()) return std::vector<float>();
    expect_close(*a, *b, vocab, what);
    return *a;
  };
  auto argmax_row = [&](const std::vector<float>& logits, int32_t row) {
    const auto first = logits.begin() + static_cast<int64_t>(row) * vocab;
    return static_cast<int32_t>(std::max_element(first, first + vocab) - first);
  };
  {
    StepInput in;
    in.token_ids.assign(prompt_a.begin(), prompt_a.begin() + 8);
    in.seqs.push_back(seq_step(0, 8, 0, table_a));
    both(in, "A's first chunk");
  }
  std::vector<int32_t> next;
  {
    StepInput in;
    in.token_ids.assign(prompt_a.begin() + 8, prompt_a.end());
    in.token_ids.insert(in.token_ids.end(), prompt_b.begin(), prompt_b.end());
    in.seqs.push_back(seq_step(0, 11, 8, table_a));
    in.seqs.push_back(seq_step(11, 13, 0, table_b));
    const std::vector<float> rows = both(in, "A's second chunk batched with B's prefill");
    ASSERT_EQ(rows.size(), static_cast<size_t>(24) * vocab);
    next = {argmax_row(rows, 10), argmax_row(rows, 23)};  // each sequence's last prompt row
  }
  // Greedy decode: both sequences in one step, fed with the TP 1 runner's tokens.
  int32_t len_a = 19, len_b = 13;
  std::vector<int32_t> distinct;
  for (int32_t step = 0; step < kDecodeSteps; ++step) {
    StepInput in;
    in.token_ids = next;
    in.seqs.push_back(seq_step(0, 1, len_a, table_a));
    in.seqs.push_back(seq_step(1, 1, len_b, table_b));
    auto a = (*one)->execute(in);
    auto b = (*many)->execute(in);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_EQ(a->sampled.size(), 2u);
    ASSERT_EQ(b->sampled.size(), 2u);
    for (size_t s = 0; s < 2; ++s) {
      EXPECT_EQ(a->sampled[s].token_id, b->sampled[s].token_id) << "seq " << s << " step " << step;
      next[s] = a->sampled[s].token_id;
      distinct.push_back(next[s]);
    }
    ++len_a;
    ++len_b;
  }
  std::sort(distinct.begin(), distinct.end());
  EXPECT_GT(std::unique(distinct.begin(), distinct.end()) - distinct.begin(), 2)
      << "the streams must vary for the comparison to mean something";
}

INSTANTIATE_TEST_SUITE_P(Models, ExpertParallelParity,
                         ::testing::Values(EpCase{"qwen3_moe", 2, true}, EpCase{"qwen3_moe", 4, true},
                                           EpCase{"fp8_moe", 2, false}, EpCase{"fp8_moe", 4, false},
                                           EpCase{"fp8_moe", 2, true}, EpCase{"fp8_moe", 4, true}),
                         [](const auto& param_info) {
                           return param_info.param.model + "_tp" + std::to_string(param_info.param.tp) +
                                  (param_info.param.expert_parallel ? "_ep" : "");
                         });

// Expert width 192 at TP 2: refused with tensor-parallel experts (a cut scale
// block), served with whole experts, and equal to one rank.
TEST(ExpertParallelFp8, WholeExpertsServeAWidthTensorParallelismCannotSplit) {
  const model::ModelConfig c = fp8_moe_config(192);
  auto one =
      CpuModelRunner::create(c, model::dummy_weights(c, 5, 0.1f), kBlockSize, kNumBlocks, 256, KvDtype::kFloat32, 1);
  ASSERT_TRUE(one.ok()) << one.status().to_string();
  EXPECT_EQ(
      CpuModelRunner::create(c, model::dummy_weights(c, 5, 0.1f), kBlockSize, kNumBlocks, 256, KvDtype::kFloat32, 2)
          .status()
          .code(),
      ErrorCode::kInvalidArgument);
  auto two = CpuModelRunner::create(c, model::dummy_weights(c, 5, 0.1f), kBlockSize, kNumBlocks, 256, KvDtype::kFloat32,
                                    2, true);
  ASSERT_TRUE(two.ok()) << two.status().to_string();
  StepInput in;
  in.token_ids = {1, 5, 9, 200, 3, 77, 411, 12, 8, 300, 41};
  std::vector<int32_t> table(kNumBlocks);
  for (int32_t i = 0; i < kNumBlocks; ++i) table[static_cast<size_t>(i)] = (i * 5 + 1) % kNumBlocks;
  in.seqs.push_back(seq_step(0, 11, 0, table));
  auto a = (*one)->forward(in, CpuModelRunner::LogitsRows::kAll);
  auto b = (*two)->forward(in, CpuModelRunner::LogitsRows::kAll);
  ASSERT_TRUE(a.ok() && b.ok());
  expect_close(*a, *b, c.vocab_size, "fp8 width 192, tp 2, expert parallel");
}

}  // namespace
}  // namespace pd::engine
