// fp32 reference kernels of the CPU runner. Plain C++; every kernel is also
// the reference the CUDA kernels are compared with. Layouts are row-major;
// "rows" are tokens. Linear weights use the HF layout [out_features][in_features].
// Preconditions (sizes, ids in range) are the caller's: the runner validates
// its StepInput once before calling any kernel.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace pd::kernels::cpu {

// out[r][:] = table[ids[r]][:]
void embedding(const float* table, int32_t hidden, std::span<const int32_t> ids, float* out);

// out[r] = x[r] / rms(x[r]) * weight, rms = sqrt(mean(x^2) + eps). out may alias x.
void rms_norm(const float* x, const float* weight, int32_t rows, int32_t dim, float eps, float* out);

// Fused residual add + norm: residual[r] += delta[r]; out[r] = rms_norm(residual[r]).
void add_rms_norm(float* residual, const float* delta, const float* weight, int32_t rows, int32_t dim, float eps,
                  float* out);

// out[M][N] = x[M][K] * w[N][K]^T (+ bias[N] when bias != nullptr).
void matmul(const float* x, const float* w, const float* bias, int32_t m, int32_t n, int32_t k, float* out);

struct RopeScalingParams {
  bool llama3 = false;
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_max_position_embeddings = 8192;
};

// The head_dim/2 inverse frequencies theta^(-2i/d), with llama3 scaling when
// asked (HF's _compute_llama3_parameters), rounded to fp32 like HF's buffer.
std::vector<float> rope_inv_freq(int32_t head_dim, double theta, const RopeScalingParams& scaling);

// In-place neox-style RoPE (HF Llama/Qwen rotate_half): for each head, the
// pairs (x[i], x[i + d/2]) rotate by position * inv_freq[i].
// x: [rows][num_heads][head_dim]; positions: [rows].
void apply_rope(float* x, int32_t rows, int32_t num_heads, int32_t head_dim, const int32_t* positions,
                std::span<const float> inv_freq);

// The shared-memory all-reduce of tensor-parallel ranks: out[i] = ((p[0][i] +
// p[1][i]) + p[2][i]) + ..., always in rank order, so the sum does not depend on
// which rank finished first. out may alias p[0].
void sum_rank_partials(std::span<const float* const> partials, int64_t count, float* out);

// out[r][j] = silu(gate[r][j]) * up[r][j]
void silu_mul(const float* gate, const float* up, int64_t count, float* out);

// Dynamic activation quantisation of a block-FP8 linear's input, applied as
// quantise-then-dequantise: per row, per group of 128 columns (the last group
// may be narrower), scale = amax(|x|) / 448 (1 when that is 0), out = e4m3(x /
// scale) * scale with e4m3() rounding to nearest even and saturating at 448.
// out may alias x.
void fp8_quantize_activations(const float* x, int32_t rows, int32_t cols, float* out);

// MoE routing as HF Qwen3MoeSparseMoeBlock: per row, softmax over the experts'
// logits in fp32, the top_k largest (ties: lower expert id first), divided by
// their sum when norm_topk_prob. expert_ids/weights: [rows][top_k], in
// descending weight order.
void moe_route(const float* router_logits, int32_t rows, int32_t num_experts, int32_t top_k, bool norm_topk_prob,
               int32_t* expert_ids, float* weights);

// Paged KV cache of one layer, one block after the other. fp32: a block is
// [2 (K,V)][block_size][num_kv_heads][head_dim] floats. fp8: a block is
// [2][block_size][num_kv_heads][head_dim] e4m3 codes, then [2][block_size]
// [num_kv_heads] fp32 scales (engine::KvCacheSpec documents the same layout).
struct PagedKvLayout {
  int32_t num_blocks = 0;
  int32_t block_size = 16;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int64_t block_stride() const { return 2ll * block_size * num_kv_heads * head_dim; }  // fp32: floats
  int64_t token_stride() const { return static_cast<int64_t>(num_kv_heads) * head_dim; }
  int64_t fp8_block_bytes() const { return 2ll * block_size * num_kv_heads * (head_dim + 4); }
  int64_t fp8_codes_bytes() const { return static_cast<int64_t>(block_size) * token_stride(); }  // K or V codes
  int64_t fp8_scales_offset() const { return 2 * fp8_codes_bytes(); }  // K scales; V scales follow
};

// One (token, kv head) row of head_dim values to e4m3 codes and its scale
// (amax / 448, 1 when the row is all zero), as the fp8 KV cache stores them.
void quantize_kv_row(const float* x, int32_t head_dim, uint8_t* codes, float* scale);

// Writes k/v rows ([rows][num_kv_heads][head_dim]) to the cache at the slots
// slot = block_id * block_size + offset_in_block.
void write_kv_cache(float* kv_layer, const PagedKvLayout& layout, const float* k, const float* v, int32_t rows,
                    const int64_t* slots);

// Causal GQA attention of one sequence over the paged cache. Query row r sits at
// position positions[r] and attends to cache positions [0, positions[r]]; the
// cache position p lives in block block_table[p / block_size], offset p % block_size.
// q, out: [num_queries][num_heads][head_dim]. scratch must hold max(position)+1 floats.
void paged_attention(const float* q, int32_t num_queries, const int32_t* positions, const float* kv_layer,
                     const PagedKvLayout& layout, std::span<const int32_t> block_table, int32_t num_heads, float scale,
                     float* out, float* scratch);

// The same two over an fp8 cache: writes quantise each (token, head) row with
// quantize_kv_row; attention dequantises keys and values as it reads them.
void write_kv_cache_fp8(uint8_t* kv_layer, const PagedKvLayout& layout, const float* k, const float* v, int32_t rows,
                        const int64_t* slots);
void paged_attention_fp8(const float* q, int32_t num_queries, const int32_t* positions, const uint8_t* kv_layer,
                         const PagedKvLayout& layout, std::span<const int32_t> block_table, int32_t num_heads,
                         float scale, float* out, float* scratch);

}  // namespace pd::kernels::cpu
