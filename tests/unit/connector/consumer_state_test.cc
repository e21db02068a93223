#include <gtest/gtest.h>

#include "connector/transfer_machines.h"

namespace pd::connector {
namespace {

const std::string kT = "0123456789abcdef0123456789abcdef";
const std::string kControl = "127.0.0.1:7000";
constexpr int32_t kLayers = 2;
constexpr int32_t kBlockSize = 4;

PeerRef producer(uint64_t nonce = 5) {
  return PeerRef{PeerKey::dialled(kControl), "prefill-0", nonce};
}

ConsumerTransfers::Params params(bool read_mode = false, uint64_t nonce = 5) {
  ConsumerTransfers::Params p;
  p.transfer_id = kT;
  p.read_mode = read_mode;
  p.remote_instance_id = "prefill-0";
  p.remote_control = kControl;
  p.remote_boot_nonce = nonce;
  if (read_mode) p.remote_block_ids = {20, 21, 22};
  return p;
}

ControlMessage msg(MessageType type, bool ok = true, int32_t num_tokens = 10) {
  ControlMessage m;
  m.type = type;
  m.transfer_id = kT;
  m.ok = ok;
  m.num_tokens = num_tokens;
  return m;
}

class ConsumerStateTest : public ::testing::Test {
 protected:
  ConsumerTransfers c_{kLayers, kBlockSize, ConsumerTimeouts{/*handshake=*/100, /*transfer=*/300}};

  // Admits a 10-token request with no local prefix: 9 external tokens in 3 blocks.
  void admit_and_allocate(bool read_mode = false) {
    ASSERT_EQ(c_.admit("req", params(read_mode), 0, 10, 0), 9);
    c_.allocated("req", {4, 5, 6}, 0, 9, 0);
  }
};

TEST_F(ConsumerStateTest, ExternalTokensLeaveTheLastPromptTokenToComputeLocally) {
  EXPECT_EQ(c_.admit("req", params(), 0, 10, 0), 9);
  ConsumerTransfers other(kLayers, kBlockSize, {});
  auto p = params();
  EXPECT_EQ(other.admit("req", p, 8, 10, 0), 1) << "a local prefix of 8 leaves one token to load";
}

TEST_F(ConsumerStateTest, WriteHandshakesThenSendsBlocksAndFinishesOnDone) {
  admit_and_allocate();
  auto a = c_.take_actions();
  EXPECT_EQ(a.handshakes, std::vector<std::string>{kControl});
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);
  a = c_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kBlocks);
  EXPECT_EQ(a.sends[0].message.block_ids, (std::vector<int32_t>{4, 5, 6}));
  EXPECT_EQ(a.sends[0].message.num_tokens, 10);
  c_.on_done(producer(), msg(MessageType::kDone));
  a = c_.take_actions();
  EXPECT_EQ(a.finished_recving, std::vector<std::string>{"req"});
  EXPECT_TRUE(a.load_failures.empty());
  EXPECT_EQ(c_.num_active(), 0u);
}

TEST_F(ConsumerStateTest, ALocalPrefixIsSkippedAndOnlyMissingBlocksAreRequested) {
  ASSERT_EQ(c_.admit("req", params(), 4, 10, 0), 5);
  c_.allocated("req", {4, 5, 6}, 4, 5, 0);
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);
  auto a = c_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.block_ids, (std::vector<int32_t>{5, 6}));
  EXPECT_EQ(a.sends[0].message.num_skip_blocks, 1);
}

TEST_F(ConsumerStateTest, AFullyCachedPromptOnlyTellsTheProducerToLetGo) {
  EXPECT_EQ(c_.admit("req", params(), 8, 9, 0), 0);
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);
  auto a = c_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kBlocks);
  EXPECT_TRUE(a.sends[0].message.block_ids.empty());
  EXPECT_EQ(a.sends[0].message.num_skip_blocks, 2);
  EXPECT_TRUE(a.finished_recving.empty());
  EXPECT_EQ(c_.num_active(), 0u);
}

