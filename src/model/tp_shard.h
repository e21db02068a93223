// Megatron-style tensor-parallel split of a decoder over N ranks: which slice
// of each linear weight a rank holds, and the checks that refuse a split the
// model cannot take. Column-parallel linears (q/k/v, gate/up, expert gate/up)
// keep a range of output rows; row-parallel ones (o_proj, down_proj, expert
// down_proj) keep the matching range of input columns and their outputs are
// summed over the ranks. Embedding, norms, router and lm_head stay replicated.
// With expert parallelism the MoE experts are not cut: rank r holds experts
// [r * E / N, (r + 1) * E / N) whole, attention stays tensor-parallel.
#pragma once

#include <cstdint>
#include <utility>

#include "common/status.h"
#include "model/config.h"

namespace pd::model {

struct TpSplit {
  int32_t tp_size = 1;
  int32_t heads_per_rank = 0;     // attention (query) heads of a rank
  int32_t kv_heads_per_rank = 0;  // 1 when tp_size > num_kv_heads (replicated KV heads)
  int32_t intermediate_per_rank = 0;
  int32_t moe_intermediate_per_rank = 0;  // the whole moe_intermediate_size with expert parallelism
  bool expert_parallel = false;
  // Experts a rank holds: num_experts / tp_size whole ones with expert
  // parallelism, else every expert (a slice of each); 0 for a dense model.
  int32_t experts_per_rank = 0;
  // The first expert of rank `rank` (0 without expert parallelism).
  int32_t expert_begin(int32_t rank) const { return expert_parallel ? rank * experts_per_rank : 0; }
  // The first KV head of rank `rank`: rank * kv_heads_per_rank when the KV heads
  // are split; rank * num_kv_heads / tp_size (each head on tp_size / num_kv_heads
  // ranks) when they are replicated.
  int32_t kv_head_begin(int32_t rank, int32_t num_kv_heads) const;
};

// Checks the split and returns it. Refused: tp_size < 1; num_heads not a
// multiple of tp_size; num_kv_heads and tp_size where neither divides the
// other; an MLP or expert intermediate size not a multiple of tp_size; and, for
// block-FP8 checkpoints, a split that would cut a 128 x 128 scale block (the
// error names the first such tensor). expert_parallel: the experts are
// sharded whole instead of split by intermediate size; refused for a model
// without MoE layers and when tp_size does not divide num_experts (the expert
// intermediate size is then not checked: no expert is cut).
Result<TpSplit> plan_tensor_parallel(const ModelConfig& config, int32_t tp_size, bool expert_parallel = false);

// The token rows [first, second) that rank `rank` of `num_ranks` owns in the
// expert-parallel exchange: contiguous, in rank order, sizes differing by at
// most one (a rank may own none when num_tokens < num_ranks).
std::pair<int32_t, int32_t> token_slice(int32_t rank, int32_t num_ranks, int32_t num_tokens);

}  // namespace pd::model
