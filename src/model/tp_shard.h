// Megatron-style tensor-parallel split of a decoder over N ranks: which slice
// of each linear weight a rank holds, and the checks that refuse a split the
// model cannot take. Column-parallel linears (q/k/v, gate/up, expert gate/up)
// keep a range of output rows; row-parallel ones (o_proj, down_proj, expert
// down_proj) keep the matching range of input columns and their outputs are
// summed over the ranks. Embedding, norms, router and lm_head stay replicated.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"
#include "model/config.h"

namespace pd::model {

struct TpSplit {
  int32_t tp_size = 1;
  int32_t heads_per_rank = 0;     // attention (query) heads of a rank
  int32_t kv_heads_per_rank = 0;  // 1 when tp_size > num_kv_heads (replicated KV heads)
  int32_t intermediate_per_rank = 0;
  int32_t moe_intermediate_per_rank = 0;
  // The first KV head of rank `rank`: rank * kv_heads_per_rank when the KV heads
  // are split; rank * num_kv_heads / tp_size (each head on tp_size / num_kv_heads
  // ranks) when they are replicated.
  int32_t kv_head_begin(int32_t rank, int32_t num_kv_heads) const;
};

// Checks the split and returns it. Refused: tp_size < 1; num_heads not a
// multiple of tp_size; num_kv_heads and tp_size where neither divides the
// other; an MLP or expert intermediate size not a multiple of tp_size; and, for
// block-FP8 checkpoints, a split that would cut a 128 x 128 scale block (the
// error names the first such tensor).
Result<TpSplit> plan_tensor_parallel(const ModelConfig& config, int32_t tp_size);

// Rows [row_begin, row_end) of a row-major [rows][cols] matrix (a column-parallel slice).
std::vector<float> slice_rows(const float* w, int64_t cols, int64_t row_begin, int64_t row_end);
// Columns [col_begin, col_end) of every row of a row-major [rows][cols] matrix (a row-parallel slice).
std::vector<float> slice_cols(const float* w, int64_t rows, int64_t cols, int64_t col_begin, int64_t col_end);

}  // namespace pd::model
