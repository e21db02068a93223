#include <gtest/gtest.h>

#include "connector/transfer_machines.h"

namespace pd::connector {
namespace {

const std::string kT = "0123456789abcdef0123456789abcdef";
constexpr int32_t kLayers = 3;
constexpr int32_t kBlockSize = 4;

PeerRef consumer() {
  return PeerRef{PeerKey::accepted("0a"), "decode-0", 77};
}
PeerRef intruder() {
  return PeerRef{PeerKey::accepted("0b"), "decode-9", 99};
}

// kv_tokens < 0: the consumer computes the last prompt token (n - 1).
ControlMessage blocks_msg(std::vector<int32_t> ids, int32_t num_tokens, int32_t skip = 0, int32_t kv_tokens = -1) {
  ControlMessage m;
  m.type = MessageType::kBlocks;
  m.transfer_id = kT;
  m.block_ids = std::move(ids);
  m.num_tokens = num_tokens;
  m.kv_tokens = kv_tokens < 0 ? num_tokens - 1 : kv_tokens;
  m.num_skip_blocks = skip;
  return m;
}

ControlMessage simple(MessageType type, const std::string& id = kT) {
  ControlMessage m;
  m.type = type;
  m.transfer_id = id;
  return m;
}

class ProducerStateTest : public ::testing::Test {
 protected:
  ProducerTransfers p_{kLayers, kBlockSize, ProducerTimeouts{/*defer=*/1000, /*transfer=*/500}};

  // The final step saves every layer, seals, and every posted write completes.
  void prefill_and_complete_every_write() {
    for (int32_t layer = 0; layer < kLayers; ++layer) p_.on_layer_saved(kT, layer);
    p_.on_forward_done(kT, true);
    for (int32_t layer = 0; layer < kLayers; ++layer) p_.on_write_done(kT, layer, true);
  }
};

// 10 tokens: the consumer needs KV of 9 tokens = 3 blocks.
TEST_F(ProducerStateTest, WritesEachLayerAsItIsSavedThenSendsDoneAndReleases) {
  ASSERT_TRUE(p_.start(kT, "req", false, 10, 0).ok());
  p_.on_blocks(consumer(), blocks_msg({7, 8, 9}, 10), 64, 0);
  p_.begin_final_step(kT, {1, 2, 3});
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    p_.on_layer_saved(kT, layer);
    auto a = p_.take_actions();
    ASSERT_EQ(a.writes.size(), 1u) << "layer " << layer << " is posted right after its attention";
    EXPECT_EQ(a.writes[0].layer, layer);
  }
  p_.on_forward_done(kT, true);
  EXPECT_TRUE(p_.take_actions().sends.empty()) << "no done while writes are in flight";
  EXPECT_TRUE(p_.request_finished(kT, {1, 2, 3}, true, 10)) << "blocks held while writes are in flight";
  for (int32_t layer = 0; layer < kLayers; ++layer) p_.on_write_done(kT, layer, true);
  auto a = p_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kDone);
  EXPECT_TRUE(a.sends[0].message.ok);
  EXPECT_EQ(a.sends[0].to, consumer().key);
  EXPECT_EQ(a.released_request_ids, std::vector<std::string>{"req"});
  EXPECT_EQ(p_.num_active(), 0u);
}

TEST_F(ProducerStateTest, ProducerHoldsBlocksUntilWriteDoneEvenOnEos) {
  // The one generated token was EOS: the request finishes in the same step its
  // writes were posted. The blocks must stay held until the writes complete.
  ASSERT_TRUE(p_.start(kT, "req", false, 10, 0).ok());
  p_.on_blocks(consumer(), blocks_msg({7, 8, 9}, 10), 64, 0);
  for (int32_t layer = 0; layer < kLayers; ++layer) p_.on_layer_saved(kT, layer);
  p_.on_forward_done(kT, true);
  EXPECT_TRUE(p_.request_finished(kT, {1, 2, 3}, true, 0));
  p_.on_write_done(kT, 0, true);
  p_.on_write_done(kT, 1, true);
  EXPECT_TRUE(p_.take_actions().released_request_ids.empty());
  EXPECT_EQ(p_.num_blocks_held(), 3u);
  p_.on_write_done(kT, 2, true);
  EXPECT_EQ(p_.take_actions().released_request_ids, std::vector<std::string>{"req"});
}

TEST_F(ProducerStateTest, BlocksArrivingBeforeTheRequestAreKeptAndUsed) {
  p_.on_blocks(consumer(), blocks_msg({7, 8, 9}, 10), 64, 0);
  EXPECT_EQ(p_.num_buffered_blocks(), 1u);
  ASSERT_TRUE(p_.start(kT, "req", false, 10, 5).ok());
  ASSERT_NE(p_.destination(kT), nullptr);
  EXPECT_EQ(p_.destination(kT)->block_ids, (std::vector<int32_t>{7, 8, 9}));
}

