// Internal: raw launchers of grouped_fp8_gemm.cu (the grouped block-scaled FP8 GEMM for MoE
// prefill and its activation quantization). Free of fmt and common/status.h so nvcc never
// parses them; GroupedFp8Gemm (grouped_fp8_gemm.h) owns every Status and buffer.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace pd::kernels::cuda::detail {

// True when grouped_fp8_gemm.cu was compiled with CUTLASS's SM90 grouped GEMM (sm_90a).
bool grouped_fp8_gemm_built();

// Per-group argument arrays on the device (one entry per group), opaque here: bytes for
// max_groups groups, filled by launch_grouped_fp8_gemm on the stream.
size_t grouped_fp8_arg_bytes(int32_t max_groups);
// Device workspace the GEMM needs for max_groups groups on sm_count multiprocessors.
size_t grouped_fp8_workspace_bytes(int32_t max_groups, int32_t sm_count);

// Rows sorted by group (offsets[g] .. offsets[g + 1]). Row r reads x[src_rows ? src_rows[r] : r]
// (row stride k), or with silu set silu(gate) * up of x's row [2k] (gate first) rounded to bf16
// as silu_mul does. Each 128-wide group of a row is quantized as quantize_fp8 does (scale =
// amax / 448, 1 for an all-zero group) into out[r][k] and its scale stored for the GEMM's
// activation operand: the scales of group g's rows form a [k / 128][count_g] block at
// scales + offsets[g] * (k / 128) (M-major within the group).
cudaError_t launch_grouped_quantize(uint8_t* out, float* scales, const __nv_bfloat16* x, const int32_t* src_rows,
                                    bool silu, int32_t rows, int32_t k, const int32_t* offsets, int32_t num_groups,
                                    cudaStream_t stream);

// Copies block scales [groups][n_blocks][scale_ld] into [groups][n_blocks][k_blocks] (dropping
// the padding the cuBLASLt layout carries).
cudaError_t launch_compact_scales(float* out, const float* in, int32_t groups, int32_t n_blocks, int32_t k_blocks,
                                  int32_t scale_ld, cudaStream_t stream);

struct GroupedFp8Args {
  __nv_bfloat16* out = nullptr;      // [rows][n], rows in group order
  const uint8_t* a = nullptr;        // [rows][k] e4m3
  const float* a_scales = nullptr;   // launch_grouped_quantize's layout
  const uint8_t* w = nullptr;        // [groups][n][k] e4m3
  const float* w_scales = nullptr;   // [groups][n / 128][k / 128]
  const int32_t* offsets = nullptr;  // device [groups + 1]
  int32_t groups = 0, n = 0, k = 0;  // n, k multiples of 128
  void* arg_buffer = nullptr;        // grouped_fp8_arg_bytes(groups)
  void* workspace = nullptr;         // grouped_fp8_workspace_bytes(groups, sm_count)
  size_t workspace_bytes = 0;
  int32_t device = 0, sm_count = 0;
};
// 0 on success; otherwise a negative code: -1 not built, -2 can_implement refused,
// -3 initialize failed, -4 run failed, or a positive cudaError_t.
int launch_grouped_fp8_gemm(const GroupedFp8Args& args, cudaStream_t stream);

}  // namespace pd::kernels::cuda::detail
