#include "router/policy.h"

#include <algorithm>

namespace pd::router {

Result<PolicyKind> parse_policy(std::string_view text) {
  if (text == "round_robin") return PolicyKind::kRoundRobin;
  if (text == "least_outstanding") return PolicyKind::kLeastOutstanding;
  if (text == "power_of_two") return PolicyKind::kPowerOfTwo;
  return invalid_argument("policy must be round_robin|least_outstanding|power_of_two, got '{}'", text);
}

const char* policy_name(PolicyKind kind) {
  switch (kind) {
    case PolicyKind::kRoundRobin: return "round_robin";
    case PolicyKind::kLeastOutstanding: return "least_outstanding";
    case PolicyKind::kPowerOfTwo: return "power_of_two";
  }
  return "?";
}

std::optional<size_t> pick_index(PolicyKind kind, std::span<const int64_t> loads, uint64_t ticket, uint64_t random) {
  const size_t n = loads.size();
  if (n == 0) return std::nullopt;
  if (n == 1) return 0;
  switch (kind) {
    case PolicyKind::kRoundRobin: return ticket % n;
    case PolicyKind::kLeastOutstanding: {
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

template <typename Predicate>
std::optional<size_t> pick_where(std::span<const Candidate> candidates, PolicyKind policy, uint64_t ticket,
                                 uint64_t random, Predicate predicate) {
  std::vector<size_t> indices;
  std::vector<int64_t> loads;
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (!candidates[i].excluded && predicate(candidates[i])) {
      indices.push_back(i);
      loads.push_back(candidates[i].outstanding);
    }
  }
  std::optional<size_t> chosen = pick_index(policy, loads, ticket, random);
  if (!chosen) return std::nullopt;
  return indices[*chosen];
}

}  // namespace

std::optional<size_t> pick_producer(std::span<const Candidate> candidates, std::string_view model, TransferMode mode,
                                    PolicyKind policy, uint64_t ticket, uint64_t random) {
  return pick_where(candidates, policy, ticket, random, [&](const Candidate& c) {
    return c.role == InstanceRole::kProducer && c.mode == mode && serves_model(c, model);
  });
}

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
      candidates, request.consumer_policy, request.consumer_ticket, random_consumer, [&](const Candidate& c) {
        const TransferMode mode = request.forced_mode.value_or(c.mode);
        return c.role == InstanceRole::kConsumer && serves_model(c, request.model) &&
               (!request.forced_mode || c.mode == mode) && has_producer_for(mode);
      });
  if (consumer) {
    const TransferMode mode = candidates[*consumer].mode;
    plan.producer = pick_producer(candidates, request.model, mode, request.producer_policy, request.producer_ticket,
                                  random_producer);
    plan.consumer = consumer;
    plan.kind = mode == TransferMode::kRead ? FlowKind::kPdRead : FlowKind::kPdWrite;
    return plan;
  }
  std::optional<size_t> collocated =
      pick_where(candidates, request.consumer_policy, request.consumer_ticket, random_consumer,
                 [&](const Candidate& c) { return c.role == InstanceRole::kBoth && serves_model(c, request.model); });
  if (collocated) {
    plan.kind = FlowKind::kCollocated;
    plan.consumer = collocated;
    return plan;
  }
  for (InstanceRole role : {InstanceRole::kConsumer, InstanceRole::kProducer}) {
    std::optional<size_t> lone =
        pick_where(candidates, request.consumer_policy, request.consumer_ticket, random_consumer,
                   [&](const Candidate& c) { return c.role == role && serves_model(c, request.model); });
    if (lone) {
      plan.kind = FlowKind::kCollocated;
      plan.consumer = lone;
      plan.fallback = role == InstanceRole::kConsumer ? FallbackReason::kNoProducer : FallbackReason::kNoConsumer;
      return plan;
    }
  }
  return plan;
}

}  // namespace pd::router