TEST_F(ProducerStateTest, BlocksArrivingAfterThePrefillPostEveryLayerAtOnce) {
  ASSERT_TRUE(p_.start(kT, "req", false, 10, 0).ok());
  for (int32_t layer = 0; layer < kLayers; ++layer) p_.on_layer_saved(kT, layer);
  p_.on_forward_done(kT, true);
  EXPECT_TRUE(p_.request_finished(kT, {1, 2, 3}, true, 0));
  EXPECT_TRUE(p_.take_actions().writes.empty());
  p_.on_blocks(consumer(), blocks_msg({7, 8, 9}, 10), 64, 100);
  EXPECT_EQ(p_.take_actions().writes.size(), static_cast<size_t>(kLayers));
}

TEST_F(ProducerStateTest, WithoutDestinationTheHoldEndsAtDeferTimeout) {
  ASSERT_TRUE(p_.start(kT, "req", false, 10, 0).ok());
  p_.on_forward_done(kT, true);
  EXPECT_TRUE(p_.request_finished(kT, {1, 2, 3}, true, 0));
  p_.tick(999);
  EXPECT_TRUE(p_.take_actions().released_request_ids.empty());
  p_.tick(1000);
  auto a = p_.take_actions();
  EXPECT_EQ(a.released_request_ids, std::vector<std::string>{"req"});
  EXPECT_EQ(a.num_timeouts, 1);
  // Late blocks for the ended transfer are answered with abort, not buffered.
  p_.on_blocks(consumer(), blocks_msg({7, 8, 9}, 10), 64, 1001);
  a = p_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kAbort);
  EXPECT_EQ(p_.num_buffered_blocks(), 0u);
}

TEST_F(ProducerStateTest, EarlyBlockListsAreBoundedInIdsNotOnlyInLists) {
  constexpr int32_t kPeerBlocks = 1 << 20;
  constexpr size_t kQuarter = kMaxEarlyBlockIds / 4;
  std::vector<int32_t> ids(kQuarter);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(i);
  auto list_for = [&](int i) {
    ControlMessage m = blocks_msg(ids, 1 << 30);
    m.transfer_id = fmt::format("{:032x}", i);
    return m;
  };
  for (int i = 0; i < 4; ++i) p_.on_blocks(consumer(), list_for(i), kPeerBlocks, 0);
  EXPECT_EQ(p_.num_buffered_block_ids(), kMaxEarlyBlockIds);
  EXPECT_TRUE(p_.take_actions().sends.empty());
  // Only 4 lists of 4096, but the ids are spent: the fifth is refused with an abort.
  p_.on_blocks(consumer(), list_for(4), kPeerBlocks, 0);
  auto a = p_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kAbort);
  EXPECT_EQ(p_.num_buffered_blocks(), 4u);
  // A list naming more blocks than the consumer's pool has is refused outright.
  ControlMessage oversized = blocks_msg({0, 1, 2}, 10);
  oversized.transfer_id = fmt::format("{:032x}", 99);
  p_.on_abort(consumer(), list_for(0));  // frees a quarter: room again in ids
  p_.take_actions();
  p_.on_blocks(consumer(), oversized, /*peer_num_blocks=*/2, 0);
  a = p_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kAbort);
  // Every way out of the buffer gives the ids back: claimed by its request, aborted, timed out.
  ASSERT_TRUE(p_.start(fmt::format("{:032x}", 1), "req", false, 1 << 30, 0).ok());
  EXPECT_EQ(p_.num_buffered_block_ids(), 2 * kQuarter);
  p_.tick(1000);
  EXPECT_EQ(p_.num_buffered_blocks(), 0u);
  EXPECT_EQ(p_.num_buffered_block_ids(), 0u);
}

TEST_F(ProducerStateTest, UnclaimedEarlyBlocksAreAbortedAtDeferTimeout) {
  p_.on_blocks(consumer(), blocks_msg({7, 8, 9}, 10), 64, 0);
  p_.tick(1000);
  auto a = p_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kAbort);
  EXPECT_EQ(p_.num_buffered_blocks(), 0u);
}

TEST_F(ProducerStateTest, BadDestinationsAbortTheTransferWithoutWriting) {
  struct Case {
    ControlMessage msg;
    int32_t peer_blocks;
  };
  const Case cases[] = {
      {blocks_msg({7, 8}, 10), 64},        // too few
      {blocks_msg({7, 8, 9}, 11), 64},     // other prompt length
      {blocks_msg({7, 8, 64}, 10), 64},    // out of the consumer's pool
      {blocks_msg({7, 7, 9}, 10), 64},     // repeated destination
      {blocks_msg({7, 8, 9}, 10, 4), 64},  // skips more than exists
  };
  for (const auto& c : cases) {
    ProducerTransfers p(kLayers, kBlockSize, ProducerTimeouts{1000, 500});
    ASSERT_TRUE(p.start(kT, "req", false, 10, 0).ok());
    p.on_blocks(consumer(), c.msg, c.peer_blocks, 0);
    for (int32_t layer = 0; layer < kLayers; ++layer) p.on_layer_saved(kT, layer);
    p.on_forward_done(kT, true);
    auto a = p.take_actions();
    EXPECT_TRUE(a.writes.empty());
    ASSERT_FALSE(a.sends.empty());
    EXPECT_EQ(a.sends[0].message.type, MessageType::kAbort);
    EXPECT_EQ(a.num_refused, 1);
    EXPECT_FALSE(p.request_finished(kT, {1, 2, 3}, true, 0)) << "nothing in flight: freed at once";
  }
}

