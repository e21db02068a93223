// Per-row sampling on the GPU with the CPU sampler's semantics
// (engine/sampler.cc) for greedy, temperature and min-p: suppression to -inf
// (undone when nothing would remain), argmax with ties to the lower id, and
// otherwise an inverse CDF over the kept tokens in id order with
// u = uniform_from_seed(rng_seed) * total. One 1024-thread CTA per row; the
// row is split into contiguous per-thread chunks so the CDF walk is a block
// scan of chunk sums plus one chunk walk by the owning thread.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cfloat>
#include <cmath>

#include "kernels/cuda/launch.h"

namespace pd::kernels::cuda::detail {
namespace {

constexpr int kSampleThreads = 1024;

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

struct ArgMax {
  float value;
  int32_t id;
};
struct ArgMaxOp {
  __device__ ArgMax operator()(const ArgMax& a, const ArgMax& b) const {
    if (a.value != b.value) return a.value > b.value ? a : b;
    return a.id < b.id ? a : b;
  }
};
struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct MaxIntOp {
  __device__ int32_t operator()(int32_t a, int32_t b) const { return a > b ? a : b; }
};

__global__ void __launch_bounds__(kSampleThreads)
    sample_rows_kernel(float* logits, int32_t vocab, const RowSampling* params, const int32_t* suppressed_ids,
                       int32_t* tokens, float* logprobs) {
  using ReduceF = cub::BlockReduce<float, kSampleThreads>;
  using ReduceD = cub::BlockReduce<double, kSampleThreads>;
  using ReduceA = cub::BlockReduce<ArgMax, kSampleThreads>;
  using ReduceI = cub::BlockReduce<int32_t, kSampleThreads>;
  using ScanD = cub::BlockScan<double, kSampleThreads>;
  __shared__ union {
    typename ReduceF::TempStorage f;
    typename ReduceD::TempStorage d;
    typename ReduceA::TempStorage a;
    typename ReduceI::TempStorage i;
    typename ScanD::TempStorage s;
  } tmp;
  __shared__ float s_float;
  __shared__ double s_double;
  __shared__ ArgMax s_argmax;
  __shared__ int32_t s_token;
  __shared__ float s_saved[kMaxSuppressedPerRow];

  const int row = blockIdx.x;
  float* x = logits + static_cast<int64_t>(row) * vocab;
  const RowSampling p = params[row];
  const int tid = threadIdx.x;

  // Raw log-normalizer for the logprob of the pick.
  float local_max = -INFINITY;
  for (int i = tid; i < vocab; i += kSampleThreads) local_max = fmaxf(local_max, x[i]);
  float block_max = ReduceF(tmp.f).Reduce(local_max, MaxOp());
  if (tid == 0) s_float = block_max;
  __syncthreads();
  const float raw_max = s_float;
  float local_sum = 0.0f;
  for (int i = tid; i < vocab; i += kSampleThreads) local_sum += __expf(x[i] - raw_max);
  __syncthreads();
  const float block_sum = ReduceF(tmp.f).Sum(local_sum);
  if (tid == 0) s_float = raw_max + logf(block_sum);
  __syncthreads();
  const float log_norm = s_float;

  const int num_supp = min(p.suppressed_end - p.suppressed_begin, kMaxSuppressedPerRow);
  if (tid == 0) {
    for (int j = 0; j < num_supp; ++j) {
      const int id = suppressed_ids[p.suppressed_begin + j];
      if (id < 0 || id >= vocab) continue;
      s_saved[j] = x[id];
      x[id] = -INFINITY;
    }
  }
  __syncthreads();
  ArgMax local{-INFINITY, vocab};
  for (int i = tid; i < vocab; i += kSampleThreads) {
    if (x[i] > local.value) local = ArgMax{x[i], i};
  }
  ArgMax best = ReduceA(tmp.a).Reduce(local, ArgMaxOp());
  if (tid == 0) {
    if (best.value == -INFINITY && num_supp > 0) {
      // Everything suppressed: undo in reverse so a repeated id gets its original value.
      for (int j = num_supp - 1; j >= 0; --j) {
        const int id = suppressed_ids[p.suppressed_begin + j];
        if (id >= 0 && id < vocab) x[id] = s_saved[j];
      }
    }
    s_argmax = best;
  }
  __syncthreads();
  if (s_argmax.value == -INFINITY && num_supp > 0) {
    local = ArgMax{-INFINITY, vocab};
    for (int i = tid; i < vocab; i += kSampleThreads) {
      if (x[i] > local.value) local = ArgMax{x[i], i};
    }
    __syncthreads();
    best = ReduceA(tmp.a).Reduce(local, ArgMaxOp());
    if (tid == 0) s_argmax = best;
    __syncthreads();
  }
  // All -inf: the CPU sampler's argmax returns id 0.
  const int32_t argmax_id = s_argmax.id < vocab ? s_argmax.id : 0;
  const float max_value = s_argmax.value;

  int32_t token = argmax_id;
  if (p.temperature > 0.0f && max_value != -INFINITY) {
    const float inv_t = 1.0f / p.temperature;
    const float min_scaled = p.min_p > 0.0f ? logf(p.min_p) : -INFINITY;
    const int chunk = (vocab + kSampleThreads - 1) / kSampleThreads;
    const int begin = min(vocab, tid * chunk);
    const int end = min(vocab, begin + chunk);
    double mass = 0.0;
    int32_t last_kept = -1;
    for (int i = begin; i < end; ++i) {
      const float v = x[i];
      if (v == -INFINITY) continue;
      const float sv = (v - max_value) * inv_t;
      if (sv < min_scaled) continue;
      mass += static_cast<double>(expf(sv));
      last_kept = i;
    }
    double prefix = 0.0, total = 0.0;
    __syncthreads();
    ScanD(tmp.s).ExclusiveSum(mass, prefix, total);
    __syncthreads();
    const int32_t block_last = ReduceI(tmp.i).Reduce(last_kept, MaxIntOp());
    if (tid == 0) {
      s_token = block_last;
      s_double = static_cast<double>(splitmix64(p.rng_seed) >> 11) * 0x1.0p-53 * total;
    }
    __syncthreads();
    const double u = s_double;
    __syncthreads();
    if (mass > 0.0 && u >= prefix && u < prefix + mass) {
      double cumulative = prefix;
      int32_t pick = last_kept;
      for (int i = begin; i < end; ++i) {
        const float v = x[i];
        if (v == -INFINITY) continue;
        const float sv = (v - max_value) * inv_t;
        if (sv < min_scaled) continue;
        cumulative += static_cast<double>(expf(sv));
        if (u < cumulative) {
          pick = i;
          break;
        }
      }
      s_token = pick;
    }
    __syncthreads();
    token = s_token >= 0 ? s_token : argmax_id;
  }
  if (tid == 0) {
    tokens[row] = token;
    logprobs[row] = x[token] - log_norm;
  }
}

}  // namespace

cudaError_t launch_sample_rows(float* logits, int32_t num_rows, int32_t vocab, const RowSampling* params,
                               const int32_t* suppressed_ids, int32_t* tokens, float* logprobs, cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  sample_rows_kernel<<<num_rows, kSampleThreads, 0, stream>>>(logits, vocab, params, suppressed_ids, tokens, logprobs);
  return cudaGetLastError();
}

}  // namespace pd::kernels::cuda::detail
