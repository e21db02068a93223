// Skinny bf16 GEMM for decode: out[M][N] = a[M][K] * w[N][K]^T with M <= 16.
//
// At decode batch sizes the weight matrix is read once and the activations
// are tiny, so the kernel is bound by how many weight bytes are in flight.
// One CTA owns 16 output columns (two n8 tiles of w rows) and splits K over its
// 8 warps; each lane streams 16-byte loads of w (kUnroll chunks of 32 k per
// warp-iteration, all issued before the first use) and the math runs on
// tensor cores (mma m16n8k16, the M activation rows zero-padded to 16), so even
// M = 16 costs nothing next to the loads. The warps' partial tiles are summed
// in shared memory; no workspace, no atomics, one launch.
//
// Variants 0..3 (the GEMM autotuner times each per shape; which wins depends on N and K):
// 4 or 8 chunks in flight per lane (8 only for M <= 8, which needs no registers
// for activation rows 8..15), and each warp's K either as one contiguous slice
// or interleaved with the other warps' (the CTA then sweeps each row front to back).
// Variant 4 (m <= 4) is a CUDA-core GEMV with whole-row loads, and variants 5 and 6
// feed the same tensor-core CTA from a cp.async ring in shared memory, below.
//
// Fusions (launch.h, SkinnyFusion). Accumulate: the store adds the value already in `out`
// (the residual add of o_proj and the down projection). Norm (variants 0..4, m <= 4 and
// m * k * 2 <= kSkinnyNormSmemBytes): `a` is the un-normalized residual stream; each CTA
// first normalizes its m rows into shared memory exactly as rmsnorm_kernel does (fp32 sum
// of squares, HF's rounding order), while the weight loads issued before the PDL wait are
// in flight, and the main loop then reads the activations from there. Every CTA repeats
// the norm of the same m rows (8 KB each at hidden 4,096, from L2): cheaper than a kernel
// launch and its wait at these sizes. Normalizing inside the loop instead (each activation
// piece times its weight piece, the row scale on the sums) needed 16-30 more registers,
// dropped a CTA per SM or spilled, and measured about 25 % slower; persistent 16-warp CTAs
// normalizing up to 16 rows once lost to the norm kernel + the usual variants by 50 %
// (docs/perf/engine.md, 2026-12-01 04:38 UTC).
//
// k permutation: a lane of quad t4 loads 8 consecutive k (16 bytes) of its w
// row and of the activation rows; those 8 values feed the mma's k slots
// {2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9} of two consecutive k16 steps. A and B use
// the same map, so the dot product is unchanged (it is a sum over k).
#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/pdl.cuh"

namespace pd::kernels::cuda::detail {
namespace {

constexpr int kSkinnyWarps = 8;
constexpr int kSkinnyThreads = kSkinnyWarps * 32;
constexpr int kSkinnyColsPerCta = 16;  // two n8 tiles
constexpr int kSkinnyKChunk = 32;      // k per warp per chunk (4 lanes x 8)
constexpr int kSkinnyMaxM = kSkinnyGemmMaxM;

// Weights are read exactly once: keep them out of L1 so the activations stay there.
__device__ __forceinline__ uint4 load_weights_16(const bf16* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void bf16x8_to_float(const uint4& v, float (&f)[8]) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(words[i] << 16);
    f[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Norm fusion prologue: act[r][0..k) = rmsnorm(a[r]) * weight for rows r < m, in shared
// memory, with rmsnorm_kernel's arithmetic (fp32 sum of squares of the bf16 inputs;
// normalize, round to bf16, multiply by the weight, round). Every thread of the CTA calls
// it after the PDL wait; it ends with a barrier. k % 8 == 0, m <= kSkinnyNormMaxM.
__device__ __forceinline__ void normalize_rows_to_smem(bf16* act, const bf16* __restrict__ a,
                                                       const bf16* __restrict__ weight, int m, int k, float eps) {
  __shared__ float partial[kSkinnyWarps][kSkinnyNormMaxM];
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int vecs = k / 8;
  auto* act_v = reinterpret_cast<uint4*>(act);
  for (int r = 0; r < m; ++r) {
    float sum_sq = 0.0f;
    for (int i = threadIdx.x; i < vecs; i += kSkinnyThreads) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(a + static_cast<int64_t>(r) * k) + i);
      float f[8];
      bf16x8_to_float(v, f);
#pragma unroll
      for (int j = 0; j < 8; ++j) sum_sq = fmaf(f[j], f[j], sum_sq);
      act_v[r * vecs + i] = v;  // raw for now; this thread normalizes it below
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, off);
    if (lane == 0) partial[warp][r] = sum_sq;
  }
  __syncthreads();
  for (int r = 0; r < m; ++r) {
    float total = 0.0f;
#pragma unroll
    for (int wp = 0; wp < kSkinnyWarps; ++wp) total += partial[wp][r];
    const float inv_rms = rsqrtf(total / static_cast<float>(k) + eps);
    for (int i = threadIdx.x; i < vecs; i += kSkinnyThreads) {
      float f[8], wf[8];
      bf16x8_to_float(act_v[r * vecs + i], f);
      bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(weight) + i), wf);
#pragma unroll
      for (int j = 0; j < 8; ++j) f[j] = __bfloat162float(__float2bfloat16(f[j] * inv_rms)) * wf[j];
      act_v[r * vecs + i] = make_uint4(pack_bf16x2(f[0], f[1]), pack_bf16x2(f[2], f[3]), pack_bf16x2(f[4], f[5]),
                                       pack_bf16x2(f[6], f[7]));
    }
  }
  __syncthreads();
}

