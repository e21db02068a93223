// Prefill attention over an FP8 KV cache (--kv-cache-dtype fp8) for the CUDA runner.
// The bf16 prefill kernel reads bf16 blocks, so a pass's prefill sequences have the
// blocks they read dequantized into a bf16 staging area first (kv_fp8_to_bf16_blocks),
// per layer, and the prefill kernel runs on the staging area with block tables
// renumbered to staging positions. Sequences are staged in groups that fit the area
// (any one sequence fits: the area holds at least max_blocks_per_seq blocks), each
// group one dequantization + one prefill launch per layer.
//
// Threads: owned by the runner, used from its engine thread only. prepare() runs on the
// host before the pass (copies its tables to the device on the runner's stream);
// run_layer() launches on that stream.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "common/status.h"
#include "kernels/cuda/kernels.h"

namespace pd::engine {

class Fp8KvPrefill {
 public:
  // capacity_blocks >= max_blocks_per_seq; max_seqs: the most prefill sequences of a pass.
  static Result<std::unique_ptr<Fp8KvPrefill>> create(int32_t capacity_blocks, int32_t max_seqs,
                                                      int32_t max_blocks_per_seq, int32_t block_size,
                                                      int32_t num_kv_heads, int32_t head_dim);
  ~Fp8KvPrefill();
  Fp8KvPrefill(const Fp8KvPrefill&) = delete;
  Fp8KvPrefill& operator=(const Fp8KvPrefill&) = delete;

  // Plans the groups of one pass: context_lens[i] and the block table row
  // block_tables[i * max_blocks_per_seq ...] of prefill sequence i (host memory), and
  // copies the staging block lists and renumbered tables to the device on `stream`.
  Status prepare(const int32_t* context_lens, const int32_t* block_tables, int32_t num_seqs, cudaStream_t stream);
  // One layer's prefill attention: `pre` describes all prefill sequences of the pass
  // (query_start / context_lens device pointers at the first prefill sequence); its
  // kv_cache is the layer's FP8 region.
  Status run_layer(const kernels::cuda::AttentionArgs& pre, const void* fp8_layer, cudaStream_t stream);

  int32_t num_groups() const { return static_cast<int32_t>(groups_.size()); }
  size_t staging_bytes() const;

 private:
  struct Group {
    int32_t first_seq = 0, num_seqs = 0;
    int32_t num_blocks = 0;
    size_t ids_offset = 0;     // into the block-id section
    size_t tables_offset = 0;  // into the table section
  };
  Fp8KvPrefill() = default;

  int32_t capacity_ = 0, max_seqs_ = 0, max_blocks_per_seq_ = 0, block_size_ = 0, num_kv_heads_ = 0, head_dim_ = 0;
  __nv_bfloat16* staging_ = nullptr;
  // One int32 region, device + pinned host mirror: block ids (sum of the groups' blocks,
  // at most max_seqs * max_blocks_per_seq), then the renumbered tables [max_seqs][max_blocks_per_seq].
  int32_t* d_ints_ = nullptr;
  int32_t* h_ints_ = nullptr;
  size_t ints_count_ = 0;
  std::vector<Group> groups_;
};

}  // namespace pd::engine
