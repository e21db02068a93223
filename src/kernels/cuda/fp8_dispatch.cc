// Shape checks of the FP8 and MoE kernels (the dispatch table's rules: nothing is
// launched for a shape the kernels do not support; the Status names the value).
#include <algorithm>

#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.h"

namespace pd::kernels::cuda {
namespace {

Status check_fp8_k(int32_t k, const char* kernel) {
  if (k <= 0 || k % kFp8Block != 0) {
    return unimplemented("{}: k = {} must be a positive multiple of {} (1 x 128 activation groups)", kernel, k,
                         kFp8Block);
  }
  return Status::Ok();
}

Status check_experts(int32_t num_experts, int32_t top_k, const char* kernel) {
  if (num_experts <= 0 || num_experts > kMoeMaxExperts) {
    return unimplemented("{}: {} experts (supported: 1..{})", kernel, num_experts, kMoeMaxExperts);
  }
  if (top_k <= 0 || top_k > kMoeMaxTopK || top_k > num_experts) {
    return invalid_argument("{}: top_k {} (need 1..min({}, {} experts))", kernel, top_k, kMoeMaxTopK, num_experts);
  }
  return Status::Ok();
}

}  // namespace

Status quantize_fp8(uint8_t* out, float* scales, const bf16* x, int32_t rows, int32_t k, cudaStream_t stream) {
  PD_RETURN_IF_ERROR(check_fp8_k(k, "quantize_fp8"));
  if (rows < 0) return invalid_argument("quantize_fp8: rows {}", rows);
  return cuda_status(
      detail::launch_quantize_fp8(out, scales, x, rows, k, fp8_act_scale_ld(rows), nullptr, nullptr, 0, stream),
      "quantize_fp8 launch");
}

Status quantize_fp8_grouped(uint8_t* out, float* scales, const bf16* x, int32_t rows, int32_t k,
                            const MoeRouting& routing, int32_t num_experts, cudaStream_t stream) {
  PD_RETURN_IF_ERROR(check_fp8_k(k, "quantize_fp8_grouped"));
  PD_RETURN_IF_ERROR(check_experts(num_experts, 1, "quantize_fp8_grouped"));
  if (rows < 0) return invalid_argument("quantize_fp8_grouped: rows {}", rows);
  return cuda_status(detail::launch_quantize_fp8(out, scales, x, rows, k, 0, routing.expert_offsets,
                                                 routing.padded_offsets, num_experts, stream),
                     "quantize_fp8_grouped launch");
}

Status stream_gemm(const StreamGemmArgs& a, int32_t rows_hint, cudaStream_t stream) {
  const bool fp8 = a.w_scale != nullptr;
  if (a.n < 0 || a.k <= 0 || a.m < 0 || a.max_groups < 0) {
    return invalid_argument("stream_gemm: m {} n {} k {} groups {}", a.m, a.n, a.k, a.max_groups);
  }
  if (fp8) {
    PD_RETURN_IF_ERROR(check_fp8_k(a.k, "stream_gemm"));
    if (a.w_scale_ld < (a.k + kFp8Block - 1) / kFp8Block) {
      return invalid_argument("stream_gemm: weight scale row of {} < {} blocks", a.w_scale_ld, a.k / kFp8Block);
    }
  } else if (a.k % 8 != 0) {
    return unimplemented("stream_gemm: k = {} must be a multiple of 8 (16-byte loads)", a.k);
  }
  if (a.lda % 8 != 0 || a.lda < a.k || a.ldo < a.n) {
    return invalid_argument("stream_gemm: lda {} (multiple of 8, >= k {}) / ldo {} (>= n {})", a.lda, a.k, a.ldo, a.n);
  }
  if (a.group_offsets == nullptr && (a.active_groups != nullptr || a.num_active != nullptr)) {
    return invalid_argument("stream_gemm: active groups without group offsets");
  }
  if (a.tc_kernel != Fp8TcKernel::kTiled) {
    if (!fp8 || a.cuda_cores || a.n % 16 != 0) {
      return invalid_argument(
          "stream_gemm: a warp-item kernel needs FP8 weights on tensor cores and n % 16 == 0 (n {})", a.n);
    }
    return cuda_status(detail::launch_fp8_warp_grouped(a, stream), "stream_gemm launch");
  }
  return cuda_status(detail::launch_stream_gemm(a, rows_hint, stream), "stream_gemm launch");
}

Status moe_route(const float* logits, int32_t num_tokens, int32_t num_experts, int32_t top_k, bool renormalize,
                 int32_t* topk_ids, float* topk_weights, cudaStream_t stream) {
  PD_RETURN_IF_ERROR(check_experts(num_experts, top_k, "moe_route"));
  if (num_tokens < 0) return invalid_argument("moe_route: num_tokens {}", num_tokens);
  return cuda_status(
      detail::launch_moe_route(logits, num_tokens, num_experts, top_k, renormalize, topk_ids, topk_weights, stream),
      "moe_route launch");
}

Status moe_align(const int32_t* topk_ids, int32_t num_tokens, int32_t top_k, int32_t num_experts,
                 const MoeRouting& routing, cudaStream_t stream) {
  PD_RETURN_IF_ERROR(check_experts(num_experts, top_k, "moe_align"));
  if (num_tokens < 0) return invalid_argument("moe_align: num_tokens {}", num_tokens);
  return cuda_status(detail::launch_moe_align(topk_ids, num_tokens, top_k, num_experts, routing, stream),
                     "moe_align launch");
}

Status moe_combine(bf16* out, const bf16* y, const int32_t* slot_of_choice, const float* topk_weights,
                   int32_t num_tokens, int32_t top_k, int32_t hidden, bool accumulate, cudaStream_t stream) {
  if (hidden <= 0 || hidden % 8 != 0) {
    return unimplemented("moe_combine: hidden = {} must be a positive multiple of 8 (16-byte vectors)", hidden);
  }
  if (top_k <= 0 || top_k > kMoeMaxTopK || num_tokens < 0) {
    return invalid_argument("moe_combine: top_k {} / num_tokens {}", top_k, num_tokens);
  }
  return cuda_status(
      detail::launch_moe_combine(out, y, slot_of_choice, topk_weights, num_tokens, top_k, hidden, accumulate, stream),
      "moe_combine launch");
}

Status decode_attention_fp8(const AttentionArgs& args_in, void* workspace, size_t workspace_bytes,
                            cudaStream_t stream) {
  AttentionArgs a = args_in;
  if (a.decode_partition_tokens == 0) a.decode_partition_tokens = kDecodePartitionTokens;
  if (a.head_dim != 64 && a.head_dim != 128) {
    return unimplemented("decode_attention_fp8: head_dim {} (supported: 64, 128)", a.head_dim);
  }
  if (a.block_size != kKvBlockSize) {
    return unimplemented("decode_attention_fp8: KV block size {} (supported: {})", a.block_size, kKvBlockSize);
  }
  if (a.num_q_heads <= 0 || a.num_kv_heads <= 0 || a.num_q_heads % a.num_kv_heads != 0) {
    return invalid_argument("decode_attention_fp8: {} q heads / {} kv heads", a.num_q_heads, a.num_kv_heads);
  }
  if (a.num_q_heads / a.num_kv_heads > 16) {
    return unimplemented("decode_attention_fp8: GQA group {} (max 16)", a.num_q_heads / a.num_kv_heads);
  }
  {
    AttentionArgs g = a;  // the CUDA-core kernel takes groups <= 8; the tensor-core one <= 16 at D128
    if (g.decode_kernel == DecodeKernel::kTensorCoreSingleBuffer) g.decode_kernel = DecodeKernel::kTensorCore;
    PD_RETURN_IF_ERROR(check_decode_gqa_group(g, "decode_attention_fp8"));
  }
  if (a.num_seqs < 0 || a.max_context_len < 0 || a.max_context_len > a.max_blocks_per_seq * a.block_size ||
      !(a.scale > 0.0f)) {
    return invalid_argument("decode_attention_fp8: seqs {}, max context {} for {} blocks, scale {}", a.num_seqs,
                            a.max_context_len, a.max_blocks_per_seq, a.scale);
  }
  if (a.decode_partition_tokens < kKvBlockSize || a.decode_partition_tokens > kDecodeMaxPartitionTokens ||
      a.decode_partition_tokens % kKvBlockSize != 0) {
    return unimplemented("decode_attention_fp8: partition of {} tokens", a.decode_partition_tokens);
  }
  const int32_t parts =
      std::max<int32_t>(1, (a.max_context_len + a.decode_partition_tokens - 1) / a.decode_partition_tokens);
  const size_t need = decode_attention_workspace_bytes(a.num_seqs, a.num_q_heads, a.head_dim, a.max_context_len,
                                                       a.decode_partition_tokens);
  if (workspace_bytes < need) {
    return invalid_argument("decode_attention_fp8: workspace {} bytes < {} needed", workspace_bytes, need);
  }
  return cuda_status(detail::launch_decode_attention_fp8(a, static_cast<float*>(workspace), parts, stream),
                     "decode_attention_fp8 launch");
}

Status kv_fp8_to_bf16_blocks(bf16* dst, const void* fp8_cache, const int32_t* block_ids, int32_t num_blocks,
                             int32_t num_kv_heads, int32_t head_dim, cudaStream_t stream) {
  if (head_dim != 64 && head_dim != 128) return unimplemented("kv_fp8_to_bf16_blocks: head_dim {}", head_dim);
  if (num_blocks < 0 || num_kv_heads <= 0) {
    return invalid_argument("kv_fp8_to_bf16_blocks: {} blocks, {} kv heads", num_blocks, num_kv_heads);
  }
  return cuda_status(detail::launch_kv_fp8_to_bf16(dst, static_cast<const uint8_t*>(fp8_cache), block_ids, num_blocks,
                                                   kKvBlockSize, num_kv_heads, head_dim, stream),
                     "kv_fp8_to_bf16_blocks launch");
}

Status fill_uniform_fp8(uint8_t* out, size_t n, uint64_t seed, float scale, cudaStream_t stream) {
  return cuda_status(detail::launch_fill_uniform_fp8(out, n, seed, scale, stream), "fill_uniform_fp8 launch");
}

}  // namespace pd::kernels::cuda
