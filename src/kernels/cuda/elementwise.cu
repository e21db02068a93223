// Memory-bound kernels: embedding/gather, fused residual + RMSNorm, bias,
// SwiGLU, q/k-norm + RoPE + paged KV write, dummy fill. 16-byte accesses
// where the row width allows (hidden sizes are multiples of 8 for every
// supported model; dispatch.cc checks).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kernels/cuda/launch.h"
#include "kernels/cuda/pdl.cuh"

namespace pd::kernels::cuda::detail {
namespace {

constexpr int kVec = 8;  // bf16 per 16-byte access

struct alignas(16) Bf16x8 {
  __nv_bfloat162 h[4];
};

__device__ __forceinline__ void to_float8(const Bf16x8& v, float* f) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __bfloat1622float2(v.h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

__device__ __forceinline__ Bf16x8 from_float8(const float* f) {
  Bf16x8 v;
#pragma unroll
  for (int i = 0; i < 4; ++i) v.h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

__global__ void embedding_kernel(bf16* __restrict__ out, const bf16* __restrict__ table,
                                 const int32_t* __restrict__ ids, int32_t num_table_rows, int32_t hidden) {
  const int64_t row = blockIdx.x;
  const int32_t id = ids[row];
  const bool valid = id >= 0 && id < num_table_rows;
  const auto* src = reinterpret_cast<const Bf16x8*>(table + static_cast<int64_t>(valid ? id : 0) * hidden);
  auto* dst = reinterpret_cast<Bf16x8*>(out + row * hidden);
  for (int i = threadIdx.x; i < hidden / kVec; i += blockDim.x) {
    Bf16x8 v;
    if (valid) {
      v = src[i];
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) v.h[j] = __floats2bfloat162_rn(0.0f, 0.0f);
    }
    dst[i] = v;
  }
}

// One block per row; the row (<= 16384 wide) stays in registers between the
// sum-of-squares pass and the scaling pass.
constexpr int kNormThreads = 256;
constexpr int kNormMaxVecPerThread = 8;  // 256 * 8 * 8 = 16384 elements

__global__ void __launch_bounds__(kNormThreads)
    rmsnorm_kernel(bf16* out, const bf16* x, bf16* residual, const bf16* __restrict__ weight, int32_t hidden,
                   float eps) {
  wait_for_prior_grids();  // pdl.cuh: before any global access
  allow_dependents();
  const int64_t row = blockIdx.x;
  const int num_vec = hidden / kVec;
  const auto* xv = reinterpret_cast<const Bf16x8*>(x + row * hidden);
  auto* rv = residual ? reinterpret_cast<Bf16x8*>(residual + row * hidden) : nullptr;
  const auto* wv = reinterpret_cast<const Bf16x8*>(weight);
  float vals[kNormMaxVecPerThread][kVec];
  Bf16x8 weights[kNormMaxVecPerThread];  // loaded with the row, not after the reduction: one memory latency less
  float sum_sq = 0.0f;
#pragma unroll
  for (int k = 0; k < kNormMaxVecPerThread; ++k) {
    const int i = threadIdx.x + k * kNormThreads;
    if (i < num_vec) {
      weights[k] = wv[i];
      to_float8(xv[i], vals[k]);
      if (rv) {
        float r[kVec];
        to_float8(rv[i], r);
#pragma unroll
        for (int j = 0; j < kVec; ++j) r[j] += vals[k][j];
        const Bf16x8 sum = from_float8(r);
        rv[i] = sum;
        to_float8(sum, vals[k]);  // normalize what was stored, as an unfused pair would
      }
#pragma unroll
      for (int j = 0; j < kVec; ++j) sum_sq += vals[k][j] * vals[k][j];
    }
  }
  __shared__ float partial[kNormThreads / 32];
  sum_sq = warp_sum(sum_sq);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = sum_sq;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kNormThreads / 32; ++w) total += partial[w];
  const float inv_rms = rsqrtf(total / static_cast<float>(hidden) + eps);
  auto* ov = reinterpret_cast<Bf16x8*>(out + row * hidden);
#pragma unroll
  for (int k = 0; k < kNormMaxVecPerThread; ++k) {
    const int i = threadIdx.x + k * kNormThreads;
    if (i < num_vec) {
      float w[kVec];
      to_float8(weights[k], w);
      float o[kVec];
      // HF order: normalize in fp32, round to bf16, then multiply by the weight.
#pragma unroll
      for (int j = 0; j < kVec; ++j) o[j] = __bfloat162float(__float2bfloat16(vals[k][j] * inv_rms)) * w[j];
      ov[i] = from_float8(o);
    }
  }
}

__global__ void add_bias_kernel(bf16* x, const bf16* __restrict__ bias, int32_t width) {
  wait_for_prior_grids();  // pdl.cuh: before any global access
  allow_dependents();
  const int64_t row = blockIdx.y;
  auto* xv = reinterpret_cast<Bf16x8*>(x + row * width);
  const auto* bv = reinterpret_cast<const Bf16x8*>(bias);
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= width / kVec) return;
  float a[kVec], b[kVec];
  to_float8(xv[i], a);
  to_float8(bv[i], b);
#pragma unroll
  for (int j = 0; j < kVec; ++j) a[j] += b[j];
  xv[i] = from_float8(a);
}

__global__ void silu_mul_kernel(bf16* __restrict__ out, const bf16* __restrict__ gate_up, int32_t intermediate) {
  wait_for_prior_grids();  // pdl.cuh: before any global access
  allow_dependents();
  const int64_t row = blockIdx.y;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= intermediate / kVec) return;
  const auto* gv = reinterpret_cast<const Bf16x8*>(gate_up + row * 2 * intermediate);
  const auto* uv = reinterpret_cast<const Bf16x8*>(gate_up + row * 2 * intermediate + intermediate);
  float g[kVec], u[kVec], o[kVec];
  to_float8(gv[i], g);
  to_float8(uv[i], u);
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    // HF rounds silu(gate) to bf16 before the product.
    const float s = __bfloat162float(__float2bfloat16(g[j] / (1.0f + __expf(-g[j]))));
    o[j] = s * u[j];
  }
  reinterpret_cast<Bf16x8*>(out + row * intermediate)[i] = from_float8(o);
}