// Sums the 8 warps' partial C tiles (two n8 tiles of columns n0..n0 + 15) of a skinny
// CTA and stores rows < m, columns < n, plus the value already stored when accumulating
// (bf16 out only). Every thread of the CTA calls it.
template <bool kOutFp32>
__device__ __forceinline__ void skinny_reduce_and_store(const float (&acc0)[4], const float (&acc1)[4], void* out,
                                                        int m, int n, int n0, bool accumulate) {
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  // [warp][tile][fragment element][lane].
  __shared__ float partial[kSkinnyWarps][2][4][32];
  __syncthreads();  // a previous call's readers are done with `partial`
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    partial[warp][0][i][lane] = acc0[i];
    partial[warp][1][i][lane] = acc1[i];
  }
  __syncthreads();
  // One thread per (tile, fragment element, lane): 2 x 4 x 32 = kSkinnyThreads.
  const int tile = threadIdx.x >> 7;
  const int elem = (threadIdx.x >> 5) & 3;
  const int src_lane = threadIdx.x & 31;
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
      bf16* o = static_cast<bf16*>(out);
      if (accumulate) sum += __bfloat162float(o[idx]);
      o[idx] = __float2bfloat16(sum);
    }
  }
}

// Precondition (checked by the caller): 1 <= m <= (kHighRows ? 16 : 8), n % 8 == 0, k % 8 == 0.
// The minimum of CTAs per SM caps registers at what keeping every load of an
// iteration in flight needs (ptxas otherwise trades loads in flight for occupancy).
// kNormed: the norm fusion (m <= kSkinnyNormMaxM; dynamic shared memory of m * k bf16).
template <bool kOutFp32, int kUnroll, bool kHighRows, bool kNormed>
__global__ void __launch_bounds__(kSkinnyThreads, kUnroll == 8 ? 2 : 3)
    skinny_gemm_kernel(void* __restrict__ out, const bf16* __restrict__ a, const bf16* __restrict__ w, int m, int n,
                       int k, bool interleave_k, const bf16* __restrict__ norm_weight, float norm_eps,
                       bool accumulate) {
  extern __shared__ uint4 normed_rows[];  // kNormed: [m][k] bf16
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;  // w row within an n8 tile; activation row (and row + 8)
  const int t4 = lane & 3;
  const int n0 = blockIdx.x * kSkinnyColsPerCta;
  const bool has_tile1 = n0 + 8 < n;  // n % 8 == 0: a tile is all in or all out

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

  const bf16* w0 = w + static_cast<int64_t>(n0 + g) * k + t4 * 8;
  const bf16* w1 = w + static_cast<int64_t>(has_tile1 ? n0 + 8 + g : n0 + g) * k + t4 * 8;
  const bool row_lo = g < m;
  const bool row_hi = kHighRows && g + 8 < m;
  const bf16* a_rows = kNormed ? reinterpret_cast<const bf16*>(normed_rows) : a;
  const bf16* a_lo = a_rows + static_cast<int64_t>(row_lo ? g : 0) * k + t4 * 8;
  const bf16* a_hi = a_rows + static_cast<int64_t>(row_hi ? g + 8 : 0) * k + t4 * 8;
  // Activation pieces: from shared memory after the norm prologue, else read-only global loads.
  auto load_activations_16 = [](const bf16* p) {
    if constexpr (kNormed) {
      return *reinterpret_cast<const uint4*>(p);
    } else {
      return __ldg(reinterpret_cast<const uint4*>(p));
    }
  };

  float acc0[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  float acc1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const uint4 zero = make_uint4(0, 0, 0, 0);
  uint4 wv0[kUnroll], wv1[kUnroll];
  auto load_weight_chunks = [&](int c) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k_off = (c + u) * kSkinnyKChunk;
      const bool valid = c + u < chunk_end && k_off + t4 * 8 < k;
      wv0[u] = valid ? load_weights_16(w0 + k_off) : zero;
      wv1[u] = valid && has_tile1 ? load_weights_16(w1 + k_off) : zero;
    }
  };
  // The first iteration's weight loads go out before the PDL wait (pdl.cuh: nothing in a
  // step writes weights), so they overlap the previous kernel's tail instead of starting
  // the HBM pipeline from empty once it has finished.
  if (chunk_first < chunk_end) load_weight_chunks(chunk_first);
  wait_for_prior_grids();  // pdl.cuh: before reading the activations
  allow_dependents();
  if constexpr (kNormed) normalize_rows_to_smem(reinterpret_cast<bf16*>(normed_rows), a, norm_weight, m, k, norm_eps);
  for (int c = chunk_first; c < chunk_end; c += chunk_step) {
    uint4 av_lo[kUnroll], av_hi[kUnroll];
    if (c != chunk_first) load_weight_chunks(c);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int k_off = (c + u) * kSkinnyKChunk;
      const bool valid = c + u < chunk_end && k_off + t4 * 8 < k;
      av_lo[u] = valid && row_lo ? load_activations_16(a_lo + k_off) : zero;
      av_hi[u] = kHighRows && valid && row_hi ? load_activations_16(a_hi + k_off) : zero;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      mma_16816(acc0, av_lo[u].x, av_hi[u].x, av_lo[u].y, av_hi[u].y, wv0[u].x, wv0[u].y);
      mma_16816(acc0, av_lo[u].z, av_hi[u].z, av_lo[u].w, av_hi[u].w, wv0[u].z, wv0[u].w);
      mma_16816(acc1, av_lo[u].x, av_hi[u].x, av_lo[u].y, av_hi[u].y, wv1[u].x, wv1[u].y);
      mma_16816(acc1, av_lo[u].z, av_hi[u].z, av_lo[u].w, av_hi[u].w, wv1[u].z, wv1[u].w);
    }
  }

  skinny_reduce_and_store<kOutFp32>(acc0, acc1, out, m, n, n0, accumulate);
}

