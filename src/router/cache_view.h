// The router's view of every registered instance's load and prefix cache, built
// from their heartbeats (docs/pd_contract.md "Load and KV cache events"). Pure:
// time is passed in. Owned by the registration thread, which receives the
// heartbeats, answers gaps with resync requests and publishes an immutable
// CacheIndex after every change; request threads only read published indexes.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_set>
#include <vector>

#include "common/clock.h"
#include "contract/block_hash.h"
#include "contract/registration.h"
#include "router/instance_info.h"
#include "router/policy.h"

namespace pd::router {

// One instance as last reported. Immutable once published.
struct InstanceCacheState {
  uint64_t boot_nonce = 0;
  std::optional<contract::LoadReport> load;
  // The prefix cache, when the router holds an exact view of it (after a reset and no gap since).
  uint32_t block_size = 0;
  std::shared_ptr<const std::unordered_set<uint64_t>> hashes;  // null: not known now
};

// instance_id -> state.
using CacheIndex = std::map<std::string, std::shared_ptr<const InstanceCacheState>, std::less<>>;

// The tokens of the longest prefix of `block_hashes` (the prompt's chained hashes at the
// instance's block size) that the instance caches.
int64_t cached_prefix_tokens(const InstanceCacheState& state, std::span<const contract::BlockHash> block_hashes);

// Fills each candidate's load report and cached_tokens (of prompt_ids, when given)
// from the index entry of the same instance_id and boot_nonce; infos[i] is
// candidate i's record. An entry of another incarnation is ignored.
void annotate_candidates(std::span<Candidate> candidates, std::span<const InstanceInfo* const> infos,
                         const CacheIndex& index, const std::vector<int32_t>* prompt_ids);

// One instance's event stream (contract::KvEventBatch's sequence rules).
class CacheTracker {
 public:
  enum class Outcome { kApplied, kUnchanged, kGap };
  // max_hashes: a view larger than this is a broken peer: dropped like a gap.
  explicit CacheTracker(size_t max_hashes) : max_hashes_(max_hashes) {}
  Outcome apply(const contract::KvEventBatch& batch);
  bool known() const { return known_; }
  uint32_t block_size() const { return block_size_; }
  const std::unordered_set<uint64_t>& hashes() const { return hashes_; }

 private:
  void lose();
  size_t max_hashes_;
  bool known_ = false;
  uint64_t last_seq_ = 0;
  uint32_t block_size_ = 0;
  std::unordered_set<uint64_t> hashes_;
};

class CacheViews {
 public:
  // resync_interval: the least time between two resync requests to one instance.
  CacheViews(std::chrono::milliseconds ttl, std::chrono::milliseconds resync_interval, size_t max_hashes_per_instance)
      : ttl_(ttl), resync_interval_(resync_interval), max_hashes_(max_hashes_per_instance) {}

  struct Applied {
    bool changed = false;      // publish() has something new
    bool send_resync = false;  // ask this instance for a snapshot now
  };
  // A valid heartbeat. A new boot_nonce starts the instance's view afresh.
  Applied apply(const contract::Heartbeat& heartbeat, SteadyClock::time_point now);
  // Forgets instances silent for ttl; true when any was forgotten.
  bool expire(SteadyClock::time_point now);
  // The current index; unchanged instances share their published state.
  std::shared_ptr<const CacheIndex> publish();
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    uint64_t boot_nonce = 0;
    CacheTracker tracker;
    std::optional<contract::LoadReport> load;
    SteadyClock::time_point last_seen;
    std::optional<SteadyClock::time_point> last_resync;
    std::shared_ptr<const InstanceCacheState> published;  // null: changed since
  };
  std::chrono::milliseconds ttl_;
  std::chrono::milliseconds resync_interval_;
  size_t max_hashes_;
  std::map<std::string, Entry, std::less<>> entries_;
};

}  // namespace pd::router
