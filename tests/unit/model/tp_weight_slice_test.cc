// The rank slices a fused-weight loader uploads (model/tp_weight_slice.h): at
// TP 1 whole tensors; at TP N the ranks' rows tile every column-parallel tensor
// and their columns tile every row-parallel one, replicated KV heads land on the
// ranks whose query heads use them, the row-parallel partial products sum to the
// full product, and FP8 slices keep their own 128x128 scale blocks.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "model/config.h"
#include "model/tp_shard.h"
#include "model/tp_weight_slice.h"
#include "model/weights.h"

namespace pd::model {
namespace {

ModelConfig dense_config(int32_t heads, int32_t kv_heads, int32_t head_dim, int32_t hidden, int32_t inter) {
  ModelConfig c;
  c.family = ModelFamily::kQwen3;
  c.architecture = "Qwen3ForCausalLM";
  c.vocab_size = 64;
  c.hidden_size = hidden;
  c.intermediate_size = inter;
  c.num_layers = 1;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = head_dim;
  c.max_position_embeddings = 64;
  return c;
}

std::vector<float> ramp(int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = std::sin(0.37f * static_cast<float>(i)) + 0.01f * i;
  return v;
}

TEST(TpWeightSlice, TensorParallelOneTakesEveryTensorWhole) {
  const ModelConfig c = dense_config(8, 2, 16, 128, 256);
  auto split = plan_tensor_parallel(c, 1);
  ASSERT_TRUE(split.ok());
  for (FusedLinear which : {FusedLinear::kQkv, FusedLinear::kOProj, FusedLinear::kGateUp, FusedLinear::kDown}) {
    for (const LinearPart& p : rank_linear_parts(c, *split, 0, "model.layers.0.", which)) {
      EXPECT_TRUE(p.whole()) << p.base;
    }
  }
  const auto qkv = rank_linear_parts(c, *split, 0, "model.layers.0.", FusedLinear::kQkv);
  ASSERT_EQ(qkv.size(), 3u);
  EXPECT_EQ(qkv[0].base, "model.layers.0.self_attn.q_proj");
  EXPECT_EQ(qkv[1].fused_row_offset, 8 * 16);
  EXPECT_EQ(qkv[2].fused_row_offset, 10 * 16);
  EXPECT_EQ(qkv[2].fused_rows, 12 * 16);
}

TEST(TpWeightSlice, SplitKvHeadsAndMlpRowsTileTheTensorsAcrossRanks) {
  const ModelConfig c = dense_config(8, 4, 16, 128, 256);
  auto split = plan_tensor_parallel(c, 2);
  ASSERT_TRUE(split.ok());
  // Each tensor's rows (column-parallel) or columns (row-parallel) are covered once.
  for (FusedLinear which : {FusedLinear::kQkv, FusedLinear::kOProj, FusedLinear::kGateUp, FusedLinear::kDown}) {
    const size_t num_parts = rank_linear_parts(c, *split, 0, "model.layers.0.", which).size();
    for (size_t k = 0; k < num_parts; ++k) {
      int64_t next = 0;
      for (int32_t rank = 0; rank < 2; ++rank) {
        const LinearPart p = rank_linear_parts(c, *split, rank, "model.layers.0.", which)[k];
        const bool column_parallel = which == FusedLinear::kQkv || which == FusedLinear::kGateUp;
        EXPECT_EQ(column_parallel ? p.row_begin : p.col_begin, next) << p.base << " rank " << rank;
        next = column_parallel ? p.row_end : p.col_end;
        EXPECT_EQ(column_parallel ? p.slice_cols() : p.slice_rows(), column_parallel ? p.cols : p.rows);
      }
      const LinearPart last = rank_linear_parts(c, *split, 1, "model.layers.0.", which)[k];
      EXPECT_EQ(next, which == FusedLinear::kQkv || which == FusedLinear::kGateUp ? last.rows : last.cols);
    }
  }
}

TEST(TpWeightSlice, ReplicatedKvHeadServesTheRanksOfItsQueryGroup) {
  // 8 query heads, 2 KV heads, TP 4: ranks 0-1 hold query heads 0-3 (KV head 0), ranks 2-3 heads 4-7 (KV head 1).
  const ModelConfig c = dense_config(8, 2, 16, 128, 256);
  auto split = plan_tensor_parallel(c, 4);
  ASSERT_TRUE(split.ok());
  for (int32_t rank = 0; rank < 4; ++rank) {
    const auto qkv = rank_linear_parts(c, *split, rank, "model.layers.0.", FusedLinear::kQkv);
    const int64_t first_q_head = qkv[0].row_begin / 16;
    const int64_t kv_head = qkv[1].row_begin / 16;
    EXPECT_EQ(qkv[1].slice_rows(), 16);
    EXPECT_EQ(kv_head, first_q_head / (8 / 2)) << "rank " << rank;
    EXPECT_EQ(qkv[2].row_begin, qkv[1].row_begin);
  }
}

TEST(TpWeightSlice, ExpertPartsSplitTheMoeIntermediate) {
  ModelConfig c = dense_config(4, 4, 16, 64, 128);
  c.family = ModelFamily::kQwen3Moe;
  c.moe.num_experts = 4;
  c.moe.num_experts_per_tok = 2;
  c.moe.moe_intermediate_size = 96;
  c.moe.decoder_sparse_step = 1;
  auto split = plan_tensor_parallel(c, 2);
  ASSERT_TRUE(split.ok());
  const auto gate_up = rank_linear_parts(c, *split, 1, "model.layers.0.mlp.experts.3.", FusedLinear::kGateUp, true);
  ASSERT_EQ(gate_up.size(), 2u);
  EXPECT_EQ(gate_up[0].base, "model.layers.0.mlp.experts.3.gate_proj");
  EXPECT_EQ(gate_up[0].row_begin, 48);
  EXPECT_EQ(gate_up[0].row_end, 96);
  EXPECT_EQ(gate_up[1].fused_row_offset, 96);
  const auto down = rank_linear_parts(c, *split, 1, "model.layers.0.mlp.experts.3.", FusedLinear::kDown, true);
  EXPECT_EQ(down[0].col_begin, 48);
  EXPECT_EQ(down[0].col_end, 96);
  EXPECT_EQ(down[0].rows, 64);
}

TEST(TpWeightSlice, ExpertParallelRanksHoldTheirExpertsWhole) {
  ModelConfig c = dense_config(4, 4, 16, 64, 128);
  c.family = ModelFamily::kQwen3Moe;
  c.moe.num_experts = 4;
  c.moe.num_experts_per_tok = 2;
  c.moe.moe_intermediate_size = 96;
  c.moe.decoder_sparse_step = 1;
  auto split = plan_tensor_parallel(c, 2, /*expert_parallel=*/true);
  ASSERT_TRUE(split.ok());
  for (int32_t rank = 0; rank < 2; ++rank) {
    for (FusedLinear which : {FusedLinear::kGateUp, FusedLinear::kDown}) {
      for (const LinearPart& p : rank_linear_parts(c, *split, rank, "model.layers.0.mlp.experts.3.", which, true))
        EXPECT_TRUE(p.whole()) << p.base << " at rank " << rank;
    }
    // Attention stays tensor-parallel.
    const auto qkv = rank_linear_parts(c, *split, rank, "model.layers.0.", FusedLinear::kQkv);
    EXPECT_EQ(qkv[0].row_begin, rank * 32);
    EXPECT_EQ(qkv[0].row_end, rank * 32 + 32);
  }
}

TEST(TpWeightSlice, RowParallelPartialProductsSumToTheFullProduct) {
  const ModelConfig c = dense_config(8, 4, 16, 32, 64);
  auto split = plan_tensor_parallel(c, 4);
  ASSERT_TRUE(split.ok());
  const int64_t rows = c.hidden_size, cols = c.intermediate_size;
  const std::vector<float> w = ramp(rows * cols), x = ramp(cols);
  std::vector<float> full(static_cast<size_t>(rows), 0.0f), summed(static_cast<size_t>(rows), 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < cols; ++k) full[static_cast<size_t>(r)] += w[static_cast<size_t>(r * cols + k)] * x[k];
  for (int32_t rank = 0; rank < 4; ++rank) {
    const LinearPart p = rank_linear_parts(c, *split, rank, "model.layers.0.", FusedLinear::kDown)[0];
    const std::vector<float> slice = copy_part(w.data(), p);
    ASSERT_EQ(static_cast<int64_t>(slice.size()), rows * p.slice_cols());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < p.slice_cols(); ++k)
        summed[static_cast<size_t>(r)] +=
            slice[static_cast<size_t>(r * p.slice_cols() + k)] * x[static_cast<size_t>(p.col_begin + k)];
  }
  for (int64_t r = 0; r < rows; ++r) EXPECT_NEAR(summed[static_cast<size_t>(r)], full[static_cast<size_t>(r)], 1e-3);
}

TEST(TpWeightSlice, ColumnParallelSliceAndBiasAreTheRanksRows) {
  const ModelConfig c = dense_config(8, 4, 16, 32, 64);
  auto split = plan_tensor_parallel(c, 2);
  ASSERT_TRUE(split.ok());
  const LinearPart k = rank_linear_parts(c, *split, 1, "model.layers.0.", FusedLinear::kQkv)[1];
  const std::vector<float> w = ramp(k.rows * k.cols), bias = ramp(k.rows);
  const std::vector<float> slice = copy_part(w.data(), k);
  ASSERT_EQ(static_cast<int64_t>(slice.size()), k.slice_rows() * k.cols);
  EXPECT_EQ(slice.front(), w[static_cast<size_t>(k.row_begin * k.cols)]);
  EXPECT_EQ(slice.back(), w[static_cast<size_t>(k.row_end * k.cols - 1)]);
  const std::vector<float> b = copy_bias_part(bias.data(), k);
  ASSERT_EQ(static_cast<int64_t>(b.size()), k.slice_rows());
  EXPECT_EQ(b.front(), bias[static_cast<size_t>(k.row_begin)]);
}

TEST(TpWeightSlice, Fp8SliceDequantisesToTheSliceOfTheDequantisedTensor) {
  // down_proj [256][384] (partial last column block), TP 3 keeps 128 columns each.
  ModelConfig c = dense_config(3, 3, 128, 256, 384);
  auto split = plan_tensor_parallel(c, 3);
  ASSERT_TRUE(split.ok());
  const int64_t rows = 256, cols = 384;
  const std::vector<float> w = ramp(rows * cols);
  std::vector<uint8_t> codes(static_cast<size_t>(rows * cols));
  std::vector<float> scales(static_cast<size_t>(2 * 3));
  quantize_fp8_blocks(w.data(), rows, cols, codes.data(), scales.data());
  std::vector<float> dense(w.size());
  dequantize_fp8_blocks(codes.data(), scales.data(), rows, cols, dense.data());
  for (int32_t rank = 0; rank < 3; ++rank) {
    const LinearPart p = rank_linear_parts(c, *split, rank, "model.layers.0.", FusedLinear::kDown)[0];
    auto part = copy_fp8_part(codes.data(), scales.data(), p);
    ASSERT_TRUE(part.ok()) << part.status().message();
    ASSERT_EQ(part->scale_inv.size(), 2u);
    std::vector<float> got(static_cast<size_t>(p.slice_rows() * p.slice_cols()));
    dequantize_fp8_blocks(part->codes.data(), part->scale_inv.data(), p.slice_rows(), p.slice_cols(), got.data());
    EXPECT_EQ(got, copy_part(dense.data(), p)) << "rank " << rank;
  }
}

TEST(TpWeightSlice, Fp8SliceOffItsScaleBlocksIsRefused) {
  LinearPart p;
  p.base = "model.layers.0.mlp.down_proj";
  p.rows = 128;
  p.cols = 256;
  p.row_end = 128;
  p.col_begin = 64;
  p.col_end = 192;
  std::vector<uint8_t> codes(128 * 256);
  std::vector<float> scales(2, 1.0f);
  auto part = copy_fp8_part(codes.data(), scales.data(), p);
  ASSERT_FALSE(part.ok());
  EXPECT_EQ(part.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(part.status().message().find("down_proj"), std::string::npos);
}

}  // namespace
}  // namespace pd::model
