// Paged attention over [num_blocks][2][16][num_kv_heads][head_dim] bf16 KV.
//
// Prefill (and chunked prefill): FlashAttention-2 style on mma.sync
// m16n8k16 (bf16 in, fp32 accumulate), online softmax in registers using the
// documented fragment layout of m16n8k16 (row = lane/4 and lane/4 + 8, columns
// 2*(lane%4) + {0,1}). Two variants (AttentionArgs::prefill_kernel):
// - kGqaTiled (default): one CTA = 128 (token, head) rows of one GQA group
//   (8 warps x 16 rows), so each K/V tile is read once for the whole group;
//   3-stage cp.async pipeline, causal tile skipping, heaviest CTAs first.
// - kPerHead (the first version, kept for comparison): one CTA = 64 query rows
//   of one q head (4 warps x 16 rows), synchronous single-buffered K/V tiles.
// Both stage key/value tiles of 64 tokens (4 paged blocks) in shared memory.
//
// Decode: one CTA = (sequence, kv head, partition of 16..256 tokens) serving all
// q heads of the GQA group, so each K/V byte is read once per step. A warp
// takes chunks of tokens; each token is split over head_dim/8 lanes holding
// 16 bytes each. Partial (max, sum, output) go to a workspace; the last CTA of
// each (sequence, kv head) merges them (AttentionArgs::decode_merge_counters;
// without counters, and for the older variants, a second kernel does).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cfloat>
#include <cstdint>

#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/pdl.cuh"

namespace pd::kernels::cuda::detail {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ldmatrix: lanes 8m..8m+7 give the row addresses of 8x8 matrix m; each lane
// receives (row lane/4, columns 2*(lane%4) + {0,1}) of every matrix (of its
// transpose with .trans), which is the m16n8k16 B-fragment layout.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  const auto addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  const auto addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// 2^x on the SFU; exp2(-inf) = +0, which the masked scores rely on.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

constexpr int kPrefillRows = 64;  // query rows per CTA
constexpr int kPrefillKeys = 64;  // keys per tile (4 KV blocks)
constexpr int kPrefillWarps = 4;
constexpr int kSmemPad = 8;  // bf16 per row: breaks the bank pattern of 32-bit fragment loads

template <int kHeadDim>
__global__ void __launch_bounds__(kPrefillWarps * 32) prefill_attention_per_head_kernel(AttentionArgs a) {
  constexpr int kStride = kHeadDim + kSmemPad;
  constexpr int kKSteps = kHeadDim / 16;       // k-steps of Q K^T
  constexpr int kSTiles = kPrefillKeys / 8;    // n-tiles of S
  constexpr int kOTiles = kHeadDim / 8;        // n-tiles of O
  constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks per K/V row
  __shared__ alignas(16) bf16 k_s[kPrefillKeys][kStride];
  __shared__ alignas(16) bf16 v_s[kPrefillKeys][kStride];

  const int seq = blockIdx.z;
  const int q_head = blockIdx.y;
  const int q_begin = a.query_start[seq];
  const int q_len = a.query_start[seq + 1] - q_begin;
  const int tile0 = blockIdx.x * kPrefillRows;
  if (tile0 >= q_len) return;
  const int ctx = a.context_lens[seq];
  const int first_pos = ctx - q_len;
  const int group = a.num_q_heads / a.num_kv_heads;
  const int kv_head = q_head / group;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int tq = lane & 3;
  const int r0 = tile0 + warp * 16 + g;
  const int r1 = r0 + 8;
  const int pos0 = first_pos + r0;
  const int pos1 = first_pos + r1;

  uint32_t qa[kKSteps][4];
  {
    const bf16* q0 = a.q + (static_cast<int64_t>(q_begin + r0) * a.num_q_heads + q_head) * kHeadDim;
    const bf16* q1 = a.q + (static_cast<int64_t>(q_begin + r1) * a.num_q_heads + q_head) * kHeadDim;
    const bool ok0 = r0 < q_len, ok1 = r1 < q_len;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      const int c = kk * 16 + 2 * tq;
      qa[kk][0] = ok0 ? *reinterpret_cast<const uint32_t*>(q0 + c) : 0u;
      qa[kk][1] = ok1 ? *reinterpret_cast<const uint32_t*>(q1 + c) : 0u;
      qa[kk][2] = ok0 ? *reinterpret_cast<const uint32_t*>(q0 + c + 8) : 0u;
      qa[kk][3] = ok1 ? *reinterpret_cast<const uint32_t*>(q1 + c + 8) : 0u;
    }
  }

  const float scale_log2 = a.scale * kLog2e;
  float m0 = -FLT_MAX, m1 = -FLT_MAX, l0 = 0.0f, l1 = 0.0f;
  float o[kOTiles][4];
#pragma unroll
  for (int nt = 0; nt < kOTiles; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;

  // Keys needed by this tile: up to the last valid query's position.
  const int last_row = min(tile0 + kPrefillRows, q_len) - 1;
  const int kv_end = min(ctx, first_pos + last_row + 1);
  const int64_t block_elems = 2LL * a.block_size * a.num_kv_heads * kHeadDim;
  const int32_t* table = a.block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;

  for (int kb = 0; kb < kv_end; kb += kPrefillKeys) {
    __syncthreads();  // the previous tile is consumed
    for (int idx = threadIdx.x; idx < kPrefillKeys * kChunksPerRow; idx += kPrefillWarps * 32) {
      const int row = idx / kChunksPerRow;
      const int chunk = idx % kChunksPerRow;
      const int key = kb + row;
      uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
      if (key < kv_end) {
        const int block = table[key / a.block_size];
        const bf16* src = a.kv_cache + block * block_elems +
                          (static_cast<int64_t>(key % a.block_size) * a.num_kv_heads + kv_head) * kHeadDim + chunk * 8;
        kv = *reinterpret_cast<const uint4*>(src);
        vv = *reinterpret_cast<const uint4*>(src + block_elems / 2);
      }
      *reinterpret_cast<uint4*>(&k_s[row][chunk * 8]) = kv;
      *reinterpret_cast<uint4*>(&v_s[row][chunk * 8]) = vv;
    }
    __syncthreads();

    float s[kSTiles][4];
#pragma unroll
    for (int nt = 0; nt < kSTiles; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
    // Lane's ldmatrix row: matrix m = lane / 8 covers n-tile (nt + m / 2), k half (m % 2).
    const int lm = lane >> 3, lr = lane & 7;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
#pragma unroll
      for (int nt = 0; nt < kSTiles; nt += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, &k_s[(nt + (lm >> 1)) * 8 + lr][kk * 16 + (lm & 1) * 8]);
        mma_bf16_16816(s[nt], qa[kk], b[0], b[1]);
        mma_bf16_16816(s[nt + 1], qa[kk], b[2], b[3]);
      }
    }

    float mx0 = -FLT_MAX, mx1 = -FLT_MAX;
#pragma unroll
    for (int nt = 0; nt < kSTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = kb + nt * 8 + 2 * tq + (e & 1);
        const int pos = e < 2 ? pos0 : pos1;
        const bool valid = key <= pos && key < kv_end;
        s[nt][e] = valid ? s[nt][e] * scale_log2 : -FLT_MAX;
      }
      mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
      mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
    }
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
    }
    const float m_new0 = fmaxf(m0, mx0), m_new1 = fmaxf(m1, mx1);
    const float alpha0 = exp2f(m0 - m_new0), alpha1 = exp2f(m1 - m_new1);
    m0 = m_new0;
    m1 = m_new1;
    float sum0 = 0.0f, sum1 = 0.0f;
#pragma unroll
    for (int nt = 0; nt < kSTiles; ++nt) {
      // A masked score is -FLT_MAX: exp2 of a huge negative is exactly 0, and a
      // row with no valid key yet keeps m = -FLT_MAX, so no inf - inf appears.
      s[nt][0] = s[nt][0] == -FLT_MAX ? 0.0f : exp2f(s[nt][0] - m0);
      s[nt][1] = s[nt][1] == -FLT_MAX ? 0.0f : exp2f(s[nt][1] - m0);
      s[nt][2] = s[nt][2] == -FLT_MAX ? 0.0f : exp2f(s[nt][2] - m1);
      s[nt][3] = s[nt][3] == -FLT_MAX ? 0.0f : exp2f(s[nt][3] - m1);
      sum0 += s[nt][0] + s[nt][1];
      sum1 += s[nt][2] + s[nt][3];
    }
    l0 = l0 * alpha0 + sum0;
    l1 = l1 * alpha1 + sum1;
#pragma unroll
    for (int nt = 0; nt < kOTiles; ++nt) {
      o[nt][0] *= alpha0;
      o[nt][1] *= alpha0;
      o[nt][2] *= alpha1;
      o[nt][3] *= alpha1;
    }
#pragma unroll
    for (int kk = 0; kk < kPrefillKeys / 16; ++kk) {
      const uint32_t pa[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                              pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int nt = 0; nt < kOTiles; nt += 2) {
        // Matrix m: keys kk*16 + (m % 2) * 8 .., head-dim columns (nt + m / 2) * 8 .., transposed.
        uint32_t b[4];
        ldmatrix_x4_trans(b, &v_s[kk * 16 + (lm & 1) * 8 + lr][(nt + (lm >> 1)) * 8]);
        mma_bf16_16816(o[nt], pa, b[0], b[1]);
        mma_bf16_16816(o[nt + 1], pa, b[2], b[3]);
      }
    }
  }

#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, off);
    l1 += __shfl_xor_sync(0xffffffffu, l1, off);
  }
  const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f;
  const float inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
  bf16* out0 = a.out + (static_cast<int64_t>(q_begin + r0) * a.num_q_heads + q_head) * kHeadDim;
  bf16* out1 = a.out + (static_cast<int64_t>(q_begin + r1) * a.num_q_heads + q_head) * kHeadDim;