TEST_F(ProducerStateTest, PrefixSkipWritesOnlyTheMissingBlocks) {
  ASSERT_TRUE(p_.start(kT, "req", false, 10, 0).ok());
  p_.on_blocks(consumer(), blocks_msg({9}, 10, /*skip=*/2), 64, 0);
  ASSERT_NE(p_.destination(kT), nullptr);
  EXPECT_EQ(p_.destination(kT)->num_skip_blocks, 2);
  EXPECT_EQ(p_.destination(kT)->block_ids.size(), 1u);
}

TEST_F(ProducerStateTest, AFullyCachedConsumerEndsTheTransferWithoutWrites) {
  ASSERT_TRUE(p_.start(kT, "req", false, 10, 0).ok());
  p_.on_blocks(consumer(), blocks_msg({}, 10, /*skip=*/3), 64, 0);
  p_.on_forward_done(kT, true);
  EXPECT_FALSE(p_.request_finished(kT, {1, 2, 3}, true, 0));
  auto a = p_.take_actions();
  EXPECT_TRUE(a.writes.empty());
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kDone);
  EXPECT_TRUE(a.released_request_ids.empty()) << "never held, so nothing to release";
}

TEST_F(ProducerStateTest, AFailedWriteSendsDoneNotOkOnlyAfterTheLastInFlightWrite) {
  ASSERT_TRUE(p_.start(kT, "req", false, 10, 0).ok());
  p_.on_blocks(consumer(), blocks_msg({7, 8, 9}, 10), 64, 0);
  p_.on_forward_done(kT, true);
  EXPECT_TRUE(p_.request_finished(kT, {1, 2, 3}, true, 0));
  p_.take_actions();
  p_.on_write_done(kT, 0, false);
  EXPECT_TRUE(p_.take_actions().sends.empty());
  p_.on_write_done(kT, 1, true);
  p_.on_write_done(kT, 2, true);
  auto a = p_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kDone);
  EXPECT_FALSE(a.sends[0].message.ok);
  EXPECT_EQ(a.released_request_ids, std::vector<std::string>{"req"});
}

TEST_F(ProducerStateTest, AbortFromAnotherPeerIsRefusedAndFromTheConsumerStopsWrites) {
  ASSERT_TRUE(p_.start(kT, "req", false, 10, 0).ok());
  p_.on_blocks(consumer(), blocks_msg({7, 8, 9}, 10), 64, 0);
  p_.on_abort(intruder(), simple(MessageType::kAbort));
  EXPECT_EQ(p_.take_actions().num_refused, 1);
  p_.on_abort(consumer(), simple(MessageType::kAbort));
  for (int32_t layer = 0; layer < kLayers; ++layer) p_.on_layer_saved(kT, layer);
  p_.on_forward_done(kT, true);
  EXPECT_TRUE(p_.take_actions().writes.empty());
  EXPECT_FALSE(p_.request_finished(kT, {1, 2, 3}, true, 0));
}

TEST_F(ProducerStateTest, ARequestAbortedMidPrefillFreesAndTellsTheConsumer) {
  ASSERT_TRUE(p_.start(kT, "req", false, 10, 0).ok());
  p_.on_blocks(consumer(), blocks_msg({7, 8, 9}, 10), 64, 0);
  EXPECT_FALSE(p_.request_finished(kT, {1, 2}, /*kv_complete=*/false, 0));
  auto a = p_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kDone);
  EXPECT_FALSE(a.sends[0].message.ok);
}

TEST_F(ProducerStateTest, ReadHoldsUntilReleaseFromTheReaderOnly) {
  ASSERT_TRUE(p_.start(kT, "req", true, 10, 0).ok());
  p_.on_forward_done(kT, true);
  EXPECT_TRUE(p_.request_finished(kT, {1, 2, 3}, true, 0));
  auto read = simple(MessageType::kRead);
  read.block_ids = {2, 3};
  read.num_tokens = 10;
  read.kv_tokens = 9;
  p_.on_read(consumer(), read, 100);
  auto a = p_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kReadOk);
  p_.on_release(intruder(), simple(MessageType::kRelease));
  a = p_.take_actions();
  EXPECT_EQ(a.num_refused, 1);
  EXPECT_TRUE(a.released_request_ids.empty());
  p_.on_release(consumer(), simple(MessageType::kRelease));
  EXPECT_EQ(p_.take_actions().released_request_ids, std::vector<std::string>{"req"});
}

