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

}  // namespace pd::kernels::cuda
