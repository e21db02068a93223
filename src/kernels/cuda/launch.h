// Internal: raw launchers implemented in the .cu files. They assume the shape
// was already checked against the dispatch table by dispatch.cc (which owns
// every Status); they return the launch's cudaError_t. Kept free of fmt and
// common/status.h so nvcc never parses them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/fp8_args.h"
#include "kernels/cuda/kernel_args.h"

namespace pd::kernels::cuda::detail {

using bf16 = __nv_bfloat16;

cudaError_t launch_embedding(bf16* out, const bf16* table, const int32_t* ids, int32_t num_rows, int32_t num_table_rows,
                             int32_t hidden, cudaStream_t stream);
cudaError_t launch_rmsnorm(bf16* out, const bf16* x, bf16* residual, const bf16* weight, int32_t num_rows,
                           int32_t hidden, float eps, cudaStream_t stream);
cudaError_t launch_add_bias(bf16* x, const bf16* bias, int32_t num_rows, int32_t width, cudaStream_t stream);
cudaError_t launch_silu_mul(bf16* out, const bf16* gate_up, int32_t num_rows, int32_t intermediate,
                            cudaStream_t stream);
cudaError_t launch_rope_kv(const RopeKvArgs& args, cudaStream_t stream);  // head_dim 64 or 128
cudaError_t launch_prefill_attention(const AttentionArgs& args, cudaStream_t stream);
cudaError_t launch_decode_attention(const AttentionArgs& args, float* workspace, int32_t num_partitions,
                                    cudaStream_t stream);
cudaError_t launch_sample_rows(float* logits, int32_t num_rows, int32_t vocab, const RowSampling* params,
                               const int32_t* suppressed_ids, int32_t* tokens, float* logprobs, cudaStream_t stream);
// Skinny GEMM (skinny_gemm.cu): out[m][n] = a[m][k] * w[n][k]^T for 1 <= m <= skinny_gemm_max_m(variant),
// n % 8 == 0, k % 8 == 0, a and w 16-byte aligned (Gemm checks), fp32 accumulate, bf16 or fp32 out.
// Variants 0..3 (tensor cores): bit 0 interleaves the warps' K chunks; 2, 3 keep 8 chunks in
// flight (m <= 8). Variant 4: CUDA-core GEMV, one row per warp load (m <= 4). Variants 5
// (m <= 16) and 6 (m <= 8): tensor cores fed by a cp.async ring in shared memory.
// Fusions (bf16 out only, one at a time): with norm_weight set, `a` holds un-normalized rows
// and the kernel multiplies rmsnorm(a) * norm_weight instead, computed by each CTA into shared
// memory (variants 0..4 and m * k * 2 <= kSkinnyNormSmemBytes: skinny_gemm_norm_fusable);
// with accumulate set, out += a * w^T (each output element is read and written by one thread).
inline constexpr int32_t kSkinnyGemmMaxM = 16;
inline constexpr int32_t kNumSkinnyGemmVariants = 7;
inline constexpr int32_t kSkinnyNormMaxM = 4;
inline constexpr int64_t kSkinnyNormSmemBytes = 32 * 1024;
bool skinny_gemm_norm_fusable(int32_t variant, int32_t m, int32_t k);
struct SkinnyFusion {
  const bf16* norm_weight = nullptr;  // [k]
  float norm_eps = 0.0f;
  bool accumulate = false;
};
int32_t skinny_gemm_max_m(int32_t variant);  // 0 for an unknown variant
cudaError_t launch_skinny_gemm(void* out, bool out_fp32, const bf16* a, const bf16* w, int32_t m, int32_t n, int32_t k,
                               int32_t variant, cudaStream_t stream, const SkinnyFusion& fusion = {});
// Whether the decode-path launchers use programmatic dependent launch (pdl.cuh);
// set through kernels.h's set_programmatic_launch.
bool programmatic_launch_enabled();
// FP8 and MoE (fp8.cu, moe.cu); shapes checked by dispatch.cc.
cudaError_t launch_quantize_fp8(uint8_t* out, float* scales, const bf16* x, int32_t rows, int32_t k, int32_t scale_ld,
                                const int32_t* offsets, const int32_t* padded_offsets, int32_t num_groups,
                                cudaStream_t stream);
// rows_hint: the most rows any group has (or may have): picks the rows per weight pass.
cudaError_t launch_stream_gemm(const StreamGemmArgs& args, int32_t rows_hint, cudaStream_t stream);
// StreamGemmArgs::tc_kernel a warp-item kernel (moe_decode.cu).
cudaError_t launch_fp8_warp_grouped(const StreamGemmArgs& args, cudaStream_t stream);
// Tensor-core streaming for dense FP8 weights, 1 <= m <= 16, n % 8 == 0, k % 128 == 0 (fp8.cu).
cudaError_t launch_fp8_tc_stream(bf16* out, const bf16* a, const uint8_t* w, const float* w_scale, int32_t scale_ld,
                                 int32_t m, int32_t n, int32_t k, bool accumulate, cudaStream_t stream);
cudaError_t launch_moe_route(const float* logits, int32_t num_tokens, int32_t num_experts, int32_t top_k,
                             bool renormalize, int32_t* topk_ids, float* topk_weights, cudaStream_t stream);
cudaError_t launch_moe_align(const int32_t* topk_ids, int32_t num_tokens, int32_t top_k, int32_t num_experts,
                             const MoeRouting& routing, cudaStream_t stream);
cudaError_t launch_moe_combine(bf16* out, const bf16* y, const int32_t* slot_of_choice, const float* weights,
                               int32_t num_tokens, int32_t top_k, int32_t hidden, bool accumulate, cudaStream_t stream);
// Decode over the FP8 KV cache on tensor cores (attention.cu; GQA group <= 8).
cudaError_t launch_decode_attention_fp8_tc(const AttentionArgs& args, float* workspace, int32_t num_partitions,
                                           cudaStream_t stream);
cudaError_t launch_decode_attention_fp8(const AttentionArgs& args, float* workspace, int32_t num_partitions,
                                        cudaStream_t stream);
cudaError_t launch_kv_fp8_to_bf16(bf16* dst, const uint8_t* cache, const int32_t* block_ids, int32_t num_blocks,
                                  int32_t block_size, int32_t num_kv_heads, int32_t head_dim, cudaStream_t stream);
cudaError_t launch_fill_uniform_fp8(uint8_t* out, size_t n, uint64_t seed, float scale, cudaStream_t stream);
cudaError_t launch_fill_uniform(bf16* out, size_t n, uint64_t seed, float scale, cudaStream_t stream);

}  // namespace pd::kernels::cuda::detail