TEST_F(ProducerStateTest, ReadOfBlocksThatDoNotBelongToTheTransferIsRefused) {
  ASSERT_TRUE(p_.start(kT, "req", true, 10, 0).ok());
  p_.on_forward_done(kT, true);
  EXPECT_TRUE(p_.request_finished(kT, {1, 2, 3}, true, 0));
  auto read = simple(MessageType::kRead);
  read.block_ids = {2, 40};
  read.num_tokens = 10;
  read.kv_tokens = 9;
  p_.on_read(consumer(), read, 0);
  auto a = p_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kError);
  EXPECT_NE(a.sends[0].message.text.find("does not belong"), std::string::npos);
  EXPECT_TRUE(a.sends[0].message.invalid_params) << "the ids came from the client: its error";
}

TEST_F(ProducerStateTest, ReadOfAnExpiredTransferIsRefusedButNotAsInvalidParameters) {
  auto read = simple(MessageType::kRead);
  read.block_ids = {1};
  read.num_tokens = 10;
  read.kv_tokens = 9;
  p_.on_read(consumer(), read, 0);
  auto a = p_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kError);
  EXPECT_FALSE(a.sends[0].message.invalid_params) << "a slow consumer recomputes";
}

TEST_F(ProducerStateTest, ReadHoldEndsAtTransferTimeoutAndAReadExtendsIt) {
  ASSERT_TRUE(p_.start(kT, "req", true, 10, 0).ok());
  p_.on_forward_done(kT, true);
  EXPECT_TRUE(p_.request_finished(kT, {1, 2, 3}, true, 0));
  auto read = simple(MessageType::kRead);
  read.block_ids = {1};
  read.num_tokens = 10;
  read.kv_tokens = 9;
  p_.on_read(consumer(), read, 400);
  p_.tick(500);
  EXPECT_TRUE(p_.take_actions().released_request_ids.empty());
  p_.tick(900);
  auto a = p_.take_actions();
  EXPECT_EQ(a.released_request_ids, std::vector<std::string>{"req"});
  EXPECT_EQ(a.num_timeouts, 1);
}

TEST_F(ProducerStateTest, ARestartedConsumerFailsItsTransfers) {
  ASSERT_TRUE(p_.start(kT, "req", false, 10, 0).ok());
  p_.on_blocks(consumer(), blocks_msg({7, 8, 9}, 10), 64, 0);
  p_.on_peer_gone("decode-0", 77);
  p_.on_forward_done(kT, true);
  EXPECT_TRUE(p_.take_actions().writes.empty());
  EXPECT_FALSE(p_.request_finished(kT, {1, 2, 3}, true, 0));
}

TEST_F(ProducerStateTest, ADuplicateTransferIdIsRefused) {
  ASSERT_TRUE(p_.start(kT, "req", false, 10, 0).ok());
  EXPECT_FALSE(p_.start(kT, "req2", false, 10, 0).ok());
}

}  // namespace
}  // namespace pd::connector

namespace pd::connector {
namespace {

TEST(ProducerAdmission, StartIsIdempotentForTheSameRequestOnly) {
  ProducerTransfers p(3, 4, {});
  ASSERT_TRUE(p.start(kT, "req", false, 10, 0).ok());
  EXPECT_TRUE(p.start(kT, "req", false, 10, 1).ok());
  EXPECT_FALSE(p.start(kT, "other", false, 10, 1).ok());
}

}  // namespace
}  // namespace pd::connector

