#include "router/policy.h"

#include <algorithm>

namespace pd::router {

Result<PolicyKind> parse_policy(std::string_view text) {
  if (text == "round_robin") return PolicyKind::kRoundRobin;
  if (text == "least_outstanding") return PolicyKind::kLeastOutstanding;
  if (text == "power_of_two") return PolicyKind::kPowerOfTwo;
  if (text == "scored") return PolicyKind::kScored;
  return invalid_argument("policy must be round_robin|least_outstanding|power_of_two|scored, got '{}'", text);
}

Result<PdPolicy> parse_pd_policy(std::string_view text) {
  if (text == "always") return PdPolicy::kAlways;
  if (text == "never") return PdPolicy::kNever;
  if (text == "auto") return PdPolicy::kAuto;
  return invalid_argument("pd policy must be always|never|auto, got '{}'", text);
}

const char* pd_policy_name(PdPolicy policy) {
  switch (policy) {
    case PdPolicy::kAlways:
      return "always";
    case PdPolicy::kNever:
      return "never";
    case PdPolicy::kAuto:
      return "auto";
  }
  return "?";
}

const char* decision_reason_name(DecisionReason reason) {
  switch (reason) {
    case DecisionReason::kPolicyAlways:
      return "always";
    case DecisionReason::kPolicyNever:
      return "never";
    case DecisionReason::kLongPrompt:
      return "long_prompt";
    case DecisionReason::kShortPrompt:
      return "short_prompt";
    case DecisionReason::kCachedPrefix:
      return "cached_prefix";
    case DecisionReason::kProducerBusy:
      return "producer_busy";
    case DecisionReason::kNoProducer:
      return "no_producer";
    case DecisionReason::kPromptUnknown:
      return "prompt_unknown";
    case DecisionReason::kNoDecoder:
      return "no_decoder";
  }
  return "?";
}

int64_t cost_tokens(const Candidate& candidate, std::optional<int64_t> num_prompt_tokens,
                    const DecisionThresholds& thresholds) {
  int64_t cost = thresholds.outstanding_request_tokens * std::max<int64_t>(0, candidate.outstanding);
  if (candidate.load) cost += static_cast<int64_t>(candidate.load->num_queued_prefill_tokens);
  if (num_prompt_tokens) cost += std::max<int64_t>(0, *num_prompt_tokens - candidate.cached_tokens);
  return cost;
}

DecisionReason decide_remote_prefill(const RemotePrefillInput& input, const DecisionThresholds& thresholds) {
  const int64_t uncached = std::max<int64_t>(0, input.num_prompt_tokens - input.consumer_cached_tokens);
  if (uncached < thresholds.min_remote_prefill_tokens) {
    return input.num_prompt_tokens >= thresholds.min_remote_prefill_tokens ? DecisionReason::kCachedPrefix
                                                                           : DecisionReason::kShortPrompt;
  }
  if (input.producer_queued_prefill_tokens > thresholds.max_producer_queue_tokens) return DecisionReason::kProducerBusy;
  return DecisionReason::kLongPrompt;
}

const char* policy_name(PolicyKind kind) {
  switch (kind) {
    case PolicyKind::kRoundRobin:
      return "round_robin";
    case PolicyKind::kLeastOutstanding:
      return "least_outstanding";
    case PolicyKind::kPowerOfTwo:
      return "power_of_two";
    case PolicyKind::kScored:
      return "scored";
  }
  return "?";
}

std::optional<size_t> pick_index(PolicyKind kind, std::span<const int64_t> loads, uint64_t ticket, uint64_t random) {
  const size_t n = loads.size();
  if (n == 0) return std::nullopt;
  if (n == 1) return 0;
  switch (kind) {
    case PolicyKind::kRoundRobin:
      return ticket % n;
    case PolicyKind::kLeastOutstanding:
    case PolicyKind::kScored: {
      const int64_t least = *std::min_element(loads.begin(), loads.end());
      const size_t num_tied = static_cast<size_t>(std::count(loads.begin(), loads.end(), least));
      size_t wanted = ticket % num_tied;
      for (size_t i = 0; i < n; ++i) {
        if (loads[i] == least && wanted-- == 0) return i;
      }
      return std::nullopt;  // unreachable: wanted < num_tied
    }
    case PolicyKind::kPowerOfTwo: {
      const size_t first = random % n;
      const size_t second = (first + 1 + (random >> 32) % (n - 1)) % n;
      return loads[second] < loads[first] ? second : first;
    }
  }
  return std::nullopt;
}

namespace {

bool serves_model(const Candidate& candidate, std::string_view model) {
  return model.empty() || candidate.model.empty() || candidate.model == model;
}

// The prompt length and thresholds a scored pick weighs candidates with.
struct Scoring {
  std::optional<int64_t> num_prompt_tokens;
  DecisionThresholds thresholds;
};

template <typename Predicate>
std::optional<size_t> pick_where(std::span<const Candidate> candidates, PolicyKind policy, uint64_t ticket,
                                 uint64_t random, Predicate predicate, const Scoring& scoring = {}) {
  std::vector<size_t> indices;
  std::vector<int64_t> loads;
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (!candidates[i].excluded && predicate(candidates[i])) {
      indices.push_back(i);
      loads.push_back(policy == PolicyKind::kScored
                          ? cost_tokens(candidates[i], scoring.num_prompt_tokens, scoring.thresholds)
                          : candidates[i].outstanding);
    }
  }
  std::optional<size_t> chosen = pick_index(policy, loads, ticket, random);
  if (!chosen) return std::nullopt;
  return indices[*chosen];
}

}  // namespace

