#include "router/cache_view.h"

#include <gtest/gtest.h>

namespace pd::router {
namespace {

using namespace std::chrono_literals;

contract::KvEventBatch batch(uint64_t seq, bool reset, std::vector<uint64_t> stored,
                             std::vector<uint64_t> removed = {}) {
  return contract::KvEventBatch{seq, reset, 16, std::move(stored), std::move(removed)};
}

contract::Heartbeat heartbeat(std::optional<contract::KvEventBatch> kv, uint64_t boot_nonce = 1,
                              std::optional<contract::LoadReport> load = std::nullopt) {
  contract::Heartbeat h;
  h.record.instance_id = "d0";
  h.record.boot_nonce = boot_nonce;
  h.kv = std::move(kv);
  h.load = load;
  return h;
}

TEST(CacheTracker, AResetThenConsecutiveBatchesBuildTheView) {
  CacheTracker t(100);
  EXPECT_EQ(t.apply(batch(1, true, {1, 2})), CacheTracker::Outcome::kApplied);
  EXPECT_EQ(t.apply(batch(2, false, {3}, {1})), CacheTracker::Outcome::kApplied);
  EXPECT_EQ(t.apply(batch(2, false, {})), CacheTracker::Outcome::kUnchanged);
  EXPECT_TRUE(t.known());
  EXPECT_EQ(t.hashes(), (std::unordered_set<uint64_t>{2, 3}));
}

TEST(CacheTracker, EventsBeforeAnyResetAreAGap) {
  CacheTracker t(100);
  EXPECT_EQ(t.apply(batch(5, false, {1})), CacheTracker::Outcome::kGap);
  EXPECT_FALSE(t.known());
}

TEST(CacheTracker, AMissedBatchDropsTheViewUntilTheNextReset) {
  CacheTracker t(100);
  t.apply(batch(1, true, {1}));
  EXPECT_EQ(t.apply(batch(3, false, {2})), CacheTracker::Outcome::kGap);
  EXPECT_FALSE(t.known());
  EXPECT_TRUE(t.hashes().empty());
  EXPECT_EQ(t.apply(batch(4, false, {5})), CacheTracker::Outcome::kGap);  // still waiting
  EXPECT_EQ(t.apply(batch(5, true, {1, 2})), CacheTracker::Outcome::kApplied);
  EXPECT_EQ(t.hashes(), (std::unordered_set<uint64_t>{1, 2}));
}

TEST(CacheTracker, AnEmptyFrameAheadOfTheViewRevealsAMissedLastBatch) {
  CacheTracker t(100);
  t.apply(batch(1, true, {1}));
  EXPECT_EQ(t.apply(batch(2, false, {})), CacheTracker::Outcome::kGap);
}

TEST(CacheTracker, AViewLargerThanTheBoundIsDropped) {
  CacheTracker t(2);
  EXPECT_EQ(t.apply(batch(1, true, {1, 2, 3})), CacheTracker::Outcome::kGap);
  EXPECT_FALSE(t.known());
}

TEST(CacheViews, AGapAsksForAResyncAtMostOncePerInterval) {
  CacheViews views(5000ms, 1000ms);
  const auto t0 = SteadyClock::time_point{} + 1h;
  EXPECT_FALSE(views.apply(heartbeat(batch(1, true, {1})), true, t0).send_resync);
  EXPECT_TRUE(views.apply(heartbeat(batch(3, false, {2})), true, t0).send_resync);
  EXPECT_FALSE(views.apply(heartbeat(batch(4, false, {3})), true, t0 + 500ms).send_resync);
  EXPECT_TRUE(views.apply(heartbeat(batch(5, false, {3})), true, t0 + 1000ms).send_resync);
  const auto index = views.publish();
  ASSERT_EQ(index->count("d0"), 1u);
  EXPECT_EQ(index->at("d0")->hashes, nullptr);  // not known while waiting for the reset
}

TEST(CacheViews, PublishesLoadAndHashesAndSharesUnchangedStates) {
  CacheViews views(5000ms, 1000ms);
  const auto t0 = SteadyClock::time_point{} + 1h;
  const contract::LoadReport load{1, 2, 30, 40, 500};
  EXPECT_TRUE(views.apply(heartbeat(batch(1, true, {7}), 1, load), true, t0).changed);
  const auto first = views.publish();
  EXPECT_EQ(first->at("d0")->load, load);
  EXPECT_EQ(*first->at("d0")->hashes, (std::unordered_set<uint64_t>{7}));
  EXPECT_FALSE(views.apply(heartbeat(batch(1, false, {}), 1, load), true, t0).changed);
  EXPECT_EQ(views.publish()->at("d0"), first->at("d0"));
}

TEST(CacheViews, ANewBootNonceStartsAfresh) {
  CacheViews views(5000ms, 1000ms);
  const auto t0 = SteadyClock::time_point{} + 1h;
  views.apply(heartbeat(batch(1, true, {7})), true, t0);
  EXPECT_TRUE(views.apply(heartbeat(batch(3, false, {8}), /*boot_nonce=*/2), true, t0).send_resync);
  EXPECT_EQ(views.publish()->at("d0")->boot_nonce, 2u);
}

TEST(CacheViews, AnInstanceNotAdmittedGetsNoView) {
  CacheViews views(5000ms, 1000ms);
  const auto t0 = SteadyClock::time_point{} + 1h;
  const CacheViews::Applied applied = views.apply(heartbeat(batch(1, true, {1, 2})), /*admitted=*/false, t0);
  EXPECT_FALSE(applied.changed);
  EXPECT_FALSE(applied.send_resync);
  EXPECT_EQ(views.size(), 0u);
  EXPECT_TRUE(views.publish()->empty());
  // Ids a peer makes up are remembered (to ask them for a snapshot once admitted) up to a bound only.
  for (size_t i = 0; i < 2 * kMaxPendingAdmissions; ++i) {
    contract::Heartbeat h = heartbeat(batch(1, true, {1}));
    h.record.instance_id = "made-up-" + std::to_string(i);
    views.apply(h, false, t0);
  }
  EXPECT_EQ(views.num_pending(), kMaxPendingAdmissions);
  EXPECT_EQ(views.size(), 0u);
  // ... and forgotten once they were not admitted for the pending time.
  EXPECT_TRUE(views.take_admitted([](std::string_view, uint64_t) { return false; }, t0 + 5000ms).empty());
  EXPECT_EQ(views.num_pending(), 0u);
}

TEST(CacheViews, AnInstanceAdmittedAfterItsFirstHeartbeatIsAskedForASnapshotOnce) {
  CacheViews views(5000ms, 1000ms);
  const auto t0 = SteadyClock::time_point{} + 1h;
  views.apply(heartbeat(batch(1, true, {1})), false, t0, ReplyTo{"envelope", true});
  auto admitted = [](std::string_view id, uint64_t nonce) { return id == "d0" && nonce == 1; };
  const std::vector<ReplyTo> ask = views.take_admitted(admitted, t0 + 100ms);
  ASSERT_EQ(ask.size(), 1u);
  EXPECT_EQ(ask[0].identity, "envelope");
  EXPECT_TRUE(ask[0].delimited);
  EXPECT_EQ(views.size(), 1u);
  EXPECT_EQ(views.publish()->at("d0")->hashes, nullptr);  // unknown until the snapshot comes
  // Its next frame (events it sent before the resync arrived) does not ask again within the interval.
  EXPECT_FALSE(views.apply(heartbeat(batch(2, false, {2})), true, t0 + 200ms).send_resync);
  EXPECT_TRUE(views.apply(heartbeat(batch(3, true, {1, 2})), true, t0 + 400ms).changed);
  EXPECT_EQ(*views.publish()->at("d0")->hashes, (std::unordered_set<uint64_t>{1, 2}));
  EXPECT_TRUE(views.take_admitted(admitted, t0 + 500ms).empty());
}

TEST(CacheViews, AnInstanceThatLeavesLosesItsView) {
  CacheViews views(5000ms, 1000ms);
  const auto t0 = SteadyClock::time_point{} + 1h;
  views.apply(heartbeat(batch(1, true, {1})), true, t0);
  EXPECT_FALSE(views.retain([](std::string_view id, uint64_t nonce) { return id == "d0" && nonce == 1; }));
  EXPECT_EQ(views.size(), 1u);
  EXPECT_TRUE(views.retain([](std::string_view, uint64_t) { return false; }));
  EXPECT_EQ(views.size(), 0u);
  EXPECT_TRUE(views.publish()->empty());
  // A heartbeat that arrives after it left (not admitted) brings nothing back.
  views.apply(heartbeat(batch(2, false, {2})), false, t0 + 10ms);
  EXPECT_EQ(views.size(), 0u);
}

TEST(CacheViews, AViewHoldsAtMostTheInstancesReportedPool) {
  CacheViews views(5000ms, 1000ms);
  const auto t0 = SteadyClock::time_point{} + 1h;
  const contract::LoadReport two_blocks{0, 0, 2, 2, 0};
  EXPECT_TRUE(views.apply(heartbeat(batch(1, true, {1, 2}), 1, two_blocks), true, t0).changed);
  EXPECT_NE(views.publish()->at("d0")->hashes, nullptr);
  // A third hash in a pool of two blocks: a broken peer, dropped like a gap.
  EXPECT_TRUE(views.apply(heartbeat(batch(2, false, {3}), 1, two_blocks), true, t0).send_resync);
  EXPECT_EQ(views.publish()->at("d0")->hashes, nullptr);
  // A pool reported smaller than the view drops it too.
  views.apply(heartbeat(batch(3, true, {1, 2}), 1, two_blocks), true, t0 + 2s);
  const contract::LoadReport one_block{0, 0, 1, 1, 0};
  views.apply(heartbeat(batch(3, false, {}), 1, one_block), true, t0 + 2s);
  EXPECT_EQ(views.publish()->at("d0")->hashes, nullptr);
}

TEST(CacheViews, TheBoundIsThePoolCappedAndOneFrameWithoutAReport) {
  EXPECT_EQ(view_bound(std::nullopt), contract::kMaxKvEventHashes);
  EXPECT_EQ(view_bound(contract::LoadReport{0, 0, 10, 1000, 0}), 1000u);
  EXPECT_EQ(view_bound(contract::LoadReport{0, 0, 0, static_cast<uint32_t>(contract::kMaxReportedBlocks), 0}),
            kMaxViewHashes);
  CacheTracker tracker(3);
  tracker.apply(batch(1, true, {1, 2, 3}));
  EXPECT_FALSE(tracker.set_max_hashes(3));
  EXPECT_TRUE(tracker.known());
  EXPECT_TRUE(tracker.set_max_hashes(2));
  EXPECT_FALSE(tracker.known());
}

TEST(AnnotateCandidates, CachedTokensAreTheLongestPrefixOfThePromptsFullBlocks) {
  std::vector<int32_t> prompt(50);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(i);
  const std::vector<contract::BlockHash> blocks = contract::hash_full_blocks(prompt, 16);
  ASSERT_EQ(blocks.size(), 3u);
  auto state = std::make_shared<InstanceCacheState>();
  state->boot_nonce = 9;
  state->block_size = 16;
  state->hashes = std::make_shared<const std::unordered_set<uint64_t>>(
      std::unordered_set<uint64_t>{blocks[0], blocks[1], /*not the prefix:*/ 12345});
  state->load = contract::LoadReport{0, 0, 1, 1, 77};
  CacheIndex index;
  index.emplace("d0", state);
  InstanceInfo same;
  same.instance_id = "d0";
  same.boot_nonce = 9;
  InstanceInfo other_incarnation = same;
  other_incarnation.boot_nonce = 10;
  std::vector<Candidate> candidates(2, Candidate{InstanceRole::kConsumer, TransferMode::kWrite, "m", 0});
  std::vector<const InstanceInfo*> infos = {&same, &other_incarnation};
  annotate_candidates(candidates, infos, index, &prompt);
  EXPECT_EQ(candidates[0].cached_tokens, 32);
  EXPECT_EQ(candidates[0].load->num_queued_prefill_tokens, 77u);
  EXPECT_EQ(candidates[1].cached_tokens, 0);
  EXPECT_FALSE(candidates[1].load.has_value());
}

}  // namespace
}  // namespace pd::router