TEST_F(ConsumerStateTest, DoneNotOkBecomesALoadErrorForEveryExternalBlock) {
  admit_and_allocate();
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);
  c_.take_actions();
  c_.on_done(producer(), msg(MessageType::kDone, /*ok=*/false));
  auto a = c_.take_actions();
  EXPECT_EQ(a.finished_recving, std::vector<std::string>{"req"});
  ASSERT_EQ(a.load_failures.size(), 1u);
  EXPECT_EQ(a.load_failures[0].block_ids, (std::vector<int32_t>{4, 5, 6}));
}

TEST_F(ConsumerStateTest, ATransferIsReportedClosedOnceWhenItsLoadEndsEitherWay) {
  admit_and_allocate();
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);
  auto a = c_.take_actions();
  EXPECT_TRUE(a.closed_transfer_ids.empty()) << "waiting for done";
  c_.on_done(producer(), msg(MessageType::kDone));
  a = c_.take_actions();
  EXPECT_EQ(a.closed_transfer_ids, std::vector<std::string>{kT});
  c_.on_done(producer(), msg(MessageType::kDone));
  EXPECT_TRUE(c_.take_actions().closed_transfer_ids.empty()) << "a second done closes nothing";

  ConsumerTransfers failing(kLayers, kBlockSize, ConsumerTimeouts{100, 300});
  ASSERT_EQ(failing.admit("req", params(), 0, 10, 0), 9);
  failing.allocated("req", {4, 5, 6}, 0, 9, 0);
  failing.on_peer_ready(kControl, "prefill-0", 5, 64);
  failing.take_actions();
  failing.on_done(producer(), msg(MessageType::kDone, /*ok=*/false));
  a = failing.take_actions();
  ASSERT_EQ(a.load_failures.size(), 1u);
  EXPECT_EQ(a.closed_transfer_ids, std::vector<std::string>{kT});
}

TEST_F(ConsumerStateTest, DoneFromAnyoneButTheNamedProducerIsRefused) {
  admit_and_allocate();
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);
  c_.take_actions();
  c_.on_done(producer(/*nonce=*/6), msg(MessageType::kDone));
  c_.on_done(PeerRef{PeerKey::dialled("127.0.0.1:7001"), "prefill-0", 5}, msg(MessageType::kDone));
  auto a = c_.take_actions();
  EXPECT_EQ(a.num_refused, 2);
  EXPECT_TRUE(a.finished_recving.empty());
}

TEST_F(ConsumerStateTest, AbortedWriteWaitHoldsBlocksUntilTheProducerStops) {
  admit_and_allocate();
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);
  c_.take_actions();
  EXPECT_TRUE(c_.request_finished("req", 10)) << "a write may still land in the blocks";
  auto a = c_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kAbort);
  c_.on_done(producer(), msg(MessageType::kDone, false));
  a = c_.take_actions();
  EXPECT_EQ(a.finished_recving, std::vector<std::string>{"req"}) << "hold released";
  EXPECT_TRUE(a.load_failures.empty()) << "the request is gone; nothing to recompute";
}

TEST_F(ConsumerStateTest, AbortedWriteWaitHoldIsBoundedByTransferTimeout) {
  admit_and_allocate();
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);
  EXPECT_TRUE(c_.request_finished("req", 0));
  c_.take_actions();
  c_.tick(299);
  EXPECT_TRUE(c_.take_actions().finished_recving.empty());
  c_.tick(300);
  auto a = c_.take_actions();
  EXPECT_EQ(a.finished_recving, std::vector<std::string>{"req"});
  EXPECT_EQ(a.num_timeouts, 1);
  EXPECT_EQ(c_.num_active(), 0u);
}

TEST_F(ConsumerStateTest, FinishingBeforeTheHandshakeHoldsNothing) {
  admit_and_allocate();
  EXPECT_FALSE(c_.request_finished("req", 0));
  EXPECT_EQ(c_.num_active(), 0u);
}

TEST_F(ConsumerStateTest, HandshakeTimeoutFailsWaitingTransfersAsLoadErrors) {
  admit_and_allocate();
  c_.take_actions();
  c_.tick(99);
  EXPECT_TRUE(c_.take_actions().load_failures.empty());
  c_.tick(100);
  auto a = c_.take_actions();
  ASSERT_EQ(a.load_failures.size(), 1u);
  EXPECT_NE(a.load_failures[0].reason.find("handshake timed out"), std::string::npos);
  EXPECT_EQ(a.dropped_dealers, std::vector<std::string>{kControl});
  EXPECT_EQ(a.finished_recving, std::vector<std::string>{"req"});
}

