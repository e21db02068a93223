// Model configuration: the subset of an HF config.json that the Llama, Qwen2 and
// Qwen3 decoder families need, normalized into one struct. Both spellings of the
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

enum class ModelFamily : uint8_t { kLlama, kQwen2, kQwen3 };
const char* model_family_name(ModelFamily family);

enum class RopeScalingType : uint8_t { kNone, kLlama3 };

struct RopeScaling {
  RopeScalingType type = RopeScalingType::kNone;
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int32_t original_max_position_embeddings = 8192;
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

  int32_t q_size() const { return num_heads * head_dim; }
  int32_t kv_size() const { return num_kv_heads * head_dim; }
  // Checks internal consistency; the message names the field.
  Status validate() const;
};

// Parses a config.json document. Unsupported architectures or settings
// (another rope type, mlp_bias, an activation other than silu) are errors.
Result<ModelConfig> parse_model_config(const nlohmann::json& doc);
// Reads <model_dir>/config.json and, when present, adds the eos ids of
// <model_dir>/generation_config.json.
Result<ModelConfig> load_model_config(const std::filesystem::path& model_dir);

// The `builtin:tiny` model: Qwen3-shaped (explicit head_dim, q/k norm, tied
// embeddings) with the Qwen3 vocabulary size so the real Qwen3 tokenizer fits.
ModelConfig builtin_tiny_config();

}  // namespace pd::model
