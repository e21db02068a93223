#include "engine/runner_cuda/cuda_model_runner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>

#include "engine/decode_graph_buckets.h"
#include "engine/kv_memory_budget.h"
#include "engine/runner_cuda/nccl_comm.h"
#include "engine/sampler.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/device_memory.h"

namespace pd::engine {
namespace {

namespace kc = pd::kernels::cuda;
using bf16 = __nv_bfloat16;

int32_t ceil_div(int32_t a, int32_t b) {
  return (a + b - 1) / b;
}

// A row needs the CPU sampler when it asks for something the GPU kernel does not do
// (top-k/top-p, top logprobs, long suppression lists, penalties, logit_bias,
// allowed_token_ids, bad words, a structured-output mask).
bool needs_host_sampling(const SeqStep& s) {
  return (s.sampling.temperature > 0.0f && (s.sampling.top_k > 0 || s.sampling.top_p < 1.0f)) ||
         s.sampling.logprobs > 0 || static_cast<int32_t>(s.suppressed_token_ids.size()) > kc::kMaxSuppressedPerRow ||
         s.sampling.has_logits_processing() || !s.allowed_token_mask.empty();
}

}  // namespace

// Split-K partition of decode attention. Measured on an H200 inside CUDA graphs
// (docs/perf/engine.md, 2026-11-30 19:45 and 2026-12-01 01:35 UTC, 2,048-token contexts, 8 kv heads, K/V
// evict-first): up to 64 (seq, kv head) rows 128 tokens (b1: 8.6 us vs 9.7 at 64
// tokens, 8.9 at 256: fewer partials to merge, two blocks per warp to overlap); up to
// 128 rows 1,024 (b16: 39.4 us vs 42.1 at 256, 41.3 at 512: each CTA's fixed start-up
// and merge amortised over 4x the tokens; 256 CTAs still keep ~16 MB in flight);
// above, 512 (b64 140.3 us vs 141.4 at 256 and 141.1 at 1,024; b128 273.3 vs 274.0 and
// 272.7: flat from 256 to 1,024).
int32_t CudaModelRunner::decode_partition_tokens_for(int32_t num_seqs, int32_t num_kv_heads) {
  const int64_t rows = static_cast<int64_t>(num_seqs) * num_kv_heads;
  if (rows <= 64) return 128;
  if (rows <= 128) return 1024;
  return 512;
}

// K/V ring depth of decode attention: 3 blocks per warp up to 128 (seq, kv head) rows,
// where each SM holds only ~2 CTAs (1,024-token partitions) and deeper rings keep more
// in flight; measured on an H200 (docs/perf/engine.md, 2026-12-01 01:35 UTC), whole Qwen3-8B steps
// at b16 6.10-6.17 ms with 3 against 6.20-6.30 with 2 in three pairs of runs; b64/b128
// equal within the spread, so they keep the 70 KiB CTA (3 per SM).
int32_t CudaModelRunner::decode_kv_stages_for(int32_t num_seqs, int32_t num_kv_heads) {
  const int64_t rows = static_cast<int64_t>(num_seqs) * num_kv_heads;
  return rows > 64 && rows <= 128 ? 3 : 2;
}

Result<std::unique_ptr<CudaModelRunner>> CudaModelRunner::create(model::ModelConfig config,
                                                                 const model::ModelWeights* host_weights,
                                                                 CudaRunnerOptions options, CudaTpRank tp) {
  PD_ASSIGN_OR_RETURN(auto runner, create_unprepared(std::move(config), host_weights, options, tp));
  PD_ASSIGN_OR_RETURN(const int64_t blocks, runner->fit_kv_blocks());
  PD_RETURN_IF_ERROR(runner->finish_init(blocks));
  return runner;
}

Result<std::unique_ptr<CudaModelRunner>> CudaModelRunner::create_unprepared(model::ModelConfig config,
                                                                            const model::ModelWeights* host_weights,
                                                                            CudaRunnerOptions options, CudaTpRank tp) {
  std::unique_ptr<CudaModelRunner> runner(new CudaModelRunner());
  PD_RETURN_IF_ERROR(runner->init(std::move(config), host_weights, options, tp));
  return runner;
}

Status CudaModelRunner::finish_init(int64_t num_blocks) {
  PD_RETURN_IF_ERROR(kc::cuda_status(cudaSetDevice(options_.device), "cudaSetDevice"));
  PD_RETURN_IF_ERROR(allocate_kv_pool(num_blocks));
  PD_RETURN_IF_ERROR(kc::cuda_status(cudaStreamSynchronize(stream_), "init sync"));
  return prepare_decode_buckets();
}

Status CudaModelRunner::sync_stream(const char* what) {
  if (tp_.tp_size == 1) return kc::cuda_status(cudaStreamSynchronize(stream_), what);
  // A peer that failed mid-step never joins the collective this stream may wait in:
  // poll, and give up when the group is marked failed or the deadline passes.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(tp_.wait_timeout_ms);
  for (;;) {
    const cudaError_t e = cudaStreamQuery(stream_);
    if (e == cudaSuccess) return Status::Ok();
    if (e != cudaErrorNotReady) return kc::cuda_status(e, what);
    if (tp_.group_failed != nullptr && tp_.group_failed->load(std::memory_order_acquire)) {
      return aborted("cuda runner rank {}: {}: another tensor-parallel rank failed", tp_.rank, what);
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return deadline_exceeded("cuda runner rank {}: {}: the step did not finish within {} ms", tp_.rank, what,
                               tp_.wait_timeout_ms);
    }
    std::this_thread::yield();
  }
}

Status CudaModelRunner::all_reduce(bf16* data, int64_t count) {
  if (tp_.tp_size == 1) return Status::Ok();
  return tp_.comms->all_reduce_bf16(tp_.rank, data, static_cast<size_t>(count), stream_);
}

CudaModelRunner::~CudaModelRunner() {
  for (auto& [bucket, exec] : graphs_) cudaGraphExecDestroy(exec);
  gemm_.reset();
  for (void* p : allocations_) kc::device_free(p);
  if (h_ints_ != nullptr) cudaFreeHost(h_ints_);
  if (h_sampling_ != nullptr) cudaFreeHost(h_sampling_);
  if (h_logprobs_ != nullptr) cudaFreeHost(h_logprobs_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void* CudaModelRunner::alloc(size_t bytes) {
  void* p = nullptr;
  if (!kc::device_malloc(&p, std::max<size_t>(bytes, 16), "cuda runner buffer").ok()) return nullptr;
  allocations_.push_back(p);
  return p;
}

size_t CudaModelRunner::kv_bytes_per_token() const {
  return static_cast<size_t>(config_.num_layers) * spec_.bytes_per_block() / static_cast<size_t>(spec_.block_size);
}

Status CudaModelRunner::init(model::ModelConfig config, const model::ModelWeights* host_weights,
                             CudaRunnerOptions options, CudaTpRank tp) {
  PD_RETURN_IF_ERROR(config.validate());
  config_ = std::move(config);
  options_ = options;
  tp_ = tp;
  if (tp_.tp_size < 1 || tp_.rank < 0 || tp_.rank >= tp_.tp_size ||
      (tp_.tp_size > 1 && (tp_.comms == nullptr || tp_.group_failed == nullptr))) {
    return invalid_argument("cuda runner: rank {} of {} (ranks need the group's communicators)", tp_.rank, tp_.tp_size);
  }
  PD_ASSIGN_OR_RETURN(split_, model::plan_tensor_parallel(config_, tp_.tp_size));
  heads_ = split_.heads_per_rank;
  kv_heads_ = split_.kv_heads_per_rank;
  inter_ = split_.intermediate_per_rank > 0 ? split_.intermediate_per_rank : config_.intermediate_size;
  moe_inter_ =
      split_.moe_intermediate_per_rank > 0 ? split_.moe_intermediate_per_rank : config_.moe.moe_intermediate_size;
  if (options_.block_size != kc::kKvBlockSize) {
    return unimplemented("cuda runner: block size {} (supported: {})", options_.block_size, kc::kKvBlockSize);
  }
  if (config_.head_dim != 64 && config_.head_dim != 128) {
    return unimplemented("cuda runner: head_dim {} has no kernels (supported: 64, 128)", config_.head_dim);
  }
  const int32_t gqa_group = heads_ / kv_heads_;  // per rank
  if (gqa_group > 16 ||
      (gqa_group > 8 && (config_.head_dim != 128 || options_.decode_kernel != kc::DecodeKernel::kTensorCore))) {
    return unimplemented(
        "cuda runner: GQA group {} per rank (max 8; up to 16 at head_dim 128 with the tensor-core decode kernel)",
        gqa_group);
  }
  if (options_.max_num_seqs <= 0 || options_.max_num_batched_tokens < options_.max_num_seqs ||
      options_.max_model_len <= 0) {
    return invalid_argument("cuda runner: max_num_seqs {} / max_num_batched_tokens {} / max_model_len {}",
                            options_.max_num_seqs, options_.max_num_batched_tokens, options_.max_model_len);
  }
  if (options_.decode_kv_stages != 0 && options_.decode_kv_stages != 2 && options_.decode_kv_stages != 3) {
    return invalid_argument("cuda runner: {} decode K/V stages (need 0 = by batch, 2 or 3)", options_.decode_kv_stages);
  }
  if (options_.decode_partition_tokens != 0 &&
      (options_.decode_partition_tokens % kc::kKvBlockSize != 0 || options_.decode_partition_tokens < 0 ||
       options_.decode_partition_tokens > kc::kDecodeMaxPartitionTokens)) {
    return invalid_argument("cuda runner: decode partition of {} tokens (need a multiple of {} up to {})",
                            options_.decode_partition_tokens, kc::kKvBlockSize, kc::kDecodeMaxPartitionTokens);
  }
  PD_RETURN_IF_ERROR(kc::cuda_status(cudaSetDevice(options_.device), "cudaSetDevice"));
  PD_RETURN_IF_ERROR(kc::cuda_status(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream"));
  // The KV budget needs the share free now; what this instance holds it counts by its own allocator.
  size_t total_bytes = 0;
  PD_RETURN_IF_ERROR(kc::cuda_status(cudaMemGetInfo(&free_bytes_at_start_, &total_bytes), "cudaMemGetInfo"));
  PD_ASSIGN_OR_RETURN(gemm_, kc::Gemm::create(64ull << 20, options_.gemm_policy));
  const bool moe = config_.family == model::ModelFamily::kQwen3Moe && config_.moe.num_experts > 0;
  if ((config_.quant.fp8() || moe) && !options_.fuse_norms_into_gemms) {
    return unimplemented("cuda runner: FP8 and MoE models run with fuse_norms_into_gemms only");
  }
  if (config_.quant.fp8()) {
    const int32_t max_k = kc::fp8_round_up(std::max({config_.hidden_size, config_.num_heads * config_.head_dim,
                                                     config_.intermediate_size, config_.moe.moe_intermediate_size}),
                                           kc::kFp8Block);
    PD_ASSIGN_OR_RETURN(fp8_gemm_, kc::Fp8Gemm::create(options_.max_num_batched_tokens, max_k));
  }
  PD_RETURN_IF_ERROR(upload_weights(host_weights));
  return allocate_buffers();
}

Status CudaModelRunner::prepare_decode_buckets() {
  const auto start = std::chrono::steady_clock::now();
  // Padding below 3 % of a step at every batch size (decode_graph_buckets.h); execute() serves a
  // batch with the first bucket >= it.
  decode_buckets_ = decode_graph_buckets(options_.max_num_seqs);
  int32_t* sample_rows = h_ints_ + off_sample_rows_;
  for (int32_t bucket : decode_buckets_) {
    // Padding rows only (as execute() pads a graph): no context read, no KV written.
    h_ints_[off_qstart_] = 0;
    append_padding_rows(0, bucket, 0);
    std::fill_n(sample_rows, bucket, 0);
    const auto n = static_cast<size_t>(bucket);
    PD_RETURN_IF_ERROR(copy_step_inputs(off_tokens_, n));
    PD_RETURN_IF_ERROR(copy_step_inputs(off_positions_, n));
    PD_RETURN_IF_ERROR(copy_step_inputs(off_slots_, n));
    PD_RETURN_IF_ERROR(copy_step_inputs(off_qstart_, n + 1));
    PD_RETURN_IF_ERROR(copy_step_inputs(off_ctx_, n));
    PD_RETURN_IF_ERROR(copy_step_inputs(off_sample_rows_, n));
    PassShape shape;
    shape.num_tokens = bucket;
    shape.num_decode = bucket;
    shape.num_sample = bucket;
    shape.max_context = options_.max_model_len;
    if (options_.enable_cuda_graphs) {
      PD_RETURN_IF_ERROR(run_decode_graph(bucket, shape));
    } else {
      PD_RETURN_IF_ERROR(forward(shape, nullptr));
    }
  }
  PD_RETURN_IF_ERROR(sync_stream("bucket preparation sync"));
  gemm_->set_tuning(false);
  if (fp8_gemm_ != nullptr) fp8_gemm_->set_tuning(false);
  bucket_preparation_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return Status::Ok();
}

int32_t CudaModelRunner::append_padding_rows(int32_t first_row, int32_t end_row, int32_t first_token) {
  // Graph padding: one token per row, reading no context (length 0) and writing no KV (slot -1).
  int32_t t = first_token;
  for (int32_t i = first_row; i < end_row; ++i) {
    h_ints_[off_tokens_ + t] = 0;
    h_ints_[off_positions_ + t] = 0;
    h_ints_[off_slots_ + t] = -1;
    ++t;
    h_ints_[off_qstart_ + i + 1] = t;
    h_ints_[off_ctx_ + i] = 0;
  }
  return t;
}

Status CudaModelRunner::copy_step_inputs(size_t offset, size_t count) {
  return kc::cuda_status(
      cudaMemcpyAsync(d_ints_ + offset, h_ints_ + offset, count * sizeof(int32_t), cudaMemcpyHostToDevice, stream_),
      "step input copy");
}

Status CudaModelRunner::allocate_buffers() {
  const auto& c = config_;
  const size_t t = static_cast<size_t>(options_.max_num_batched_tokens);
  const size_t s = static_cast<size_t>(options_.max_num_seqs);
  const size_t h = c.hidden_size, qd = static_cast<size_t>(heads_) * c.head_dim,
               qkv = static_cast<size_t>(heads_ + 2 * kv_heads_) * c.head_dim, inter = static_cast<size_t>(inter_);
  auto bf = [&](size_t n) { return static_cast<bf16*>(alloc(n * sizeof(bf16))); };
  residual_ = bf(t * h);
  x_ = bf(t * h);
  qkv_buf_ = bf(t * qkv);
  q_buf_ = bf(t * qd);
  attn_buf_ = bf(t * qd);
  gate_up_buf_ = bf(t * 2 * inter);
  act_buf_ = bf(t * inter);
  sample_hidden_ = bf(s * h);
  if (tp_.tp_size > 1) {
    tp_out_ = bf(t * h);
    if (tp_out_ == nullptr) return resource_exhausted("cuda runner: out of device memory for activation buffers");
  }
  if (c.family == model::ModelFamily::kQwen3Moe && c.moe.num_experts > 0) {
    PD_ASSIGN_OR_RETURN(moe_, kc::MoeLayer::create(options_.max_num_batched_tokens, c.moe.num_experts_per_tok,
                                                   c.moe.num_experts, c.hidden_size, moe_inter_));
    router_logits_ = static_cast<float*>(alloc(t * static_cast<size_t>(c.moe.num_experts) * sizeof(float)));
  }
  logits_ = static_cast<float*>(alloc(s * c.vocab_size * sizeof(float)));
  // Largest workspace over every decode batch size (the partition depends on it).
  decode_ws_bytes_ = 0;
  for (int32_t seqs = 1; seqs <= options_.max_num_seqs; ++seqs) {
    decode_ws_bytes_ = std::max(decode_ws_bytes_,
                                kc::decode_attention_workspace_bytes(seqs, heads_, c.head_dim, options_.max_model_len,
                                                                     decode_partition_tokens(seqs)));
  }
  decode_ws_ = alloc(decode_ws_bytes_);
  const size_t num_merge_counters = s * static_cast<size_t>(kv_heads_);
  decode_merge_counters_ = static_cast<uint32_t*>(alloc(num_merge_counters * sizeof(uint32_t)));
  max_blocks_per_seq_ = ceil_div(options_.max_model_len, options_.block_size);
  size_t off = 0;
  auto take = [&](size_t n) {
    const size_t at = off;
    off += (n + 3) & ~size_t{3};  // 16-byte aligned sections
    return at;
  };
  off_tokens_ = take(t);
  off_positions_ = take(t);
  off_slots_ = take(t);
  off_qstart_ = take(s + 1);
  off_ctx_ = take(s);
  off_sample_rows_ = take(s);
  off_suppressed_ = take(s * kc::kMaxSuppressedPerRow);
  off_out_tokens_ = take(s);
  off_tables_ = take(s * static_cast<size_t>(max_blocks_per_seq_));
  ints_count_ = off;
  d_ints_ = static_cast<int32_t*>(alloc(ints_count_ * sizeof(int32_t)));
  d_sampling_ = static_cast<kc::RowSampling*>(alloc(s * sizeof(kc::RowSampling)));
  d_logprobs_ = static_cast<float*>(alloc(s * sizeof(float)));
  for (void* p :
       {static_cast<void*>(residual_), static_cast<void*>(x_), static_cast<void*>(qkv_buf_), static_cast<void*>(q_buf_),
        static_cast<void*>(attn_buf_), static_cast<void*>(gate_up_buf_), static_cast<void*>(act_buf_),
        static_cast<void*>(sample_hidden_), static_cast<void*>(logits_), decode_ws_, static_cast<void*>(d_ints_),
        static_cast<void*>(d_sampling_), static_cast<void*>(d_logprobs_), static_cast<void*>(decode_merge_counters_)}) {
    if (p == nullptr) return resource_exhausted("cuda runner: out of device memory for activation buffers");
  }
  PD_RETURN_IF_ERROR(kc::cuda_status(cudaMemset(decode_merge_counters_, 0, num_merge_counters * sizeof(uint32_t)),
                                     "memset decode merge counters"));
  PD_RETURN_IF_ERROR(kc::cuda_status(cudaMallocHost(reinterpret_cast<void**>(&h_ints_), ints_count_ * sizeof(int32_t)),
                                     "cudaMallocHost(step inputs)"));
  std::memset(h_ints_, 0, ints_count_ * sizeof(int32_t));
  PD_RETURN_IF_ERROR(kc::cuda_status(
      cudaMallocHost(reinterpret_cast<void**>(&h_sampling_), s * sizeof(kc::RowSampling)), "cudaMallocHost"));
  PD_RETURN_IF_ERROR(
      kc::cuda_status(cudaMallocHost(reinterpret_cast<void**>(&h_logprobs_), s * sizeof(float)), "cudaMallocHost"));
  // Block tables beyond a sequence's blocks are never read, but keep them valid ids.
  return kc::cuda_status(cudaMemset(d_ints_, 0, ints_count_ * sizeof(int32_t)), "memset step inputs");
}

Result<int64_t> CudaModelRunner::fit_kv_blocks() {
  PD_RETURN_IF_ERROR(kc::cuda_status(cudaSetDevice(options_.device), "cudaSetDevice"));
  spec_.num_layers = config_.num_layers;
  spec_.num_kv_heads = kv_heads_;
  spec_.head_dim = config_.head_dim;
  spec_.block_size = options_.block_size;
  spec_.dtype = options_.kv_fp8 ? KvDtype::kFp8E4m3 : KvDtype::kBFloat16;
  if (options_.kv_fp8) PD_RETURN_IF_ERROR(create_fp8_kv_prefill());
  const size_t per_block_all_layers = spec_.bytes_per_block() * static_cast<size_t>(config_.num_layers);
  int64_t blocks = options_.num_kv_blocks;
  if (blocks <= 0) {
    size_t free_bytes = 0, total_bytes = 0;
    PD_RETURN_IF_ERROR(kc::cuda_status(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo"));
    KvMemoryBudgetInput budget;
    budget.total_bytes = total_bytes;
    budget.free_bytes_at_start = free_bytes_at_start_;
    budget.free_bytes_now = free_bytes;
    budget.own_bytes = kc::device_bytes_held(options_.device);
    budget.gpu_memory_utilization = options_.gpu_memory_utilization;
    // Leave room for cuBLASLt, graphs and the CUDA context's own growth.
    budget.reserve_bytes = 512ull << 20;
    budget.bytes_per_block = per_block_all_layers;
    Result<int64_t> fitted = kv_cache_blocks_for_budget(budget);
    if (!fitted.ok()) return fitted.status().with_context("cuda runner");
    blocks = *fitted;
  }
  if (blocks > INT32_MAX / options_.block_size) blocks = INT32_MAX / options_.block_size;
  return blocks;
}

Status CudaModelRunner::allocate_kv_pool(int64_t blocks) {
  const size_t per_block_all_layers = spec_.bytes_per_block() * static_cast<size_t>(config_.num_layers);
  spec_.num_blocks = static_cast<int32_t>(blocks);
  kv_pool_ = alloc(per_block_all_layers * static_cast<size_t>(blocks));
  if (kv_pool_ == nullptr) {
    return resource_exhausted("cuda runner: cannot allocate {} KV blocks ({} bytes)", blocks,
                              per_block_all_layers * static_cast<size_t>(blocks));
  }
  return Status::Ok();
}

void* CudaModelRunner::kv_layer_base(int32_t layer) {
  if (layer < 0 || layer >= config_.num_layers) return nullptr;
  return static_cast<uint8_t*>(kv_pool_) + spec_.bytes_per_layer() * static_cast<size_t>(layer);
}

Status CudaModelRunner::fill_kv_random(uint64_t seed) {
  if (options_.kv_fp8) return fill_fp8_kv_random(seed);
  const size_t n = spec_.bytes_per_layer() * static_cast<size_t>(config_.num_layers) / sizeof(bf16);
  PD_RETURN_IF_ERROR(kc::fill_uniform(static_cast<bf16*>(kv_pool_), n, seed, 1.0f, stream_));
  return kc::cuda_status(cudaStreamSynchronize(stream_), "fill_kv_random sync");
}

Result<std::vector<float>> CudaModelRunner::last_logits(int32_t num_rows) {
  if (num_rows < 0 || num_rows > options_.max_num_seqs) return invalid_argument("last_logits: {} rows", num_rows);
  std::vector<float> out(static_cast<size_t>(num_rows) * config_.vocab_size);
  PD_RETURN_IF_ERROR(kc::cuda_status(cudaStreamSynchronize(stream_), "last_logits sync"));
  PD_RETURN_IF_ERROR(kc::cuda_status(
      cudaMemcpy(out.data(), logits_, out.size() * sizeof(float), cudaMemcpyDeviceToHost), "last_logits copy"));
  return out;
}

Status CudaModelRunner::validate(const StepInput& input) const {
  if (input.seqs.empty()) return invalid_argument("cuda runner: empty step");
  if (static_cast<int32_t>(input.seqs.size()) > options_.max_num_seqs) {
    return invalid_argument("cuda runner: {} seqs > max_num_seqs {}", input.seqs.size(), options_.max_num_seqs);
  }
  if (static_cast<int64_t>(input.token_ids.size()) > options_.max_num_batched_tokens) {
    return invalid_argument("cuda runner: {} tokens > max_num_batched_tokens {}", input.token_ids.size(),
                            options_.max_num_batched_tokens);
  }
  for (int32_t id : input.token_ids) {
    if (id < 0 || id >= config_.vocab_size) return invalid_argument("cuda runner: token id {} outside the vocab", id);
  }
  // The pass lays every sequence's new tokens out back to back: their sum, not token_ids'
  // size, is what fills the step buffers (ranges may overlap in a malformed step).
  int64_t num_pass_tokens = 0;
  for (const SeqStep& s : input.seqs) num_pass_tokens += std::max(0, s.num_new_tokens);
  if (num_pass_tokens > options_.max_num_batched_tokens) {
    return invalid_argument("cuda runner: the seqs' new tokens sum to {} > max_num_batched_tokens {}", num_pass_tokens,
                            options_.max_num_batched_tokens);
  }
  for (size_t i = 0; i < input.seqs.size(); ++i) {
    const SeqStep& s = input.seqs[i];
    if (s.num_new_tokens < 1 || s.num_computed_tokens < 0 || s.token_offset < 0 ||
        static_cast<size_t>(s.token_offset) + static_cast<size_t>(s.num_new_tokens) > input.token_ids.size()) {
      return invalid_argument("cuda runner: seq {} has offset {} / {} new / {} computed tokens over {} token ids", i,
                              s.token_offset, s.num_new_tokens, s.num_computed_tokens, input.token_ids.size());
    }
    const int32_t ctx = s.num_computed_tokens + s.num_new_tokens;
    if (ctx > options_.max_model_len) {
      return invalid_argument("cuda runner: seq {} reaches {} tokens > max_model_len {}", i, ctx,
                              options_.max_model_len);
    }
    const int32_t need = ceil_div(ctx, options_.block_size);
    if (static_cast<int32_t>(s.block_table.size()) < need) {
      return invalid_argument("cuda runner: seq {} has {} blocks for {} tokens", i, s.block_table.size(), ctx);
    }
    for (int32_t j = 0; j < need; ++j) {
      const int32_t b = s.block_table[static_cast<size_t>(j)];
      if (b < 0 || b >= spec_.num_blocks) return invalid_argument("cuda runner: seq {} block id {} out of range", i, b);
    }
  }
  return Status::Ok();
}

int32_t CudaModelRunner::decode_partition_tokens(int32_t num_decode) const {
  if (options_.decode_partition_tokens > 0) return options_.decode_partition_tokens;
  return decode_partition_tokens_for(num_decode, kv_heads_);
}

Status CudaModelRunner::forward(const PassShape& shape, LayerKvHooks* hooks) {
  const auto& c = config_;
  const int32_t t = shape.num_tokens;
  const int32_t h = c.hidden_size, hq = heads_, hkv = kv_heads_, d = c.head_dim, inter = inter_;
  const int32_t qkv_width = (hq + 2 * hkv) * d;
  int32_t* ints = d_ints_;
  // Read at launch (and so at graph capture): each bucket's graph keeps the setting of its size.
  kc::set_programmatic_launch(options_.programmatic_launch && t <= options_.programmatic_launch_max_tokens);
  PD_RETURN_IF_ERROR(kc::embedding_lookup(residual_, embed_, ints + off_tokens_, t, c.vocab_size, h, stream_));

  kc::AttentionArgs base;
  base.q = q_buf_;
  base.out = attn_buf_;
  base.num_q_heads = hq;
  base.num_kv_heads = hkv;
  base.head_dim = d;
  base.block_size = options_.block_size;
  base.max_blocks_per_seq = max_blocks_per_seq_;
  base.scale = 1.0f / std::sqrt(static_cast<float>(d));
  kc::AttentionArgs dec = base;
  dec.query_start = ints + off_qstart_;
  dec.context_lens = ints + off_ctx_;
  dec.block_tables = ints + off_tables_;
  dec.num_seqs = shape.num_decode;
  dec.max_query_len = 1;
  dec.max_context_len = shape.max_context;
  dec.decode_partition_tokens = decode_partition_tokens(shape.num_decode);
  dec.decode_kv_evict_first = options_.decode_kv_evict_first;
  dec.decode_kv_stages =
      options_.decode_kv_stages > 0 ? options_.decode_kv_stages : decode_kv_stages_for(shape.num_decode, hkv);
  dec.decode_kernel = options_.decode_kernel;
  if (options_.decode_merge_in_attention) dec.decode_merge_counters = decode_merge_counters_;
  kc::AttentionArgs pre = base;
  pre.query_start = ints + off_qstart_ + shape.num_decode;
  pre.context_lens = ints + off_ctx_ + shape.num_decode;
  pre.block_tables = ints + off_tables_ + static_cast<size_t>(shape.num_decode) * max_blocks_per_seq_;
  pre.num_seqs = shape.num_prefill;
  pre.prefill_kernel = options_.prefill_kernel;
  pre.max_query_len = shape.max_prefill_q;
  pre.max_context_len = shape.max_context;

  // Fused: residual_ holds the residual stream throughout; o_proj and the down projection add
  // into it, and the qkv and gate_up GEMMs normalize it on the way in (x_ is the norm's scratch
  // when it runs as its own kernel). Unfused: o_proj and down write x_, and an add + norm kernel
  // folds it into residual_ and writes the normalized rows to x_.
  // With tensor parallelism each rank's o_proj / MLP / MoE output is a partial sum: it goes to
  // tp_out_, is all-reduced there, and the add + norm kernel folds it into residual_ (the
  // unfused layout with tp_out_ in x_'s place); one GPU keeps the fused layout.
  const bool tp = tp_.tp_size > 1;
  const bool fused = options_.fuse_norms_into_gemms && !tp;
  auto normed = [&](const bf16* norm_weight) {
    kc::GemmFusion f;
    f.norm_weight = norm_weight;
    f.norm_eps = c.rms_norm_eps;
    f.norm_scratch = x_;
    return f;
  };
  kc::GemmFusion accumulate;
  accumulate.accumulate = true;
  bf16* const block_out = fused ? residual_ : (tp ? tp_out_ : x_);  // where o_proj and the MLP write
  // The norm after attention: from residual_ (fused: o_proj added into it), else the add +
  // norm of block_out into residual_.
  auto post_norm = [&](const bf16* weight) {
    return fused ? kc::rmsnorm(x_, residual_, nullptr, weight, t, h, c.rms_norm_eps, stream_)
                 : kc::rmsnorm(x_, block_out, residual_, weight, t, h, c.rms_norm_eps, stream_);
  };

  for (int32_t l = 0; l < c.num_layers; ++l) {
    const LayerWeights& w = layers_[static_cast<size_t>(l)];
    bf16* kv = static_cast<bf16*>(kv_layer_base(l));
    if (fused && w.qkv8.data != nullptr) {
      PD_RETURN_IF_ERROR(kc::rmsnorm(x_, residual_, nullptr, w.input_norm, t, h, c.rms_norm_eps, stream_));
      PD_RETURN_IF_ERROR(fp8_gemm_->run(qkv_buf_, x_, t, w.qkv8, stream_));
    } else if (fused) {
      PD_RETURN_IF_ERROR(gemm_->run(qkv_buf_, kc::GemmOut::kBFloat16, residual_, w.qkv, t, qkv_width, h, stream_,
                                    normed(w.input_norm)));
    } else {
      if (l == 0) {
        PD_RETURN_IF_ERROR(kc::rmsnorm(x_, residual_, nullptr, w.input_norm, t, h, c.rms_norm_eps, stream_));
      } else {
        PD_RETURN_IF_ERROR(kc::rmsnorm(x_, block_out, residual_, w.input_norm, t, h, c.rms_norm_eps, stream_));
      }
      if (w.qkv8.data != nullptr) {
        PD_RETURN_IF_ERROR(fp8_gemm_->run(qkv_buf_, x_, t, w.qkv8, stream_));
      } else {
        PD_RETURN_IF_ERROR(gemm_->run(qkv_buf_, kc::GemmOut::kBFloat16, x_, w.qkv, t, qkv_width, h, stream_));
      }
    }
    if (w.qkv_bias != nullptr) PD_RETURN_IF_ERROR(kc::add_bias(qkv_buf_, w.qkv_bias, t, qkv_width, stream_));
    kc::RopeKvArgs rope;
    rope.qkv = qkv_buf_;
    rope.q_out = q_buf_;
    rope.kv_cache = kv;
    rope.positions = ints + off_positions_;
    rope.slot_mapping = ints + off_slots_;
    rope.inv_freq = inv_freq_;
    rope.q_norm_weight = w.q_norm;
    rope.k_norm_weight = w.k_norm;
    rope.norm_eps = c.rms_norm_eps;
    rope.num_tokens = t;
    rope.num_q_heads = hq;
    rope.num_kv_heads = hkv;
    rope.head_dim = d;
    rope.block_size = options_.block_size;
    rope.kv_fp8 = options_.kv_fp8;
    PD_RETURN_IF_ERROR(kc::rope_kv_write(rope, stream_));
    if (hooks != nullptr) hooks->wait_for_layer_load(l);
    dec.kv_cache = kv;
    pre.kv_cache = kv;
    if (shape.num_decode > 0) {
      PD_RETURN_IF_ERROR(options_.kv_fp8 ? kc::decode_attention_fp8(dec, decode_ws_, decode_ws_bytes_, stream_)
                                         : kc::decode_attention(dec, decode_ws_, decode_ws_bytes_, stream_));
    }
    if (shape.num_prefill > 0) {
      PD_RETURN_IF_ERROR(options_.kv_fp8 ? fp8_kv_prefill_->run_layer(pre, kv, stream_)
                                         : kc::prefill_attention(pre, stream_));
    }
    if (hooks != nullptr) {
      // The connector reads this layer's KV from another stream: the writes must be complete.
      PD_RETURN_IF_ERROR(kc::cuda_status(cudaStreamSynchronize(stream_), "layer sync before save_layer"));
      hooks->save_layer(l);
    }
    if (w.o_proj8.data != nullptr) {
      PD_RETURN_IF_ERROR(fp8_gemm_->run(block_out, attn_buf_, t, w.o_proj8, stream_, /*accumulate=*/fused));
    } else {
      PD_RETURN_IF_ERROR(gemm_->run(block_out, kc::GemmOut::kBFloat16, attn_buf_, w.o_proj, t, h, hq * d, stream_,
                                    fused ? accumulate : kc::GemmFusion{}));
    }
    if (tp) PD_RETURN_IF_ERROR(all_reduce(block_out, static_cast<int64_t>(t) * h));
    if (w.o_bias != nullptr) PD_RETURN_IF_ERROR(kc::add_bias(block_out, w.o_bias, t, h, stream_));
    if (w.router != nullptr) {
      // Qwen3-MoE sparse layer (fused only): router logits from the normalized rows, then the
      // experts' weighted sum added into the residual stream. Decode passes (graphs) stream the
      // routed experts' weights; passes with prefill rows run one grouped GEMM per projection
      // (FP8 experts; MoeLayer falls back to one GEMM per active expert).
      PD_RETURN_IF_ERROR(post_norm(w.post_norm));
      PD_RETURN_IF_ERROR(
          gemm_->run(router_logits_, kc::GemmOut::kFloat32, x_, w.router, t, c.moe.num_experts, h, stream_));
      const kc::MoePath path = shape.num_prefill > 0 || hooks != nullptr ? kc::MoePath::kGrouped : kc::MoePath::kStream;
      PD_RETURN_IF_ERROR(moe_->forward(block_out, x_, router_logits_, t, w.experts, c.moe.norm_topk_prob, path, stream_,
                                       /*accumulate=*/fused, gemm_.get(), fp8_gemm_.get()));
      if (tp) PD_RETURN_IF_ERROR(all_reduce(block_out, static_cast<int64_t>(t) * h));
      continue;
    }
    if (w.gate_up8.data != nullptr) {
      PD_RETURN_IF_ERROR(post_norm(w.post_norm));
      PD_RETURN_IF_ERROR(fp8_gemm_->run(gate_up_buf_, x_, t, w.gate_up8, stream_));
      PD_RETURN_IF_ERROR(kc::silu_mul(act_buf_, gate_up_buf_, t, inter, stream_));
      PD_RETURN_IF_ERROR(fp8_gemm_->run(block_out, act_buf_, t, w.down8, stream_, /*accumulate=*/fused));
      if (tp) PD_RETURN_IF_ERROR(all_reduce(block_out, static_cast<int64_t>(t) * h));
      continue;
    }
    if (fused) {
      PD_RETURN_IF_ERROR(gemm_->run(gate_up_buf_, kc::GemmOut::kBFloat16, residual_, w.gate_up, t, 2 * inter, h,
                                    stream_, normed(w.post_norm)));
    } else {
      PD_RETURN_IF_ERROR(post_norm(w.post_norm));
      PD_RETURN_IF_ERROR(gemm_->run(gate_up_buf_, kc::GemmOut::kBFloat16, x_, w.gate_up, t, 2 * inter, h, stream_));
    }
    PD_RETURN_IF_ERROR(kc::silu_mul(act_buf_, gate_up_buf_, t, inter, stream_));
    PD_RETURN_IF_ERROR(gemm_->run(block_out, kc::GemmOut::kBFloat16, act_buf_, w.down, t, h, inter, stream_,
                                  fused ? accumulate : kc::GemmFusion{}));
    if (tp) PD_RETURN_IF_ERROR(all_reduce(block_out, static_cast<int64_t>(t) * h));
  }
  // Only rank 0 computes logits: every rank holds the same residual stream after the last
  // reduction, and the lm_head is replicated (README: why not vocabulary-parallel).
  if (shape.num_sample == 0 || tp_.rank != 0) return Status::Ok();
  return final_logits(shape.num_sample, t);
}

Status CudaModelRunner::final_logits(int32_t num_rows, int32_t num_tokens) {
  const auto& c = config_;
  const int32_t h = c.hidden_size;
  const int32_t* rows = d_ints_ + off_sample_rows_;
  const bool tp = tp_.tp_size > 1;
  const bool fused = options_.fuse_norms_into_gemms && !tp;
  const bf16* const block_out = tp ? tp_out_ : x_;  // unfused: the last block's output, added to residual_ by the norm
  // Final (residual add and) norm only for the rows asked for.
  if (fused) {
    PD_RETURN_IF_ERROR(kc::embedding_lookup(sample_hidden_, residual_, rows, num_rows, num_tokens, h, stream_));
    PD_RETURN_IF_ERROR(
        kc::rmsnorm(sample_hidden_, sample_hidden_, nullptr, final_norm_, num_rows, h, c.rms_norm_eps, stream_));
  } else {
    bf16* residual_rows = gate_up_buf_;  // scratch: [num_rows][H] fits in [T][2I]
    PD_RETURN_IF_ERROR(kc::embedding_lookup(sample_hidden_, block_out, rows, num_rows, num_tokens, h, stream_));
    PD_RETURN_IF_ERROR(kc::embedding_lookup(residual_rows, residual_, rows, num_rows, num_tokens, h, stream_));
    PD_RETURN_IF_ERROR(
        kc::rmsnorm(sample_hidden_, sample_hidden_, residual_rows, final_norm_, num_rows, h, c.rms_norm_eps, stream_));
  }
  return gemm_->run(logits_, kc::GemmOut::kFloat32, sample_hidden_, lm_head_, num_rows, c.vocab_size, h, stream_);
}

Status CudaModelRunner::collect_prompt_logprobs(const StepInput& input, const std::vector<int32_t>& last_token_of,
                                                int32_t num_tokens, StepOutput* out) {
  const auto vocab = static_cast<size_t>(config_.vocab_size);
  std::vector<float> rows_logits;
  for (size_t i = 0; i < input.seqs.size(); ++i) {
    const SeqStep& s = input.seqs[i];
    const int32_t num_rows = num_prompt_logprob_rows(s);
    if (num_rows == 0) continue;
    const int32_t first_row = last_token_of[i] - (s.num_new_tokens - 1);
    PromptLogprobsChunk chunk{static_cast<int32_t>(i), s.num_computed_tokens, {}};
    chunk.rows.reserve(static_cast<size_t>(num_rows));
    // The pass's hidden rows are still in place: final norm and lm_head for max_num_seqs rows at a time
    // (the sampled rows' buffers), then each row's logprobs on the host, as for top-n logprobs rows.
    for (int32_t done = 0; done < num_rows; done += options_.max_num_seqs) {
      const int32_t n = std::min(options_.max_num_seqs, num_rows - done);
      for (int32_t r = 0; r < n; ++r) h_ints_[off_sample_rows_ + static_cast<size_t>(r)] = first_row + done + r;
      PD_RETURN_IF_ERROR(copy_step_inputs(off_sample_rows_, static_cast<size_t>(n)));
      PD_RETURN_IF_ERROR(final_logits(n, num_tokens));
      rows_logits.resize(static_cast<size_t>(n) * vocab);
      PD_RETURN_IF_ERROR(
          kc::cuda_status(cudaMemcpyAsync(rows_logits.data(), logits_, rows_logits.size() * sizeof(float),
                                          cudaMemcpyDeviceToHost, stream_),
                          "prompt logits copy"));
      PD_RETURN_IF_ERROR(kc::cuda_status(cudaStreamSynchronize(stream_), "prompt logits sync"));
      for (int32_t r = 0; r < n; ++r) {
        const auto position = static_cast<size_t>(s.num_computed_tokens + done + r);
        chunk.rows.push_back(
            prompt_position_logprobs(std::span<const float>(rows_logits.data() + static_cast<size_t>(r) * vocab, vocab),
                                     s.prompt_token_ids[position + 1], s.prompt_logprobs));
      }
    }
    out->prompt_logprobs.push_back(std::move(chunk));
  }
  return Status::Ok();
}

Status CudaModelRunner::run_decode_graph(int32_t bucket, const PassShape& shape) {
  auto it = graphs_.find(bucket);
  if (it == graphs_.end()) {
    // Warm-up pass outside capture (cuBLASLt plans for these shapes) with the
    // current inputs, then capture the same pass.
    PD_RETURN_IF_ERROR(forward(shape, nullptr));
    cudaGraph_t graph = nullptr;
    PD_RETURN_IF_ERROR(
        kc::cuda_status(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "begin capture"));
    const Status st = forward(shape, nullptr);
    const cudaError_t end = cudaStreamEndCapture(stream_, &graph);
    if ((!st.ok() || end != cudaSuccess) && graph != nullptr) cudaGraphDestroy(graph);
    PD_RETURN_IF_ERROR(st);
    PD_RETURN_IF_ERROR(kc::cuda_status(end, "end capture"));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    PD_RETURN_IF_ERROR(kc::cuda_status(inst, "graph instantiate"));
    it = graphs_.emplace(bucket, exec).first;
  }
  return kc::cuda_status(cudaGraphLaunch(it->second, stream_), "graph launch");
}

Result<float> CudaModelRunner::time_decode_graph(int32_t num_seqs, int reps) {
  auto it = graphs_.lower_bound(num_seqs);  // buckets are ascending: the first >= num_seqs serves it
  if (it == graphs_.end() || reps <= 0) {
    return failed_precondition("cuda runner: no decode graph captured for {} seqs (or reps {} <= 0)", num_seqs, reps);
  }
  cudaEvent_t start = nullptr, stop = nullptr;
  PD_RETURN_IF_ERROR(kc::cuda_status(cudaEventCreate(&start), "event create"));
  PD_RETURN_IF_ERROR(kc::cuda_status(cudaEventCreate(&stop), "event create"));
  std::vector<float> ms(static_cast<size_t>(reps));
  Status st = Status::Ok();
  for (int r = 0; r < reps && st.ok(); ++r) {
    st = kc::cuda_status(cudaEventRecord(start, stream_), "event record");
    if (st.ok()) st = kc::cuda_status(cudaGraphLaunch(it->second, stream_), "graph launch");
    if (st.ok()) st = kc::cuda_status(cudaEventRecord(stop, stream_), "event record");
    if (st.ok()) st = kc::cuda_status(cudaEventSynchronize(stop), "event sync");
    if (st.ok()) st = kc::cuda_status(cudaEventElapsedTime(&ms[static_cast<size_t>(r)], start, stop), "elapsed");
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  PD_RETURN_IF_ERROR(st);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

Result<StepOutput> CudaModelRunner::execute(const StepInput& input) {
  PD_RETURN_IF_ERROR(validate(input));
  PD_RETURN_IF_ERROR(kc::cuda_status(cudaSetDevice(options_.device), "cudaSetDevice"));
  // Internal order: decode sequences (one new token) first, then the rest.
  std::vector<int32_t> order;
  order.reserve(input.seqs.size());
  for (size_t i = 0; i < input.seqs.size(); ++i)
    if (input.seqs[i].num_new_tokens == 1) order.push_back(static_cast<int32_t>(i));
  const auto num_decode = static_cast<int32_t>(order.size());
  for (size_t i = 0; i < input.seqs.size(); ++i)
    if (input.seqs[i].num_new_tokens != 1) order.push_back(static_cast<int32_t>(i));
  const auto num_seqs = static_cast<int32_t>(order.size());

  PassShape shape;
  shape.num_decode = num_decode;
  shape.num_prefill = num_seqs - num_decode;
  const bool use_graph = options_.enable_cuda_graphs && input.layer_hooks == nullptr && shape.num_prefill == 0 &&
                         num_decode <= decode_buckets_.back();
  // decode_buckets_ ascend: the first one >= num_seqs serves it (they cover every use_graph batch).
  const int32_t bucket =
      use_graph ? *std::lower_bound(decode_buckets_.begin(), decode_buckets_.end(), num_seqs) : num_seqs;
  int32_t* tok = h_ints_ + off_tokens_;
  int32_t* pos = h_ints_ + off_positions_;
  int32_t* slot = h_ints_ + off_slots_;
  int32_t* qstart = h_ints_ + off_qstart_;
  int32_t* ctx = h_ints_ + off_ctx_;
  int32_t* tables = h_ints_ + off_tables_;
  int32_t* sample_rows = h_ints_ + off_sample_rows_;
  int32_t* supp = h_ints_ + off_suppressed_;
  std::vector<int32_t> last_token_of(input.seqs.size());
  int32_t t = 0;
  qstart[0] = 0;
  for (int32_t i = 0; i < num_seqs; ++i) {
    const SeqStep& s = input.seqs[static_cast<size_t>(order[static_cast<size_t>(i)])];
    for (int32_t j = 0; j < s.num_new_tokens; ++j) {
      const int32_t p = s.num_computed_tokens + j;
      tok[t] = input.token_ids[static_cast<size_t>(s.token_offset + j)];
      pos[t] = p;
      slot[t] =
          s.block_table[static_cast<size_t>(p / options_.block_size)] * options_.block_size + p % options_.block_size;
      ++t;
    }
    qstart[i + 1] = t;
    ctx[i] = s.num_computed_tokens + s.num_new_tokens;
    const int32_t nb = ceil_div(ctx[i], options_.block_size);
    std::copy_n(s.block_table.begin(), nb, tables + static_cast<size_t>(i) * max_blocks_per_seq_);
    last_token_of[static_cast<size_t>(order[static_cast<size_t>(i)])] = t - 1;
    shape.max_context = std::max(shape.max_context, ctx[i]);
    if (i >= num_decode) shape.max_prefill_q = std::max(shape.max_prefill_q, s.num_new_tokens);
  }
  if (use_graph) t = append_padding_rows(num_seqs, bucket, t);
  shape.num_tokens = t;
  // Sampled rows, in StepInput order.
  std::vector<int32_t> sampled_seq;
  std::vector<int32_t> host_rows;
  int32_t num_supp = 0;
  for (size_t i = 0; i < input.seqs.size(); ++i) {
    const SeqStep& s = input.seqs[i];
    if (!s.sample) continue;
    const auto r = static_cast<int32_t>(sampled_seq.size());
    sampled_seq.push_back(static_cast<int32_t>(i));
    sample_rows[r] = last_token_of[i];
    kc::RowSampling& rs = h_sampling_[r];
    rs.temperature = s.sampling.temperature;
    rs.min_p = s.sampling.min_p;
    rs.rng_seed = s.rng_seed;
    rs.suppressed_begin = num_supp;
    const int32_t n = std::min<int32_t>(static_cast<int32_t>(s.suppressed_token_ids.size()), kc::kMaxSuppressedPerRow);
    std::copy_n(s.suppressed_token_ids.begin(), n, supp + num_supp);
    num_supp += n;
    rs.suppressed_end = num_supp;
    if (needs_host_sampling(s)) host_rows.push_back(r);
  }
  const auto num_sample = static_cast<int32_t>(sampled_seq.size());
  shape.num_sample = num_sample;
  const int32_t rows_written = use_graph ? bucket : num_seqs;
  if (use_graph) {
    for (int32_t r = num_sample; r < bucket; ++r) sample_rows[r] = 0;
    shape.num_sample = bucket;
    shape.num_decode = bucket;
    shape.max_context = options_.max_model_len;  // the captured decode split covers any context
  }
  // Copy the used part of each input section.
  PD_RETURN_IF_ERROR(copy_step_inputs(off_tokens_, static_cast<size_t>(t)));
  PD_RETURN_IF_ERROR(copy_step_inputs(off_positions_, static_cast<size_t>(t)));
  PD_RETURN_IF_ERROR(copy_step_inputs(off_slots_, static_cast<size_t>(t)));
  PD_RETURN_IF_ERROR(copy_step_inputs(off_qstart_, static_cast<size_t>(rows_written) + 1));
  PD_RETURN_IF_ERROR(copy_step_inputs(off_ctx_, static_cast<size_t>(rows_written)));
  PD_RETURN_IF_ERROR(copy_step_inputs(off_sample_rows_, static_cast<size_t>(std::max(shape.num_sample, 1))));
  if (num_supp > 0) PD_RETURN_IF_ERROR(copy_step_inputs(off_suppressed_, static_cast<size_t>(num_supp)));
  PD_RETURN_IF_ERROR(copy_step_inputs(off_tables_, static_cast<size_t>(num_seqs) * max_blocks_per_seq_));
  if (num_sample > 0) {
    PD_RETURN_IF_ERROR(kc::cuda_status(cudaMemcpyAsync(d_sampling_, h_sampling_, num_sample * sizeof(kc::RowSampling),
                                                       cudaMemcpyHostToDevice, stream_),
                                       "sampling params copy"));
  }

  if (options_.kv_fp8 && shape.num_prefill > 0) {
    PD_RETURN_IF_ERROR(fp8_kv_prefill_->prepare(
        ctx + num_decode, tables + static_cast<size_t>(num_decode) * max_blocks_per_seq_, shape.num_prefill, stream_));
  }
  if (use_graph) {
    PD_RETURN_IF_ERROR(run_decode_graph(bucket, shape));
  } else {
    PD_RETURN_IF_ERROR(forward(shape, input.layer_hooks));
  }
  StepOutput out;
  if (num_sample == 0 || tp_.rank != 0) {  // ranks other than 0 compute no logits
    PD_RETURN_IF_ERROR(sync_stream("step sync"));
    if (tp_.rank == 0) PD_RETURN_IF_ERROR(collect_prompt_logprobs(input, last_token_of, t, &out));
    return out;
  }
  // Raw logits of the rows the CPU sampler handles, before the GPU kernel edits rows.
  std::vector<std::vector<float>> host_logits(host_rows.size());
  for (size_t k = 0; k < host_rows.size(); ++k) {
    host_logits[k].resize(static_cast<size_t>(config_.vocab_size));
    PD_RETURN_IF_ERROR(kc::cuda_status(
        cudaMemcpyAsync(host_logits[k].data(), logits_ + static_cast<size_t>(host_rows[k]) * config_.vocab_size,
                        static_cast<size_t>(config_.vocab_size) * sizeof(float), cudaMemcpyDeviceToHost, stream_),
        "logits row copy"));
  }
  int32_t* d_tokens = d_ints_ + off_out_tokens_;
  PD_RETURN_IF_ERROR(kc::sample_rows(logits_, num_sample, config_.vocab_size, d_sampling_, d_ints_ + off_suppressed_,
                                     d_tokens, d_logprobs_, stream_));
  PD_RETURN_IF_ERROR(kc::cuda_status(cudaMemcpyAsync(h_ints_ + off_out_tokens_, d_tokens, num_sample * sizeof(int32_t),
                                                     cudaMemcpyDeviceToHost, stream_),
                                     "token copy"));
  PD_RETURN_IF_ERROR(kc::cuda_status(
      cudaMemcpyAsync(h_logprobs_, d_logprobs_, num_sample * sizeof(float), cudaMemcpyDeviceToHost, stream_),
      "logprob copy"));
  PD_RETURN_IF_ERROR(sync_stream("step sync"));
  out.sampled.resize(static_cast<size_t>(num_sample));
  for (int32_t r = 0; r < num_sample; ++r) {
    out.sampled[static_cast<size_t>(r)].token_id = h_ints_[off_out_tokens_ + static_cast<size_t>(r)];
    out.sampled[static_cast<size_t>(r)].logprob = h_logprobs_[r];
  }
  for (size_t k = 0; k < host_rows.size(); ++k) {
    const int32_t r = host_rows[k];
    const SeqStep& s = input.seqs[static_cast<size_t>(sampled_seq[static_cast<size_t>(r)])];
    out.sampled[static_cast<size_t>(r)] = sample_step_token(host_logits[k], s);
  }
  PD_RETURN_IF_ERROR(collect_prompt_logprobs(input, last_token_of, t, &out));
  return out;
}

}  // namespace pd::engine