std::optional<size_t> pick_producer(std::span<const Candidate> candidates, std::string_view model, TransferMode mode,
                                    PolicyKind policy, uint64_t ticket, uint64_t random,
                                    std::optional<int64_t> num_prompt_tokens, const DecisionThresholds& thresholds,
                                    bool include_collocated, std::optional<size_t> not_index) {
  return pick_where(
      candidates, policy, ticket, random,
      [&](const Candidate& c) {
        const bool role_ok = c.role == InstanceRole::kProducer ||
                             (include_collocated && c.role == InstanceRole::kBoth && c.has_connector);
        const bool other = !not_index || &c != &candidates[*not_index];
        return role_ok && other && c.mode == mode && serves_model(c, model);
      },
      Scoring{num_prompt_tokens, thresholds});
}

namespace {

// A lone consumer decodes on its own (kNoProducer), else a lone producer serves (kNoConsumer).
FlowPlan lone_fallback(std::span<const Candidate> candidates, const PlanRequest& request, uint64_t random_consumer,
                       FlowPlan plan) {
  for (InstanceRole role : {InstanceRole::kConsumer, InstanceRole::kProducer}) {
    std::optional<size_t> lone = pick_where(
        candidates, request.consumer_policy, request.consumer_ticket, random_consumer,
        [&](const Candidate& c) { return c.role == role && serves_model(c, request.model); },
        Scoring{request.num_prompt_tokens, request.thresholds});
    if (lone) {
      plan.kind = FlowKind::kCollocated;
      plan.consumer = lone;
      plan.fallback = role == InstanceRole::kConsumer ? FallbackReason::kNoProducer : FallbackReason::kNoConsumer;
      return plan;
    }
  }
  return plan;
}

}  // namespace

