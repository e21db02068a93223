// Scheduler-side P/D connector interface (DESIGN.md §3.3), called only on the
// engine thread (except validate_request, see there). The engine without a connector (nullptr) is a plain engine;
// every call below is skipped then. The connector module implements it; the
// worker-side half is LayerKvHooks (model_runner.h), handed to the runner per
// step by build_step_hooks.
//
// Lifecycle of a request as the connector sees it:
//   admission:  get_num_new_matched_tokens (may set the request's connector slot,
//               Request::connector_state, which the request carries from then on)
//               -> (blocks allocated) -> update_state_after_alloc
//               (async load: request sits in kWaitingForRemoteKv until poll() lists it in
//               finished_recving, or its deadline passes -> on_remote_kv_timeout)
//   each step:  build_step_hooks -> runner.execute -> after_step -> poll
//   preemption: request_preempted (may hold the old blocks until a transfer stops)
//   finish:     request_finished (any finish: stop, length, abort, error; may hold blocks);
//               the slot goes with the request after that call: what the connector must
//               keep past the finish (a hold, a transfer in flight) it keeps by id itself
//
// Block holds: when request_preempted returns true or request_finished returns
// delay_free_blocks, the engine keeps one reference on each of those blocks (a
// "hold"). Each hold is released by exactly one later appearance of the request
// id in ConnectorEvents::finished_sending or finished_recving (oldest hold
// first). The connector must report every hold eventually (its transfer
// timeout bounds that); while held, an id cannot be reused by a new request.
//
// DESIGN §6 items and how this interface covers them:
//  1. get_num_new_matched_tokens is asked only for requests that carry
//     kv_transfer_params, only on their first admission (Request::external_kv_eligible):
//     plain requests and preempted/re-admitted ones never wait for KV.
//  2. every kWaitingForRemoteKv request has a deadline (ExternalMatch::timeout_ms);
//     an abort while waiting finishes it and calls request_finished with its
//     blocks, which are freed unless the connector holds them (a write may still land).
//  3. a producer whose only token was EOS/stop still gets request_finished and
//     keeps its blocks by returning delay_free_blocks until finished_sending.
//  4. load failures are reported by poll() as LoadError; the engine rolls the
//     request's num_computed_tokens back to the first failed block and
//     recomputes from there (a token sampled on partial KV is discarded).
//     A synchronous load (load_async = false) must report its errors in the
//     poll() that directly follows that step's after_step: the engine polls
//     there, before it accepts the step's tokens.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/block_pool.h"
#include "engine/engine_request.h"
#include "engine/model_runner.h"
#include "engine/step_plan.h"

namespace pd::engine {

struct ExternalMatch {
  // Tokens after the locally computed prefix whose KV the connector provides.
  // The engine clamps it so that at least the last prompt token is computed
  // locally (the sampler needs its logits), unless includes_last_prompt_token.
  int32_t num_external_tokens = 0;
  // true: the KV arrives asynchronously; the request waits in
  // kWaitingForRemoteKv until poll() reports it in finished_recving.
  // false: the KV is loaded inside the next forward pass (wait_for_layer_load).
  bool load_async = false;
  // Deadline for an async load, from the moment the request starts waiting.
  int64_t timeout_ms = 120'000;
  // First-token hand-over: the KV of every prompt token arrives, and with it,
  // usually, the first output token sampled by the producer
  // (ConnectorEvents::first_tokens). Only with load_async. When the load
  // completes without a token, the engine computes the last prompt token
  // again (its KV is overwritten with the same values) to get its logits.
  bool includes_last_prompt_token = false;
};

struct FinishDecision {
  // Keep the request's blocks referenced (a transfer may still read or write
  // them) until the id is reported in finished_sending / finished_recving.
  bool delay_free_blocks = false;
  // Returned to the client in the final RequestOutput (vLLM's kv_transfer_params).
  std::optional<contract::ProducerAnswer> kv_transfer_params;
};

struct LoadError {
  std::string request_id;
  std::vector<int32_t> failed_block_ids;  // KV in these blocks is invalid
};

// A live request whose transfer failed for good (on_failure=fail policy, or
// its kv_transfer_params were refused by the peer they name): the engine
// finishes it with kFinishedError and this message. Its blocks are
// released through request_finished as for any finish (the connector may hold them).
struct FailedRequest {
  std::string request_id;
  std::string message;
  // The request's own parameters were refused (RequestOutput::invalid_request).
  bool invalid_request = false;
};

// The producer's first output token for a request whose load completes in the
// same poll (finished_recving). The engine emits it as the request's first
// token, as if sampled here, and continues with decode.
struct HandedOverToken {
  std::string request_id;
  int32_t token_id = 0;
};

struct ConnectorEvents {
  std::vector<std::string> finished_recving;  // async loads complete (or a held block set may be released)
  std::vector<std::string> finished_sending;  // sends complete: release one hold each
  std::vector<LoadError> load_errors;         // recompute those blocks' tokens
  // Applied first; the other lists then see these ids as finished (a
  // finished_recving for one releases its hold, if any).
  std::vector<FailedRequest> failed_requests;
  // Each id also appears in finished_recving of the same poll.
  std::vector<HandedOverToken> first_tokens;
};

// Streams a handed-over first token to the client from the thread that received
// it (KvConnector::bind_first_token_sink). Thread-safe and non-blocking.
using FirstTokenSink = std::function<void(const std::string& request_id, int32_t token_id)>;

// The engine's load as its thread sees it after an iteration (report_load).
struct EngineLoad {
  int32_t num_running = 0;
  int32_t num_waiting = 0;  // waiting for a step or for remote KV
  int32_t num_kv_blocks_free = 0;
  int32_t num_kv_blocks_total = 0;
  int64_t num_queued_prefill_tokens = 0;  // Scheduler::num_queued_prefill_tokens
  int32_t block_size = 16;                // tokens per hashed block
};

enum class RemoteKvTimeoutAction : uint8_t {
  kRecomputeLocally,  // forget the external tokens, compute them here
  kFail,              // finish the request with kFinishedError
};

class KvConnector {
 public:
  virtual ~KvConnector() = default;