namespace pd::connector {
namespace {

TEST(ProducerAdmission, AnAbortThatBeatsTheRequestMeansNothingIsHeld) {
  ProducerTransfers p(3, 4, {});
  ControlMessage abort;
  abort.type = MessageType::kAbort;
  abort.transfer_id = kT;
  p.on_abort(consumer(), abort);
  ASSERT_TRUE(p.start(kT, "req", false, 10, 0).ok());
  p.on_forward_done(kT, true);
  EXPECT_FALSE(p.request_finished(kT, {1, 2, 3}, true, 0));
  EXPECT_EQ(p.num_active(), 0u);
}

// First-token hand-over. 10 tokens, block size 4: the whole prompt is 3 blocks
// (the same 3 as for 9 tokens), 12 tokens would be 3 against 3 too, 9 tokens 3 against 2.
TEST_F(ProducerStateTest, DoneCarriesTheFirstTokenToAConsumerThatTookTheWholePrompt) {
  ASSERT_TRUE(p_.start(kT, "req", false, 9, 0).ok());
  p_.on_blocks(consumer(), blocks_msg({7, 8, 9}, 9, 0, /*kv_tokens=*/9), 64, 0);
  EXPECT_EQ(p_.take_actions().num_refused, 0) << "3 blocks for all 9 tokens";
  prefill_and_complete_every_write();
  EXPECT_TRUE(p_.take_actions().sends.empty()) << "done waits for the token sampled in the same step";
  p_.first_token_sampled(kT, 4242, 0xfeed);
  auto a = p_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kDone);
  EXPECT_TRUE(a.sends[0].message.ok);
  ASSERT_TRUE(a.sends[0].message.first_token.has_value());
  EXPECT_EQ(*a.sends[0].message.first_token, 4242);
  EXPECT_EQ(a.sends[0].message.sampling_key, 0xfeedu);
  EXPECT_FALSE(p_.request_finished(kT, {1, 2, 3}, true, 0)) << "done already sent, nothing in flight";
}

// The done is settled (KV sealed, destination known, token sampled) while the
// last writes are still in flight: it is offered once for the completion path to
// send, and the engine thread's later view of the completions sends nothing more.
TEST_F(ProducerStateTest, ADoneSettledWhileWritesAreInFlightIsOfferedToTheCompletionPath) {
  ASSERT_TRUE(p_.start(kT, "req", false, 9, 0).ok());
  p_.on_blocks(consumer(), blocks_msg({7, 8, 9}, 9, 0, /*kv_tokens=*/9), 64, 0);
  for (int32_t layer = 0; layer < kLayers; ++layer) p_.on_layer_saved(kT, layer);
  p_.on_forward_done(kT, true);
  EXPECT_TRUE(p_.take_actions().early_dones.empty()) << "the consumer wants the token: not settled yet";
  p_.first_token_sampled(kT, 4242, 0xfeed);
  auto a = p_.take_actions();
  EXPECT_TRUE(a.sends.empty());
  ASSERT_EQ(a.early_dones.size(), 1u);
  EXPECT_EQ(a.early_dones[0].to, consumer().key);
  EXPECT_TRUE(a.early_dones[0].message.ok);
  ASSERT_TRUE(a.early_dones[0].message.first_token.has_value());
  EXPECT_EQ(*a.early_dones[0].message.first_token, 4242);
  EXPECT_TRUE(p_.request_finished(kT, {1, 2, 3}, true, 0)) << "held while writes are in flight";
  EXPECT_TRUE(p_.take_actions().early_dones.empty()) << "offered once";
  p_.on_done_sent_early(kT);
  for (int32_t layer = 0; layer < kLayers; ++layer) p_.on_write_done(kT, layer, true);
  a = p_.take_actions();
  EXPECT_TRUE(a.sends.empty()) << "the consumer has its done already";
  EXPECT_EQ(a.num_completed, 1);
  EXPECT_EQ(a.released_request_ids, std::vector<std::string>{"req"});
  EXPECT_EQ(p_.num_active(), 0u);
}

TEST_F(ProducerStateTest, AnOfferedDoneThatWasNotSentBecauseAWriteFailedEndsAsDoneNotOk) {
  ASSERT_TRUE(p_.start(kT, "req", false, 9, 0).ok());
  p_.on_blocks(consumer(), blocks_msg({7, 8, 9}, 9, 0, 9), 64, 0);
  for (int32_t layer = 0; layer < kLayers; ++layer) p_.on_layer_saved(kT, layer);
  p_.on_forward_done(kT, true);
  p_.first_token_sampled(kT, 4242, 0xfeed);
  ASSERT_EQ(p_.take_actions().early_dones.size(), 1u);
  EXPECT_TRUE(p_.request_finished(kT, {1, 2, 3}, true, 0));
  p_.on_write_done(kT, 0, false);
  p_.on_write_done(kT, 1, true);
  p_.on_write_done(kT, 2, true);
  auto a = p_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kDone);
  EXPECT_FALSE(a.sends[0].message.ok);
  EXPECT_EQ(a.released_request_ids, std::vector<std::string>{"req"});
}

// An offered early done whose transfer is then aborted (consumer abort, router
// release) while its writes are in flight is withdrawn, and the transfer ends with
// done not ok, counted once as failed.
TEST_F(ProducerStateTest, AnOfferedDoneIsWithdrawnWhenTheTransferIsAbortedBeforeItWentOut) {
  ASSERT_TRUE(p_.start(kT, "req", false, 9, 0).ok());
  p_.on_blocks(consumer(), blocks_msg({7, 8, 9}, 9, 0, 9), 64, 0);
  for (int32_t layer = 0; layer < kLayers; ++layer) p_.on_layer_saved(kT, layer);
  p_.on_forward_done(kT, true);
  p_.first_token_sampled(kT, 4242, 0xfeed);
  ASSERT_EQ(p_.take_actions().early_dones.size(), 1u);
  EXPECT_TRUE(p_.request_finished(kT, {1, 2, 3}, true, 0));
  EXPECT_TRUE(p_.release(kT));  // the router gave up on it
  auto a = p_.take_actions();
  EXPECT_EQ(a.withdrawn_early_dones, std::vector<std::string>{kT});
  EXPECT_EQ(a.num_failed, 1);
  for (int32_t layer = 0; layer < kLayers; ++layer) p_.on_write_done(kT, layer, true);
  a = p_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_FALSE(a.sends[0].message.ok);
  EXPECT_EQ(a.num_completed, 0);
  EXPECT_EQ(a.released_request_ids, std::vector<std::string>{"req"});
  EXPECT_EQ(p_.num_active(), 0u);
}

