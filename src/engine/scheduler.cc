#include "engine/scheduler.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "common/clock.h"
#include "common/log.h"
#include "engine/sampler.h"

namespace pd::engine {

namespace {
// A failing pool call from the scheduler is an engine bug: loud in debug builds,
// logged (and survived) in release builds.
void check_pool(const Status& status, const char* what) {
  if (!status.ok()) {
    PD_LOG_ERROR("block pool invariant broken in {}: {}", what, status.to_string());
    assert(false && "block pool invariant broken");
  }
}

// Prompt logprobs are still owed: asked for, and no output token emitted yet
// (they go out with the first one).
bool wants_prompt_logprobs(const Request& request) {
  return request.sampling().prompt_logprobs >= 0 && request.num_output_tokens() == 0;
}
}  // namespace

Scheduler::Scheduler(SchedulerConfig config, KvConnector* connector)
    : config_(std::move(config)), connector_(connector), pool_(config_.num_blocks, config_.enable_prefix_caching) {
  pool_.set_record_events(config_.record_cache_events);
}

int64_t Scheduler::num_queued_prefill_tokens() const {
  int64_t total = 0;
  for (const auto& [id, request] : requests_) {
    // KV that a producer computes is not prefill work of this instance.
    if (request->state() == RequestState::kWaitingForRemoteKv) continue;
    total += std::max<int64_t>(0, request->num_prompt_tokens() - request->num_computed_tokens);
  }
  return total;
}

Status Scheduler::add_request(std::unique_ptr<Request> request) {
  if (request->state() != RequestState::kWaiting) {
    return internal_error("request {} added in state {}", request->request_id(), request_state_name(request->state()));
  }
  if (is_id_in_use(request->request_id())) {
    return invalid_argument("request id '{}' is already in use", request->request_id());
  }
  update_block_hashes(*request);
  Request* raw = request.get();
  requests_.emplace(raw->request_id(), std::move(request));
  waiting_.push_back(raw);
  return Status::Ok();
}

bool Scheduler::is_id_in_use(const std::string& request_id) const {
  return requests_.contains(request_id) || holds_.contains(request_id);
}

Request* Scheduler::find(const std::string& request_id) {
  auto it = requests_.find(request_id);
  return it == requests_.end() ? nullptr : it->second.get();
}

int32_t Scheduler::num_holds() const {
  int32_t n = 0;
  for (const auto& [id, holds] : holds_) n += static_cast<int32_t>(holds.size());
  return n;
}

std::optional<int64_t> Scheduler::next_remote_kv_deadline_ns() const {
  std::optional<int64_t> earliest;
  for (const Request* r : remote_waiting_) {
    if (!earliest || r->remote_kv_deadline_ns < *earliest) earliest = r->remote_kv_deadline_ns;
  }
  return earliest;
}

void Scheduler::update_block_hashes(Request& request) {
  const int32_t bs = config_.block_size;
  const auto& tokens = request.token_ids();
  while (static_cast<int32_t>(request.block_hashes.size() + 1) * bs <= request.num_tokens()) {
    const size_t i = request.block_hashes.size();
    std::optional<BlockHash> parent;
    if (i > 0) parent = request.block_hashes.back();
    request.block_hashes.push_back(hash_block_tokens(
        parent, std::span<const int32_t>(tokens).subspan(i * static_cast<size_t>(bs), static_cast<size_t>(bs))));
  }
}

void Scheduler::append_token(Request& request, int32_t token_id) {
  request.append_output_token(token_id);
  update_block_hashes(request);
}

void Scheduler::release_blocks(const std::string& request_id, std::vector<int32_t>& block_ids, bool hold) {
  if (block_ids.empty()) return;
  if (hold) {
    holds_[request_id].push_back(std::move(block_ids));
  } else {
    // Tail first: a prompt's last (least shared) blocks are evicted first.
    std::vector<int32_t> reversed(block_ids.rbegin(), block_ids.rend());
    check_pool(pool_.free_blocks(reversed), "release_blocks");
  }
  block_ids.clear();
}

void Scheduler::remove_from_queues(Request* request) {
  auto drop = [request](auto& queue) {
    auto it = std::find(queue.begin(), queue.end(), request);
    if (it != queue.end()) queue.erase(it);
  };
  drop(running_);
  drop(waiting_);
  drop(remote_waiting_);
}

void Scheduler::reset_to_waiting_front(Request& request) {
  request.num_computed_tokens = 0;
  request.num_cached_blocks = 0;
  request.num_pending_external_tokens = 0;
  request.remote_kv_deadline_ns = 0;
  // Never wait for external KV again: whatever was promised may never come (DESIGN §6.1).
  request.external_kv_eligible = false;
  waiting_.push_front(&request);
}

void Scheduler::preempt(Request& request, StepPlan* plan) {
  remove_from_queues(&request);
  check_pool(request.transition_to(RequestState::kPreempted), "preempt");
  const bool hold = connector_ != nullptr && connector_->request_preempted(request, request.block_ids);
  release_blocks(request.request_id(), request.block_ids, hold);
  ++request.num_preemptions;
  ++counters_.num_preemptions;
  counters_.num_recomputed_tokens += request.num_computed_tokens;
  check_pool(request.transition_to(RequestState::kWaiting), "preempt");
  reset_to_waiting_front(request);
  if (plan != nullptr) plan->preempted_request_ids.push_back(request.request_id());
}

int32_t Scheduler::reserve_target_blocks(const Request& request) const {
  const double reserve = std::max(config_.remote_output_reserve, 0.0);
  const auto reserved_output =
      static_cast<int64_t>(std::ceil(reserve * static_cast<double>(request.max_output_tokens())));
  const int64_t tokens =
      std::min<int64_t>(int64_t{request.num_prompt_tokens()} + reserved_output, int64_t{config_.max_model_len});
  return blocks_for_tokens(static_cast<int32_t>(std::max<int64_t>(tokens, request.num_tokens())));
}

int32_t Scheduler::reserved_growth_blocks() const {
  int32_t total = 0;
  auto add = [&](const Request* r) {
    if (r->block_ids.empty()) return;
    total += std::max(0, reserve_target_blocks(*r) - static_cast<int32_t>(r->block_ids.size()));
  };
  for (const Request* r : running_) add(r);
  for (const Request* r : remote_waiting_) add(r);
  for (const Request* r : waiting_) add(r);
  return total;
}

Scheduler::Admit Scheduler::try_admit(Request& request, int32_t* budget, StepPlan* plan, FinishedRequest* failed) {
  const int32_t bs = config_.block_size;
  std::vector<int32_t> hit_blocks;
  int32_t num_external = 0;
  bool load_async = false;
  int64_t timeout_ms = 0;
  const bool fresh = request.block_ids.empty();
  if (fresh) {
    // Leave at least the last token to compute: its logits produce the next token.
    const size_t max_hit_blocks = static_cast<size_t>((request.num_tokens() - 1) / bs);
    const std::span<const BlockHash> hashes(request.block_hashes.data(),
                                            std::min(max_hit_blocks, request.block_hashes.size()));
    // Prompt logprobs come from computing every prompt position: no prefix hits (vLLM v1 does the same).
    if (!wants_prompt_logprobs(request)) hit_blocks = pool_.find_cached_prefix(hashes);
    const int32_t num_local = static_cast<int32_t>(hit_blocks.size()) * bs;
    if (connector_ != nullptr && request.external_kv_eligible) {
      // Asked on every admission attempt (the connector answers idempotently);
      // eligibility ends only when an admission commits, below.
      Result<ExternalMatch> match = connector_->get_num_new_matched_tokens(request, num_local);
      if (!match.ok()) {
        *failed = finish_request(request, RequestState::kFinishedError, FinishReason::kError);
        failed->error = "KV connector rejected the request: " + match.status().message();
        failed->conflict = match.status().code() == ErrorCode::kFailedPrecondition;
        return Admit::kFailed;
      }
      // A hand-over brings the last prompt token's KV too (and the token it
      // produced); otherwise that token is computed here for its logits.
      const bool whole_prompt = match->includes_last_prompt_token && match->load_async;
      num_external =
          std::clamp(match->num_external_tokens, 0, request.num_tokens() - (whole_prompt ? 0 : 1) - num_local);
      load_async = match->load_async && num_external > 0;
      timeout_ms = match->timeout_ms;
    }
  }
  const int32_t num_computed =
      fresh ? static_cast<int32_t>(hit_blocks.size()) * bs + num_external : request.num_computed_tokens;
  int32_t num_new = 0;
  if (!load_async) {
    num_new = request.num_tokens() - num_computed;
    if (!config_.enable_chunked_prefill && num_new > *budget) return Admit::kNoRoom;
    num_new = std::min(num_new, *budget);
    if (num_new <= 0) return Admit::kNoRoom;
  }
  const int32_t num_blocks_needed =
      blocks_for_tokens(num_computed + num_new) - static_cast<int32_t>(hit_blocks.size() + request.block_ids.size());
  // Hit blocks sitting on the free list are not available for allocation.
  int32_t num_hits_on_free_list = 0;
  for (int32_t id : hit_blocks) num_hits_on_free_list += pool_.ref_count(id) == 0;
  if (num_blocks_needed > pool_.num_free_blocks() - num_hits_on_free_list) return Admit::kNoRoom;
  // A remote request also needs the reserve (SchedulerConfig::remote_output_reserve),
  // unless nothing else holds blocks: alone it can always run to its end.
  const bool others_hold_blocks =
      !running_.empty() || !remote_waiting_.empty() ||
      std::any_of(waiting_.begin(), waiting_.end(), [](const Request* r) { return !r->block_ids.empty(); });
  if (num_external > 0 && config_.remote_output_reserve >= 0.0 && others_hold_blocks) {
    const int32_t num_own = static_cast<int32_t>(hit_blocks.size() + request.block_ids.size());
    const int32_t own = std::max(num_blocks_needed, reserve_target_blocks(request) - num_own);
    const auto watermark = static_cast<int32_t>(config_.kv_watermark * static_cast<double>(pool_.num_blocks()));
    if (own + reserved_growth_blocks() + watermark > pool_.num_free_blocks() - num_hits_on_free_list) {
      if (!request.deferred_for_reserve) {
        request.deferred_for_reserve = true;
        ++counters_.num_remote_admissions_deferred;
      }
      return Admit::kNoRoom;
    }
  }

  // Committed: take references on the hits before allocating (allocation may evict).
  request.external_kv_eligible = false;
  if (fresh) {
    check_pool(pool_.touch(hit_blocks), "admit touch");
    request.block_ids = hit_blocks;
    request.num_cached_blocks = static_cast<int32_t>(hit_blocks.size());
    counters_.num_prefix_cache_queries += request.num_tokens();
    counters_.num_prefix_cache_hit_tokens += static_cast<int64_t>(hit_blocks.size()) * bs;
    counters_.num_external_hit_tokens += num_external;
    if (request.num_output_tokens() == 0 && request.num_preemptions == 0) {
      request.num_cached_tokens = static_cast<int32_t>(hit_blocks.size()) * bs + num_external;
    }
  }
  if (num_blocks_needed > 0) {
    Result<std::vector<int32_t>> fresh_blocks = pool_.allocate(num_blocks_needed);
    check_pool(fresh_blocks.status(), "admit allocate");
    if (fresh_blocks.ok()) {
      request.block_ids.insert(request.block_ids.end(), fresh_blocks->begin(), fresh_blocks->end());
    }
  }
  if (num_external > 0) connector_->update_state_after_alloc(request, request.block_ids, num_external);

  waiting_.erase(std::find(waiting_.begin(), waiting_.end(), &request));
  if (load_async) {
    request.num_computed_tokens = num_computed - num_external;
    request.num_pending_external_tokens = num_external;
    request.remote_kv_deadline_ns = now_ns() + timeout_ms * 1'000'000;
    check_pool(request.transition_to(RequestState::kWaitingForRemoteKv), "admit remote");
    remote_waiting_.push_back(&request);
    plan->remote_kv_request_ids.push_back(request.request_id());
    return Admit::kRemoteWait;
  }
  request.num_computed_tokens = num_computed;
  check_pool(request.transition_to(RequestState::kRunning), "admit run");
  running_.push_back(&request);
  ScheduledSeq seq;
  seq.request = &request;
  seq.num_computed_tokens = num_computed;
  seq.num_new_tokens = num_new;
  seq.sample = num_computed + num_new == request.num_tokens();
  seq.num_external_tokens = num_external;
  seq.newly_admitted = true;
  plan->seqs.push_back(seq);
  plan->num_batched_tokens += num_new;
  *budget -= num_new;
  return Admit::kScheduled;
}

StepPlan Scheduler::schedule(std::vector<FinishedRequest>* failed) {
  StepPlan plan;
  int32_t budget = config_.max_num_batched_tokens;

  // 1. Running requests, in order; preempt from the tail when blocks run out.
  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Request& request = *running_[i];
    const int32_t num_new = std::min(request.num_tokens() - request.num_computed_tokens, budget);
    if (num_new <= 0) {
      ++i;
      continue;
    }
    const int32_t num_blocks_needed =
        blocks_for_tokens(request.num_computed_tokens + num_new) - static_cast<int32_t>(request.block_ids.size());
    bool self_preempted = false;
    while (num_blocks_needed > pool_.num_free_blocks()) {
      Request& victim = *running_.back();
      self_preempted = &victim == &request;
      preempt(victim, &plan);
      if (self_preempted) break;
    }
    if (self_preempted) break;  // it was the tail: nothing after it remains
    if (num_blocks_needed > 0) {
      Result<std::vector<int32_t>> blocks = pool_.allocate(num_blocks_needed);
      check_pool(blocks.status(), "running allocate");
      if (blocks.ok()) request.block_ids.insert(request.block_ids.end(), blocks->begin(), blocks->end());
    }
    ScheduledSeq seq;
    seq.request = &request;
    seq.num_computed_tokens = request.num_computed_tokens;
    seq.num_new_tokens = num_new;
    seq.sample = request.num_computed_tokens + num_new == request.num_tokens();
    plan.seqs.push_back(seq);
    plan.num_batched_tokens += num_new;
    budget -= num_new;
    ++i;
  }