#pragma unroll
  for (int nt = 0; nt < kOTiles; ++nt) {
    const int c = nt * 8 + 2 * tq;
    if (r0 < q_len)
      *reinterpret_cast<__nv_bfloat162*>(out0 + c) = __floats2bfloat162_rn(o[nt][0] * inv0, o[nt][1] * inv0);
    if (r1 < q_len)
      *reinterpret_cast<__nv_bfloat162*>(out1 + c) = __floats2bfloat162_rn(o[nt][2] * inv1, o[nt][3] * inv1);
  }
}

// ------------------------------------------ prefill, GQA-tiled (the default)
// The q heads of a GQA group read the same keys, so one CTA serves one
// (sequence, kv head) and its M dimension is the flattened (token, head) space
// of that group: row r is token r / G, q head r % G (G = q heads per kv head).
// Each K/V tile fetched from the paged cache then feeds G heads, and a CTA's
// 128 rows span only 128 / G tokens, so few of its tiles cross the diagonal.
// 8 warps x 16 rows; each warp keeps its own online softmax in registers
// (scores pre-scaled by log2(e), exp2 on the SFU). K/V tiles of 64 keys flow
// through a 3-stage cp.async ring: tile j + 2 is in flight while tile j is
// computed, with one barrier per tile. A warp skips tiles wholly above its
// causal diagonal and masks only the tiles that cross it. CTAs start heaviest
// first (the last token tiles see the most keys) so the causal tail is short.
constexpr int kGqaWarps = 8;
constexpr int kGqaThreads = kGqaWarps * 32;
constexpr int kGqaRows = kGqaWarps * 16;  // flattened (token, head) rows per CTA
constexpr int kGqaKeys = 64;              // keys per tile (4 KV blocks)
constexpr int kGqaStages = 3;

template <int kHeadDim>
constexpr int gqa_prefill_smem_bytes() {
  return kGqaStages * 2 * kGqaKeys * (kHeadDim + kSmemPad) * static_cast<int>(sizeof(bf16));
}

// Copies one K/V tile of one kv head (keys [kb, kb + kGqaKeys)) from the paged
// cache into shared memory ([kGqaKeys][kHeadDim + kSmemPad] each) with cp.async.
// Thread t copies 16-byte chunk t % kChunksPerRow of rows t / kChunksPerRow +
// i * kRowsPerCopy; kRowsPerCopy is a multiple of the block size, so the slot
// within a block and all offsets are fixed per thread and only the block ids
// change from tile to tile. Split in two so a tile's block-table reads are
// issued one iteration before its copies: a dependent global load just before
// the copies would stall every warp right after the barrier.
template <int kHeadDim>
struct KvTileLoader {
  static constexpr int kStride = kHeadDim + kSmemPad;
  static constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks per key row
  static constexpr int kRowsPerCopy = kGqaThreads / kChunksPerRow;
  static constexpr int kCopies = kGqaKeys / kRowsPerCopy;
  static_assert(kRowsPerCopy % kKvBlockSize == 0 && kGqaKeys % kRowsPerCopy == 0, "fixed slot per thread");

  int first_row;            // of this thread within the tile
  int src_offset;           // slot, kv head and chunk within a paged block (elements)
  int dst_offset;           // first row and chunk within a shared tile (elements)
  int32_t blocks[kCopies];  // paged block of each of this thread's rows

  __device__ __forceinline__ KvTileLoader(int num_kv_heads, int kv_head) {
    const int tid = static_cast<int>(threadIdx.x);
    const int chunk = tid % kChunksPerRow;
    first_row = tid / kChunksPerRow;
    src_offset = ((first_row % kKvBlockSize) * num_kv_heads + kv_head) * kHeadDim + chunk * 8;
    dst_offset = first_row * kStride + chunk * 8;
  }

  // Keys >= kv_end read the tile's first block (kb < kv_end, so it is mapped); their copies read nothing.
  __device__ __forceinline__ void fetch_blocks(const int32_t* __restrict__ table, int kb, int kv_end) {
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int key = kb + first_row + i * kRowsPerCopy;
      blocks[i] = table[static_cast<unsigned>(key < kv_end ? key : kb) / kKvBlockSize];
    }
  }

  // Keys >= kv_end are zero-filled, so a masked key never multiplies leftover
  // shared memory (NaN * 0 = NaN).
  __device__ __forceinline__ void copy(bf16* k_dst, bf16* v_dst, const bf16* __restrict__ kv_cache, int kb, int kv_end,
                                       int block_elems) const {
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const bool valid = kb + first_row + i * kRowsPerCopy < kv_end;
      const bf16* src = kv_cache + static_cast<int64_t>(blocks[i]) * block_elems + src_offset;
      const int dst = dst_offset + i * kRowsPerCopy * kStride;
      cp_async_16(k_dst + dst, src, valid);
      cp_async_16(v_dst + dst, src + block_elems / 2, valid);
    }
  }
};

// Grid: (num_kv_heads, num_seqs, row tiles) with the row tile reversed
// (blockIdx.z = 0 is the last tile) so the longest CTAs are dispatched first.
template <int kHeadDim>
__global__ void __launch_bounds__(kGqaThreads, kHeadDim == 64 ? 2 : 1) prefill_attention_gqa_kernel(AttentionArgs a) {
  constexpr int kStride = kHeadDim + kSmemPad;
  constexpr int kTileElems = kGqaKeys * kStride;  // one K or V tile
  constexpr int kKSteps = kHeadDim / 16;          // k-steps of Q K^T
  constexpr int kSTiles = kGqaKeys / 8;           // n-tiles of S
  constexpr int kOTiles = kHeadDim / 8;           // n-tiles of O
  extern __shared__ __align__(16) unsigned char gqa_smem[];
  bf16* const stages = reinterpret_cast<bf16*>(gqa_smem);  // [kGqaStages][K, V][kGqaKeys][kStride]

  const int kv_head = blockIdx.x;
  const int seq = blockIdx.y;
  const int tile = static_cast<int>(gridDim.z - 1 - blockIdx.z);
  const int q_begin = a.query_start[seq];
  const int q_len = a.query_start[seq + 1] - q_begin;
  const int group = a.num_q_heads / a.num_kv_heads;
  const int num_rows = q_len * group;
  const int row0 = tile * kGqaRows;
  if (row0 >= num_rows) return;
  const int ctx = a.context_lens[seq];
  const int first_pos = ctx - q_len;  // position of the sequence's first query
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int tq = lane & 3;
  const int lm = lane >> 3, lr = lane & 7;  // ldmatrix: matrix index, row within it

  // This thread's fragment rows (g and g + 8 of the warp's 16). Rows past the
  // sequence are clamped onto its last row: they compute a copy, store nothing.
  const int warp_row0 = row0 + warp * 16;
  const int ra = warp_row0 + g, rb = ra + 8;
  const int ra_c = min(ra, num_rows - 1), rb_c = min(rb, num_rows - 1);
  const int tok_a = ra_c / group, tok_b = rb_c / group;
  const int head_a = kv_head * group + ra_c % group, head_b = kv_head * group + rb_c % group;
  const int pos_a = first_pos + tok_a, pos_b = first_pos + tok_b;
  const bool warp_active = warp_row0 < num_rows;
  const int warp_min_pos = first_pos + min(warp_row0, num_rows - 1) / group;
  const int warp_max_pos = first_pos + min(warp_row0 + 15, num_rows - 1) / group;
  const int cta_max_pos = first_pos + (min(row0 + kGqaRows, num_rows) - 1) / group;
  const int kv_end = min(ctx, cta_max_pos + 1);  // keys this CTA needs
  const int num_tiles = kv_end > 0 ? (kv_end + kGqaKeys - 1) / kGqaKeys : 0;

  const int block_elems = 2 * kKvBlockSize * a.num_kv_heads * kHeadDim;  // K and V of one paged block
  const int32_t* table = a.block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;
  // Prologue: the first kGqaStages - 1 tiles in flight, one commit group each
  // (empty groups keep the count uniform when there are fewer tiles), and the
  // block ids of the next tile fetched.
  KvTileLoader<kHeadDim> loader(a.num_kv_heads, kv_head);
#pragma unroll
  for (int j = 0; j < kGqaStages - 1; ++j) {
    if (j < num_tiles) {
      bf16* k_dst = stages + j * 2 * kTileElems;
      loader.fetch_blocks(table, j * kGqaKeys, kv_end);
      loader.copy(k_dst, k_dst + kTileElems, a.kv_cache, j * kGqaKeys, kv_end, block_elems);
    }
    cp_async_commit();
  }
  if (kGqaStages - 1 < num_tiles) loader.fetch_blocks(table, (kGqaStages - 1) * kGqaKeys, kv_end);
  int read_stage = 0, write_stage = kGqaStages - 1;  // ring positions of tiles j and j + kGqaStages - 1

  uint32_t qf[kKSteps][4];
  {
    const bf16* qa_row = a.q + (static_cast<int64_t>(q_begin + tok_a) * a.num_q_heads + head_a) * kHeadDim;
    const bf16* qb_row = a.q + (static_cast<int64_t>(q_begin + tok_b) * a.num_q_heads + head_b) * kHeadDim;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      const int c = kk * 16 + 2 * tq;
      qf[kk][0] = *reinterpret_cast<const uint32_t*>(qa_row + c);
      qf[kk][1] = *reinterpret_cast<const uint32_t*>(qb_row + c);
      qf[kk][2] = *reinterpret_cast<const uint32_t*>(qa_row + c + 8);
      qf[kk][3] = *reinterpret_cast<const uint32_t*>(qb_row + c + 8);
    }
  }

  const float scale_log2 = a.scale * kLog2e;
  float m_a = -INFINITY, m_b = -INFINITY;  // running max of the scaled scores (log2 units)
  float l_a = 0.0f, l_b = 0.0f;            // this thread's share of the running row sums
  float o[kOTiles][4];
