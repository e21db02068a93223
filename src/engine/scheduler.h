// The scheduler: pure CPU, no threads, no I/O, no device calls. Owned by the
// engine thread. vLLM-v1 style: one token budget per step shared by running
// requests first (decode and unfinished chunked prefills, in running order),
// then waiting requests in arrival order (preempted ones go to the front);
// recompute-preemption from the tail of the running list when blocks run out.
//
// It owns every live Request, the BlockPool and the prefix-cache bookkeeping.
// One step is: schedule() -> build_step_input() -> (runner) ->
// apply_load_errors() -> complete_step() -> append_token()/finish_request().
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "common/status.h"
#include "engine/block_pool.h"
#include "engine/engine_request.h"
#include "engine/engine_stats.h"
#include "engine/kv_connector.h"
#include "engine/model_runner.h"
#include "engine/step_plan.h"

namespace pd::engine {

struct SchedulerConfig {
  int32_t max_num_seqs = 256;
  int32_t max_num_batched_tokens = 2048;
  int32_t max_model_len = 4096;
  int32_t block_size = 16;
  int32_t num_blocks = 0;
  bool enable_prefix_caching = true;
  bool enable_chunked_prefill = true;
  // Admission of a request that loads KV from a remote producer (a P/D
  // consumer): it is admitted only when the free blocks cover its own blocks
  // now, the growth still to come of every live request that holds blocks
  // (its own included) up to prompt + remote_output_reserve x its maximum
  // output, and kv_watermark x num_blocks blocks on top. Otherwise it waits
  // (FCFS) and its producer keeps the KV. With 1.0 a consumer whose requests
  // all came this way never has to preempt. Negative: no reserve (a remote
  // request is admitted like any other, on its prompt's blocks alone).
  double remote_output_reserve = 1.0;
  double kv_watermark = 0.01;
  // The block pool records prefix-cache events (BlockPool::set_record_events)
  // for take_cache_events(); on when a connector reports them to a router.
  bool record_cache_events = false;
  // Suppressed while a request has fewer than min_tokens outputs.
  std::vector<int32_t> eos_token_ids;
};

// A request leaving the scheduler: the record (for its last output) and what
// the connector said about it.
struct FinishedRequest {
  std::unique_ptr<Request> request;
  FinishDecision decision;
  std::string error;  // for kFinishedError: what went wrong
  // kFinishedError because the request conflicts with one in flight (the
  // connector answered kFailedPrecondition, e.g. a duplicate transfer id).
  bool conflict = false;
};

class Scheduler {
 public:
  // connector may be null (plain engine); it must outlive the scheduler.
  Scheduler(SchedulerConfig config, KvConnector* connector);

  const SchedulerConfig& config() const { return config_; }
  const BlockPool& block_pool() const { return pool_; }
  const SchedulerCounters& counters() const { return counters_; }

  // Takes a validated request (state kWaiting) to the back of the waiting queue.
  // kInvalidArgument if its id is live or still holds blocks for a transfer.
  Status add_request(std::unique_ptr<Request> request);
  // True while the id names a live request or a block hold (not reusable yet).
  bool is_id_in_use(const std::string& request_id) const;
  Request* find(const std::string& request_id);

  int32_t num_running() const { return static_cast<int32_t>(running_.size()); }
  // Waiting for a step, plus waiting for remote KV.
  int32_t num_waiting() const { return static_cast<int32_t>(waiting_.size() + remote_waiting_.size()); }
  int32_t num_remote_waiting() const { return static_cast<int32_t>(remote_waiting_.size()); }
  int32_t num_holds() const;
  // Prompt tokens of live requests not computed yet (waiting, or running an
  // unfinished prefill; not those waiting for a producer's KV): the prefill
  // work queued here.
  int64_t num_queued_prefill_tokens() const;
  // The prefix-cache events since the last call (empty unless record_cache_events).
  std::vector<KvCacheEvent> take_cache_events() { return pool_.take_events(); }
  bool has_unfinished() const { return !running_.empty() || !waiting_.empty() || !remote_waiting_.empty(); }
  // Earliest remote-KV deadline, if any request waits for remote KV.
  std::optional<int64_t> next_remote_kv_deadline_ns() const;

