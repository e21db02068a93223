// What callers (server, connector) hand the engine and what it hands back.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "contract/transfer_types.h"
#include "engine/sampling_params.h"
#include "engine/token_constraint.h"

namespace pd::engine {

// Request lifecycle (docs/engine.md has the transition table). Ordered: a
// request only moves forward, except Preempted -> Waiting.
enum class RequestState : uint8_t {
  kWaiting,             // queued, no KV computed (or preempted and reset)
  kWaitingForRemoteKv,  // P/D consumer: blocks allocated, KV arriving from a producer
  kRunning,             // scheduled; num_computed_tokens advances each step
  kPreempted,           // blocks taken back; returns to kWaiting and recomputes
  kFinishedStopped,     // EOS, stop id or stop string
  kFinishedLength,      // max_tokens or max_model_len reached
  kFinishedAborted,     // client abort/disconnect
  kFinishedError,       // engine-side failure for this request only
};
bool is_finished(RequestState state);
const char* request_state_name(RequestState state);

enum class FinishReason : uint8_t { kNone, kStop, kLength, kAbort, kError };
// OpenAI spelling: "stop", "length", "abort", "error"; kNone -> null.
const char* finish_reason_name(FinishReason reason);

struct GenerateRequest {
  std::string request_id;  // unique among live requests
  std::vector<int32_t> prompt_token_ids;
  SamplingParams sampling;
  // vLLM's kv_transfer_params extension, parsed and validated against this instance
  // at the HTTP edge (the connector's parser); the connector acts on it.
  std::optional<contract::TransferParams> kv_transfer_params;
  int64_t arrival_ns = 0;  // 0 = stamped by the engine on arrival
  // Structured output (compiled at the HTTP edge): every sampled token obeys it; the engine
  // takes it over, and nothing else may use it once the request is added.
  std::shared_ptr<TokenConstraint> constraint;
};

struct TopLogprob {
  int32_t token_id;
  float logprob;
};
struct TokenLogprob {
  int32_t token_id;
  float logprob;
  std::vector<TopLogprob> top;  // descending by logprob, length = SamplingParams::logprobs
};

// One prompt token's logprob given the tokens before it (vLLM's prompt_logprobs entry).
struct PromptTokenLogprob {
  int32_t token_id = -1;
  float logprob = 0.0f;
  int32_t rank = 0;             // 1 + the ids the model found strictly more likely there
  std::vector<TopLogprob> top;  // descending by logprob, length = SamplingParams::prompt_logprobs
};

// A delta for one request. Outputs for one request arrive in order; the last
// has finished = true and nothing arrives after it.
struct RequestOutput {
  std::string request_id;
  std::vector<int32_t> new_token_ids;
  std::string text_delta;              // detokenized, never a broken UTF-8 sequence
  std::vector<TokenLogprob> logprobs;  // parallel to new_token_ids when requested
  // With SamplingParams::prompt_logprobs >= 0, on the output that carries the first
  // token: one entry per prompt token after the first (the first has no context).
  std::vector<PromptTokenLogprob> prompt_logprobs;
  bool finished = false;
  FinishReason finish_reason = FinishReason::kNone;
  // The stop string or token id that ended the request, if any (OpenAI "stop_reason").
  std::optional<std::string> stop_string;
  std::optional<int32_t> stop_token_id;
  int32_t num_prompt_tokens = 0;
  int32_t num_output_tokens = 0;  // total so far
  int32_t num_cached_tokens = 0;  // prompt tokens served from prefix cache or remote KV
  std::string error;              // set when finish_reason == kError
  // With kError: the request's own input was refused after admission (e.g. a P/D
  // producer refused its kv_transfer_params) -- the client's fault (HTTP 400),
  // not the engine's.
  bool invalid_request = false;
  // With kError: the request names state already in use here (a P/D transfer id
  // that is active on this instance): the caller's error (HTTP 409).
  bool conflict = false;
  // What a P/D producer returns on finish (the server writes it as kv_transfer_params).
  std::optional<contract::ProducerAnswer> kv_transfer_params;
};

// Called on the engine thread. Must not block and must not call back into the
// engine synchronously (post elsewhere instead).
using OutputCallback = std::function<void(RequestOutput)>;

}  // namespace pd::engine
