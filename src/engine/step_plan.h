// What the scheduler decided for one step. Plain data; built and consumed on
// the engine thread (the connector reads it in build_step_hooks).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace pd::engine {

class Request;

struct ScheduledSeq {
  // Non-owning; valid until the step's outputs are processed.
  Request* request = nullptr;
  // KV positions [num_computed_tokens, num_computed_tokens + num_new_tokens)
  // are computed this step; num_computed_tokens is the value before the step.
  int32_t num_computed_tokens = 0;
  int32_t num_new_tokens = 0;
  // True when the step reaches the request's last known token: a token is sampled.
  bool sample = false;
  // Tokens of [num_computed_tokens - num_external_tokens, num_computed_tokens)
  // that a connector loads synchronously during this step (load_async == false).
  int32_t num_external_tokens = 0;
  // True when the request entered the running set in this step.
  bool newly_admitted = false;
};

struct StepPlan {
  // Running requests first (in running order), then admissions (in arrival order).
  std::vector<ScheduledSeq> seqs;
  int32_t num_batched_tokens = 0;  // sum of num_new_tokens, <= max_num_batched_tokens
  // Requests preempted while building this plan (now back in the waiting queue).
  std::vector<std::string> preempted_request_ids;
  // Requests moved to kWaitingForRemoteKv while building this plan.
  std::vector<std::string> remote_kv_request_ids;
  bool empty() const { return seqs.empty(); }
};

}  // namespace pd::engine
