// Skinny bf16 GEMM for decode: out[M][N] = a[M][K] * w[N][K]^T with M <= 16.
//
// At decode batch sizes the weight matrix is read once and the activations
// are tiny, so the kernel is bound by how many weight bytes are in flight.
// One CTA owns 16 output columns (two n8 tiles of w rows) and splits K over its
// 8 warps; each lane streams 16-byte loads of w (kUnroll chunks of 32 k per
// warp-iteration, all issued before the first use) and the math runs on
// tensor cores (mma m16n8k16, the M activation rows zero-padded to 16), so even
// M = 16 costs nothing next to the loads. The warps' partial tiles are summed
// in shared memory; no workspace, no atomics, one launch. Optionally SwiGLU is applied
// while loading the activations (SkinnyPrologue::kSwiGlu: a holds [gate | up] rows), which
// removes the silu_mul kernel and its round trip in front of the down projection.
//
// Variants 0..3 (the GEMM autotuner times each per shape; which wins depends on N and K):
// 4 or 8 chunks in flight per lane (8 only for M <= 8, which needs no registers
// for activation rows 8..15), and each warp's K either as one contiguous slice
// or interleaved with the other warps' (the CTA then sweeps each row front to back).
// Variants 5, 6: 32 columns per CTA (half the activation reads per weight byte, for
// M up to 16), 3 chunks in flight, K contiguous / interleaved.
// Variant 4 (m <= 4) is a CUDA-core GEMV with whole-row loads, below.
//
// k permutation: a lane of quad t4 loads 8 consecutive k (16 bytes) of its w
// row and of the activation rows; those 8 values feed the mma's k slots
// {2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9} of two consecutive k16 steps. A and B use
// the same map, so the dot product is unchanged (it is a sum over k).
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/launch.h"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/swiglu.cuh"

