// Warp-item FP8 streaming GEMM for MoE decode (stream_gemm with StreamGemmArgs::tc_kernel):
// out[r][:] (+)= a[row(r)][:] . dequant(W_g)^T for the few rows r of each active expert g.
//
// Work item = (active expert, 16 output columns). A warp owns an item for the whole of K, so
// there is no cross-warp reduction and no barrier: the grid is at most one wave of resident
// CTAs, and each warp walks the items blockIdx.x + gridDim.x * (warp + warps j), so when items
// are few (small batches) they spread over every SM. A lane loads 16 weight bytes of rows
// n0 + g and n0 + 8 + g per 64-wide K chunk, converts them to bf16 times the chunk's 128 x 128
// block scale (as fp8.cu's tiled kernel: relative rounding 2^-9) and feeds them as the A operand
// of mma m16n8k16 (16 weight rows); the expert's tokens are the B operand (8 per tile, a second
// tile for 9..16 rows, passes of 16 rows beyond). Lane (g, t4) loads token g's 16 activations of
// the same k; both operands use the same k permutation (a lane's 4 consecutive k per step feed
// slots 2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9), so the sum over k is unchanged.
// Two ways to keep loads in flight (Fp8TcKernel):
// - registers: 4 chunks loaded, then computed (one memory round trip per 4 chunks);
// - ring: each lane streams its own weight and activation pieces through a private cp.async ring
//   of kStages chunks in shared memory (kStages - 1 ahead of the chunk it computes; no barrier,
//   since a lane reads only what it copied).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <atomic>
#include <cstdint>

#include "kernels/cuda/async_copy.cuh"
#include "kernels/cuda/fp8_args.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/pdl.cuh"

namespace pd::kernels::cuda::detail {
namespace {

constexpr int kWarps = 8;
constexpr int kChunk = 64;  // K per chunk: 16 per lane x 4 lanes (t4)

__device__ __forceinline__ uint4 load_weights_16(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Two e4m3 (low byte first) times s, as bf16x2 (low half first).
__device__ __forceinline__ uint32_t e4m3x2_scaled_bf16x2(uint32_t bits16, float s) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(bits16), __NV_E4M3);
  const float2 f = __half22float2(__half2(h));
  const __nv_bfloat162 v = __floats2bfloat162_rn(f.x * s, f.y * s);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A token's 16 activations at k = koff + 16 t4 .. + 16 (row already offset by 16 t4) as 8 bf16x2
// words; zeros for a token past the item's rows.
__device__ __forceinline__ void load_token(const bf16* row, int koff, bool ok, uint32_t (&b)[8]) {
  if (!ok) {
#pragma unroll
    for (int i = 0; i < 8; ++i) b[i] = 0u;
    return;
  }
  const uint4 v0 = __ldg(reinterpret_cast<const uint4*>(row + koff));
  const uint4 v1 = __ldg(reinterpret_cast<const uint4*>(row + koff + 8));
  b[0] = v0.x;
  b[1] = v0.y;
  b[2] = v0.z;
  b[3] = v0.w;
  b[4] = v1.x;
  b[5] = v1.y;
  b[6] = v1.z;
  b[7] = v1.w;
}

// One chunk of mma steps: weights of rows g (lo) and g + 8 (hi) as 16 e4m3 each, block scale s,
// token g's (b0) and g + 8's (b1, kHi) activations.
template <bool kHi>
__device__ __forceinline__ void mma_chunk(float (&acc0)[4], float (&acc1)[4], const uint4& wl, const uint4& wh,
                                          float sc, const uint32_t (&b0)[8], const uint32_t (&b1)[8]) {
  const uint32_t lo[4] = {wl.x, wl.y, wl.z, wl.w};
  const uint32_t hi[4] = {wh.x, wh.y, wh.z, wh.w};
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    // A: a0 = row g, k slots 2 t4 (+1); a1 = row g + 8; a2 / a3 = the same rows, slots 2 t4 + 8 (+9).
    const uint32_t x0 = e4m3x2_scaled_bf16x2(lo[s] & 0xffffu, sc);
    const uint32_t x2 = e4m3x2_scaled_bf16x2(lo[s] >> 16, sc);
    const uint32_t x1 = e4m3x2_scaled_bf16x2(hi[s] & 0xffffu, sc);
    const uint32_t x3 = e4m3x2_scaled_bf16x2(hi[s] >> 16, sc);
    mma_16816(acc0, x0, x1, x2, x3, b0[2 * s], b0[2 * s + 1]);
    if constexpr (kHi) mma_16816(acc1, x0, x1, x2, x3, b1[2 * s], b1[2 * s + 1]);
  }
}

// C fragment of one 8-token tile: elements 0, 1 are weight row g (output column n0 + g),
// tokens 2 t4 and 2 t4 + 1 of the tile; 2, 3 the same for column n0 + 8 + g.
__device__ __forceinline__ void store_tile(const StreamGemmArgs& p, const float (&acc)[4], int r0, int rows,
                                           int first_token, int col) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int tok = first_token + j;
    if (tok >= rows) continue;
    bf16* o = p.out + static_cast<int64_t>(r0 + tok) * p.ldo + col;
    o[0] = __float2bfloat16(p.accumulate ? acc[j] + __bfloat162float(o[0]) : acc[j]);
    o[8] = __float2bfloat16(p.accumulate ? acc[2 + j] + __bfloat162float(o[8]) : acc[2 + j]);
  }
}

