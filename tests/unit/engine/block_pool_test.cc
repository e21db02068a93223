#include "engine/block_pool.h"

#include <gtest/gtest.h>

#include <vector>

namespace pd::engine {
namespace {

using Ids = std::vector<int32_t>;

TEST(BlockPool, FreshPoolHandsOutBlocksInIdOrder) {
  BlockPool pool(4, true);
  EXPECT_EQ(pool.free_list_order(), (Ids{0, 1, 2, 3}));
  auto ids = pool.allocate(3);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, (Ids{0, 1, 2}));
  EXPECT_EQ(pool.num_free_blocks(), 1);
  EXPECT_EQ(pool.num_used_blocks(), 3);
  for (int32_t id : *ids) EXPECT_EQ(pool.ref_count(id), 1);
  EXPECT_TRUE(pool.check_invariants().ok());
}

TEST(BlockPool, FreedBlocksJoinTheTailInTheGivenOrder) {
  BlockPool pool(4, true);
  auto ids = pool.allocate(4);
  ASSERT_TRUE(ids.ok());
  ASSERT_TRUE(pool.free_blocks(Ids{2, 0}).ok());
  ASSERT_TRUE(pool.free_blocks(Ids{3}).ok());
  EXPECT_EQ(pool.free_list_order(), (Ids{2, 0, 3}));
  auto again = pool.allocate(2);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, (Ids{2, 0}));
  EXPECT_TRUE(pool.check_invariants().ok());
}

TEST(BlockPool, AllocatingMoreThanFreeFailsAndTakesNothing) {
  BlockPool pool(3, true);
  ASSERT_TRUE(pool.allocate(2).ok());
  auto too_many = pool.allocate(2);
  EXPECT_FALSE(too_many.ok());
  EXPECT_EQ(too_many.status().code(), ErrorCode::kResourceExhausted);
  EXPECT_EQ(pool.num_free_blocks(), 1);
  EXPECT_TRUE(pool.check_invariants().ok());
}

TEST(BlockPool, SharedBlockReturnsOnlyAfterLastReference) {
  BlockPool pool(2, true);
  auto ids = pool.allocate(1);
  ASSERT_TRUE(ids.ok());
  ASSERT_TRUE(pool.touch(*ids).ok());
  EXPECT_EQ(pool.ref_count((*ids)[0]), 2);
  ASSERT_TRUE(pool.free_blocks(*ids).ok());
  EXPECT_EQ(pool.num_free_blocks(), 1);
  ASSERT_TRUE(pool.free_blocks(*ids).ok());
  EXPECT_EQ(pool.num_free_blocks(), 2);
  EXPECT_EQ(pool.ref_count((*ids)[0]), 0);
  EXPECT_TRUE(pool.check_invariants().ok());
}

TEST(BlockPool, DoubleFreeIsRejectedAndChangesNothing) {
  BlockPool pool(3, true);
  auto ids = pool.allocate(2);
  ASSERT_TRUE(ids.ok());
  ASSERT_TRUE(pool.free_blocks(Ids{0}).ok());
  Status again = pool.free_blocks(Ids{1, 0});
  EXPECT_EQ(again.code(), ErrorCode::kInternal);
  EXPECT_EQ(pool.ref_count(1), 1) << "a rejected call must not free its valid ids either";
  Status twice_in_one_call = pool.free_blocks(Ids{1, 1});
  EXPECT_EQ(twice_in_one_call.code(), ErrorCode::kInternal);
  EXPECT_EQ(pool.ref_count(1), 1);
  EXPECT_EQ(pool.free_blocks(Ids{7}).code(), ErrorCode::kInternal);
  EXPECT_EQ(pool.free_blocks(Ids{-1}).code(), ErrorCode::kInternal);
  EXPECT_EQ(pool.touch(Ids{3}).code(), ErrorCode::kInternal);
  EXPECT_TRUE(pool.check_invariants().ok());
}

TEST(BlockPool, CachedBlockStaysFindableAfterFreeUntilReallocated) {
  BlockPool pool(2, true);
  auto ids = pool.allocate(1);
  ASSERT_TRUE(ids.ok());
  const BlockHash h = hash_block_tokens(std::nullopt, Ids{1, 2, 3, 4});
  EXPECT_TRUE(pool.cache_block((*ids)[0], h));
  ASSERT_TRUE(pool.free_blocks(*ids).ok());
  EXPECT_EQ(pool.find_cached_prefix(std::vector<BlockHash>{h}), *ids);
  // A hit revives the block off the free list.
  ASSERT_TRUE(pool.touch(*ids).ok());
  EXPECT_EQ(pool.num_free_blocks(), 1);
  ASSERT_TRUE(pool.free_blocks(*ids).ok());
  // Allocating everything evicts it.
  ASSERT_TRUE(pool.allocate(2).ok());
  EXPECT_TRUE(pool.find_cached_prefix(std::vector<BlockHash>{h}).empty());
  EXPECT_FALSE(pool.block_hash((*ids)[0]).has_value());
  EXPECT_EQ(pool.num_evictions(), 1);
  EXPECT_TRUE(pool.check_invariants().ok());
}

