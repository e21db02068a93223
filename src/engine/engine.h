// The engine facade: one thread owns all scheduling state (STYLE.md §3).
// HTTP threads call add_request/abort, which post messages into the engine's
// queue; results come back through each request's OutputCallback, invoked on
// the engine thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/kv_connector.h"
#include "engine/model_runner.h"
#include "engine/request.h"

namespace pd::tokenizer {
class Tokenizer;
}

namespace pd::engine {

struct EngineConfig {
  int32_t max_num_seqs = 256;             // --max-num-seqs
  int32_t max_num_batched_tokens = 2048;  // --max-num-batched-tokens (token budget per step)
  int32_t max_model_len = 4096;           // --max-model-len (prompt + output)
  bool enable_prefix_caching = true;
  bool enable_chunked_prefill = true;
  uint64_t seed = 0;                   // --seed: base for requests without their own seed
  std::vector<int32_t> eos_token_ids;  // from the model's config / tokenizer
  size_t max_waiting_requests = 4096;  // beyond this add_request returns kResourceExhausted (HTTP 503)
  // P/D consumer admission reserve (SchedulerConfig::remote_output_reserve):
  // --remote-output-reserve (fraction of max output tokens, negative = none)
  // and --kv-watermark (fraction of all blocks).
  double remote_output_reserve = 1.0;
  double kv_watermark = 0.01;
  std::string model_name = "pdserve";  // the model_name label of the vllm:* metrics (served model name)
};

// A consistent snapshot, cheap to take from any thread.
struct EngineStats {
  int32_t num_running = 0;
  int32_t num_waiting = 0;
  int32_t num_blocks_total = 0;
  int32_t num_blocks_free = 0;    // free, including cached-but-unreferenced blocks
  int32_t num_blocks_in_use = 0;  // referenced by a live request (or held for a transfer)
  int64_t num_prompt_tokens = 0;  // cumulative
  int64_t num_generation_tokens = 0;
  int64_t num_preemptions = 0;
  int64_t num_recomputed_tokens = 0;           // KV thrown away by preemptions, computed again
  int64_t num_remote_admissions_deferred = 0;  // remote requests that waited for the reserve
  int64_t num_prefix_cache_hit_tokens = 0;
  int64_t num_steps = 0;
  int64_t num_step_errors = 0;            // runner failures (each failed its step's requests)
  int32_t num_waiting_for_remote_kv = 0;  // included in num_waiting
  int64_t num_handed_over_tokens = 0;     // first tokens taken from a P/D producer
  int64_t num_handed_over_tokens_ignored = 0;
  int64_t num_first_tokens_streamed_on_arrival = 0;  // of those, streamed before the engine thread took them
};

class Engine {
 public:
  // tokenizer may be null: token-id prompts still work; stop strings and
  // text deltas need it (add_request rejects stop strings without one).
  static Result<std::unique_ptr<Engine>> create(EngineConfig config, std::unique_ptr<ModelRunner> runner,
                                                std::shared_ptr<const tokenizer::Tokenizer> tokenizer);
  // With a P/D connector (kv_connector.h); null behaves exactly like the
  // overload above. The engine owns it and destroys it before the runner, so
  // a connector may keep a raw pointer to the runner (e.g. for kv_layer_base).
  static Result<std::unique_ptr<Engine>> create(EngineConfig config, std::unique_ptr<ModelRunner> runner,
                                                std::shared_ptr<const tokenizer::Tokenizer> tokenizer,
                                                std::unique_ptr<KvConnector> connector);
  virtual ~Engine() = default;

  // Thread-safe. Validates (ids in vocab, length vs max_model_len, sampling
  // ranges, duplicate id) and enqueues. On error nothing is enqueued and the
  // callback is never called.
  virtual Status add_request(GenerateRequest request, OutputCallback on_output) = 0;
  // Thread-safe; a message to the engine thread. Unknown or finished ids are
  // ignored. The request's callback receives a final output with kAbort.
  virtual void abort(const std::string& request_id) = 0;
  virtual EngineStats stats() const = 0;
  virtual const EngineConfig& config() const = 0;
  virtual const KvCacheSpec& kv_cache_spec() const = 0;
  // Aborts every live request, stops and joins the engine thread. Idempotent.
  virtual void shutdown() = 0;
};

}  // namespace pd::engine
