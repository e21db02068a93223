// The CPU model runner: fp32 reference forward pass of the Llama / Qwen2 /
// Qwen3 decoder over a paged KV cache, then sampling through the engine's
// sampler. Single-threaded; called only from the engine thread.
#pragma once

#include <memory>
#include <vector>

#include "engine/model_runner.h"
#include "kernels/cpu/cpu_kernels.h"
#include "model/config.h"
#include "model/weights.h"

namespace pd::engine {

class CpuModelRunner final : public ModelRunner {
 public:
  // num_kv_blocks blocks of block_size tokens per layer; positions must stay
  // below max_model_len. Fails when a weight is missing or mis-shaped.
  static Result<std::unique_ptr<CpuModelRunner>> create(model::ModelConfig config, model::ModelWeights weights,
                                                        int32_t block_size, int32_t num_kv_blocks,
                                                        int32_t max_model_len);

  const KvCacheSpec& kv_cache_spec() const override { return spec_; }
  int32_t vocab_size() const override { return config_.vocab_size; }
  Result<StepOutput> execute(const StepInput& input) override;
  void* kv_layer_base(int32_t layer) override;
  bool kv_on_device() const override { return false; }

  const model::ModelConfig& config() const { return config_; }
  int32_t max_model_len() const { return max_model_len_; }

  // Which logits rows forward() returns.
  enum class LogitsRows : uint8_t {
    kSampled,  // one row per SeqStep with sample == true (its last new token), in seqs order
    kAll,      // one row per new token, in StepInput::token_ids order
  };
  // Runs the forward pass (writing KV for every new token) and returns the
  // requested rows of logits, row-major [rows][vocab_size].
  Result<std::vector<float>> forward(const StepInput& input, LogitsRows rows);

 private:
  struct LayerPtrs {
    const float* input_norm;
    const float* q_proj;
    const float* k_proj;
    const float* v_proj;
    const float* q_bias;  // null when the family has no qkv bias
    const float* k_bias;
    const float* v_bias;
    const float* q_norm;  // null unless Qwen3
    const float* k_norm;
    const float* o_proj;
    const float* o_bias;
    const float* post_norm;
    const float* gate_proj;
    const float* up_proj;
    const float* down_proj;
  };

  CpuModelRunner() = default;
  Status validate(const StepInput& input) const;

  model::ModelConfig config_;
  model::ModelWeights weights_;
  KvCacheSpec spec_;
  int32_t max_model_len_ = 0;
  kernels::cpu::PagedKvLayout layout_;
  std::vector<float> inv_freq_;
  const float* embed_ = nullptr;
  const float* final_norm_ = nullptr;
  const float* lm_head_ = nullptr;  // the embedding table when tied
  std::vector<LayerPtrs> layers_;
  // One contiguous KV region per layer, allocated without zero-fill: a slot is
  // read only after this runner or a KV transfer wrote it.
  std::vector<std::unique_ptr<float[]>> kv_;
};

}  // namespace pd::engine
