// Attention over the FP8 KV cache (layout: RopeKvArgs::kv_fp8, engine/README.md).
//
// Decode: split-K over the context like the bf16 kernels; one CTA = (partition, kv head,
// sequence), 4 warps, each warp taking 32-token chunks (two blocks) of the partition in turn.
// Scores: lane t of a warp owns token t of the chunk and reads its whole K row (16-byte
// loads), the GQA group's queries come from shared memory (broadcast), so a score needs no
// cross-lane reduction; the K scale multiplies the dot product. Softmax: online per head,
// a warp max / sum per chunk. Values: lane l owns head dims [l * D/32, (l + 1) * D/32) and
// walks the chunk's tokens, with p * v_scale of each (token, head) from shared memory, so the
// V scale costs nothing per element. Partials (log2-sum-exp and output per q head and
// partition) are merged by decode_fp8_reduce_kernel, the bf16 path's workspace layout.
// Prefill: the blocks a step reads are dequantized to bf16 (kv_fp8_to_bf16_blocks) and
// the bf16 prefill kernel runs on them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cfloat>
#include <cstdint>

#include "kernels/cuda/launch.h"

namespace pd::kernels::cuda::detail {
namespace {

constexpr int kFp8DecodeWarps = 4;
constexpr int kChunk = 32;  // tokens per warp step
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ float2 fp8x2_to_float2_kv(uint32_t bits16) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(bits16), __NV_E4M3);
  return __half22float2(__half2(h));
}

struct Fp8KvLayout {
  int64_t codes;        // bytes of K (or V) codes per block
  int64_t block_bytes;  // codes * 2 + scales
  int64_t scales_per_tensor;
};

__device__ __forceinline__ Fp8KvLayout fp8_kv_layout(const AttentionArgs& a) {
  Fp8KvLayout l;
  l.codes = static_cast<int64_t>(a.block_size) * a.num_kv_heads * a.head_dim;
  l.scales_per_tensor = static_cast<int64_t>(a.block_size) * a.num_kv_heads;
  l.block_bytes = 2 * l.codes + 2 * l.scales_per_tensor * static_cast<int64_t>(sizeof(float));
  return l;
}

