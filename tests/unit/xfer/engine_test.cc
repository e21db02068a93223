// In-process tests: two engines in one process talking over real UCX.
#include "xfer/engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <thread>

#include "test_util.h"

namespace pd::xfer {
namespace {

using testing::fill_pattern;

EngineConfig config(const std::string& name, bool faults = false) {
  EngineConfig c;
  c.name = name;
  c.backends = {"ucx"};
  c.batch_timeout_ms = 10'000;
  c.enable_fault_injection = faults;
  return c;
}

std::unique_ptr<TransferEngine> make_engine(const EngineConfig& c) {
  auto engine = TransferEngine::create(c);
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

// Random block-to-block ops: `num_ops` distinct source and destination blocks.
std::vector<Op> random_block_ops(std::mt19937_64& rng, uint64_t num_blocks, uint64_t block_bytes, size_t num_ops) {
  std::vector<uint64_t> src(num_blocks), dst(num_blocks);
  for (uint64_t i = 0; i < num_blocks; ++i) src[i] = dst[i] = i;
  std::shuffle(src.begin(), src.end(), rng);
  std::shuffle(dst.begin(), dst.end(), rng);
  std::vector<Op> ops;
  for (size_t i = 0; i < num_ops; ++i) ops.push_back({src[i] * block_bytes, dst[i] * block_bytes, block_bytes});
  return ops;
}

class TwoEngines : public ::testing::Test {
 protected:
  void SetUp() override {
    a_ = make_engine(config("a", /*faults=*/true));
    b_ = make_engine(config("b"));
    ASSERT_TRUE(a_ && b_);
    ASSERT_TRUE(a_->connect(b_->describe()).ok());
    ASSERT_TRUE(b_->connect(a_->describe()).ok());
  }
  void TearDown() override {
    a_.reset();
    b_.reset();
  }

  struct Pair {
    std::vector<uint8_t> local, remote;
    MemDesc local_desc, remote_desc;
    Session session;
  };
  Pair make_pair(size_t bytes, uint64_t seed) {
    Pair p;
    p.local.resize(bytes);
    p.remote.assign(bytes, 0);
    fill_pattern(p.local, seed);
    auto l = a_->register_memory(p.local.data(), bytes, MemKind::kHost);
    auto r = b_->register_memory(p.remote.data(), bytes, MemKind::kHost);
    EXPECT_TRUE(l.ok() && r.ok());
    p.local_desc = *l;
    p.remote_desc = *decode_mem_desc(encode(*r));  // as a peer receives it
    auto s = a_->session(p.local_desc, p.remote_desc);
    EXPECT_TRUE(s.ok()) << s.status().to_string();
    if (s.ok()) p.session = *s;
    return p;
  }

  std::unique_ptr<TransferEngine> a_, b_;
};

TEST_F(TwoEngines, AutoPicksUcxForHostMemory) {
  Pair p = make_pair(4096, 1);
  EXPECT_EQ(p.session.backend(), "ucx");
}

TEST_F(TwoEngines, RandomWriteBatchesLandByteExact) {
  constexpr uint64_t kBlock = 4096, kBlocks = 512;
  Pair p = make_pair(kBlock * kBlocks, 2);
  std::mt19937_64 rng(11);
  for (int round = 0; round < 5; ++round) {
    std::fill(p.remote.begin(), p.remote.end(), 0);
    std::vector<Op> ops = random_block_ops(rng, kBlocks, kBlock, 200);
    auto id = p.session.write(ops);
    ASSERT_TRUE(id.ok()) << id.status().to_string();
    ASSERT_TRUE(a_->wait(*id, Deadline::after_ms(10'000)).ok());
    EXPECT_TRUE(a_->poll(*id).done());
    std::vector<uint8_t> expected(p.remote.size(), 0);
    for (const Op& op : ops) std::memcpy(&expected[op.remote_offset], &p.local[op.local_offset], op.bytes);
    ASSERT_EQ(p.remote, expected) << "round " << round;
    a_->release(*id);
  }
}

TEST_F(TwoEngines, RandomReadBatchesLandByteExact) {
  constexpr uint64_t kBlock = 1024, kBlocks = 256;
  Pair p = make_pair(kBlock * kBlocks, 3);
  fill_pattern(p.remote, 99);
  std::mt19937_64 rng(12);
  std::fill(p.local.begin(), p.local.end(), 0);
  std::vector<Op> ops = random_block_ops(rng, kBlocks, kBlock, 100);
  auto id = p.session.read(ops);
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(a_->wait(*id, Deadline::after_ms(10'000)).ok());
  std::vector<uint8_t> expected(p.local.size(), 0);
  for (const Op& op : ops) std::memcpy(&expected[op.local_offset], &p.remote[op.remote_offset], op.bytes);
  EXPECT_EQ(p.local, expected);
}

TEST_F(TwoEngines, SixteenConcurrentSessionsOnSixteenThreads) {
  constexpr int kSessions = 16;
  constexpr uint64_t kBlock = 2048, kBlocks = 64;
  std::vector<Pair> pairs;
  for (int i = 0; i < kSessions; ++i) pairs.push_back(make_pair(kBlock * kBlocks, 100 + i));
  std::vector<std::thread> threads;
  std::atomic<int> num_ok{0};
  for (int i = 0; i < kSessions; ++i) {
    threads.emplace_back([&, i] {
      std::mt19937_64 rng(1000 + i);
      bool all_ok = true;
      for (int round = 0; round < 4; ++round) {
        std::vector<Op> ops = random_block_ops(rng, kBlocks, kBlock, 32);
        auto id = round % 2 == 0 ? pairs[i].session.write(ops) : pairs[i].session.read(ops);
        all_ok = all_ok && id.ok() && a_->wait(*id, Deadline::after_ms(20'000)).ok();
        if (!all_ok) break;
        for (const Op& op : ops) {
          all_ok = all_ok &&
                   std::memcmp(&pairs[i].local[op.local_offset], &pairs[i].remote[op.remote_offset], op.bytes) == 0;
        }
        a_->release(*id);
      }
      if (all_ok) num_ok.fetch_add(1);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(num_ok.load(), kSessions);
}

TEST_F(TwoEngines, OutOfRangeBatchIsRejectedAndNothingIsPosted) {
  Pair p = make_pair(8192, 4);
  const uint64_t posted = a_->num_batches_posted();
  std::vector<Op> ops = {{0, 0, 4096}, {4096, 8000, 4096}};
  auto id = p.session.write(ops);
  ASSERT_FALSE(id.ok());
  EXPECT_EQ(id.status().code(), ErrorCode::kOutOfRange);
  EXPECT_EQ(a_->num_batches_posted(), posted);
  EXPECT_EQ(a_->num_batches_rejected(), 1u);
  EXPECT_TRUE(std::all_of(p.remote.begin(), p.remote.end(), [](uint8_t b) { return b == 0; }));
}

TEST_F(TwoEngines, EmptyBatchIsDoneAtOnce) {
  Pair p = make_pair(4096, 5);
  auto id = p.session.write({});
  ASSERT_TRUE(id.ok());
  EXPECT_TRUE(a_->poll(*id).done());
}

TEST_F(TwoEngines, SessionRejectsDescriptorsThatAreNotOurs) {
  Pair p = make_pair(4096, 6);
  // The remote descriptor passed as local.
  EXPECT_EQ(a_->session(p.remote_desc, p.remote_desc).status().code(), ErrorCode::kInvalidArgument);
  // A region id this engine never registered.
  MemDesc unknown = p.local_desc;
  unknown.region_id = 999;
  EXPECT_EQ(a_->session(unknown, p.remote_desc).status().code(), ErrorCode::kNotFound);
  // A peer never connected.
  MemDesc stranger = p.remote_desc;
  stranger.engine_name = "nobody";
  EXPECT_EQ(a_->session(p.local_desc, stranger).status().code(), ErrorCode::kNotFound);
  // A backend that is not enabled.
  EXPECT_FALSE(a_->session(p.local_desc, p.remote_desc, "cuda").ok());
}

TEST_F(TwoEngines, RestartedPeerReplacesOldBootAndOldDescriptorsAreRefused) {
  Pair p = make_pair(4096, 7);
  const MemDesc old_remote = p.remote_desc;
  b_ = make_engine(config("b"));  // the peer restarts: same name, new boot nonce
  ASSERT_TRUE(b_);
  ASSERT_TRUE(a_->connect(b_->describe()).ok());
  ASSERT_TRUE(a_->connect(b_->describe()).ok());  // idempotent
  auto stale = a_->session(p.local_desc, old_remote);
  ASSERT_FALSE(stale.ok());
  EXPECT_EQ(stale.status().code(), ErrorCode::kFailedPrecondition);
  std::vector<Op> ops = {{0, 0, 4096}};
  auto old_session_post = p.session.write(ops);
  ASSERT_FALSE(old_session_post.ok());
  EXPECT_NE(old_session_post.status().message().find("replaced"), std::string::npos);

  std::vector<uint8_t> remote(4096, 0);
  auto r = b_->register_memory(remote.data(), remote.size(), MemKind::kHost);
  ASSERT_TRUE(r.ok());
  auto fresh = a_->session(p.local_desc, *r);
  ASSERT_TRUE(fresh.ok()) << fresh.status().to_string();
  auto id = fresh->write(ops);
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(a_->wait(*id, Deadline::after_ms(10'000)).ok());
  EXPECT_EQ(remote, p.local);
}

TEST_F(TwoEngines, StalledBatchFailsAtItsDeadlineNotLater) {
  Pair p = make_pair(4096, 8);
  a_->fault_injector()->set_fault({FaultMode::kDelay, /*delay_ms=*/3'000, /*num_batches=*/1});
  std::vector<Op> ops = {{0, 0, 4096}};
  const int64_t start = now_ns();
  auto id = p.session.write(ops, Deadline::after_ms(200));
  ASSERT_TRUE(id.ok());
  Status s = a_->wait(*id, Deadline::after_ms(10'000));
  const double elapsed_ms = (now_ns() - start) / 1e6;
  EXPECT_EQ(s.code(), ErrorCode::kDeadlineExceeded) << s.to_string();
  EXPECT_GE(elapsed_ms, 190);
  EXPECT_LT(elapsed_ms, 2'000);
  EXPECT_TRUE(a_->poll(*id).failed());
}

TEST_F(TwoEngines, DroppedBatchFailsAtItsDeadline) {
  Pair p = make_pair(4096, 9);
  a_->fault_injector()->set_fault({FaultMode::kDrop, 0, 1});
  std::vector<Op> ops = {{0, 0, 4096}};
  auto id = p.session.write(ops, Deadline::after_ms(100));
  ASSERT_TRUE(id.ok());
  EXPECT_TRUE(a_->poll(*id).pending());
  EXPECT_EQ(a_->wait(*id, Deadline::after_ms(5'000)).code(), ErrorCode::kDeadlineExceeded);
  // The next batch is not affected.
  auto next = p.session.write(ops);
  ASSERT_TRUE(next.ok());
  EXPECT_TRUE(a_->wait(*next, Deadline::after_ms(10'000)).ok());
}

TEST_F(TwoEngines, InjectedFailureFailsTheBatchWithItsReason) {
  Pair p = make_pair(4096, 10);
  a_->fault_injector()->set_fault({FaultMode::kFail, 0, 1});
  std::vector<Op> ops = {{0, 0, 4096}};
  auto id = p.session.write(ops);
  ASSERT_TRUE(id.ok());
  TransferState state = a_->poll(*id);
  EXPECT_TRUE(state.failed());
  EXPECT_EQ(state.message, "injected failure");
  EXPECT_FALSE(a_->wait(*id, Deadline::after_ms(1'000)).ok());
}

TEST_F(TwoEngines, WaitDeadlineShorterThanTheBatchLeavesItPending) {
  Pair p = make_pair(4096, 11);
  a_->fault_injector()->set_fault({FaultMode::kDelay, 300, 1});
  std::vector<Op> ops = {{0, 0, 4096}};
  auto id = p.session.write(ops);
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(a_->wait(*id, Deadline::after_ms(20)).code(), ErrorCode::kDeadlineExceeded);
  EXPECT_TRUE(a_->poll(*id).pending());
  EXPECT_TRUE(a_->wait(*id, Deadline::after_ms(10'000)).ok());
  EXPECT_EQ(p.remote, p.local);
}

TEST_F(TwoEngines, DeregisterRefusesWhileABatchIsInFlight) {
  Pair p = make_pair(4096, 12);
  a_->fault_injector()->set_fault({FaultMode::kDelay, 300, 1});
  std::vector<Op> ops = {{0, 0, 4096}};
  auto id = p.session.write(ops);
  ASSERT_TRUE(id.ok());
  // The delay holds the report, but UCX may have finished; the fault keeps it counted until reported.
  Status early = a_->deregister(p.local_desc.region_id);
  EXPECT_EQ(early.code(), ErrorCode::kFailedPrecondition) << early.to_string();
  ASSERT_TRUE(a_->wait(*id, Deadline::after_ms(10'000)).ok());
  EXPECT_TRUE(a_->deregister(p.local_desc.region_id).ok());
  auto after = p.session.write(ops);
  EXPECT_EQ(after.status().code(), ErrorCode::kFailedPrecondition);
}

TEST_F(TwoEngines, UnknownAndReleasedIdsReportFailed) {
  Pair p = make_pair(4096, 13);
  EXPECT_TRUE(a_->poll(12345).failed());
  EXPECT_EQ(a_->wait(12345, Deadline::after_ms(10)).code(), ErrorCode::kNotFound);
  std::vector<Op> ops = {{0, 0, 4096}};
  auto id = p.session.write(ops);
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(a_->wait(*id, Deadline::after_ms(10'000)).ok());
  a_->release(*id);
  EXPECT_TRUE(a_->poll(*id).failed());
}

TEST_F(TwoEngines, EngineAllocatedHostMemoryIsWrittenAndReadByteExact) {
  constexpr size_t kBytes = 1 << 20;
  void* remote_ptr = nullptr;
  auto remote = b_->allocate_host_memory(kBytes, &remote_ptr);
  ASSERT_TRUE(remote.ok()) << remote.status().to_string();
  ASSERT_NE(remote_ptr, nullptr);
  std::memset(remote_ptr, 0, kBytes);
  std::vector<uint8_t> local(kBytes), back(kBytes, 0);
  fill_pattern(local, 77);
  auto l = a_->register_memory(local.data(), kBytes, MemKind::kHost);
  auto r = a_->register_memory(back.data(), kBytes, MemKind::kHost);
  ASSERT_TRUE(l.ok() && r.ok());
  auto out = a_->session(*l, *remote);
  auto in = a_->session(*r, *remote);
  ASSERT_TRUE(out.ok() && in.ok());
  std::mt19937_64 rng(5);
  std::vector<Op> ops = random_block_ops(rng, kBytes / 4096, 4096, 100);
  auto id = out->write(ops);
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(a_->wait(*id, Deadline::after_ms(10'000)).ok());
  const auto* remote_bytes = static_cast<const uint8_t*>(remote_ptr);
  for (const Op& op : ops)
    ASSERT_EQ(std::memcmp(remote_bytes + op.remote_offset, &local[op.local_offset], op.bytes), 0);
  std::vector<Op> whole = {{0, 0, kBytes}};
  auto rid = in->read(whole);
  ASSERT_TRUE(rid.ok());
  ASSERT_TRUE(a_->wait(*rid, Deadline::after_ms(10'000)).ok());
  EXPECT_EQ(std::memcmp(back.data(), remote_ptr, kBytes), 0);
  EXPECT_TRUE(b_->deregister(remote->region_id).ok());
}

TEST(EngineCreate, RejectsBadConfig) {
  EngineConfig unnamed;
  EXPECT_EQ(TransferEngine::create(unnamed).status().code(), ErrorCode::kInvalidArgument);
  EngineConfig unknown = config("x");
  unknown.backends = {"carrier-pigeon"};
  EXPECT_EQ(TransferEngine::create(unknown).status().code(), ErrorCode::kInvalidArgument);
}

TEST(EngineCreate, DefaultBackendListWorksWithoutAGpu) {
  EngineConfig c;
  c.name = "default";
  auto engine = TransferEngine::create(c);
  ASSERT_TRUE(engine.ok()) << engine.status().to_string();
  auto names = (*engine)->backend_names();
  EXPECT_NE(std::find(names.begin(), names.end(), "ucx"), names.end());
}

TEST(EngineConnect, RejectsGarbageAndSelf) {
  auto a = make_engine(config("self"));
  ASSERT_TRUE(a);
  EXPECT_FALSE(a->connect(a->describe()).ok());
  EXPECT_FALSE(a->connect(EngineDesc{}).ok());
}

}  // namespace
}  // namespace pd::xfer
