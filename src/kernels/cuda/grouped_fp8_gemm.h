// Grouped block-scaled FP8 GEMM for MoE prefill: one launch per projection over every
// expert's rows instead of one GEMM per expert.
//   out[r][:] = dequant(a_q[r][:]) . dequant(W_g)^T for the rows r of each group g
//   (rows sorted by group, group g's rows [offsets[g], offsets[g + 1]) on the device),
// W_g = w + g * n * k (e4m3 [n][k], 128 x 128 block scales in Fp8Weight's padded layout),
// activations quantized per token per 128 columns (scale = amax / 448, as quantize_fp8) by
// quantize(), which can gather rows (x[src_rows[r]]) or apply silu(gate) * up on the way.
// Through CUTLASS's SM90 pointer-array kernel with blockwise scaling (grouped_fp8_gemm.cu);
// available() is false when the build had no CUTLASS headers, and create() then refuses
// (kUnimplemented). Empty groups are allowed; nothing waits for the host (whether the calls can
// be captured in a CUDA graph is not checked: CUTLASS sets up its launch on the host per call).
// Not thread-safe: one object per stream owner.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "common/status.h"
#include "kernels/cuda/fp8_args.h"

namespace pd::kernels::cuda {

class GroupedFp8Gemm {
 public:
  static bool available();
  // Buffers for up to max_groups groups, max_rows rows and K up to max_k; weight scales whose
  // padded layout differs from the kernel's (k / 128 not a multiple of 4) are compacted into
  // scratch sized for max_groups x max_n x max_k. The quantized rows go to a_q ([max_rows][max_k]
  // bytes) and a_scales (max_rows * max_k / 128 floats) when given (the caller's scratch, which
  // must outlive this object), else to buffers of its own.
  static Result<std::unique_ptr<GroupedFp8Gemm>> create(int32_t max_groups, int32_t max_rows, int32_t max_n,
                                                        int32_t max_k, uint8_t* a_q = nullptr,
                                                        float* a_scales = nullptr);
  ~GroupedFp8Gemm();
  GroupedFp8Gemm(const GroupedFp8Gemm&) = delete;
  GroupedFp8Gemm& operator=(const GroupedFp8Gemm&) = delete;

  // Quantizes `rows` rows into this object's scratch for a GEMM with this k: row r is
  // x[src_rows ? src_rows[r] : r] ([k] wide), or with silu set silu(gate) * up of x's row
  // [2k] (bf16 rounding as silu_mul).
  Status quantize(const __nv_bfloat16* x, const int32_t* src_rows, bool silu, int32_t rows, int32_t k,
                  const int32_t* offsets, int32_t groups, cudaStream_t stream);
  // out [rows][w.n] for the rows last quantized (same k, offsets and groups); w is group 0's
  // weight, the others follow at w.data + g * n * k, scales at w.scale + g * ceil(n/128) * scale_ld.
  Status run(__nv_bfloat16* out, const Fp8Weight& w, const int32_t* offsets, int32_t groups, cudaStream_t stream);

 private:
  GroupedFp8Gemm() = default;
  int32_t max_groups_ = 0, max_rows_ = 0, max_n_ = 0, max_k_ = 0, device_ = 0, sm_count_ = 0;
  int32_t quantized_k_ = 0;
  uint8_t* a_q_ = nullptr;
  float* a_scales_ = nullptr;
  bool owns_a_ = true;         // a_q_ and a_scales_ are this object's
  float* w_scales_ = nullptr;  // compacted weight scales
  void* args_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
};

}  // namespace pd::kernels::cuda
