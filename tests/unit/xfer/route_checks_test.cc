#include "xfer/backends/route_checks.h"

#include <gtest/gtest.h>

#include <limits>

namespace pd::xfer {
namespace {

TEST(RouteChecks, SpanWithinHoldsAtTheEdgesAndNeverOverflows) {
  EXPECT_TRUE(span_within(0, 100, 100));
  EXPECT_TRUE(span_within(100, 0, 100));
  EXPECT_TRUE(span_within(40, 60, 100));
  EXPECT_FALSE(span_within(41, 60, 100));
  EXPECT_FALSE(span_within(101, 0, 100));
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  // offset + bytes wraps to a small number: a check written as `offset + bytes <= limit` passes it.
  EXPECT_FALSE(span_within(kMax - 10, 20, 100));
  EXPECT_FALSE(span_within(50, kMax, 100));
}

TEST(RouteChecks, ProcessRegionsAdmitOnlyRegisteredSpansUntilDeregistered) {
  ProcessRegions& regions = ProcessRegions::instance();
  int owner_a = 0, owner_b = 0;
  regions.add(&owner_a, 1, 0x10000, 0x1000);
  regions.add(&owner_b, 1, 0x40000, 0x2000);
  EXPECT_TRUE(regions.contains(0x10000, 0x1000));
  EXPECT_TRUE(regions.contains(0x10800, 0x800));
  EXPECT_TRUE(regions.contains(0x41000, 0x1000));
  EXPECT_FALSE(regions.contains(0x10800, 0x801));  // runs past the region's end
  EXPECT_FALSE(regions.contains(0x0ff00, 0x200));  // starts before it
  EXPECT_FALSE(regions.contains(0x20000, 0x10));   // between regions
  EXPECT_FALSE(regions.contains(0x10000, std::numeric_limits<uint64_t>::max()));
  regions.remove(&owner_a, 1);
  EXPECT_FALSE(regions.contains(0x10000, 0x1000));
  EXPECT_TRUE(regions.contains(0x40000, 0x2000));  // the same id of another backend stays
  regions.remove_owner(&owner_b);
  EXPECT_FALSE(regions.contains(0x40000, 0x2000));
}

}  // namespace
}  // namespace pd::xfer
