// Argument structs and layout helpers of the FP8 and MoE kernels (kernels.h has the
// contracts). Free of fmt/Status so the .cu files can include it.
//
// FP8 formats (e4m3, "value = fp8 * scale"):
// - Weights [N][K] (HF layout) with one fp32 scale per 128 x 128 block (the checkpoint's
//   `weight_scale_inv` [ceil(N/128)][ceil(K/128)]), kept on the device row-major with the row
//   padded to fp8_weight_scale_ld(K) = round_up(ceil(K/128), 4) entries: cuBLASLt's
//   BLK128x128_32F layout for a row-major operand.
// - Activations [M][K] quantized per token per 128-wide group, scale = amax / 448, stored
//   outer-dimension-major: scale of (row m, group g) at scales[g * ld + m] with
//   ld = fp8_act_scale_ld(M) = round_up(M, 4): cuBLASLt's VEC128_32F layout.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pd::kernels::cuda {

using bf16 = __nv_bfloat16;

inline constexpr int32_t kFp8Block = 128;
inline constexpr float kFp8E4m3Max = 448.0f;
// MoE routing limits (one warp holds a token's expert logits; top_k choices fit a warp).
inline constexpr int32_t kMoeMaxExperts = 512;
inline constexpr int32_t kMoeMaxTopK = 32;

constexpr int32_t fp8_round_up(int32_t x, int32_t to) {
  return (x + to - 1) / to * to;
}
constexpr int32_t fp8_weight_scale_ld(int32_t k) {
  return fp8_round_up((k + kFp8Block - 1) / kFp8Block, 4);
}
constexpr int32_t fp8_act_scale_ld(int32_t m) {
  return fp8_round_up(m, 4);
}
// cuBLASLt's block-scaled FP8 GEMM runs only for M a multiple of 16 here (H200, cuBLAS 13.0:
// no algorithm for M = 1, 3, 5, 37, 143, 333, 835, ...; M = 16, 64, 128, 512, 2048 run), so
// a GEMM takes the first fp8_cublas_rows(M) rows through cuBLASLt and the rest (< 16) through
// the streaming kernel.
inline constexpr int32_t kFp8CublasRowMultiple = 16;
constexpr int32_t fp8_cublas_rows(int32_t m) {
  return m / kFp8CublasRowMultiple * kFp8CublasRowMultiple;
}

// A block-scaled FP8 weight (device pointers). Experts of one MoE layer are stored back to
// back: expert e at data + e * n * k, its scales at scale + e * ceil(n/128) * scale_ld.
struct Fp8Weight {
  const uint8_t* data = nullptr;  // [n][k] e4m3
  const float* scale = nullptr;   // [ceil(n/128)][scale_ld]
  int32_t n = 0;
  int32_t k = 0;
  int32_t scale_ld = 0;  // fp8_weight_scale_ld(k)
};

// Tensor-core kernels of stream_gemm for FP8 weights (StreamGemmArgs::tc_kernel).
enum class Fp8TcKernel : uint8_t {
  kTiled,      // fp8.cu: CTAs of 1 / 2 / 4 16-column tiles, K split over the CTA's warps
  kWarpItems,  // moe_decode.cu: one warp per (group, 16 columns) over the whole K
};

// Weight-streaming GEMM (stream_gemm): out[r][n] (+)= a[row(r)][:] . dequant(w[n][:]) for
// the rows r of each group. Built for decode, where every weight byte should be read once:
// a CTA owns a few output columns of one group and streams their weight rows once per
// 8 activation rows. Dense: one group of m rows, rows read in place. Grouped (MoE experts):
// group g = the active expert active_groups[y] for grid row y < *num_active, its rows
// [group_offsets[g], group_offsets[g + 1]) of the expert-sorted order; `a_rows` maps a
// sorted row to the activation row it reads (null: the sorted row itself), and group g
// reads weights at w + g * w_group_stride (scales likewise).
struct StreamGemmArgs {
  bf16* out = nullptr;  // [rows][ldo]
  int32_t ldo = 0;
  const bf16* a = nullptr;  // [..][lda]
  int32_t lda = 0;
  const int32_t* a_rows = nullptr;
  const void* w = nullptr;         // uint8_t e4m3 (w_scale set) or bf16 (w_scale null)
  const float* w_scale = nullptr;  // [ceil(n/128)][w_scale_ld]
  int32_t w_scale_ld = 0;
  int64_t w_group_stride = 0;              // elements
  int64_t scale_group_stride = 0;          // floats
  const int32_t* group_offsets = nullptr;  // [groups + 1]; null: one group of m rows
  const int32_t* active_groups = nullptr;  // [max_groups]; null: grid row y is group y
  const int32_t* num_active = nullptr;     // device scalar; null: every grid row is active
  int32_t max_groups = 1;                  // grid rows
  int32_t m = 0;                           // dense: rows
  int32_t n = 0;
  int32_t k = 0;
  bool accumulate = false;
  // FP8 weights with n % 16 == 0 run on tensor cores (weights converted to bf16 times their
  // block scale in registers, 16 rows per weight pass); set to run the CUDA-core kernel
  // instead (8 rows per pass), kept for comparison. bf16 weights always take the CUDA cores.
  bool cuda_cores = false;
  // Tensor-core kernel: 16-column tiles per CTA (1, 2 or 4); 0 = fp8_tc_grouped_tiles' choice.
  int32_t tc_tiles = 0;
  // FP8 weights on tensor cores, n % 16 == 0: the tiled kernel above or a warp-item kernel
  // (moe_decode.cu: a warp streams 16 columns of one group over the whole K, on a grid of at most
  // one wave).
  Fp8TcKernel tc_kernel = Fp8TcKernel::kTiled;
};

// Tiles per CTA of the tensor-core streaming kernel: grouped (MoE) GEMMs with K <= 1,024 take 4
// (two warps of 6-8 chunks of 64 per tile instead of eight of 1-2), K <= 2,048 take 2, the
// rest and dense GEMMs 1.
constexpr int32_t fp8_tc_grouped_tiles(const StreamGemmArgs& a) {
  if (a.tc_tiles == 1 || a.tc_tiles == 2 || a.tc_tiles == 4) return a.tc_tiles;
  if (a.group_offsets == nullptr) return 1;
  return a.k <= 1024 ? 4 : a.k <= 2048 ? 2 : 1;
}

// MoE routing outputs (moe_align): the T * top_k (token, choice) pairs sorted by expert.
struct MoeRouting {
  int32_t* expert_offsets = nullptr;  // [num_experts + 1]: sorted rows of expert e
  int32_t* padded_offsets = nullptr;  // [num_experts + 1]: prefix sums of round_up(count, 4)
  int32_t* active_experts = nullptr;  // [num_experts]: experts with rows, ascending
  int32_t* num_active = nullptr;      // [1]
  int32_t* sorted_token = nullptr;    // [T * top_k]: token of each sorted row
  int32_t* slot_of_choice = nullptr;  // [T * top_k]: sorted row of (token t, choice j) at t * top_k + j
};

}  // namespace pd::kernels::cuda