  // 2. Waiting requests, unless this step had to preempt (no room to grow).
  if (plan.preempted_request_ids.empty()) {
    const bool head_blocked = admit_waiting(&budget, &plan, failed);
    // Nothing runs, so nothing will free blocks: waiting requests that hold
    // blocks (remote KV that arrived) must give them up or the engine stalls.
    if (head_blocked && running_.empty() && reclaim_waiting_blocks()) admit_waiting(&budget, &plan, failed);
  }
  return plan;
}

bool Scheduler::admit_waiting(int32_t* budget, StepPlan* plan, std::vector<FinishedRequest>* failed) {
  while (!waiting_.empty() && *budget > 0 && static_cast<int32_t>(running_.size()) < config_.max_num_seqs) {
    Request& request = *waiting_.front();
    FinishedRequest failure;
    const Admit result = try_admit(request, budget, plan, &failure);
    if (result == Admit::kNoRoom) return true;  // FCFS: do not let later requests jump ahead
    if (result == Admit::kFailed) failed->push_back(std::move(failure));
    // kScheduled / kRemoteWait / kFailed removed the request from waiting_.
  }
  return false;
}

bool Scheduler::reclaim_waiting_blocks() {
  bool reclaimed = false;
  // Tail first; the head is the request that must fit. Their full blocks stay
  // in the prefix cache (freed with their hashes), so a later admission may
  // find them again instead of recomputing.
  for (auto it = waiting_.rbegin(); it != waiting_.rend(); ++it) {
    Request& r = **it;
    if (&r == waiting_.front() || r.block_ids.empty()) continue;
    const bool hold = connector_ != nullptr && connector_->request_preempted(r, r.block_ids);
    release_blocks(r.request_id(), r.block_ids, hold);
    counters_.num_recomputed_tokens += r.num_computed_tokens;
    r.num_computed_tokens = 0;
    r.num_cached_blocks = 0;
    r.num_pending_external_tokens = 0;
    r.external_kv_eligible = false;  // never wait for the same KV twice (DESIGN §6.1)
    ++r.num_preemptions;
    ++counters_.num_preemptions;
    reclaimed = true;
  }
  return reclaimed;
}