// The activation rows of a pass: token g (and g + 8) of rows r0.., offset by 16 t4.
struct PassRows {
  const bf16* a0;
  const bf16* a1;
  bool ok0, ok1;
};

template <bool kHi>
__device__ __forceinline__ PassRows pass_rows(const StreamGemmArgs& p, int r0, int rows, int g, int t4) {
  PassRows r;
  r.ok0 = g < rows;
  r.ok1 = kHi && g + 8 < rows;
  const int src0 = r0 + (r.ok0 ? g : 0), src1 = r0 + (r.ok1 ? g + 8 : 0);
  r.a0 = p.a + static_cast<int64_t>(p.a_rows != nullptr ? p.a_rows[src0] : src0) * p.lda + t4 * 16;
  r.a1 = kHi ? p.a + static_cast<int64_t>(p.a_rows != nullptr ? p.a_rows[src1] : src1) * p.lda + t4 * 16 : r.a0;
  return r;
}

constexpr int kRegDepth = 4;  // registers kernel: chunks per round trip

// One pass of a warp over its 16 weight rows for up to 8 (kHi: 16) tokens r0 ..: kRegDepth
// chunks loaded into registers, then computed.
template <bool kHi>
__device__ __forceinline__ void warp_pass_registers(const StreamGemmArgs& p, const uint8_t* w_lo, const uint8_t* w_hi,
                                                    const float* srow, int r0, int rows, int n0, int lane) {
  const int g = lane >> 2, t4 = lane & 3;
  const int chunks = p.k / kChunk;
  const PassRows pr = pass_rows<kHi>(p, r0, rows, g, t4);
  float acc0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int c = 0; c < chunks; c += kRegDepth) {
    uint4 wl[kRegDepth], wh[kRegDepth];
    float sc[kRegDepth];
#pragma unroll
    for (int u = 0; u < kRegDepth; ++u) {
      const bool valid = c + u < chunks;
      const int koff = (c + u) * kChunk;
      wl[u] = valid ? load_weights_16(w_lo + koff) : zero;
      wh[u] = valid ? load_weights_16(w_hi + koff) : zero;
      sc[u] = valid ? __ldg(srow + koff / kFp8Block) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kRegDepth; ++u) {
      if (c + u >= chunks) break;  // uniform over the warp
      const int koff = (c + u) * kChunk;
      uint32_t b0[8], b1[8];
      load_token(pr.a0, koff, pr.ok0, b0);
      if constexpr (kHi) load_token(pr.a1, koff, pr.ok1, b1);
      mma_chunk<kHi>(acc0, acc1, wl[u], wh[u], sc[u], b0, b1);
    }
  }
  store_tile(p, acc0, r0, rows, 2 * t4, n0 + g);
  if constexpr (kHi) store_tile(p, acc1, r0, rows, 8 + 2 * t4, n0 + g);
}

// Ring kernel: per lane and stage 6 pieces of 16 bytes (weights of rows g and g + 8, token g's
// 16 activations, token g + 8's), laid out [warp][stage][piece][lane] so that a warp's accesses
// to one piece are 512 contiguous bytes (no bank conflicts).
constexpr int kRingWarps = 4;
constexpr int kRingPieces = 6;

