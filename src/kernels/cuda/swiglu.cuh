// SwiGLU's activation, shared by silu_mul (elementwise.cu) and the skinny GEMM's SwiGLU
// prologue (skinny_gemm.cu) so the fused and unfused paths give identical bf16 values:
// silu(gate) rounded to bf16 (as HF rounds its output), times up, in fp32. The fast
// intrinsics cost a few fp32 ulp, far below one bf16 step; they matter because the fused
// prologue recomputes the activation once per CTA of the down projection.
#pragma once

#include <cuda_bf16.h>

namespace pd::kernels::cuda::detail {

__device__ __forceinline__ float swiglu(float gate, float up) {
  const float silu = __fdividef(gate, 1.0f + __expf(-gate));  // -> -0 for gate < -88 (exp overflows)
  return __bfloat162float(__float2bfloat16(silu)) * up;
}

}  // namespace pd::kernels::cuda::detail