namespace pd::kernels::cuda::detail {
namespace {

constexpr int kSkinnyWarps = 8;
constexpr int kSkinnyThreads = kSkinnyWarps * 32;
constexpr int kSkinnyKChunk = 32;  // k per warp per chunk (4 lanes x 8)
constexpr int kSkinnyMaxM = kSkinnyGemmMaxM;

// Weights are read exactly once: keep them out of L1 so the activations stay there.
__device__ __forceinline__ uint4 load_weights_16(const bf16* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// SwiGLU prologue: the activation row is [gate | up] of 2k elements and the GEMM
// consumes silu(gate) * up rounded to bf16, computed as silu_mul computes it (swiglu.cuh),
// so fused and unfused paths agree bit for bit.
__device__ __forceinline__ uint32_t swiglu_bf16x2(uint32_t gate, uint32_t up) {
  __nv_bfloat162 v =
      __floats2bfloat162_rn(swiglu(__uint_as_float(gate << 16), __uint_as_float(up << 16)),
                            swiglu(__uint_as_float(gate & 0xffff0000u), __uint_as_float(up & 0xffff0000u)));
  return *reinterpret_cast<uint32_t*>(&v);
}

// 8 consecutive activations of a row at element offset k_off: a plain load, or with
// kSwiGlu the row is [gate | up] (row length 2k) and the loaded values are silu(gate) * up.
template <bool kSwiGlu>
__device__ __forceinline__ uint4 load_activations_16(const bf16* row, int k_off, int k) {
  const uint4 v = __ldg(reinterpret_cast<const uint4*>(row + k_off));
  if constexpr (!kSwiGlu) {
    return v;
  } else {
    const uint4 up = __ldg(reinterpret_cast<const uint4*>(row + k + k_off));
    return make_uint4(swiglu_bf16x2(v.x, up.x), swiglu_bf16x2(v.y, up.y), swiglu_bf16x2(v.z, up.z),
                      swiglu_bf16x2(v.w, up.w));
  }
}

__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Precondition (checked by the caller): 1 <= m <= (kHighRows ? 16 : 8), n % 8 == 0, k % 8 == 0.
// One CTA owns kTiles n8 tiles (8 * kTiles columns); every warp of it reads the whole M x K
// activation slice of its K range once for all its tiles, so wider CTAs (kTiles 4) halve the
// activation traffic from L2, which at M = 16 is as large as the weight traffic with 2 tiles.
// The minimum of CTAs per SM caps registers at what keeping every load of an
// iteration in flight needs (ptxas otherwise trades loads in flight for occupancy).
// kSwiGlu: a is [m][2k] (gate | up) and the GEMM's activations are silu(gate) * up; its
// two activation loads per chunk need the registers of 2 CTAs per SM (the deep variant then
// keeps 6 chunks in flight instead of 8, which ptxas otherwise spills).
template <bool kOutFp32, int kUnroll, bool kHighRows, bool kSwiGlu, int kTiles>
__global__ void __launch_bounds__(kSkinnyThreads, kUnroll >= 6 || kSwiGlu || kTiles > 2 ? 2 : 3)
    skinny_gemm_kernel(void* __restrict__ out, const bf16* __restrict__ a, const bf16* __restrict__ w, int m, int n,
                       int k, bool interleave_k) {
  wait_for_prior_grids();  // pdl.cuh: before any global access
  allow_dependents();
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;  // w row within an n8 tile; activation row (and row + 8)
  const int t4 = lane & 3;
  const int n0 = blockIdx.x * 8 * kTiles;

  const int num_chunks = (k + kSkinnyKChunk - 1) / kSkinnyKChunk;
  // This warp's iterations: chunks [c, c + kUnroll) for c = chunk_first, += chunk_step, below chunk_end.
  int chunk_first, chunk_step, chunk_end;
  if (interleave_k) {
    chunk_first = warp * kUnroll;
    chunk_step = kSkinnyWarps * kUnroll;
    chunk_end = num_chunks;
  } else {
    const int chunks_per_warp = (num_chunks + kSkinnyWarps - 1) / kSkinnyWarps;
    chunk_first = warp * chunks_per_warp;
    chunk_step = kUnroll;
    chunk_end = min(num_chunks, chunk_first + chunks_per_warp);
  }

  // Tile t's row g is w_row + t * 8k; n % 8 == 0, so a tile is all in or all out (n0 + 8t < n).
  const bf16* w_row = w + static_cast<int64_t>(n0 + g) * k + t4 * 8;
  const int64_t tile_stride = 8LL * k;
  const bool row_lo = g < m;
  const bool row_hi = kHighRows && g + 8 < m;
  const int64_t a_stride = kSwiGlu ? 2LL * k : k;
  const bf16* a_lo = a + (row_lo ? g : 0) * a_stride + t4 * 8;
  const bf16* a_hi = a + (row_hi ? g + 8 : 0) * a_stride + t4 * 8;

  float acc[kTiles][4] = {};
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int c = chunk_first; c < chunk_end; c += chunk_step) {
    uint4 wv[kUnroll][kTiles], av_lo[kUnroll], av_hi[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k_off = (c + u) * kSkinnyKChunk;
      const bool valid = c + u < chunk_end && k_off + t4 * 8 < k;
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
        wv[u][t] = valid && n0 + 8 * t < n ? load_weights_16(w_row + t * tile_stride + k_off) : zero;
      }
      av_lo[u] = valid && row_lo ? load_activations_16<kSwiGlu>(a_lo, k_off, k) : zero;
      av_hi[u] = kHighRows && valid && row_hi ? load_activations_16<kSwiGlu>(a_hi, k_off, k) : zero;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int t = 0; t < kTiles; ++t) {
        mma_16816(acc[t], av_lo[u].x, av_hi[u].x, av_lo[u].y, av_hi[u].y, wv[u][t].x, wv[u][t].y);
        mma_16816(acc[t], av_lo[u].z, av_hi[u].z, av_lo[u].w, av_hi[u].w, wv[u][t].z, wv[u][t].w);
      }
    }
  }

