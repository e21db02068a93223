// Builds a ModelRunner from a model name: an HF directory (config.json +
// safetensors) or "builtin:tiny". The server calls this once at start-up.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/model_runner.h"

namespace pd::engine {

struct ModelLoadOptions {
  std::string model = "builtin:tiny";  // HF directory or "builtin:tiny"
  std::string load_format = "auto";    // auto | safetensors | dummy
  std::string device = "cpu";          // cpu (cuda comes from the CUDA runner)
  uint64_t seed = 0;                   // dummy weights seed
  int32_t block_size = 16;
  int64_t kv_cache_bytes = 0;  // 0 = default (CPU: 256 MiB); num_kv_blocks overrides when > 0
  int32_t num_kv_blocks = 0;
  // auto: the device's default (cpu float32, cuda bfloat16); fp8: e4m3 values with
  // one fp32 scale per (token, kv head) inside each block (KvCacheSpec).
  std::string kv_cache_dtype = "auto";
  int32_t max_model_len = 0;  // 0 = min(config max_position_embeddings, 4096)
  // Ranks of the tensor-parallel split (cpu only: threads of this process).
  int32_t tensor_parallel_size = 1;
  // MoE experts sharded whole over the ranks (cpu only in this build).
  bool enable_expert_parallel = false;
  // cuda only: fraction of device memory for weights + KV, and the largest
  // batch the runner must hold (sizes its pinned step buffers and graph buckets).
  double gpu_memory_utilization = 0.9;
  int32_t cuda_device = 0;  // device ordinal
  int32_t max_num_seqs = 256;
  int32_t max_num_batched_tokens = 8192;
};

struct LoadedModel {
  std::string architecture;  // e.g. "Qwen3ForCausalLM"
  std::unique_ptr<ModelRunner> runner;
  std::filesystem::path tokenizer_dir;  // where tokenizer files live ("" if none)
  int32_t max_model_len = 0;
  std::vector<int32_t> eos_token_ids;  // from config.json / generation_config.json
};

inline constexpr int64_t kDefaultCpuKvCacheBytes = 256ll << 20;
inline constexpr int32_t kDefaultMaxModelLen = 4096;

Result<LoadedModel> load_model(const ModelLoadOptions& options);

// The project's assets directory: $PDSERVE_ASSETS_DIR, else
// <dir of /proc/self/exe>/../../assets, else the source tree's assets/ (a
// compile-time path). Empty when none of them exists.
std::filesystem::path find_assets_dir();

}  // namespace pd::engine
