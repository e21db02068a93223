#include "engine/block_pool.h"

#include <unordered_map>

namespace pd::engine {

BlockPool::BlockPool(int32_t num_blocks, bool enable_caching)
    : enable_caching_(enable_caching), blocks_(static_cast<size_t>(num_blocks > 0 ? num_blocks : 0)) {
  for (int32_t id = 0; id < this->num_blocks(); ++id) push_tail(id);
}

void BlockPool::push_tail(int32_t id) {
  BlockMeta& b = blocks_[static_cast<size_t>(id)];
  b.prev = tail_;
  b.next = kNil;
  if (tail_ == kNil) {
    head_ = id;
  } else {
    blocks_[static_cast<size_t>(tail_)].next = id;
  }
  tail_ = id;
  ++num_free_;
}

void BlockPool::unlink(int32_t id) {
  BlockMeta& b = blocks_[static_cast<size_t>(id)];
  if (b.prev == kNil) {
    head_ = b.next;
  } else {
    blocks_[static_cast<size_t>(b.prev)].next = b.next;
  }
  if (b.next == kNil) {
    tail_ = b.prev;
  } else {
    blocks_[static_cast<size_t>(b.next)].prev = b.prev;
  }
  b.prev = b.next = kNil;
  --num_free_;
}

Status BlockPool::check_id(int32_t id) const {
  if (id < 0 || id >= num_blocks()) return internal_error("block id {} outside [0, {})", id, num_blocks());
  return Status::Ok();
}

Result<std::vector<int32_t>> BlockPool::allocate(int32_t n) {
  if (n < 0) return internal_error("allocate of {} blocks", n);
  if (n > num_free_) return resource_exhausted("need {} KV blocks, {} free", n, num_free_);
  std::vector<int32_t> ids;
  ids.reserve(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) {
    const int32_t id = head_;
    unlink(id);
    BlockMeta& b = blocks_[static_cast<size_t>(id)];
    if (b.has_hash) {
      cached_.erase(b.hash);
      b.has_hash = false;
      ++num_evictions_;
      if (record_events_) events_.push_back(KvCacheEvent{b.hash, false});
    }
    b.ref_count = 1;
    ids.push_back(id);
  }
  return ids;
}

Status BlockPool::free_blocks(std::span<const int32_t> block_ids) {
  // Validate the whole call first so a bad id changes nothing.
  std::unordered_map<int32_t, int32_t> drops;
  for (int32_t id : block_ids) {
    PD_RETURN_IF_ERROR(check_id(id));
    const int32_t n = ++drops[id];
    if (n > blocks_[static_cast<size_t>(id)].ref_count) {
      return internal_error("double free of block {} (ref count {}, freed {} times in this call)", id,
                            blocks_[static_cast<size_t>(id)].ref_count, n);
    }
  }
  for (int32_t id : block_ids) {
    BlockMeta& b = blocks_[static_cast<size_t>(id)];
    if (--b.ref_count == 0) push_tail(id);
  }
  return Status::Ok();
}

Status BlockPool::touch(std::span<const int32_t> block_ids) {
  for (int32_t id : block_ids) PD_RETURN_IF_ERROR(check_id(id));
  for (int32_t id : block_ids) {
    BlockMeta& b = blocks_[static_cast<size_t>(id)];
    if (b.ref_count++ == 0) unlink(id);
  }
  return Status::Ok();
}

std::vector<int32_t> BlockPool::find_cached_prefix(std::span<const BlockHash> block_hashes) const {
  std::vector<int32_t> ids;
  if (!enable_caching_) return ids;
  for (BlockHash h : block_hashes) {
    auto it = cached_.find(h);
    if (it == cached_.end()) break;
    ids.push_back(it->second);
  }
  return ids;
}

bool BlockPool::cache_block(int32_t block_id, BlockHash hash) {
  if (!enable_caching_ || !check_id(block_id).ok()) return false;
  BlockMeta& b = blocks_[static_cast<size_t>(block_id)];
  if (b.ref_count == 0 || b.has_hash) return false;
  if (!cached_.emplace(hash, block_id).second) return false;
  b.has_hash = true;
  b.hash = hash;
  if (record_events_) events_.push_back(KvCacheEvent{hash, true});
  return true;
}

std::optional<BlockHash> BlockPool::block_hash(int32_t block_id) const {
  const BlockMeta& b = blocks_.at(static_cast<size_t>(block_id));
  if (!b.has_hash) return std::nullopt;
  return b.hash;
}

std::vector<int32_t> BlockPool::free_list_order() const {
  std::vector<int32_t> order;
  for (int32_t id = head_; id != kNil; id = blocks_[static_cast<size_t>(id)].next) order.push_back(id);
  return order;
}

Status BlockPool::check_invariants() const {
  std::vector<bool> on_list(blocks_.size(), false);
  int32_t count = 0;
  int32_t prev = kNil;
  for (int32_t id = head_; id != kNil; id = blocks_[static_cast<size_t>(id)].next) {
    if (id < 0 || id >= num_blocks()) return internal_error("free list holds bad id {}", id);
    if (on_list[static_cast<size_t>(id)]) return internal_error("free list cycles at block {}", id);
    on_list[static_cast<size_t>(id)] = true;
    if (blocks_[static_cast<size_t>(id)].prev != prev) return internal_error("block {} has a wrong prev link", id);
    prev = id;
    ++count;
  }
  if (prev != tail_) return internal_error("free list tail {} but walk ended at {}", tail_, prev);
  if (count != num_free_) return internal_error("free list length {} but num_free {}", count, num_free_);
  for (int32_t id = 0; id < num_blocks(); ++id) {
    const BlockMeta& b = blocks_[static_cast<size_t>(id)];
    if (b.ref_count < 0) return internal_error("block {} ref count {}", id, b.ref_count);
    if ((b.ref_count == 0) != on_list[static_cast<size_t>(id)]) {
      return internal_error("block {} ref count {} but on free list = {}", id, b.ref_count,
                            on_list[static_cast<size_t>(id)]);
    }
    if (b.has_hash) {
      auto it = cached_.find(b.hash);
      if (it == cached_.end() || it->second != id) return internal_error("block {} hash not in the cache map", id);
    }
  }
  for (const auto& [hash, id] : cached_) {
    if (id < 0 || id >= num_blocks() || !blocks_[static_cast<size_t>(id)].has_hash ||
        blocks_[static_cast<size_t>(id)].hash != hash) {
      return internal_error("cache map entry for block {} does not match its metadata", id);
    }
  }
  return Status::Ok();
}

}  // namespace pd::engine
