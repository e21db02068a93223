// CUDA kernels of the bf16 model runner (sm_90). Every entry point checks its
// shape against the bounded dispatch table (head_dim 64/128, KV block size 16,
// bf16 activations and KV) and returns a Status naming the unsupported value
// instead of launching. Launches are asynchronous on `stream`; a returned ok
// Status means the launch was accepted (cudaGetLastError was clean), not that
// the kernel finished. All pointers are device pointers unless said otherwise.
//
// KV cache layout per layer: [num_blocks][2 (K,V)][block_size][num_kv_heads][head_dim].
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/status.h"
#include "kernels/cuda/fp8_args.h"
#include "kernels/cuda/kernel_args.h"

namespace pd::kernels::cuda {

// Wraps a CUDA runtime result: ok, or an internal error naming the call.
Status cuda_status(cudaError_t err, const char* what);
// Checks cudaGetLastError after a launch.
Status last_launch_status(const char* kernel_name);

// out[t][:] = table[ids[t]][:] for t < num_rows; an id outside [0, num_table_rows)
// writes a zero row (the runner validates ids on the host first). Also used to
// gather rows of a hidden-state matrix (ids = row indices).
Status embedding_lookup(bf16* out, const bf16* table, const int32_t* ids, int32_t num_rows, int32_t num_table_rows,
                        int32_t hidden, cudaStream_t stream);

// Fused residual add + RMSNorm over rows of `hidden` elements:
//   if residual_in_out != nullptr: residual = x + residual (stored in bf16);
//   else                          : residual is not touched and the norm reads x.
//   out = rmsnorm(residual or x) * weight, computed in fp32 from the bf16 sum.
// out may alias x.
Status rmsnorm(bf16* out, const bf16* x, bf16* residual_in_out, const bf16* weight, int32_t num_rows, int32_t hidden,
               float eps, cudaStream_t stream);

// x[t][n] += bias[n] (Qwen2's qkv bias).
Status add_bias(bf16* x, const bf16* bias, int32_t num_rows, int32_t width, cudaStream_t stream);

// out[t][i] = silu(gate_up[t][i]) * gate_up[t][intermediate + i].
Status silu_mul(bf16* out, const bf16* gate_up, int32_t num_rows, int32_t intermediate, cudaStream_t stream);

// rope_kv_write: see RopeKvArgs.
Status rope_kv_write(const RopeKvArgs& args, cudaStream_t stream);

// Attention: see AttentionArgs.
// Prefill and chunked prefill (any query length, tensor cores, causal).
Status prefill_attention(const AttentionArgs& args, cudaStream_t stream);

// Decode: exactly one query per sequence; split-K over the context in
// partitions (AttentionArgs::decode_partition_tokens), then a merge of the partitions:
// inside the attention kernel when AttentionArgs::decode_merge_counters is set (tensor-core
// ring kernel only), else in a second kernel. A sequence with context_len 0 (graph padding)
// gets a zero output row.
size_t decode_attention_workspace_bytes(int32_t num_seqs, int32_t num_q_heads, int32_t head_dim,
                                        int32_t max_context_len, int32_t partition_tokens = kDecodePartitionTokens);
Status decode_attention(const AttentionArgs& args, void* workspace, size_t workspace_bytes, cudaStream_t stream);
// Decode attention's GQA groups: <= 8 on every kernel, 9..16 (Qwen3-235B-A22B: 16) on the
// tensor-core ring kernels at head_dim 128 (bf16 and FP8 KV); UNIMPLEMENTED otherwise.
Status check_decode_gqa_group(const AttentionArgs& args, const char* kernel);

// Samples one token from each row of fp32 logits [num_rows][vocab] with the
// CPU sampler's semantics (engine/sampler.h) for greedy, temperature and min-p
// (no top-k/top-p: those rows go to the CPU sampler). Suppressed ids are set to
// -inf in the row (restored when that would leave nothing). tokens[r] gets the
// pick, logprobs[r] its log-softmax over the raw logits.
Status sample_rows(float* logits, int32_t num_rows, int32_t vocab, const RowSampling* params,
                   const int32_t* suppressed_ids, int32_t* tokens, float* logprobs, cudaStream_t stream);

// Programmatic dependent launch (kernels/cuda/pdl.cuh) for the kernels of the
// decode path (norms, RoPE, SwiGLU, bias, decode attention, skinny GEMM): each
// may be scheduled while its predecessor finishes, and waits for it before
// touching memory. Process-wide (one runner per process); off by default.
void set_programmatic_launch(bool enabled);

// Fills n bf16 values with a counter-based hash of (seed, index), uniform in
// [-scale, scale): dummy weights and random test data without host traffic.
Status fill_uniform(bf16* out, size_t n, uint64_t seed, float scale, cudaStream_t stream);

// ---- FP8 and MoE (fp8.cu, moe.cu; layouts in fp8_args.h) ----

// Per-token 1 x 128 quantization of x [rows][k] (k a multiple of 128) to e4m3 `out` [rows][k]:
// scale = amax / 448 of each 128-wide group (1 for an all-zero group), stored at
// scales[g * fp8_act_scale_ld(rows) + row] (cuBLASLt's VEC128_32F layout).
Status quantize_fp8(uint8_t* out, float* scales, const bf16* x, int32_t rows, int32_t k, cudaStream_t stream);
// The same for rows sorted by expert (moe_align's routing): the first
// m_e = fp8_cublas_rows(count_e) rows of expert e's range [expert_offsets[e], +count_e) get
// their own scale block of [k / 128][m_e] at scales + padded_offsets[e] * (k / 128), the
// layout one cuBLASLt call per expert reads; the other rows get codes but no scale.
Status quantize_fp8_grouped(uint8_t* out, float* scales, const bf16* x, int32_t rows, int32_t k,
                            const MoeRouting& routing, int32_t num_experts, cudaStream_t stream);

// Weight-streaming GEMM (see StreamGemmArgs): bf16 activations, FP8 (w_scale set, k a
// multiple of 128) or bf16 weights, bf16 out, fp32 accumulate. rows_hint >= the rows of the
// largest group (dense: m); it picks how many rows share one pass over the weights.
Status stream_gemm(const StreamGemmArgs& args, int32_t rows_hint, cudaStream_t stream);

// Router: logits [num_tokens][num_experts] fp32 -> per token the top_k experts by softmax
// probability (ties to the lower id) and their weights (the probabilities, divided by their
// sum when renormalize is set): topk_ids / topk_weights [num_tokens][top_k].
Status moe_route(const float* logits, int32_t num_tokens, int32_t num_experts, int32_t top_k, bool renormalize,
                 int32_t* topk_ids, float* topk_weights, cudaStream_t stream);
// Sorts the num_tokens * top_k (token, choice) pairs by expert into `routing` (fp8_args.h).
// One CTA; no host synchronization, so it can sit in a CUDA graph.
Status moe_align(const int32_t* topk_ids, int32_t num_tokens, int32_t top_k, int32_t num_experts,
                 const MoeRouting& routing, cudaStream_t stream);
// out[t][:] (+ out[t][:] when accumulate) = sum_j topk_weights[t][j] * y[slot_of_choice[t * top_k + j]][:].
Status moe_combine(bf16* out, const bf16* y, const int32_t* slot_of_choice, const float* topk_weights,
                   int32_t num_tokens, int32_t top_k, int32_t hidden, bool accumulate, cudaStream_t stream);

// FP8 KV cache (RopeKvArgs::kv_fp8 writes it; layout in engine/README.md): bytes of one
// block of one layer.
inline size_t fp8_kv_block_bytes(int32_t block_size, int32_t num_kv_heads, int32_t head_dim) {
  return 2ull * block_size * num_kv_heads * (static_cast<size_t>(head_dim) + sizeof(float));
}
// Decode attention reading the FP8 cache at args.kv_cache (CUDA cores; split-K partitions
// of args.decode_partition_tokens, the workspace of decode_attention_workspace_bytes; the
// decode_kernel / stages / evict-first / merge-counter fields are ignored).
Status decode_attention_fp8(const AttentionArgs& args, void* workspace, size_t workspace_bytes, cudaStream_t stream);
// Prefill over the FP8 cache: dst block i (bf16 [2][block][heads][D]) = dequantized
// cache block block_ids[i]; the bf16 prefill kernel then runs on dst with a block table
// renumbered to the positions in block_ids.
Status kv_fp8_to_bf16_blocks(bf16* dst, const void* fp8_cache, const int32_t* block_ids, int32_t num_blocks,
                             int32_t num_kv_heads, int32_t head_dim, cudaStream_t stream);

// Dummy FP8 weights: n e4m3 bytes uniform in [-scale, scale) from a counter hash of (seed, index).
Status fill_uniform_fp8(uint8_t* out, size_t n, uint64_t seed, float scale, cudaStream_t stream);

}  // namespace pd::kernels::cuda
