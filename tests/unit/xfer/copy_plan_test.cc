// The host side of the cuda backend's posts: launch tables, work items, launch cuts,
// executed on the CPU by a reference of the copy kernel's chunk walk.
#include "xfer/backends/copy_plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>

#include "test_util.h"

namespace pd::xfer {
namespace {

// What the copy kernel does with one launch, on the host: chunk c belongs to the last op
// whose chunk_begin <= c and covers chunk_bytes of it from (c - chunk_begin) * chunk_bytes.
void copy_like_the_kernel(const CopyOp* table, const LaunchShape& shape) {
  ASSERT_GT(shape.num_ops, 0u);
  for (uint64_t chunk = 0; chunk < shape.num_chunks; ++chunk) {
    const CopyOp* op = std::upper_bound(table, table + shape.num_ops, chunk,
                                        [](uint64_t c, const CopyOp& o) { return c < o.chunk_begin; }) -
                       1;
    const uint64_t offset = (chunk - op->chunk_begin) * shape.chunk_bytes;
    ASSERT_LT(offset, op->bytes) << "chunk " << chunk << " past its op";
    const uint64_t n = std::min<uint64_t>(shape.chunk_bytes, op->bytes - offset);
    std::memcpy(reinterpret_cast<void*>(op->dst + offset), reinterpret_cast<const void*>(op->src + offset), n);
  }
}

struct Launches {
  std::vector<LaunchShape> shapes;
  uint64_t bytes = 0;
};

// Plans every launch of `ops` and runs each on the CPU between two host buffers.
Launches run_batch(std::span<const Op> ops, Direction direction, std::vector<uint8_t>& local,
                   std::vector<uint8_t>& remote, uint64_t max_ctas, bool pipelined) {
  LaunchScratch scratch;
  KernelLaunchPlanner planner(ops, direction, reinterpret_cast<uint64_t>(local.data()),
                              reinterpret_cast<uint64_t>(remote.data()), max_ctas, 64 * 1024, pipelined, scratch);
  Launches launches;
  while (!planner.done()) {
    const KernelLaunchPlanner::Launch launch = planner.next();
    EXPECT_LE(launch.shape.num_ops, kMaxInlineOps);
    EXPECT_EQ(launch.shape.grid, std::min<uint64_t>(launch.shape.num_chunks, max_ctas));
    copy_like_the_kernel(launch.table, launch.shape);
    launches.shapes.push_back(launch.shape);
    launches.bytes += launch.shape.bytes;
  }
  return launches;
}

// Distinct random blocks on both sides, every fifth op continuing the previous one on
// both sides (mergeable), some ops shorter than a block. Runs start on even blocks and
// continue on the odd block after, so no block is used twice.
std::vector<Op> random_ops(std::mt19937_64& rng, size_t num_ops, uint64_t block, uint64_t num_blocks) {
  std::vector<uint64_t> src(num_blocks / 2), dst(num_blocks / 2);
  for (uint64_t i = 0; i < num_blocks / 2; ++i) src[i] = dst[i] = 2 * i;
  std::shuffle(src.begin(), src.end(), rng);
  std::shuffle(dst.begin(), dst.end(), rng);
  std::vector<Op> ops;
  for (size_t i = 0; i < num_ops; ++i) {
    if (i % 5 == 4 && ops.back().bytes == block) {
      const Op& last = ops.back();
      ops.push_back({last.local_offset + block, last.remote_offset + block, block - rng() % 2 * (rng() % block)});
    } else {
      const uint64_t bytes = block - (rng() % 3 == 0 ? rng() % block : 0);
      ops.push_back({src[i] * block, dst[i] * block, bytes});
    }
  }
  return ops;
}

void expect_batch_landed(std::span<const Op> ops, Direction direction, const std::vector<uint8_t>& local,
                         const std::vector<uint8_t>& remote, const std::vector<uint8_t>& source_before) {
  const std::vector<uint8_t>& dst = direction == Direction::kWrite ? remote : local;
  std::vector<std::pair<uint64_t, uint64_t>> written;  // destination [begin, end) of each op
  for (const Op& op : ops) {
    const uint64_t from = direction == Direction::kWrite ? op.local_offset : op.remote_offset;
    const uint64_t to = direction == Direction::kWrite ? op.remote_offset : op.local_offset;
    ASSERT_EQ(0, std::memcmp(dst.data() + to, source_before.data() + from, op.bytes)) << "op at " << to;
    written.emplace_back(to, to + op.bytes);
  }
  std::sort(written.begin(), written.end());
  written.emplace_back(dst.size(), dst.size());
  uint64_t untouched = 0;  // start of the gap before the next op
  for (const auto& [begin, end] : written) {
    ASSERT_TRUE(std::all_of(dst.begin() + static_cast<ptrdiff_t>(untouched),
                            dst.begin() + static_cast<ptrdiff_t>(begin), [](uint8_t b) { return b == 0; }))
        << "a byte in [" << untouched << ", " << begin << ") outside every op was written";
    untouched = end;
  }
}

TEST(CopyPlan, EveryBatchLandsByteExactThroughThePlannedLaunches) {
  std::mt19937_64 rng(21);
  const uint64_t block = 1024, num_blocks = 6000;
  for (const bool pipelined : {false, true}) {
    for (const Direction direction : {Direction::kWrite, Direction::kRead}) {
      for (const size_t num_ops : {1, 125, 1000, 1001, 2500}) {
        std::vector<uint8_t> local(num_blocks * block), remote(num_blocks * block, 0);
        std::generate(local.begin(), local.end(), [&] { return static_cast<uint8_t>(rng()); });
        if (direction == Direction::kRead) std::swap(local, remote);
        const std::vector<uint8_t> source_before = direction == Direction::kWrite ? local : remote;
        const std::vector<Op> ops = random_ops(rng, num_ops, block, num_blocks);
        ASSERT_TRUE(validate_ops(ops, direction, local.size(), remote.size()).ok());
        const Launches launches = run_batch(ops, direction, local, remote, /*max_ctas=*/528, pipelined);
        uint64_t bytes = 0;
        for (const Op& op : ops) bytes += op.bytes;
        EXPECT_EQ(launches.bytes, bytes);
        expect_batch_landed(ops, direction, local, remote, source_before);
      }
    }
  }
}

TEST(CopyPlan, PipelinedLargeBatchStartsWithASmallLaunch) {
  std::vector<Op> ops;
  for (uint64_t i = 0; i < 4500; ++i) ops.push_back({i * 2 * 65536, (4499 - i) * 2 * 65536, 65536});  // no merges
  std::vector<uint8_t> local(4500 * 2 * 65536), remote(local.size(), 0);
  const Launches pipelined = run_batch(ops, Direction::kWrite, local, remote, 528, true);
  ASSERT_EQ(pipelined.shapes.size(), 6u);  // 128 + 4 x 1000 + 372
  EXPECT_EQ(pipelined.shapes[0].num_ops, kFirstLaunchOps);
  EXPECT_EQ(pipelined.shapes[1].num_ops, kMaxInlineOps);
  EXPECT_EQ(pipelined.shapes[5].num_ops, 4500 - kFirstLaunchOps - 4 * kMaxInlineOps);
  const Launches sorted_first = run_batch(ops, Direction::kWrite, local, remote, 528, false);
  ASSERT_EQ(sorted_first.shapes.size(), 5u);
  for (size_t i = 0; i + 1 < sorted_first.shapes.size(); ++i) EXPECT_EQ(sorted_first.shapes[i].num_ops, kMaxInlineOps);
}

TEST(CopyPlan, SmallBatchIsOneLaunchWhateverTheMode) {
  std::vector<Op> ops;
  for (uint64_t i = 0; i < 125; ++i) ops.push_back({i * 65536, (124 - i) * 65536, 65536});
  std::vector<uint8_t> local(125 * 65536), remote(local.size(), 0);
  for (const bool pipelined : {false, true}) {
    const Launches launches = run_batch(ops, Direction::kWrite, local, remote, 528, pipelined);
    ASSERT_EQ(launches.shapes.size(), 1u);
    // One wave: every CTA gets about one work item.
    EXPECT_EQ(launches.shapes[0].chunk_bytes, 16384u);
    EXPECT_EQ(launches.shapes[0].num_chunks, 500u);
    EXPECT_EQ(launches.shapes[0].grid, 500u);
  }
}

TEST(CopyPlan, MergedRunsBecomeOneTableEntry) {
  // 3,000 ops that continue one another on both sides: one op, one launch.
  std::vector<Op> ops;
  for (uint64_t i = 0; i < 3000; ++i) ops.push_back({i * 100, 7 + i * 100, 100});
  std::vector<uint8_t> local(300'000), remote(300'100, 0);
  testing::fill_pattern(local, 1);
  const Launches launches = run_batch(ops, Direction::kWrite, local, remote, 528, true);
  ASSERT_EQ(launches.shapes.size(), 1u);
  EXPECT_EQ(launches.shapes[0].num_ops, 1u);
  EXPECT_EQ(launches.shapes[0].bytes, 300'000u);
  EXPECT_EQ(0, std::memcmp(remote.data() + 7, local.data(), 300'000));
}

TEST(CopyPlan, WorkItemsAreWholePagesWithinTheLimit) {
  EXPECT_EQ(work_item_bytes(125 * 65536, 528, 1, 65536), 16384u);
  EXPECT_EQ(work_item_bytes(uint64_t{1} << 34, 528, 1, 65536), 65536u);  // capped
  EXPECT_EQ(work_item_bytes(100, 528, 4, 65536), 4096u);                 // at least a page
  EXPECT_EQ(work_item_bytes(1000 * 65536, 528, 4, 65536), 32768u);
  EXPECT_EQ(work_item_bytes(1 << 30, 528, 1, 1024), 4096u);  // a limit under a page gives a page
  for (uint64_t bytes : {uint64_t{1}, uint64_t{12345}, uint64_t{1} << 20, uint64_t{3} << 30}) {
    const uint64_t item = work_item_bytes(bytes, 264, 4, 65536);
    EXPECT_EQ(item % 4096, 0u);
    EXPECT_GE(item, 4096u);
    EXPECT_LE(item, 65536u);
  }
}

TEST(CopyPlan, LaunchCapacityAndWaves) {
  EXPECT_EQ(launch_capacity(0, 125, true), kMaxInlineOps);
  EXPECT_EQ(launch_capacity(0, kMaxInlineOps, true), kMaxInlineOps);
  EXPECT_EQ(launch_capacity(0, kMaxInlineOps + 1, true), kFirstLaunchOps);
  EXPECT_EQ(launch_capacity(1, kMaxInlineOps + 1, true), kMaxInlineOps);
  EXPECT_EQ(launch_capacity(0, kMaxInlineOps + 1, false), kMaxInlineOps);
  EXPECT_EQ(launch_waves(0, true, false), 1u);
  EXPECT_EQ(launch_waves(0, false, false), 4u);
  EXPECT_EQ(launch_waves(0, false, true), 1u);
  EXPECT_EQ(launch_waves(3, false, true), 4u);
}

TEST(CopyPlan, CopyAddressesFollowTheDirection) {
  const Op op{10, 20, 5};
  const CopyAddresses write = copy_addresses(op, Direction::kWrite, 1000, 5000);
  EXPECT_EQ(write.src, 1010u);
  EXPECT_EQ(write.dst, 5020u);
  const CopyAddresses read = copy_addresses(op, Direction::kRead, 1000, 5000);
  EXPECT_EQ(read.src, 5020u);
  EXPECT_EQ(read.dst, 1010u);
}

}  // namespace
}  // namespace pd::xfer