TEST(BlockPool, EvictionFollowsLeastRecentlyFreed) {
  BlockPool pool(3, true);
  auto ids = pool.allocate(3);
  ASSERT_TRUE(ids.ok());
  std::vector<BlockHash> hashes;
  for (int32_t i = 0; i < 3; ++i) {
    hashes.push_back(hash_block_tokens(std::nullopt, Ids{i}));
    ASSERT_TRUE(pool.cache_block(i, hashes.back()));
  }
  ASSERT_TRUE(pool.free_blocks(Ids{1, 2, 0}).ok());  // 1 is least recently freed
  ASSERT_TRUE(pool.allocate(1).ok());
  EXPECT_TRUE(pool.find_cached_prefix(std::vector<BlockHash>{hashes[1]}).empty());
  EXPECT_EQ(pool.find_cached_prefix(std::vector<BlockHash>{hashes[2]}), (Ids{2}));
  EXPECT_EQ(pool.find_cached_prefix(std::vector<BlockHash>{hashes[0]}), (Ids{0}));
}

TEST(BlockPool, HashChainCoversTheWholePrefix) {
  const Ids a = {1, 2}, b = {3, 4};
  const BlockHash root_a = hash_block_tokens(std::nullopt, a);
  const BlockHash root_b = hash_block_tokens(std::nullopt, b);
  EXPECT_EQ(root_a, hash_block_tokens(std::nullopt, Ids{1, 2}));
  EXPECT_NE(root_a, root_b);
  // Same tokens after different parents hash differently.
  EXPECT_NE(hash_block_tokens(root_a, b), hash_block_tokens(root_b, b));
  EXPECT_NE(hash_block_tokens(root_a, b), root_b);
  // Extra keys separate otherwise equal blocks.
  const uint64_t salt = 42;
  EXPECT_NE(hash_block_tokens(std::nullopt, a, std::span<const uint64_t>(&salt, 1)), root_a);
}

TEST(BlockPool, PrefixLookupStopsAtTheFirstMiss) {
  BlockPool pool(4, true);
  auto ids = pool.allocate(3);
  ASSERT_TRUE(ids.ok());
  const BlockHash h0 = hash_block_tokens(std::nullopt, Ids{1});
  const BlockHash h1 = hash_block_tokens(h0, Ids{2});
  const BlockHash h2 = hash_block_tokens(h1, Ids{3});
  ASSERT_TRUE(pool.cache_block(0, h0));
  ASSERT_TRUE(pool.cache_block(2, h2));  // h1 never cached
  EXPECT_EQ(pool.find_cached_prefix(std::vector<BlockHash>{h0, h1, h2}), (Ids{0}));
}

TEST(BlockPool, SecondBlockWithTheSameHashStaysPrivate) {
  BlockPool pool(2, true);
  auto ids = pool.allocate(2);
  ASSERT_TRUE(ids.ok());
  const BlockHash h = hash_block_tokens(std::nullopt, Ids{9});
  EXPECT_TRUE(pool.cache_block(0, h));
  EXPECT_FALSE(pool.cache_block(1, h));
  EXPECT_FALSE(pool.cache_block(0, hash_block_tokens(std::nullopt, Ids{8}))) << "a block has one hash";
  EXPECT_EQ(pool.find_cached_prefix(std::vector<BlockHash>{h}), (Ids{0}));
  EXPECT_EQ(pool.num_cached_blocks(), 1);
  EXPECT_TRUE(pool.check_invariants().ok());
}

TEST(BlockPool, CachingDisabledNeverHits) {
  BlockPool pool(2, false);
  ASSERT_TRUE(pool.allocate(1).ok());
  const BlockHash h = hash_block_tokens(std::nullopt, Ids{9});
  EXPECT_FALSE(pool.cache_block(0, h));
  EXPECT_TRUE(pool.find_cached_prefix(std::vector<BlockHash>{h}).empty());
}

TEST(BlockPool, FreeBlockCannotBeCached) {
  BlockPool pool(2, true);
  EXPECT_FALSE(pool.cache_block(0, 1234));
  EXPECT_FALSE(pool.cache_block(5, 1234));
}

TEST(BlockPoolEvents, RecordsStoresAndEvictionsInOrderOnlyWhenAsked) {
  BlockPool pool(2, /*enable_caching=*/true);
  auto ids = pool.allocate(2);
  ASSERT_TRUE(ids.ok());
  ASSERT_TRUE(pool.cache_block((*ids)[0], 11));
  EXPECT_TRUE(pool.take_events().empty());  // recording is off by default

  pool.set_record_events(true);
  ASSERT_TRUE(pool.cache_block((*ids)[1], 22));
  EXPECT_FALSE(pool.cache_block((*ids)[1], 33));  // already hashed: no event
  ASSERT_TRUE(pool.free_blocks(*ids).ok());       // freed blocks stay cached: no event
  auto again = pool.allocate(1);                  // reuses the head, evicting 11
  ASSERT_TRUE(again.ok());
  const std::vector<KvCacheEvent> events = pool.take_events();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].hash, 22u);
  EXPECT_TRUE(events[0].stored);
  EXPECT_EQ(events[1].hash, 11u);
  EXPECT_FALSE(events[1].stored);
  EXPECT_TRUE(pool.take_events().empty());
}

}  // namespace
}  // namespace pd::engine