// The completion path sent the offered done just before the abort's withdrawal
// reached it: no second done, and the transfer is not counted completed.
TEST_F(ProducerStateTest, AnEarlyDoneSentAfterTheTransferFailedIsNotCountedCompleted) {
  ASSERT_TRUE(p_.start(kT, "req", false, 9, 0).ok());
  p_.on_blocks(consumer(), blocks_msg({7, 8, 9}, 9, 0, 9), 64, 0);
  for (int32_t layer = 0; layer < kLayers; ++layer) p_.on_layer_saved(kT, layer);
  p_.on_forward_done(kT, true);
  p_.first_token_sampled(kT, 4242, 0xfeed);
  ASSERT_EQ(p_.take_actions().early_dones.size(), 1u);
  EXPECT_TRUE(p_.request_finished(kT, {1, 2, 3}, true, 0));
  EXPECT_TRUE(p_.release(kT));  // the router gave up on it
  EXPECT_EQ(p_.take_actions().num_failed, 1);
  p_.on_done_sent_early(kT);  // reported with the last write's completion
  for (int32_t layer = 0; layer < kLayers; ++layer) p_.on_write_done(kT, layer, true);
  auto a = p_.take_actions();
  EXPECT_TRUE(a.sends.empty()) << "the consumer has a done already";
  EXPECT_EQ(a.num_completed, 0);
  EXPECT_EQ(p_.num_active(), 0u);
}

TEST_F(ProducerStateTest, DoneWithoutATokenWhenTheRequestFinishesWithoutOne) {
  ASSERT_TRUE(p_.start(kT, "req", false, 9, 0).ok());
  p_.on_blocks(consumer(), blocks_msg({7, 8, 9}, 9, 0, 9), 64, 0);
  prefill_and_complete_every_write();
  EXPECT_TRUE(p_.take_actions().sends.empty());
  EXPECT_TRUE(p_.request_finished(kT, {1, 2, 3}, true, 0));
  auto a = p_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_TRUE(a.sends[0].message.ok);
  EXPECT_FALSE(a.sends[0].message.first_token.has_value()) << "the consumer computes the token itself";
  EXPECT_EQ(a.released_request_ids, std::vector<std::string>{"req"}) << "the hold ends with done";
}

TEST_F(ProducerStateTest, ATokenIsNotSentToAConsumerThatComputesTheLastTokenItself) {
  ASSERT_TRUE(p_.start(kT, "req", false, 9, 0).ok());
  p_.first_token_sampled(kT, 4242, 1);
  p_.on_blocks(consumer(), blocks_msg({7, 8}, 9), 64, 0);
  prefill_and_complete_every_write();
  auto a = p_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_FALSE(a.sends[0].message.first_token.has_value());
}

TEST_F(ProducerStateTest, KvTokensOtherThanThePromptOrOneLessAreRefused) {
  ASSERT_TRUE(p_.start(kT, "req", false, 9, 0).ok());
  p_.on_blocks(consumer(), blocks_msg({7, 8}, 9, 0, /*kv_tokens=*/5), 64, 0);
  auto a = p_.take_actions();
  EXPECT_EQ(a.num_refused, 1);
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kAbort);
}

TEST_F(ProducerStateTest, ReadOkCarriesTheFirstTokenWhenTheWholePromptIsRead) {
  ASSERT_TRUE(p_.start(kT, "req", true, 9, 0).ok());
  p_.on_forward_done(kT, true);
  p_.first_token_sampled(kT, 17, 0xabc);
  EXPECT_TRUE(p_.request_finished(kT, {1, 2, 3}, true, 0));
  auto read = simple(MessageType::kRead);
  read.block_ids = {1, 2, 3};
  read.num_tokens = 9;
  read.kv_tokens = 9;
  p_.on_read(consumer(), read, 0);
  auto a = p_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kReadOk);
  ASSERT_TRUE(a.sends[0].message.first_token.has_value());
  EXPECT_EQ(*a.sends[0].message.first_token, 17);
  EXPECT_EQ(a.sends[0].message.sampling_key, 0xabcu);
}

// ---- explicit release (POST /pd/release) ---------------------------------------

