#include "xfer/ops.h"

#include <gtest/gtest.h>

#include <random>

namespace pd::xfer {
namespace {

TEST(NormalizeOps, SortsByDestinationAndMergesRunsContiguousOnBothSides) {
  std::vector<Op> ops = {{8192, 4096, 4096}, {0, 0, 4096}, {4096, 100000, 4096}, {12288, 8192, 4096}};
  auto result = normalize_ops(ops, Direction::kWrite, 1 << 20, 1 << 20);
  ASSERT_TRUE(result.ok()) << result.status().to_string();
  // remote 0..4096 then 4096..12288 (two ops merged, local 8192..16384), then 100000.
  std::vector<Op> expected = {{0, 0, 4096}, {8192, 4096, 8192}, {4096, 100000, 4096}};
  EXPECT_EQ(*result, expected);
}

TEST(NormalizeOps, DoesNotMergeRunsContiguousOnOneSideOnly) {
  std::vector<Op> ops = {{0, 0, 16}, {16, 32, 16}};
  auto result = normalize_ops(ops, Direction::kWrite, 1024, 1024);
  ASSERT_TRUE(result.ok());
  EXPECT_EQ(result->size(), 2u);
}

TEST(NormalizeOps, ReadsSortAndCheckOverlapOnTheLocalSide) {
  // Two reads of one remote block into different local blocks are fine...
  std::vector<Op> fan_out = {{0, 64, 64}, {128, 64, 64}};
  EXPECT_TRUE(normalize_ops(fan_out, Direction::kRead, 1024, 1024).ok());
  // ...two reads into one local block are not.
  std::vector<Op> clash = {{0, 0, 64}, {32, 512, 64}};
  auto result = normalize_ops(clash, Direction::kRead, 1024, 1024);
  ASSERT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), ErrorCode::kInvalidArgument);
}

TEST(NormalizeOps, RejectsOverlappingDestinationRanges) {
  std::vector<Op> ops = {{0, 0, 4096}, {8192, 4095, 2}};
  auto result = normalize_ops(ops, Direction::kWrite, 1 << 20, 1 << 20);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(result.status().message().find("overlaps"), std::string::npos) << result.status().message();
}

TEST(NormalizeOps, RejectsOutOfRangeOpsOnEitherSide) {
  std::vector<Op> local_past_end = {{1000, 0, 25}};
  auto a = normalize_ops(local_past_end, Direction::kWrite, 1024, 4096);
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), ErrorCode::kOutOfRange);
  EXPECT_NE(a.status().message().find("local"), std::string::npos);
  std::vector<Op> remote_past_end = {{0, 4000, 100}};
  auto b = normalize_ops(remote_past_end, Direction::kWrite, 1 << 20, 4096);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("remote"), std::string::npos);
}

TEST(NormalizeOps, RejectsOffsetsThatOverflow) {
  std::vector<Op> ops = {{UINT64_MAX - 10, 0, 64}};
  EXPECT_EQ(normalize_ops(ops, Direction::kWrite, UINT64_MAX, UINT64_MAX).status().code(), ErrorCode::kOutOfRange);
}

TEST(NormalizeOps, RejectsZeroByteOps) {
  std::vector<Op> ops = {{0, 0, 0}};
  EXPECT_EQ(normalize_ops(ops, Direction::kWrite, 1024, 1024).status().code(), ErrorCode::kInvalidArgument);
}

TEST(NormalizeOps, EmptyBatchIsValidAndEmpty) {
  auto result = normalize_ops({}, Direction::kWrite, 1024, 1024);
  ASSERT_TRUE(result.ok());
  EXPECT_TRUE(result->empty());
}

TEST(NormalizeOps, RandomBatchesCoverExactlyTheSameBytesAfterMerging) {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 50; ++round) {
    const uint64_t block = 64, num_blocks = 256;
    std::vector<uint64_t> dst(num_blocks);
    for (uint64_t i = 0; i < num_blocks; ++i) dst[i] = i;
    std::shuffle(dst.begin(), dst.end(), rng);
    std::vector<Op> ops;
    for (uint64_t i = 0; i < 100; ++i) ops.push_back({i * block, dst[i] * block, block});
    auto result = normalize_ops(ops, Direction::kWrite, num_blocks * block, num_blocks * block);
    ASSERT_TRUE(result.ok());
    // Expand the merged ops back to (local, remote) byte pairs per block and compare.
    std::map<uint64_t, uint64_t> from_merged;
    for (const Op& op : *result) {
      for (uint64_t b = 0; b < op.bytes; b += block) from_merged[op.remote_offset + b] = op.local_offset + b;
    }
    std::map<uint64_t, uint64_t> from_input;
    for (const Op& op : ops) from_input[op.remote_offset] = op.local_offset;
    EXPECT_EQ(from_merged, from_input);
    for (size_t i = 1; i < result->size(); ++i) {
      EXPECT_LT((*result)[i - 1].remote_offset, (*result)[i].remote_offset);
    }
  }
}

}  // namespace
}  // namespace pd::xfer