StepInput Scheduler::build_step_input(const StepPlan& plan) const {
  StepInput input;
  input.token_ids.reserve(static_cast<size_t>(plan.num_batched_tokens));
  input.seqs.reserve(plan.seqs.size());
  for (const ScheduledSeq& s : plan.seqs) {
    const Request& r = *s.request;
    SeqStep step;
    step.token_offset = static_cast<int32_t>(input.token_ids.size());
    step.num_new_tokens = s.num_new_tokens;
    step.num_computed_tokens = s.num_computed_tokens;
    const auto begin = r.token_ids().begin() + s.num_computed_tokens;
    input.token_ids.insert(input.token_ids.end(), begin, begin + s.num_new_tokens);
    const size_t num_table_blocks = static_cast<size_t>(blocks_for_tokens(s.num_computed_tokens + s.num_new_tokens));
    step.block_table.assign(r.block_ids.begin(), r.block_ids.begin() + static_cast<std::ptrdiff_t>(num_table_blocks));
    step.sample = s.sample;
    if (wants_prompt_logprobs(r) && s.num_computed_tokens < r.num_prompt_tokens() - 1) {
      step.prompt_logprobs = r.sampling().prompt_logprobs;
      step.prompt_token_ids = std::span<const int32_t>(r.token_ids()).first(static_cast<size_t>(r.num_prompt_tokens()));
    }
    if (s.sample) {
      step.sampling = r.sampling();
      step.num_output_tokens = r.num_output_tokens();
      step.rng_seed = derive_rng_seed(r.rng_base_seed(), r.num_output_tokens());
      if (r.num_output_tokens() < r.sampling().min_tokens) {
        step.suppressed_token_ids = r.sampling().stop_token_ids;
        if (!r.sampling().ignore_eos) {
          step.suppressed_token_ids.insert(step.suppressed_token_ids.end(), config_.eos_token_ids.begin(),
                                           config_.eos_token_ids.end());
        }
      }
    }
    input.seqs.push_back(std::move(step));
  }
  return input;
}