template <int kStages>
constexpr int ring_smem_bytes() {
  return kRingWarps * kStages * kRingPieces * 32 * 16;
}

template <int kStages, bool kHi>
__device__ __forceinline__ void warp_pass_ring(const StreamGemmArgs& p, const uint8_t* w_lo, const uint8_t* w_hi,
                                               const float* srow, int r0, int rows, int n0, int lane, uint4* ring) {
  const int g = lane >> 2, t4 = lane & 3;
  const int chunks = p.k / kChunk;
  const PassRows pr = pass_rows<kHi>(p, r0, rows, g, t4);
  auto piece = [&](int stage, int pc) { return ring + (stage * kRingPieces + pc) * 32 + lane; };
  auto issue = [&](int c) {
    if (c < chunks) {
      const int stage = c % kStages, koff = c * kChunk;
      cp_async_16(piece(stage, 0), w_lo + koff, true);
      cp_async_16(piece(stage, 1), w_hi + koff, true);
      cp_async_16(piece(stage, 2), pr.a0 + koff, pr.ok0);
      cp_async_16(piece(stage, 3), pr.a0 + koff + 8, pr.ok0);
      if constexpr (kHi) {
        cp_async_16(piece(stage, 4), pr.a1 + koff, pr.ok1);
        cp_async_16(piece(stage, 5), pr.a1 + koff + 8, pr.ok1);
      }
    }
    cp_async_commit();  // one group per chunk, empty past the end: the wait below counts chunks
  };
#pragma unroll
  for (int c = 0; c < kStages - 1; ++c) issue(c);
  float acc0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int c = 0; c < chunks; ++c) {
    cp_async_wait<kStages - 2>();  // chunk c has landed (this lane's own copies)
    const int stage = c % kStages;
    const uint4 wl = *piece(stage, 0), wh = *piece(stage, 1);
    const uint4 t0 = *piece(stage, 2), t1 = *piece(stage, 3);
    uint32_t b0[8] = {t0.x, t0.y, t0.z, t0.w, t1.x, t1.y, t1.z, t1.w};
    uint32_t b1[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
    if constexpr (kHi) {
      const uint4 t2 = *piece(stage, 4), t3 = *piece(stage, 5);
      b1[0] = t2.x;
      b1[1] = t2.y;
      b1[2] = t2.z;
      b1[3] = t2.w;
      b1[4] = t3.x;
      b1[5] = t3.y;
      b1[6] = t3.z;
      b1[7] = t3.w;
    }
    const float sc = __ldg(srow + c * kChunk / kFp8Block);
    // Refill the stage read one chunk ago (its values are in registers and were used).
    issue(c + kStages - 1);
    mma_chunk<kHi>(acc0, acc1, wl, wh, sc, b0, b1);
  }
  cp_async_wait<0>();  // nothing of this pass in flight when the ring is reused
  store_tile(p, acc0, r0, rows, 2 * t4, n0 + g);
  if constexpr (kHi) store_tile(p, acc1, r0, rows, 8 + 2 * t4, n0 + g);
}