template <int kHeadDim, int kMaxGroup>
__global__ void __launch_bounds__(kFp8DecodeWarps * 32)
    decode_fp8_kernel(AttentionArgs a, float* __restrict__ part_lse, float* __restrict__ part_out,
                      int32_t num_partitions) {
  constexpr int kPer = kHeadDim / 32;  // V dims per lane
  __shared__ float q_s[kMaxGroup][kHeadDim];
  __shared__ float p_s[kFp8DecodeWarps][kMaxGroup][kChunk];
  __shared__ int64_t row_s[kFp8DecodeWarps][kChunk];
  __shared__ float m_s[kFp8DecodeWarps][kMaxGroup], l_s[kFp8DecodeWarps][kMaxGroup];
  __shared__ float acc_s[kFp8DecodeWarps][kMaxGroup][kHeadDim];
  const int part = blockIdx.x, kv_head = blockIdx.y, seq = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = a.num_q_heads / a.num_kv_heads;
  const int ctx = a.context_lens[seq];
  const int part_begin = part * a.decode_partition_tokens;
  if (part_begin >= ctx) return;  // the reduce reads only partitions below the context
  const int part_end = min(ctx, part_begin + a.decode_partition_tokens);
  const int q_row = a.query_start[seq];
  const float qscale = a.scale * kLog2e;
  for (int i = threadIdx.x; i < group * kHeadDim; i += kFp8DecodeWarps * 32) {
    const int h = i / kHeadDim, d = i % kHeadDim;
    q_s[h][d] =
        __bfloat162float(a.q[(static_cast<int64_t>(q_row) * a.num_q_heads + kv_head * group + h) * kHeadDim + d]) *
        qscale;
  }
  __syncthreads();
  const Fp8KvLayout lay = fp8_kv_layout(a);
  const auto* cache = reinterpret_cast<const uint8_t*>(a.kv_cache);
  const int32_t* table = a.block_tables + static_cast<int64_t>(seq) * a.max_blocks_per_seq;
  float m[kMaxGroup], l[kMaxGroup], acc[kMaxGroup][kPer];
#pragma unroll
  for (int h = 0; h < kMaxGroup; ++h) {
    m[h] = -FLT_MAX;
    l[h] = 0.0f;
#pragma unroll
    for (int j = 0; j < kPer; ++j) acc[h][j] = 0.0f;
  }
  for (int c0 = part_begin + warp * kChunk; c0 < part_end; c0 += kFp8DecodeWarps * kChunk) {
    // Scores: lane = token.
    const int pos = c0 + lane;
    const bool valid = pos < part_end;
    int64_t block_base = 0, row = 0;
    float s[kMaxGroup];
    float v_scale = 0.0f;
    if (valid) {
      const int block = table[pos / a.block_size];
      block_base = static_cast<int64_t>(block) * lay.block_bytes;
      row = static_cast<int64_t>(pos % a.block_size) * a.num_kv_heads + kv_head;
      const uint8_t* k_row = cache + block_base + row * kHeadDim;
      const float k_scale = *reinterpret_cast<const float*>(cache + block_base + 2 * lay.codes + row * 4);
      v_scale = *reinterpret_cast<const float*>(cache + block_base + 2 * lay.codes + (lay.scales_per_tensor + row) * 4);
      uint4 kv[kHeadDim / 16];
#pragma unroll
      for (int i = 0; i < kHeadDim / 16; ++i) kv[i] = *reinterpret_cast<const uint4*>(k_row + i * 16);
#pragma unroll
      for (int h = 0; h < kMaxGroup; ++h) s[h] = 0.0f;
#pragma unroll
      for (int i = 0; i < kHeadDim / 16; ++i) {
        const uint32_t w[4] = {kv[i].x, kv[i].y, kv[i].z, kv[i].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 f0 = fp8x2_to_float2_kv(w[j] & 0xffffu);
          const float2 f1 = fp8x2_to_float2_kv(w[j] >> 16);
          const int d = i * 16 + j * 4;
#pragma unroll
          for (int h = 0; h < kMaxGroup; ++h) {
            if (h < group) {
              const float4 q4 = *reinterpret_cast<const float4*>(&q_s[h][d]);
              s[h] = fmaf(q4.x, f0.x, fmaf(q4.y, f0.y, fmaf(q4.z, f1.x, fmaf(q4.w, f1.y, s[h]))));
            }
          }
        }
      }
#pragma unroll
      for (int h = 0; h < kMaxGroup; ++h) s[h] *= k_scale;
    } else {
#pragma unroll
      for (int h = 0; h < kMaxGroup; ++h) s[h] = -FLT_MAX;
    }
    row_s[warp][lane] = valid ? block_base + lay.codes + row * kHeadDim : -1;
#pragma unroll
    for (int h = 0; h < kMaxGroup; ++h) {
      if (h >= group) break;
      float mx = s[h];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_new = fmaxf(m[h], mx);
      const float p = valid ? exp2f(s[h] - m_new) : 0.0f;
      float sum = p;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      const float corr = exp2f(m[h] - m_new);
      l[h] = l[h] * corr + sum;
      m[h] = m_new;
#pragma unroll
      for (int j = 0; j < kPer; ++j) acc[h][j] *= corr;
      p_s[warp][h][lane] = p * v_scale;
    }
    __syncwarp();
    // Values: lane = head dims.
    const int n = min(kChunk, part_end - c0);
    for (int t = 0; t < n; ++t) {
      const uint8_t* v_row = cache + row_s[warp][t] + lane * kPer;
      float v[kPer];
      if constexpr (kPer == 4) {
        const uint32_t w = *reinterpret_cast<const uint32_t*>(v_row);
        const float2 f0 = fp8x2_to_float2_kv(w & 0xffffu), f1 = fp8x2_to_float2_kv(w >> 16);
        v[0] = f0.x;
        v[1] = f0.y;
        v[2] = f1.x;
        v[3] = f1.y;
      } else {
        const float2 f0 = fp8x2_to_float2_kv(*reinterpret_cast<const uint16_t*>(v_row));
        v[0] = f0.x;
        v[1] = f0.y;
      }
#pragma unroll
      for (int h = 0; h < kMaxGroup; ++h) {
        if (h < group) {
          const float p = p_s[warp][h][t];
#pragma unroll
          for (int j = 0; j < kPer; ++j) acc[h][j] = fmaf(p, v[j], acc[h][j]);
        }
      }
    }
    __syncwarp();
  }
  // Merge the warps.
#pragma unroll
  for (int h = 0; h < kMaxGroup; ++h) {
    if (h < group) {
      if (lane == 0) {
        m_s[warp][h] = m[h];
        l_s[warp][h] = l[h];
      }
#pragma unroll
      for (int j = 0; j < kPer; ++j) acc_s[warp][h][lane * kPer + j] = acc[h][j];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < group * kHeadDim; idx += kFp8DecodeWarps * 32) {
    const int h = idx / kHeadDim, d = idx % kHeadDim;
    float mm = -FLT_MAX;
#pragma unroll
    for (int w = 0; w < kFp8DecodeWarps; ++w) mm = fmaxf(mm, m_s[w][h]);
    float sum = 0.0f, out = 0.0f;
#pragma unroll
    for (int w = 0; w < kFp8DecodeWarps; ++w) {
      const float f = m_s[w][h] == -FLT_MAX ? 0.0f : exp2f(m_s[w][h] - mm);
      sum += l_s[w][h] * f;
      out += acc_s[w][h][d] * f;
    }
    const int64_t pidx = (static_cast<int64_t>(seq) * a.num_q_heads + kv_head * group + h) * num_partitions + part;
    part_out[pidx * kHeadDim + d] = out / sum;
    if (d == 0) part_lse[pidx] = mm + log2f(sum);
  }
}

template <int kHeadDim>
__global__ void decode_fp8_reduce_kernel(AttentionArgs a, const float* __restrict__ part_lse,
                                         const float* __restrict__ part_out, int32_t num_partitions) {
  const int seq = blockIdx.y, q_head = blockIdx.x, d = threadIdx.x;
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
  a.out[(static_cast<int64_t>(a.query_start[seq]) * a.num_q_heads + q_head) * kHeadDim + d] =
      __float2bfloat16(used > 0 ? out / sum : 0.0f);
}

template <int kHeadDim, int kMaxGroup>
cudaError_t launch_decode_fp8_t(const AttentionArgs& args, float* workspace, int32_t num_partitions,
                                cudaStream_t stream) {
  const size_t rows = static_cast<size_t>(args.num_seqs) * args.num_q_heads * num_partitions;
  float* lse = workspace;
  float* out = workspace + (rows + 3) / 4 * 4;
  decode_fp8_kernel<kHeadDim, kMaxGroup>
      <<<dim3(num_partitions, args.num_kv_heads, args.num_seqs), kFp8DecodeWarps * 32, 0, stream>>>(args, lse, out,
                                                                                                    num_partitions);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  decode_fp8_reduce_kernel<kHeadDim>
      <<<dim3(args.num_q_heads, args.num_seqs), kHeadDim, 0, stream>>>(args, lse, out, num_partitions);
  return cudaGetLastError();
}

template <int kHeadDim>
cudaError_t launch_decode_fp8_d(const AttentionArgs& args, float* workspace, int32_t num_partitions,
                                cudaStream_t stream) {
  const int group = args.num_q_heads / args.num_kv_heads;
  if (group <= 4) return launch_decode_fp8_t<kHeadDim, 4>(args, workspace, num_partitions, stream);
  return launch_decode_fp8_t<kHeadDim, 8>(args, workspace, num_partitions, stream);
}

// dst block i (bf16 [2][block][heads][D]) = dequantized cache block block_ids[i].
__global__ void kv_fp8_to_bf16_kernel(bf16* __restrict__ dst, const uint8_t* __restrict__ cache,
                                      const int32_t* __restrict__ block_ids, int32_t block_size, int32_t num_kv_heads,
                                      int32_t head_dim) {
  const int64_t codes = static_cast<int64_t>(block_size) * num_kv_heads * head_dim;
  const int64_t rows = static_cast<int64_t>(block_size) * num_kv_heads;
  const int64_t block_bytes = 2 * codes + 2 * rows * static_cast<int64_t>(sizeof(float));
  const uint8_t* src = cache + static_cast<int64_t>(block_ids[blockIdx.x]) * block_bytes;
  const float* scales = reinterpret_cast<const float*>(src + 2 * codes);
  bf16* out = dst + static_cast<int64_t>(blockIdx.x) * 2 * codes;
  for (int64_t i = threadIdx.x * 2; i < 2 * codes; i += blockDim.x * 2) {
    const float2 f = fp8x2_to_float2_kv(*reinterpret_cast<const uint16_t*>(src + i));
    const float s = scales[i / head_dim];  // row i / D of the [2][block][heads] scales
    reinterpret_cast<__nv_bfloat162*>(out + i)[0] = __floats2bfloat162_rn(f.x * s, f.y * s);
  }
}

}  // namespace

cudaError_t launch_decode_attention_fp8(const AttentionArgs& args, float* workspace, int32_t num_partitions,
                                        cudaStream_t stream) {
  if (args.num_seqs == 0) return cudaSuccess;
  // Tensor cores (attention.cu) unless the CUDA-core kernel is asked for (kept as the cross-check).
  if (args.decode_kernel != DecodeKernel::kCudaCore) {
    return launch_decode_attention_fp8_tc(args, workspace, num_partitions, stream);
  }
  if (args.head_dim == 128) return launch_decode_fp8_d<128>(args, workspace, num_partitions, stream);
  return launch_decode_fp8_d<64>(args, workspace, num_partitions, stream);
}

cudaError_t launch_kv_fp8_to_bf16(bf16* dst, const uint8_t* cache, const int32_t* block_ids, int32_t num_blocks,
                                  int32_t block_size, int32_t num_kv_heads, int32_t head_dim, cudaStream_t stream) {
  if (num_blocks == 0) return cudaSuccess;
  kv_fp8_to_bf16_kernel<<<num_blocks, 256, 0, stream>>>(dst, cache, block_ids, block_size, num_kv_heads, head_dim);
  return cudaGetLastError();
}

}  // namespace pd::kernels::cuda::detail