TEST_F(ProducerStateTest, ReleaseOfAWriteHoldWithoutDestinationFreesAtOnce) {
  ASSERT_TRUE(p_.start(kT, "req", false, 10, 0).ok());
  p_.on_forward_done(kT, true);
  EXPECT_TRUE(p_.request_finished(kT, {1, 2, 3}, true, 0));
  p_.take_actions();
  EXPECT_TRUE(p_.release(kT));
  auto a = p_.take_actions();
  EXPECT_EQ(a.released_request_ids, std::vector<std::string>{"req"});
  EXPECT_EQ(a.num_failed, 1);
  EXPECT_EQ(p_.num_blocks_held(), 0u);
  EXPECT_FALSE(p_.release(kT)) << "a second release finds nothing";
}

TEST_F(ProducerStateTest, ReleaseOfAReadHoldFreesAtOnce) {
  ASSERT_TRUE(p_.start(kT, "req", true, 10, 0).ok());
  p_.on_forward_done(kT, true);
  EXPECT_TRUE(p_.request_finished(kT, {1, 2, 3}, true, 0));
  p_.take_actions();
  EXPECT_TRUE(p_.release(kT));
  EXPECT_EQ(p_.take_actions().released_request_ids, std::vector<std::string>{"req"});
  EXPECT_EQ(p_.num_active(), 0u);
}

TEST_F(ProducerStateTest, ReleaseWaitsForInFlightWritesAndTellsTheConsumer) {
  ASSERT_TRUE(p_.start(kT, "req", false, 10, 0).ok());
  p_.on_blocks(consumer(), blocks_msg({7, 8, 9}, 10), 64, 0);
  for (int32_t layer = 0; layer < kLayers; ++layer) p_.on_layer_saved(kT, layer);
  p_.on_forward_done(kT, true);
  EXPECT_TRUE(p_.request_finished(kT, {1, 2, 3}, true, 0));
  EXPECT_EQ(p_.take_actions().writes.size(), static_cast<size_t>(kLayers));
  EXPECT_TRUE(p_.release(kT));
  auto a = p_.take_actions();
  EXPECT_TRUE(a.released_request_ids.empty()) << "writes in flight: blocks stay";
  EXPECT_TRUE(a.sends.empty());
  for (int32_t layer = 0; layer < kLayers; ++layer) p_.on_write_done(kT, layer, true);
  a = p_.take_actions();
  EXPECT_EQ(a.released_request_ids, std::vector<std::string>{"req"});
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kDone);
  EXPECT_FALSE(a.sends[0].message.ok);
  EXPECT_EQ(a.sends[0].to, consumer().key);
}

TEST_F(ProducerStateTest, ReleaseBeforeTheRequestMeansItsLegHoldsNothing) {
  EXPECT_FALSE(p_.release(kT));
  ASSERT_TRUE(p_.start(kT, "req", false, 10, 0).ok());
  p_.on_forward_done(kT, true);
  EXPECT_FALSE(p_.request_finished(kT, {1, 2, 3}, true, 0));
  EXPECT_EQ(p_.num_blocks_held(), 0u);
}

TEST_F(ProducerStateTest, ReleaseOfBufferedBlocksAbortsThemToTheirConsumer) {
  p_.on_blocks(consumer(), blocks_msg({7, 8, 9}, 10), 64, 0);
  EXPECT_TRUE(p_.release(kT));
  auto a = p_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kAbort);
  EXPECT_EQ(p_.num_buffered_blocks(), 0u);
  ASSERT_TRUE(p_.start(kT, "req", false, 10, 0).ok());
  EXPECT_FALSE(p_.request_finished(kT, {1, 2, 3}, true, 0));
}

TEST_F(ProducerStateTest, AnAbortFromAnotherPeerCannotDropBufferedBlocks) {
  p_.on_blocks(consumer(), blocks_msg({7, 8, 9}, 10), 64, 0);
  p_.on_abort(intruder(), simple(MessageType::kAbort));
  EXPECT_EQ(p_.take_actions().num_refused, 1);
  EXPECT_EQ(p_.num_buffered_blocks(), 1u);
  ASSERT_TRUE(p_.start(kT, "req", false, 10, 0).ok());
  ASSERT_NE(p_.destination(kT), nullptr);
}

// ---- tensor parallelism: several plan pieces (rank pairs) per layer ----------------------

