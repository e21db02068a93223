#include "router/instance_registry.h"

#include <gtest/gtest.h>

namespace pd::router {
namespace {

using namespace std::chrono_literals;

InstanceInfo instance(const std::string& id, uint64_t nonce) {
  InstanceInfo info;
  info.role = InstanceRole::kProducer;
  info.http = {"127.0.0.1", 8000};
  info.control = HostPort{"127.0.0.1", 9000};
  info.instance_id = id;
  info.boot_nonce = nonce;
  info.model = "m";
  return info;
}

TEST(InstanceRegistry, HeartbeatRefreshesAndKeepsEntryAlive) {
  InstanceRegistry registry(5000ms);
  const auto t0 = SteadyClock::time_point{} + 100s;
  EXPECT_EQ(registry.upsert(instance("p0", 1), t0), UpsertOutcome::kAdded);
  EXPECT_EQ(registry.upsert(instance("p0", 1), t0 + 3s), UpsertOutcome::kRefreshed);
  EXPECT_TRUE(registry.expire(t0 + 7s).empty());
  EXPECT_EQ(registry.size(), 1u);
}

TEST(InstanceRegistry, SilentEntryExpiresAtTtlAndEveryEntryIsScanned) {
  InstanceRegistry registry(5000ms);
  const auto t0 = SteadyClock::time_point{} + 100s;
  registry.upsert(instance("a", 1), t0);
  registry.upsert(instance("b", 1), t0 + 1s);
  registry.upsert(instance("c", 1), t0);
  EXPECT_TRUE(registry.expire(t0 + 4999ms).empty());
  auto expired = registry.expire(t0 + 5000ms);
  ASSERT_EQ(expired.size(), 2u);
  EXPECT_EQ(expired[0].instance_id, "a");
  EXPECT_EQ(expired[1].instance_id, "c");
  EXPECT_EQ(registry.size(), 1u);
  EXPECT_EQ(registry.expire(t0 + 6s).size(), 1u);
  EXPECT_EQ(registry.size(), 0u);
}

TEST(InstanceRegistry, NewBootNonceReplacesTheOldIncarnation) {
  InstanceRegistry registry(5000ms);
  const auto t0 = SteadyClock::time_point{} + 100s;
  registry.upsert(instance("p0", 1), t0);
  EXPECT_EQ(registry.upsert(instance("p0", 2), t0 + 1s), UpsertOutcome::kReplaced);
  ASSERT_EQ(registry.size(), 1u);
  EXPECT_EQ(registry.entries().at("p0").info.boot_nonce, 2u);
}

TEST(InstanceRegistry, ChangedAddressAlsoReplaces) {
  InstanceRegistry registry(5000ms);
  const auto t0 = SteadyClock::time_point{} + 100s;
  registry.upsert(instance("p0", 1), t0);
  InstanceInfo moved = instance("p0", 1);
  moved.http.port = 8001;
  EXPECT_EQ(registry.upsert(moved, t0), UpsertOutcome::kReplaced);
  EXPECT_EQ(registry.entries().at("p0").info.http.port, 8001);
}

TEST(InstanceRegistry, ReAdmitsAnExpiredInstance) {
  InstanceRegistry registry(5000ms);
  const auto t0 = SteadyClock::time_point{} + 100s;
  registry.upsert(instance("p0", 1), t0);
  ASSERT_EQ(registry.expire(t0 + 10s).size(), 1u);
  EXPECT_EQ(registry.upsert(instance("p0", 2), t0 + 11s), UpsertOutcome::kAdded);
}

}  // namespace
}  // namespace pd::router
