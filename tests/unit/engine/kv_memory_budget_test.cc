#include "engine/kv_memory_budget.h"

#include <gtest/gtest.h>

namespace pd::engine {
namespace {

constexpr size_t kGiB = 1ull << 30;
constexpr size_t kMiB = 1ull << 20;

KvMemoryBudgetInput h200(size_t free_at_start, size_t own_bytes, double utilization) {
  KvMemoryBudgetInput in;
  in.total_bytes = 140 * kGiB;
  in.free_bytes_at_start = free_at_start;
  in.free_bytes_now = free_at_start - own_bytes;
  in.own_bytes = own_bytes;
  in.gpu_memory_utilization = utilization;
  in.reserve_bytes = 512 * kMiB;
  in.bytes_per_block = 2 * kMiB;
  return in;
}

TEST(KvMemoryBudget, ShareIsOfTotalMemoryMinusOnlyThisInstancesOwnAllocations) {
  // 0.4 x 140 GiB = 56 GiB; this instance holds 10 GiB of weights; 0.5 GiB reserve.
  auto blocks = kv_cache_blocks_for_budget(h200(139 * kGiB, 10 * kGiB, 0.4));
  ASSERT_TRUE(blocks.ok()) << blocks.status().to_string();
  EXPECT_EQ(*blocks, static_cast<int64_t>((56 * kGiB - 10 * kGiB - 512 * kMiB) / (2 * kMiB)));
}

TEST(KvMemoryBudget, AnotherProcessesMemoryDoesNotShrinkTheShare) {
  // A producer already holds 56 GiB of the device: a consumer at 0.4 still gets its
  // own 56 GiB (the same blocks as on an empty device), not 56 - 56.
  auto alone = kv_cache_blocks_for_budget(h200(139 * kGiB, 10 * kGiB, 0.4));
  auto beside = kv_cache_blocks_for_budget(h200(83 * kGiB, 10 * kGiB, 0.4));
  ASSERT_TRUE(alone.ok());
  ASSERT_TRUE(beside.ok()) << beside.status().to_string();
  EXPECT_EQ(*beside, *alone);
  EXPECT_GT(*beside, 0);
}

TEST(KvMemoryBudget, AnInstanceStartingBesideItAtTheSameTimeIsNotCountedAsOwn) {
  // A producer and a consumer start together on one H200 at 0.4 each; while the
  // consumer loads its 31 GiB of weights the producer allocates 27 GiB of its own.
  // The consumer's share is still 56 GiB minus its own 31 GiB.
  KvMemoryBudgetInput in = h200(139 * kGiB, 31 * kGiB, 0.4);
  in.free_bytes_now = (139 - 31 - 27) * kGiB;
  auto blocks = kv_cache_blocks_for_budget(in);
  ASSERT_TRUE(blocks.ok()) << blocks.status().to_string();
  EXPECT_EQ(*blocks, static_cast<int64_t>((56 * kGiB - 31 * kGiB - 512 * kMiB) / (2 * kMiB)));
}

TEST(KvMemoryBudget, ThePoolNeverTakesMoreThanIsFreeWhenItIsSized) {
  // Others overcommitted the device: only 4 GiB are free although the share leaves 45.
  KvMemoryBudgetInput in = h200(139 * kGiB, 10 * kGiB, 0.4);
  in.free_bytes_now = 4 * kGiB;
  auto blocks = kv_cache_blocks_for_budget(in);
  ASSERT_TRUE(blocks.ok()) << blocks.status().to_string();
  EXPECT_EQ(*blocks, static_cast<int64_t>((4 * kGiB - 512 * kMiB) / (2 * kMiB)));
  in.free_bytes_now = 256 * kMiB;
  blocks = kv_cache_blocks_for_budget(in);
  ASSERT_FALSE(blocks.ok());
  EXPECT_EQ(blocks.status().code(), ErrorCode::kResourceExhausted);
  EXPECT_NE(blocks.status().message().find("free now"), std::string::npos) << blocks.status().message();
}

TEST(KvMemoryBudget, ShareNotFreeAtStartUpIsRefusedNamingBothAmounts) {
  // 0.9 x 140 GiB = 126 GiB cannot be had when only 83 GiB are free.
  auto blocks = kv_cache_blocks_for_budget(h200(83 * kGiB, 10 * kGiB, 0.9));
  ASSERT_FALSE(blocks.ok());
  EXPECT_EQ(blocks.status().code(), ErrorCode::kResourceExhausted);
  EXPECT_NE(blocks.status().message().find("83.00 GiB"), std::string::npos) << blocks.status().message();
  EXPECT_NE(blocks.status().message().find("126.00 GiB"), std::string::npos) << blocks.status().message();
}

TEST(KvMemoryBudget, WeightsLargerThanTheShareLeaveNoBlocks) {
  auto blocks = kv_cache_blocks_for_budget(h200(139 * kGiB, 60 * kGiB, 0.4));
  ASSERT_FALSE(blocks.ok());
  EXPECT_EQ(blocks.status().code(), ErrorCode::kResourceExhausted);
  EXPECT_NE(blocks.status().message().find("KV cache"), std::string::npos);
}

TEST(KvMemoryBudget, MemoryFreedByOthersDuringStartUpDoesNotEnlargeTheShare) {
  // free_now above free_at_start (another process exited): the share stays 56 GiB.
  KvMemoryBudgetInput in = h200(100 * kGiB, 0, 0.4);
  in.free_bytes_now = 120 * kGiB;
  auto blocks = kv_cache_blocks_for_budget(in);
  ASSERT_TRUE(blocks.ok());
  EXPECT_EQ(*blocks, static_cast<int64_t>((56 * kGiB - 512 * kMiB) / (2 * kMiB)));
}

TEST(KvMemoryBudget, RejectsBadInput) {
  KvMemoryBudgetInput in = h200(100 * kGiB, 0, 0.0);
  EXPECT_EQ(kv_cache_blocks_for_budget(in).status().code(), ErrorCode::kInvalidArgument);
  in = h200(100 * kGiB, 0, 1.5);
  EXPECT_EQ(kv_cache_blocks_for_budget(in).status().code(), ErrorCode::kInvalidArgument);
  in = h200(100 * kGiB, 0, 0.5);
  in.bytes_per_block = 0;
  EXPECT_EQ(kv_cache_blocks_for_budget(in).status().code(), ErrorCode::kInvalidArgument);
  in = h200(100 * kGiB, 0, 0.5);
  in.free_bytes_at_start = 200 * kGiB;
  EXPECT_EQ(kv_cache_blocks_for_budget(in).status().code(), ErrorCode::kInvalidArgument);
}

}  // namespace
}  // namespace pd::engine