std::unordered_set<std::string> Scheduler::apply_load_errors(const std::vector<LoadError>& errors) {
  std::unordered_set<std::string> moved_back;
  for (const LoadError& error : errors) {
    Request* request = find(error.request_id);
    if (request == nullptr) {
      ++num_unknown_connector_ids_;
      continue;
    }
    size_t first_bad = request->block_ids.size();
    for (int32_t bad : error.failed_block_ids) {
      auto it = std::find(request->block_ids.begin(), request->block_ids.end(), bad);
      if (it != request->block_ids.end())
        first_bad = std::min(first_bad, static_cast<size_t>(it - request->block_ids.begin()));
    }
    const int32_t valid_tokens = static_cast<int32_t>(first_bad) * config_.block_size;
    if (request->state() == RequestState::kWaitingForRemoteKv) {
      const int32_t promised = request->num_computed_tokens + request->num_pending_external_tokens;
      const int32_t kept = std::min(promised, valid_tokens);
      request->num_computed_tokens = std::min(request->num_computed_tokens, kept);
      request->num_pending_external_tokens = kept - request->num_computed_tokens;
    } else if (valid_tokens < request->num_computed_tokens) {
      // A synchronous load in this step (counted as computed at admission)
      // failed: recompute from the first bad block; this step's result is void.
      request->num_computed_tokens = valid_tokens;
      moved_back.insert(request->request_id());
    }
    request->num_cached_blocks = std::min(request->num_cached_blocks, static_cast<int32_t>(first_bad));
  }
  return moved_back;
}

