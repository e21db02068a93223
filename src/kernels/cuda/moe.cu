// MoE routing kernels: softmax + top-k (+ renormalization) of the router logits, the
// sort of (token, choice) pairs by expert (counts, offsets, active experts, permutation),
// and the weighted un-permutation (each token's top-k expert outputs summed with their
// routing weights, no atomics, so the sum order is fixed).
#include <cuda_bf16.h>

#include <cfloat>
#include <cstdint>

#include "kernels/cuda/fp8_args.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/pdl.cuh"

namespace pd::kernels::cuda::detail {
namespace {

constexpr int kRouteWarps = 4;
constexpr int kMaxPerLane = kMoeMaxExperts / 32;

// One warp per token. Softmax in fp32 over the expert logits, then top_k rounds of a
// warp-wide argmax (ties to the lower expert id, as torch.topk on equal values is not
// specified; the CPU reference uses the same rule); the weights are the softmax
// probabilities, divided by their sum over the chosen experts when renormalize is set.
__device__ __forceinline__ void route_token(const float* __restrict__ logits, int t, int32_t num_experts, int32_t top_k,
                                            bool renormalize, int32_t* __restrict__ topk_ids,
                                            float* __restrict__ topk_weights) {
  const int lane = threadIdx.x % 32;
  const float* row = logits + static_cast<int64_t>(t) * num_experts;
  float v[kMaxPerLane];
  float mx = -FLT_MAX;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int e = i * 32 + lane;
    v[i] = e < num_experts ? row[e] : -FLT_MAX;
    mx = fmaxf(mx, v[i]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int e = i * 32 + lane;
    v[i] = e < num_experts ? __expf(v[i] - mx) : -1.0f;  // probabilities are >= 0; -1 marks "none"
    sum += e < num_experts ? v[i] : 0.0f;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const float inv_sum = 1.0f / sum;
  float chosen_sum = 0.0f;
  float my_weight = 0.0f;  // lane j < top_k keeps choice j
  int my_id = 0;
  for (int j = 0; j < top_k; ++j) {
    float best = -2.0f;
    int best_e = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int e = i * 32 + lane;
      if (v[i] > best) {  // ascending e per lane: the first max is the lowest id
        best = v[i];
        best_e = e;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, o);
      const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
      if (ob > best || (ob == best && oe < best_e)) {
        best = ob;
        best_e = oe;
      }
    }
    const float p = best * inv_sum;
    chosen_sum += p;
    if (lane == j) {
      my_weight = p;
      my_id = best_e;
    }
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      if (i * 32 + lane == best_e) v[i] = -1.0f;
    }
  }
  if (lane < top_k) {
    topk_ids[static_cast<int64_t>(t) * top_k + lane] = my_id;
    topk_weights[static_cast<int64_t>(t) * top_k + lane] = renormalize ? my_weight / chosen_sum : my_weight;
  }
}

__global__ void __launch_bounds__(kRouteWarps * 32)
    moe_route_kernel(const float* __restrict__ logits, int32_t num_tokens, int32_t num_experts, int32_t top_k,
                     bool renormalize, int32_t* __restrict__ topk_ids, float* __restrict__ topk_weights) {
  wait_for_prior_grids();  // pdl.cuh: before any global access
  allow_dependents();
  const int t = blockIdx.x * kRouteWarps + threadIdx.x / 32;
  if (t >= num_tokens) return;
  route_token(logits, t, num_experts, top_k, renormalize, topk_ids, topk_weights);
}

constexpr int kAlignThreads = 1024;

// One CTA: histogram of the expert ids, offsets (plain, and of the cuBLASLt rows per expert),
// the ascending list of experts with rows, then each (token, choice) pair takes a row of
// its expert's range through a shared-memory cursor. The order of rows within an expert
// depends on the atomics' order; no result does (every GEMM row is computed on its own and
// moe_combine sums in choice order through slot_of_choice).
__device__ __forceinline__ void align_pairs(const int32_t* __restrict__ topk_ids, int32_t num_pairs, int32_t top_k,
                                            int32_t num_experts, const MoeRouting& r) {
  __shared__ int32_t counts[kMoeMaxExperts];
  __shared__ int32_t offsets[kMoeMaxExperts + 1];
  __shared__ int32_t cursor[kMoeMaxExperts];
  for (int e = threadIdx.x; e < num_experts; e += kAlignThreads) counts[e] = 0;
  __syncthreads();
  for (int i = threadIdx.x; i < num_pairs; i += kAlignThreads) {
    const int e = topk_ids[i];
    if (e >= 0 && e < num_experts) atomicAdd(&counts[e], 1);
  }
  __syncthreads();
  // Offsets, padded offsets and the active list: warp 0, each lane a run of consecutive
  // experts, exclusive prefix sums over the lanes by shuffles.
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const int per = (num_experts + 31) / 32, e0 = lane * per, e1 = min(num_experts, e0 + per);
    int acc = 0, padded = 0, active = 0;
    for (int e = e0; e < e1; ++e) {
      acc += counts[e];
      padded += fp8_cublas_rows(counts[e]);
      active += counts[e] > 0 ? 1 : 0;
    }
    int acc_in = acc, padded_in = padded, active_in = active;  // inclusive scans
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int a = __shfl_up_sync(0xffffffffu, acc_in, o), p = __shfl_up_sync(0xffffffffu, padded_in, o),
                c = __shfl_up_sync(0xffffffffu, active_in, o);
      if (lane >= o) {
        acc_in += a;
        padded_in += p;
        active_in += c;
      }
    }
    acc = acc_in - acc;
    padded = padded_in - padded;
    active = active_in - active;
    for (int e = e0; e < e1; ++e) {
      offsets[e] = acc;
      r.expert_offsets[e] = acc;
      r.padded_offsets[e] = padded;
      if (counts[e] > 0) r.active_experts[active++] = e;
      acc += counts[e];
      padded += fp8_cublas_rows(counts[e]);
    }
    const int total = __shfl_sync(0xffffffffu, acc_in, 31), total_padded = __shfl_sync(0xffffffffu, padded_in, 31),
              total_active = __shfl_sync(0xffffffffu, active_in, 31);
    if (lane == 0) {
      offsets[num_experts] = total;
      r.expert_offsets[num_experts] = total;
      r.padded_offsets[num_experts] = total_padded;
      *r.num_active = total_active;
    }
    for (int e = total_active + lane; e < num_experts; e += 32) r.active_experts[e] = -1;
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += kAlignThreads) cursor[e] = offsets[e];
  __syncthreads();
  const int lane = threadIdx.x % 32;
  for (int base = 0; base < num_pairs; base += kAlignThreads) {
    const int i = base + threadIdx.x;
    const int e = i < num_pairs ? topk_ids[i] : -1;
    const bool valid = e >= 0 && e < num_experts;
    // One atomic per (warp, expert): the lanes of a warp with the same expert take
    // consecutive rows in lane order.
    const unsigned same = __match_any_sync(0xffffffffu, valid ? e : -1);
    const int leader = __ffs(same) - 1;
    const int rank = __popc(same & ((1u << lane) - 1));
    int start = 0;
    if (valid && lane == leader) start = atomicAdd(&cursor[e], __popc(same));
    start = __shfl_sync(same, start, leader);
    if (valid) {
      const int pos = start + rank;
      r.sorted_token[pos] = i / top_k;
      r.slot_of_choice[i] = pos;
    }
  }
}

