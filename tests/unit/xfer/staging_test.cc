// ucx staging (backends/ucx_staging.h): GPU regions moved through bounded host staging
// buffers and active messages. Here MemKind::kCuda regions are host memory standing in
// for a device (EngineConfig::ucx_staging = "memcpy"): the protocol, its chunking,
// bounds and failures run exactly as with a GPU, the device copy being a memcpy.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <thread>

#include "test_util.h"
#include "xfer/backends/staging_plan.h"
#include "xfer/engine.h"

namespace pd::xfer {
namespace {

using testing::fill_pattern;

constexpr int64_t kWaitMs = 20'000;

EngineConfig staged_config(const std::string& name, uint64_t chunk_bytes, uint32_t slots) {
  EngineConfig c;
  c.name = name;
  c.backends = {"ucx"};
  c.batch_timeout_ms = 10'000;
  c.ucx_staging = "memcpy";
  c.ucx_staging_chunk_bytes = chunk_bytes;
  c.ucx_staging_slots = slots;
  return c;
}

std::unique_ptr<TransferEngine> make_engine(const EngineConfig& c) {
  auto engine = TransferEngine::create(c);
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

// Distinct random blocks on both sides, plus one op spanning several chunks.
std::vector<Op> mixed_ops(std::mt19937_64& rng, uint64_t num_blocks, uint64_t block_bytes, size_t num_ops) {
  std::vector<uint64_t> src(num_blocks), dst(num_blocks);
  for (uint64_t i = 0; i < num_blocks; ++i) src[i] = dst[i] = i;
  std::shuffle(src.begin(), src.end(), rng);
  std::shuffle(dst.begin(), dst.end(), rng);
  std::vector<Op> ops;
  for (size_t i = 0; i < num_ops; ++i) ops.push_back({src[i] * block_bytes, dst[i] * block_bytes, block_bytes});
  // Bytes 1..block-1 of distinct unused blocks, unaligned.
  ops.push_back({src[num_ops] * block_bytes + 1, dst[num_ops] * block_bytes + 3, block_bytes - 5});
  return ops;
}

// Two engines in this process; regions of `kind` on both sides unless said otherwise.
class StagedEngines : public ::testing::Test {
 protected:
  void start(uint64_t chunk_bytes, uint32_t slots) {
    a_ = make_engine(staged_config("a", chunk_bytes, slots));
    b_ = make_engine(staged_config("b", chunk_bytes, slots));
    ASSERT_TRUE(a_ && b_);
    ASSERT_TRUE(a_->connect(b_->describe()).ok());
    ASSERT_TRUE(b_->connect(a_->describe()).ok());
  }
  void TearDown() override {
    a_.reset();
    b_.reset();
  }
  struct Side {
    std::vector<uint8_t> bytes;
    MemDesc desc;
  };
  Side region(TransferEngine& engine, size_t bytes, MemKind kind, uint64_t seed) {
    Side s;
    s.bytes.resize(bytes);
    if (seed != 0) fill_pattern(s.bytes, seed);
    auto d = engine.register_memory(s.bytes.data(), bytes, kind, kind == MemKind::kCuda ? 0 : -1);
    EXPECT_TRUE(d.ok()) << d.status().to_string();
    if (d.ok()) s.desc = *decode_mem_desc(encode(*d));
    return s;
  }
  std::unique_ptr<TransferEngine> a_, b_;
};

TEST_F(StagedEngines, GpuRegionsAreReachedThroughUcxWhenNoCudaBackendRuns) {
  start(64 << 10, 2);
  Side local = region(*a_, 4096, MemKind::kCuda, 1);
  Side remote = region(*b_, 4096, MemKind::kCuda, 0);
  auto session = a_->session(local.desc, remote.desc);  // "auto"
  ASSERT_TRUE(session.ok()) << session.status().to_string();
  EXPECT_EQ(session->backend(), "ucx");
}

TEST_F(StagedEngines, GpuToGpuWritesAndReadsAreByteExactAcrossManyChunks) {
  // 64 KiB chunks, 2 slots per role: a 2 MiB batch is >= 32 chunks through 2 buffers.
  start(64 << 10, 2);
  constexpr uint64_t kBlock = 16 << 10, kBlocks = 256;
  Side local = region(*a_, kBlock * kBlocks, MemKind::kCuda, 7);
  Side remote = region(*b_, kBlock * kBlocks, MemKind::kCuda, 0);
  auto session = a_->session(local.desc, remote.desc, "ucx");
  ASSERT_TRUE(session.ok()) << session.status().to_string();
  std::mt19937_64 rng(3);
  for (int round = 0; round < 3; ++round) {
    std::fill(remote.bytes.begin(), remote.bytes.end(), 0);
    std::vector<Op> ops = mixed_ops(rng, kBlocks, kBlock, 128);
    auto id = session->write(ops);
    ASSERT_TRUE(id.ok()) << id.status().to_string();
    Status s = a_->wait(*id, Deadline::after_ms(kWaitMs));
    ASSERT_TRUE(s.ok()) << s.to_string();
    // Done means in the target region: checked at once, no further synchronisation.
    std::vector<uint8_t> expected(remote.bytes.size(), 0);
    for (const Op& op : ops) std::memcpy(&expected[op.remote_offset], &local.bytes[op.local_offset], op.bytes);
    ASSERT_EQ(remote.bytes, expected) << "round " << round;

    std::vector<uint8_t> before = local.bytes;
    fill_pattern(remote.bytes, 100 + round);
    std::vector<Op> back = mixed_ops(rng, kBlocks, kBlock, 64);
    auto rid = session->read(back);
    ASSERT_TRUE(rid.ok());
    ASSERT_TRUE(a_->wait(*rid, Deadline::after_ms(kWaitMs)).ok());
    for (const Op& op : back) std::memcpy(&before[op.local_offset], &remote.bytes[op.remote_offset], op.bytes);
    ASSERT_EQ(local.bytes, before) << "read round " << round;
    a_->release(*id);
    a_->release(*rid);
  }
}

TEST_F(StagedEngines, GpuToHostAndHostToGpuAreByteExact) {
  start(32 << 10, 1);
  constexpr uint64_t kBytes = 256 << 10;
  Side gpu = region(*a_, kBytes, MemKind::kCuda, 11);
  Side host_remote = region(*b_, kBytes, MemKind::kHost, 0);
  Side host_local = region(*a_, kBytes, MemKind::kHost, 12);
  Side gpu_remote = region(*b_, kBytes, MemKind::kCuda, 0);
  auto from_gpu = a_->session(gpu.desc, host_remote.desc);
  auto from_host = a_->session(host_local.desc, gpu_remote.desc);
  ASSERT_TRUE(from_gpu.ok() && from_host.ok());
  std::vector<Op> whole = {{0, 0, kBytes}};
  auto x = from_gpu->write(whole);
  auto y = from_host->write(whole);
  ASSERT_TRUE(x.ok() && y.ok());
  ASSERT_TRUE(a_->wait(*x, Deadline::after_ms(kWaitMs)).ok());
  ASSERT_TRUE(a_->wait(*y, Deadline::after_ms(kWaitMs)).ok());
  EXPECT_EQ(host_remote.bytes, gpu.bytes);
  EXPECT_EQ(gpu_remote.bytes, host_local.bytes);
}

TEST_F(StagedEngines, BothEnginesWritingToEachOtherWithOneBufferPerRoleDoNotDeadlock) {
  // Every chunk of a's batches waits for b's single target buffer and vice versa; the
  // roles have separate buffers, so neither side's batches can starve the other's.
  start(16 << 10, 1);
  constexpr uint64_t kBytes = 1 << 20;
  Side a_src = region(*a_, kBytes, MemKind::kCuda, 21);
  Side a_dst = region(*a_, kBytes, MemKind::kCuda, 0);
  Side b_src = region(*b_, kBytes, MemKind::kCuda, 22);
  Side b_dst = region(*b_, kBytes, MemKind::kCuda, 0);
  auto ab = a_->session(a_src.desc, b_dst.desc);
  auto ba = b_->session(b_src.desc, a_dst.desc);
  ASSERT_TRUE(ab.ok() && ba.ok());
  std::vector<Op> whole = {{0, 0, kBytes}};
  std::vector<std::pair<TransferEngine*, XferId>> ids;
  for (int i = 0; i < 4; ++i) {
    auto x = ab->write(whole);
    auto y = ba->write(whole);
    ASSERT_TRUE(x.ok() && y.ok());
    ids.push_back({a_.get(), *x});
    ids.push_back({b_.get(), *y});
  }
  for (auto [engine, id] : ids) ASSERT_TRUE(engine->wait(id, Deadline::after_ms(kWaitMs)).ok());
  EXPECT_EQ(b_dst.bytes, a_src.bytes);
  EXPECT_EQ(a_dst.bytes, b_src.bytes);
}

TEST_F(StagedEngines, ConcurrentBatchesFromEightThreadsShareTheBoundedBuffers) {
  start(32 << 10, 2);
  constexpr int kThreads = 8;
  constexpr uint64_t kBlock = 8 << 10, kBlocks = 64;
  std::vector<Side> locals, remotes;
  for (int i = 0; i < kThreads; ++i) {
    locals.push_back(region(*a_, kBlock * kBlocks, MemKind::kCuda, 200 + i));
    remotes.push_back(region(*b_, kBlock * kBlocks, MemKind::kCuda, 0));
  }
  std::atomic<int> num_ok{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      auto session = a_->session(locals[i].desc, remotes[i].desc);
      if (!session.ok()) return;
      std::mt19937_64 rng(300 + i);
      for (int round = 0; round < 3; ++round) {
        std::vector<Op> ops = mixed_ops(rng, kBlocks, kBlock, 40);
        auto id = round % 2 == 0 ? session->write(ops) : session->read(ops);
        if (!id.ok() || !a_->wait(*id, Deadline::after_ms(kWaitMs)).ok()) return;
        for (const Op& op : ops) {
          if (std::memcmp(&locals[i].bytes[op.local_offset], &remotes[i].bytes[op.remote_offset], op.bytes) != 0) {
            return;
          }
        }
        a_->release(*id);
      }
      num_ok.fetch_add(1);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(num_ok.load(), kThreads);
}

TEST_F(StagedEngines, WriteToADeregisteredRemoteRegionFailsWithTheTargetsReason) {
  start(64 << 10, 2);
  Side local = region(*a_, 8192, MemKind::kCuda, 31);
  Side remote = region(*b_, 8192, MemKind::kCuda, 0);
  auto session = a_->session(local.desc, remote.desc);
  ASSERT_TRUE(session.ok());
  ASSERT_TRUE(b_->deregister(remote.desc.region_id).ok());
  std::vector<Op> ops = {{0, 0, 8192}};
  auto id = session->write(ops);
  ASSERT_TRUE(id.ok());
  Status s = a_->wait(*id, Deadline::after_ms(kWaitMs));
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("unknown region"), std::string::npos) << s.to_string();
  EXPECT_TRUE(std::all_of(remote.bytes.begin(), remote.bytes.end(), [](uint8_t b) { return b == 0; }));
  // The local region is free again: the failed batch retired.
  EXPECT_TRUE(a_->deregister(local.desc.region_id).ok());
}

TEST_F(StagedEngines, TargetRefusesPiecesOutsideItsRegionAndWritesNothing) {
  start(64 << 10, 2);
  Side local = region(*a_, 16384, MemKind::kCuda, 41);
  Side remote = region(*b_, 8192, MemKind::kCuda, 0);
  // A forged descriptor claiming a larger region: our engine's bounds check passes,
  // the target's (against what it registered) does not.
  MemDesc forged = remote.desc;
  forged.bytes = 16384;
  auto session = a_->session(local.desc, forged);
  ASSERT_TRUE(session.ok());
  std::vector<Op> ops = {{0, 4096, 8192}};
  auto id = session->write(ops);
  ASSERT_TRUE(id.ok());
  Status s = a_->wait(*id, Deadline::after_ms(kWaitMs));
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("bad request"), std::string::npos) << s.to_string();
  EXPECT_TRUE(std::all_of(remote.bytes.begin(), remote.bytes.end(), [](uint8_t b) { return b == 0; }));
}

TEST(StagingOff, GpuRegionsAreRefusedWithoutAStagingPath) {
  EngineConfig c = staged_config("off", 64 << 10, 2);
  c.ucx_staging = "off";
  auto engine = make_engine(c);
  ASSERT_TRUE(engine);
  std::vector<uint8_t> bytes(4096);
  EXPECT_EQ(engine->register_memory(bytes.data(), bytes.size(), MemKind::kCuda, 0).status().code(),
            ErrorCode::kFailedPrecondition);
}

TEST(StagingConfig, BadSettingsAreRefusedAtEngineCreation) {
  EngineConfig unknown_mode = staged_config("bad", 64 << 10, 2);
  unknown_mode.ucx_staging = "carrier-pigeon";
  EXPECT_EQ(TransferEngine::create(unknown_mode).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(TransferEngine::create(staged_config("bad", 64 << 10, 0)).status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(TransferEngine::create(staged_config("bad", 100, 2)).status().code(), ErrorCode::kInvalidArgument);
}

// ---- the pure parts: chunk plan and wire checks ----

TEST(StagingPlan, ChunksKeepOrderRespectBothBoundsAndCoverEveryByteOnce) {
  std::mt19937_64 rng(9);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<Op> ops;
    uint64_t total = 0, at = 0;
    const size_t n = 1 + rng() % 50;
    for (size_t i = 0; i < n; ++i) {
      const uint64_t bytes = 1 + rng() % 20'000;
      ops.push_back({at, at * 2 + 7, bytes});
      at += bytes + rng() % 100;
      total += bytes;
    }
    const uint64_t chunk = 1 + rng() % 10'000;
    const uint32_t max_pieces = 1 + static_cast<uint32_t>(rng() % 8);
    std::vector<StagingChunk> chunks = plan_staging_chunks(ops, chunk, max_pieces);
    // Concatenating every chunk's pieces gives back the ops, split but in order.
    std::vector<Op> flat;
    uint64_t covered = 0;
    for (const StagingChunk& c : chunks) {
      ASSERT_FALSE(c.pieces.empty());
      ASSERT_LE(c.pieces.size(), max_pieces);
      ASSERT_LE(c.bytes, chunk);
      uint64_t sum = 0;
      for (const Op& p : c.pieces) sum += p.bytes;
      ASSERT_EQ(sum, c.bytes);
      covered += c.bytes;
      flat.insert(flat.end(), c.pieces.begin(), c.pieces.end());
    }
    ASSERT_EQ(covered, total);
    size_t k = 0;
    for (const Op& op : ops) {
      uint64_t done = 0;
      while (done < op.bytes) {
        ASSERT_LT(k, flat.size());
        ASSERT_EQ(flat[k].local_offset, op.local_offset + done);
        ASSERT_EQ(flat[k].remote_offset, op.remote_offset + done);
        done += flat[k].bytes;
        ++k;
      }
      ASSERT_EQ(done, op.bytes);
    }
    ASSERT_EQ(k, flat.size());
    // Only the last chunk may be short of both bounds.
    for (size_t c = 0; c + 1 < chunks.size(); ++c) {
      ASSERT_TRUE(chunks[c].bytes == chunk || chunks[c].pieces.size() == max_pieces);
    }
  }
}

TEST(StagingWire, ChunkTokensNeverRepeatAndDependOnTheInstanceKey) {
  // Replies are matched by token alone: tokens must be distinct within an instance and not
  // the plain counter a forger could count along with.
  std::set<uint64_t> seen;
  constexpr uint64_t kKey = 0x1234abcd5678ef90ULL;
  for (uint64_t i = 0; i < 100'000; ++i) ASSERT_TRUE(seen.insert(staging_token(i, kKey)).second) << i;
  // Consecutive tokens are far apart (no counting along): no two differ by less than 2^32.
  int close_neighbours = 0;
  for (uint64_t i = 0; i < 1'000; ++i) {
    const uint64_t a = staging_token(i, kKey), b = staging_token(i + 1, kKey);
    close_neighbours += (a > b ? a - b : b - a) < (uint64_t{1} << 32);
  }
  EXPECT_EQ(close_neighbours, 0);
}

TEST(StagingWire, HeadersFromTheNetworkAreCheckedBeforeUse) {
  StagingHeader h;
  h.type = static_cast<uint32_t>(StagingMessage::kWrite);
  EXPECT_TRUE(decode_staging_header(&h, sizeof(h)).has_value());
  EXPECT_FALSE(decode_staging_header(&h, sizeof(h) - 1).has_value());
  EXPECT_FALSE(decode_staging_header(nullptr, 0).has_value());
  StagingHeader bad_magic = h;
  bad_magic.magic ^= 1;
  EXPECT_FALSE(decode_staging_header(&bad_magic, sizeof(h)).has_value());
  for (uint32_t type : {0u, 5u, 0xffffffffu}) {
    StagingHeader t = h;
    t.type = type;
    EXPECT_FALSE(decode_staging_header(&t, sizeof(t)).has_value()) << type;
  }
}

TEST(StagingWire, PieceTablesOutsideTheRegionOrInconsistentAreRefused) {
  auto check = [](std::vector<WirePiece> pieces, uint64_t data_bytes, uint64_t region_bytes, int64_t table_delta = 0) {
    StagingHeader h;
    h.type = static_cast<uint32_t>(StagingMessage::kWrite);
    h.num_pieces = static_cast<uint32_t>(pieces.size());
    h.data_bytes = data_bytes;
    std::vector<uint8_t> raw(pieces.size() * sizeof(WirePiece) + 1);
    if (!pieces.empty()) std::memcpy(raw.data() + 1, pieces.data(), pieces.size() * sizeof(WirePiece));  // unaligned
    return read_piece_table(h, raw.data() + 1, pieces.size() * sizeof(WirePiece) + table_delta, region_bytes).ok();
  };
  EXPECT_TRUE(check({{0, 10}, {100, 28}}, 38, 128));
  EXPECT_FALSE(check({{0, 10}, {100, 29}}, 39, 128));       // past the end
  EXPECT_FALSE(check({{0, 10}, {100, 28}}, 37, 128));       // sum differs from the header
  EXPECT_FALSE(check({{0, 0}}, 0, 128));                    // empty piece
  EXPECT_FALSE(check({{~0ull - 3, 8}}, 8, ~0ull));          // offset + bytes overflows
  EXPECT_FALSE(check({{0, ~0ull}, {0, ~0ull}}, 5, ~0ull));  // sum overflows
  EXPECT_FALSE(check({{0, 10}}, 10, 128, -1));              // table shorter than num_pieces
  EXPECT_FALSE(check({}, 0, 128));                          // no pieces
}

}  // namespace
}  // namespace pd::xfer