TEST_F(ConsumerStateTest, ARestartedProducerIsReHandshaken) {
  admit_and_allocate();
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);
  c_.on_done(producer(), msg(MessageType::kDone));
  c_.take_actions();
  // The next request names the producer's new incarnation (nonce 6).
  auto p = params(false, 6);
  ASSERT_EQ(c_.admit("req2", p, 0, 10, 1000), 9);
  c_.allocated("req2", {7, 8, 9}, 0, 9, 1000);
  auto a = c_.take_actions();
  EXPECT_TRUE(a.dropped_dealers.empty()) << "asked again on the same connection";
  EXPECT_EQ(a.handshakes, std::vector<std::string>{kControl});
  EXPECT_TRUE(a.sends.empty());
  c_.on_peer_ready(kControl, "prefill-0", 6, 64);
  a = c_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kBlocks);
}

// A request naming an incarnation the address does not have (stale or forged) must not
// disturb the transfers in flight with the live one.
TEST_F(ConsumerStateTest, AStaleNonceFailsOnlyItsOwnRequest) {
  admit_and_allocate();
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);
  c_.take_actions();  // blocks sent: "req" waits for done
  auto stale = params(false, 6);
  stale.transfer_id = "11111111111111111111111111111111";
  ASSERT_EQ(c_.admit("req2", stale, 0, 10, 100), 9);
  c_.allocated("req2", {7, 8, 9}, 0, 9, 100);
  auto a = c_.take_actions();
  EXPECT_TRUE(a.dropped_dealers.empty());
  EXPECT_EQ(a.handshakes, std::vector<std::string>{kControl});
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);  // the same incarnation answers
  a = c_.take_actions();
  ASSERT_EQ(a.load_failures.size(), 1u);
  EXPECT_EQ(a.load_failures[0].request_id, "req2");
  c_.on_done(producer(5), msg(MessageType::kDone));
  a = c_.take_actions();
  EXPECT_EQ(a.finished_recving, std::vector<std::string>{"req"});
  EXPECT_TRUE(a.load_failures.empty());
  EXPECT_EQ(c_.num_active(), 0u);
}

// When a new incarnation answers at the address, the old one is gone: what waited on it
// recomputes now rather than at its timeout.
TEST_F(ConsumerStateTest, ARestartFailsTheTransfersInFlightWithTheOldIncarnation) {
  admit_and_allocate();
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);
  c_.take_actions();  // "req" waits for done from nonce 5
  auto fresh = params(false, 6);
  fresh.transfer_id = "22222222222222222222222222222222";
  ASSERT_EQ(c_.admit("req2", fresh, 0, 10, 100), 9);
  c_.allocated("req2", {7, 8, 9}, 0, 9, 100);
  c_.take_actions();
  c_.on_peer_ready(kControl, "prefill-0", 6, 64);
  auto a = c_.take_actions();
  ASSERT_EQ(a.load_failures.size(), 1u);
  EXPECT_EQ(a.load_failures[0].request_id, "req");
  EXPECT_NE(a.load_failures[0].reason.find("restarted"), std::string::npos);
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kBlocks);
  EXPECT_EQ(a.sends[0].message.transfer_id, fresh.transfer_id);
}

TEST_F(ConsumerStateTest, AProducerThatIsNotTheNamedIncarnationFailsTheTransfer) {
  admit_and_allocate();
  c_.on_peer_ready(kControl, "prefill-0", /*nonce=*/9, 64);
  auto a = c_.take_actions();
  ASSERT_EQ(a.load_failures.size(), 1u);
  EXPECT_NE(a.load_failures[0].reason.find("nonce"), std::string::npos);
}

TEST_F(ConsumerStateTest, HandshakeRefusalEndsWaitingTransfers) {
  admit_and_allocate();
  ControlMessage refusal;
  refusal.type = MessageType::kError;
  refusal.text = "KV layout mismatch, refusing the peer: head_dim 64 here vs 128 at the peer";
  c_.on_abort_or_error(producer(), refusal);
  auto a = c_.take_actions();
  ASSERT_EQ(a.load_failures.size(), 1u);
  EXPECT_NE(a.load_failures[0].reason.find("layout mismatch"), std::string::npos);
}

