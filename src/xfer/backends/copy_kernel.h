// Launch surface of the cuda backend's copy kernel. Plain C++17 so nvcc and the
// C++20 host code can share it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace pd::xfer {

// One op of a batch as the kernel sees it (device addresses in this process).
struct CopyOp {
  uint64_t src;
  uint64_t dst;
  uint64_t bytes;
  uint64_t chunk_begin;  // index of this op's first chunk_bytes chunk within the batch
};

// One launch that copies every op: `ops` is a device array of `num_ops` ops whose
// chunk counts sum to `num_chunks`. 16-byte vector copies where src, dst and length
// allow, bytes otherwise. Returns the launch error.
cudaError_t launch_gather_scatter(const CopyOp* ops, uint32_t num_ops, uint64_t num_chunks, uint32_t chunk_bytes,
                                  unsigned grid, unsigned threads_per_cta, cudaStream_t stream);

// Batches of at most this many ops pass their table inside the launch parameters.
constexpr uint32_t kMaxInlineOps = 1000;

// As launch_gather_scatter, with `host_ops` (host memory, num_ops <= kMaxInlineOps)
// copied into the launch parameters.
cudaError_t launch_gather_scatter_inline(const CopyOp* host_ops, uint32_t num_ops, uint64_t num_chunks,
                                         uint32_t chunk_bytes, unsigned grid, unsigned threads_per_cta,
                                         cudaStream_t stream);

}  // namespace pd::xfer
