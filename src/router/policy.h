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
#include "contract/registration.h"
#include "router/instance_info.h"

namespace pd::router {

// kScored: the least cost_tokens (below); ties rotate by ticket.
enum class PolicyKind { kRoundRobin, kLeastOutstanding, kPowerOfTwo, kScored };

Result<PolicyKind> parse_policy(std::string_view text);
const char* policy_name(PolicyKind kind);

// Index into `loads` of the chosen candidate; nullopt when loads is empty.
// For kScored, loads[i] is candidate i's cost_tokens and the least is chosen as for least_outstanding.
// loads[i] is candidate i's outstanding requests (legs in flight, a stream
// counting until its last byte). `ticket` is a per-policy counter that
// advances once per pick; `random` is uniformly random.
//  round_robin:        ticket % n
//  least_outstanding:  the least loaded; ties rotate by ticket
//  power_of_two:       two distinct random candidates, the less loaded (first on a tie)
//  scored:             as least_outstanding, on costs
std::optional<size_t> pick_index(PolicyKind kind, std::span<const int64_t> loads, uint64_t ticket, uint64_t random);

// One discovered instance as the planner sees it.
struct Candidate {
  InstanceRole role;
  TransferMode mode;
  std::string_view model;  // empty: unknown, serves any model
  int64_t outstanding;
  bool excluded = false;  // already failed for this request
  // It has a KV connector (a control address): a collocated instance without one never takes
  // part in P/D.
  bool has_connector = true;
  // Its last load report (heartbeat); absent for a static instance or before its first report.
  std::optional<contract::LoadReport> load = std::nullopt;
  // The longest prefix of this request's prompt in its prefix cache, in tokens (0 when unknown).
  int64_t cached_tokens = 0;
};

// Whether a request's prompt is prefilled on a producer (--pd-policy):
//  always: P/D whenever a consumer and a producer of its mode exist (roles consumer / producer);
//  never:  every request is prefilled where it decodes (a consumer or a collocated instance);
//  auto:   per request (decide_remote_prefill); instances of role "both" serve either side.
enum class PdPolicy { kAlways, kNever, kAuto };
Result<PdPolicy> parse_pd_policy(std::string_view text);
const char* pd_policy_name(PdPolicy policy);

// The knobs of the scored policy and of --pd-policy auto (src/router/README.md "Per-request
// decisions" derives the defaults from tools/pdbench/capacity_model.py).
struct DecisionThresholds {
  // Remote prefill only for at least this many uncached prompt tokens on the decoding instance.
  int64_t min_remote_prefill_tokens = 512;
  // ... and only while the producer's queued prefill tokens are at most this.
  int64_t max_producer_queue_tokens = 4096;
  // Scored policy: one outstanding request counts as this many prompt tokens of work.
  int64_t outstanding_request_tokens = 256;
};

// The scored policy's cost of sending a prompt of num_prompt_tokens to `candidate`, in prompt
// tokens of work ahead of it there:
//   (num_prompt_tokens - cached_tokens) + load.queued_prefill_tokens + outstanding_request_tokens x outstanding
// Without a report the queue counts 0; without a prompt length (nullopt) only the load counts.
int64_t cost_tokens(const Candidate& candidate, std::optional<int64_t> num_prompt_tokens,
                    const DecisionThresholds& thresholds);

enum class FlowKind { kNone, kCollocated, kPdWrite, kPdRead };
enum class FallbackReason { kNone, kNoProducer, kNoConsumer };

// Why a request was (or was not) prefilled remotely; the "reason" label of pd_router_decisions_total.
enum class DecisionReason {
  kPolicyAlways,   // --pd-policy always
  kPolicyNever,    // --pd-policy never
  kLongPrompt,     // auto: enough uncached tokens and a short producer queue -> P/D
  kShortPrompt,    // auto: the prompt is shorter than min_remote_prefill_tokens -> local
  kCachedPrefix,   // auto: long, but the decoding instance holds enough of it -> local
  kProducerBusy,   // auto: the producer's queue is past max_producer_queue_tokens -> local
  kNoProducer,     // auto: no producer for the decoding instance's mode -> local
  kPromptUnknown,  // auto: the prompt's length is not known -> as always
  kNoDecoder,      // auto: no consumer or collocated instance -> a lone producer serves (fallback)
};
const char* decision_reason_name(DecisionReason reason);

struct RemotePrefillInput {
  int64_t num_prompt_tokens = 0;
  int64_t consumer_cached_tokens = 0;          // on the decoding instance
  int64_t producer_queued_prefill_tokens = 0;  // on the chosen producer (0 without a report)
};
// auto's rule, pure: P/D (kLongPrompt) when the uncached prompt on the decoding instance is at
// least min_remote_prefill_tokens and the producer's queue at most max_producer_queue_tokens;
// else kShortPrompt, kCachedPrefix (the prompt alone would be long enough) or kProducerBusy.
DecisionReason decide_remote_prefill(const RemotePrefillInput& input, const DecisionThresholds& thresholds);

struct PlanRequest {
  std::string_view model;  // the request's "model"; empty matches every instance
  PolicyKind producer_policy = PolicyKind::kRoundRobin;
  PolicyKind consumer_policy = PolicyKind::kRoundRobin;
  uint64_t producer_ticket = 0;
  uint64_t consumer_ticket = 0;
  uint64_t random = 0;
  std::optional<TransferMode> forced_mode;  // router --mode; nullopt: the consumer's registered mode
  PdPolicy pd_policy = PdPolicy::kAlways;
  std::optional<int64_t> num_prompt_tokens;  // the prompt's length, when known
  DecisionThresholds thresholds;
};

struct FlowPlan {
  FlowKind kind = FlowKind::kNone;
  std::optional<size_t> producer;  // indices into the candidate list
  std::optional<size_t> consumer;  // the decoding (or collocated) instance; always set unless kNone
  FallbackReason fallback = FallbackReason::kNone;
  bool model_unknown = false;  // no instance serves the requested model
  DecisionReason reason = DecisionReason::kPolicyAlways;
  // auto or never chose to prefill where the request decodes (kCollocated on a consumer or a
  // collocated instance), for `reason`; not a fallback.
  bool local_by_policy = false;
};

// Chooses how to serve one request. always:
//  1. a consumer (consumer policy) and a producer of the same mode (producer policy) -> P/D;
//  2. else a collocated instance ("both", consumer policy);
//  3. else a lone consumer decodes on its own (fallback kNoProducer), or a lone producer (kNoConsumer).
// never: a consumer or collocated instance (consumer policy) prefills itself; else 3.
// auto: the decoding instance among consumers and collocated ones (consumer policy), then a
// producer of its mode among producers and the other collocated ones (producer policy), then
// decide_remote_prefill; an unknown prompt length plans as always. Else 3.
FlowPlan plan_flow(std::span<const Candidate> candidates, const PlanRequest& request);

// Whether the prompt's token count can change plan_flow's answer: auto with a producer or two
// collocated instances with connectors, or a scored policy and an instance whose cache is known
// (any_cache_known, from the router's cache index).
bool prompt_tokens_matter(std::span<const Candidate> candidates, const PlanRequest& request, bool any_cache_known);

// Another producer for a retry: same mode as `mode`, not excluded, serving the model.
// With include_collocated (auto), instances of role "both" other than `not_index` qualify too.
std::optional<size_t> pick_producer(std::span<const Candidate> candidates, std::string_view model, TransferMode mode,
                                    PolicyKind policy, uint64_t ticket, uint64_t random,
                                    std::optional<int64_t> num_prompt_tokens = std::nullopt,
                                    const DecisionThresholds& thresholds = {}, bool include_collocated = false,
                                    std::optional<size_t> not_index = std::nullopt);

// Another producer after plan.producer failed (a retry): chosen exactly as plan_flow chose the first,
// with the same request (the producer policy, scored on the prompt's length, load reports and cached
// prefixes; under auto, instances of role "both" with a connector qualify too), among the candidates not
// excluded (the caller excludes every producer already tried) and never the decoding instance.
std::optional<size_t> pick_retry_producer(std::span<const Candidate> candidates, const PlanRequest& request,
                                          const FlowPlan& plan, uint64_t ticket, uint64_t random);

}  // namespace pd::router