__global__ void __launch_bounds__(kAlignThreads)
    moe_align_kernel(const int32_t* __restrict__ topk_ids, int32_t num_pairs, int32_t top_k, int32_t num_experts,
                     MoeRouting r) {
  wait_for_prior_grids();  // pdl.cuh: before any global access
  allow_dependents();
  align_pairs(topk_ids, num_pairs, top_k, num_experts, r);
}

// out[t][:] (+)= sum_j weights[t * top_k + j] * y[slot_of_choice[t * top_k + j]][:], fp32 sum in
// choice order, 8 columns per thread.
__global__ void moe_combine_kernel(bf16* __restrict__ out, const bf16* __restrict__ y,
                                   const int32_t* __restrict__ slot_of_choice, const float* __restrict__ weights,
                                   int32_t top_k, int32_t hidden, bool accumulate) {
  wait_for_prior_grids();  // pdl.cuh: before any global access
  allow_dependents();
  const int t = blockIdx.y;
  const int c = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
  if (c >= hidden) return;
  float acc[8];
  bf16* o = out + static_cast<int64_t>(t) * hidden + c;
  if (accumulate) {
    const uint4 v = *reinterpret_cast<const uint4*>(o);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc[2 * i] = __uint_as_float(w[i] << 16);
      acc[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
  }
  for (int j = 0; j < top_k; ++j) {
    const int slot = slot_of_choice[t * top_k + j];
    const float wt = weights[t * top_k + j];
    const uint4 v = *reinterpret_cast<const uint4*>(y + static_cast<int64_t>(slot) * hidden + c);
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc[2 * i] = fmaf(wt, __uint_as_float(w[i] << 16), acc[2 * i]);
      acc[2 * i + 1] = fmaf(wt, __uint_as_float(w[i] & 0xffff0000u), acc[2 * i + 1]);
    }
  }
  uint4 packed;
  uint32_t* pw = reinterpret_cast<uint32_t*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 b = __floats2bfloat162_rn(acc[2 * i], acc[2 * i + 1]);
    pw[i] = *reinterpret_cast<const uint32_t*>(&b);
  }
  *reinterpret_cast<uint4*>(o) = packed;
}

}  // namespace

cudaError_t launch_moe_route(const float* logits, int32_t num_tokens, int32_t num_experts, int32_t top_k,
                             bool renormalize, int32_t* topk_ids, float* topk_weights, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  const cudaError_t err =
      launch_dependent(moe_route_kernel, dim3((num_tokens + kRouteWarps - 1) / kRouteWarps), dim3(kRouteWarps * 32), 0,
                       stream, logits, num_tokens, num_experts, top_k, renormalize, topk_ids, topk_weights);
  return err != cudaSuccess ? err : cudaGetLastError();
}

cudaError_t launch_moe_align(const int32_t* topk_ids, int32_t num_tokens, int32_t top_k, int32_t num_experts,
                             const MoeRouting& routing, cudaStream_t stream) {
  const cudaError_t err = launch_dependent(moe_align_kernel, dim3(1), dim3(kAlignThreads), 0, stream, topk_ids,
                                           num_tokens * top_k, top_k, num_experts, routing);
  return err != cudaSuccess ? err : cudaGetLastError();
}

cudaError_t launch_moe_combine(bf16* out, const bf16* y, const int32_t* slot_of_choice, const float* weights,
                               int32_t num_tokens, int32_t top_k, int32_t hidden, bool accumulate,
                               cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  const int threads = 128;
  const dim3 grid((hidden / 8 + threads - 1) / threads, num_tokens);
  const cudaError_t err = launch_dependent(moe_combine_kernel, grid, dim3(threads), 0, stream, out, y, slot_of_choice,
                                           weights, top_k, hidden, accumulate);
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace pd::kernels::cuda::detail