  // Called once by the engine before its thread starts. `wakeup` is thread-safe
  // and cheap: call it from any thread when poll() has something new, so the
  // idle engine thread does not wait for its idle timeout.
  virtual void bind_engine_wakeup(std::function<void()> wakeup) = 0;

  // Called once by the engine before its thread starts. The connector may call
  // `sink` from any thread the moment a request's first token and its whole
  // prompt's KV have both arrived, ahead of the poll() that reports them
  // (finished_recving + first_tokens), so the client does not wait for the step
  // in flight. The connector must be sure that poll() will report exactly this
  // token with a successful load, and the request's remote-KV deadline (its
  // ExternalMatch::timeout_ms from admission) must not have passed when it calls.
  // The engine streams the token only while the request still waits for it
  // (never twice, never after its final output) and, when the poll reports it,
  // takes it as usual without emitting it again.
  virtual void bind_first_token_sink(FirstTokenSink sink) {}

  // Called by Engine::add_request on the CALLER's thread (so it must be
  // thread-safe and must not touch engine-thread state): static checks of
  // kv_transfer_params. An error rejects the request (add_request returns it,
  // HTTP 400) before anything is enqueued.
  virtual Status validate_request(const GenerateRequest& request) const { return Status::Ok(); }

  // Admission of a request with external_kv_eligible set. num_local_computed_tokens
  // is the block-aligned local prefix-cache hit. An error (e.g. malformed
  // kv_transfer_params) finishes the request with kFinishedError and that message;
  // kFailedPrecondition says it conflicts with a request in flight (a transfer id
  // already active here): RequestOutput::conflict, the caller's error.
  virtual Result<ExternalMatch> get_num_new_matched_tokens(const Request& request,
                                                           int32_t num_local_computed_tokens) = 0;

  // After the engine allocated blocks for an admission with num_external_tokens > 0:
  // block_ids is the request's whole block table; the external tokens go to
  // positions [num_local_computed_tokens, + num_external_tokens).
  virtual void update_state_after_alloc(const Request& request, std::span<const int32_t> block_ids,
                                        int32_t num_external_tokens) = 0;

  // The worker-side hooks for this step, or nullptr when there is nothing to
  // load or save. Owned by the connector, valid until after_step returns.
  virtual LayerKvHooks* build_step_hooks(const StepInput& input, const StepPlan& plan) = 0;

  // The runner returned (status is its result). Saves can be sealed here.
  virtual void after_step(const StepPlan& plan, const Status& status) = 0;

  // Called on the engine thread after every step and whenever woken or idle.
  virtual ConnectorEvents poll() = 0;

  // A request's first output token was sampled on this engine (called before
  // the finish checks, so also for a request that this token finishes).
  virtual void first_token_sampled(const Request& request, int32_t token_id) {}

  // A running request is preempted and will recompute; block_ids are its
  // blocks. Return true to hold them (a save from an earlier step may still
  // read them): one hold, released by one finished_sending report.
  virtual bool request_preempted(const Request& request, std::span<const int32_t> block_ids) = 0;

  // A request finished (any reason; request.state() is the finished state).
  virtual FinishDecision request_finished(const Request& request, std::span<const int32_t> block_ids) = 0;

  // Asked once, before the engine thread starts. true: the block pool records
  // prefix-cache events and report_load is called after every engine iteration.
  virtual bool wants_load_reports() const { return false; }

  // The engine's load and the prefix-cache events since the previous call, in
  // the order they happened. Must not block: hand them to another thread.
  virtual void report_load(const EngineLoad& load, std::vector<KvCacheEvent> events) {}

  // A kWaitingForRemoteKv request passed its deadline.
  virtual RemoteKvTimeoutAction on_remote_kv_timeout(const Request& request) = 0;
};

}  // namespace pd::engine
