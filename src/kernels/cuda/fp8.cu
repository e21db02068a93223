// FP8 kernels: per-token 1 x 128 activation quantization (dense and per MoE expert) and
// the weight-streaming GEMM for small M (FP8 block-scaled or bf16 weights, dense or
// grouped by MoE expert). Layouts: kernels/cuda/fp8_args.h.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "kernels/cuda/fp8_args.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/warp_util.cuh"

namespace pd::kernels::cuda::detail {
namespace {

constexpr int kQuantWarps = 8;

// One warp per (row, 128-wide group): 4 elements per lane, amax across the warp,
// scale = amax / 448 (1 for an all-zero group), q = satfinite(x / scale).
// Dense: scale index g * scale_ld + row. Grouped (offsets set): the first
// fp8_cublas_rows(count_e) rows of expert e get their own [groups][that many] block at
// padded_offsets[e] * groups (the rest are multiplied in bf16 by the streaming kernel).
__global__ void __launch_bounds__(kQuantWarps * 32)
    quantize_fp8_kernel(uint8_t* __restrict__ out, float* __restrict__ scales, const bf16* __restrict__ x, int32_t rows,
                        int32_t k, int32_t scale_ld, const int32_t* __restrict__ offsets,
                        const int32_t* __restrict__ padded_offsets, int32_t num_groups) {
  const int groups = k / kFp8Block;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kQuantWarps + threadIdx.x / 32;
  if (item >= static_cast<int64_t>(rows) * groups) return;
  const int row = static_cast<int>(item / groups), g = static_cast<int>(item % groups);
  const int lane = threadIdx.x % 32;
  const int64_t base = static_cast<int64_t>(row) * k + g * kFp8Block + lane * 4;
  const uint2 raw = *reinterpret_cast<const uint2*>(x + base);
  float v[4];
  v[0] = __uint_as_float(raw.x << 16);
  v[1] = __uint_as_float(raw.x & 0xffff0000u);
  v[2] = __uint_as_float(raw.y << 16);
  v[3] = __uint_as_float(raw.y & 0xffff0000u);
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  amax = warp_max(amax);
  const float scale = amax > 0.0f ? amax / kFp8E4m3Max : 1.0f;
  const __nv_fp8x2_storage_t lo =
      __nv_cvt_float2_to_fp8x2(make_float2(v[0] / scale, v[1] / scale), __NV_SATFINITE, __NV_E4M3);
  const __nv_fp8x2_storage_t hi =
      __nv_cvt_float2_to_fp8x2(make_float2(v[2] / scale, v[3] / scale), __NV_SATFINITE, __NV_E4M3);
  *reinterpret_cast<uint32_t*>(out + base) = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  if (lane == 0) {
    if (offsets == nullptr) {
      scales[static_cast<int64_t>(g) * scale_ld + row] = scale;
    } else {
      const int e = find_group(offsets, num_groups, row);
      const int main_rows = fp8_cublas_rows(offsets[e + 1] - offsets[e]);
      const int r = row - offsets[e];
      // Rows past the expert's cuBLASLt rows go through the streaming kernel (bf16): no scale.
      if (r < main_rows) {
        scales[static_cast<int64_t>(padded_offsets[e]) * groups + static_cast<int64_t>(g) * main_rows + r] = scale;
      }
    }
  }
}

// ---- weight-streaming GEMM ----
constexpr int kStreamWarps = 8;
constexpr int kStreamCols = 2;  // output columns (weight rows) per warp
constexpr int kStreamColsPerCta = kStreamWarps * kStreamCols;
constexpr int kStreamUnroll = 2;  // 16-byte weight loads per column in flight per lane

__device__ __forceinline__ uint4 load_stream_16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ float2 fp8x2_to_float2(uint32_t bits16) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(bits16), __NV_E4M3);
  return __half22float2(__half2(h));
}

// 16 e4m3 values -> float.
__device__ __forceinline__ void fp8x16_to_float(const uint4& v, float (&f)[16]) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 a = fp8x2_to_float2(words[i] & 0xffffu);
    const float2 b = fp8x2_to_float2(words[i] >> 16);
    f[4 * i] = a.x;
    f[4 * i + 1] = a.y;
    f[4 * i + 2] = b.x;
    f[4 * i + 3] = b.y;
  }
}