#pragma unroll
  for (int nt = 0; nt < kOTiles; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;

  for (int j = 0; j < num_tiles; ++j) {
    cp_async_wait<kGqaStages - 2>();  // this thread's copies of tile j have landed
    __syncthreads();                  // everyone's have, and every warp is done with tile j - 1
    {
      // Refill the stage that tile j - 1 used with tile j + kGqaStages - 1.
      const int jn = j + kGqaStages - 1;
      if (jn < num_tiles) {
        bf16* k_dst = stages + write_stage * 2 * kTileElems;
        loader.copy(k_dst, k_dst + kTileElems, a.kv_cache, jn * kGqaKeys, kv_end, block_elems);
        if (jn + 1 < num_tiles) loader.fetch_blocks(table, (jn + 1) * kGqaKeys, kv_end);
      }
      cp_async_commit();
      write_stage = write_stage == kGqaStages - 1 ? 0 : write_stage + 1;
    }
    const bf16* k_s = stages + read_stage * 2 * kTileElems;
    const bf16* v_s = k_s + kTileElems;
    read_stage = read_stage == kGqaStages - 1 ? 0 : read_stage + 1;
    const int kb = j * kGqaKeys;
    if (!warp_active || kb > warp_max_pos) continue;  // every key of the tile is in this warp's future

    float s[kSTiles][4];
#pragma unroll
    for (int nt = 0; nt < kSTiles; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
#pragma unroll
      for (int nt = 0; nt < kSTiles; nt += 2) {
        // Matrix m = lm: keys of n-tile nt + m / 2, head-dim half m % 2 of k-step kk.
        uint32_t b[4];
        ldmatrix_x4(b, k_s + ((nt + (lm >> 1)) * 8 + lr) * kStride + kk * 16 + (lm & 1) * 8);
        mma_bf16_16816(s[nt], qf[kk], b[0], b[1]);
        mma_bf16_16816(s[nt + 1], qf[kk], b[2], b[3]);
      }
    }
    // Only a tile that reaches past this warp's first position can hold a key
    // in some row's future (keys >= kv_end are past every row's position too).
    if (kb + kGqaKeys - 1 > warp_min_pos) {
#pragma unroll
      for (int nt = 0; nt < kSTiles; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = kb + nt * 8 + 2 * tq + (e & 1);
          if (key > (e < 2 ? pos_a : pos_b)) s[nt][e] = -INFINITY;
        }
      }
    }
    float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kSTiles; ++nt) {
      mx_a = fmaxf(mx_a, fmaxf(s[nt][0], s[nt][1]));
      mx_b = fmaxf(mx_b, fmaxf(s[nt][2], s[nt][3]));
    }
#pragma unroll
    for (int off = 1; off <= 2; off <<= 1) {  // the 4 lanes of a quad share rows
      mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, off));
      mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, off));
    }
    const float new_m_a = fmaxf(m_a, mx_a * scale_log2);
    const float new_m_b = fmaxf(m_b, mx_b * scale_log2);
    // A row with no valid key yet stays at -inf; subtracting 0 then keeps
    // exp2(-inf - base) = 0 instead of exp2(-inf + inf) = NaN.
    const float base_a = new_m_a == -INFINITY ? 0.0f : new_m_a;
    const float base_b = new_m_b == -INFINITY ? 0.0f : new_m_b;
    const float alpha_a = fast_exp2(m_a - base_a);
    const float alpha_b = fast_exp2(m_b - base_b);
    m_a = new_m_a;
    m_b = new_m_b;
    float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
    for (int nt = 0; nt < kSTiles; ++nt) {
      s[nt][0] = fast_exp2(fmaf(s[nt][0], scale_log2, -base_a));
      s[nt][1] = fast_exp2(fmaf(s[nt][1], scale_log2, -base_a));
      s[nt][2] = fast_exp2(fmaf(s[nt][2], scale_log2, -base_b));
      s[nt][3] = fast_exp2(fmaf(s[nt][3], scale_log2, -base_b));
      sum_a += s[nt][0] + s[nt][1];
      sum_b += s[nt][2] + s[nt][3];
    }
    l_a = l_a * alpha_a + sum_a;
    l_b = l_b * alpha_b + sum_b;
#pragma unroll
    for (int nt = 0; nt < kOTiles; ++nt) {
      o[nt][0] *= alpha_a;
      o[nt][1] *= alpha_a;
      o[nt][2] *= alpha_b;
      o[nt][3] *= alpha_b;
    }
#pragma unroll
    for (int kk = 0; kk < kGqaKeys / 16; ++kk) {
      // The S accumulators of n-tiles 2kk, 2kk + 1 are exactly the A fragment of keys [16kk, 16kk + 16).
      const uint32_t pa[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                              pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int nt = 0; nt < kOTiles; nt += 2) {
        // Matrix m: keys kk*16 + (m % 2) * 8 .., head-dim columns (nt + m / 2) * 8 .., transposed.
        uint32_t b[4];
        ldmatrix_x4_trans(b, v_s + (kk * 16 + (lm & 1) * 8 + lr) * kStride + (nt + (lm >> 1)) * 8);
        mma_bf16_16816(o[nt], pa, b[0], b[1]);
        mma_bf16_16816(o[nt + 1], pa, b[2], b[3]);
      }
    }
  }
  if (!warp_active) return;

#pragma unroll
  for (int off = 1; off <= 2; off <<= 1) {
    l_a += __shfl_xor_sync(0xffffffffu, l_a, off);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, off);
  }
  const float inv_a = l_a > 0.0f ? 1.0f / l_a : 0.0f;
  const float inv_b = l_b > 0.0f ? 1.0f / l_b : 0.0f;
  // Output rows from the row index again (cheaper than keeping them live through the loop).
  const int out_ra = row0 + warp * 16 + g, out_rb = out_ra + 8;
  bf16* out_a =
      a.out +
      (static_cast<int64_t>(q_begin + out_ra / group) * a.num_q_heads + kv_head * group + out_ra % group) * kHeadDim;
  bf16* out_b =
      a.out +
      (static_cast<int64_t>(q_begin + out_rb / group) * a.num_q_heads + kv_head * group + out_rb % group) * kHeadDim;
#pragma unroll
  for (int nt = 0; nt < kOTiles; ++nt) {
    const int c = nt * 8 + 2 * tq;
    if (ra < num_rows)
      *reinterpret_cast<__nv_bfloat162*>(out_a + c) = __floats2bfloat162_rn(o[nt][0] * inv_a, o[nt][1] * inv_a);
    if (rb < num_rows)
      *reinterpret_cast<__nv_bfloat162*>(out_b + c) = __floats2bfloat162_rn(o[nt][2] * inv_b, o[nt][3] * inv_b);
  }
}

template <int kHeadDim>
cudaError_t launch_prefill_gqa(const AttentionArgs& args, cudaStream_t stream) {
  constexpr int kSmemBytes = gqa_prefill_smem_bytes<kHeadDim>();  // > 48 KiB: needs the opt-in
  cudaError_t err = opt_in_dynamic_smem<prefill_attention_gqa_kernel<kHeadDim>>(kSmemBytes);
  if (err != cudaSuccess) return err;
  const int64_t rows = static_cast<int64_t>(args.max_query_len) * (args.num_q_heads / args.num_kv_heads);
  const int64_t row_tiles = (rows + kGqaRows - 1) / kGqaRows;
  if (row_tiles > 65535 || args.num_seqs > 65535) return cudaErrorInvalidConfiguration;  // grid y/z limits
  const dim3 grid(args.num_kv_heads, args.num_seqs, static_cast<unsigned>(row_tiles));
  prefill_attention_gqa_kernel<kHeadDim><<<grid, kGqaThreads, kSmemBytes, stream>>>(args);
  return cudaGetLastError();
}

// ---------------------------------------------------------------- decode

constexpr int kDecodeWarps = 4;

