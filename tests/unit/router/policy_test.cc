#include "router/policy.h"

#include <gtest/gtest.h>

#include <map>
#include <vector>

namespace pd::router {
namespace {

TEST(PickIndex, RoundRobinCyclesThroughEveryCandidate) {
  std::vector<int64_t> loads = {5, 0, 9};
  std::vector<size_t> picks;
  for (uint64_t ticket = 0; ticket < 6; ++ticket) picks.push_back(*pick_index(PolicyKind::kRoundRobin, loads, ticket, 0));
  EXPECT_EQ(picks, (std::vector<size_t>{0, 1, 2, 0, 1, 2}));
}

TEST(PickIndex, LeastOutstandingPicksTheMinimumAndRotatesTies) {
  std::vector<int64_t> loads = {3, 1, 2, 1};
  EXPECT_EQ(*pick_index(PolicyKind::kLeastOutstanding, loads, 0, 0), 1u);
  EXPECT_EQ(*pick_index(PolicyKind::kLeastOutstanding, loads, 1, 0), 3u);
  EXPECT_EQ(*pick_index(PolicyKind::kLeastOutstanding, loads, 2, 0), 1u);
}

TEST(PickIndex, PowerOfTwoChoosesTheLessLoadedOfTwoDistinct) {
  std::vector<int64_t> loads = {10, 0, 10, 10};
  std::map<size_t, int> counts;
  for (uint64_t r = 0; r < 4000; ++r) {
    uint64_t random = r * 0x9E3779B97F4A7C15ull;
    counts[*pick_index(PolicyKind::kPowerOfTwo, loads, 0, random)]++;
  }
  // Candidate 1 wins whenever it is one of the two sampled: about half the time (2/4).
  EXPECT_GT(counts[1], 1500);
  // Two distinct candidates are always compared, so the idle one is never passed over for itself.
  std::vector<int64_t> pair = {7, 1};
  for (uint64_t r = 0; r < 100; ++r) EXPECT_EQ(*pick_index(PolicyKind::kPowerOfTwo, pair, 0, r * 7919), 1u);
}

TEST(PickIndex, EmptyHasNoChoiceAndSingleIsAlwaysChosen) {
  EXPECT_FALSE(pick_index(PolicyKind::kRoundRobin, {}, 0, 0).has_value());
  std::vector<int64_t> one = {100};
  for (PolicyKind kind : {PolicyKind::kRoundRobin, PolicyKind::kLeastOutstanding, PolicyKind::kPowerOfTwo}) {
    EXPECT_EQ(*pick_index(kind, one, 17, 99), 0u);
  }
}

TEST(ParsePolicy, AcceptsTheThreeNamesOnly) {
  EXPECT_EQ(*parse_policy("round_robin"), PolicyKind::kRoundRobin);
  EXPECT_EQ(*parse_policy("least_outstanding"), PolicyKind::kLeastOutstanding);
  EXPECT_EQ(*parse_policy("power_of_two"), PolicyKind::kPowerOfTwo);
  EXPECT_FALSE(parse_policy("random").ok());
}

Candidate make(InstanceRole role, TransferMode mode, int64_t load = 0, std::string_view model = "m") {
  return Candidate{role, mode, model, load};
}

PlanRequest request_for(std::string_view model) {
  PlanRequest request;
  request.model = model;
  return request;
}

TEST(PlanFlow, ProducerAndConsumerOfOneModeMakeAPdFlowOfThatMode) {
  std::vector<Candidate> c = {make(InstanceRole::kProducer, TransferMode::kRead),
                              make(InstanceRole::kConsumer, TransferMode::kRead)};
  FlowPlan plan = plan_flow(c, request_for("m"));
  EXPECT_EQ(plan.kind, FlowKind::kPdRead);
  EXPECT_EQ(plan.producer, 0u);
  EXPECT_EQ(plan.consumer, 1u);
  c[0].mode = c[1].mode = TransferMode::kWrite;
  EXPECT_EQ(plan_flow(c, request_for("m")).kind, FlowKind::kPdWrite);
}

TEST(PlanFlow, ModeMismatchFallsBackToCollocated) {
  std::vector<Candidate> c = {make(InstanceRole::kProducer, TransferMode::kRead),
                              make(InstanceRole::kConsumer, TransferMode::kWrite),
                              make(InstanceRole::kBoth, TransferMode::kWrite)};
  FlowPlan plan = plan_flow(c, request_for(""));
  EXPECT_EQ(plan.kind, FlowKind::kCollocated);
  EXPECT_EQ(plan.consumer, 2u);
  EXPECT_EQ(plan.fallback, FallbackReason::kNone);
}

TEST(PlanFlow, LoneConsumerDecodesAloneAndSaysWhy) {
  std::vector<Candidate> c = {make(InstanceRole::kConsumer, TransferMode::kWrite)};
  FlowPlan plan = plan_flow(c, request_for(""));
  EXPECT_EQ(plan.kind, FlowKind::kCollocated);
  EXPECT_EQ(plan.consumer, 0u);
  EXPECT_EQ(plan.fallback, FallbackReason::kNoProducer);
}

TEST(PlanFlow, UnknownModelIsReportedAndUnknownInstanceModelMatchesAll) {
  std::vector<Candidate> c = {make(InstanceRole::kBoth, TransferMode::kWrite, 0, "m")};
  FlowPlan plan = plan_flow(c, request_for("other"));
  EXPECT_EQ(plan.kind, FlowKind::kNone);
  EXPECT_TRUE(plan.model_unknown);
  c[0].model = "";
  EXPECT_EQ(plan_flow(c, request_for("other")).kind, FlowKind::kCollocated);
  EXPECT_FALSE(plan_flow({}, request_for("m")).model_unknown);
}

TEST(PlanFlow, PoliciesApplySeparatelyToProducersAndConsumers) {
  std::vector<Candidate> c = {make(InstanceRole::kProducer, TransferMode::kWrite, 5),
                              make(InstanceRole::kProducer, TransferMode::kWrite, 0),
                              make(InstanceRole::kConsumer, TransferMode::kWrite, 0),
                              make(InstanceRole::kConsumer, TransferMode::kWrite, 9)};
  PlanRequest request = request_for("m");
  request.producer_policy = PolicyKind::kLeastOutstanding;
  request.consumer_policy = PolicyKind::kRoundRobin;
  request.consumer_ticket = 1;
  FlowPlan plan = plan_flow(c, request);
  EXPECT_EQ(plan.producer, 1u);
  EXPECT_EQ(plan.consumer, 3u);  // round robin ignores load
}

TEST(PickProducer, RetrySkipsExcludedAndOtherModes) {
  std::vector<Candidate> c = {make(InstanceRole::kProducer, TransferMode::kWrite),
                              make(InstanceRole::kProducer, TransferMode::kRead),
                              make(InstanceRole::kProducer, TransferMode::kWrite)};
  c[0].excluded = true;
  EXPECT_EQ(pick_producer(c, "m", TransferMode::kWrite, PolicyKind::kRoundRobin, 0, 0), 2u);
  c[2].excluded = true;
  EXPECT_FALSE(pick_producer(c, "m", TransferMode::kWrite, PolicyKind::kRoundRobin, 0, 0).has_value());
}

}  // namespace
}  // namespace pd::router
