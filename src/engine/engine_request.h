// The engine's own record of one live request. Owned by the engine thread
// (scheduler + output processing); the connector sees it as const& only.
//
// Progress is one number: num_computed_tokens, the count of leading positions
// of token_ids whose KV is in this request's blocks. Chunked prefill, prefix
// hits, remote KV arrival and preemption all just move that number.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/generate_api.h"
#include "engine/sampling_params.h"
#include "engine/token_constraint.h"

namespace pd::engine {

using BlockHash = uint64_t;

// State that another owner keeps on a request (Request::engine_io, Request::connector_state):
// the request holds it from the moment the owner sets it until the request is destroyed, so
// it lives exactly as long as the request without a map keyed by its id. The scheduler never
// looks inside; each owner casts back to its own type.
class RequestSlot {
 public:
  virtual ~RequestSlot() = default;
};

// Owns one RequestSlot. A copy of a request (a snapshot of its tokens and params, such
// as the engine's early first-token slot keeps) owns no slot: the slot belongs to the
// one live request.
class OwnedRequestSlot {
 public:
  OwnedRequestSlot() = default;
  OwnedRequestSlot(const OwnedRequestSlot&) noexcept {}
  OwnedRequestSlot& operator=(const OwnedRequestSlot&) = delete;
  OwnedRequestSlot(OwnedRequestSlot&&) noexcept = default;
  OwnedRequestSlot& operator=(OwnedRequestSlot&&) noexcept = default;
  OwnedRequestSlot& operator=(std::unique_ptr<RequestSlot> slot) {
    slot_ = std::move(slot);
    return *this;
  }
  RequestSlot* get() const { return slot_.get(); }
  void reset() { slot_.reset(); }

 private:
  std::unique_ptr<RequestSlot> slot_;
};

class Request {
 public:
  Request(std::string request_id, uint64_t arrival_seq, std::vector<int32_t> prompt_token_ids, SamplingParams sampling,
          std::optional<contract::TransferParams> kv_transfer_params, int64_t arrival_ns, uint64_t rng_base_seed,
          int32_t max_output_tokens);

  const std::string& request_id() const { return request_id_; }
  // Engine-local arrival counter: unique for the engine's lifetime, unlike
  // request_id (a client may reuse an id after the request finished).
  uint64_t arrival_seq() const { return arrival_seq_; }
  RequestState state() const { return state_; }
  // Enforces the transition table of docs/engine.md; an illegal move is a bug
  // (kInternal) and leaves the state unchanged.
  Status transition_to(RequestState next);

  // Prompt followed by the generated tokens.
  const std::vector<int32_t>& token_ids() const { return token_ids_; }
  int32_t num_tokens() const { return static_cast<int32_t>(token_ids_.size()); }
  int32_t num_prompt_tokens() const { return num_prompt_tokens_; }
  int32_t num_output_tokens() const { return num_tokens() - num_prompt_tokens_; }
  std::span<const int32_t> output_token_ids() const {
    return std::span<const int32_t>(token_ids_).subspan(static_cast<size_t>(num_prompt_tokens_));
  }
  void append_output_token(int32_t token_id) { token_ids_.push_back(token_id); }

  const SamplingParams& sampling() const { return sampling_; }
  // min(sampling.max_tokens, max_model_len - prompt length), fixed at arrival.
  int32_t max_output_tokens() const { return max_output_tokens_; }
  const std::optional<contract::TransferParams>& kv_transfer_params() const { return kv_transfer_params_; }
  int64_t arrival_ns() const { return arrival_ns_; }
  uint64_t rng_base_seed() const { return rng_base_seed_; }

  // --- KV progress (engine thread only) -------------------------------------
  int32_t num_computed_tokens = 0;
  // Block ids covering positions [0, block_ids.size() * block_size); the
  // first num_computed_tokens positions hold valid KV.
  std::vector<int32_t> block_ids;
  // Chained hashes of the full blocks of token_ids (grows as tokens arrive).
  std::vector<BlockHash> block_hashes;
  // How many leading blocks are registered in the prefix cache (or were hits).
  int32_t num_cached_blocks = 0;
  // Prompt tokens served without computing them (prefix cache or remote KV), for usage.
  int32_t num_cached_tokens = 0;
  int32_t num_preemptions = 0;

  // --- P/D (kv_connector.h) --------------------------------------------------
  // The connector is asked for external KV only while this is true: set for a
  // request that carries kv_transfer_params, cleared on its first admission
  // and never set again, so a preempted or re-admitted request recomputes
  // locally instead of waiting for KV that will never come (DESIGN §6.1).
  bool external_kv_eligible = false;
  // Tokens the connector is loading asynchronously into block_ids while the
  // request is kWaitingForRemoteKv; applied to num_computed_tokens on arrival.
  int32_t num_pending_external_tokens = 0;
  int64_t remote_kv_deadline_ns = 0;
  // Its admission waited at least once for the remote-admission reserve
  // (SchedulerConfig::remote_output_reserve); counted once.
  bool deferred_for_reserve = false;

  // --- state other owners keep on the request (RequestSlot) ----------------
  // The engine loop's output callback and output state (engine.cc), set when the
  // engine thread takes the request in.
  OwnedRequestSlot engine_io;
  // The connector's own state for this request (kv_connector.h): the connector sets it
  // at admission (get_num_new_matched_tokens) and reads it in every later call about
  // the request, last in request_finished. Mutable: the connector gets the request as
  // const& and owns only this slot of it; the engine never looks inside.
  mutable OwnedRequestSlot connector_state;

  // --- output bookkeeping ----------------------------------------------------
  int64_t first_scheduled_ns = 0;  // the first step that computed any of it (end of queueing)
  int64_t first_token_ns = 0;
  int64_t last_token_ns = 0;
  FinishReason finish_reason = FinishReason::kNone;
  // Prompt logprobs computed so far, entry i for prompt token i + 1 (sized on the
  // first chunk; a recompute after preemption overwrites); sent with the first token.
  std::vector<PromptTokenLogprob> prompt_logprobs;

  // --- structured output (engine thread only) ---------------------------------
  // The request's constraint (null for most requests: then nothing below is touched); the
  // mask of its next sampled row (SeqStep::allowed_token_mask views it during execute()); a
  // mask that could not be computed, which ends the request when its token comes back.
  std::shared_ptr<TokenConstraint> constraint;
  std::vector<uint32_t> allowed_token_mask;
  std::string constraint_error;

 private:
  std::string request_id_;
  uint64_t arrival_seq_;
  RequestState state_ = RequestState::kWaiting;
  std::vector<int32_t> token_ids_;
  int32_t num_prompt_tokens_;
  SamplingParams sampling_;
  std::optional<contract::TransferParams> kv_transfer_params_;
  int64_t arrival_ns_;
  uint64_t rng_base_seed_;
  int32_t max_output_tokens_;
};

// True when the transition table (docs/engine.md) allows from -> to.
bool is_valid_transition(RequestState from, RequestState to);

}  // namespace pd::engine
