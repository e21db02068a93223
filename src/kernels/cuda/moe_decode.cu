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
// Loads in flight: a lane loads 4 chunks (2 x 4 x 16 weight bytes and its tokens' activations)
// into registers, then computes them: one memory round trip per 4 chunks, 16 warps per SM (98
// registers). A per-lane cp.async ring of 4 / 8 chunks in shared memory instead was measured
// 1.2-2.2x slower (docs/perf/engine.md, 2026-12-02 03:58 UTC), as were 8 chunks in registers
// (one 8-warp CTA per SM).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <atomic>
#include <cstdint>

#include "kernels/cuda/fp8_args.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/warp_util.cuh"

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
    mma_bf16_16816(acc0, x0, x1, x2, x3, b0[2 * s], b0[2 * s + 1]);
    if constexpr (kHi) mma_bf16_16816(acc1, x0, x1, x2, x3, b1[2 * s], b1[2 * s + 1]);
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

constexpr int kDepth = 4;  // chunks per round trip

// One pass of a warp over its 16 weight rows for up to 8 (kHi: 16) tokens r0 ..: kDepth
// chunks loaded into registers, then computed.
template <bool kHi>
__device__ __forceinline__ void warp_pass(const StreamGemmArgs& p, const uint8_t* w_lo, const uint8_t* w_hi,
                                          const float* srow, int r0, int rows, int n0, int lane) {
  const int g = lane >> 2, t4 = lane & 3;
  const int chunks = p.k / kChunk;
  const PassRows pr = pass_rows<kHi>(p, r0, rows, g, t4);
  float acc0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int c = 0; c < chunks; c += kDepth) {
    uint4 wl[kDepth], wh[kDepth];
    float sc[kDepth];
#pragma unroll
    for (int u = 0; u < kDepth; ++u) {
      const bool valid = c + u < chunks;
      const int koff = (c + u) * kChunk;
      wl[u] = valid ? load_weights_16(w_lo + koff) : zero;
      wh[u] = valid ? load_weights_16(w_hi + koff) : zero;
      sc[u] = valid ? __ldg(srow + koff / kFp8Block) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kDepth; ++u) {
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

__global__ void __launch_bounds__(kWarps * 32) fp8_warp_grouped_kernel(StreamGemmArgs p) {
  wait_for_prior_grids();  // pdl.cuh: before any global access
  allow_dependents();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int tiles_n = p.n / 16;
  const bool grouped = p.group_offsets != nullptr;
  const int groups = !grouped ? 1 : p.num_active != nullptr ? *p.num_active : p.max_groups;
  const int64_t items = static_cast<int64_t>(groups) * tiles_n;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
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
      if (rows > 8) {
        warp_pass<true>(p, w_lo, w_hi, srow, r0, rows, n0, lane);
      } else {
        warp_pass<false>(p, w_lo, w_hi, srow, r0, rows, n0, lane);
      }
    }
  }
}

constexpr int kMaxDevices = 64;

// CTAs of the kernel resident on the whole device (SMs x blocks per SM), computed once per device.
cudaError_t resident_ctas(int* out) {
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
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fp8_warp_grouped_kernel, kWarps * 32, 0);
  if (err != cudaSuccess) return err;
  *out = sms * (per_sm > 0 ? per_sm : 1);
  if (device >= 0 && device < kMaxDevices) cached[device].store(*out, std::memory_order_relaxed);
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_fp8_warp_grouped(const StreamGemmArgs& p, cudaStream_t stream) {
  if (p.n == 0 || (p.group_offsets == nullptr && p.m == 0) || p.max_groups == 0) return cudaSuccess;
  int resident = 0;
  const cudaError_t err = resident_ctas(&resident);
  if (err != cudaSuccess) return err;
  const int64_t max_items = static_cast<int64_t>(p.group_offsets != nullptr ? p.max_groups : 1) * (p.n / 16);
  const int64_t wanted = (max_items + kWarps - 1) / kWarps;
  const unsigned grid = static_cast<unsigned>(wanted < resident ? wanted : resident);
  const cudaError_t launch = launch_dependent(fp8_warp_grouped_kernel, dim3(grid), dim3(kWarps * 32), 0, stream, p);
  return launch != cudaSuccess ? launch : cudaGetLastError();
}

}  // namespace pd::kernels::cuda::detail
