// The CUDA model runner: bf16 forward pass of the Llama / Qwen2 / Qwen3
// decoder on one GPU (or one tensor-parallel rank of a CudaTpRunner) over a paged KV cache (cuBLASLt GEMMs, kernels
// from kernels/cuda), sampling on the GPU (greedy / temperature / min-p; rows with top-k, top-p or top-n logprobs go
// through the CPU sampler on their logits row). Decode-only steps run as CUDA graphs captured per batch-size bucket;
// padding rows of a bucket write no KV (slot -1) and read no context.
//
// Threads: execute() is called from the engine thread only; the runner owns
// one stream and every device buffer. execute() returns after the step's
// device work is complete (its tokens are on the host).
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <map>
#include <memory>
#include <vector>

#include "engine/model_runner.h"
#include "engine/runner_cuda/fp8_kv_prefill.h"
#include "kernels/cuda/fp8_gemm.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/moe_layer.h"
#include "model/config.h"
#include "model/tp_shard.h"
#include "model/weights.h"

namespace pd::engine {

struct CudaRunnerOptions {
  int32_t device = 0;
  int32_t block_size = 16;
  int32_t max_model_len = 4096;
  int32_t max_num_seqs = 256;
  int32_t max_num_batched_tokens = 8192;
  double gpu_memory_utilization = 0.9;  // share of the device's memory this process may hold
  int32_t num_kv_blocks = 0;            // > 0: exactly this many blocks (overrides the utilization sizing)
  bool enable_cuda_graphs = true;
  kernels::cuda::DecodeKernel decode_kernel = kernels::cuda::DecodeKernel::kTensorCore;
  kernels::cuda::PrefillKernel prefill_kernel = kernels::cuda::PrefillKernel::kGqaTiled;
  kernels::cuda::GemmPolicy gemm_policy = kernels::cuda::GemmPolicy::kAutotune;
  // Programmatic dependent launch for the decode-path kernels (kernels.h) in passes of
  // at most programmatic_launch_max_tokens tokens; set process-wide at each forward pass.
  // Measured on an H200, Qwen3-8B decode (docs/perf/engine.md): 2026-11-30 19:45 UTC, b1 4.63 ms
  // with vs 4.91 without, but b16 6.67 vs 6.34 (worse). 2026-12-01 01:45 UTC, after the skinny GEMMs began
  // loading weights before their wait (and o_proj at M = 16 became one): b16 6.14 with vs
  // 6.28-6.34 without, b64 9.76 vs 9.80, b128 14.69 vs 14.75-14.78.
  bool programmatic_launch = true;
  int32_t programmatic_launch_max_tokens = 256;
  // Decode attention merges its split-K partitions in its last CTA per (sequence, kv head)
  // instead of a second (reduce) kernel; kTensorCore only. Off by default: alone the two
  // take the same time, but whole decode steps measured 0.1-0.4 ms slower at b1 with it in
  // three runs out of three (docs/perf/engine.md, 2026-11-30 22:47 UTC).
  bool decode_merge_in_attention = false;
  // Decode attention split-K partition in tokens (a multiple of 16 up to 2,048); 0 = the
  // rule of decode_partition_tokens_for.
  int32_t decode_partition_tokens = 0;
  // Decode attention loads K/V with an L2 evict-first hint (AttentionArgs). Measured on an
  // H200 (docs/perf/engine.md, 2026-12-01 01:35 UTC): attention 1-4 % faster at b16-b128, whole
  // steps b64/b128 1.5-2 % faster, b1/b16 equal.
  bool decode_kv_evict_first = true;
  // Decode attention: 16-token K/V blocks each warp keeps in flight (AttentionArgs, 2 or
  // 3); 0 = the rule of decode_kv_stages_for.
  int32_t decode_kv_stages = 0;
  // The residual adds run as accumulating stores of o_proj and the down projection, and each
  // RMSNorm travels with the GEMM that reads it (GemmFusion), which computes it in-kernel where
  // the tuner measures that faster (the skinny kernels at decode sizes) and otherwise runs
  // the norm kernel before it. Off: add + norm kernels between the GEMMs, as before.
  bool fuse_norms_into_gemms = true;
  // KV cache in FP8 (--kv-cache-dtype fp8; layout KvCacheSpec / KvDtype::kFp8E4m3): the KV write
  // quantizes each (token, kv head) row, decode attention reads the codes directly, prefill
  // attention reads its blocks dequantized into a bf16 staging area (Fp8KvPrefill).
  bool kv_fp8 = false;
  uint64_t dummy_seed = 0;
};

class NcclGroup;

// One tensor-parallel rank of a CudaTpRunner (cuda_tp_runner.h). The default is
// the whole model on one GPU: tp_size 1, no collectives.
struct CudaTpRank {
  int32_t rank = 0;
  int32_t tp_size = 1;
  NcclGroup* comms = nullptr;                       // required when tp_size > 1
  const std::atomic<bool>* group_failed = nullptr;  // set when a rank failed a step: its peers stop waiting
  int64_t wait_timeout_ms = 120000;                 // a rank's wait for its step (tp_size > 1)
};

class CudaModelRunner final : public ModelRunner {
 public:
  // host_weights: fp32 tensors (safetensors or model::dummy_weights), converted
  // to bf16 on upload; null = dummy weights generated on the GPU from
  // options.dummy_seed (N(0, 0.02)-scaled uniform matrices, unit norms).
  // tp: which rank of a tensor-parallel group this runner is (default: the whole
  // model); a rank holds its slices of the weights (model::plan_tensor_parallel)
  // and of every KV block, and only rank 0 computes logits and samples.
  static Result<std::unique_ptr<CudaModelRunner>> create(model::ModelConfig config,
                                                         const model::ModelWeights* host_weights,
                                                         CudaRunnerOptions options, CudaTpRank tp = {});
  ~CudaModelRunner() override;

