// Programmatic dependent launch (PDL, sm_90). A kernel launched through
// launch_dependent() may be scheduled while the kernel before it in the stream
// is still running, so its launch latency overlaps that kernel's tail instead
// of following it (a decode step is ~370 short kernels; the gaps add up).
//
// Contract of every kernel launched this way: it calls wait_for_prior_grids()
// before any global memory access, and allow_dependents() only after it. The
// wait returns once the previous grid in the stream has completed and its
// writes are visible, so no two kernels' memory operations ever overlap and
// the usual stream order holds for memory (also transitively: each kernel
// waited for its own predecessor). allow_dependents() only lets the next kernel
// be scheduled early; it orders nothing. Both are no-ops for a kernel launched
// without the attribute, and launches are plain ones while
// programmatic_launch_enabled() is false.
// The one exception: reads of what no kernel of the step writes (the step
// inputs copied in before its first kernel: context lengths, block tables; and
// the weights, written only at load) may precede the wait. Because every kernel
// lets its successor start only after its own wait, when a kernel starts, all
// kernels before its predecessor have completed, and the copies before them too.
// Decode attention reads its block table this way, and the skinny GEMMs issue
// their first weight loads.
#pragma once

#include <cuda_runtime.h>

#include "kernels/cuda/launch.h"

namespace pd::kernels::cuda::detail {

__device__ __forceinline__ void wait_for_prior_grids() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

__device__ __forceinline__ void allow_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

template <typename... KernelArgs, typename... Args>
cudaError_t launch_dependent(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes,
                             cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = programmatic_launch_enabled() ? 1 : 0;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, static_cast<KernelArgs>(args)...);
}

}  // namespace pd::kernels::cuda::detail
