// Load-balancing policies and flow planning. Pure: the caller passes the
// candidates' current loads, a round-robin ticket and a random number, so the
// choice is a deterministic function of its inputs (unit-tested directly).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "router/instance_info.h"

namespace pd::router {

enum class PolicyKind { kRoundRobin, kLeastOutstanding, kPowerOfTwo };

Result<PolicyKind> parse_policy(std::string_view text);
const char* policy_name(PolicyKind kind);

// Index into `loads` of the chosen candidate; nullopt when loads is empty.
// loads[i] is candidate i's outstanding requests (legs in flight, a stream
// counting until its last byte). `ticket` is a per-policy counter that
// advances once per pick; `random` is uniformly random.
//  round_robin:        ticket % n
//  least_outstanding:  the least loaded; ties rotate by ticket
//  power_of_two:       two distinct random candidates, the less loaded (first on a tie)
std::optional<size_t> pick_index(PolicyKind kind, std::span<const int64_t> loads, uint64_t ticket, uint64_t random);

// One discovered instance as the planner sees it.
struct Candidate {
  InstanceRole role;
  TransferMode mode;
  std::string_view model;  // empty: unknown, serves any model
  int64_t outstanding;
  bool excluded = false;  // already failed for this request
};

enum class FlowKind { kNone, kCollocated, kPdWrite, kPdRead };
enum class FallbackReason { kNone, kNoProducer, kNoConsumer };

struct PlanRequest {
  std::string_view model;  // the request's "model"; empty matches every instance
  PolicyKind producer_policy = PolicyKind::kRoundRobin;
  PolicyKind consumer_policy = PolicyKind::kRoundRobin;
  uint64_t producer_ticket = 0;
  uint64_t consumer_ticket = 0;
  uint64_t random = 0;
  std::optional<TransferMode> forced_mode;  // router --mode; nullopt: the consumer's registered mode
};

struct FlowPlan {
  FlowKind kind = FlowKind::kNone;
  std::optional<size_t> producer;  // indices into the candidate list
  std::optional<size_t> consumer;  // the decoding (or collocated) instance; always set unless kNone
  FallbackReason fallback = FallbackReason::kNone;
  bool model_unknown = false;  // no instance serves the requested model
};

// Chooses how to serve one request:
//  1. a consumer (consumer policy) and a producer of the same mode (producer policy) -> P/D;
//  2. else a collocated instance ("both", consumer policy);
//  3. else a lone consumer decodes on its own (fallback kNoProducer), or a lone producer (kNoConsumer).
FlowPlan plan_flow(std::span<const Candidate> candidates, const PlanRequest& request);

// Another producer for a retry: same mode as `mode`, not excluded, serving the model.
std::optional<size_t> pick_producer(std::span<const Candidate> candidates, std::string_view model, TransferMode mode,
                                    PolicyKind policy, uint64_t ticket, uint64_t random);

}  // namespace pd::router