void Scheduler::complete_step(const StepPlan& plan, const std::unordered_set<std::string>& skip) {
  const int32_t bs = config_.block_size;
  for (const ScheduledSeq& s : plan.seqs) {
    Request& r = *s.request;
    if (skip.contains(r.request_id())) continue;
    r.num_computed_tokens = s.num_computed_tokens + s.num_new_tokens;
    // Cache only blocks whose KV now exists: a block registered at allocation
    // could be hit by another request in the same batch before it is written.
    const int32_t num_full = std::min(static_cast<int32_t>(r.block_hashes.size()), r.num_computed_tokens / bs);
    for (int32_t i = r.num_cached_blocks; i < num_full; ++i) {
      pool_.cache_block(r.block_ids[static_cast<size_t>(i)], r.block_hashes[static_cast<size_t>(i)]);
    }
    r.num_cached_blocks = std::max(r.num_cached_blocks, num_full);
  }
}

FinishedRequest Scheduler::finish_request(Request& request, RequestState final_state, FinishReason reason) {
  remove_from_queues(&request);
  check_pool(request.transition_to(final_state), "finish");
  request.finish_reason = reason;
  FinishedRequest out;
  if (connector_ != nullptr) out.decision = connector_->request_finished(request, request.block_ids);
  release_blocks(request.request_id(), request.block_ids, out.decision.delay_free_blocks);
  auto it = requests_.find(request.request_id());
  out.request = std::move(it->second);
  requests_.erase(it);
  return out;
}

