// A peer's UCX worker address and remote keys are checked before UCX parses them:
// the walker itself (ucx_wire_check.h) on real blobs from this machine's UCX, and
// the engine refusing garbage in connect / session instead of aborting in UCX.
#include "xfer/backends/ucx_wire_check.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "common/metrics.h"
#include "xfer/engine.h"

namespace pd::xfer {
namespace {

EngineConfig config(const std::string& name) {
  EngineConfig c;
  c.name = name;
  c.backends = {"ucx"};
  c.batch_timeout_ms = 5'000;
  return c;
}

std::unique_ptr<TransferEngine> make_engine(const std::string& name) {
  auto engine = TransferEngine::create(config(name));
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

double refused(const char* kind) {
  return metrics::Registry::global()
      .counter("pd_xfer_peer_blobs_refused_total", "Peer UCX addresses and keys refused before UCX parsed them",
               {{"kind", kind}})
      .value();
}

class UcxBlobs : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = make_engine("wire-a");
    ASSERT_TRUE(engine_);
    address_ = engine_->describe().endpoints.at("ucx");
    memory_.assign(4096, 1);
    auto desc = engine_->register_memory(memory_.data(), memory_.size(), MemKind::kHost);
    ASSERT_TRUE(desc.ok()) << desc.status().to_string();
    local_ = *desc;
    rkey_ = desc->keys.at("ucx");
  }
  std::unique_ptr<TransferEngine> engine_;
  std::vector<uint8_t> address_;
  std::vector<uint8_t> memory_;
  std::vector<uint8_t> rkey_;
  MemDesc local_;
};

TEST_F(UcxBlobs, ThisWorkersOwnAddressAndKeyPass) {
  auto layout = parse_ucx_worker_address(address_);
  ASSERT_TRUE(layout.ok()) << layout.status().to_string();
  EXPECT_FALSE(layout->entries.empty());
  const UcxAddressProfile profile = ucx_address_profile(*layout);
  EXPECT_TRUE(check_ucx_worker_address(address_, profile).ok());
  EXPECT_TRUE(check_ucx_rkey(rkey_).ok());
  // Another worker on this machine packs the same format.
  auto other = make_engine("wire-b");
  ASSERT_TRUE(other);
  EXPECT_TRUE(check_ucx_worker_address(other->describe().endpoints.at("ucx"), profile).ok());
}

TEST_F(UcxBlobs, EveryTruncationAndAnyTrailingByteIsRefused) {
  const UcxAddressProfile profile = ucx_address_profile(*parse_ucx_worker_address(address_));
  for (size_t n = 0; n < address_.size(); ++n) {
    std::vector<uint8_t> cut(address_.begin(), address_.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_FALSE(check_ucx_worker_address(cut, profile).ok()) << n << " of " << address_.size() << " bytes";
  }
  std::vector<uint8_t> longer = address_;
  longer.push_back(0);
  EXPECT_FALSE(check_ucx_worker_address(longer, profile).ok());
  for (size_t n = 0; n < rkey_.size(); ++n) {
    std::vector<uint8_t> cut(rkey_.begin(), rkey_.begin() + static_cast<std::ptrdiff_t>(n));
    EXPECT_FALSE(check_ucx_rkey(cut).ok()) << n << " of " << rkey_.size() << " bytes";
  }
  std::vector<uint8_t> key = rkey_;
  key.push_back(0);
  EXPECT_FALSE(check_ucx_rkey(key).ok());
}

TEST_F(UcxBlobs, UnknownVersionsFlagsAndOutOfRangeFieldsAreRefused) {
  const UcxAddressProfile profile = ucx_address_profile(*parse_ucx_worker_address(address_));
  for (uint8_t version = 2; version < 16; ++version) {
    std::vector<uint8_t> bad = address_;
    bad[0] = static_cast<uint8_t>((bad[0] & 0xf0) | version);
    EXPECT_FALSE(check_ucx_worker_address(bad, profile).ok()) << "version " << int{version};
    EXPECT_FALSE(check_ucx_worker_address_header(bad, profile.version).ok()) << "version " << int{version};
  }
  std::vector<uint8_t> key = rkey_;
  key[8] = 200;  // memory type
  EXPECT_FALSE(check_ucx_rkey(key).ok());
}

TEST_F(UcxBlobs, SixteenGarbageBytesAreRefused) {
  const UcxAddressProfile profile = ucx_address_profile(*parse_ucx_worker_address(address_));
  std::mt19937_64 rng(7);
  for (int i = 0; i < 2000; ++i) {
    std::vector<uint8_t> garbage(16);
    for (auto& b : garbage) b = static_cast<uint8_t>(rng());
    EXPECT_FALSE(check_ucx_worker_address(garbage, profile).ok());
  }
  const std::vector<uint8_t> ff(16, 0xff);
  EXPECT_FALSE(check_ucx_worker_address(ff, profile).ok());
  EXPECT_FALSE(check_ucx_worker_address_header(ff, profile.version).ok());
}

// The defect: connect handed a peer's blob to ucp_ep_create after checking only its
// length, and UCX aborted the process on the address version.
TEST_F(UcxBlobs, ConnectRefusesAGarbageEndpointAndCountsIt) {
  EngineDesc peer;
  peer.name = "forged";
  peer.boot_nonce = 99;
  peer.host_id = "elsewhere";
  peer.endpoints["ucx"] = std::vector<uint8_t>(16, 0xff);
  const double before = refused("ucx_address");
  Status status = engine_->connect(peer);
  EXPECT_FALSE(status.ok());
  EXPECT_EQ(refused("ucx_address"), before + 1);
  // Every 16-byte prefix pattern whose first byte names an unknown version, too.
  for (int version = 2; version < 16; ++version) {
    peer.endpoints["ucx"] = std::vector<uint8_t>(16, static_cast<uint8_t>(version));
    EXPECT_FALSE(engine_->connect(peer).ok());
  }
}

TEST_F(UcxBlobs, SessionRefusesAGarbageRemoteKeyAndCountsIt) {
  auto peer = make_engine("wire-peer");
  ASSERT_TRUE(peer);
  ASSERT_TRUE(engine_->connect(peer->describe()).ok());
  std::vector<uint8_t> remote(4096, 0);
  auto remote_desc = peer->register_memory(remote.data(), remote.size(), MemKind::kHost);
  ASSERT_TRUE(remote_desc.ok());
  MemDesc forged = *remote_desc;
  forged.keys["ucx"] = std::vector<uint8_t>(16, 0xff);  // every md bit set, nothing behind them
  const double before = refused("ucx_rkey");
  EXPECT_FALSE(engine_->session(local_, forged, "ucx").ok());
  EXPECT_EQ(refused("ucx_rkey"), before + 1);
  // The real key still works on the same connection.
  auto good = engine_->session(local_, *remote_desc, "ucx");
  ASSERT_TRUE(good.ok());
  const std::vector<Op> ops{Op{0, 0, 64}};
  auto id = good->write(ops);
  ASSERT_TRUE(id.ok()) << id.status().to_string();
  EXPECT_TRUE(engine_->wait(*id, Deadline::after_ms(5'000)).ok());
  engine_->release(*id);
}

// Found by fuzz_ucx_descriptor: a forged key with a shared-memory (posix) section of zero
// segment length made uct_posix_rkey_unpack assert. A key with one zero 32-byte section for
// md i, for each of the first 8 md indices, must be refused or work, never abort; the one at
// this machine's posix md is refused.
TEST_F(UcxBlobs, AKeyWithAZeroSharedMemoryLengthIsRefusedNotAnAbort) {
  auto peer = make_engine("wire-shm");
  ASSERT_TRUE(peer);
  ASSERT_TRUE(engine_->connect(peer->describe()).ok());
  std::vector<uint8_t> remote(4096, 0);
  auto remote_desc = peer->register_memory(remote.data(), remote.size(), MemKind::kHost);
  ASSERT_TRUE(remote_desc.ok());
  int num_refused = 0;
  for (int md = 0; md < 8; ++md) {
    std::vector<uint8_t> key(8 + 1 + 1 + 32, 0);
    const uint64_t md_map = uint64_t{1} << md;
    std::memcpy(key.data(), &md_map, sizeof(md_map));
    key[9] = 32;  // section length; the section is all zeros
    MemDesc forged = *remote_desc;
    forged.keys["ucx"] = key;
    num_refused += engine_->session(local_, forged, "ucx").ok() ? 0 : 1;
  }
  EXPECT_GE(num_refused, 1) << "this machine's UCX has a posix md; its zero-length key must be refused";
}

}  // namespace
}  // namespace pd::xfer
