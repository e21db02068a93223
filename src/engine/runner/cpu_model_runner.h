// The CPU model runner: fp32 reference forward pass of the Llama / Qwen2 /
// Qwen3 / Qwen3-MoE decoder (bf16 or block-FP8 weights) over a paged KV cache
// (fp32 or fp8 e4m3 with per-(token, head) scales), then sampling through the
// engine's sampler. Called only from the engine thread; with tensor_parallel_size
// N > 1 each step runs on N ranks (threads of a RankPool, Megatron-style split,
// partial sums reduced in rank order), giving the same greedy tokens as N = 1.
#pragma once

#include <memory>
#include <vector>

#include "engine/model_runner.h"
#include "engine/runner/rank_pool.h"
#include "kernels/cpu/cpu_kernels.h"
#include "model/config.h"
#include "model/tp_shard.h"
#include "model/weights.h"

namespace pd::engine {

class CpuModelRunner final : public ModelRunner {
 public:
  // num_kv_blocks blocks of block_size tokens per layer; positions must stay
  // below max_model_len. kv_dtype: kFloat32 or kFp8E4m3 (KvCacheSpec's layout).
  // Fails when a weight is missing, mis-shaped or of the wrong dtype. FP8
  // weights are dequantised here, once (w = code * scale_inv of its block).
  // tensor_parallel_size: ranks of the step (model::plan_tensor_parallel's
  // checks; each rank keeps its slice of every split weight and of every KV block).
  // enable_expert_parallel: each rank keeps num_experts / N whole experts instead.
  static Result<std::unique_ptr<CpuModelRunner>> create(model::ModelConfig config, model::ModelWeights weights,
                                                        int32_t block_size, int32_t num_kv_blocks,
                                                        int32_t max_model_len, KvDtype kv_dtype = KvDtype::kFloat32,
                                                        int32_t tensor_parallel_size = 1,
                                                        bool enable_expert_parallel = false);

  const KvCacheSpec& kv_cache_spec() const override { return spec_; }
  int32_t vocab_size() const override { return config_.vocab_size; }
  Result<StepOutput> execute(const StepInput& input) override;
  // The layer's KV region at tensor_parallel_size 1; null with more ranks (each
  // rank has its own region: kv_layer_base(rank, layer), the connector's
  // kv_rank_layer_base).
  void* kv_layer_base(int32_t layer) override;
  void* kv_layer_base(int32_t rank, int32_t layer);
  int32_t kv_num_ranks() const override { return split_.tp_size; }
  int32_t kv_heads_per_rank() const override { return split_.kv_heads_per_rank; }
  int32_t kv_rank_head_begin(int32_t rank) const override { return split_.kv_head_begin(rank, config_.num_kv_heads); }
  void* kv_rank_layer_base(int32_t rank, int32_t layer) override { return kv_layer_base(rank, layer); }
  int32_t tensor_parallel_size() const { return split_.tp_size; }
  const model::TpSplit& tp_split() const { return split_; }
  bool kv_on_device() const override { return false; }

  const model::ModelConfig& config() const { return config_; }
  int32_t max_model_len() const { return max_model_len_; }

  // Which logits rows forward() returns.
  enum class LogitsRows : uint8_t {
    kSampled,  // one row per SeqStep with sample == true (its last new token), in seqs order
    kAll,      // one row per new token, in StepInput::token_ids order
    // per SeqStep in seqs order: its num_prompt_logprob_rows rows (from its first
    // new token), then its sampled row when sample == true
    kSampledAndPrompt,
  };
  // Runs the forward pass (writing KV for every new token) and returns the
  // requested rows of logits, row-major [rows][vocab_size].
  Result<std::vector<float>> forward(const StepInput& input, LogitsRows rows);

 private:
  // A linear layer's fp32 weight [out][in] (dequantised when the checkpoint is
  // FP8) and bias; fp8_input: quantise the input per token per 128 columns first.
  struct Linear {
    const float* weight = nullptr;
    const float* bias = nullptr;
    bool fp8_input = false;
  };
  struct Expert {
    Linear gate_proj, up_proj, down_proj;
  };
  struct LayerPtrs {
    const float* input_norm = nullptr;
    Linear q_proj, k_proj, v_proj;
    const float* q_norm = nullptr;  // null unless Qwen3 / Qwen3-MoE
    const float* k_norm = nullptr;
    Linear o_proj;
    const float* post_norm = nullptr;
    Linear gate_proj, up_proj, down_proj;  // dense MLP (when router == nullptr)
    const float* router = nullptr;         // MoE: [num_experts][hidden]
    std::vector<Expert> experts;           // MoE: num_experts
  };

  // One tensor-parallel rank: its weight slices, its KV regions and its
  // per-step buffers (touched only by that rank's thread during run()).
  struct Rank {
    std::vector<LayerPtrs> layers;
    kernels::cpu::PagedKvLayout layout;  // kv_heads_per_rank heads
    // One contiguous KV region per layer (kv_f32 or kv_fp8 by spec_.dtype),
    // allocated without zero-fill: a slot is read only after this runner or a
    // KV transfer wrote it.
    std::vector<std::unique_ptr<float[]>> kv_f32;
    std::vector<std::unique_ptr<uint8_t[]>> kv_fp8;
    std::vector<float> q, k, v, attn, gate, up, partial, scratch, quant_scratch;
    std::vector<float> xs, out;  // MoE rows of one expert
    // Expert parallelism: (row, weight) per local expert of the current layer.
    std::vector<std::vector<std::pair<int32_t, float>>> local_routed;
  };

  CpuModelRunner() = default;
  // forward() up to the final norm: the normed hidden rows [rows][hidden_size].
  Result<std::vector<float>> forward_hidden(const StepInput& input, LogitsRows rows);
  Status validate(const StepInput& input) const;
  // out[m][out] = linear(x[m][in]); `scratch` holds the quantised input when needed.
  void run_linear(const Linear& l, const float* x, int32_t m, int32_t n, int32_t k, float* out,
                  std::vector<float>* scratch) const;
  // rank.partial = this rank's share of the Qwen3-MoE sparse block of x (rows t).
  void run_moe(Rank& rank, const LayerPtrs& w, const float* x, int32_t t,
               const std::vector<std::vector<std::pair<int32_t, float>>>& routed);
  // The MoE block with expert parallelism: dispatch (each rank routes its token
  // slice; all-gather of the routed tokens), every rank's experts over the rows
  // routed to them, combine (reduce-scatter in rank order into delta's slices).
  void run_expert_parallel_moe(size_t layer, const float* x, int32_t t, float* delta);
  // delta = sum over the ranks' `partial`, in rank order.
  void all_reduce(int64_t count, float* delta);

  model::ModelConfig config_;
  model::ModelWeights weights_;
  KvCacheSpec spec_;
  int32_t max_model_len_ = 0;
  model::TpSplit split_;
  std::unique_ptr<RankPool> pool_;
  std::vector<Rank> ranks_;
  std::vector<float> inv_freq_;
  const float* embed_ = nullptr;
  const float* final_norm_ = nullptr;
  const float* lm_head_ = nullptr;  // the embedding table when tied
  // fp32 copies of the FP8 weights (the codes in weights_ are not read by the
  // forward pass), and the ranks' slices when tensor_parallel_size > 1.
  std::vector<std::vector<float>> dequantised_;
};

}  // namespace pd::engine