// Variants 5 and 6: the same CTA shape and k permutation as skinny_gemm_kernel, but
// each lane streams its chunks through a ring of shared memory with cp.async
// instead of registers, so several chunks per lane stay in flight at any M
// without register pressure (the register variants keep 4 in flight at M = 16
// and drain to zero between iterations). Lane l copies exactly the 16-byte
// pieces it later reads (w rows g and g + 8, activation rows g and g + 8, k
// piece t4 of the chunk), so a lane only waits for its own copies: no barrier
// inside the loop. The first stages' weight copies are issued before the PDL
// wait (pdl.cuh: weights are not written during a step). Variant 5: m <= 16;
// variant 6: m <= 8 (no activation rows 8..15: more stages in the same memory).
// Measured (docs/perf/engine.md, 2026-12-01 01:35 UTC): at M = 16 it wins o_proj (10.8 us vs
// 13.4 for cuBLASLt, weights rotated through HBM) but not the wide or long shapes
// (gate_up 60.7 vs 49.3, down 35.0 vs 28.5). A 32-column version (half the activation
// reads per weight byte, activations through L1) was slower everywhere and was removed.
constexpr int kRingColTiles = 2;  // 16 columns per CTA, as skinny_gemm_kernel

template <bool kHighRows>
struct RingShape {
  static constexpr int kPieces = kRingColTiles + (kHighRows ? 2 : 1);  // per lane per stage
  // As many stages as keep a CTA at <= 100 KiB of ring (two CTAs per SM).
  static constexpr int kStages = 100 * 1024 / (kSkinnyWarps * kPieces * 32 * 16);
  static constexpr int kSmemBytes = kSkinnyWarps * kStages * kPieces * 32 * 16;
  static constexpr int kCols = kRingColTiles * 8;
};