// One warp per (token, head). Lane l owns the rotate-half pairs
// (i, i + D/2) for i in [l * P, l * P + P), P = D / 64 pairs... see kPairs.
constexpr int kRopeWarps = 8;

template <int kHeadDim>
__global__ void __launch_bounds__(kRopeWarps * 32) rope_kv_kernel(RopeKvArgs a) {
  wait_for_prior_grids();  // pdl.cuh: before any global access
  allow_dependents();
  constexpr int kHalf = kHeadDim / 2;
  constexpr int kPairs = kHalf / 32;  // pairs per lane: 1 (D=64) or 2 (D=128)
  const int t = blockIdx.x;
  const int head = blockIdx.y * kRopeWarps + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  const int num_heads = a.num_q_heads + 2 * a.num_kv_heads;
  if (head >= num_heads) return;
  const int qkv_width = num_heads * kHeadDim;
  const bf16* src = a.qkv + static_cast<int64_t>(t) * qkv_width + head * kHeadDim;
  const bool is_q = head < a.num_q_heads;
  const bool is_k = !is_q && head < a.num_q_heads + a.num_kv_heads;
  const bf16* norm_w = is_q ? a.q_norm_weight : is_k ? a.k_norm_weight : nullptr;
  // Every load that does not depend on another is issued here, together, so the kernel
  // waits for memory once rather than once per step (it is latency-bound at decode).
  float lo[kPairs], hi[kPairs], norm_lo[kPairs], norm_hi[kPairs], freq[kPairs];
#pragma unroll
  for (int p = 0; p < kPairs; ++p) {
    const int i = lane * kPairs + p;
    lo[p] = __bfloat162float(src[i]);
    hi[p] = __bfloat162float(src[i + kHalf]);
    norm_lo[p] = norm_w != nullptr ? __bfloat162float(norm_w[i]) : 1.0f;
    norm_hi[p] = norm_w != nullptr ? __bfloat162float(norm_w[i + kHalf]) : 1.0f;
    freq[p] = a.inv_freq[i];
  }
  const float pos = static_cast<float>(a.positions[t]);
  const int slot = is_q ? 0 : a.slot_mapping[t];
  if (is_q || is_k) {
    if (norm_w != nullptr) {
      float ss = 0.0f;
#pragma unroll
      for (int p = 0; p < kPairs; ++p) ss += lo[p] * lo[p] + hi[p] * hi[p];
      ss = warp_sum(ss);
      const float inv_rms = rsqrtf(ss / kHeadDim + a.norm_eps);
#pragma unroll
      for (int p = 0; p < kPairs; ++p) {
        // Rounded to bf16 like HF's q_norm/k_norm output, then rotated.
        lo[p] = __bfloat162float(__float2bfloat16(__bfloat162float(__float2bfloat16(lo[p] * inv_rms)) * norm_lo[p]));
        hi[p] = __bfloat162float(__float2bfloat16(__bfloat162float(__float2bfloat16(hi[p] * inv_rms)) * norm_hi[p]));
      }
    }
#pragma unroll
    for (int p = 0; p < kPairs; ++p) {
      float s, c;
      sincosf(pos * freq[p], &s, &c);
      const float x1 = lo[p], x2 = hi[p];
      lo[p] = x1 * c - x2 * s;
      hi[p] = x2 * c + x1 * s;
    }
  }
  bf16* dst;
  if (is_q) {
    dst = a.q_out + (static_cast<int64_t>(t) * a.num_q_heads + head) * kHeadDim;
  } else if (a.kv_fp8) {
    if (slot < 0) return;
    const int block = slot / a.block_size;
    const int offset = slot % a.block_size;
    const int kv_head = is_k ? head - a.num_q_heads : head - a.num_q_heads - a.num_kv_heads;
    const int64_t codes = static_cast<int64_t>(a.block_size) * a.num_kv_heads * kHeadDim;  // per K or V
    uint8_t* base = reinterpret_cast<uint8_t*>(a.kv_cache) +
                    block * (2 * codes + 2LL * a.block_size * a.num_kv_heads * static_cast<int64_t>(sizeof(float)));
    const int64_t row = static_cast<int64_t>(offset) * a.num_kv_heads + kv_head;
    float amax = 0.0f;
#pragma unroll
    for (int p = 0; p < kPairs; ++p) {
      lo[p] = __bfloat162float(__float2bfloat16(lo[p]));
      hi[p] = __bfloat162float(__float2bfloat16(hi[p]));
      amax = fmaxf(amax, fmaxf(fabsf(lo[p]), fabsf(hi[p])));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
    uint8_t* code = base + (is_k ? 0 : codes) + row * kHeadDim;
#pragma unroll
    for (int p = 0; p < kPairs; ++p) {
      const int i = lane * kPairs + p;
      code[i] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(lo[p] / scale, __NV_SATFINITE, __NV_E4M3));
      code[i + kHalf] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(hi[p] / scale, __NV_SATFINITE, __NV_E4M3));
    }
    if (lane == 0) {
      float* scales = reinterpret_cast<float*>(base + 2 * codes);
      scales[(is_k ? 0 : static_cast<int64_t>(a.block_size) * a.num_kv_heads) + row] = scale;
    }
    return;
  } else {
    if (slot < 0) return;
    const int block = slot / a.block_size;
    const int offset = slot % a.block_size;
    const int kv_head = is_k ? head - a.num_q_heads : head - a.num_q_heads - a.num_kv_heads;
    const int64_t block_elems = 2LL * a.block_size * a.num_kv_heads * kHeadDim;
    dst = a.kv_cache + block * block_elems + (is_k ? 0 : block_elems / 2) +
          (static_cast<int64_t>(offset) * a.num_kv_heads + kv_head) * kHeadDim;
  }