__device__ __forceinline__ void bf16x8_to_float(const uint4& v, float (&f)[8]) {
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __bfloat1622float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

template <int kHeadDim, int kMaxGroup>
__global__ void __launch_bounds__(kDecodeWarps * 32)
    decode_attention_kernel(AttentionArgs a, float* __restrict__ part_lse, float* __restrict__ part_out,
                            int32_t num_partitions) {
  constexpr int kLanesPerTok = kHeadDim / 8;
  constexpr int kTokPerStep = 32 / kLanesPerTok;
  // Steps per chunk bound the score registers (steps x group <= 32).
  constexpr int kStepsFull = kDecodeTokensPerBlock / kTokPerStep;
  constexpr int kStepsCap = 32 / kMaxGroup;
  constexpr int kSteps = kStepsFull < kStepsCap ? kStepsFull : kStepsCap;
  constexpr int kChunkTokens = kSteps * kTokPerStep;

  const int seq = blockIdx.z;
  const int kv_head = blockIdx.y;
  const int part = blockIdx.x;
  const int ctx = a.context_lens[seq];
  const int part_tokens = a.decode_partition_tokens;
  const int part_begin = part * part_tokens;
  if (part_begin >= ctx) return;  // the reduce reads only partitions below ctx
  const int part_end = min(ctx, part_begin + part_tokens);
  const int group = a.num_q_heads / a.num_kv_heads;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int sub = lane / kLanesPerTok;
  const int dl = lane % kLanesPerTok;
  const int q_row = a.query_start[seq];

  const float scale_log2 = a.scale * kLog2e;
  float qf[kMaxGroup][8];
#pragma unroll
  for (int h = 0; h < kMaxGroup; ++h) {
    if (h < group) {
      const bf16* qp = a.q + (static_cast<int64_t>(q_row) * a.num_q_heads + kv_head * group + h) * kHeadDim + dl * 8;
      bf16x8_to_float(*reinterpret_cast<const uint4*>(qp), qf[h]);
#pragma unroll
      for (int e = 0; e < 8; ++e) qf[h][e] *= scale_log2;
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) qf[h][e] = 0.0f;
    }
  }
  float m[kMaxGroup], l[kMaxGroup], acc[kMaxGroup][8];
#pragma unroll
  for (int h = 0; h < kMaxGroup; ++h) {
    m[h] = -FLT_MAX;
    l[h] = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[h][e] = 0.0f;
  }

  const int64_t block_elems = 2LL * a.block_size * a.num_kv_heads * kHeadDim;
  const int64_t token_stride = static_cast<int64_t>(a.num_kv_heads) * kHeadDim;
  const int32_t* table = a.block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;
  const int num_chunks = (part_end - part_begin + kChunkTokens - 1) / kChunkTokens;

  for (int c = warp; c < num_chunks; c += kDecodeWarps) {
    const int chunk_begin = part_begin + c * kChunkTokens;  // never crosses a block: kChunkTokens | 16
    const int block = table[chunk_begin / kDecodeTokensPerBlock];
    const bf16* kbase = a.kv_cache + block * block_elems + (chunk_begin % kDecodeTokensPerBlock) * token_stride +
                        kv_head * kHeadDim + dl * 8;
    uint4 kr[kSteps], vr[kSteps];
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
      const int tok = chunk_begin + j * kTokPerStep + sub;
      if (tok < part_end) {
        const bf16* p = kbase + (j * kTokPerStep + sub) * token_stride;
        kr[j] = *reinterpret_cast<const uint4*>(p);
        vr[j] = *reinterpret_cast<const uint4*>(p + block_elems / 2);
      } else {
        kr[j] = vr[j] = make_uint4(0, 0, 0, 0);
      }
    }
    float sc[kSteps][kMaxGroup];
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
      float kf[8];
      bf16x8_to_float(kr[j], kf);
      const bool valid = chunk_begin + j * kTokPerStep + sub < part_end;
#pragma unroll
      for (int h = 0; h < kMaxGroup; ++h) {
        float d = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) d += kf[e] * qf[h][e];
#pragma unroll
        for (int off = 1; off < kLanesPerTok; off <<= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
        sc[j][h] = valid ? d : -FLT_MAX;
      }
    }
#pragma unroll
    for (int h = 0; h < kMaxGroup; ++h) {
      float mx = -FLT_MAX;
#pragma unroll
      for (int j = 0; j < kSteps; ++j) mx = fmaxf(mx, sc[j][h]);
#pragma unroll
      for (int off = kLanesPerTok; off < 32; off <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_new = fmaxf(m[h], mx);
      const float alpha = exp2f(m[h] - m_new);
      m[h] = m_new;
      l[h] *= alpha;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[h][e] *= alpha;
#pragma unroll
      for (int j = 0; j < kSteps; ++j) {
        const float p = sc[j][h] == -FLT_MAX ? 0.0f : exp2f(sc[j][h] - m_new);
        sc[j][h] = p;
        l[h] += p;
      }
    }
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
      float vf[8];
      bf16x8_to_float(vr[j], vf);
#pragma unroll
      for (int h = 0; h < kMaxGroup; ++h) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[h][e] += sc[j][h] * vf[e];
      }
    }
  }

  // Fold the token sub-groups of the warp (they share m), then merge warps.
#pragma unroll
  for (int h = 0; h < kMaxGroup; ++h) {
#pragma unroll
    for (int off = kLanesPerTok; off < 32; off <<= 1) {
      l[h] += __shfl_xor_sync(0xffffffffu, l[h], off);
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[h][e] += __shfl_xor_sync(0xffffffffu, acc[h][e], off);
    }
  }
  __shared__ float m_s[kDecodeWarps][kMaxGroup];
  __shared__ float l_s[kDecodeWarps][kMaxGroup];
  __shared__ alignas(16) float acc_s[kDecodeWarps][kMaxGroup][kHeadDim];
  if (sub == 0) {
#pragma unroll
    for (int h = 0; h < kMaxGroup; ++h) {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc_s[warp][h][dl * 8 + e] = acc[h][e];
      if (dl == 0) {
        m_s[warp][h] = m[h];
        l_s[warp][h] = l[h];
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < group * kHeadDim; idx += kDecodeWarps * 32) {
    const int h = idx / kHeadDim;
    const int d = idx % kHeadDim;
    float mm = -FLT_MAX;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) mm = fmaxf(mm, m_s[w][h]);
    float sum = 0.0f, out = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float f = m_s[w][h] == -FLT_MAX ? 0.0f : exp2f(m_s[w][h] - mm);
      sum += l_s[w][h] * f;
      out += acc_s[w][h][d] * f;
    }
    const int q_head = kv_head * group + h;
    const int64_t pidx = (static_cast<int64_t>(seq) * a.num_q_heads + q_head) * num_partitions + part;
    part_out[pidx * kHeadDim + d] = out / sum;
    if (d == 0) part_lse[pidx] = mm + log2f(sum);
  }
}

// ------------------------------------------------ decode on tensor cores
// One CTA = (partition, kv head, sequence). The G q heads of the group are the
// rows of a 16-row m16n8k16 A operand (rows >= G are zero), so S = Q K^T and
// O += P V run on tensor cores and each K/V byte is read once per step. Each
// warp runs its own online softmax over its share of the keys, 16 at a time;
// the warps are merged at the end. Two ways to stage the keys (DecodeKernel):
// - kTensorCore (default): warp w owns the paged blocks w, w + 4, ... of the
//   partition and streams them through its own 2-stage cp.async ring, so up to
//   two blocks per warp are in flight and warps never wait for each other
//   before the merge; the block ids come from one table read per warp.
// - kTensorCoreSingleBuffer (the first version): key tiles of 64 tokens (4
//   paged blocks) are loaded by the whole CTA, waited for, then computed.
// Keys past the partition are zero-filled in shared memory and masked.
constexpr int kMmaDecodeKeys = 64;
constexpr int kMmaDecodeWarps = 4;
constexpr int kMmaDecodeMaxRows = 8;  // group bucket of the 8-row kernels: only A rows 0..7 carry heads
// GQA groups of 9..16 (Qwen3-235B-A22B: 16) use all 16 A rows (the ring kernels, head_dim 128).
constexpr int kMmaDecodeMaxRows16 = 16;

// Q fragment of the GQA group: A row g < group is q head kv_head * group + g.
template <int kHeadDim>
__device__ __forceinline__ void load_decode_q(uint32_t (&qa)[kHeadDim / 16][4], const AttentionArgs& a, int seq,
                                              int kv_head, int group) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int tq = lane & 3;
  const bool has = g < group;
  const bool has8 = g + 8 < group;  // A row g + 8 (groups above 8)
  const bf16* q0 = a.q + static_cast<int64_t>(a.query_start[seq]) * a.num_q_heads * kHeadDim;
  const bf16* qp = q0 + static_cast<int64_t>(kv_head * group + (has ? g : 0)) * kHeadDim;
  const bf16* qp8 = q0 + static_cast<int64_t>(kv_head * group + (has8 ? g + 8 : 0)) * kHeadDim;
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    const int c = kk * 16 + 2 * tq;
    qa[kk][0] = has ? *reinterpret_cast<const uint32_t*>(qp + c) : 0u;
    qa[kk][1] = has8 ? *reinterpret_cast<const uint32_t*>(qp8 + c) : 0u;
    qa[kk][2] = has ? *reinterpret_cast<const uint32_t*>(qp + c + 8) : 0u;
    qa[kk][3] = has8 ? *reinterpret_cast<const uint32_t*>(qp8 + c + 8) : 0u;
  }
}

// One warp's online-softmax step over 16 keys: rows 0..15 of k_rows / v_rows
// (row stride kHeadDim + kSmemPad) hold keys key0 .. key0 + 15; keys >= part_end are masked.
// kRows 8: A rows 0..7 carry q heads (m0 / l0, o[.][0..1]); kRows 16: rows 8..15 too (m1 / l1,
// o[.][2..3]).
template <int kHeadDim, int kRows = kMmaDecodeMaxRows>
__device__ __forceinline__ void decode_mma_step(const bf16* k_rows, const bf16* v_rows,
                                                const uint32_t (&qa)[kHeadDim / 16][4], int key0, int part_end,
                                                float scale_log2, float& m0, float& l0, float& m1, float& l1,
                                                float (&o)[kHeadDim / 8][4]) {
  constexpr int kStride = kHeadDim + kSmemPad;
  const int lane = threadIdx.x & 31;
  const int tq = lane & 3;
  const int lm = lane >> 3, lr = lane & 7;
  // S for the 16 keys: two n-tiles.
  float sc[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    uint32_t b[4];
    ldmatrix_x4(b, k_rows + ((lm >> 1) * 8 + lr) * kStride + kk * 16 + (lm & 1) * 8);
    mma_bf16_16816(sc[0], qa[kk], b[0], b[1]);
    mma_bf16_16816(sc[1], qa[kk], b[2], b[3]);
  }
  // Online softmax of A row r (0: row g, 1: row g + 8): sc[nt][2 r + e].
  auto softmax_row = [&](int r, float& m, float& l) {
    float mx = -FLT_MAX;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = key0 + nt * 8 + 2 * tq + e;
        sc[nt][2 * r + e] = key < part_end ? sc[nt][2 * r + e] * scale_log2 : -FLT_MAX;
        mx = fmaxf(mx, sc[nt][2 * r + e]);
      }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m, mx);
    const float alpha = exp2f(m - m_new);
    m = m_new;
    float sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        sc[nt][2 * r + e] = sc[nt][2 * r + e] == -FLT_MAX ? 0.0f : exp2f(sc[nt][2 * r + e] - m_new);
        sum += sc[nt][2 * r + e];
      }
    }
    l = l * alpha + sum;