  const KvCacheSpec& kv_cache_spec() const override { return spec_; }
  int32_t vocab_size() const override { return config_.vocab_size; }
  Result<StepOutput> execute(const StepInput& input) override;
  void* kv_layer_base(int32_t layer) override;
  bool kv_on_device() const override { return true; }
  int32_t kv_device_index() const override { return options_.device; }

  const model::ModelConfig& config() const { return config_; }
  size_t weight_bytes() const { return weight_bytes_; }
  const model::TpSplit& tp_split() const { return split_; }
  // Bytes of K and V one token occupies over all layers (this rank's KV heads; FP8 KV: codes and scales).
  size_t kv_bytes_per_token() const;
  // Fills the whole KV pool with seeded random values (benchmarks read real data, not zeros).
  Status fill_kv_random(uint64_t seed);
  // The fp32 logits rows of the last execute() (one per sampled seq; rows with
  // suppressed ids hold -inf there; a step with prompt logprobs leaves its last group of
  // prompt rows there instead). For whole-model checks against the CPU runner.
  Result<std::vector<float>> last_logits(int32_t num_rows);
  int32_t num_graphs_captured() const { return static_cast<int32_t>(graphs_.size()); }
  // Decode batch sizes served by one graph (or, without graphs, tuned at load) each.
  const std::vector<int32_t>& decode_buckets() const { return decode_buckets_; }
  // Wall time of prepare_decode_buckets() at load.
  double bucket_preparation_seconds() const { return bucket_preparation_seconds_; }
  // The GEMM plans (what the autotuner measured and chose), for benchmarks.
  const kernels::cuda::Gemm& gemm() const { return *gemm_; }
  // Device time of one replay of the decode graph that serves num_seqs sequences
  // (median of `reps`, milliseconds), on the inputs of the last execute(); the
  // graph must have been captured by an earlier execute(). execute()'s wall time
  // minus this is the host side of a step (preparation, copies, sampling).
  Result<float> time_decode_graph(int32_t num_seqs, int reps);
  // Tokens per split-K partition of decode attention for a batch (public so benchmarks time what the runner runs).
  static int32_t decode_partition_tokens_for(int32_t num_seqs, int32_t num_kv_heads);
  static int32_t decode_kv_stages_for(int32_t num_seqs, int32_t num_kv_heads);

 private:
  friend class CudaTpRunner;  // builds its ranks in phases (create_unprepared, fit_kv_blocks, finish_init)