#pragma unroll
  for (int p = 0; p < kPairs; ++p) {
    const int i = lane * kPairs + p;
    dst[i] = __float2bfloat16(lo[p]);
    dst[i + kHalf] = __float2bfloat16(hi[p]);
  }
}

__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__global__ void fill_uniform_kernel(bf16* out, size_t n, uint64_t seed, float scale) {
  const uint64_t key = mix64(seed);
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint64_t h = mix64(key ^ i);
    const float u = static_cast<float>(h >> 40) * 0x1.0p-24f;  // [0, 1)
    out[i] = __float2bfloat16((2.0f * u - 1.0f) * scale);
  }
}

}  // namespace

cudaError_t launch_embedding(bf16* out, const bf16* table, const int32_t* ids, int32_t num_rows, int32_t num_table_rows,
                             int32_t hidden, cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  embedding_kernel<<<num_rows, 128, 0, stream>>>(out, table, ids, num_table_rows, hidden);
  return cudaGetLastError();
}

cudaError_t launch_rmsnorm(bf16* out, const bf16* x, bf16* residual, const bf16* weight, int32_t num_rows,
                           int32_t hidden, float eps, cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  const cudaError_t err = launch_dependent(rmsnorm_kernel, dim3(num_rows), dim3(kNormThreads), 0, stream, out, x,
                                           residual, weight, hidden, eps);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

cudaError_t launch_add_bias(bf16* x, const bf16* bias, int32_t num_rows, int32_t width, cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  const int vecs = width / kVec;
  const cudaError_t err =
      launch_dependent(add_bias_kernel, dim3((vecs + 127) / 128, num_rows), dim3(128), 0, stream, x, bias, width);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

cudaError_t launch_silu_mul(bf16* out, const bf16* gate_up, int32_t num_rows, int32_t intermediate,
                            cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  const int vecs = intermediate / kVec;
  const cudaError_t err = launch_dependent(silu_mul_kernel, dim3((vecs + 127) / 128, num_rows), dim3(128), 0, stream,
                                           out, gate_up, intermediate);
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

cudaError_t launch_rope_kv(const RopeKvArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0) return cudaSuccess;
  const int num_heads = args.num_q_heads + 2 * args.num_kv_heads;
  const dim3 grid(args.num_tokens, (num_heads + kRopeWarps - 1) / kRopeWarps);
  if (args.head_dim == 128) {
    const cudaError_t err = launch_dependent(rope_kv_kernel<128>, grid, dim3(kRopeWarps * 32), 0, stream, args);
    if (err != cudaSuccess) return err;
  } else {
    const cudaError_t err = launch_dependent(rope_kv_kernel<64>, grid, dim3(kRopeWarps * 32), 0, stream, args);
    if (err != cudaSuccess) return err;
  }
  return cudaGetLastError();
}

cudaError_t launch_fill_uniform(bf16* out, size_t n, uint64_t seed, float scale, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  fill_uniform_kernel<<<1024, 256, 0, stream>>>(out, n, seed, scale);
  return cudaGetLastError();
}

}  // namespace pd::kernels::cuda::detail