#pragma unroll
    for (int nt = 0; nt < kHeadDim / 8; ++nt) {
      o[nt][2 * r] *= alpha;
      o[nt][2 * r + 1] *= alpha;
    }
  };
  softmax_row(0, m0, l0);
  if constexpr (kRows > 8) softmax_row(1, m1, l1);
  const uint32_t pa[4] = {pack_bf16x2(sc[0][0], sc[0][1]), kRows > 8 ? pack_bf16x2(sc[0][2], sc[0][3]) : 0u,
                          pack_bf16x2(sc[1][0], sc[1][1]), kRows > 8 ? pack_bf16x2(sc[1][2], sc[1][3]) : 0u};
#pragma unroll
  for (int nt = 0; nt < kHeadDim / 8; nt += 2) {
    uint32_t b[4];
    ldmatrix_x4_trans(b, v_rows + ((lm & 1) * 8 + lr) * kStride + (nt + (lm >> 1)) * 8);
    mma_bf16_16816(o[nt], pa, b[0], b[1]);
    mma_bf16_16816(o[nt + 1], pa, b[2], b[3]);
  }
}

// Merges the warps' (m, l, o) of one CTA and writes the partition's partial
// output and log2-sum-exp. Every thread of the CTA must call it; o_s is
// shared memory of kMmaDecodeWarps * kMmaDecodeMaxRows * kHeadDim floats that
// may alias the key staging area (the first barrier protects it).
template <int kHeadDim, int kRows = kMmaDecodeMaxRows>
__device__ __forceinline__ void decode_mma_merge(const float (&o)[kHeadDim / 8][4], float m0, float l0, float m1,
                                                 float l1, float* o_s, float (&m_s)[kMmaDecodeWarps][kRows],
                                                 float (&l_s)[kMmaDecodeWarps][kRows], const AttentionArgs& a,
                                                 int group, int seq, int kv_head, int part, int32_t num_partitions,
                                                 float* __restrict__ part_lse, float* __restrict__ part_out) {
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int tq = lane & 3;
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  if constexpr (kRows > 8) {
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  }
  __syncthreads();  // every warp is done with the staging area o_s may alias
#pragma unroll
  for (int r = 0; r < (kRows > 8 ? 2 : 1); ++r) {
    const int row = g + 8 * r;
    if (row < group) {
#pragma unroll
      for (int nt = 0; nt < kHeadDim / 8; ++nt) {
        float* dst = o_s + (warp * kRows + row) * kHeadDim + nt * 8 + 2 * tq;
        dst[0] = o[nt][2 * r];
        dst[1] = o[nt][2 * r + 1];
      }
      if (tq == 0) {
        m_s[warp][row] = r == 0 ? m0 : m1;
        l_s[warp][row] = r == 0 ? l0 : l1;
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < group * kHeadDim; idx += kMmaDecodeWarps * 32) {
    const int h = idx / kHeadDim;
    const int d = idx % kHeadDim;
    float mm = -FLT_MAX;
#pragma unroll
    for (int w = 0; w < kMmaDecodeWarps; ++w) mm = fmaxf(mm, m_s[w][h]);
    float sum = 0.0f, out = 0.0f;
#pragma unroll
    for (int w = 0; w < kMmaDecodeWarps; ++w) {
      const float f = m_s[w][h] == -FLT_MAX ? 0.0f : exp2f(m_s[w][h] - mm);
      sum += l_s[w][h] * f;
      out += o_s[(w * kRows + h) * kHeadDim + d] * f;
    }
    const int q_head = kv_head * group + h;
    const int64_t pidx = (static_cast<int64_t>(seq) * a.num_q_heads + q_head) * num_partitions + part;
    part_out[pidx * kHeadDim + d] = out / sum;
    if (d == 0) part_lse[pidx] = mm + log2f(sum);
  }
}

template <int kHeadDim>
__global__ void __launch_bounds__(kMmaDecodeWarps * 32)
    decode_attention_mma_kernel(AttentionArgs a, float* __restrict__ part_lse, float* __restrict__ part_out,
                                int32_t num_partitions) {
  constexpr int kStride = kHeadDim + kSmemPad;
  constexpr int kOTiles = kHeadDim / 8;
  constexpr int kChunksPerRow = kHeadDim / 8;
  __shared__ alignas(16) bf16 k_s[kMmaDecodeKeys][kStride];
  __shared__ alignas(16) bf16 v_s[kMmaDecodeKeys][kStride];
  __shared__ float m_s[kMmaDecodeWarps][kMmaDecodeMaxRows];
  __shared__ float l_s[kMmaDecodeWarps][kMmaDecodeMaxRows];
  static_assert(sizeof(k_s) >= sizeof(float) * kMmaDecodeWarps * kMmaDecodeMaxRows * kHeadDim, "o_s must fit in k_s");

  const int seq = blockIdx.z;
  const int kv_head = blockIdx.y;
  const int part = blockIdx.x;
  const int ctx = a.context_lens[seq];
  const int part_tokens = a.decode_partition_tokens;
  const int part_begin = part * part_tokens;
  if (part_begin >= ctx) return;  // the reduce reads only partitions below ctx
  const int part_end = min(ctx, part_begin + part_tokens);
  const int group = a.num_q_heads / a.num_kv_heads;
  const int warp = threadIdx.x >> 5;

  uint32_t qa[kHeadDim / 16][4];
  load_decode_q<kHeadDim>(qa, a, seq, kv_head, group);
  const float scale_log2 = a.scale * kLog2e;
  float m0 = -FLT_MAX, l0 = 0.0f, m1 = -FLT_MAX, l1 = 0.0f;
  float o[kOTiles][4];
#pragma unroll
  for (int nt = 0; nt < kOTiles; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;

  const int64_t block_elems = 2LL * a.block_size * a.num_kv_heads * kHeadDim;
  const int32_t* table = a.block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;

  for (int kb = part_begin; kb < part_end; kb += kMmaDecodeKeys) {
    __syncthreads();  // the previous tile is consumed
    for (int idx = threadIdx.x; idx < kMmaDecodeKeys * kChunksPerRow; idx += kMmaDecodeWarps * 32) {
      const int row = idx / kChunksPerRow;
      const int chunk = idx % kChunksPerRow;
      const int key = kb + row;
      const bool valid = key < part_end;
      const int block = table[(valid ? key : part_begin) / a.block_size];
      const bf16* src = a.kv_cache + block * block_elems +
                        (static_cast<int64_t>((valid ? key : 0) % a.block_size) * a.num_kv_heads + kv_head) * kHeadDim +
                        chunk * 8;
      cp_async_16(&k_s[row][chunk * 8], src, valid);
      cp_async_16(&v_s[row][chunk * 8], src + block_elems / 2, valid);
    }
    cp_async_wait_all();
    __syncthreads();
    // Warp w: keys [16w, 16w + 16) of the tile.
    decode_mma_step<kHeadDim>(&k_s[warp * 16][0], &v_s[warp * 16][0], qa, kb + warp * 16, part_end, scale_log2, m0, l0,
                              m1, l1, o);
  }
  decode_mma_merge<kHeadDim>(o, m0, l0, m1, l1, reinterpret_cast<float*>(&k_s[0][0]), m_s, l_s, a, group, seq, kv_head,
                             part, num_partitions, part_lse, part_out);
}

// Zero output rows for the group's q heads of a sequence with no context.
template <int kHeadDim>
__device__ __forceinline__ void decode_write_zero_rows(const AttentionArgs& a, int seq, int kv_head, int group) {
  bf16* out = a.out + (static_cast<int64_t>(a.query_start[seq]) * a.num_q_heads + kv_head * group) * kHeadDim;
  for (int idx = threadIdx.x; idx < group * kHeadDim; idx += blockDim.x) out[idx] = __float2bfloat16(0.0f);
}

template <int kHeadDim, int kDecodeRingStages>
constexpr int decode_ring_smem_bytes() {
  return kMmaDecodeWarps * kDecodeRingStages * 2 * kKvBlockSize * (kHeadDim + kSmemPad) *
         static_cast<int>(sizeof(bf16));
}

// One (sequence, kv head, partition) of decode attention on the calling warps' cp.async rings:
// warp w streams the partition's blocks w, w + 4, ... (my_block: lane t holds the id of its
// t-th) and the CTA writes the partition's partial output and log2-sum-exp (decode_mma_merge).
// Every thread of the CTA calls it, after the wait for the prior grids.
template <int kHeadDim, int kDecodeRingStages, int kRows>
__device__ __forceinline__ void decode_ring_partition(const AttentionArgs& a, int seq, int kv_head, int part,
                                                      int part_begin, int part_end, int num_mine, int32_t my_block,
                                                      unsigned char* smem, float (&m_s)[kMmaDecodeWarps][kRows],
                                                      float (&l_s)[kMmaDecodeWarps][kRows], int32_t num_partitions,
                                                      float* __restrict__ part_lse, float* __restrict__ part_out) {
  constexpr int kStride = kHeadDim + kSmemPad;
  constexpr int kOTiles = kHeadDim / 8;
  constexpr int kChunksPerRow = kHeadDim / 8;
  constexpr int kBlockTileElems = kKvBlockSize * kStride;  // one K or V block in shared memory
  constexpr int kCopiesPerLane = kKvBlockSize * kChunksPerRow / 32;
  static_assert(kKvBlockSize * kChunksPerRow % 32 == 0, "a block splits evenly over a warp");
  const int group = a.num_q_heads / a.num_kv_heads;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  // [kDecodeRingStages][K, V][kKvBlockSize][kStride] per warp.
  bf16* const ring = reinterpret_cast<bf16*>(smem) + warp * kDecodeRingStages * 2 * kBlockTileElems;

  const int block_elems = 2 * kKvBlockSize * a.num_kv_heads * kHeadDim;  // K and V of one paged block
  // Lane's copies: chunk lane % kChunksPerRow of slots lane / kChunksPerRow + c * (32 / kChunksPerRow).
  const int lane_chunk = lane % kChunksPerRow;
  const int lane_slot = lane / kChunksPerRow;
  constexpr int kSlotsPerCopy = 32 / kChunksPerRow;
  const bool evict_first = a.decode_kv_evict_first;
  const uint64_t kv_policy = evict_first ? l2_evict_first_policy() : 0;
  // Issues the copies of this warp's t-th block into ring stage `stage` (warp-uniform t).
  auto copy_block = [&](int t, int stage) {
    const int32_t block = __shfl_sync(0xffffffffu, my_block, t);
    const int key0 = part_begin + (warp + t * kMmaDecodeWarps) * kKvBlockSize;
    const bf16* src = a.kv_cache + static_cast<int64_t>(block) * block_elems +
                      (lane_slot * a.num_kv_heads + kv_head) * kHeadDim + lane_chunk * 8;
    bf16* dst = ring + stage * 2 * kBlockTileElems + lane_slot * kStride + lane_chunk * 8;
#pragma unroll
    for (int c = 0; c < kCopiesPerLane; ++c) {
      const int slot = c * kSlotsPerCopy;  // added to lane_slot
      const bool valid = key0 + lane_slot + slot < part_end;
      const bf16* k_src = src + slot * a.num_kv_heads * kHeadDim;
      if (evict_first) {
        cp_async_16_hint(dst + slot * kStride, k_src, valid, kv_policy);
        cp_async_16_hint(dst + kBlockTileElems + slot * kStride, k_src + block_elems / 2, valid, kv_policy);
      } else {
        cp_async_16(dst + slot * kStride, k_src, valid);
        cp_async_16(dst + kBlockTileElems + slot * kStride, k_src + block_elems / 2, valid);
      }
    }
  };
#pragma unroll
  for (int t = 0; t < kDecodeRingStages; ++t) {
    if (t < num_mine) copy_block(t, t);
    cp_async_commit();
  }

  uint32_t qa[kHeadDim / 16][4];
  load_decode_q<kHeadDim>(qa, a, seq, kv_head, group);
  const float scale_log2 = a.scale * kLog2e;
  float m0 = -FLT_MAX, l0 = 0.0f, m1 = -FLT_MAX, l1 = 0.0f;
  float o[kOTiles][4];
#pragma unroll
  for (int nt = 0; nt < kOTiles; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;

  int stage = 0;
  for (int t = 0; t < num_mine; ++t) {
    cp_async_wait<kDecodeRingStages - 1>();  // this lane's copies of block t have landed
    __syncwarp();                            // ... and every lane's
    const bf16* k_rows = ring + stage * 2 * kBlockTileElems;
    decode_mma_step<kHeadDim, kRows>(k_rows, k_rows + kBlockTileElems, qa,
                                     part_begin + (warp + t * kMmaDecodeWarps) * kKvBlockSize, part_end, scale_log2, m0,
                                     l0, m1, l1, o);
    __syncwarp();  // every lane is done reading the stage before it is refilled
    if (t + kDecodeRingStages < num_mine) copy_block(t + kDecodeRingStages, stage);
    cp_async_commit();
    stage = stage == kDecodeRingStages - 1 ? 0 : stage + 1;
  }
  decode_mma_merge<kHeadDim, kRows>(o, m0, l0, m1, l1, reinterpret_cast<float*>(smem), m_s, l_s, a, group, seq, kv_head,
                                    part, num_partitions, part_lse, part_out);
}

// This warp's blocks of a partition: partition blocks warp, warp + 4, ... (part_begin is a
// multiple of the block size); lane t returns the id of the t-th (0 beyond num_mine).
__device__ __forceinline__ int32_t decode_warp_blocks(const AttentionArgs& a, int seq, int part_begin, int part_end,
                                                      int* num_mine) {
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int part_blocks = (part_end - part_begin + kKvBlockSize - 1) / kKvBlockSize;
  *num_mine = part_blocks > warp ? (part_blocks - warp + kMmaDecodeWarps - 1) / kMmaDecodeWarps : 0;
  const int32_t* table = a.block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;
  return lane < *num_mine ? table[part_begin / kKvBlockSize + warp + lane * kMmaDecodeWarps] : 0;
}

__device__ __forceinline__ unsigned long long global_timer_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

template <int kHeadDim, int kDecodeRingStages, int kRows>
__global__ void __launch_bounds__(kMmaDecodeWarps * 32)
    decode_attention_mma_ring_kernel(AttentionArgs a, float* __restrict__ part_lse, float* __restrict__ part_out,
                                     int32_t num_partitions) {
  constexpr int kMaxBlocksPerWarp = kDecodeMaxPartitionTokens / kKvBlockSize / kMmaDecodeWarps;
  static_assert(kMaxBlocksPerWarp <= 32, "one lane per block id of a warp");
  static_assert(decode_ring_smem_bytes<kHeadDim, kDecodeRingStages>() >=
                    static_cast<int>(sizeof(float)) * kMmaDecodeWarps * kRows * kHeadDim,
                "o_s must fit in the rings");
  extern __shared__ __align__(16) unsigned char decode_ring_smem[];
  __shared__ float m_s[kMmaDecodeWarps][kRows];
  __shared__ float l_s[kMmaDecodeWarps][kRows];
  unsigned long long* const clock =
      a.decode_cta_clock != nullptr && threadIdx.x == 0
          ? a.decode_cta_clock + 4 * (blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z))
          : nullptr;
  if (clock != nullptr) clock[0] = global_timer_ns();

  // Before the wait (pdl.cuh): only the step inputs copied in before the step's first
  // kernel (context lengths, block tables), so their latency overlaps the previous kernel.
  const int seq = blockIdx.z;
  const int kv_head = blockIdx.y;
  const int part = blockIdx.x;
  const int ctx = a.context_lens[seq];
  const int part_tokens = a.decode_partition_tokens;
  const int part_begin = part * part_tokens;
  const int group = a.num_q_heads / a.num_kv_heads;
  if (part_begin >= ctx) {  // the merge reads only partitions below ctx
    if (ctx == 0 && part == 0 && a.decode_merge_counters != nullptr) {
      wait_for_prior_grids();
      decode_write_zero_rows<kHeadDim>(a, seq, kv_head, group);  // graph padding: no partition runs
    }
    if (clock != nullptr) clock[1] = clock[2] = clock[3] = global_timer_ns();
    return;
  }
  const int part_end = min(ctx, part_begin + part_tokens);
  int num_mine = 0;
  const int32_t my_block = decode_warp_blocks(a, seq, part_begin, part_end, &num_mine);
  wait_for_prior_grids();  // the KV cache and q are the previous kernel's (RoPE's) output
  allow_dependents();
  if (clock != nullptr) clock[1] = global_timer_ns();
  decode_ring_partition<kHeadDim, kDecodeRingStages, kRows>(a, seq, kv_head, part, part_begin, part_end, num_mine,
                                                            my_block, decode_ring_smem, m_s, l_s, num_partitions,
                                                            part_lse, part_out);
  if (clock != nullptr) clock[2] = global_timer_ns();
  if (a.decode_merge_counters == nullptr) {  // decode_reduce_kernel merges
    if (clock != nullptr) clock[3] = global_timer_ns();
    return;
  }
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;

  // Split-K merge in place: the last CTA of this (sequence, kv head) to finish merges every
  // partition's partial (threadfence-reduction pattern: publish, fence, count; the last one
  // to count sees every other CTA's partials).
  __shared__ bool merges;
  __threadfence();  // this CTA's partials are visible device-wide before it is counted
  __syncthreads();
  const int used = (ctx + part_tokens - 1) / part_tokens;
  if (threadIdx.x == 0) {
    uint32_t* counter = a.decode_merge_counters + seq * a.num_kv_heads + kv_head;
    merges = atomicAdd(counter, 1u) + 1u == static_cast<uint32_t>(used);
    // Every partition has counted: reset for the next launch (graph replays reuse the counters).
    if (merges) *counter = 0u;
  }
  __syncthreads();
  if (!merges) {
    if (clock != nullptr) clock[3] = global_timer_ns();
    return;
  }
  __threadfence();
  // Pass 1, warp w for q heads w, w + 4, ...: the max and the sum of 2^lse over the
  // partitions, each lane folding its partitions online, then across the warp.
  __shared__ float head_max[kRows];
  __shared__ float head_inv_sum[kRows];
  const int64_t group_base = (static_cast<int64_t>(seq) * a.num_q_heads + kv_head * group) * num_partitions;
  for (int h = warp; h < group; h += kMmaDecodeWarps) {
    const float* lse = part_lse + group_base + h * num_partitions;
    float mm = -FLT_MAX, sum = 0.0f;
    for (int p = lane; p < used; p += 32) {
      const float x = __ldcg(lse + p);
      const float m_new = fmaxf(mm, x);
      sum = sum * exp2f(mm - m_new) + exp2f(x - m_new);
      mm = m_new;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float m_other = __shfl_xor_sync(0xffffffffu, mm, off);
      const float s_other = __shfl_xor_sync(0xffffffffu, sum, off);
      const float m_new = fmaxf(mm, m_other);
      sum = (mm == -FLT_MAX ? 0.0f : sum * exp2f(mm - m_new)) +
            (m_other == -FLT_MAX ? 0.0f : s_other * exp2f(m_other - m_new));
      mm = m_new;
    }
    if (lane == 0) {
      head_max[h] = mm;
      head_inv_sum[h] = 1.0f / sum;
    }
  }
  __syncthreads();
  // Pass 2: a thread per 4 consecutive output elements of one head; the loads of the
  // partitions are independent, so several are in flight.
  constexpr int kQuadsPerHead = kHeadDim / 4;
  for (int idx = threadIdx.x; idx < group * kQuadsPerHead; idx += kMmaDecodeWarps * 32) {
    const int h = idx / kQuadsPerHead;
    const int quad = idx % kQuadsPerHead;
    const int64_t base = group_base + h * num_partitions;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 8
    for (int p = 0; p < used; ++p) {
      const float w = exp2f(__ldcg(part_lse + base + p) - head_max[h]);
      const float4 v = __ldcg(reinterpret_cast<const float4*>(part_out + (base + p) * kHeadDim) + quad);
      acc.x += w * v.x;
      acc.y += w * v.y;
      acc.z += w * v.z;
      acc.w += w * v.w;
    }
    const float inv = head_inv_sum[h];
    __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(
        a.out + (static_cast<int64_t>(a.query_start[seq]) * a.num_q_heads + kv_head * group + h) * kHeadDim + quad * 4);
    dst[0] = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
    dst[1] = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
  }
  if (clock != nullptr) clock[3] = global_timer_ns();
}

template <int kHeadDim>
__global__ void decode_reduce_kernel(AttentionArgs a, const float* __restrict__ part_lse,
                                     const float* __restrict__ part_out, int32_t num_partitions) {
  wait_for_prior_grids();  // pdl.cuh: before any global access
  allow_dependents();
  const int seq = blockIdx.y;
  const int q_head = blockIdx.x;
  const int d = threadIdx.x;
  const int ctx = a.context_lens[seq];
  const int used = min(num_partitions, (ctx + a.decode_partition_tokens - 1) / a.decode_partition_tokens);
  const int64_t base = (static_cast<int64_t>(seq) * a.num_q_heads + q_head) * num_partitions;
  float mm = -FLT_MAX;
  for (int p = 0; p < used; ++p) mm = fmaxf(mm, part_lse[base + p]);
  float sum = 0.0f, out = 0.0f;
  for (int p = 0; p < used; ++p) {
    const float w = exp2f(part_lse[base + p] - mm);
    sum += w;
    out += w * part_out[(base + p) * kHeadDim + d];
  }
  const int q_row = a.query_start[seq];
  a.out[(static_cast<int64_t>(q_row) * a.num_q_heads + q_head) * kHeadDim + d] =
      __float2bfloat16(used > 0 ? out / sum : 0.0f);
}

// The workspace: [rows] log2-sum-exps, then [rows][head_dim] partial outputs, 16-byte
// aligned (the in-kernel merge reads them as float4); rows = seqs x q heads x partitions.
float* decode_partial_outputs(float* workspace, const AttentionArgs& args, int32_t num_partitions) {
  const size_t rows = static_cast<size_t>(args.num_seqs) * args.num_q_heads * num_partitions;
  return workspace + (rows + 3) / 4 * 4;
}

// ---- Decode attention over the FP8 KV cache on tensor cores ----
// The ring kernel's structure with FP8 blocks: warp w streams the partition's blocks w, w + 4,
// ... through its own kFp8RingStages-deep cp.async ring of raw blocks (this kv head's K and V
// codes, 16 x D bytes each, and their 16 + 16 fp32 scales: half the bytes of a bf16 block),
// dequantizes each landed block into its bf16 tile (code * scale rounded to bf16, as
// kv_fp8_to_bf16_blocks stages prefill blocks), refills the stage, and runs decode_mma_step on
// the tile. Partials go to the bf16 path's workspace, merged by decode_reduce_kernel.
constexpr int kFp8RingStages = 4;

template <int kHeadDim>
constexpr int fp8_ring_stage_bytes() {
  return 2 * kKvBlockSize * kHeadDim + 2 * kKvBlockSize * static_cast<int>(sizeof(float));
}
template <int kHeadDim>
constexpr int fp8_ring_warp_bytes() {
  return kFp8RingStages * fp8_ring_stage_bytes<kHeadDim>() +
         2 * kKvBlockSize * (kHeadDim + kSmemPad) * static_cast<int>(sizeof(bf16));
}

__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t bits16) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(bits16), __NV_E4M3);
  return __half22float2(__half2(h));
}