  // Sum the warps' partial tiles: [warp][tile][fragment element][lane].
  __shared__ float partial[kSkinnyWarps][kTiles][4][32];
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp][t][i][lane] = acc[t][i];
  }
  __syncthreads();
  // One thread per (tile, fragment element, lane) of the kTiles x 4 x 32.
  for (int item = threadIdx.x; item < kTiles * 4 * 32; item += kSkinnyThreads) {
    const int tile = item >> 7;
    const int elem = (item >> 5) & 3;
    const int src_lane = item & 31;
    float sum = 0.0f;
#pragma unroll
    for (int wp = 0; wp < kSkinnyWarps; ++wp) sum += partial[wp][tile][elem][src_lane];
    // mma C fragment: elements 0,1 are row g, 2,3 row g + 8; column 2 t4 + (elem & 1).
    const int row = (src_lane >> 2) + (elem >= 2 ? 8 : 0);
    const int col = n0 + tile * 8 + (src_lane & 3) * 2 + (elem & 1);
    if (row < m && col < n) {
      const int64_t idx = static_cast<int64_t>(row) * n + col;
      if constexpr (kOutFp32) {
        static_cast<float*>(out)[idx] = sum;
      } else {
        static_cast<bf16*>(out)[idx] = __float2bfloat16(sum);
      }
    }
  }
}

// Variant 4, m <= 4: plain CUDA-core GEMV. Each warp owns kGemvRowsPerWarp w rows
// over the whole of K and every load instruction of the warp reads 512
// contiguous bytes of one row (the mma variants read 64 bytes of 8 rows), at
// the price of 8 FMAs per loaded weight pair per activation row.
constexpr int kGemvMaxM = 4;
constexpr int kGemvRowsPerWarp = 2;
constexpr int kGemvUnroll = 4;  // 256-wide k steps in flight per lane
constexpr int kGemvRowsPerCta = kSkinnyWarps * kGemvRowsPerWarp;

