#include "router/idle_pool.h"

#include <gtest/gtest.h>

#include <memory>

namespace pd::router {
namespace {

using Pool = IdlePool<std::unique_ptr<int>>;
using std::chrono::milliseconds;

const Pool::TimePoint kStart{};

TEST(IdlePool, HandsOutTheMostRecentlyUsedConnection) {
  Pool pool(8, milliseconds(1000));
  pool.put(std::make_unique<int>(1), kStart);
  pool.put(std::make_unique<int>(2), kStart + milliseconds(10));
  auto taken = pool.take(kStart + milliseconds(20));
  ASSERT_TRUE(taken);
  EXPECT_EQ(*taken, 2);
  EXPECT_EQ(pool.size(), 1u);
}

TEST(IdlePool, NeverHandsOutAConnectionIdleForMaxIdle) {
  // The engine closes a connection idle for its keep-alive; every pooled one idled that long, so
  // none of them may be handed out (taking the next pooled one after a stale one fails too).
  Pool pool(8, milliseconds(1000));
  for (int i = 0; i < 5; ++i) pool.put(std::make_unique<int>(i), kStart + milliseconds(i));
  EXPECT_FALSE(pool.take(kStart + milliseconds(1004)));
  EXPECT_EQ(pool.size(), 0u);
}

TEST(IdlePool, DropsOnlyTheExpiredEntries) {
  Pool pool(8, milliseconds(1000));
  pool.put(std::make_unique<int>(1), kStart);
  pool.put(std::make_unique<int>(2), kStart + milliseconds(500));
  EXPECT_EQ(pool.prune(kStart + milliseconds(999)), 0u);
  EXPECT_EQ(pool.prune(kStart + milliseconds(1000)), 1u);
  auto taken = pool.take(kStart + milliseconds(1499));
  ASSERT_TRUE(taken);
  EXPECT_EQ(*taken, 2);
}

TEST(IdlePool, ShrinksToWhatASteadyLoadUses) {
  // A burst leaves 100 connections; afterwards one request at a time reuses the freshest one and
  // the others age out, so the pool holds what the load uses.
  Pool pool(1024, milliseconds(1000));
  for (int i = 0; i < 100; ++i) pool.put(std::make_unique<int>(i), kStart);
  auto now = kStart;
  for (int step = 0; step < 30; ++step) {
    now += milliseconds(100);
    auto connection = pool.take(now);
    ASSERT_TRUE(connection);
    pool.put(std::move(connection), now);
  }
  EXPECT_EQ(pool.size(), 1u);
}

TEST(IdlePool, IsBoundedByMaxSizeDroppingTheOldest) {
  Pool pool(2, milliseconds(1000));
  pool.put(std::make_unique<int>(1), kStart);
  pool.put(std::make_unique<int>(2), kStart);
  pool.put(std::make_unique<int>(3), kStart);
  EXPECT_EQ(pool.size(), 2u);
  EXPECT_EQ(*pool.take(kStart), 3);
  EXPECT_EQ(*pool.take(kStart), 2);
  EXPECT_FALSE(pool.take(kStart));
  Pool none(0, milliseconds(1000));
  none.put(std::make_unique<int>(1), kStart);
  EXPECT_EQ(none.size(), 0u);
}

}  // namespace
}  // namespace pd::router
