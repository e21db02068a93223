// The boundary between the engine core (pure CPU scheduling) and a device
// runner (cpu reference or cuda). The engine builds one StepInput per step;
// the runner computes the forward pass over the paged KV cache and samples.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/sampling_params.h"

namespace pd::engine {

// kFp8E4m3: float8 e4m3fn values with one fp32 scale per (token, kv head)
// stored inside the block (see KvCacheSpec); chosen by --kv-cache-dtype fp8.
enum class KvDtype : uint8_t { kFloat32, kBFloat16, kFloat16, kFp8E4m3 };
// Bytes of one K or V element (1 for fp8: its scales come on top, see below).
size_t kv_dtype_bytes(KvDtype dtype);
// The name in the connector's layout fingerprint and in logs: "float32",
// "bfloat16", "float16", "fp8_e4m3".
const char* kv_dtype_name(KvDtype dtype);

// KV layout per layer: [num_blocks][block], one (layer, block) being one
// contiguous segment of bytes_per_block() bytes that moves as it is over the
// connector. Inside a block of B tokens, H kv heads, head_dim D:
//   float32 / bfloat16 / float16: [2 (K,V)][B][H][D] elements.
//   fp8_e4m3: [2 (K,V)][B][H][D] one-byte e4m3 codes (K codes at byte 0, V codes
//     at byte B*H*D), then [2 (K,V)][B][H] fp32 scales (K scales at byte
//     2*B*H*D, V scales at 2*B*H*D + 4*B*H). The value of element (t, h, i) is
//     e4m3(code) * scale[t][h]; a writer sets scale = amax_i |x[t][h][i]| / 448
//     (1 when that is 0) and code = e4m3(x / scale), rounded to nearest even.
//     D + 4 bytes per (token, head) and tensor, vs 2 * D in bfloat16.
struct KvCacheSpec {
  int32_t num_layers = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t block_size = 16;
  KvDtype dtype = KvDtype::kFloat32;
  int32_t num_blocks = 0;

  size_t bytes_per_block() const {
    const size_t scale_bytes = dtype == KvDtype::kFp8E4m3 ? sizeof(float) : 0;
    return 2ull * block_size * num_kv_heads * (head_dim * kv_dtype_bytes(dtype) + scale_bytes);
  }
  size_t bytes_per_layer() const { return bytes_per_block() * static_cast<size_t>(num_blocks); }
};

// One sequence's slice of a step. Tokens at positions
// [num_computed_tokens, num_computed_tokens + num_new_tokens) are computed now;
// their token ids are StepInput::token_ids[token_offset, token_offset + num_new_tokens).
struct SeqStep {
  int32_t token_offset = 0;
  int32_t num_new_tokens = 0;
  int32_t num_computed_tokens = 0;
  // Block ids covering positions [0, num_computed_tokens + num_new_tokens).
  std::vector<int32_t> block_table;
  // True when this step computes the last known token, so a next token is sampled.
  bool sample = false;
  SamplingParams sampling;  // valid when sample == true
  // Seed for this (request, output index): counter-based so CPU and GPU agree.
  uint64_t rng_seed = 0;
  // Token ids generated so far (for min_tokens handling of EOS/stop ids).
  int32_t num_output_tokens = 0;
  std::vector<int32_t> suppressed_token_ids;  // masked to -inf before sampling (eos while < min_tokens)
  // The request's prompt and generated tokens (penalties, bad words): views
  // into the engine's request, valid during execute(); empty when unused.
  std::span<const int32_t> prompt_token_ids;
  std::span<const int32_t> output_token_ids;
  // Structured output: when non-empty, only the ids whose bit is set may be sampled (bit t % 32
  // of word t / 32; engine/token_constraint.h), applied before every other step of sampling, so
  // the returned logprobs see disallowed ids as -inf (vLLM applies its grammar bitmask to the
  // logits the same way). A view into the engine's request, valid during execute().
  std::span<const uint32_t> allowed_token_mask;
  // >= 0: the runner returns prompt logprobs (StepOutput::prompt_logprobs) for
  // each new position p < prompt_token_ids.size() - 1: the log-softmax of p's
  // raw logits at prompt_token_ids[p + 1], its rank and this many top entries.
  // prompt_token_ids is set whenever this is.
  int32_t prompt_logprobs = -1;
};

// Worker-side P/D connector hooks (DESIGN.md §3.3), called by a runner inside
// execute(): wait_for_layer_load before a layer reads its KV, save_layer after
// a layer's attention wrote its KV (so per-layer transfer overlaps the rest of
// the forward pass). What to load or save comes from the connector's own
// per-step metadata, built on the engine thread before execute().
class LayerKvHooks {
 public:
  virtual ~LayerKvHooks() = default;
  virtual void wait_for_layer_load(int32_t layer) = 0;
  virtual void save_layer(int32_t layer) = 0;
};

struct StepInput {
  std::vector<int32_t> token_ids;  // all new tokens of all seqs, concatenated
  std::vector<SeqStep> seqs;
  LayerKvHooks* layer_hooks = nullptr;  // null when no connector is active
};

struct SampledToken {
  int32_t token_id = -1;
  float logprob = 0.0f;                                 // log-softmax of the raw logits (before temperature)
  std::vector<std::pair<int32_t, float>> top_logprobs;  // when sampling.logprobs > 0
};

// The distribution at one prompt position, seen from the prompt token that follows it.
struct PromptPositionLogprobs {
  int32_t token_id = -1;                                // the prompt token at position + 1
  float logprob = 0.0f;                                 // its log-softmax over the raw logits
  int32_t rank = 0;                                     // 1 + the number of ids with a strictly larger logit
  std::vector<std::pair<int32_t, float>> top_logprobs;  // descending, ties by lower id
};

// Prompt logprobs of one SeqStep: rows[i] belongs to position first_position + i.
struct PromptLogprobsChunk {
  int32_t seq_index = 0;  // into StepInput::seqs
  int32_t first_position = 0;
  std::vector<PromptPositionLogprobs> rows;
};

struct StepOutput {
  // One entry per SeqStep with sample == true, in StepInput::seqs order.
  std::vector<SampledToken> sampled;
  // One entry per SeqStep with prompt_logprobs >= 0 that computes a position
  // before the last prompt token, in StepInput::seqs order.
  std::vector<PromptLogprobsChunk> prompt_logprobs;
};

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;
  virtual const KvCacheSpec& kv_cache_spec() const = 0;
  virtual int32_t vocab_size() const = 0;
  virtual Result<StepOutput> execute(const StepInput& input) = 0;
  // Base address of one layer's KV region (for xfer registration by the connector).
  virtual void* kv_layer_base(int32_t layer) = 0;
  virtual bool kv_on_device() const = 0;
  // CUDA device ordinal holding the KV regions; -1 for host memory.
  virtual int32_t kv_device_index() const { return kv_on_device() ? 0 : -1; }
  // Tensor-parallel KV shards, for the connector: each rank holds its own region
  // per layer with KV heads [kv_rank_head_begin, + kv_heads_per_rank) of the
  // model in every block (KvCacheSpec's layout with kv_heads_per_rank heads).
  // One rank by default: the whole cache (kv_layer_base).
  virtual int32_t kv_num_ranks() const { return 1; }
  virtual int32_t kv_heads_per_rank() const { return kv_cache_spec().num_kv_heads; }
  virtual int32_t kv_rank_head_begin(int32_t) const { return 0; }
  virtual void* kv_rank_layer_base(int32_t rank, int32_t layer) { return rank == 0 ? kv_layer_base(layer) : nullptr; }
};

}  // namespace pd::engine
