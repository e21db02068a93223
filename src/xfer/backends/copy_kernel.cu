// The gather/scatter copy kernel of the cuda backend (C++17 for nvcc; the backend's
// host code is C++20 and calls it through copy_kernel.h).
#include "xfer/backends/copy_kernel.h"

namespace pd::xfer {
namespace {

constexpr int kVecPerThread = 8;

// One CTA per chunk at a time (grid-stride over chunks). Thread 0 finds the chunk's
// op by binary search over chunk_begin; every thread then moves up to
// kVecPerThread 16-byte vectors, all loads before all stores for memory-level parallelism.
__device__ __forceinline__ void copy_chunks(const CopyOp* __restrict__ ops, uint32_t num_ops, uint64_t num_chunks,
                                            uint32_t chunk_bytes) {
  __shared__ uint32_t op_index;
  for (uint64_t chunk = blockIdx.x; chunk < num_chunks; chunk += gridDim.x) {
    if (threadIdx.x == 0) {
      uint32_t lo = 0, hi = num_ops - 1;
      while (lo < hi) {
        uint32_t mid = (lo + hi + 1) / 2;
        if (ops[mid].chunk_begin <= chunk) {
          lo = mid;
        } else {
          hi = mid - 1;
        }
      }
      op_index = lo;
    }
    __syncthreads();
    const CopyOp op = ops[op_index];
    __syncthreads();  // op_index is rewritten by the next iteration
    const uint64_t offset = (chunk - op.chunk_begin) * chunk_bytes;
    const uint64_t n = min(static_cast<uint64_t>(chunk_bytes), op.bytes - offset);
    const char* src = reinterpret_cast<const char*>(op.src) + offset;
    char* dst = reinterpret_cast<char*>(op.dst) + offset;
    if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) | n) & 15) == 0) {
      const uint4* s4 = reinterpret_cast<const uint4*>(src);
      uint4* d4 = reinterpret_cast<uint4*>(dst);
      const uint64_t n4 = n / 16;
      for (uint64_t base = 0; base < n4; base += uint64_t{blockDim.x} * kVecPerThread) {
        uint4 v[kVecPerThread];
#pragma unroll
        for (int k = 0; k < kVecPerThread; ++k) {
          const uint64_t i = base + static_cast<uint64_t>(k) * blockDim.x + threadIdx.x;
          if (i < n4) v[k] = s4[i];
        }
#pragma unroll
        for (int k = 0; k < kVecPerThread; ++k) {
          const uint64_t i = base + static_cast<uint64_t>(k) * blockDim.x + threadIdx.x;
          if (i < n4) d4[i] = v[k];
        }
      }
    } else {
      for (uint64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
    }
  }
}

__global__ void gather_scatter_kernel(const CopyOp* __restrict__ ops, uint32_t num_ops, uint64_t num_chunks,
                                      uint32_t chunk_bytes) {
  copy_chunks(ops, num_ops, num_chunks, chunk_bytes);
}

template <uint32_t kCapacity>
struct InlineOps {
  CopyOp ops[kCapacity];
};

// The op table travels in the launch's parameter block (up to 32 KiB since CUDA 12.1):
// no upload copy ahead of the kernel, which is most of the cost of a small batch. A few
// capacities keep the parameter block (copied at every launch) close to the batch size.
template <uint32_t kCapacity>
__global__ void gather_scatter_inline_kernel(const __grid_constant__ InlineOps<kCapacity> table, uint32_t num_ops,
                                             uint64_t num_chunks, uint32_t chunk_bytes) {
  copy_chunks(table.ops, num_ops, num_chunks, chunk_bytes);
}

// The parameter block is read straight from `host_ops` (InlineOps<kCapacity> is an array
// of kCapacity CopyOps, and the caller's buffer holds kMaxInlineOps >= kCapacity): the
// driver copies it once, where a by-value launch copied the table twice more.
template <uint32_t kCapacity>
cudaError_t launch_inline(const CopyOp* host_ops, uint32_t num_ops, uint64_t num_chunks, uint32_t chunk_bytes,
                          unsigned grid, unsigned threads_per_cta, cudaStream_t stream) {
  static_assert(sizeof(InlineOps<kCapacity>) == kCapacity * sizeof(CopyOp), "the table is a plain array");
  static_assert(kCapacity <= kMaxInlineOps, "the caller's buffer holds kMaxInlineOps ops");
  void* args[] = {const_cast<CopyOp*>(host_ops), &num_ops, &num_chunks, &chunk_bytes};
  return cudaLaunchKernel(reinterpret_cast<const void*>(&gather_scatter_inline_kernel<kCapacity>), dim3(grid),
                          dim3(threads_per_cta), args, 0, stream);
}

}  // namespace

cudaError_t launch_gather_scatter_inline(const CopyOp* host_ops, uint32_t num_ops, uint64_t num_chunks,
                                         uint32_t chunk_bytes, unsigned grid, unsigned threads_per_cta,
                                         cudaStream_t stream) {
  if (num_ops <= 16)
    return launch_inline<16>(host_ops, num_ops, num_chunks, chunk_bytes, grid, threads_per_cta, stream);
  if (num_ops <= 128) {
    return launch_inline<128>(host_ops, num_ops, num_chunks, chunk_bytes, grid, threads_per_cta, stream);
  }
  if (num_ops <= kMaxInlineOps) {
    return launch_inline<kMaxInlineOps>(host_ops, num_ops, num_chunks, chunk_bytes, grid, threads_per_cta, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t launch_gather_scatter(const CopyOp* ops, uint32_t num_ops, uint64_t num_chunks, uint32_t chunk_bytes,
                                  unsigned grid, unsigned threads_per_cta, cudaStream_t stream) {
  gather_scatter_kernel<<<grid, threads_per_cta, 0, stream>>>(ops, num_ops, num_chunks, chunk_bytes);
  return cudaGetLastError();
}

}  // namespace pd::xfer
