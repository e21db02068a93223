#include "engine/runner_cuda/fp8_kv_prefill.h"

#include <algorithm>

#include "kernels/cuda/device_memory.h"

namespace pd::engine {

namespace kc = pd::kernels::cuda;

Result<std::unique_ptr<Fp8KvPrefill>> Fp8KvPrefill::create(int32_t capacity_blocks, int32_t max_seqs,
                                                           int32_t max_blocks_per_seq, int32_t block_size,
                                                           int32_t num_kv_heads, int32_t head_dim) {
  if (max_seqs <= 0 || max_blocks_per_seq <= 0 || capacity_blocks < max_blocks_per_seq || block_size <= 0 ||
      num_kv_heads <= 0 || head_dim <= 0) {
    return invalid_argument(
        "fp8 kv prefill: capacity {} blocks, {} seqs, {} blocks per seq, block {}, {} kv heads, head_dim {}",
        capacity_blocks, max_seqs, max_blocks_per_seq, block_size, num_kv_heads, head_dim);
  }
  std::unique_ptr<Fp8KvPrefill> p(new Fp8KvPrefill());
  p->capacity_ = capacity_blocks;
  p->max_seqs_ = max_seqs;
  p->max_blocks_per_seq_ = max_blocks_per_seq;
  p->block_size_ = block_size;
  p->num_kv_heads_ = num_kv_heads;
  p->head_dim_ = head_dim;
  p->ints_count_ = 2 * static_cast<size_t>(max_seqs) * static_cast<size_t>(max_blocks_per_seq);
  PD_RETURN_IF_ERROR(kc::device_malloc(reinterpret_cast<void**>(&p->staging_), p->staging_bytes(), "fp8 kv staging"));
  PD_RETURN_IF_ERROR(
      kc::device_malloc(reinterpret_cast<void**>(&p->d_ints_), p->ints_count_ * 4, "fp8 kv staging tables"));
  PD_RETURN_IF_ERROR(kc::cuda_status(cudaMallocHost(reinterpret_cast<void**>(&p->h_ints_), p->ints_count_ * 4),
                                     "fp8 kv staging tables (host)"));
  return p;
}

Fp8KvPrefill::~Fp8KvPrefill() {
  kc::device_free(staging_);
  kc::device_free(d_ints_);
  if (h_ints_ != nullptr) cudaFreeHost(h_ints_);
}

size_t Fp8KvPrefill::staging_bytes() const {
  return static_cast<size_t>(capacity_) * 2 * block_size_ * num_kv_heads_ * head_dim_ * sizeof(__nv_bfloat16);
}

Status Fp8KvPrefill::prepare(const int32_t* context_lens, const int32_t* block_tables, int32_t num_seqs,
                             cudaStream_t stream) {
  groups_.clear();
  if (num_seqs < 0 || num_seqs > max_seqs_) {
    return invalid_argument("fp8 kv prefill: {} prefill sequences (max {})", num_seqs, max_seqs_);
  }
  const size_t tables_base = static_cast<size_t>(max_seqs_) * max_blocks_per_seq_;
  size_t ids = 0;
  for (int32_t i = 0; i < num_seqs; ++i) {
    const int32_t need = (context_lens[i] + block_size_ - 1) / block_size_;
    if (need < 0 || need > max_blocks_per_seq_) {
      return invalid_argument("fp8 kv prefill: sequence {} needs {} blocks (max {})", i, need, max_blocks_per_seq_);
    }
    if (groups_.empty() || groups_.back().num_blocks + need > capacity_) {
      Group g;
      g.first_seq = i;
      g.ids_offset = ids;
      g.tables_offset = tables_base + static_cast<size_t>(i) * max_blocks_per_seq_;
      groups_.push_back(g);
    }
    Group& g = groups_.back();
    int32_t* table = h_ints_ + tables_base + static_cast<size_t>(i) * max_blocks_per_seq_;
    for (int32_t j = 0; j < need; ++j) {
      h_ints_[ids++] = block_tables[static_cast<size_t>(i) * max_blocks_per_seq_ + j];
      table[j] = g.num_blocks + j;  // the block's position in the group's staging area
    }
    g.num_blocks += need;
    ++g.num_seqs;
  }
  if (num_seqs == 0) return Status::Ok();
  PD_RETURN_IF_ERROR(kc::cuda_status(
      cudaMemcpyAsync(d_ints_, h_ints_, ids * sizeof(int32_t), cudaMemcpyHostToDevice, stream), "fp8 kv block ids"));
  // Table rows past a sequence's blocks are never read.
  return kc::cuda_status(cudaMemcpyAsync(d_ints_ + tables_base, h_ints_ + tables_base,
                                         static_cast<size_t>(num_seqs) * max_blocks_per_seq_ * sizeof(int32_t),
                                         cudaMemcpyHostToDevice, stream),
                         "fp8 kv staging tables");
}

Status Fp8KvPrefill::run_layer(const kc::AttentionArgs& pre, const void* fp8_layer, cudaStream_t stream) {
  if (pre.max_blocks_per_seq != max_blocks_per_seq_) {
    return invalid_argument("fp8 kv prefill: {} blocks per seq, planned for {}", pre.max_blocks_per_seq,
                            max_blocks_per_seq_);
  }
  for (const Group& g : groups_) {
    if (g.num_blocks == 0) continue;
    PD_RETURN_IF_ERROR(kc::kv_fp8_to_bf16_blocks(staging_, fp8_layer, d_ints_ + g.ids_offset, g.num_blocks,
                                                 num_kv_heads_, head_dim_, stream));
    kc::AttentionArgs a = pre;
    a.kv_cache = staging_;
    a.query_start = pre.query_start + g.first_seq;
    a.context_lens = pre.context_lens + g.first_seq;
    a.block_tables = d_ints_ + g.tables_offset;
    a.num_seqs = g.num_seqs;
    PD_RETURN_IF_ERROR(kc::prefill_attention(a, stream));
  }
  return Status::Ok();
}

}  // namespace pd::engine
