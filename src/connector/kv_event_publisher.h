// What an instance tells the router about its prefix cache (docs/pd_contract.md
// "Load and KV cache events"). Pure: the heartbeat thread owns one, feeds it the
// engine's cache events in order and asks it for each frame's batch.
//
// It keeps two sets: the engine's cache as the events describe it, and the
// receiver's view after every batch handed out. A batch is their difference
// (bounded per list), so a hash stored and evicted between two frames costs
// nothing, and a snapshot is the same mechanism started from an empty view.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_set>

#include "contract/registration.h"
#include "engine/block_pool.h"

namespace pd::connector {

class KvEventPublisher {
 public:
  explicit KvEventPublisher(size_t max_hashes_per_list = contract::kMaxKvEventHashes)
      : max_hashes_per_list_(max_hashes_per_list) {}

  // The engine's events, in the order they happened.
  void apply(std::span<const engine::KvCacheEvent> events);
  // The receiver lost track (it asked for a snapshot): the next batch resets its
  // view and the following ones carry the rest of the cache.
  void request_reset() { reset_pending_ = true; }

  // The next frame's batch: a reset first (the receiver starts from nothing), then
  // up to max_hashes_per_list stored and removed hashes. seq advances only for a
  // batch with events (contract::KvEventBatch).
  contract::KvEventBatch next_batch(uint32_t block_size);
  // Differences not handed out yet (another batch should follow soon).
  bool has_pending() const { return reset_pending_ || !dirty_.empty(); }
  size_t num_cached() const { return cache_.size(); }
  uint64_t seq() const { return seq_; }

 private:
  const size_t max_hashes_per_list_;
  std::unordered_set<uint64_t> cache_;  // the engine's prefix cache now
  std::unordered_set<uint64_t> sent_;   // the receiver's view after every batch handed out
  std::unordered_set<uint64_t> dirty_;  // hashes that may be in one set and not the other
  bool reset_pending_ = true;
  uint64_t seq_ = 0;
};

}  // namespace pd::connector