  struct LayerWeights {
    __nv_bfloat16* input_norm = nullptr;
    __nv_bfloat16* qkv = nullptr;       // [(Hq + 2 Hkv) D][H]: q, k, v rows stacked
    __nv_bfloat16* qkv_bias = nullptr;  // Qwen2
    __nv_bfloat16* q_norm = nullptr;    // Qwen3
    __nv_bfloat16* k_norm = nullptr;
    __nv_bfloat16* o_proj = nullptr;  // [H][Hq D]
    __nv_bfloat16* o_bias = nullptr;
    __nv_bfloat16* post_norm = nullptr;
    __nv_bfloat16* gate_up = nullptr;  // [2 I][H]: gate rows then up rows
    __nv_bfloat16* down = nullptr;     // [H][I]
    // Block-FP8 models: the same linears as e4m3 codes + padded 128 x 128 scales (the bf16
    // pointers above stay null then).
    kernels::cuda::Fp8Weight qkv8, o_proj8, gate_up8, down8;
    // Qwen3-MoE sparse layers: router [E][H] bf16 and the experts (gate_up / down unused).
    __nv_bfloat16* router = nullptr;
    kernels::cuda::MoeWeights experts;
  };
  // Shapes of one forward pass over the internal token order: decode
  // sequences (one token each) first, then prefill sequences.
  struct PassShape {
    int32_t num_tokens = 0;
    int32_t num_decode = 0;
    int32_t num_prefill = 0;
    int32_t max_prefill_q = 0;
    int32_t max_context = 0;
    int32_t num_sample = 0;
  };

  CudaModelRunner() = default;
  // Weights and buffers, no KV pool yet. A tensor-parallel group builds every rank this
  // far, gives all of them the smallest rank's KV block count, then finishes them together
  // (finish_init runs forward passes, whose collectives need every rank).
  static Result<std::unique_ptr<CudaModelRunner>> create_unprepared(model::ModelConfig config,
                                                                    const model::ModelWeights* host_weights,
                                                                    CudaRunnerOptions options, CudaTpRank tp);
  Status init(model::ModelConfig config, const model::ModelWeights* host_weights, CudaRunnerOptions options,
              CudaTpRank tp);
  // KV blocks that fit this rank's device (options.num_kv_blocks when set).
  Result<int64_t> fit_kv_blocks();
  // Allocates num_blocks KV blocks and prepares the decode buckets.
  Status finish_init(int64_t num_blocks);
  Status upload_weights(const model::ModelWeights* host_weights);  // cuda_weights.cc
  Status allocate_buffers();
  Status allocate_kv_pool(int64_t num_blocks);
  // Waits for stream_: cudaStreamSynchronize on one GPU; with ranks, a poll that gives up
  // when another rank failed (tp_.group_failed) or after tp_.wait_timeout_ms.
  Status sync_stream(const char* what);
  // With ranks: data[0, count) = the sum over the ranks (on stream_); nothing on one GPU.
  Status all_reduce(__nv_bfloat16* data, int64_t count);
  // kv_fp8 (fp8_kv_runner.cc): the prefill staging area, and seeded random codes + scales.
  Status create_fp8_kv_prefill();
  Status fill_fp8_kv_random(uint64_t seed);
  Status validate(const StepInput& input) const;
  // Launches the forward pass (through the lm_head) on stream_ for the inputs already in device buffers.
  Status forward(const PassShape& shape, LayerKvHooks* hooks);
  // Final norm and lm_head (fp32 logits_) for num_rows <= max_num_seqs rows of the last pass of
  // num_tokens tokens, the rows named by the device ints at off_sample_rows_.
  Status final_logits(int32_t num_rows, int32_t num_tokens);
  // After the pass (stream idle): SeqStep::prompt_logprobs rows, max_num_seqs at a time
  // through final_logits, their logprobs computed on the host (engine::prompt_position_logprobs).
  Status collect_prompt_logprobs(const StepInput& input, const std::vector<int32_t>& last_token_of, int32_t num_tokens,
                                 StepOutput* out);
  // Decode attention partition for a pass with num_decode decode rows (options, else the rule).
  int32_t decode_partition_tokens(int32_t num_decode) const;
  Status run_decode_graph(int32_t bucket, const PassShape& shape);
  // At load: tunes the GEMM plans of every decode bucket (and captures its graph when
  // graphs are on) with a pass of padding rows, then turns GEMM tuning off, so that no
  // serving step pays for tuning or capture (each costs tens of milliseconds on large
  // weights, and every running request would see it as one long inter-token gap).
  Status prepare_decode_buckets();
  // Writes padding rows [first_row, end_row) into the host step inputs, their tokens from
  // first_token on; returns the token count after them.
  int32_t append_padding_rows(int32_t first_row, int32_t end_row, int32_t first_token);
  // Copies `count` int32s of the step-input region at `offset` to the device (stream-ordered).
  Status copy_step_inputs(size_t offset, size_t count);
  void* alloc(size_t bytes);