__device__ __forceinline__ void bf16x8_to_float_at(const uint4& v, float* f) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(words[i] << 16);
    f[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

// kFp8: e4m3 weights with 128 x 128 block scales (16 k per 16-byte load), else bf16 weights
// (8 k per load). kMT: activation rows per weight pass. Each warp owns kStreamCols weight
// rows and sweeps K with lane-strided 16-byte loads (a warp covers 32 loads per step); the
// block scale of a 16-element piece is constant (16 | 128), applied to its partial dot product.
template <bool kFp8, int kMT>
__global__ void __launch_bounds__(kStreamWarps * 32, 2) stream_gemm_kernel(StreamGemmArgs p) {
  wait_for_prior_grids();  // pdl.cuh: before any global access
  allow_dependents();
  int group = 0, row_begin = 0, row_end = p.m;
  if (p.group_offsets != nullptr) {
    const int y = blockIdx.y;
    if (p.num_active != nullptr && y >= *p.num_active) return;
    group = p.active_groups != nullptr ? p.active_groups[y] : y;
    row_begin = p.group_offsets[group];
    row_end = p.group_offsets[group + 1];
    if (row_begin >= row_end) return;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = (blockIdx.x * kStreamWarps + warp) * kStreamCols;
  if (n0 >= p.n) return;
  constexpr int E = kFp8 ? 16 : 8;  // k per 16-byte weight load
  constexpr int kStep = 32 * E;
  const size_t elem = kFp8 ? 1 : 2;
  const char* w_base = static_cast<const char*>(p.w) + static_cast<size_t>(group) * p.w_group_stride * elem;
  const float* s_base = kFp8 ? p.w_scale + static_cast<size_t>(group) * p.scale_group_stride : nullptr;
  bool col_ok[kStreamCols];
  const char* w_row[kStreamCols];
  const float* s_row[kStreamCols];
#pragma unroll
  for (int c = 0; c < kStreamCols; ++c) {
    const int col = n0 + c;
    col_ok[c] = col < p.n;
    const int safe = col_ok[c] ? col : n0;
    w_row[c] = w_base + static_cast<size_t>(safe) * p.k * elem;
    s_row[c] = kFp8 ? s_base + static_cast<size_t>(safe / kFp8Block) * p.w_scale_ld : nullptr;
  }
  for (int r0 = row_begin; r0 < row_end; r0 += kMT) {
    const int rows = min(kMT, row_end - r0);
    const bf16* a_row[kMT];
#pragma unroll
    for (int r = 0; r < kMT; ++r) {
      const int sorted = r0 + min(r, rows - 1);
      const int src = p.a_rows != nullptr ? p.a_rows[sorted] : sorted;
      a_row[r] = p.a + static_cast<int64_t>(src) * p.lda;
    }
    float acc[kMT][kStreamCols];
#pragma unroll
    for (int r = 0; r < kMT; ++r) {
#pragma unroll
      for (int c = 0; c < kStreamCols; ++c) acc[r][c] = 0.0f;
    }
    for (int kb = lane * E; kb < p.k; kb += kStep * kStreamUnroll) {
      uint4 wv[kStreamUnroll][kStreamCols];
      float sc[kStreamUnroll][kStreamCols];
#pragma unroll
      for (int u = 0; u < kStreamUnroll; ++u) {
        const int k0 = kb + u * kStep;
#pragma unroll
        for (int c = 0; c < kStreamCols; ++c) {
          if (k0 < p.k) {
            wv[u][c] = load_stream_16(w_row[c] + static_cast<size_t>(k0) * elem);
            sc[u][c] = kFp8 ? __ldg(s_row[c] + k0 / kFp8Block) : 1.0f;
          } else {
            wv[u][c] = make_uint4(0, 0, 0, 0);
            sc[u][c] = 0.0f;
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kStreamUnroll; ++u) {
        const int k0 = kb + u * kStep;
        if (k0 >= p.k) break;
        float wf[kStreamCols][E];
#pragma unroll
        for (int c = 0; c < kStreamCols; ++c) {
          if constexpr (kFp8) {
            fp8x16_to_float(wv[u][c], wf[c]);
          } else {
            bf16x8_to_float_at(wv[u][c], wf[c]);
          }
        }
#pragma unroll
        for (int r = 0; r < kMT; ++r) {
          if (r >= rows) break;
          float af[E];
          const uint4 a0 = __ldg(reinterpret_cast<const uint4*>(a_row[r] + k0));
          bf16x8_to_float_at(a0, af);
          if constexpr (kFp8) {
            const uint4 a1 = __ldg(reinterpret_cast<const uint4*>(a_row[r] + k0 + 8));
            bf16x8_to_float_at(a1, af + 8);
          }
#pragma unroll
          for (int c = 0; c < kStreamCols; ++c) {
            float part = 0.0f;
#pragma unroll
            for (int e = 0; e < E; ++e) part = fmaf(wf[c][e], af[e], part);
            acc[r][c] = fmaf(part, sc[u][c], acc[r][c]);
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kMT; ++r) {
#pragma unroll
      for (int c = 0; c < kStreamCols; ++c) {
        const float v = warp_sum(acc[r][c]);
        if (lane == 0 && r < rows && col_ok[c]) {
          bf16* o = p.out + static_cast<int64_t>(r0 + r) * p.ldo + n0 + c;
          *o = __float2bfloat16(p.accumulate ? v + __bfloat162float(*o) : v);
        }
      }
    }
  }
}

// ---- tensor-core weight streaming for M <= 16 (dense) ----
// The skinny bf16 kernel's shape (skinny_gemm.cu) for FP8 weights: a CTA owns 16 output
// columns (two n8 tiles) and splits K over 8 warps in contiguous ranges; lane (g, t4) loads
// 16 e4m3 weights (k = 64 c + 16 t4 .. + 16) of w rows n0 + g and n0 + 8 + g per 64-wide chunk
// c, converts them to bf16 times the chunk's 128 x 128 block scale (a chunk lies in one block:
// 64 | 128 and the 16 rows of a CTA lie in one 128-row block), and feeds them with the bf16
// activations of the same k to mma m16n8k16 (rows >= m are zero). The k permutation (a lane's
// 8 consecutive k feed slots {2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9}) is the same on both
// operands, so the sum over k is unchanged. bf16 rounding of the scaled weight adds a relative
// error of 2^-9 per weight.
constexpr int kTcWarps = 8;
constexpr int kTcChunk = 64;

__device__ __forceinline__ uint32_t fp8x2_scaled_to_bf16x2(uint32_t bits16, float s) {
  const float2 f = fp8x2_to_float2(bits16);
  const __nv_bfloat162 v = __floats2bfloat162_rn(f.x * s, f.y * s);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Two mma k16 steps for 8 consecutive k of this lane: weights (2 words = 8 e4m3), activations
// of rows g (lo) and g + 8 (hi) as 8 bf16 each.
__device__ __forceinline__ void mma_fp8_piece(float (&acc)[4], uint32_t w_lo, uint32_t w_hi, float s, const uint4& lo,
                                              const uint4& hi) {
  const uint32_t b0 = fp8x2_scaled_to_bf16x2(w_lo & 0xffffu, s), b1 = fp8x2_scaled_to_bf16x2(w_lo >> 16, s);
  const uint32_t b2 = fp8x2_scaled_to_bf16x2(w_hi & 0xffffu, s), b3 = fp8x2_scaled_to_bf16x2(w_hi >> 16, s);
  mma_bf16_16816(acc, lo.x, hi.x, lo.y, hi.y, b0, b1);
  mma_bf16_16816(acc, lo.z, hi.z, lo.w, hi.w, b2, b3);
}

template <int kUnroll, bool kHighRows>
__global__ void __launch_bounds__(kTcWarps * 32, 2)
    fp8_tc_stream_kernel(bf16* __restrict__ out, const bf16* __restrict__ a, const uint8_t* __restrict__ w,
                         const float* __restrict__ w_scale, int scale_ld, int m, int n, int k, bool accumulate) {
  wait_for_prior_grids();  // pdl.cuh: before any global access
  allow_dependents();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int n0 = blockIdx.x * 16;
  const bool has_tile1 = n0 + 8 < n;  // n % 8 == 0
  const int num_chunks = k / kTcChunk;
  const int per_warp = (num_chunks + kTcWarps - 1) / kTcWarps;
  const int first = warp * per_warp, end = min(num_chunks, first + per_warp);
  const uint8_t* w0 = w + static_cast<int64_t>(n0 + g) * k + t4 * 16;
  const uint8_t* w1 = w + static_cast<int64_t>(has_tile1 ? n0 + 8 + g : n0 + g) * k + t4 * 16;
  const float* srow = w_scale + static_cast<int64_t>(n0 / kFp8Block) * scale_ld;
  const bool row_lo = g < m, row_hi = kHighRows && g + 8 < m;
  const bf16* a_lo = a + static_cast<int64_t>(row_lo ? g : 0) * k + t4 * 16;
  const bf16* a_hi = a + static_cast<int64_t>(row_hi ? g + 8 : 0) * k + t4 * 16;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  float acc0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int c = first; c < end; c += kUnroll) {
    uint4 wv0[kUnroll], wv1[kUnroll], lo[kUnroll][2], hi[kUnroll][2];
    float sc[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const bool valid = c + u < end;
      const int k_off = (c + u) * kTcChunk;
      wv0[u] = valid ? load_stream_16(w0 + k_off) : zero;
      wv1[u] = valid && has_tile1 ? load_stream_16(w1 + k_off) : zero;
      sc[u] = valid ? __ldg(srow + k_off / kFp8Block) : 0.0f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        lo[u][h] = valid && row_lo ? __ldg(reinterpret_cast<const uint4*>(a_lo + k_off + h * 8)) : zero;
        hi[u][h] = kHighRows && valid && row_hi ? __ldg(reinterpret_cast<const uint4*>(a_hi + k_off + h * 8)) : zero;
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      mma_fp8_piece(acc0, wv0[u].x, wv0[u].y, sc[u], lo[u][0], hi[u][0]);
      mma_fp8_piece(acc0, wv0[u].z, wv0[u].w, sc[u], lo[u][1], hi[u][1]);
      mma_fp8_piece(acc1, wv1[u].x, wv1[u].y, sc[u], lo[u][0], hi[u][0]);
      mma_fp8_piece(acc1, wv1[u].z, wv1[u].w, sc[u], lo[u][1], hi[u][1]);
    }
  }
  // Sum the warps' partial tiles and store rows < m, columns < n.
  __shared__ float partial[kTcWarps][2][4][32];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    partial[warp][0][i][lane] = acc0[i];
    partial[warp][1][i][lane] = acc1[i];
  }
  __syncthreads();
  const int tile = threadIdx.x >> 7, elem = (threadIdx.x >> 5) & 3, src = threadIdx.x & 31;
  float sum = 0.0f;
#pragma unroll
  for (int wp = 0; wp < kTcWarps; ++wp) sum += partial[wp][tile][elem][src];
  // mma C fragment: elements 0, 1 are row g, 2, 3 row g + 8; column 2 t4 + (elem & 1).
  const int row = (src >> 2) + (elem >= 2 ? 8 : 0);
  const int col = n0 + tile * 8 + (src & 3) * 2 + (elem & 1);
  if (row < m && col < n) {
    bf16* o = out + static_cast<int64_t>(row) * n + col;
    *o = __float2bfloat16(accumulate ? sum + __bfloat162float(*o) : sum);
  }
}

// The same mma step over a group of rows (StreamGemmArgs: dense, or an active MoE expert with
// its rows gathered through a_rows), 16 rows per weight pass. A CTA owns kTiles tiles of 16
// output columns, each split over K by kTcWarps / kTiles warps: more tiles per CTA give each
// warp more chunks and the CTA more columns, so fewer, longer CTAs share the fixed costs
// (group lookup, the cross-warp sum, the barriers) — what limits short-K experts (down_proj).
template <int kTiles>
__global__ void __launch_bounds__(kTcWarps * 32, 2) fp8_tc_grouped_kernel(StreamGemmArgs p) {
  wait_for_prior_grids();  // pdl.cuh: before any global access
  allow_dependents();
  constexpr int kWarpsPerTile = kTcWarps / kTiles;
  int group = 0, row_begin = 0, row_end = p.m;
  if (p.group_offsets != nullptr) {
    const int y = blockIdx.y;
    if (p.num_active != nullptr && y >= *p.num_active) return;
    group = p.active_groups != nullptr ? p.active_groups[y] : y;
    row_begin = p.group_offsets[group];
    row_end = p.group_offsets[group + 1];
    if (row_begin >= row_end) return;  // uniform over the CTA
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int tile = warp / kWarpsPerTile, wt = warp % kWarpsPerTile;
  const int n = p.n, k = p.k;
  const int n0 = (blockIdx.x * kTiles + tile) * 16;
  const bool tile_ok = n0 < n;  // warps of a tile past n load nothing but join the barriers
  const int n0_safe = tile_ok ? n0 : 0;
  const bool has_tile1 = n0_safe + 8 < n;
  const int num_chunks = k / kTcChunk;
  const int per_warp = (num_chunks + kWarpsPerTile - 1) / kWarpsPerTile;
  const int first = wt * per_warp, end = tile_ok ? min(num_chunks, first + per_warp) : first;
  const uint8_t* wg = static_cast<const uint8_t*>(p.w) + static_cast<int64_t>(group) * p.w_group_stride;
  const uint8_t* w0 = wg + static_cast<int64_t>(n0_safe + g) * k + t4 * 16;
  const uint8_t* w1 = wg + static_cast<int64_t>(has_tile1 ? n0_safe + 8 + g : n0_safe + g) * k + t4 * 16;
  const float* srow = p.w_scale + static_cast<int64_t>(group) * p.scale_group_stride +
                      static_cast<int64_t>(n0_safe / kFp8Block) * p.w_scale_ld;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  __shared__ float partial[kTcWarps][2][4][32];
  for (int r0 = row_begin; r0 < row_end; r0 += 16) {
    const int rows = min(16, row_end - r0);
    const bool row_lo = g < rows, row_hi = g + 8 < rows;
    const int src_lo = p.a_rows != nullptr ? p.a_rows[r0 + (row_lo ? g : 0)] : r0 + (row_lo ? g : 0);
    const int src_hi = p.a_rows != nullptr ? p.a_rows[r0 + (row_hi ? g + 8 : 0)] : r0 + (row_hi ? g + 8 : 0);
    const bf16* a_lo = p.a + static_cast<int64_t>(src_lo) * p.lda + t4 * 16;
    const bf16* a_hi = p.a + static_cast<int64_t>(src_hi) * p.lda + t4 * 16;
    float acc0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int c = first; c < end; c += 4) {
      uint4 wv0[4], wv1[4], lo[4][2], hi[4][2];
      float sc[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const bool valid = c + u < end;
        const int k_off = (c + u) * kTcChunk;
        wv0[u] = valid ? load_stream_16(w0 + k_off) : zero;
        wv1[u] = valid && has_tile1 ? load_stream_16(w1 + k_off) : zero;
        sc[u] = valid ? __ldg(srow + k_off / kFp8Block) : 0.0f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          lo[u][h] = valid && row_lo ? __ldg(reinterpret_cast<const uint4*>(a_lo + k_off + h * 8)) : zero;
          hi[u][h] = valid && row_hi ? __ldg(reinterpret_cast<const uint4*>(a_hi + k_off + h * 8)) : zero;
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        mma_fp8_piece(acc0, wv0[u].x, wv0[u].y, sc[u], lo[u][0], hi[u][0]);
        mma_fp8_piece(acc0, wv0[u].z, wv0[u].w, sc[u], lo[u][1], hi[u][1]);
        mma_fp8_piece(acc1, wv1[u].x, wv1[u].y, sc[u], lo[u][0], hi[u][0]);
        mma_fp8_piece(acc1, wv1[u].z, wv1[u].w, sc[u], lo[u][1], hi[u][1]);
      }
    }
    __syncthreads();  // the previous row block's readers are done with `partial`
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      partial[warp][0][i][lane] = acc0[i];
      partial[warp][1][i][lane] = acc1[i];
    }
    __syncthreads();
    // kTiles x 256 outputs (2 n8 tiles x 4 fragment elements x 32 lanes per 16-column tile),
    // each the sum of its tile's warps.
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
      const int idx = j * kTcWarps * 32 + threadIdx.x;
      const int out_tile = idx >> 8, half = (idx >> 7) & 1, elem = (idx >> 5) & 3, src = idx & 31;
      float sum = 0.0f;
#pragma unroll
      for (int wp = 0; wp < kWarpsPerTile; ++wp) sum += partial[out_tile * kWarpsPerTile + wp][half][elem][src];
      const int row = (src >> 2) + (elem >= 2 ? 8 : 0);
      const int col = (blockIdx.x * kTiles + out_tile) * 16 + half * 8 + (src & 3) * 2 + (elem & 1);
      if (row < rows && col < n) {
        bf16* o = p.out + static_cast<int64_t>(r0 + row) * p.ldo + col;
        *o = __float2bfloat16(p.accumulate ? sum + __bfloat162float(*o) : sum);
      }
    }
  }
}

template <bool kFp8>
cudaError_t launch_stream_gemm_typed(const StreamGemmArgs& p, int32_t rows_hint, cudaStream_t stream) {
  const dim3 grid((p.n + kStreamColsPerCta - 1) / kStreamColsPerCta, p.group_offsets != nullptr ? p.max_groups : 1);
  const dim3 block(kStreamWarps * 32);
  cudaError_t err = cudaSuccess;
  if (rows_hint <= 1) {
    err = launch_dependent(stream_gemm_kernel<kFp8, 1>, grid, block, 0, stream, p);
  } else if (rows_hint <= 2) {
    err = launch_dependent(stream_gemm_kernel<kFp8, 2>, grid, block, 0, stream, p);
  } else if (rows_hint <= 4) {
    err = launch_dependent(stream_gemm_kernel<kFp8, 4>, grid, block, 0, stream, p);
  } else {
    err = launch_dependent(stream_gemm_kernel<kFp8, 8>, grid, block, 0, stream, p);
  }
  return err != cudaSuccess ? err : cudaGetLastError();
}

// Dummy FP8 weights: e4m3 of a counter hash of (seed, index), uniform in [-scale, scale).
__global__ void fill_uniform_fp8_kernel(uint8_t* out, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + i;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * (1.0f / 16777216.0f);
    out[i] = static_cast<uint8_t>(__nv_cvt_float_to_fp8((2.0f * u - 1.0f) * scale, __NV_SATFINITE, __NV_E4M3));
  }
}

}  // namespace

cudaError_t launch_fill_uniform_fp8(uint8_t* out, size_t n, uint64_t seed, float scale, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  fill_uniform_fp8_kernel<<<1024, 256, 0, stream>>>(out, n, seed, scale);
  return cudaGetLastError();
}

cudaError_t launch_quantize_fp8(uint8_t* out, float* scales, const bf16* x, int32_t rows, int32_t k, int32_t scale_ld,
                                const int32_t* offsets, const int32_t* padded_offsets, int32_t num_groups,
                                cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int64_t items = static_cast<int64_t>(rows) * (k / kFp8Block);
  const unsigned blocks = static_cast<unsigned>((items + kQuantWarps - 1) / kQuantWarps);
  quantize_fp8_kernel<<<blocks, kQuantWarps * 32, 0, stream>>>(out, scales, x, rows, k, scale_ld, offsets,
                                                               padded_offsets, num_groups);
  return cudaGetLastError();
}

cudaError_t launch_fp8_tc_stream(bf16* out, const bf16* a, const uint8_t* w, const float* w_scale, int32_t scale_ld,
                                 int32_t m, int32_t n, int32_t k, bool accumulate, cudaStream_t stream) {
  if (m == 0 || n == 0) return cudaSuccess;
  const dim3 grid((n + 15) / 16);
  const cudaError_t err = m <= 8 ? launch_dependent(fp8_tc_stream_kernel<4, false>, grid, dim3(kTcWarps * 32), 0,
                                                    stream, out, a, w, w_scale, scale_ld, m, n, k, accumulate)
                                 : launch_dependent(fp8_tc_stream_kernel<4, true>, grid, dim3(kTcWarps * 32), 0, stream,
                                                    out, a, w, w_scale, scale_ld, m, n, k, accumulate);
  return err != cudaSuccess ? err : cudaGetLastError();
}

cudaError_t launch_stream_gemm(const StreamGemmArgs& args, int32_t rows_hint, cudaStream_t stream) {
  if (args.n == 0 || (args.group_offsets == nullptr && args.m == 0) || args.max_groups == 0) return cudaSuccess;
  if (args.w_scale != nullptr && !args.cuda_cores && args.n % 16 == 0) {
    const int tiles = fp8_tc_grouped_tiles(args);
    const dim3 grid((args.n + 16 * tiles - 1) / (16 * tiles), args.group_offsets != nullptr ? args.max_groups : 1);
    const dim3 block(kTcWarps * 32);
    const cudaError_t err = tiles == 4   ? launch_dependent(fp8_tc_grouped_kernel<4>, grid, block, 0, stream, args)
                            : tiles == 2 ? launch_dependent(fp8_tc_grouped_kernel<2>, grid, block, 0, stream, args)
                                         : launch_dependent(fp8_tc_grouped_kernel<1>, grid, block, 0, stream, args);
    return err != cudaSuccess ? err : cudaGetLastError();
  }
  return args.w_scale != nullptr ? launch_stream_gemm_typed<true>(args, rows_hint, stream)
                                 : launch_stream_gemm_typed<false>(args, rows_hint, stream);
}

}  // namespace pd::kernels::cuda::detail