template <int kHeadDim, int kRows>
__global__ void __launch_bounds__(kMmaDecodeWarps * 32)
    decode_attention_fp8_ring_kernel(AttentionArgs a, float* __restrict__ part_lse, float* __restrict__ part_out,
                                     int32_t num_partitions) {
  constexpr int kStride = kHeadDim + kSmemPad;
  constexpr int kOTiles = kHeadDim / 8;
  constexpr int kTileElems = kKvBlockSize * kStride;  // one K or V block of the bf16 tile
  constexpr int kCodes = kKvBlockSize * kHeadDim;     // bytes of one block's K (or V) codes of one head
  constexpr int kStageBytes = fp8_ring_stage_bytes<kHeadDim>();
  constexpr int kChunks = kHeadDim / 16;                    // 16-byte chunks per code row
  constexpr int kCopies = 2 * kKvBlockSize * kChunks / 32;  // 16-byte copies per lane and block
  static_assert(2 * kKvBlockSize == 32, "one lane per scale of a block");
  static_assert(kMmaDecodeWarps * fp8_ring_warp_bytes<kHeadDim>() >=
                    static_cast<int>(sizeof(float)) * kMmaDecodeWarps * kRows * kHeadDim,
                "o_s must fit in the rings");
  extern __shared__ __align__(16) unsigned char fp8_ring_smem[];
  __shared__ float m_s[kMmaDecodeWarps][kRows];
  __shared__ float l_s[kMmaDecodeWarps][kRows];
  const int seq = blockIdx.z;
  const int kv_head = blockIdx.y;
  const int part = blockIdx.x;
  const int ctx = a.context_lens[seq];
  const int part_begin = part * a.decode_partition_tokens;
  if (part_begin >= ctx) return;  // the reduce reads only partitions below ctx
  const int part_end = min(ctx, part_begin + a.decode_partition_tokens);
  const int group = a.num_q_heads / a.num_kv_heads;
  int num_mine = 0;
  const int32_t my_block = decode_warp_blocks(a, seq, part_begin, part_end, &num_mine);
  wait_for_prior_grids();  // the KV cache and q are the previous kernel's (RoPE's) output
  allow_dependents();
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  unsigned char* const ring = fp8_ring_smem + warp * fp8_ring_warp_bytes<kHeadDim>();
  bf16* const tile = reinterpret_cast<bf16*>(ring + kFp8RingStages * kStageBytes);
  const int64_t codes_per_block = static_cast<int64_t>(kKvBlockSize) * a.num_kv_heads * kHeadDim;
  const int64_t block_bytes = 2 * codes_per_block + 2LL * kKvBlockSize * a.num_kv_heads * sizeof(float);
  const auto* cache = reinterpret_cast<const uint8_t*>(a.kv_cache);
  // No L2 evict-first hint here (decode_kv_evict_first is ignored): with it this kernel raised an
  // illegal instruction at the hinted cp.async on an H200 (compute-sanitizer, 2026-12-01 23:56 UTC).
  // Issues the copies of this warp's t-th block into ring stage `stage` (warp-uniform t):
  // copy i = c * 32 + lane is chunk i % kChunks of row (i / kChunks) % 16 of K (i < 16 kChunks) or V.
  auto copy_block = [&](int t, int stage) {
    const int32_t block = __shfl_sync(0xffffffffu, my_block, t);
    const int key0 = part_begin + (warp + t * kMmaDecodeWarps) * kKvBlockSize;
    const uint8_t* base = cache + static_cast<int64_t>(block) * block_bytes;
    unsigned char* dst = ring + stage * kStageBytes;
#pragma unroll
    for (int c = 0; c < kCopies; ++c) {
      const int i = c * 32 + lane;
      const int kv = i / (kKvBlockSize * kChunks);
      const int row = (i / kChunks) % kKvBlockSize;
      const int chunk = i % kChunks;
      const bool valid = key0 + row < part_end;
      const uint8_t* src =
          base + kv * codes_per_block + (static_cast<int64_t>(row) * a.num_kv_heads + kv_head) * kHeadDim + chunk * 16;
      cp_async_16(dst + kv * kCodes + row * kHeadDim + chunk * 16, src, valid);
    }
    // Scales ([2][16][kv heads] fp32 after the codes): lane = (K or V, row).
    const int kv = lane / kKvBlockSize;
    const int row = lane % kKvBlockSize;
    cp_async_4(dst + 2 * kCodes + lane * static_cast<int>(sizeof(float)),
               base + 2 * codes_per_block +
                   ((static_cast<int64_t>(kv) * kKvBlockSize + row) * a.num_kv_heads + kv_head) * sizeof(float),
               key0 + row < part_end);
  };
#pragma unroll
  for (int t = 0; t < kFp8RingStages; ++t) {
    if (t < num_mine) copy_block(t, t);
    cp_async_commit();
  }
  uint32_t qa[kHeadDim / 16][4];
  load_decode_q<kHeadDim>(qa, a, seq, kv_head, group);
  const float scale_log2 = a.scale * kLog2e;
  float m0 = -FLT_MAX, l0 = 0.0f, m1 = -FLT_MAX, l1 = 0.0f;
  float o[kOTiles][4];
#pragma unroll
  for (int nt = 0; nt < kOTiles; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
  int stage = 0;
  for (int t = 0; t < num_mine; ++t) {
    cp_async_wait<kFp8RingStages - 1>();  // this lane's copies of block t have landed
    __syncwarp();                         // ... and every lane's
    // Dequantize into the tile (rows past the context were zero-filled, codes and scales: 0).
    const unsigned char* src = ring + stage * kStageBytes;
    const float* scales = reinterpret_cast<const float*>(src + 2 * kCodes);
#pragma unroll
    for (int c = 0; c < kCopies; ++c) {
      const int i = c * 32 + lane;
      const int kv = i / (kKvBlockSize * kChunks);
      const int row = (i / kChunks) % kKvBlockSize;
      const int chunk = i % kChunks;
      const uint4 w = *reinterpret_cast<const uint4*>(src + kv * kCodes + row * kHeadDim + chunk * 16);
      const float s = scales[kv * kKvBlockSize + row];
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
      uint32_t packed[8];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f0 = e4m3x2_to_float2(words[j] & 0xffffu);
        const float2 f1 = e4m3x2_to_float2(words[j] >> 16);
        packed[2 * j] = pack_bf16x2(f0.x * s, f0.y * s);
        packed[2 * j + 1] = pack_bf16x2(f1.x * s, f1.y * s);
      }
      bf16* d = tile + kv * kTileElems + row * kStride + chunk * 16;
      *reinterpret_cast<uint4*>(d) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      *reinterpret_cast<uint4*>(d + 8) = make_uint4(packed[4], packed[5], packed[6], packed[7]);
    }
    __syncwarp();  // the tile is complete and every lane is done reading the stage
    if (t + kFp8RingStages < num_mine) copy_block(t + kFp8RingStages, stage);
    cp_async_commit();
    decode_mma_step<kHeadDim, kRows>(tile, tile + kTileElems, qa,
                                     part_begin + (warp + t * kMmaDecodeWarps) * kKvBlockSize, part_end, scale_log2, m0,
                                     l0, m1, l1, o);
    __syncwarp();  // every lane is done reading the tile before the next block overwrites it
    stage = stage == kFp8RingStages - 1 ? 0 : stage + 1;
  }
  decode_mma_merge<kHeadDim, kRows>(o, m0, l0, m1, l1, reinterpret_cast<float*>(fp8_ring_smem), m_s, l_s, a, group, seq,
                                    kv_head, part, num_partitions, part_lse, part_out);
}