template <bool kOutFp32, bool kHighRows>
__global__ void __launch_bounds__(kSkinnyThreads, 2)
    skinny_ring_gemm_kernel(void* __restrict__ out, const bf16* __restrict__ a, const bf16* __restrict__ w, int m,
                            int n, int k, bool accumulate) {
  using Shape = RingShape<kHighRows>;
  constexpr int kStages = Shape::kStages;
  constexpr int kPieces = Shape::kPieces;
  extern __shared__ uint4 ring_smem[];  // [warp][stage][piece][lane]
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2;
  const int t4 = lane & 3;
  const int n0 = blockIdx.x * Shape::kCols;

  // Each warp owns one contiguous slice of the k chunks.
  const int num_chunks = (k + kSkinnyKChunk - 1) / kSkinnyKChunk;
  const int chunks_per_warp = (num_chunks + kSkinnyWarps - 1) / kSkinnyWarps;
  const int chunk_first = warp * chunks_per_warp;
  const int my_chunks = max(0, min(num_chunks, chunk_first + chunks_per_warp) - chunk_first);

  const bf16* w_rows[kRingColTiles];
  bool has_tile[kRingColTiles];
#pragma unroll
  for (int t = 0; t < kRingColTiles; ++t) {
    has_tile[t] = n0 + 8 * t < n;  // n % 8 == 0: a tile is all in or all out
    w_rows[t] = w + static_cast<int64_t>(has_tile[t] ? n0 + 8 * t + g : n0 + g) * k + t4 * 8;
  }
  const bool row_lo = g < m;
  const bool row_hi = kHighRows && g + 8 < m;
  const bf16* a_lo = a + static_cast<int64_t>(row_lo ? g : 0) * k + t4 * 8;
  const bf16* a_hi = a + static_cast<int64_t>(row_hi ? g + 8 : 0) * k + t4 * 8;
  uint4* const ring = ring_smem + warp * kStages * kPieces * 32 + lane;
  auto piece = [&](int stage, int p) { return ring + (stage * kPieces + p) * 32; };

  // i: this warp's i-th chunk; an i past the slice (or k past the end) copies zeros.
  auto chunk_offset = [&](int i, bool& valid) {
    const int k_off = (chunk_first + i) * kSkinnyKChunk;
    valid = i < my_chunks && k_off + t4 * 8 < k;
    return valid ? k_off : 0;
  };
  auto copy_weights = [&](int i) {
    bool valid;
    const int k_off = chunk_offset(i, valid);
    const int stage = i % kStages;
#pragma unroll
    for (int t = 0; t < kRingColTiles; ++t) cp_async_16(piece(stage, t), w_rows[t] + k_off, valid && has_tile[t]);
  };
  auto copy_activations = [&](int i) {
    bool valid;
    const int k_off = chunk_offset(i, valid);
    const int stage = i % kStages;
    cp_async_16(piece(stage, kRingColTiles), a_lo + k_off, valid && row_lo);
    if constexpr (kHighRows) cp_async_16(piece(stage, kRingColTiles + 1), a_hi + k_off, valid && row_hi);
  };

#pragma unroll
  for (int i = 0; i < kStages; ++i) copy_weights(i);
  wait_for_prior_grids();  // pdl.cuh: before reading the activations
  allow_dependents();
#pragma unroll
  for (int i = 0; i < kStages; ++i) {
    copy_activations(i);
    cp_async_commit();  // group i: stage i (group 0 also holds every early weight copy)
  }

  float acc[kRingColTiles][4] = {};
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int i = 0; i < my_chunks; ++i) {
    cp_async_wait<kStages - 1>();  // group i (this lane's copies of chunk i) has landed
    const int stage = i % kStages;
    const uint4 av_lo = *piece(stage, kRingColTiles);
    uint4 av_hi = zero;
    if constexpr (kHighRows) av_hi = *piece(stage, kRingColTiles + 1);
#pragma unroll
    for (int t = 0; t < kRingColTiles; ++t) {
      const uint4 wv = *piece(stage, t);
      mma_16816(acc[t], av_lo.x, av_hi.x, av_lo.y, av_hi.y, wv.x, wv.y);
      mma_16816(acc[t], av_lo.z, av_hi.z, av_lo.w, av_hi.w, wv.z, wv.w);
    }
    // Refill the stage just read with chunk i + kStages (the reads above completed:
    // the mma consumed their registers before this copy is issued).
    copy_weights(i + kStages);
    copy_activations(i + kStages);
    cp_async_commit();
  }
  cp_async_wait<0>();  // the trailing zero-fill copies land before the CTA's shared memory is released