TEST_F(ProducerStateTest, EveryRankPairOfEveryLayerIsWrittenBeforeDone) {
  ASSERT_TRUE(p_.start(kT, "req", false, 10, 0).ok());
  p_.on_blocks(consumer(), blocks_msg({7, 8, 9}, 10), 64, 0, /*pieces_per_layer=*/3);
  p_.begin_final_step(kT, {1, 2, 3});
  p_.on_layer_saved(kT, 0);
  auto a = p_.take_actions();
  ASSERT_EQ(a.writes.size(), 3u) << "one write per plan piece, right after the layer's attention";
  for (int32_t piece = 0; piece < 3; ++piece) {
    EXPECT_EQ(a.writes[piece].layer, 0);
    EXPECT_EQ(a.writes[piece].piece, piece);
  }
  for (int32_t layer = 1; layer < kLayers; ++layer) p_.on_layer_saved(kT, layer);
  p_.on_forward_done(kT, true);
  EXPECT_EQ(p_.take_actions().writes.size(), static_cast<size_t>(3 * (kLayers - 1)));
  EXPECT_TRUE(p_.request_finished(kT, {1, 2, 3}, true, 10));
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    for (int32_t piece = 0; piece < 3; ++piece) {
      EXPECT_TRUE(p_.take_actions().sends.empty()) << "done before layer " << layer << " piece " << piece;
      p_.on_write_done(kT, layer, true, piece);
    }
  }
  a = p_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kDone);
  EXPECT_TRUE(a.sends[0].message.ok);
  EXPECT_EQ(a.released_request_ids, std::vector<std::string>{"req"});
}

TEST_F(ProducerStateTest, OneRankFailingFailsTheTransferAfterEveryRanksWritesDrained) {
  // Layer 0's write of piece 1 fails while the other pieces' writes are in flight:
  // no more layers are posted, done{ok:false} and the release wait for all of them.
  ASSERT_TRUE(p_.start(kT, "req", false, 10, 0).ok());
  p_.on_blocks(consumer(), blocks_msg({7, 8, 9}, 10), 64, 0, /*pieces_per_layer=*/2);
  p_.begin_final_step(kT, {1, 2, 3});
  p_.on_layer_saved(kT, 0);
  ASSERT_EQ(p_.take_actions().writes.size(), 2u);
  p_.on_write_done(kT, 0, false, 1);
  p_.on_layer_saved(kT, 1);
  p_.on_forward_done(kT, true);
  auto a = p_.take_actions();
  EXPECT_TRUE(a.writes.empty()) << "a failed transfer posts nothing more";
  EXPECT_TRUE(a.sends.empty()) << "rank 0's write of layer 0 is still in flight";
  EXPECT_EQ(a.num_failed, 1);
  EXPECT_TRUE(p_.request_finished(kT, {1, 2, 3}, true, 10)) << "blocks held while a rank's write is in flight";
  EXPECT_EQ(p_.num_blocks_held(), 3u);
  EXPECT_TRUE(p_.take_actions().released_request_ids.empty());
  p_.on_write_done(kT, 0, true, 0);
  a = p_.take_actions();
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_EQ(a.sends[0].message.type, MessageType::kDone);
  EXPECT_FALSE(a.sends[0].message.ok);
  EXPECT_NE(a.sends[0].message.text.find("plan piece 1"), std::string::npos) << a.sends[0].message.text;
  EXPECT_EQ(a.released_request_ids, std::vector<std::string>{"req"});
  EXPECT_EQ(p_.num_active(), 0u);
  EXPECT_EQ(p_.num_blocks_held(), 0u);
}

TEST_F(ProducerStateTest, AnAbortDrainsEveryRanksWritesBeforeTheRelease) {
  ASSERT_TRUE(p_.start(kT, "req", false, 10, 0).ok());
  p_.on_blocks(consumer(), blocks_msg({7, 8, 9}, 10), 64, 0, /*pieces_per_layer=*/4);
  p_.begin_final_step(kT, {1, 2, 3});
  for (int32_t layer = 0; layer < kLayers; ++layer) p_.on_layer_saved(kT, layer);
  p_.on_forward_done(kT, true);
  ASSERT_EQ(p_.take_actions().writes.size(), static_cast<size_t>(4 * kLayers));
  EXPECT_TRUE(p_.request_finished(kT, {1, 2, 3}, true, 10));
  p_.on_abort(consumer(), simple(MessageType::kAbort));
  for (int32_t layer = 0; layer < kLayers; ++layer) {
    for (int32_t piece = 0; piece < 4; ++piece) {
      EXPECT_TRUE(p_.take_actions().released_request_ids.empty());
      p_.on_write_done(kT, layer, true, piece);
    }
  }
  auto a = p_.take_actions();
  EXPECT_EQ(a.released_request_ids, std::vector<std::string>{"req"});
  ASSERT_EQ(a.sends.size(), 1u);
  EXPECT_FALSE(a.sends[0].message.ok);
}

TEST_F(ProducerStateTest, BufferedBlocksKeepTheirPieceCount) {
  p_.on_blocks(consumer(), blocks_msg({7, 8, 9}, 10), 64, 0, /*pieces_per_layer=*/2);
  ASSERT_TRUE(p_.start(kT, "req", false, 10, 5).ok());
  ASSERT_NE(p_.destination(kT), nullptr);
  EXPECT_EQ(p_.destination(kT)->pieces_per_layer, 2);
  p_.on_layer_saved(kT, 0);
  EXPECT_EQ(p_.take_actions().writes.size(), 2u);
}

}  // namespace
}  // namespace pd::connector
