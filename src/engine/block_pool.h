// KV block metadata: reference counts, the free list and the prefix cache.
// Blocks are int32 ids into the runner's KV regions; no KV bytes live here.
//
// The free list is intrusive (prev/next ids in the block metadata), O(1) for
// push, pop and unlink. It doubles as the prefix cache's LRU: a freed block
// keeps its hash and stays findable until allocate() pops it from the head,
// which evicts the hash. Callers free a request's blocks tail-first so that a
// prompt's last blocks are evicted before its shared first blocks.
//
// Owner: the engine thread (not thread-safe by design).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/status.h"
#include "contract/block_hash.h"
#include "engine/engine_request.h"

namespace pd::engine {

// Hash of one full block (the contract's, which the router computes too):
// chained over the parent block's hash, so equal hashes mean equal whole
// prefixes. extra_keys distinguish KV that differs for the same tokens.
using contract::hash_block_tokens;

// One change of the prefix cache: a hash became findable (stored) or stopped
// being findable (evicted when its free block was reallocated).
struct KvCacheEvent {
  BlockHash hash = 0;
  bool stored = false;
};

class BlockPool {
 public:
  BlockPool(int32_t num_blocks, bool enable_caching);

  int32_t num_blocks() const { return static_cast<int32_t>(blocks_.size()); }
  // Blocks on the free list (unreferenced, cached or not).
  int32_t num_free_blocks() const { return num_free_; }
  int32_t num_used_blocks() const { return num_blocks() - num_free_; }
  // Blocks whose hash is registered in the prefix cache (referenced or not).
  int32_t num_cached_blocks() const { return static_cast<int32_t>(cached_.size()); }
  int64_t num_evictions() const { return num_evictions_; }
  bool caching_enabled() const { return enable_caching_; }

  // Pops n blocks from the head of the free list (evicting their cached
  // hashes), each with ref count 1. kResourceExhausted (nothing taken) when
  // fewer than n are free.
  Result<std::vector<int32_t>> allocate(int32_t n);

  // Drops one reference from each block; a block reaching 0 is appended to
  // the free list tail in the order given (first given = evicted first). The
  // whole call is rejected (nothing changes) with kInternal if any id is out
  // of range or would drop below zero (a double free).
  Status free_blocks(std::span<const int32_t> block_ids);

  // Adds one reference to each block (a prefix-cache hit or a hold), taking
  // unreferenced ones off the free list. kInternal (nothing changes) for a bad id.
  Status touch(std::span<const int32_t> block_ids);

  // The cached blocks matching the leading hashes, stopping at the first miss.
  // Does not take references: touch() them before any allocate().
  std::vector<int32_t> find_cached_prefix(std::span<const BlockHash> block_hashes) const;

  // Registers a referenced, fully computed block under its hash. Returns false
  // (and leaves the block uncached) when caching is off, the block already has
  // a hash, or another block holds this hash (two requests computed the same
  // prefix in one step: the first one wins, the other block stays private).
  bool cache_block(int32_t block_id, BlockHash hash);

  // With recording on, every hash stored (cache_block) and evicted (allocate)
  // is appended, in order, until take_events(). Off by default.
  void set_record_events(bool on) { record_events_ = on; }
  std::vector<KvCacheEvent> take_events() { return std::exchange(events_, {}); }

  int32_t ref_count(int32_t block_id) const { return blocks_.at(static_cast<size_t>(block_id)).ref_count; }
  std::optional<BlockHash> block_hash(int32_t block_id) const;
  // Free list from head (next evicted) to tail, for tests and debugging.
  std::vector<int32_t> free_list_order() const;
  // Walks every structure; kInternal describing the first inconsistency.
  Status check_invariants() const;

 private:
  static constexpr int32_t kNil = -1;
  struct BlockMeta {
    int32_t ref_count = 0;
    int32_t prev = kNil;
    int32_t next = kNil;
    bool has_hash = false;
    BlockHash hash = 0;
  };
  void push_tail(int32_t id);
  void unlink(int32_t id);
  Status check_id(int32_t id) const;

  bool enable_caching_;
  std::vector<BlockMeta> blocks_;
  int32_t head_ = kNil;
  int32_t tail_ = kNil;
  int32_t num_free_ = 0;
  int64_t num_evictions_ = 0;
  std::unordered_map<BlockHash, int32_t> cached_;
  bool record_events_ = false;
  std::vector<KvCacheEvent> events_;
};

}  // namespace pd::engine