  // Plans one step. Requests whose connector lookup failed come back in
  // *failed (already finished with kFinishedError) so the engine can report them.
  StepPlan schedule(std::vector<FinishedRequest>* failed);

  // The runner's input for a plan: tokens, block tables, sampling seeds.
  StepInput build_step_input(const StepPlan& plan) const;

  // Connector load failures: each named request recomputes from its first
  // failed block. Returns the ids whose progress moved back (their sampled
  // token of the current step, if any, must be dropped).
  std::unordered_set<std::string> apply_load_errors(const std::vector<LoadError>& errors);

  // After a successful execute: advances num_computed_tokens of every seq not
  // in `skip` and registers newly completed full blocks in the prefix cache.
  void complete_step(const StepPlan& plan, const std::unordered_set<std::string>& skip);

  // Appends a sampled token (and the hashes of blocks it completes).
  void append_token(Request& request, int32_t token_id);

  // Finishes a live request in any state: transitions it, removes it from its
  // queue, asks the connector, frees or holds its blocks.
  FinishedRequest finish_request(Request& request, RequestState final_state, FinishReason reason);

  // Moves finished remote loads back to waiting, releases holds. Ids that are
  // neither are ignored (counted in num_unknown_connector_ids).
  // First-token hand-over: a load that brought the whole prompt's KV together
  // with the producer's token puts its request in the running set as if its
  // prefill had run here; the returned (request, token) pairs are for the
  // caller to append like sampled tokens. A whole-prompt load without a token
  // leaves the last prompt token to compute again (for its logits).
  struct HandedOver {
    Request* request;
    int32_t token_id;
  };
  std::vector<HandedOver> apply_connector_events(const ConnectorEvents& events);
  int64_t num_unknown_connector_ids() const { return num_unknown_connector_ids_; }

  // Remote-KV waits past their deadline: recompute (like a preemption) or fail.
  std::vector<FinishedRequest> expire_remote_kv_waits(int64_t now_ns);

  // Every live request, for shutdown.
  std::vector<Request*> live_requests();

 private:
  int32_t blocks_for_tokens(int32_t num_tokens) const {
    return (num_tokens + config_.block_size - 1) / config_.block_size;
  }
  void update_block_hashes(Request& request);
  // Releases blocks (tail first) or turns them into a hold of request_id.
  void release_blocks(const std::string& request_id, std::vector<int32_t>& block_ids, bool hold);
  void preempt(Request& request, StepPlan* plan);
  void reset_to_waiting_front(Request& request);
  // Blocks still to be allocated, under the remote-admission reserve, to the
  // live requests that hold blocks.
  int32_t reserved_growth_blocks() const;
  int32_t reserve_target_blocks(const Request& request) const;
  // Admission of one waiting request; false when it cannot be admitted now.
  enum class Admit { kScheduled, kRemoteWait, kFailed, kNoRoom };
  Admit try_admit(Request& request, int32_t* budget, StepPlan* plan, FinishedRequest* failed);
  // Admits from the head of waiting_ until one does not fit; true when the head is blocked.
  bool admit_waiting(int32_t* budget, StepPlan* plan, std::vector<FinishedRequest>* failed);
  // Releases the blocks of every waiting request but the head (they recompute);
  // true when anything was released.
  bool reclaim_waiting_blocks();
  void remove_from_queues(Request* request);

  SchedulerConfig config_;
  KvConnector* connector_;
  BlockPool pool_;
  SchedulerCounters counters_;
  std::unordered_map<std::string, std::unique_ptr<Request>> requests_;
  std::vector<Request*> running_;
  std::deque<Request*> waiting_;
  std::vector<Request*> remote_waiting_;
  // Blocks kept for a connector transfer, per request id, oldest hold first.
  std::unordered_map<std::string, std::deque<std::vector<int32_t>>> holds_;
  int64_t num_unknown_connector_ids_ = 0;
};

}  // namespace pd::engine
