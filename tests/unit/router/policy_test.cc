#include "router/policy.h"

#include <gtest/gtest.h>

#include <map>
#include <vector>

namespace pd::router {
namespace {

TEST(PickIndex, RoundRobinCyclesThroughEveryCandidate) {
  std::vector<int64_t> loads = {5, 0, 9};
  std::vector<size_t> picks;
  for (uint64_t ticket = 0; ticket < 6; ++ticket)
    picks.push_back(*pick_index(PolicyKind::kRoundRobin, loads, ticket, 0));
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
  std::vector<Candidate> c = {
      make(InstanceRole::kProducer, TransferMode::kWrite, 5), make(InstanceRole::kProducer, TransferMode::kWrite, 0),
      make(InstanceRole::kConsumer, TransferMode::kWrite, 0), make(InstanceRole::kConsumer, TransferMode::kWrite, 9)};
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

// ---- per-request decisions (--pd-policy, scored placement) ----

Candidate reported(InstanceRole role, int64_t queued_prefill_tokens = 0, int64_t cached_tokens = 0,
                   int64_t outstanding = 0) {
  Candidate c = make(role, TransferMode::kWrite, outstanding);
  c.load = contract::LoadReport{0, 0, 100, 100, static_cast<uint64_t>(queued_prefill_tokens)};
  c.cached_tokens = cached_tokens;
  return c;
}

PlanRequest auto_request(int64_t num_prompt_tokens) {
  PlanRequest request = request_for("m");
  request.pd_policy = PdPolicy::kAuto;
  request.num_prompt_tokens = num_prompt_tokens;
  request.consumer_policy = PolicyKind::kScored;
  request.producer_policy = PolicyKind::kScored;
  return request;
}

TEST(DecideRemotePrefill, LongUncachedPromptAndShortQueueGoesRemote) {
  const DecisionThresholds t;  // 512 tokens, 4096 queued
  EXPECT_EQ(decide_remote_prefill({2000, 0, 0}, t), DecisionReason::kLongPrompt);
  EXPECT_EQ(decide_remote_prefill({512, 0, 4096}, t), DecisionReason::kLongPrompt);  // both bounds inclusive
}

TEST(DecideRemotePrefill, ShortPromptStaysLocal) {
  EXPECT_EQ(decide_remote_prefill({511, 0, 0}, {}), DecisionReason::kShortPrompt);
}

TEST(DecideRemotePrefill, ALongPromptMostlyCachedWhereItDecodesStaysLocal) {
  EXPECT_EQ(decide_remote_prefill({2000, 1600, 0}, {}), DecisionReason::kCachedPrefix);
  EXPECT_EQ(decide_remote_prefill({2000, 1488, 0}, {}), DecisionReason::kLongPrompt);  // 512 uncached
}

TEST(DecideRemotePrefill, ALoadedProducerKeepsTheRequestLocal) {
  EXPECT_EQ(decide_remote_prefill({2000, 0, 4097}, {}), DecisionReason::kProducerBusy);
}

TEST(CostTokens, IsUncachedPromptPlusQueuePlusWeightedOutstanding) {
  DecisionThresholds t;
  t.outstanding_request_tokens = 100;
  Candidate c = reported(InstanceRole::kConsumer, /*queued=*/300, /*cached=*/640, /*outstanding=*/2);
  EXPECT_EQ(cost_tokens(c, 1000, t), (1000 - 640) + 300 + 2 * 100);
  EXPECT_EQ(cost_tokens(c, std::nullopt, t), 300 + 2 * 100);
  c.cached_tokens = 5000;  // never negative
  EXPECT_EQ(cost_tokens(c, 1000, t), 300 + 200);
}

TEST(PlanFlowAuto, LongPromptIsPrefilledByTheProducer) {
  std::vector<Candidate> c = {reported(InstanceRole::kProducer), reported(InstanceRole::kConsumer)};
  const FlowPlan plan = plan_flow(c, auto_request(2000));
  EXPECT_EQ(plan.kind, FlowKind::kPdWrite);
  EXPECT_EQ(plan.producer, 0u);
  EXPECT_EQ(plan.consumer, 1u);
  EXPECT_EQ(plan.reason, DecisionReason::kLongPrompt);
  EXPECT_FALSE(plan.local_by_policy);
}

TEST(PlanFlowAuto, ShortPromptIsPrefilledByTheDecodingInstance) {
  std::vector<Candidate> c = {reported(InstanceRole::kProducer), reported(InstanceRole::kConsumer)};
  const FlowPlan plan = plan_flow(c, auto_request(100));
  EXPECT_EQ(plan.kind, FlowKind::kCollocated);
  EXPECT_EQ(plan.consumer, 1u);
  EXPECT_FALSE(plan.producer.has_value());
  EXPECT_EQ(plan.reason, DecisionReason::kShortPrompt);
  EXPECT_TRUE(plan.local_by_policy);
  EXPECT_EQ(plan.fallback, FallbackReason::kNone);
}

TEST(PlanFlowAuto, ACachedPrefixSendsTheRequestToTheCachingInstanceWhichPrefillsTheRestItself) {
  std::vector<Candidate> c = {reported(InstanceRole::kProducer), reported(InstanceRole::kConsumer),
                              reported(InstanceRole::kConsumer, 0, /*cached=*/1920)};
  const FlowPlan plan = plan_flow(c, auto_request(2000));
  EXPECT_EQ(plan.consumer, 2u);
  EXPECT_EQ(plan.kind, FlowKind::kCollocated);
  EXPECT_EQ(plan.reason, DecisionReason::kCachedPrefix);
}

TEST(PlanFlowAuto, LoadOutweighsACachedPrefixWhenItCostsMore) {
  DecisionThresholds t;
  std::vector<Candidate> c = {reported(InstanceRole::kConsumer, /*queued=*/0, /*cached=*/320),
                              reported(InstanceRole::kConsumer, /*queued=*/0, /*cached=*/0)};
  PlanRequest request = auto_request(400);
  EXPECT_EQ(plan_flow(c, request).consumer, 0u);  // 80 vs 400 tokens of work
  c[0].outstanding = 2;                           // + 2 x 256
  EXPECT_EQ(plan_flow(c, request).consumer, 1u);
  c[0].outstanding = 0;
  c[0].load->num_queued_prefill_tokens = 1000;
  EXPECT_EQ(plan_flow(c, request).consumer, 1u);
}

TEST(PlanFlowAuto, ALoadedProducerKeepsALongPromptLocal) {
  std::vector<Candidate> c = {reported(InstanceRole::kProducer, /*queued=*/10000), reported(InstanceRole::kConsumer)};
  const FlowPlan plan = plan_flow(c, auto_request(2000));
  EXPECT_EQ(plan.kind, FlowKind::kCollocated);
  EXPECT_EQ(plan.consumer, 1u);
  EXPECT_EQ(plan.reason, DecisionReason::kProducerBusy);
}

TEST(PlanFlowAuto, TheLeastLoadedProducerIsAsked) {
  std::vector<Candidate> c = {reported(InstanceRole::kProducer, 10000), reported(InstanceRole::kProducer, 100),
                              reported(InstanceRole::kConsumer)};
  const FlowPlan plan = plan_flow(c, auto_request(2000));
  EXPECT_EQ(plan.producer, 1u);
  EXPECT_EQ(plan.reason, DecisionReason::kLongPrompt);
}

TEST(PlanFlowAuto, TwoCollocatedInstancesSplitLongPromptsAndKeepShortOnesLocal) {
  std::vector<Candidate> c = {reported(InstanceRole::kBoth), reported(InstanceRole::kBoth, 0, 0, /*outstanding=*/1)};
  FlowPlan plan = plan_flow(c, auto_request(2000));
  EXPECT_EQ(plan.kind, FlowKind::kPdWrite);
  EXPECT_EQ(plan.consumer, 0u);  // the less loaded decodes
  EXPECT_EQ(plan.producer, 1u);  // the other prefills
  plan = plan_flow(c, auto_request(100));
  EXPECT_EQ(plan.kind, FlowKind::kCollocated);
  EXPECT_EQ(plan.consumer, 0u);
  EXPECT_EQ(plan.reason, DecisionReason::kShortPrompt);
}

TEST(PlanFlowAuto, ALoneCollocatedInstanceServesLocallyForWantOfAProducer) {
  std::vector<Candidate> c = {reported(InstanceRole::kBoth)};
  const FlowPlan plan = plan_flow(c, auto_request(2000));
  EXPECT_EQ(plan.kind, FlowKind::kCollocated);
  EXPECT_EQ(plan.reason, DecisionReason::kNoProducer);
}

TEST(PlanFlowAuto, AProducerOfAnotherModeDoesNotCount) {
  std::vector<Candidate> c = {make(InstanceRole::kProducer, TransferMode::kRead), reported(InstanceRole::kConsumer)};
  EXPECT_EQ(plan_flow(c, auto_request(2000)).reason, DecisionReason::kNoProducer);
}

TEST(PlanFlowAuto, AnUnknownPromptLengthPlansAsAlways) {
  std::vector<Candidate> c = {reported(InstanceRole::kProducer), reported(InstanceRole::kConsumer)};
  PlanRequest request = auto_request(0);
  request.num_prompt_tokens.reset();
  const FlowPlan plan = plan_flow(c, request);
  EXPECT_EQ(plan.kind, FlowKind::kPdWrite);
  EXPECT_EQ(plan.reason, DecisionReason::kPromptUnknown);
}

TEST(PlanFlowPolicy, AlwaysSplitsEvenAShortPrompt) {
  std::vector<Candidate> c = {reported(InstanceRole::kProducer), reported(InstanceRole::kConsumer)};
  PlanRequest request = auto_request(10);
  request.pd_policy = PdPolicy::kAlways;
  const FlowPlan plan = plan_flow(c, request);
  EXPECT_EQ(plan.kind, FlowKind::kPdWrite);
  EXPECT_EQ(plan.reason, DecisionReason::kPolicyAlways);
}

TEST(PlanFlowPolicy, NeverPrefillsWhereItDecodesEvenALongPrompt) {
  std::vector<Candidate> c = {reported(InstanceRole::kProducer), reported(InstanceRole::kConsumer)};
  PlanRequest request = auto_request(100000);
  request.pd_policy = PdPolicy::kNever;
  const FlowPlan plan = plan_flow(c, request);
  EXPECT_EQ(plan.kind, FlowKind::kCollocated);
  EXPECT_EQ(plan.consumer, 1u);
  EXPECT_EQ(plan.reason, DecisionReason::kPolicyNever);
  EXPECT_TRUE(plan.local_by_policy);
  // Only producers left: one serves whole, as a fallback.
  std::vector<Candidate> producers = {reported(InstanceRole::kProducer)};
  const FlowPlan lone = plan_flow(producers, request);
  EXPECT_EQ(lone.kind, FlowKind::kCollocated);
  EXPECT_EQ(lone.fallback, FallbackReason::kNoConsumer);
  request.pd_policy = PdPolicy::kAuto;
  EXPECT_EQ(plan_flow(producers, request).reason, DecisionReason::kNoDecoder);
  EXPECT_EQ(plan_flow(producers, request).fallback, FallbackReason::kNoConsumer);
}

TEST(PlanFlowAuto, ACollocatedInstanceWithoutAConnectorNeverTakesPartInPd) {
  std::vector<Candidate> c = {reported(InstanceRole::kBoth), reported(InstanceRole::kBoth, 0, 0, 1)};
  c[1].has_connector = false;
  EXPECT_EQ(plan_flow(c, auto_request(2000)).reason, DecisionReason::kNoProducer);
  c[0].has_connector = false;
  c[1].has_connector = true;
  EXPECT_EQ(plan_flow(c, auto_request(2000)).reason, DecisionReason::kNoProducer);  // the decoder cannot receive
}

TEST(PromptTokensMatter, OnlyWhenADecisionCanDependOnThem) {
  PlanRequest request = auto_request(0);
  std::vector<Candidate> lone = {reported(InstanceRole::kBoth)};
  EXPECT_FALSE(prompt_tokens_matter(lone, request, false));
  EXPECT_TRUE(prompt_tokens_matter(lone, request, true));  // scored, and a cache to match
  std::vector<Candidate> pair = {reported(InstanceRole::kBoth), reported(InstanceRole::kBoth)};
  EXPECT_TRUE(prompt_tokens_matter(pair, request, false));
  pair[1].has_connector = false;
  EXPECT_FALSE(prompt_tokens_matter(pair, request, false));
  std::vector<Candidate> pd = {reported(InstanceRole::kProducer), reported(InstanceRole::kConsumer)};
  EXPECT_TRUE(prompt_tokens_matter(pd, request, false));
  request.pd_policy = PdPolicy::kAlways;
  EXPECT_FALSE(prompt_tokens_matter(pd, request, false));
  request.consumer_policy = request.producer_policy = PolicyKind::kLeastOutstanding;
  EXPECT_FALSE(prompt_tokens_matter(pd, request, true));
}

TEST(PickRetryProducer, ARetryIsScoredLikeTheFirstPickAmongTheProducersNotTriedYet) {
  // The first producer failed; of the others, the idle one is chosen, not the one with a long queue.
  std::vector<Candidate> c = {reported(InstanceRole::kProducer), reported(InstanceRole::kConsumer),
                              reported(InstanceRole::kProducer, /*queued=*/50000),
                              reported(InstanceRole::kProducer, /*queued=*/0)};
  const PlanRequest request = auto_request(2000);
  const FlowPlan plan = plan_flow(c, request);
  ASSERT_EQ(plan.producer, 0u);
  c[0].excluded = true;
  for (uint64_t ticket = 0; ticket < 4; ++ticket) EXPECT_EQ(pick_retry_producer(c, request, plan, ticket, 0), 3u);
  // Its cached prefix counts too: a producer holding most of the prompt costs less than an idle one.
  c[2].load->num_queued_prefill_tokens = 500;
  c[2].cached_tokens = 1920;
  EXPECT_EQ(pick_retry_producer(c, request, plan, 0, 0), 2u);
  c[2].excluded = true;
  c[3].excluded = true;
  EXPECT_FALSE(pick_retry_producer(c, request, plan, 0, 0).has_value());
}

TEST(PickRetryProducer, UnderAutoAKvBothInstanceTakesOverButNeverTheDecodingOne) {
  std::vector<Candidate> c = {reported(InstanceRole::kBoth), reported(InstanceRole::kBoth),
                              reported(InstanceRole::kBoth)};
  const PlanRequest request = auto_request(2000);
  const FlowPlan plan = plan_flow(c, request);
  ASSERT_EQ(plan.kind, FlowKind::kPdWrite);
  ASSERT_TRUE(plan.producer.has_value() && plan.consumer.has_value());
  c[*plan.producer].excluded = true;
  const std::optional<size_t> retry = pick_retry_producer(c, request, plan, 0, 0);
  ASSERT_TRUE(retry.has_value());
  EXPECT_NE(*retry, *plan.producer);
  EXPECT_NE(*retry, *plan.consumer);
  c[*retry].excluded = true;
  EXPECT_FALSE(pick_retry_producer(c, request, plan, 0, 0).has_value());
  // A plan that is not P/D has no producer to replace.
  FlowPlan local = plan;
  local.kind = FlowKind::kCollocated;
  EXPECT_FALSE(pick_retry_producer(c, request, local, 0, 0).has_value());
}

TEST(ParsePdPolicy, AcceptsTheThreeNamesOnly) {
  EXPECT_EQ(*parse_pd_policy("always"), PdPolicy::kAlways);
  EXPECT_EQ(*parse_pd_policy("never"), PdPolicy::kNever);
  EXPECT_EQ(*parse_pd_policy("auto"), PdPolicy::kAuto);
  EXPECT_FALSE(parse_pd_policy("sometimes").ok());
  EXPECT_EQ(*parse_policy("scored"), PolicyKind::kScored);
}

}  // namespace
}  // namespace pd::router