template <int kHeadDim, int kMaxGroup>
cudaError_t launch_decode_t(const AttentionArgs& args, float* workspace, int32_t num_partitions, cudaStream_t stream) {
  float* lse = workspace;
  float* out = decode_partial_outputs(workspace, args, num_partitions);
  decode_attention_kernel<kHeadDim, kMaxGroup>
      <<<dim3(num_partitions, args.num_kv_heads, args.num_seqs), kDecodeWarps * 32, 0, stream>>>(args, lse, out,
                                                                                                 num_partitions);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  decode_reduce_kernel<kHeadDim>
      <<<dim3(args.num_q_heads, args.num_seqs), kHeadDim, 0, stream>>>(args, lse, out, num_partitions);
  return cudaGetLastError();
}

template <int kHeadDim, int kStages, int kRows>
cudaError_t launch_decode_ring_rows(const AttentionArgs& args, dim3 grid, float* lse, float* out,
                                    int32_t num_partitions, cudaStream_t stream) {
  constexpr int kSmemBytes = decode_ring_smem_bytes<kHeadDim, kStages>();  // > 48 KiB for D128: needs the opt-in
  const cudaError_t attr = opt_in_dynamic_smem<decode_attention_mma_ring_kernel<kHeadDim, kStages, kRows>>(kSmemBytes);
  if (attr != cudaSuccess) return attr;
  return launch_dependent(decode_attention_mma_ring_kernel<kHeadDim, kStages, kRows>, grid, dim3(kMmaDecodeWarps * 32),
                          static_cast<size_t>(kSmemBytes), stream, args, lse, out, num_partitions);
}

