// CudaModelRunner's FP8 KV cache parts (--kv-cache-dtype fp8): the prefill staging area
// and the benchmark fill. The KV write, decode and prefill dispatch are in forward().
#include <algorithm>

#include "engine/runner_cuda/cuda_model_runner.h"

namespace pd::engine {

namespace kc = pd::kernels::cuda;

Status CudaModelRunner::create_fp8_kv_prefill() {
  // Enough for one pass's new tokens plus a partial block per sequence; a pass whose prefill
  // contexts need more runs its prefill attention in several groups (any one sequence fits).
  const int32_t pass_blocks =
      (options_.max_num_batched_tokens + options_.block_size - 1) / options_.block_size + options_.max_num_seqs;
  PD_ASSIGN_OR_RETURN(fp8_kv_prefill_,
                      Fp8KvPrefill::create(std::max(max_blocks_per_seq_, pass_blocks), options_.max_num_seqs,
                                           max_blocks_per_seq_, options_.block_size, kv_heads_, config_.head_dim));
  return Status::Ok();
}

Status CudaModelRunner::fill_fp8_kv_random(uint64_t seed) {
  // Codes uniform in [-1, 1) (as the bf16 fill's values), every scale 0x3f3f3f3f (0.747), so
  // the cache holds finite values of the bf16 fill's magnitude.
  const size_t blocks = static_cast<size_t>(spec_.num_blocks) * static_cast<size_t>(config_.num_layers);
  const size_t codes = 2ull * spec_.block_size * spec_.num_kv_heads * spec_.head_dim;
  const size_t scale_bytes = 2ull * spec_.block_size * spec_.num_kv_heads * sizeof(float);
  PD_RETURN_IF_ERROR(
      kc::fill_uniform_fp8(static_cast<uint8_t*>(kv_pool_), blocks * spec_.bytes_per_block(), seed, 1.0f, stream_));
  PD_RETURN_IF_ERROR(kc::cuda_status(cudaMemset2DAsync(static_cast<uint8_t*>(kv_pool_) + codes, spec_.bytes_per_block(),
                                                       0x3f, scale_bytes, blocks, stream_),
                                     "fp8 kv scale fill"));
  return kc::cuda_status(cudaStreamSynchronize(stream_), "fill_kv_random sync");
}

}  // namespace pd::engine