#pragma unroll
  for (int t = 0; t < kRingColTiles; t += 2) {
    skinny_reduce_and_store<kOutFp32>(acc[t], acc[t + 1], out, m, n, n0 + 8 * t, accumulate);
  }
}

template <bool kHighRows>
cudaError_t launch_skinny_ring(void* out, bool out_fp32, const bf16* a, const bf16* w, int32_t m, int32_t n, int32_t k,
                               bool accumulate, cudaStream_t stream) {
  using Shape = RingShape<kHighRows>;
  constexpr auto kernel_bf16 = skinny_ring_gemm_kernel<false, kHighRows>;
  constexpr auto kernel_fp32 = skinny_ring_gemm_kernel<true, kHighRows>;
  const cudaError_t err = out_fp32 ? opt_in_dynamic_smem<kernel_fp32>(Shape::kSmemBytes)
                                   : opt_in_dynamic_smem<kernel_bf16>(Shape::kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid((n + Shape::kCols - 1) / Shape::kCols);
  return launch_dependent(out_fp32 ? kernel_fp32 : kernel_bf16, grid, dim3(kSkinnyThreads), Shape::kSmemBytes, stream,
                          out, a, w, m, n, k, accumulate);
}

// Variant 4, m <= 4: plain CUDA-core GEMV. Each warp owns kGemvRowsPerWarp w rows
// over the whole of K and every load instruction of the warp reads 512
// contiguous bytes of one row (the mma variants read 64 bytes of 8 rows), at
// the price of 8 FMAs per loaded weight pair per activation row.
constexpr int kGemvMaxM = 4;
constexpr int kGemvRowsPerWarp = 2;
constexpr int kGemvUnroll = 4;  // 256-wide k steps in flight per lane
constexpr int kGemvRowsPerCta = kSkinnyWarps * kGemvRowsPerWarp;

template <bool kOutFp32, bool kNormed>
__global__ void __launch_bounds__(kSkinnyThreads, 2)
    gemv_kernel(void* __restrict__ out, const bf16* __restrict__ a, const bf16* __restrict__ w, int m, int n, int k,
                const bf16* __restrict__ norm_weight, float norm_eps, bool accumulate) {
  extern __shared__ uint4 normed_rows[];  // kNormed: [m][k] bf16
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int row0 = blockIdx.x * kGemvRowsPerCta + warp * kGemvRowsPerWarp;
  float acc[kGemvRowsPerWarp][kGemvMaxM] = {};
  const uint4 zero = make_uint4(0, 0, 0, 0);
  constexpr int kStep = 32 * 8;  // k per warp load instruction
  uint4 wv[kGemvUnroll][kGemvRowsPerWarp];
  auto load_weight_steps = [&](int k0) {
#pragma unroll
    for (int u = 0; u < kGemvUnroll; ++u) {
#pragma unroll
      for (int r = 0; r < kGemvRowsPerWarp; ++r) {
        const bool valid = k0 + u * kStep < k && row0 + r < n;
        wv[u][r] = valid ? load_weights_16(w + static_cast<int64_t>(row0 + r) * k + k0 + u * kStep) : zero;
      }
    }
  };
  // As in skinny_gemm_kernel: the first weight loads precede the PDL wait.
  if (lane * 8 < k) load_weight_steps(lane * 8);
  wait_for_prior_grids();  // pdl.cuh: before reading the activations
  allow_dependents();
  if constexpr (kNormed) normalize_rows_to_smem(reinterpret_cast<bf16*>(normed_rows), a, norm_weight, m, k, norm_eps);
  for (int k0 = lane * 8; k0 < k; k0 += kGemvUnroll * kStep) {
    if (k0 != lane * 8) load_weight_steps(k0);
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
        const int64_t a_off = static_cast<int64_t>(mi) * k + k0 + u * kStep;
        if constexpr (kNormed) {
          bf16x8_to_float(*reinterpret_cast<const uint4*>(reinterpret_cast<const bf16*>(normed_rows) + a_off), af);
        } else {
          bf16x8_to_float(__ldg(reinterpret_cast<const uint4*>(a + a_off)), af);
        }
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
          bf16* o = static_cast<bf16*>(out);
          if (accumulate) v += __bfloat162float(o[idx]);
          o[idx] = __float2bfloat16(v);
        }
      }
    }
  }
}

}  // namespace

