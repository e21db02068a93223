// Asynchronous global -> shared copies (cp.async, sm_80+) with optional L2
// cache policies, and the dynamic shared memory opt-in, shared by the
// attention and skinny GEMM kernels.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace pd::kernels::cuda::detail {

// cp.async: 16 bytes global -> shared without passing through registers;
// src_bytes 0 zero-fills the destination (keys past the context).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const auto dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes) : "memory");
}
// Same with an L2 cache policy (createpolicy), e.g. evict-first for data read once.
__device__ __forceinline__ void cp_async_16_hint(void* smem, const void* gmem, bool valid, uint64_t policy) {
  const auto dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(gmem),
               "r"(src_bytes), "l"(policy)
               : "memory");
}
// 4 bytes (cp.async.ca: sizes below 16 go through L1); src_bytes 0 zero-fills.
__device__ __forceinline__ void cp_async_4(void* smem, const void* gmem, bool valid) {
  const auto dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  cp_async_commit();
  cp_async_wait<0>();
}

// Opts kKernel into `bytes` (> 48 KiB) of dynamic shared memory, once per
// device (the setting lives in the device's context); later launches, such as
// those recorded while a decode graph is captured, skip the call.
template <auto kKernel>
cudaError_t opt_in_dynamic_smem(int bytes) {
  static std::atomic<uint64_t> configured_devices{0};  // bit d: done on device d
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit != 0 && (configured_devices.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  err = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) configured_devices.fetch_or(bit, std::memory_order_release);
  return err;
}

}  // namespace pd::kernels::cuda::detail