std::vector<Scheduler::HandedOver> Scheduler::apply_connector_events(const ConnectorEvents& events) {
  auto release_hold = [this](const std::string& id) {
    auto it = holds_.find(id);
    if (it == holds_.end()) return false;
    std::vector<int32_t> blocks = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) holds_.erase(it);
    release_blocks(id, blocks, /*hold=*/false);
    return true;
  };
  std::unordered_map<std::string_view, int32_t> first_tokens;
  for (const HandedOverToken& t : events.first_tokens) first_tokens.emplace(t.request_id, t.token_id);
  std::vector<HandedOver> handed_over;
  for (const std::string& id : events.finished_recving) {
    Request* request = find(id);
    if (request != nullptr && request->state() == RequestState::kWaitingForRemoteKv) {
      remove_from_queues(request);
      request->num_computed_tokens += request->num_pending_external_tokens;
      request->num_pending_external_tokens = 0;
      const bool whole_prompt = request->num_computed_tokens >= request->num_tokens();
      const auto token = first_tokens.find(id);
      const bool take_token = whole_prompt && token != first_tokens.end() && request->num_output_tokens() == 0;
      // Without a token the last prompt token is computed again for its logits.
      if (whole_prompt && !take_token) request->num_computed_tokens = request->num_tokens() - 1;
      // Received full blocks are as good as computed ones: share them.
      const int32_t num_full = std::min(static_cast<int32_t>(request->block_hashes.size()),
                                        request->num_computed_tokens / config_.block_size);
      for (int32_t i = request->num_cached_blocks; i < num_full; ++i) {
        pool_.cache_block(request->block_ids[static_cast<size_t>(i)], request->block_hashes[static_cast<size_t>(i)]);
      }
      request->num_cached_blocks = std::max(request->num_cached_blocks, num_full);
      check_pool(request->transition_to(RequestState::kWaiting), "recv done");
      if (take_token) {
        check_pool(request->transition_to(RequestState::kRunning), "recv done, token handed over");
        running_.push_back(request);
        handed_over.push_back(HandedOver{request, token->second});
      } else {
        waiting_.push_front(request);
      }
    } else if (!release_hold(id)) {
      ++num_unknown_connector_ids_;
    }
  }
  for (const std::string& id : events.finished_sending) {
    if (!release_hold(id)) ++num_unknown_connector_ids_;
  }
  return handed_over;
}

std::vector<FinishedRequest> Scheduler::expire_remote_kv_waits(int64_t now) {
  std::vector<FinishedRequest> failed;
  std::vector<Request*> expired;
  for (Request* r : remote_waiting_) {
    if (r->remote_kv_deadline_ns <= now) expired.push_back(r);
  }
  for (Request* r : expired) {
    const RemoteKvTimeoutAction action =
        connector_ != nullptr ? connector_->on_remote_kv_timeout(*r) : RemoteKvTimeoutAction::kFail;
    if (action == RemoteKvTimeoutAction::kFail) {
      failed.push_back(finish_request(*r, RequestState::kFinishedError, FinishReason::kError));
      failed.back().error = "timed out waiting for remote KV";
      continue;
    }
    // Recompute locally: drop the blocks (held if a late write may still land).
    remove_from_queues(r);
    const bool hold = connector_ != nullptr && connector_->request_preempted(*r, r->block_ids);
    release_blocks(r->request_id(), r->block_ids, hold);
    check_pool(r->transition_to(RequestState::kWaiting), "remote timeout");
    reset_to_waiting_front(*r);
  }
  return failed;
}

std::vector<Request*> Scheduler::live_requests() {
  std::vector<Request*> all;
  all.reserve(requests_.size());
  for (auto& [id, r] : requests_) all.push_back(r.get());
  return all;
}

}  // namespace pd::engine