TEST_F(ConsumerStateTest, ReadRequestsTheProducersIdsThenReadsEveryLayerThenReleases) {
  admit_and_allocate(/*read_mode=*/true);
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);
  auto a = c_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kRead);
  EXPECT_EQ(a.sends[0].message.block_ids, (std::vector<int32_t>{20, 21, 22}));
  c_.on_read_ok(producer(), msg(MessageType::kReadOk));
  a = c_.take_actions();
  ASSERT_EQ(a.reads.size(), static_cast<size_t>(kLayers));
  c_.on_read_done(kT, 0, true);
  EXPECT_TRUE(c_.take_actions().finished_recving.empty());
  c_.on_read_done(kT, 1, true);
  a = c_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kRelease);
  EXPECT_EQ(a.finished_recving, std::vector<std::string>{"req"});
  EXPECT_TRUE(a.load_failures.empty());
}

TEST_F(ConsumerStateTest, AFailedReadIsReportedAsALoadErrorAndStillReleasesTheProducer) {
  admit_and_allocate(true);
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);
  c_.on_read_ok(producer(), msg(MessageType::kReadOk));
  c_.take_actions();
  c_.on_read_done(kT, 0, false);
  c_.on_read_done(kT, 1, true);
  auto a = c_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kRelease);
  ASSERT_EQ(a.load_failures.size(), 1u);
  EXPECT_EQ(a.load_failures[0].block_ids, (std::vector<int32_t>{4, 5, 6}));
}

TEST_F(ConsumerStateTest, ReadIdsBeyondTheProducersPoolFailBeforeAnyRead) {
  admit_and_allocate(true);
  c_.on_peer_ready(kControl, "prefill-0", 5, /*peer_num_blocks=*/21);
  auto a = c_.take_actions();
  EXPECT_TRUE(a.sends.empty());
  ASSERT_EQ(a.load_failures.size(), 1u);
}

TEST_F(ConsumerStateTest, TimeoutIsSilentButTheLateDoneStillEndsTheTransfer) {
  admit_and_allocate();
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);
  c_.take_actions();
  c_.on_remote_kv_timeout("req");
  auto a = c_.take_actions();
  EXPECT_EQ(a.num_timeouts, 1);
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kAbort);
  c_.on_done(producer(), msg(MessageType::kDone, false));
  a = c_.take_actions();
  EXPECT_TRUE(a.finished_recving.empty());
  EXPECT_TRUE(a.load_failures.empty());
  EXPECT_EQ(c_.num_active(), 0u);
}

TEST_F(ConsumerStateTest, PreemptionWhileDataMayMoveHoldsTheOldBlocks) {
  admit_and_allocate();
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);
  c_.on_remote_kv_timeout("req");
  c_.take_actions();
  EXPECT_TRUE(c_.request_preempted("req", 0));
  EXPECT_FALSE(c_.request_finished("req", 0)) << "the preemption hold is separate from the request";
  c_.tick(300);
  EXPECT_EQ(c_.take_actions().finished_recving, std::vector<std::string>{"req"});
}

}  // namespace
}  // namespace pd::connector

namespace pd::connector {
namespace {

TEST(ConsumerAdmission, AskingAgainBeforeAllocationGivesTheSameAnswer) {
  ConsumerTransfers c(2, 4, {});
  EXPECT_EQ(c.admit("req", params(), 0, 10, 0), 9);
  EXPECT_EQ(c.admit("req", params(), 4, 10, 5), 5) << "a larger local prefix since the first ask";
  c.allocated("req", {4, 5, 6}, 4, 5, 5);
  c.on_peer_ready(kControl, "prefill-0", 5, 64);
  auto a = c.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.num_skip_blocks, 1);
  EXPECT_EQ(c.admit("req", params(), 4, 10, 5), -1) << "after allocation the transfer is committed";
}

TEST(ConsumerAdmission, AnotherRequestCannotClaimAnActiveTransfer) {
  ConsumerTransfers c(2, 4, {});
  EXPECT_EQ(c.admit("req", params(), 0, 10, 0), 9);
  EXPECT_EQ(c.admit("other", params(), 0, 10, 0), -1);
}

}  // namespace
}  // namespace pd::connector

