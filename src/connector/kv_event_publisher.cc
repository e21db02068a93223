#include "connector/kv_event_publisher.h"

namespace pd::connector {

void KvEventPublisher::apply(std::span<const engine::KvCacheEvent> events) {
  for (const engine::KvCacheEvent& e : events) {
    if (e.stored) {
      cache_.insert(e.hash);
    } else {
      cache_.erase(e.hash);
    }
    dirty_.insert(e.hash);
  }
}

contract::KvEventBatch KvEventPublisher::next_batch(uint32_t block_size) {
  contract::KvEventBatch batch;
  batch.block_size = block_size;
  if (reset_pending_) {
    reset_pending_ = false;
    batch.reset = true;
    sent_.clear();
    dirty_ = cache_;
  }
  for (auto it = dirty_.begin(); it != dirty_.end();) {
    if (batch.stored.size() == max_hashes_per_list_ && batch.removed.size() == max_hashes_per_list_) break;
    const uint64_t hash = *it;
    const bool cached = cache_.contains(hash);
    const bool sent = sent_.contains(hash);
    if (cached && !sent) {
      if (batch.stored.size() == max_hashes_per_list_) {
        ++it;
        continue;
      }
      batch.stored.push_back(hash);
      sent_.insert(hash);
    } else if (!cached && sent) {
      if (batch.removed.size() == max_hashes_per_list_) {
        ++it;
        continue;
      }
      batch.removed.push_back(hash);
      sent_.erase(hash);
    }
    it = dirty_.erase(it);
  }
  if (batch.has_events()) ++seq_;
  batch.seq = seq_;
  return batch;
}

}  // namespace pd::connector
