// Tensor parallelism on the CPU runner: TP 2 and TP 4 must produce the same
// greedy tokens as TP 1 and logits within a tight tolerance, on the tiny dense
// (qwen3: 4 heads, 2 KV heads, so TP 4 replicates each KV head on two ranks)
// and MoE (qwen3_moe) golden models, through chunked prefill, a prefix-cache
// hit batched with a decode step, and greedy decode. Plus the refusals.
#include <gtest/gtest.h>
#include <atomic>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "engine/runner/cpu_model_runner.h"
#include "engine/runner/load_model.h"
#include "engine/runner/rank_pool.h"
#include "model/config.h"
#include "model/tp_shard.h"
#include "model/weights.h"
#include "runner_test_util.h"

namespace pd::engine {
namespace {

constexpr int32_t kBlockSize = 4;
constexpr int32_t kNumBlocks = 64;
// TP sums the row-parallel partials in another order than one rank's matmul;
// the logits may differ by fp32 rounding only.
constexpr double kMaxRelativeError = 1e-5;

using runner_test::golden_dir;

std::vector<int32_t> golden_prompt(const std::string& family) {
  std::ifstream in(golden_dir(family) / "golden.json");
  return nlohmann::json::parse(in)["prompt_token_ids"].get<std::vector<int32_t>>();
}

Result<std::unique_ptr<CpuModelRunner>> make_runner(const std::string& family, int32_t tp) {
  PD_ASSIGN_OR_RETURN(model::ModelConfig config, model::load_model_config(golden_dir(family)));
  PD_ASSIGN_OR_RETURN(model::ModelWeights weights, model::load_safetensors_weights(config, golden_dir(family)));
  return CpuModelRunner::create(std::move(config), std::move(weights), kBlockSize, kNumBlocks, 256, KvDtype::kFloat32,
                                tp);
}

SeqStep seq_step(int32_t offset, int32_t num_new, int32_t num_computed, const std::vector<int32_t>& table,
                 bool sample) {
  return runner_test::seq_step(offset, num_new, num_computed, table, kBlockSize, sample);
}

std::vector<int32_t> scattered_table(int32_t salt) {
  std::vector<int32_t> table(kNumBlocks);
  for (int32_t i = 0; i < kNumBlocks; ++i) table[static_cast<size_t>(i)] = (i * 37 + salt) % kNumBlocks;
  return table;
}

void expect_close(const std::vector<float>& want, const std::vector<float>& got, int32_t vocab,
                  const std::string& what) {
  runner_test::expect_rows_close(want, got, vocab, kMaxRelativeError, what);
}

struct TpCase {
  std::string family;
  int32_t tp;
};

class TpParity : public ::testing::TestWithParam<TpCase> {};

// The same step sequence on a TP 1 and a TP N runner: a chunked prefill of
// sequence A, a step batching A's first decode with sequence B (a prefix hit
// on A's first two blocks), then 24 greedy decode steps of A fed with the
// TP 1 runner's tokens; the TP N runner must sample the same tokens.
TEST_P(TpParity, SameGreedyTokensAndLogitsAsOneRank) {
  const TpCase tc = GetParam();
  auto one = make_runner(tc.family, 1);
  ASSERT_TRUE(one.ok()) << one.status().to_string();
  auto many = make_runner(tc.family, tc.tp);
  ASSERT_TRUE(many.ok()) << many.status().to_string();
  ASSERT_EQ((*many)->tensor_parallel_size(), tc.tp);
  const int32_t vocab = (*one)->vocab_size();
  const std::vector<int32_t> prompt = golden_prompt(tc.family);
  const int32_t n = static_cast<int32_t>(prompt.size());
  ASSERT_GT(n, 12);
  const std::vector<int32_t> table_a = scattered_table(3);

  auto both = [&](const StepInput& in, CpuModelRunner::LogitsRows rows, const std::string& what) {
    auto a = (*one)->forward(in, rows);
    auto b = (*many)->forward(in, rows);
    EXPECT_TRUE(a.ok() && b.ok()) << what;
    if (!a.ok() || !b.ok()) return std::vector<float>();
    expect_close(*a, *b, vocab, what);
    return *a;
  };

  // Chunked prefill of A: 5, 7, then the rest.
  int32_t done = 0;
  std::vector<float> last;
  for (int32_t chunk : {5, 7, n - 12}) {
    StepInput in;
    in.token_ids.assign(prompt.begin() + done, prompt.begin() + done + chunk);
    in.seqs.push_back(seq_step(0, chunk, done, table_a, done + chunk == n));
    last = both(in, CpuModelRunner::LogitsRows::kAll, "prefill chunk at " + std::to_string(done));
    done += chunk;
  }
  ASSERT_FALSE(last.empty());
  const float* last_row = last.data() + static_cast<size_t>(n - 13) * vocab;
  int32_t token = static_cast<int32_t>(std::max_element(last_row, last_row + vocab) - last_row);

  // A's first decode batched with B, whose first 8 positions are a prefix-cache hit on A's blocks.
  const int32_t blocks_a = (n + 32 + kBlockSize - 1) / kBlockSize;
  std::vector<int32_t> table_b(table_a.begin(), table_a.begin() + 2);
  for (int32_t i = blocks_a; static_cast<int32_t>(table_b.size()) < blocks_a; ++i)
    table_b.push_back(table_a[static_cast<size_t>(i)]);
  {
    StepInput in;
    in.token_ids = {token};
    in.token_ids.insert(in.token_ids.end(), prompt.begin() + 8, prompt.end());
    in.seqs.push_back(seq_step(0, 1, n, table_a, true));
    in.seqs.push_back(seq_step(1, n - 8, 8, table_b, true));
    const std::vector<float> rows = both(in, CpuModelRunner::LogitsRows::kAll, "decode batched with a prefix hit");
    ASSERT_FALSE(rows.empty());
    // B's last row is A's prompt's last row again (same tokens, same positions).
    std::vector<float> b_last(rows.end() - vocab, rows.end());
    expect_close(std::vector<float>(last_row, last_row + vocab), b_last, vocab, "prefix-hit row vs prefill row");
    token = static_cast<int32_t>(std::max_element(rows.begin(), rows.begin() + vocab) - rows.begin());
  }

  // Greedy decode through execute(): both runners sample the same token each step.
  for (int32_t step = 1; step <= 24; ++step) {
    StepInput in;
    in.token_ids = {token};
    in.seqs.push_back(seq_step(0, 1, n + step, table_a, true));
    auto a = (*one)->execute(in);
    auto b = (*many)->execute(in);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_EQ(a->sampled.size(), 1u);
    ASSERT_EQ(b->sampled.size(), 1u);
    EXPECT_EQ(a->sampled[0].token_id, b->sampled[0].token_id) << tc.family << " tp " << tc.tp << " step " << step;
    token = a->sampled[0].token_id;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, TpParity,
                         ::testing::Values(TpCase{"qwen3", 2}, TpCase{"qwen3", 4}, TpCase{"qwen3_moe", 2},
                                           TpCase{"qwen3_moe", 4}),
                         [](const auto& param_info) {
                           return param_info.param.family + "_tp" + std::to_string(param_info.param.tp);
                         });

TEST(TpSplit, ReplicatesKvHeadsWhenRanksExceedThem) {
  model::ModelConfig c = model::builtin_tiny_config();  // 4 heads, 2 KV heads
  auto split = model::plan_tensor_parallel(c, 4);
  ASSERT_TRUE(split.ok()) << split.status().to_string();
  EXPECT_EQ(split->heads_per_rank, 1);
  EXPECT_EQ(split->kv_heads_per_rank, 1);
  // Ranks 0-1 hold KV head 0 (query heads 0-1), ranks 2-3 KV head 1 (query heads 2-3).
  EXPECT_EQ(split->kv_head_begin(0, 2), 0);
  EXPECT_EQ(split->kv_head_begin(1, 2), 0);
  EXPECT_EQ(split->kv_head_begin(2, 2), 1);
  EXPECT_EQ(split->kv_head_begin(3, 2), 1);
  auto two = model::plan_tensor_parallel(c, 2);
  ASSERT_TRUE(two.ok());
  EXPECT_EQ(two->kv_heads_per_rank, 1);
  EXPECT_EQ(two->kv_head_begin(1, 2), 1);
}

TEST(TpSplit, RefusesSplitsTheModelCannotTake) {
  model::ModelConfig c = model::builtin_tiny_config();  // 4 heads, 2 KV heads
  auto heads = model::plan_tensor_parallel(c, 3);
  EXPECT_EQ(heads.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(heads.status().message().find("attention heads (4)"), std::string::npos) << heads.status().to_string();
  EXPECT_EQ(model::plan_tensor_parallel(c, 0).status().code(), ErrorCode::kInvalidArgument);

  model::ModelConfig kv = c;
  kv.num_heads = 12;
  kv.num_kv_heads = 3;
  auto kv_split = model::plan_tensor_parallel(kv, 2);
  EXPECT_EQ(kv_split.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(kv_split.status().message().find("KV heads (3)"), std::string::npos) << kv_split.status().to_string();

  model::ModelConfig inter = c;
  inter.intermediate_size = 66;
  auto inter_split = model::plan_tensor_parallel(inter, 4);
  EXPECT_EQ(inter_split.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(inter_split.status().message().find("intermediate_size (66)"), std::string::npos);
}

TEST(TpSplit, RefusesToCutAnFp8ScaleBlockNamingTheTensor) {
  // qwen3_moe_fp8: 2 heads of 64; two ranks would take 64 rows of q_proj each, half a 128 block.
  auto config = model::load_model_config(golden_dir("qwen3_moe_fp8"));
  ASSERT_TRUE(config.ok());
  auto split = model::plan_tensor_parallel(*config, 2);
  EXPECT_EQ(split.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(split.status().message().find("'model.layers.0.self_attn.q_proj.weight'"), std::string::npos)
      << split.status().to_string();
  // qwen3_fp8: 3 heads cannot split over 2 ranks.
  auto dense = make_runner("qwen3_fp8", 2);
  EXPECT_EQ(dense.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(dense.status().message().find("attention heads (3)"), std::string::npos) << dense.status().to_string();
}

// A block-FP8 model whose split lands on block boundaries (2 heads of 128, intermediate 256).
TEST(TpSplit, Fp8SplitOnBlockBoundariesMatchesOneRank) {
  model::ModelConfig c = model::builtin_tiny_config();
  c.hidden_size = 128;
  c.num_heads = 2;
  c.num_kv_heads = 2;
  c.head_dim = 128;
  c.intermediate_size = 256;
  c.vocab_size = 512;
  c.quant.method = model::QuantMethod::kFp8Block;
  c.quant.block_out = 128;
  c.quant.block_in = 128;
  ASSERT_TRUE(c.validate().ok()) << c.validate().to_string();
  auto one =
      CpuModelRunner::create(c, model::dummy_weights(c, 7, 0.1f), kBlockSize, kNumBlocks, 256, KvDtype::kFloat32, 1);
  auto two =
      CpuModelRunner::create(c, model::dummy_weights(c, 7, 0.1f), kBlockSize, kNumBlocks, 256, KvDtype::kFloat32, 2);
  ASSERT_TRUE(one.ok()) << one.status().to_string();
  ASSERT_TRUE(two.ok()) << two.status().to_string();
  StepInput in;
  in.token_ids = {1, 5, 9, 200, 3, 77, 411, 12, 8};
  in.seqs.push_back(seq_step(0, 9, 0, scattered_table(5), true));
  auto a = (*one)->forward(in, CpuModelRunner::LogitsRows::kAll);
  auto b = (*two)->forward(in, CpuModelRunner::LogitsRows::kAll);
  ASSERT_TRUE(a.ok() && b.ok());
  expect_close(*a, *b, c.vocab_size, "fp8 tp 2");
}

TEST(TpLoadModel, BuiltinTinyLoadsWithTwoRanksAndCudaDoesNotRefuseTheRanks) {
  ModelLoadOptions options;
  options.num_kv_blocks = 8;
  options.tensor_parallel_size = 2;
  auto loaded = load_model(options);
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  auto* runner = dynamic_cast<CpuModelRunner*>(loaded->runner.get());
  ASSERT_NE(runner, nullptr);
  EXPECT_EQ(runner->tensor_parallel_size(), 2);
  EXPECT_EQ(runner->kv_cache_spec().num_kv_heads, 2);  // one KV head per rank
  EXPECT_EQ(runner->kv_layer_base(0), nullptr);        // no single region to hand to a P/D transfer
  EXPECT_NE(runner->kv_layer_base(1, 0), nullptr);

  // cuda takes tensor_parallel_size > 1 now; here it still fails (no CUDA runner in this build,
  // or no GPU, or builtin:tiny's head_dim 32), but never for the rank count.
  options.device = "cuda";
  auto cuda = load_model(options);
  EXPECT_FALSE(cuda.ok());
  EXPECT_EQ(cuda.status().message().find("cpu device only"), std::string::npos) << cuda.status().to_string();
  EXPECT_EQ(cuda.status().message().find("tensor parallelism"), std::string::npos) << cuda.status().to_string();
  options.device = "cpu";
  options.tensor_parallel_size = 3;
  EXPECT_EQ(load_model(options).status().code(), ErrorCode::kInvalidArgument);
}

}  // namespace
}  // namespace pd::engine

namespace pd::engine {
namespace {

// Every run() executes each rank exactly once, rank 0 on the calling thread,
// and returns only after all ranks finished (the counts are read without
// further synchronisation right after run()).
TEST(RankPool, RunsEveryRankOncePerRunAndJoins) {
  RankPool pool(4);
  ASSERT_EQ(pool.num_ranks(), 4);
  std::vector<int32_t> runs(4, 0);
  std::vector<std::thread::id> rank0_thread;
  for (int32_t round = 0; round < 200; ++round) {
    pool.run([&](int32_t rank) {
      ++runs[static_cast<size_t>(rank)];
      if (rank == 0) rank0_thread.push_back(std::this_thread::get_id());
    });
    for (int32_t r = 0; r < 4; ++r) ASSERT_EQ(runs[static_cast<size_t>(r)], round + 1) << "rank " << r;
  }
  for (const auto& id : rank0_thread) EXPECT_EQ(id, std::this_thread::get_id());
  RankPool single(1);
  int32_t calls = 0;
  single.run([&](int32_t rank) { calls += rank == 0 ? 1 : 100; });
  EXPECT_EQ(calls, 1);
}

// A rank that throws does not leave run() early or kill its thread: run()
// rethrows after every rank finished, and the pool serves the next run.
TEST(RankPool, RethrowsARanksExceptionAfterEveryRankFinished) {
  RankPool pool(3);
  for (int32_t thrower = 0; thrower < 3; ++thrower) {
    std::atomic<int32_t> finished{0};
    EXPECT_THROW(pool.run([&](int32_t rank) {
      if (rank == thrower) throw std::runtime_error("rank failed");
      std::this_thread::yield();
      finished.fetch_add(1);
    }),
                 std::runtime_error);
    EXPECT_EQ(finished.load(), 2) << "thrower " << thrower;
  }
  std::atomic<int32_t> runs{0};
  pool.run([&](int32_t) { runs.fetch_add(1); });
  EXPECT_EQ(runs.load(), 3);
}

}  // namespace
}  // namespace pd::engine