namespace pd::connector {
namespace {

TEST(ConsumerAdmission, APreemptedRequestWhoseKvNeverMovedReleasesTheProducerAtOnce) {
  ConsumerTransfers c(2, 4, {});
  // Another transfer made the peer ready.
  auto other = params();
  other.transfer_id = "ffffffffffffffffffffffffffffffff";
  ASSERT_EQ(c.admit("r0", other, 0, 10, 0), 9);
  c.allocated("r0", {1, 2, 3}, 0, 9, 0);
  c.on_peer_ready(kControl, "prefill-0", 5, 64);
  c.take_actions();
  ASSERT_EQ(c.admit("req", params(), 0, 10, 0), 9);  // admitted, never allocated (no room)
  EXPECT_FALSE(c.request_preempted("req", 0));
  auto a = c.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kAbort);
  EXPECT_EQ(a.sends[0].message.transfer_id, kT);
}

// First-token hand-over: 10 tokens, all 10 come from the producer (3 blocks).
ConsumerTransfers::Params handover_params(bool read_mode, uint64_t key) {
  auto p = params(read_mode);
  p.want_first_token = true;
  p.sampling_key = key;
  return p;
}

ControlMessage with_token(ControlMessage m, int32_t token, uint64_t key) {
  m.first_token = token;
  m.sampling_key = key;
  return m;
}

TEST_F(ConsumerStateTest, HandOverTakesTheWholePromptAndReportsTheProducersToken) {
  ASSERT_EQ(c_.admit("req", handover_params(false, 7), 0, 10, 0), 10);
  c_.allocated("req", {4, 5, 6}, 0, 10, 0);
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);
  auto a = c_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.kv_tokens, 10) << "asks for every prompt token";
  EXPECT_EQ(a.sends[0].message.block_ids, (std::vector<int32_t>{4, 5, 6}));
  c_.on_done(producer(), with_token(msg(MessageType::kDone), 99, 7));
  a = c_.take_actions();
  EXPECT_EQ(a.finished_recving, std::vector<std::string>{"req"});
  ASSERT_EQ(a.first_tokens.size(), 1u);
  EXPECT_EQ(a.first_tokens[0], (std::pair<std::string, int32_t>{"req", 99}));
}

TEST_F(ConsumerStateTest, HandOverRefusesATokenSampledUnderOtherParameters) {
  ASSERT_EQ(c_.admit("req", handover_params(false, 7), 0, 10, 0), 10);
  c_.allocated("req", {4, 5, 6}, 0, 10, 0);
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);
  c_.take_actions();
  c_.on_done(producer(), with_token(msg(MessageType::kDone), 99, 8));
  auto a = c_.take_actions();
  EXPECT_EQ(a.finished_recving, std::vector<std::string>{"req"}) << "the KV is still good";
  EXPECT_TRUE(a.first_tokens.empty());
  EXPECT_EQ(a.num_first_tokens_refused, 1);
}

TEST_F(ConsumerStateTest, HandOverTokenIsDroppedWhenTheTransferFails) {
  ASSERT_EQ(c_.admit("req", handover_params(false, 7), 0, 10, 0), 10);
  c_.allocated("req", {4, 5, 6}, 0, 10, 0);
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);
  c_.take_actions();
  c_.on_done(producer(), with_token(msg(MessageType::kDone, /*ok=*/false), 99, 7));
  auto a = c_.take_actions();
  EXPECT_TRUE(a.first_tokens.empty());
  ASSERT_EQ(a.load_failures.size(), 1u);
}

TEST_F(ConsumerStateTest, ATokenNobodyAskedForIsIgnored) {
  admit_and_allocate();
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);
  auto a = c_.take_actions();
  EXPECT_EQ(a.sends[0].message.kv_tokens, 9);
  c_.on_done(producer(), with_token(msg(MessageType::kDone), 99, 0));
  a = c_.take_actions();
  EXPECT_EQ(a.finished_recving, std::vector<std::string>{"req"});
  EXPECT_TRUE(a.first_tokens.empty());
}