bool skinny_gemm_norm_fusable(int32_t variant, int32_t m, int32_t k) {
  return variant >= 0 && variant <= 4 && m >= 1 && m <= kSkinnyNormMaxM && m <= skinny_gemm_max_m(variant) &&
         static_cast<int64_t>(m) * k * 2 <= kSkinnyNormSmemBytes;
}

cudaError_t launch_skinny_gemm(void* out, bool out_fp32, const bf16* a, const bf16* w, int32_t m, int32_t n, int32_t k,
                               int32_t variant, cudaStream_t stream, const SkinnyFusion& fusion) {
  if (m < 1 || m > skinny_gemm_max_m(variant)) return cudaErrorInvalidValue;
  const bool normed = fusion.norm_weight != nullptr;
  if ((normed || fusion.accumulate) && out_fp32) return cudaErrorInvalidValue;  // bf16 out only
  // Both at once: nothing needs it, and the runner's accumulating calls write the rows a norm reads.
  if (normed && fusion.accumulate) return cudaErrorInvalidValue;
  if (normed &&
      (!skinny_gemm_norm_fusable(variant, m, k) || reinterpret_cast<uintptr_t>(fusion.norm_weight) % 16 != 0)) {
    return cudaErrorInvalidValue;
  }
  const size_t norm_smem = normed ? static_cast<size_t>(m) * k * sizeof(bf16) : 0;
  const bf16* nw = fusion.norm_weight;
  const float eps = fusion.norm_eps;
  const bool accumulate = fusion.accumulate;
  if (variant == 4) {
    const auto kernel = out_fp32 ? gemv_kernel<true, false>
                        : normed ? gemv_kernel<false, true>
                                 : gemv_kernel<false, false>;
    const dim3 grid((n + kGemvRowsPerCta - 1) / kGemvRowsPerCta);
    return launch_dependent(kernel, grid, dim3(kSkinnyThreads), norm_smem, stream, out, a, w, m, n, k, nw, eps,
                            accumulate);
  }
  switch (variant) {
    case 5:
      return launch_skinny_ring<true>(out, out_fp32, a, w, m, n, k, accumulate, stream);
    case 6:
      return launch_skinny_ring<false>(out, out_fp32, a, w, m, n, k, accumulate, stream);
    default:
      break;
  }
  const bool deep = variant >= 2;  // 8 chunks in flight, rows 0..7 only
  const auto kernel =
      out_fp32 ? (deep ? skinny_gemm_kernel<true, 8, false, false> : skinny_gemm_kernel<true, 4, true, false>)
      : normed ? (deep ? skinny_gemm_kernel<false, 8, false, true> : skinny_gemm_kernel<false, 4, true, true>)
               : (deep ? skinny_gemm_kernel<false, 8, false, false> : skinny_gemm_kernel<false, 4, true, false>);
  const bool interleave_k = (variant & 1) != 0;
  const dim3 grid((n + kSkinnyColsPerCta - 1) / kSkinnyColsPerCta);
  return launch_dependent(kernel, grid, dim3(kSkinnyThreads), norm_smem, stream, out, a, w, m, n, k, interleave_k, nw,
                          eps, accumulate);
}

int32_t skinny_gemm_max_m(int32_t variant) {
  if (variant < 0 || variant >= kNumSkinnyGemmVariants) return 0;
  if (variant == 4) return kGemvMaxM;
  if (variant == 5) return kSkinnyMaxM;
  if (variant == 6) return 8;
  return variant >= 2 ? 8 : kSkinnyMaxM;
}

}  // namespace pd::kernels::cuda::detail
