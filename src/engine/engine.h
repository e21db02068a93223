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
#include "engine/engine_stats.h"
#include "engine/generate_api.h"
#include "engine/kv_connector.h"
#include "engine/model_runner.h"

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