__device__ __forceinline__ void bf16x8_to_float(const uint4& v, float (&f)[8]) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(words[i] << 16);
    f[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

template <bool kOutFp32, bool kSwiGlu>
__global__ void __launch_bounds__(kSkinnyThreads, 2)
    gemv_kernel(void* __restrict__ out, const bf16* __restrict__ a, const bf16* __restrict__ w, int m, int n, int k) {
  wait_for_prior_grids();  // pdl.cuh: before any global access
  allow_dependents();
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int row0 = blockIdx.x * kGemvRowsPerCta + warp * kGemvRowsPerWarp;
  float acc[kGemvRowsPerWarp][kGemvMaxM] = {};
  const uint4 zero = make_uint4(0, 0, 0, 0);
  constexpr int kStep = 32 * 8;  // k per warp load instruction
  for (int k0 = lane * 8; k0 < k; k0 += kGemvUnroll * kStep) {
    uint4 wv[kGemvUnroll][kGemvRowsPerWarp];
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
#pragma unroll
      for (int r = 0; r < kGemvRowsPerWarp; ++r) {
        const bool valid = k0 + u * kStep < k && row0 + r < n;
        wv[u][r] = valid ? load_weights_16(w + static_cast<int64_t>(row0 + r) * k + k0 + u * kStep) : zero;
      }
    }
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
      if (k0 + u * kStep >= k) break;
      float wf[kGemvRowsPerWarp][8];
#pragma unroll
      for (int r = 0; r < kGemvRowsPerWarp; ++r) bf16x8_to_float(wv[u][r], wf[r]);
#pragma unroll
      for (int mi = 0; mi < kGemvMaxM; ++mi) {
        if (mi >= m) break;
        float af[8];
        const int64_t a_stride = kSwiGlu ? 2LL * k : k;
        bf16x8_to_float(load_activations_16<kSwiGlu>(a + mi * a_stride, k0 + u * kStep, k), af);
#pragma unroll
        for (int r = 0; r < kGemvRowsPerWarp; ++r) {
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[r][mi] = fmaf(af[j], wf[r][j], acc[r][mi]);
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kGemvRowsPerWarp; ++r) {
#pragma unroll
    for (int mi = 0; mi < kGemvMaxM; ++mi) {
      float v = acc[r][mi];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
      if (lane == 0 && mi < m && row0 + r < n) {
        const int64_t idx = static_cast<int64_t>(mi) * n + row0 + r;
        if constexpr (kOutFp32) {
          static_cast<float*>(out)[idx] = v;
        } else {
          static_cast<bf16*>(out)[idx] = __float2bfloat16(v);
        }
      }
    }
  }
}

}  // namespace

cudaError_t launch_skinny_gemm(void* out, bool out_fp32, const bf16* a, const bf16* w, int32_t m, int32_t n, int32_t k,
                               int32_t variant, cudaStream_t stream, SkinnyPrologue prologue) {
  if (m < 1 || m > skinny_gemm_max_m(variant, prologue)) return cudaErrorInvalidValue;
  const bool swiglu = prologue == SkinnyPrologue::kSwiGlu;
  if (swiglu && out_fp32) return cudaErrorInvalidValue;  // not instantiated: SwiGLU feeds the bf16 down projection
  if (variant == 4) {
    using GemvKernel = void (*)(void*, const bf16*, const bf16*, int, int, int);
    const GemvKernel kernel =
        swiglu ? gemv_kernel<false, true> : (out_fp32 ? gemv_kernel<true, false> : gemv_kernel<false, false>);
    const dim3 grid((n + kGemvRowsPerCta - 1) / kGemvRowsPerCta);
    return launch_dependent(kernel, grid, dim3(kSkinnyThreads), 0, stream, out, a, w, m, n, k);
  }
  using Kernel = void (*)(void*, const bf16*, const bf16*, int, int, int, bool);
  Kernel kernel = nullptr;
  int cols_per_cta = 16;
  if (variant >= 5) {  // 32 columns per CTA, 3 chunks in flight, rows 0..15
    kernel = out_fp32 ? skinny_gemm_kernel<true, 3, true, false, 4> : skinny_gemm_kernel<false, 3, true, false, 4>;
    cols_per_cta = 32;
  } else if (variant >= 2) {  // 8 chunks in flight (6 with SwiGLU), rows 0..7 only
    kernel = swiglu     ? skinny_gemm_kernel<false, 6, false, true, 2>
             : out_fp32 ? skinny_gemm_kernel<true, 8, false, false, 2>
                        : skinny_gemm_kernel<false, 8, false, false, 2>;
  } else {
    kernel = swiglu     ? skinny_gemm_kernel<false, 4, true, true, 2>
             : out_fp32 ? skinny_gemm_kernel<true, 4, true, false, 2>
                        : skinny_gemm_kernel<false, 4, true, false, 2>;
  }
  const bool interleave_k = variant == 1 || variant == 3 || variant == 6;
  const dim3 grid((n + cols_per_cta - 1) / cols_per_cta);
  return launch_dependent(kernel, grid, dim3(kSkinnyThreads), 0, stream, out, a, w, m, n, k, interleave_k);
}

int32_t skinny_gemm_max_m(int32_t variant, SkinnyPrologue prologue) {
  if (variant < 0 || variant >= kNumSkinnyGemmVariants) return 0;
  if (variant == 4) return kGemvMaxM;
  if (variant >= 5) return prologue == SkinnyPrologue::kNone ? kSkinnyMaxM : 0;  // no SwiGLU instantiation
  return variant >= 2 ? 8 : kSkinnyMaxM;
}

}  // namespace pd::kernels::cuda::detail
