#include "xfer/ops.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
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

namespace pd::xfer {
namespace {

// Random batches of every shape validate_ops has a proof for: blocks in ascending order,
// shuffled blocks (bitmap), unaligned ops spread thinly over a large region (sort), with
// and without a deliberate overlap, as writes and as reads.
std::vector<Op> random_batch(std::mt19937_64& rng, int shape, bool with_overlap) {
  std::vector<Op> ops;
  if (shape < 2) {
    const uint64_t block = 4096, num_blocks = 512;
    std::vector<uint64_t> ids(num_blocks);
    for (uint64_t i = 0; i < num_blocks; ++i) ids[i] = i;
    std::shuffle(ids.begin(), ids.end(), rng);
    std::vector<uint64_t> dst(ids.begin(), ids.begin() + 200);
    if (shape == 0) std::sort(dst.begin(), dst.end());
    for (uint64_t i = 0; i < dst.size(); ++i) ops.push_back({ids[300 + i % 200] * block, dst[i] * block, block});
  } else {
    // Ops of 1..300 bytes at random unaligned offsets 1 MiB apart: too sparse for a bitmap.
    for (uint64_t i = 0; i < 100; ++i) {
      ops.push_back({rng() % 4096, i * (1 << 20) + rng() % 1000, 1 + rng() % 300});
    }
    std::shuffle(ops.begin(), ops.end(), rng);
  }
  if (with_overlap) {
    Op clash = ops[rng() % ops.size()];
    if (shape < 2) {
      clash.local_offset = 0;  // a whole block written twice: the bitmap still applies
    } else {
      clash.remote_offset += rng() % clash.bytes;  // starts inside the other op's destination
      clash.bytes = 1;
    }
    ops.insert(ops.begin() + static_cast<ptrdiff_t>(rng() % (ops.size() + 1)), clash);
  }
  return ops;
}

TEST(ValidateOps, AcceptsAndRejectsExactlyWhatNormalizeDoes) {
  std::mt19937_64 rng(11);
  constexpr uint64_t kRegion = uint64_t{1} << 27;
  int num_rejected = 0;
  for (int round = 0; round < 600; ++round) {
    const int shape = round % 3;
    const bool with_overlap = (round / 3) % 2 == 1;
    std::vector<Op> ops = random_batch(rng, shape, with_overlap);
    const OverlapCheck expected_check[] = {with_overlap ? OverlapCheck::kBitmap : OverlapCheck::kAscending,
                                           OverlapCheck::kBitmap, OverlapCheck::kSorted};
    ASSERT_EQ(overlap_check_for(ops, Direction::kWrite), expected_check[shape]) << "round " << round;
    const Status validated = validate_ops(ops, Direction::kWrite, kRegion, kRegion);
    const auto normalized = normalize_ops(ops, Direction::kWrite, kRegion, kRegion);
    ASSERT_EQ(validated.ok(), normalized.ok())
        << "round " << round << ": " << validated.to_string() << " vs " << normalized.status().to_string();
    EXPECT_EQ(validated.ok(), !with_overlap) << "round " << round;
    if (!validated.ok()) {
      ++num_rejected;
      EXPECT_EQ(validated.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(validated.message().find("overlaps"), std::string::npos) << validated.message();
    }
  }
  EXPECT_EQ(num_rejected, 300);
}

TEST(ValidateOps, TakesTheCheapestProofThatHolds) {
  std::mt19937_64 rng(3);
  EXPECT_EQ(overlap_check_for(random_batch(rng, 0, false), Direction::kWrite), OverlapCheck::kAscending);
  EXPECT_EQ(overlap_check_for(random_batch(rng, 1, false), Direction::kWrite), OverlapCheck::kBitmap);
  EXPECT_EQ(overlap_check_for(random_batch(rng, 2, false), Direction::kWrite), OverlapCheck::kSorted);
  // Reads prove disjointness on the local side: the same shuffled blocks, mirrored.
  std::vector<Op> reads = random_batch(rng, 1, false);
  for (Op& op : reads) std::swap(op.local_offset, op.remote_offset);
  EXPECT_EQ(overlap_check_for(reads, Direction::kRead), OverlapCheck::kBitmap);
  EXPECT_TRUE(validate_ops(reads, Direction::kRead, 1 << 22, 1 << 22).ok());
}

TEST(ValidateOps, RejectsAnOverlapOnEveryPath) {
  // Ascending until the clash: the second op starts inside the first.
  std::vector<Op> ascending = {{0, 0, 4096}, {8192, 4095, 2}};
  // Shuffled 4 KiB blocks, one written twice (bitmap).
  std::vector<Op> twice = {{0, 8192, 4096}, {4096, 0, 4096}, {8192, 8192, 4096}};
  // Sparse unaligned ops, the last two overlapping by one byte (sort).
  std::vector<Op> sparse = {{0, 50'000'001, 10}, {0, 3, 7}, {0, 90'000'000, 5}, {0, 50'000'000, 2}};
  ASSERT_EQ(overlap_check_for(sparse, Direction::kWrite), OverlapCheck::kSorted);
  for (const auto* ops : {&ascending, &twice, &sparse}) {
    const Status s = validate_ops(*ops, Direction::kWrite, 1 << 20, 1 << 30);
    EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find("overlaps"), std::string::npos) << s.message();
  }
}

TEST(ValidateOps, ChecksSourcesForBoundsButNotForOverlap) {
  // One source block fanned out to two destinations is fine...
  std::vector<Op> fan_out = {{0, 4096, 4096}, {0, 0, 4096}};
  EXPECT_TRUE(validate_ops(fan_out, Direction::kWrite, 4096, 8192).ok());
  // ...a source past the local region is not.
  std::vector<Op> past_end = {{4096, 0, 4096}};
  const Status s = validate_ops(past_end, Direction::kWrite, 4096, 8192);
  EXPECT_EQ(s.code(), ErrorCode::kOutOfRange);
  EXPECT_NE(s.message().find("local"), std::string::npos);
}

TEST(ValidateOps, RejectsZeroBytesOverflowAndTooManyOps) {
  std::vector<Op> zero = {{0, 0, 0}};
  EXPECT_EQ(validate_ops(zero, Direction::kWrite, 1024, 1024).code(), ErrorCode::kInvalidArgument);
  std::vector<Op> overflow = {{UINT64_MAX - 10, 0, 64}};
  EXPECT_EQ(validate_ops(overflow, Direction::kWrite, UINT64_MAX, UINT64_MAX).code(), ErrorCode::kOutOfRange);
  std::vector<Op> too_many(kMaxOpsPerBatch + 1, Op{0, 0, 1});
  EXPECT_EQ(validate_ops(too_many, Direction::kWrite, 1024, 1024).code(), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(validate_ops({}, Direction::kWrite, 1024, 1024).ok());
}

std::vector<Op> merge_in_pieces(std::span<const Op> ops, size_t piece) {
  ConsecutiveMerger merger(ops);
  std::vector<Op> out, buffer(piece);
  while (!merger.done()) {
    const size_t n = merger.next(buffer);
    EXPECT_GT(n, 0u);
    out.insert(out.end(), buffer.begin(), buffer.begin() + static_cast<ptrdiff_t>(n));
  }
  EXPECT_EQ(merger.consumed(), ops.size());
  return out;
}

TEST(ConsecutiveMerger, OnADestinationSortedBatchGivesNormalizeOpsResult) {
  std::mt19937_64 rng(5);
  for (int round = 0; round < 100; ++round) {
    // Runs of 1..4 blocks contiguous on both sides, in destination order, sources shuffled by run.
    std::vector<Op> ops;
    uint64_t dst = 0;
    while (ops.size() < 300) {
      const uint64_t run = 1 + rng() % 4;
      const uint64_t src = (rng() % 1000) * 64 * 8;
      for (uint64_t i = 0; i < run; ++i) ops.push_back({src + i * 64, dst + i * 64, 64});
      dst += run * 64 + (rng() % 2) * 64;  // sometimes a gap on the destination side
    }
    const auto normalized = normalize_ops(ops, Direction::kWrite, 1 << 20, 1 << 20);
    ASSERT_TRUE(normalized.ok()) << normalized.status().to_string();
    EXPECT_EQ(merge_in_pieces(ops, ops.size()), *normalized);
  }
}

TEST(ConsecutiveMerger, PiecesOfAnySizeGiveTheSameOpsAndNeverSplitARun) {
  std::mt19937_64 rng(9);
  std::vector<Op> ops;
  for (uint64_t i = 0; i < 500; ++i) {
    // Every third op starts a new run elsewhere; the others continue the current run.
    if (i % 3 == 0) {
      ops.push_back({rng() % 100 * 4096, rng() % 100 * 4096, 16});
    } else {
      const Op& last = ops.back();
      ops.push_back({last.local_offset + last.bytes, last.remote_offset + last.bytes, 16});
    }
  }
  const std::vector<Op> whole = merge_in_pieces(ops, ops.size());
  EXPECT_LE(whole.size(), 167u);
  for (size_t piece : {1, 2, 3, 7, 128}) EXPECT_EQ(merge_in_pieces(ops, piece), whole) << "piece " << piece;
}

TEST(ConsecutiveMerger, MergesOnlyNeighboursContiguousOnBothSides) {
  // Contiguous on the destination side only, on the source side only, then contiguous on
  // both sides with the first op but not its neighbour.
  std::vector<Op> ops = {{0, 0, 16}, {32, 16, 16}, {48, 64, 16}, {100, 100, 4}, {16, 32, 16}};
  EXPECT_EQ(merge_in_pieces(ops, 8), ops);
}

}  // namespace
}  // namespace pd::xfer
