#include "model/tp_shard.h"

#include <algorithm>
#include <string>
#include <vector>

#include "model/fp8.h"

namespace pd::model {

int32_t TpSplit::kv_head_begin(int32_t rank, int32_t num_kv_heads) const {
  if (tp_size <= num_kv_heads) return rank * kv_heads_per_rank;
  return static_cast<int32_t>(static_cast<int64_t>(rank) * num_kv_heads / tp_size);
}

Result<TpSplit> plan_tensor_parallel(const ModelConfig& c, int32_t tp, bool expert_parallel) {
  if (tp < 1) return invalid_argument("tensor_parallel_size must be >= 1, got {}", tp);
  if (c.num_heads % tp != 0)
    return invalid_argument("tensor_parallel_size {} must divide the number of attention heads ({})", tp, c.num_heads);
  if (c.num_kv_heads % tp != 0 && tp % c.num_kv_heads != 0)
    return invalid_argument(
        "tensor_parallel_size {} and the number of KV heads ({}) must divide one another (split or replicate them)", tp,
        c.num_kv_heads);
  bool any_dense = false, any_moe = false;
  for (int32_t l = 0; l < c.num_layers; ++l) (c.is_moe_layer(l) ? any_moe : any_dense) = true;
  if (any_dense && c.intermediate_size % tp != 0)
    return invalid_argument("tensor_parallel_size {} must divide intermediate_size ({})", tp, c.intermediate_size);
  if (expert_parallel && !any_moe)
    return invalid_argument("enable_expert_parallel needs a MoE model; {} has no MoE layer", c.architecture);
  if (expert_parallel && c.moe.num_experts % tp != 0)
    return invalid_argument(
        "enable_expert_parallel: tensor_parallel_size {} must divide the number of experts ({}) so every rank "
        "holds as many whole experts",
        tp, c.moe.num_experts);
  if (any_moe && !expert_parallel && c.moe.moe_intermediate_size % tp != 0)
    return invalid_argument("tensor_parallel_size {} must divide moe_intermediate_size ({})", tp,
                            c.moe.moe_intermediate_size);
  TpSplit s;
  s.tp_size = tp;
  s.heads_per_rank = c.num_heads / tp;
  s.kv_heads_per_rank = std::max(1, c.num_kv_heads / tp);
  s.intermediate_per_rank = any_dense ? c.intermediate_size / tp : 0;
  s.expert_parallel = expert_parallel;
  s.moe_intermediate_per_rank = !any_moe          ? 0
                                : expert_parallel ? c.moe.moe_intermediate_size
                                                  : c.moe.moe_intermediate_size / tp;
  s.experts_per_rank = !any_moe ? 0 : expert_parallel ? c.moe.num_experts / tp : c.moe.num_experts;
  if (tp > 1 && c.quant.fp8()) {
    // Every slice must start on a block boundary: each rank's extent of the split dimension is a multiple of 128.
    const int64_t b = kFp8BlockSize;
    const std::string l0 = "model.layers.0.";
    int32_t first_moe = 0;
    while (any_moe && !c.is_moe_layer(first_moe)) ++first_moe;
    const std::string lm = "model.layers." + std::to_string(first_moe) + ".mlp.experts.0.";
    struct Cut {
      std::string tensor;
      int64_t extent;
    };
    std::vector<Cut> cuts = {
        {l0 + "self_attn.q_proj.weight", static_cast<int64_t>(s.heads_per_rank) * c.head_dim},
        {l0 + "self_attn.k_proj.weight", static_cast<int64_t>(s.kv_heads_per_rank) * c.head_dim},
        {l0 + "self_attn.v_proj.weight", static_cast<int64_t>(s.kv_heads_per_rank) * c.head_dim},
        {l0 + "self_attn.o_proj.weight", static_cast<int64_t>(s.heads_per_rank) * c.head_dim},
    };
    if (any_dense) {
      std::string ld = l0;
      for (int32_t l = 0; l < c.num_layers; ++l)
        if (!c.is_moe_layer(l)) {
          ld = "model.layers." + std::to_string(l) + ".";
          break;
        }
      cuts.push_back({ld + "mlp.gate_proj.weight", s.intermediate_per_rank});
      cuts.push_back({ld + "mlp.up_proj.weight", s.intermediate_per_rank});
      cuts.push_back({ld + "mlp.down_proj.weight", s.intermediate_per_rank});
    }
    if (any_moe && !expert_parallel) {  // whole experts keep their scale blocks whole
      cuts.push_back({lm + "gate_proj.weight", s.moe_intermediate_per_rank});
      cuts.push_back({lm + "up_proj.weight", s.moe_intermediate_per_rank});
      cuts.push_back({lm + "down_proj.weight", s.moe_intermediate_per_rank});
    }
    for (const Cut& cut : cuts)
      if (cut.extent % b != 0)
        return invalid_argument(
            "tensor_parallel_size {} would cut the 128x128 FP8 scale blocks of '{}' (each rank's slice is {} wide, "
            "not a multiple of 128)",
            tp, cut.tensor, cut.extent);
  }
  return s;
}

std::pair<int32_t, int32_t> token_slice(int32_t rank, int32_t num_ranks, int32_t num_tokens) {
  const auto at = [&](int32_t r) { return static_cast<int32_t>(static_cast<int64_t>(num_tokens) * r / num_ranks); };
  return {at(rank), at(rank + 1)};
}

}  // namespace pd::model
