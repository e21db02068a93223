// Model configuration: the subset of an HF config.json that the Llama, Qwen2,
// Qwen3 and Qwen3-MoE decoder families need, normalized into one struct, plus the
// block-FP8 quantization of the "-FP8" checkpoints. Both spellings of the
// rope settings are accepted: transformers <= 4 (`rope_theta` + `rope_scaling`)
// and transformers >= 5 (`rope_parameters`).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "common/status.h"

namespace pd::model {

enum class ModelFamily : uint8_t { kLlama, kQwen2, kQwen3, kQwen3Moe };
const char* model_family_name(ModelFamily family);

enum class RopeScalingType : uint8_t { kNone, kLlama3 };

struct RopeScaling {
  RopeScalingType type = RopeScalingType::kNone;
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int32_t original_max_position_embeddings = 8192;
};

// Qwen3-MoE's sparse MLP (HF Qwen3MoeSparseMoeBlock). num_experts == 0: dense model.
struct MoeConfig {
  int32_t num_experts = 0;               // "num_experts"
  int32_t num_experts_per_tok = 0;       // top-k
  int32_t moe_intermediate_size = 0;     // each expert's SwiGLU width
  bool norm_topk_prob = false;           // renormalise the top-k softmax weights to sum 1
  int32_t decoder_sparse_step = 1;       // layer l is sparse when (l + 1) % step == 0 ...
  std::vector<int32_t> mlp_only_layers;  // ... and l is not listed here
};

// Block-wise FP8 quantization as the Qwen "-FP8" releases ship it:
// quantization_config {quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128],
// activation_scheme: dynamic}. Quantised linears (attention q/k/v/o, dense and
// expert gate/up/down) store float8_e4m3fn weights [out, in] plus fp32
// `weight_scale_inv` [ceil(out/128), ceil(in/128)]; w = code * scale_inv of its
// block. Their inputs are quantised per token per 128-column group at run time.
// Embeddings, norms, lm_head and the MoE router stay unquantised.
enum class QuantMethod : uint8_t { kNone, kFp8Block };
struct QuantConfig {
  QuantMethod method = QuantMethod::kNone;
  int32_t block_out = 0;  // weight_block_size[0] (128)
  int32_t block_in = 0;   // weight_block_size[1] (128); also the activation group width
  bool fp8() const { return method == QuantMethod::kFp8Block; }
};

struct ModelConfig {
  std::string architecture;  // e.g. "Qwen3ForCausalLM"
  ModelFamily family = ModelFamily::kLlama;
  int32_t vocab_size = 0;
  int32_t hidden_size = 0;
  int32_t intermediate_size = 0;
  int32_t num_layers = 0;
  int32_t num_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;  // explicit in Qwen3 configs; hidden_size / num_heads otherwise
  float rms_norm_eps = 1e-6f;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  int32_t max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;               // Qwen2 always; Llama/Qwen3 when attention_bias
  bool o_bias = false;                 // Llama/Qwen3 when attention_bias
  bool qk_norm = false;                // Qwen3: RMSNorm over head_dim on q and k before RoPE
  std::vector<int32_t> eos_token_ids;  // from config.json (may be empty)
  MoeConfig moe;                       // Qwen3-MoE only
  QuantConfig quant;                   // from quantization_config

  int32_t q_size() const { return num_heads * head_dim; }
  // True when layer `layer`'s MLP is the sparse MoE block (HF Qwen3MoeDecoderLayer's rule).
  bool is_moe_layer(int32_t layer) const;
  int32_t kv_size() const { return num_kv_heads * head_dim; }
  // Checks internal consistency; the message names the field.
  Status validate() const;
};

// Parses a config.json document. Unsupported architectures or settings
// (another rope type, mlp_bias, an activation other than silu, a quantization
// other than block FP8 e4m3 [128, 128] dynamic) are errors naming the setting.
Result<ModelConfig> parse_model_config(const nlohmann::json& doc);
// Reads <model_dir>/config.json and, when present, adds the eos ids of
// <model_dir>/generation_config.json.
Result<ModelConfig> load_model_config(const std::filesystem::path& model_dir);

// The `builtin:tiny` model: Qwen3-shaped (explicit head_dim, q/k norm, tied
// embeddings) with the Qwen3 vocabulary size so the real Qwen3 tokenizer fits.
ModelConfig builtin_tiny_config();

}  // namespace pd::model
