#include "connector/kv_event_publisher.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <vector>

namespace pd::connector {
namespace {

using engine::KvCacheEvent;

std::set<uint64_t> as_set(const std::vector<uint64_t>& hashes) {
  return {hashes.begin(), hashes.end()};
}

// The receiver's side of the contract: applies batches to a view.
struct View {
  std::set<uint64_t> hashes;
  void apply(const contract::KvEventBatch& batch) {
    if (batch.reset) hashes.clear();
    hashes.insert(batch.stored.begin(), batch.stored.end());
    for (uint64_t h : batch.removed) hashes.erase(h);
  }
};

TEST(KvEventPublisher, TheFirstBatchIsAResetWithTheWholeCache) {
  KvEventPublisher publisher;
  const std::vector<KvCacheEvent> events = {{1, true}, {2, true}};
  publisher.apply(events);
  const contract::KvEventBatch batch = publisher.next_batch(16);
  EXPECT_TRUE(batch.reset);
  EXPECT_EQ(batch.seq, 1u);
  EXPECT_EQ(batch.block_size, 16u);
  EXPECT_EQ(as_set(batch.stored), (std::set<uint64_t>{1, 2}));
  EXPECT_TRUE(batch.removed.empty());
  EXPECT_FALSE(publisher.has_pending());
}

TEST(KvEventPublisher, AFrameWithoutEventsRepeatsTheLastSequenceNumber) {
  KvEventPublisher publisher;
  EXPECT_EQ(publisher.next_batch(16).seq, 1u);  // the reset, even of an empty cache
  const contract::KvEventBatch idle = publisher.next_batch(16);
  EXPECT_FALSE(idle.has_events());
  EXPECT_EQ(idle.seq, 1u);
  const std::vector<KvCacheEvent> events = {{5, true}};
  publisher.apply(events);
  const contract::KvEventBatch next = publisher.next_batch(16);
  EXPECT_FALSE(next.reset);
  EXPECT_EQ(next.seq, 2u);
  EXPECT_EQ(next.stored, std::vector<uint64_t>{5});
}

TEST(KvEventPublisher, SendsTheDifferenceSoAHashStoredAndEvictedBetweenFramesCostsNothing) {
  KvEventPublisher publisher;
  const std::vector<KvCacheEvent> first = {{1, true}};
  publisher.apply(first);
  (void)publisher.next_batch(16);
  const std::vector<KvCacheEvent> churn = {{2, true}, {2, false}, {1, false}, {3, true}, {1, true}, {1, false}};
  publisher.apply(churn);
  const contract::KvEventBatch batch = publisher.next_batch(16);
  EXPECT_EQ(batch.stored, std::vector<uint64_t>{3});
  EXPECT_EQ(batch.removed, std::vector<uint64_t>{1});
}

TEST(KvEventPublisher, ASnapshotLargerThanOneFrameContinuesInTheNextOnes) {
  KvEventPublisher publisher(/*max_hashes_per_list=*/3);
  std::vector<KvCacheEvent> events;
  for (uint64_t h = 1; h <= 8; ++h) events.push_back({h, true});
  publisher.apply(events);
  View view;
  std::vector<contract::KvEventBatch> batches;
  for (int i = 0; i < 10 && publisher.has_pending(); ++i) batches.push_back(publisher.next_batch(16));
  EXPECT_FALSE(publisher.has_pending());
  ASSERT_EQ(batches.size(), 3u);
  EXPECT_TRUE(batches[0].reset);
  for (size_t i = 0; i < batches.size(); ++i) {
    EXPECT_LE(batches[i].stored.size(), 3u);
    EXPECT_EQ(batches[i].seq, i + 1);
    EXPECT_EQ(batches[i].reset, i == 0);
    view.apply(batches[i]);
  }
  EXPECT_EQ(view.hashes.size(), 8u);
}

TEST(KvEventPublisher, AResyncRequestSendsTheWholeCacheAgainAsAReset) {
  KvEventPublisher publisher;
  const std::vector<KvCacheEvent> events = {{1, true}, {2, true}, {3, true}};
  publisher.apply(events);
  View lost;
  lost.apply(publisher.next_batch(16));
  const std::vector<KvCacheEvent> evict = {{2, false}};
  publisher.apply(evict);
  (void)publisher.next_batch(16);  // lost on the way: the receiver misses seq 2
  publisher.request_reset();
  const contract::KvEventBatch snapshot = publisher.next_batch(16);
  EXPECT_TRUE(snapshot.reset);
  EXPECT_EQ(snapshot.seq, 3u);
  lost.apply(snapshot);
  EXPECT_EQ(lost.hashes, (std::set<uint64_t>{1, 3}));
}

}  // namespace
}  // namespace pd::connector
