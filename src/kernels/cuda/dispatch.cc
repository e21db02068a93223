// The dispatch table: every shape check lives here, before any launch.
// Supported: head_dim in {64, 128}, KV block size 16, GQA group <= 16 (decode: <= 8, or
// 9..16 on the tensor-core ring kernel at head_dim 128), row widths that are multiples of 8
// (16-byte vectors), hidden <= 16384.
#include <algorithm>
#include <atomic>

#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.h"

namespace pd::kernels::cuda {
namespace {

constexpr int32_t kMaxNormHidden = 16384;
constexpr int32_t kMaxGqaGroup = 16;

Status check_head_dim(int32_t head_dim, const char* kernel) {
  if (head_dim != 64 && head_dim != 128) {
    return unimplemented("{}: head_dim {} has no instantiation (supported: 64, 128)", kernel, head_dim);
  }
  return Status::Ok();
}

Status check_block_size(int32_t block_size, const char* kernel) {
  if (block_size != kKvBlockSize) {
    return unimplemented("{}: KV block size {} has no instantiation (supported: {})", kernel, block_size, kKvBlockSize);
  }
  return Status::Ok();
}

Status check_vec_width(int32_t width, const char* what, const char* kernel) {
  if (width <= 0 || width % 8 != 0) {
    return unimplemented("{}: {} = {} must be a positive multiple of 8 (16-byte vectors)", kernel, what, width);
  }
  return Status::Ok();
}

Status check_heads(int32_t num_q_heads, int32_t num_kv_heads, const char* kernel) {
  if (num_q_heads <= 0 || num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0) {
    return invalid_argument("{}: {} q heads are not a multiple of {} kv heads", kernel, num_q_heads, num_kv_heads);
  }
  if (num_q_heads / num_kv_heads > kMaxGqaGroup) {
    return unimplemented("{}: GQA group {} has no instantiation (max {})", kernel, num_q_heads / num_kv_heads,
                         kMaxGqaGroup);
  }
  return Status::Ok();
}

Status check_attention(const AttentionArgs& a, const char* kernel) {
  PD_RETURN_IF_ERROR(check_head_dim(a.head_dim, kernel));
  PD_RETURN_IF_ERROR(check_block_size(a.block_size, kernel));
  PD_RETURN_IF_ERROR(check_heads(a.num_q_heads, a.num_kv_heads, kernel));
  if (a.num_seqs < 0 || a.max_blocks_per_seq < 0 || a.max_query_len < 0 || a.max_context_len < 0) {
    return invalid_argument("{}: negative sizes (seqs {}, blocks/seq {}, max q {}, max ctx {})", kernel, a.num_seqs,
                            a.max_blocks_per_seq, a.max_query_len, a.max_context_len);
  }
  if (a.max_context_len > a.max_blocks_per_seq * a.block_size) {
    return invalid_argument("{}: max context {} exceeds the block table ({} blocks of {})", kernel, a.max_context_len,
                            a.max_blocks_per_seq, a.block_size);
  }
  if (!(a.scale > 0.0f)) return invalid_argument("{}: softmax scale {} must be > 0", kernel, a.scale);
  return Status::Ok();
}

std::atomic<bool> g_programmatic_launch{false};

}  // namespace

// GQA groups of 9..16 run only on the tensor-core ring kernels (16 A rows) at head_dim 128.
Status check_decode_gqa_group(const AttentionArgs& a, const char* kernel) {
  const int32_t group = a.num_q_heads / a.num_kv_heads;
  if (group <= 8) return Status::Ok();
  if (a.head_dim != 128 || a.decode_kernel != DecodeKernel::kTensorCore) {
    return unimplemented("{}: GQA group {} needs head_dim 128 and the tensor-core ring kernel (max 8 otherwise)",
                         kernel, group);
  }
  return Status::Ok();
}

namespace {}  // namespace

namespace detail {
bool programmatic_launch_enabled() {
  return g_programmatic_launch.load(std::memory_order_relaxed);
}
}  // namespace detail

void set_programmatic_launch(bool enabled) {
  g_programmatic_launch.store(enabled, std::memory_order_relaxed);
}

Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return internal_error("{} failed: {} ({})", what, cudaGetErrorName(err), cudaGetErrorString(err));
}

Status last_launch_status(const char* kernel_name) {
  return cuda_status(cudaGetLastError(), kernel_name);
}

Status embedding_lookup(bf16* out, const bf16* table, const int32_t* ids, int32_t num_rows, int32_t num_table_rows,
                        int32_t hidden, cudaStream_t stream) {
  PD_RETURN_IF_ERROR(check_vec_width(hidden, "hidden", "embedding_lookup"));
  return cuda_status(detail::launch_embedding(out, table, ids, num_rows, num_table_rows, hidden, stream),
                     "embedding_lookup launch");
}