FlowPlan plan_flow(std::span<const Candidate> candidates, const PlanRequest& request) {
  FlowPlan plan;
  bool any_for_model = false;
  for (const Candidate& c : candidates) any_for_model |= !c.excluded && serves_model(c, request.model);
  if (!any_for_model) {
    plan.model_unknown = !candidates.empty() && !request.model.empty();
    return plan;
  }
  const uint64_t random_producer = request.random;
  const uint64_t random_consumer = request.random * 0x9E3779B97F4A7C15ull + 1;
  const Scoring scoring{request.num_prompt_tokens, request.thresholds};

  if (request.pd_policy == PdPolicy::kNever ||
      (request.pd_policy == PdPolicy::kAuto && request.num_prompt_tokens.has_value())) {
    // The decoding instance: a consumer or a collocated one, by the consumer policy.
    std::optional<size_t> decoder = pick_where(
        candidates, request.consumer_policy, request.consumer_ticket, random_consumer,
        [&](const Candidate& c) {
          const bool role_ok = c.role == InstanceRole::kConsumer || c.role == InstanceRole::kBoth;
          return role_ok && serves_model(c, request.model) && (!request.forced_mode || c.mode == *request.forced_mode);
        },
        scoring);
    if (decoder) {
      plan.consumer = decoder;
      plan.kind = FlowKind::kCollocated;
      plan.local_by_policy = true;
      if (request.pd_policy == PdPolicy::kNever) {
        plan.reason = DecisionReason::kPolicyNever;
        return plan;
      }
      const Candidate& d = candidates[*decoder];
      std::optional<size_t> producer;
      if (d.has_connector) {
        producer = pick_producer(candidates, request.model, d.mode, request.producer_policy, request.producer_ticket,
                                 random_producer, request.num_prompt_tokens, request.thresholds, true, decoder);
      }
      if (!producer) {
        plan.reason = DecisionReason::kNoProducer;
        return plan;
      }
      const Candidate& p = candidates[*producer];
      RemotePrefillInput input;
      input.num_prompt_tokens = *request.num_prompt_tokens;
      input.consumer_cached_tokens = d.cached_tokens;
      input.producer_queued_prefill_tokens = p.load ? static_cast<int64_t>(p.load->num_queued_prefill_tokens) : 0;
      plan.reason = decide_remote_prefill(input, request.thresholds);
      if (plan.reason == DecisionReason::kLongPrompt) {
        plan.producer = producer;
        plan.local_by_policy = false;
        plan.kind = d.mode == TransferMode::kRead ? FlowKind::kPdRead : FlowKind::kPdWrite;
      }
      return plan;
    }
    plan.reason = request.pd_policy == PdPolicy::kNever ? DecisionReason::kPolicyNever : DecisionReason::kNoDecoder;
    return lone_fallback(candidates, request, random_consumer, plan);
  }
  plan.reason = request.pd_policy == PdPolicy::kAuto ? DecisionReason::kPromptUnknown : DecisionReason::kPolicyAlways;

  // P/D: a consumer whose mode has at least one producer.
  auto has_producer_for = [&](TransferMode mode) {
    for (const Candidate& c : candidates) {
      if (!c.excluded && c.role == InstanceRole::kProducer && c.mode == mode && serves_model(c, request.model)) {
        return true;
      }
    }
    return false;
  };
  std::optional<size_t> consumer = pick_where(
      candidates, request.consumer_policy, request.consumer_ticket, random_consumer,
      [&](const Candidate& c) {
        const TransferMode mode = request.forced_mode.value_or(c.mode);
        return c.role == InstanceRole::kConsumer && serves_model(c, request.model) &&
               (!request.forced_mode || c.mode == mode) && has_producer_for(mode);
      },
      scoring);
  if (consumer) {
    const TransferMode mode = candidates[*consumer].mode;
    plan.producer = pick_producer(candidates, request.model, mode, request.producer_policy, request.producer_ticket,
                                  random_producer, request.num_prompt_tokens, request.thresholds);
    plan.consumer = consumer;
    plan.kind = mode == TransferMode::kRead ? FlowKind::kPdRead : FlowKind::kPdWrite;
    return plan;
  }
  std::optional<size_t> collocated = pick_where(
      candidates, request.consumer_policy, request.consumer_ticket, random_consumer,
      [&](const Candidate& c) { return c.role == InstanceRole::kBoth && serves_model(c, request.model); }, scoring);
  if (collocated) {
    plan.kind = FlowKind::kCollocated;
    plan.consumer = collocated;
    return plan;
  }
  return lone_fallback(candidates, request, random_consumer, plan);
}

std::optional<size_t> pick_retry_producer(std::span<const Candidate> candidates, const PlanRequest& request,
                                          const FlowPlan& plan, uint64_t ticket, uint64_t random) {
  if (!plan.consumer || (plan.kind != FlowKind::kPdRead && plan.kind != FlowKind::kPdWrite)) return std::nullopt;
  const TransferMode mode = plan.kind == FlowKind::kPdRead ? TransferMode::kRead : TransferMode::kWrite;
  return pick_producer(candidates, request.model, mode, request.producer_policy, ticket, random,
                       request.num_prompt_tokens, request.thresholds, request.pd_policy == PdPolicy::kAuto,
                       plan.consumer);
}

bool prompt_tokens_matter(std::span<const Candidate> candidates, const PlanRequest& request, bool any_cache_known) {
  const bool scored = request.consumer_policy == PolicyKind::kScored || request.producer_policy == PolicyKind::kScored;
  if (scored && any_cache_known) return true;
  if (request.pd_policy != PdPolicy::kAuto) return false;
  int num_connected_collocated = 0;
  for (const Candidate& c : candidates) {
    if (c.role == InstanceRole::kProducer) return true;
    if (c.role == InstanceRole::kBoth && c.has_connector) ++num_connected_collocated;
  }
  return num_connected_collocated >= 2;
}

}  // namespace pd::router
