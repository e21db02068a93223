// Launch surface of the cuda backend's copy kernel. Plain C++17 so nvcc and the
// C++20 host code can share it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "xfer/backends/copy_op.h"

namespace pd::xfer {

// One launch that copies every op: `ops` is a device array of `num_ops` ops whose
// chunk counts sum to `num_chunks`. 16-byte vector copies where src, dst and length
// allow, bytes otherwise. Returns the launch error.
cudaError_t launch_gather_scatter(const CopyOp* ops, uint32_t num_ops, uint64_t num_chunks, uint32_t chunk_bytes,
                                  unsigned grid, unsigned threads_per_cta, cudaStream_t stream);

// As launch_gather_scatter, with the table copied from host memory into the launch
// parameters: `host_ops` holds num_ops <= kMaxInlineOps ops and is readable for
// kMaxInlineOps entries (the parameter block is copied whole, from the pointer, with no
// intermediate copy; entries past num_ops are never read by the kernel).
cudaError_t launch_gather_scatter_inline(const CopyOp* host_ops, uint32_t num_ops, uint64_t num_chunks,
                                         uint32_t chunk_bytes, unsigned grid, unsigned threads_per_cta,
                                         cudaStream_t stream);

}  // namespace pd::xfer