Status rmsnorm(bf16* out, const bf16* x, bf16* residual_in_out, const bf16* weight, int32_t num_rows, int32_t hidden,
               float eps, cudaStream_t stream) {
  PD_RETURN_IF_ERROR(check_vec_width(hidden, "hidden", "rmsnorm"));
  if (hidden > kMaxNormHidden) return unimplemented("rmsnorm: hidden {} > {}", hidden, kMaxNormHidden);
  return cuda_status(detail::launch_rmsnorm(out, x, residual_in_out, weight, num_rows, hidden, eps, stream),
                     "rmsnorm launch");
}

Status add_bias(bf16* x, const bf16* bias, int32_t num_rows, int32_t width, cudaStream_t stream) {
  PD_RETURN_IF_ERROR(check_vec_width(width, "width", "add_bias"));
  return cuda_status(detail::launch_add_bias(x, bias, num_rows, width, stream), "add_bias launch");
}

Status silu_mul(bf16* out, const bf16* gate_up, int32_t num_rows, int32_t intermediate, cudaStream_t stream) {
  PD_RETURN_IF_ERROR(check_vec_width(intermediate, "intermediate", "silu_mul"));
  return cuda_status(detail::launch_silu_mul(out, gate_up, num_rows, intermediate, stream), "silu_mul launch");
}

Status rope_kv_write(const RopeKvArgs& args, cudaStream_t stream) {
  PD_RETURN_IF_ERROR(check_head_dim(args.head_dim, "rope_kv_write"));
  PD_RETURN_IF_ERROR(check_block_size(args.block_size, "rope_kv_write"));
  PD_RETURN_IF_ERROR(check_heads(args.num_q_heads, args.num_kv_heads, "rope_kv_write"));
  if (args.num_tokens < 0) return invalid_argument("rope_kv_write: num_tokens {}", args.num_tokens);
  return cuda_status(detail::launch_rope_kv(args, stream), "rope_kv_write launch");
}

Status prefill_attention(const AttentionArgs& args, cudaStream_t stream) {
  PD_RETURN_IF_ERROR(check_attention(args, "prefill_attention"));
  return cuda_status(detail::launch_prefill_attention(args, stream), "prefill_attention launch");
}

namespace {
int32_t decode_partitions(int32_t max_context_len, int32_t partition_tokens) {
  return std::max<int32_t>(1, (max_context_len + partition_tokens - 1) / partition_tokens);
}
}  // namespace

size_t decode_attention_workspace_bytes(int32_t num_seqs, int32_t num_q_heads, int32_t head_dim,
                                        int32_t max_context_len, int32_t partition_tokens) {
  const size_t rows =
      static_cast<size_t>(num_seqs) * num_q_heads * decode_partitions(max_context_len, partition_tokens);
  // launch_decode_attention aligns the partial outputs after the rows' sums to 16 bytes.
  return ((rows + 3) / 4 * 4 + rows * static_cast<size_t>(head_dim)) * sizeof(float);
}

Status decode_attention(const AttentionArgs& args_in, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  PD_RETURN_IF_ERROR(check_attention(args_in, "decode_attention"));
  AttentionArgs args = args_in;
  if (args.decode_partition_tokens == 0) args.decode_partition_tokens = kDecodePartitionTokens;
  if (args.decode_partition_tokens < kKvBlockSize || args.decode_partition_tokens > kDecodeMaxPartitionTokens ||
      args.decode_partition_tokens % kKvBlockSize != 0) {
    return unimplemented("decode_attention: partition of {} tokens (need a multiple of {} up to {})",
                         args.decode_partition_tokens, kKvBlockSize, kDecodeMaxPartitionTokens);
  }
  if (args.decode_kv_stages != 2 && args.decode_kv_stages != 3) {
    return unimplemented("decode_attention: {} K/V ring stages (supported: 2, 3)", args.decode_kv_stages);
  }
  PD_RETURN_IF_ERROR(check_decode_gqa_group(args, "decode_attention"));
  const size_t need = decode_attention_workspace_bytes(args.num_seqs, args.num_q_heads, args.head_dim,
                                                       args.max_context_len, args.decode_partition_tokens);
  if (workspace_bytes < need) {
    return invalid_argument("decode_attention: workspace {} bytes < {} needed", workspace_bytes, need);
  }
  return cuda_status(
      detail::launch_decode_attention(args, static_cast<float*>(workspace),
                                      decode_partitions(args.max_context_len, args.decode_partition_tokens), stream),
      "decode_attention launch");
}

Status sample_rows(float* logits, int32_t num_rows, int32_t vocab, const RowSampling* params,
                   const int32_t* suppressed_ids, int32_t* tokens, float* logprobs, cudaStream_t stream) {
  if (vocab <= 0) return invalid_argument("sample_rows: vocab {}", vocab);
  return cuda_status(
      detail::launch_sample_rows(logits, num_rows, vocab, params, suppressed_ids, tokens, logprobs, stream),
      "sample_rows launch");
}

Status fill_uniform(bf16* out, size_t n, uint64_t seed, float scale, cudaStream_t stream) {
  return cuda_status(detail::launch_fill_uniform(out, n, seed, scale, stream), "fill_uniform launch");
}

}  // namespace pd::kernels::cuda