// kStages 0: the registers kernel (8 warps per CTA); else the ring kernel (kRingWarps per CTA).
template <int kStages>
__global__ void __launch_bounds__((kStages == 0 ? kWarps : kRingWarps) * 32) fp8_warp_grouped_kernel(StreamGemmArgs p) {
  wait_for_prior_grids();  // pdl.cuh: before any global access
  allow_dependents();
  constexpr int kCtaWarps = kStages == 0 ? kWarps : kRingWarps;
  extern __shared__ uint4 ring_smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;
  uint4* ring = ring_smem + warp * (kStages > 0 ? kStages : 1) * kRingPieces * 32;
  const int tiles_n = p.n / 16;
  const bool grouped = p.group_offsets != nullptr;
  const int groups = !grouped ? 1 : p.num_active != nullptr ? *p.num_active : p.max_groups;
  const int64_t items = static_cast<int64_t>(groups) * tiles_n;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kCtaWarps;
  for (int64_t item = blockIdx.x + static_cast<int64_t>(gridDim.x) * warp; item < items; item += stride) {
    const int y = static_cast<int>(item / tiles_n), tile = static_cast<int>(item % tiles_n);
    int group = 0, row_begin = 0, row_end = p.m;
    if (grouped) {
      group = p.active_groups != nullptr ? p.active_groups[y] : y;
      row_begin = p.group_offsets[group];
      row_end = p.group_offsets[group + 1];
    }
    const int n0 = tile * 16;
    const uint8_t* wg = static_cast<const uint8_t*>(p.w) + static_cast<int64_t>(group) * p.w_group_stride;
    const uint8_t* w_lo = wg + static_cast<int64_t>(n0 + g) * p.k + t4 * 16;
    const uint8_t* w_hi = wg + static_cast<int64_t>(n0 + 8 + g) * p.k + t4 * 16;
    // The 16 rows of an item lie in one 128-row scale block (16 | 128).
    const float* srow = p.w_scale + static_cast<int64_t>(group) * p.scale_group_stride +
                        static_cast<int64_t>(n0 / kFp8Block) * p.w_scale_ld;
    for (int r0 = row_begin; r0 < row_end; r0 += 16) {
      const int rows = min(16, row_end - r0);
      if constexpr (kStages == 0) {
        if (rows > 8) {
          warp_pass_registers<true>(p, w_lo, w_hi, srow, r0, rows, n0, lane);
        } else {
          warp_pass_registers<false>(p, w_lo, w_hi, srow, r0, rows, n0, lane);
        }
      } else {
        if (rows > 8) {
          warp_pass_ring<kStages, true>(p, w_lo, w_hi, srow, r0, rows, n0, lane, ring);
        } else {
          warp_pass_ring<kStages, false>(p, w_lo, w_hi, srow, r0, rows, n0, lane, ring);
        }
      }
    }
  }
}

constexpr int kMaxDevices = 64;

// CTAs of the kernel resident on the whole device (SMs x blocks per SM), computed once per device.
template <int kStages>
cudaError_t resident_ctas(int threads, int smem, int* out) {
  static std::atomic<int> cached[kMaxDevices];
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  if (device >= 0 && device < kMaxDevices) {
    const int v = cached[device].load(std::memory_order_relaxed);
    if (v > 0) {
      *out = v;
      return cudaSuccess;
    }
  }
  int sms = 0, per_sm = 0;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fp8_warp_grouped_kernel<kStages>, threads, smem);
  if (err != cudaSuccess) return err;
  *out = sms * (per_sm > 0 ? per_sm : 1);
  if (device >= 0 && device < kMaxDevices) cached[device].store(*out, std::memory_order_relaxed);
  return cudaSuccess;
}

template <int kStages>
cudaError_t launch_typed(const StreamGemmArgs& p, cudaStream_t stream) {
  constexpr int kCtaWarps = kStages == 0 ? kWarps : kRingWarps;
  constexpr int kSmem = kStages == 0 ? 0 : ring_smem_bytes<kStages>();
  if constexpr (kSmem > 48 * 1024) {
    const cudaError_t err = opt_in_dynamic_smem<fp8_warp_grouped_kernel<kStages>>(kSmem);
    if (err != cudaSuccess) return err;
  }
  int resident = 0;
  const cudaError_t err = resident_ctas<kStages>(kCtaWarps * 32, kSmem, &resident);
  if (err != cudaSuccess) return err;
  const int64_t max_items = static_cast<int64_t>(p.group_offsets != nullptr ? p.max_groups : 1) * (p.n / 16);
  const int64_t wanted = (max_items + kCtaWarps - 1) / kCtaWarps;
  const unsigned grid = static_cast<unsigned>(wanted < resident ? wanted : resident);
  const cudaError_t launch =
      launch_dependent(fp8_warp_grouped_kernel<kStages>, dim3(grid), dim3(kCtaWarps * 32), kSmem, stream, p);
  return launch != cudaSuccess ? launch : cudaGetLastError();
}

}  // namespace

cudaError_t launch_fp8_warp_grouped(const StreamGemmArgs& p, cudaStream_t stream) {
  if (p.n == 0 || (p.group_offsets == nullptr && p.m == 0) || p.max_groups == 0) return cudaSuccess;
  switch (p.tc_kernel) {
    case Fp8TcKernel::kWarpItemsRing4:
      return launch_typed<4>(p, stream);
    case Fp8TcKernel::kWarpItemsRing8:
      return launch_typed<8>(p, stream);
    default:
      return launch_typed<0>(p, stream);
  }
}

}  // namespace pd::kernels::cuda::detail