// GQA groups above 8 (head_dim 128 only: the dispatch refuses the rest) take the 16-row kernel.
template <int kHeadDim, int kStages>
cudaError_t launch_decode_ring(const AttentionArgs& args, dim3 grid, float* lse, float* out, int32_t num_partitions,
                               cudaStream_t stream) {
  if constexpr (kHeadDim == 128) {
    if (args.num_q_heads / args.num_kv_heads > kMmaDecodeMaxRows) {
      return launch_decode_ring_rows<kHeadDim, kStages, kMmaDecodeMaxRows16>(args, grid, lse, out, num_partitions,
                                                                             stream);
    }
  }
  return launch_decode_ring_rows<kHeadDim, kStages, kMmaDecodeMaxRows>(args, grid, lse, out, num_partitions, stream);
}

template <int kHeadDim>
cudaError_t launch_decode_mma(const AttentionArgs& args, float* workspace, int32_t num_partitions,
                              cudaStream_t stream) {
  float* lse = workspace;
  float* out = decode_partial_outputs(workspace, args, num_partitions);
  const dim3 grid(num_partitions, args.num_kv_heads, args.num_seqs);
  if (args.decode_kernel == DecodeKernel::kTensorCore) {
    const cudaError_t attr = args.decode_kv_stages == 3
                                 ? launch_decode_ring<kHeadDim, 3>(args, grid, lse, out, num_partitions, stream)
                                 : launch_decode_ring<kHeadDim, 2>(args, grid, lse, out, num_partitions, stream);
    if (attr != cudaSuccess || args.decode_merge_counters != nullptr) return attr;  // merged in place
  } else {
    decode_attention_mma_kernel<kHeadDim><<<grid, kMmaDecodeWarps * 32, 0, stream>>>(args, lse, out, num_partitions);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  err = launch_dependent(decode_reduce_kernel<kHeadDim>, dim3(args.num_q_heads, args.num_seqs), dim3(kHeadDim), 0,
                         stream, args, static_cast<const float*>(lse), static_cast<const float*>(out), num_partitions);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

template <int kHeadDim>
cudaError_t launch_decode_d(const AttentionArgs& args, float* workspace, int32_t num_partitions, cudaStream_t stream) {
  if (args.decode_kernel != DecodeKernel::kCudaCore) {
    return launch_decode_mma<kHeadDim>(args, workspace, num_partitions, stream);
  }
  const int group = args.num_q_heads / args.num_kv_heads;
  if (group <= 1) return launch_decode_t<kHeadDim, 1>(args, workspace, num_partitions, stream);
  if (group <= 2) return launch_decode_t<kHeadDim, 2>(args, workspace, num_partitions, stream);
  if (group <= 4) return launch_decode_t<kHeadDim, 4>(args, workspace, num_partitions, stream);
  return launch_decode_t<kHeadDim, 8>(args, workspace, num_partitions, stream);
}

template <int kHeadDim>
cudaError_t launch_decode_fp8_ring(const AttentionArgs& args_in, float* workspace, int32_t num_partitions,
                                   cudaStream_t stream) {
  AttentionArgs args = args_in;
  args.decode_merge_counters = nullptr;  // merged by the reduce kernel
  args.decode_cta_clock = nullptr;
  float* lse = workspace;
  float* out = decode_partial_outputs(workspace, args, num_partitions);
  constexpr int kSmemBytes = kMmaDecodeWarps * fp8_ring_warp_bytes<kHeadDim>();  // 100 KiB at D128
  const dim3 grid(num_partitions, args.num_kv_heads, args.num_seqs);
  cudaError_t err = cudaSuccess;
  if constexpr (kHeadDim == 128) {
    if (args.num_q_heads / args.num_kv_heads > kMmaDecodeMaxRows) {
      constexpr auto kKernel = decode_attention_fp8_ring_kernel<kHeadDim, kMmaDecodeMaxRows16>;
      err = opt_in_dynamic_smem<kKernel>(kSmemBytes);
      if (err == cudaSuccess) {
        err = launch_dependent(kKernel, grid, dim3(kMmaDecodeWarps * 32), static_cast<size_t>(kSmemBytes), stream, args,
                               lse, out, num_partitions);
      }
      if (err != cudaSuccess) return err;
    }
  }
  if (args.num_q_heads / args.num_kv_heads <= kMmaDecodeMaxRows) {
    constexpr auto kKernel = decode_attention_fp8_ring_kernel<kHeadDim, kMmaDecodeMaxRows>;
    err = opt_in_dynamic_smem<kKernel>(kSmemBytes);
    if (err == cudaSuccess) {
      err = launch_dependent(kKernel, grid, dim3(kMmaDecodeWarps * 32), static_cast<size_t>(kSmemBytes), stream, args,
                             lse, out, num_partitions);
    }
    if (err != cudaSuccess) return err;
  }
  err = launch_dependent(decode_reduce_kernel<kHeadDim>, dim3(args.num_q_heads, args.num_seqs), dim3(kHeadDim), 0,
                         stream, args, static_cast<const float*>(lse), static_cast<const float*>(out), num_partitions);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_decode_attention_fp8_tc(const AttentionArgs& args, float* workspace, int32_t num_partitions,
                                           cudaStream_t stream) {
  if (args.num_seqs == 0) return cudaSuccess;
  if (args.head_dim == 128) return launch_decode_fp8_ring<128>(args, workspace, num_partitions, stream);
  return launch_decode_fp8_ring<64>(args, workspace, num_partitions, stream);
}

cudaError_t launch_prefill_attention(const AttentionArgs& args, cudaStream_t stream) {
  if (args.num_seqs == 0 || args.max_query_len == 0) return cudaSuccess;
  if (args.prefill_kernel == PrefillKernel::kGqaTiled) {
    return args.head_dim == 128 ? launch_prefill_gqa<128>(args, stream) : launch_prefill_gqa<64>(args, stream);
  }
  const dim3 grid((args.max_query_len + kPrefillRows - 1) / kPrefillRows, args.num_q_heads, args.num_seqs);
  if (args.head_dim == 128) {
    prefill_attention_per_head_kernel<128><<<grid, kPrefillWarps * 32, 0, stream>>>(args);
  } else {
    prefill_attention_per_head_kernel<64><<<grid, kPrefillWarps * 32, 0, stream>>>(args);
  }
  return cudaGetLastError();
}

cudaError_t launch_decode_attention(const AttentionArgs& args, float* workspace, int32_t num_partitions,
                                    cudaStream_t stream) {
  if (args.num_seqs == 0) return cudaSuccess;
  if (args.head_dim == 128) return launch_decode_d<128>(args, workspace, num_partitions, stream);
  return launch_decode_d<64>(args, workspace, num_partitions, stream);
}

}  // namespace pd::kernels::cuda::detail