  model::ModelConfig config_;
  CudaRunnerOptions options_;
  CudaTpRank tp_;
  model::TpSplit split_;
  // This rank's share of the model (the whole model's at tp_size 1).
  int32_t heads_ = 0, kv_heads_ = 0, inter_ = 0, moe_inter_ = 0;
  KvCacheSpec spec_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<kernels::cuda::Gemm> gemm_;
  std::unique_ptr<kernels::cuda::Fp8Gemm> fp8_gemm_;  // block-FP8 models
  std::unique_ptr<kernels::cuda::MoeLayer> moe_;      // Qwen3-MoE: shared by the sparse layers
  float* router_logits_ = nullptr;                    // [max_num_batched_tokens][E]
  std::vector<void*> allocations_;
  size_t weight_bytes_ = 0;
  size_t free_bytes_at_start_ = 0;  // device memory free before this instance allocated (KV budget)

  __nv_bfloat16* embed_ = nullptr;
  __nv_bfloat16* final_norm_ = nullptr;
  __nv_bfloat16* lm_head_ = nullptr;  // == embed_ when tied
  std::vector<LayerWeights> layers_;
  float* inv_freq_ = nullptr;

  // Activations, sized for max_num_batched_tokens rows.
  __nv_bfloat16* residual_ = nullptr;
  __nv_bfloat16* x_ = nullptr;
  __nv_bfloat16* qkv_buf_ = nullptr;
  __nv_bfloat16* q_buf_ = nullptr;
  __nv_bfloat16* attn_buf_ = nullptr;
  __nv_bfloat16* gate_up_buf_ = nullptr;
  __nv_bfloat16* act_buf_ = nullptr;
  __nv_bfloat16* tp_out_ = nullptr;  // tp_size > 1: [T][H] the rank's partial of o_proj / MLP / MoE, reduced in place
  __nv_bfloat16* sample_hidden_ = nullptr;  // [max_num_seqs][H]
  float* logits_ = nullptr;                 // [max_num_seqs][V]
  void* decode_ws_ = nullptr;
  size_t decode_ws_bytes_ = 0;
  uint32_t* decode_merge_counters_ = nullptr;  // [max_num_seqs][num_kv_heads], zero between launches

  // Step inputs: one int32 region (device + pinned host mirror) at fixed offsets, so a
  // captured graph always reads the same addresses.
  int32_t* d_ints_ = nullptr;
  int32_t* h_ints_ = nullptr;
  size_t ints_count_ = 0;
  size_t off_tokens_ = 0, off_positions_ = 0, off_slots_ = 0, off_qstart_ = 0, off_ctx_ = 0, off_tables_ = 0,
         off_sample_rows_ = 0, off_suppressed_ = 0, off_out_tokens_ = 0;
  int32_t max_blocks_per_seq_ = 0;
  kernels::cuda::RowSampling* d_sampling_ = nullptr;
  kernels::cuda::RowSampling* h_sampling_ = nullptr;
  float* d_logprobs_ = nullptr;
  float* h_logprobs_ = nullptr;

  void* kv_pool_ = nullptr;
  std::unique_ptr<Fp8KvPrefill> fp8_kv_prefill_;  // kv_fp8: prefill attention's bf16 staging

  std::map<int32_t, cudaGraphExec_t> graphs_;  // decode bucket -> instantiated graph
  std::vector<int32_t> decode_buckets_;
  double bucket_preparation_seconds_ = 0.0;
};

}  // namespace pd::engine