TEST_F(ConsumerStateTest, ReadHandOverReportsTheTokenOnlyAfterEveryReadSucceeded) {
  ASSERT_EQ(c_.admit("req", handover_params(true, 7), 0, 10, 0), 10);
  c_.allocated("req", {4, 5, 6}, 0, 10, 0);
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);
  auto a = c_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.kv_tokens, 10);
  c_.on_read_ok(producer(), with_token(msg(MessageType::kReadOk), 5, 7));
  EXPECT_TRUE(c_.take_actions().first_tokens.empty());
  c_.on_read_done(kT, 0, true);
  c_.on_read_done(kT, 1, true);
  a = c_.take_actions();
  ASSERT_EQ(a.first_tokens.size(), 1u);
  EXPECT_EQ(a.first_tokens[0].second, 5);
}

TEST_F(ConsumerStateTest, ReadHandOverTokenIsDroppedWhenAReadFails) {
  ASSERT_EQ(c_.admit("req", handover_params(true, 7), 0, 10, 0), 10);
  c_.allocated("req", {4, 5, 6}, 0, 10, 0);
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);
  c_.take_actions();
  c_.on_read_ok(producer(), with_token(msg(MessageType::kReadOk), 5, 7));
  c_.on_read_done(kT, 0, false);
  c_.on_read_done(kT, 1, true);
  auto a = c_.take_actions();
  EXPECT_TRUE(a.first_tokens.empty());
  EXPECT_EQ(a.load_failures.size(), 1u);
}

TEST_F(ConsumerStateTest, HandOverIsNotAskedForWhenOnlyTheLastTokenIsMissing) {
  // 9 tokens, 8 cached here: computing the last one is cheaper than a transfer.
  EXPECT_EQ(c_.admit("req", handover_params(false, 7), 8, 9, 0), 0);
}

TEST_F(ConsumerStateTest, AReadRefusedForInvalidParametersFailsTheRequestAsInvalid) {
  admit_and_allocate(/*read_mode=*/true);
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);
  c_.take_actions();
  auto refusal = msg(MessageType::kError);
  refusal.text = "block 21 does not belong to transfer";
  refusal.invalid_params = true;
  c_.on_abort_or_error(producer(), refusal);
  auto a = c_.take_actions();
  ASSERT_EQ(a.load_failures.size(), 1u);
  EXPECT_TRUE(a.load_failures[0].invalid_params);
  EXPECT_NE(a.load_failures[0].reason.find("refused kv_transfer_params"), std::string::npos);
  EXPECT_TRUE(a.reads.empty());
}

TEST_F(ConsumerStateTest, AnInvalidParametersFlagOutsideAReadRequestIsNotTrusted) {
  // WRITE: our blocks are ours, not the client's; a producer's error is a plain failure.
  admit_and_allocate(/*read_mode=*/false);
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);
  c_.take_actions();
  auto refusal = msg(MessageType::kError);
  refusal.invalid_params = true;
  c_.on_abort_or_error(producer(), refusal);
  auto a = c_.take_actions();
  ASSERT_EQ(a.load_failures.size(), 1u);
  EXPECT_FALSE(a.load_failures[0].invalid_params);
}

// ---- a new identity on the connection to a producer: it restarted --------------------

TEST_F(ConsumerStateTest, AnyMessageFromANewIncarnationFailsTheTransfersWaitingOnTheOldOne) {
  admit_and_allocate(/*read_mode=*/true);
  c_.on_peer_ready(kControl, "prefill-0", 5, 64);
  auto a = c_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kRead);  // now awaiting read_ok
  // The same incarnation speaking changes nothing.
  c_.on_producer_identity(kControl, "prefill-0", 5);
  EXPECT_TRUE(c_.take_actions().load_failures.empty());
  // Another process at that address (it answered, say, `error` to a later message).
  c_.on_producer_identity(kControl, "prefill-0", 6);
  a = c_.take_actions();
  ASSERT_EQ(a.load_failures.size(), 1u);
  EXPECT_EQ(a.load_failures[0].request_id, "req");
  EXPECT_NE(a.load_failures[0].reason.find("restarted"), std::string::npos) << a.load_failures[0].reason;
  EXPECT_FALSE(c_.peer_ready(kControl)) << "the next request handshakes again";
  EXPECT_EQ(c_.num_active(), 0u);
}

TEST_F(ConsumerStateTest, ANewIdentityOnAConnectionStillHandshakingIsLeftToTheHandshake) {
  admit_and_allocate();
  c_.take_actions();
  c_.on_producer_identity(kControl, "prefill-0", 6);
  EXPECT_TRUE(c_.take_actions().load_failures.empty());
  EXPECT_EQ(c_.num_active(), 1u);
}

