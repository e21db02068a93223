#include "common/log_throttle.h"

#include <gtest/gtest.h>

namespace pd {
namespace {

constexpr int64_t kSecondNs = 1'000'000'000;

TEST(LogThrottle, FirstEventIsLogged) {
  LogThrottle throttle(kSecondNs);
  EXPECT_TRUE(throttle.admit(5 * kSecondNs));
  EXPECT_EQ(throttle.num_held_back(), 0);
}

TEST(LogThrottle, EventsWithinTheIntervalAreHeldBackAndTheNextLoggedOneCountsThem) {
  LogThrottle throttle(kSecondNs);
  ASSERT_TRUE(throttle.admit(0));
  for (int i = 1; i <= 3; ++i) EXPECT_FALSE(throttle.admit(i * kSecondNs / 4));
  EXPECT_TRUE(throttle.admit(kSecondNs));
  EXPECT_EQ(throttle.num_held_back(), 3);
  EXPECT_FALSE(throttle.admit(kSecondNs + 1));
  EXPECT_TRUE(throttle.admit(3 * kSecondNs));
  EXPECT_EQ(throttle.num_held_back(), 1);
}

}  // namespace
}  // namespace pd
