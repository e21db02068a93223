// Argument structs of the CUDA kernels (see kernels.h for the contracts).
// Free of fmt/Status so the .cu files can include it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace pd::kernels::cuda {

using bf16 = __nv_bfloat16;

inline constexpr int32_t kKvBlockSize = 16;
inline constexpr int32_t kDecodeTokensPerBlock = kKvBlockSize;
// Decode attention splits each context into partitions of this many tokens
// by default (AttentionArgs::decode_partition_tokens picks 16..kDecodeMaxPartitionTokens).
inline constexpr int32_t kDecodePartitionTokens = 256;
// Largest partition: the ring kernel keeps one block id per lane, so a warp may own at most
// 32 blocks (4 warps x 32 x 16 tokens).
inline constexpr int32_t kDecodeMaxPartitionTokens = 2048;

// Per token t of qkv [num_tokens][(num_q_heads + 2*num_kv_heads) * head_dim]:
// optional per-head RMSNorm of q and k (Qwen3; weights [head_dim], null = off),
// rotary embedding (rotate-half form, angle = positions[t] * inv_freq[i],
// inv_freq has head_dim/2 entries, any scaling folded in by the host), then
// q goes to q_out [num_tokens][num_q_heads][head_dim] and k, v to the paged
// cache at slot slot_mapping[t] = block * 16 + offset (a negative slot writes
// nothing: padding rows of a CUDA graph).
struct RopeKvArgs {
  const bf16* qkv = nullptr;
  bf16* q_out = nullptr;
  bf16* kv_cache = nullptr;  // this layer's region
  const int32_t* positions = nullptr;
  const int32_t* slot_mapping = nullptr;
  const float* inv_freq = nullptr;
  const bf16* q_norm_weight = nullptr;
  const bf16* k_norm_weight = nullptr;
  float norm_eps = 1e-6f;
  int32_t num_tokens = 0;
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t block_size = kKvBlockSize;
  // FP8 KV cache (engine/README.md): kv_cache points at e4m3 blocks of
  // [2][block][kv heads][D] codes followed by [2][block][kv heads] fp32 scales; each
  // (token, kv head) row of K and V is stored as e4m3(x / s) with s = amax|x| / 448 (1 for 0),
  // x being the bf16-rounded value the bf16 cache would hold.
  bool kv_fp8 = false;
};
// Paged attention over the KV cache (which already holds this step's keys and
// values). Sequence s owns query rows [query_start[s], query_start[s+1]) of q
// and out ([tokens][num_q_heads][head_dim]); it has context_lens[s] keys in
// total, its new queries being the last ones (causal: query i of a sequence
// with q_len queries sits at position context_len - q_len + i). Its blocks are
// block_tables[s * max_blocks_per_seq + j]. GQA: q head h reads kv head
// h / (num_q_heads / num_kv_heads).
// Decode attention variants: tensor cores (the GQA group as the rows of an
// m16n8k16 tile; per-warp 2-stage cp.async rings of paged blocks), CUDA cores
// (dot products split over lanes + shuffles), or the first tensor-core version
// (CTA-wide single-buffered 64-key tiles, kept so both can be compared in one run).
enum class DecodeKernel : uint8_t { kTensorCore, kCudaCore, kTensorCoreSingleBuffer };
// Prefill attention variants: all q heads of a GQA group per CTA with a
// pipelined K/V ring (the default), or one q head per CTA (the first version,
// kept so both can be compared in one run).
enum class PrefillKernel : uint8_t { kGqaTiled, kPerHead };

struct AttentionArgs {
  const bf16* q = nullptr;
  bf16* out = nullptr;
  const bf16* kv_cache = nullptr;
  const int32_t* query_start = nullptr;   // [num_seqs + 1]
  const int32_t* context_lens = nullptr;  // [num_seqs]
  const int32_t* block_tables = nullptr;  // [num_seqs][max_blocks_per_seq]
  int32_t num_seqs = 0;
  int32_t max_blocks_per_seq = 0;
  int32_t max_query_len = 0;    // upper bound, sizes the prefill grid
  int32_t max_context_len = 0;  // upper bound, sizes the decode split
  int32_t num_q_heads = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t block_size = kKvBlockSize;
  float scale = 0.0f;  // softmax scale, usually 1/sqrt(head_dim)
  // Decode only: tokens per split-K partition, a multiple of 16 up to kDecodeMaxPartitionTokens
  // (0 = kDecodePartitionTokens). Smaller partitions give small batches more CTAs; larger ones
  // give each CTA more to stream per fixed start-up and merge cost.
  int32_t decode_partition_tokens = 0;
  // Decode, kTensorCore only: load K/V with an L2 evict-first hint. Each layer's KV is read
  // once per step, so it should not displace what is read again soon (the split-K partials
  // the reduce kernel reads next).
  bool decode_kv_evict_first = false;
  // Decode, kTensorCore only: 16-token blocks each warp keeps in its cp.async ring (2 or 3;
  // 3 takes 104 KiB of shared memory per CTA instead of 70 for head_dim 128).
  int32_t decode_kv_stages = 2;
  DecodeKernel decode_kernel = DecodeKernel::kTensorCore;
  // Decode, kTensorCore only: when set, the last CTA to finish of each (sequence, kv head)
  // merges the partitions itself, so no reduce kernel runs. At least num_seqs * num_kv_heads
  // counters, all zero before the first launch; every launch leaves them zero again (graph
  // replays rely on it). Two launches that may run at the same time must not share them.
  uint32_t* decode_merge_counters = nullptr;
  // Decode, kTensorCore only; diagnostics (engine_bench --ops timeline): when set, thread 0
  // of CTA i writes %globaltimer at entry, once the prior grids are done, when its last K/V
  // block is consumed and at exit (after the in-kernel merge, if any), to [4 * i, 4 * i + 4).
  // Sized for the grid the launch uses.
  unsigned long long* decode_cta_clock = nullptr;
  PrefillKernel prefill_kernel = PrefillKernel::kGqaTiled;
};

// Per-row sampling parameters for sample_rows (device array).
struct RowSampling {
  float temperature = 0.0f;  // <= 0: greedy
  float min_p = 0.0f;
  uint64_t rng_seed = 0;
  int32_t suppressed_begin = 0;  // into the suppressed-id array
  int32_t suppressed_end = 0;
};
inline constexpr int32_t kMaxSuppressedPerRow = 64;

}  // namespace pd::kernels::cuda
