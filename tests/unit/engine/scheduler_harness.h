// A driver for the scheduler alone: plays the engine's part of a step with a
// deterministic "model" (next token = function of the whole token sequence)
// and checks block accounting after every step.
#pragma once

#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/scheduler.h"

namespace pd::engine::testing {

inline int32_t next_token_of(const std::vector<int32_t>& tokens) {
  uint64_t h = 1469598103934665603ull;
  for (int32_t t : tokens) h = (h ^ static_cast<uint32_t>(t)) * 1099511628211ull;
  return static_cast<int32_t>(h % 997);
}

// A plan's content copied out: the plan's Request pointers dangle once the
// harness finishes those requests.
struct SeqView {
  std::string id;
  int32_t num_computed_tokens = 0;
  int32_t num_new_tokens = 0;
  bool sample = false;
  bool newly_admitted = false;
};
struct PlanView {
  std::vector<SeqView> seqs;
  int32_t num_batched_tokens = 0;
  std::vector<std::string> preempted_request_ids;
};

class SchedulerHarness {
 public:
  explicit SchedulerHarness(SchedulerConfig config, KvConnector* connector = nullptr)
      : scheduler(std::move(config), connector) {}

  Request* add(const std::string& id, std::vector<int32_t> prompt, int32_t max_tokens,
               std::optional<contract::TransferParams> kv_transfer_params = std::nullopt) {
    SamplingParams sampling;
    sampling.temperature = 0.0f;
    sampling.max_tokens = max_tokens;
    auto request = std::make_unique<Request>(id, next_seq_++, std::move(prompt), sampling,
                                             std::move(kv_transfer_params), 0, 0, max_tokens);
    Request* raw = request.get();
    EXPECT_TRUE(scheduler.add_request(std::move(request)).ok());
    return raw;
  }

  // One step: plan, "execute", append sampled tokens, finish at max_tokens.
  PlanView step() {
    std::vector<FinishedRequest> failed;
    StepPlan plan = scheduler.schedule(&failed);
    PlanView view{{}, plan.num_batched_tokens, plan.preempted_request_ids};
    for (const ScheduledSeq& s : plan.seqs) {
      view.seqs.push_back(
          {s.request->request_id(), s.num_computed_tokens, s.num_new_tokens, s.sample, s.newly_admitted});
    }
    for (auto& f : failed) finished[f.request->request_id()] = f.request->output_token_ids().size();
    last_input = scheduler.build_step_input(plan);
    scheduler.complete_step(plan, {});
    std::vector<Request*> done;
    for (const ScheduledSeq& s : plan.seqs) {
      if (!s.sample) continue;
      scheduler.append_token(*s.request, next_token_of(s.request->token_ids()));
      if (s.request->num_output_tokens() >= s.request->max_output_tokens()) done.push_back(s.request);
    }
    for (Request* r : done) finish(*r, RequestState::kFinishedLength);
    check_accounting();
    return view;
  }

  void finish(Request& r, RequestState state) {
    const std::string id = r.request_id();
    std::vector<int32_t> outputs(r.output_token_ids().begin(), r.output_token_ids().end());
    FinishedRequest f = scheduler.finish_request(r, state, FinishReason::kLength);
    outputs_[id] = outputs;
    finished[id] = outputs.size();
  }

  void abort(const std::string& id) {
    if (Request* r = scheduler.find(id)) finish(*r, RequestState::kFinishedAborted);
  }

  void run_until_idle(int max_steps = 10000) {
    for (int i = 0; i < max_steps && scheduler.has_unfinished(); ++i) step();
    ASSERT_FALSE(scheduler.has_unfinished()) << "requests still live after " << max_steps << " steps";
  }

  // Every block's ref count equals the number of live requests that list it
  // (plus holds, which tests without a connector never have).
  void check_accounting() {
    const BlockPool& pool = scheduler.block_pool();
    ASSERT_TRUE(pool.check_invariants().ok()) << pool.check_invariants().to_string();
    if (scheduler.num_holds() > 0) return;
    std::map<int32_t, int32_t> expected;
    for (Request* r : scheduler.live_requests()) {
      for (int32_t id : r->block_ids) ++expected[id];
    }
    for (int32_t id = 0; id < pool.num_blocks(); ++id) {
      const int32_t want = expected.contains(id) ? expected[id] : 0;
      ASSERT_EQ(pool.ref_count(id), want) << "block " << id;
    }
  }

  const std::vector<int32_t>& outputs(const std::string& id) { return outputs_.at(id); }

  Scheduler scheduler;
  StepInput last_input;
  std::map<std::string, size_t> finished;

 private:
  uint64_t next_seq_ = 0;
  std::map<std::string, std::vector<int32_t>> outputs_;
};

inline std::vector<int32_t> iota_tokens(int32_t n, int32_t start = 1) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) t[static_cast<size_t>(i)] = start + i;
  return t;
}

// The true output of a request: the harness model run on the plain sequence.
inline std::vector<int32_t> reference_outputs(std::vector<int32_t> tokens, int32_t max_tokens) {
  std::vector<int32_t> out;
  for (int32_t i = 0; i < max_tokens; ++i) {
    out.push_back(next_token_of(tokens));
    tokens.push_back(out.back());
  }
  return out;
}

}  // namespace pd::engine::testing
