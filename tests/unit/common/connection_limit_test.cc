#include "common/connection_limit.h"

#include <gtest/gtest.h>

#include <vector>

namespace pd {
namespace {

constexpr std::string_view kFlag = "--max-connections";
const ConnectionFdBudget kOneFdPlus100Reserved{1, 100};

TEST(ConnectionLimitPlan, CapThatFitsTheSoftLimitLeavesTheLimitAlone) {
  auto plan = plan_connection_limit(kFlag, 900, /*requested_explicitly=*/true, kOneFdPlus100Reserved, {1000, 4096});
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(plan->max_connections, 900);
  EXPECT_EQ(plan->soft_limit, 1000u);
  EXPECT_TRUE(plan->lowered_note.empty());
}

TEST(ConnectionLimitPlan, ShortSoftLimitIsRaisedToTheHardLimit) {
  auto plan = plan_connection_limit(kFlag, 1024, /*requested_explicitly=*/false, kOneFdPlus100Reserved, {1024, 4096});
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(plan->max_connections, 1024);
  EXPECT_EQ(plan->soft_limit, 4096u);
  EXPECT_TRUE(plan->lowered_note.empty());
}

TEST(ConnectionLimitPlan, UnlimitedHardLimitRaisesTheSoftLimitToWhatTheCapNeeds) {
  auto plan = plan_connection_limit(kFlag, 1000, /*requested_explicitly=*/true, ConnectionFdBudget{3, 100},
                                    {1024, OpenFileLimits::kUnlimited});
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(plan->soft_limit, 3100u);
}

TEST(ConnectionLimitPlan, ExplicitCapBeyondTheHardLimitIsRefusedNamingFlagAndLimit) {
  auto plan = plan_connection_limit(kFlag, 5000, /*requested_explicitly=*/true, kOneFdPlus100Reserved, {1024, 4096});
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), ErrorCode::kResourceExhausted);
  EXPECT_NE(plan.status().message().find("--max-connections 5000 needs 5100 file descriptors"), std::string::npos)
      << plan.status().message();
  EXPECT_NE(plan.status().message().find("hard limit is 4096"), std::string::npos) << plan.status().message();
}

TEST(ConnectionLimitPlan, DefaultCapBeyondTheHardLimitIsLoweredToFitAndSaysSo) {
  // Three files per connection (a router: client + two backend legs): (1000 - 100) / 3 = 300.
  auto plan =
      plan_connection_limit(kFlag, 1024, /*requested_explicitly=*/false, ConnectionFdBudget{3, 100}, {1000, 1000});
  ASSERT_TRUE(plan.ok()) << plan.status().to_string();
  EXPECT_EQ(plan->max_connections, 300);
  EXPECT_EQ(plan->soft_limit, 1000u);
  EXPECT_NE(plan->lowered_note.find("--max-connections lowered from its default 1024 to 300"), std::string::npos)
      << plan->lowered_note;
}

TEST(ConnectionLimitPlan, LimitWithNoRoomForAnyConnectionIsRefusedEvenForTheDefault) {
  auto plan = plan_connection_limit(kFlag, 1024, /*requested_explicitly=*/false, kOneFdPlus100Reserved, {64, 100});
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), ErrorCode::kResourceExhausted);
}

TEST(ConnectionLimitPlan, CapBelowOneIsInvalid) {
  auto plan = plan_connection_limit(kFlag, 0, /*requested_explicitly=*/true, kOneFdPlus100Reserved, {1024, 4096});
  ASSERT_FALSE(plan.ok());
  EXPECT_EQ(plan.status().code(), ErrorCode::kInvalidArgument);
}

TEST(ConnectionSlot, IsHeldUntilDestroyedAndReleasedOnceAfterAMove) {
  std::atomic<int64_t> num_held{0};
  {
    ConnectionSlot first(num_held);
    EXPECT_EQ(num_held.load(), 1);
    {
      ConnectionSlot moved(std::move(first));
      EXPECT_EQ(num_held.load(), 1);
    }
    EXPECT_EQ(num_held.load(), 0);
  }
  EXPECT_EQ(num_held.load(), 0);
}

TEST(ConnectionGate, ServesUpToTheCapThenRefusesThenDropsAFlood) {
  using Verdict = ConnectionGate::Verdict;
  ConnectionGate gate(2);
  int64_t now_ns = 0;
  auto first = gate.admit(now_ns);
  auto second = gate.admit(now_ns);
  ASSERT_EQ(first.verdict, Verdict::kServe);
  ASSERT_EQ(second.verdict, Verdict::kServe);
  EXPECT_EQ(gate.num_connections(), 2);
  // At the cap: refusals are answered, kMaxRefusalsInFlight at a time; beyond that, dropped.
  std::vector<ConnectionGate::Admission> refusals;
  for (int64_t i = 0; i < ConnectionGate::kMaxRefusalsInFlight; ++i) {
    refusals.push_back(gate.admit(now_ns += 1'000));
    ASSERT_EQ(refusals.back().verdict, Verdict::kRefuse) << i;
    ASSERT_TRUE(refusals.back().slot.has_value());
  }
  EXPECT_TRUE(refusals.front().log_now) << "the first refusal is logged";
  EXPECT_FALSE(refusals.back().log_now) << "then at most one line per second";
  auto flood = gate.admit(now_ns += 1'000);
  EXPECT_EQ(flood.verdict, Verdict::kDrop);
  EXPECT_FALSE(flood.slot.has_value());
  // An answered refusal frees its slot; a closed connection frees a place under the cap.
  refusals.pop_back();
  EXPECT_EQ(gate.admit(now_ns += 1'000).verdict, Verdict::kRefuse);
  first.slot.reset();
  EXPECT_EQ(gate.num_connections(), 1);
  auto third = gate.admit(now_ns += 1'000);
  EXPECT_EQ(third.verdict, Verdict::kServe);
  // A second later the next refusal is logged again, with the count of those held back.
  auto later = gate.admit(now_ns + 2'000'000'000);
  EXPECT_EQ(later.verdict, Verdict::kRefuse);
  EXPECT_TRUE(later.log_now);
  EXPECT_GT(later.num_held_back, 0);
}

}  // namespace
}  // namespace pd
