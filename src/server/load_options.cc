#include "server/load_options.h"

namespace pd::server {

engine::ModelLoadOptions model_load_options(const ServerConfig& config) {
  engine::ModelLoadOptions options;
  options.model = config.model;
  options.load_format = config.load_format;
  options.device = config.device;
  options.seed = config.seed;
  options.block_size = config.block_size;
  options.kv_cache_bytes = config.kv_cache_bytes;
  options.kv_cache_dtype = config.kv_cache_dtype;
  options.num_kv_blocks = static_cast<int32_t>(config.num_kv_blocks);
  options.max_model_len = config.max_model_len.value_or(0);
  options.tensor_parallel_size = config.tensor_parallel_size;
  options.enable_expert_parallel = config.enable_expert_parallel;
  options.cuda_device = config.cuda_device;
  options.gpu_memory_utilization = config.gpu_memory_utilization;
  options.max_num_seqs = config.max_num_seqs;
  options.max_num_batched_tokens = config.max_num_batched_tokens;
  return options;
}

}  // namespace pd::server