// ---- tensor parallelism: every consumer rank pulls its heads (plan pieces) ---------------

TEST_F(ConsumerStateTest, ReadPostsEveryPieceOfEveryLayerAndFinishesAfterAll) {
  admit_and_allocate(true);
  c_.on_peer_ready(kControl, "prefill-0", 5, 64, /*pieces_per_layer=*/3);
  c_.take_actions();
  c_.on_read_ok(producer(), msg(MessageType::kReadOk));
  auto a = c_.take_actions();
  ASSERT_EQ(a.reads.size(), static_cast<size_t>(3 * kLayers));
  for (size_t i = 0; i < a.reads.size(); ++i) {
    EXPECT_EQ(a.reads[i].layer, static_cast<int32_t>(i / 3));
    EXPECT_EQ(a.reads[i].piece, static_cast<int32_t>(i % 3));
  }
  for (size_t i = 0; i + 1 < a.reads.size(); ++i) {
    c_.on_read_done(kT, a.reads[i].layer, true, a.reads[i].piece);
    EXPECT_TRUE(c_.take_actions().finished_recving.empty()) << "finished before every rank's read";
  }
  c_.on_read_done(kT, a.reads.back().layer, true, a.reads.back().piece);
  a = c_.take_actions();
  EXPECT_EQ(a.finished_recving, std::vector<std::string>{"req"});
  EXPECT_TRUE(a.load_failures.empty());
  EXPECT_EQ(a.num_completed, 1);
}

TEST_F(ConsumerStateTest, OneRanksFailedReadFailsTheWholeLoadOnceEveryRanksReadEnded) {
  admit_and_allocate(true);
  c_.on_peer_ready(kControl, "prefill-0", 5, 64, /*pieces_per_layer=*/2);
  c_.on_read_ok(producer(), msg(MessageType::kReadOk));
  auto reads = c_.take_actions().reads;
  ASSERT_EQ(reads.size(), static_cast<size_t>(2 * kLayers));
  c_.on_read_done(kT, 0, false, 1);
  auto a = c_.take_actions();
  EXPECT_TRUE(a.sends.empty()) << "no release while other ranks still read the producer's blocks";
  EXPECT_TRUE(a.load_failures.empty()) << "no recompute while reads still land in our blocks";
  c_.on_read_done(kT, 0, true, 0);
  c_.on_read_done(kT, 1, true, 0);
  EXPECT_TRUE(c_.take_actions().load_failures.empty());
  c_.on_read_done(kT, 1, true, 1);
  a = c_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kRelease);
  ASSERT_EQ(a.load_failures.size(), 1u);
  EXPECT_EQ(a.load_failures[0].block_ids, (std::vector<int32_t>{4, 5, 6})) << "every block recomputes";
  EXPECT_NE(a.load_failures[0].reason.find("plan piece 1"), std::string::npos) << a.load_failures[0].reason;
  EXPECT_EQ(a.finished_recving, std::vector<std::string>{"req"});
  EXPECT_EQ(c_.num_active(), 0u);
}

TEST_F(ConsumerStateTest, AbortWhileRanksReadWaitsForEveryRanksRead) {
  admit_and_allocate(true);
  c_.on_peer_ready(kControl, "prefill-0", 5, 64, /*pieces_per_layer=*/2);
  c_.on_read_ok(producer(), msg(MessageType::kReadOk));
  c_.take_actions();
  c_.on_abort_or_error(producer(), msg(MessageType::kAbort));
  EXPECT_TRUE(c_.take_actions().load_failures.empty());
  EXPECT_TRUE(c_.request_finished("req", 10)) << "the blocks stay held while reads are in flight";
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    for (int32_t piece = 0; piece < 2; ++piece) {
      EXPECT_TRUE(c_.take_actions().finished_recving.empty());
      c_.on_read_done(kT, layer, true, piece);
    }
  }
  auto a = c_.take_actions();
  EXPECT_EQ(a.finished_recving, std::vector<std::string>{"req"}) << "the hold ends with the last rank's read";
  EXPECT_EQ(c_.num_active(), 0u);
}

}  // namespace
}  // namespace pd::connector
