// The router's view of every registered instance's load and prefix cache, built
// from their heartbeats (docs/pd_contract.md "Load and KV cache events"). Pure:
// time is passed in. Owned by the registration thread, which receives the
// heartbeats, answers gaps with resync requests and publishes an immutable
// CacheIndex after every change; request threads only read published indexes.
#pragma once

#include <algorithm>
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
  // A new bound (the instance reported another pool size); a view already larger is dropped.
  // True when it was.
  bool set_max_hashes(size_t max_hashes);
  bool known() const { return known_; }
  uint32_t block_size() const { return block_size_; }
  size_t max_hashes() const { return max_hashes_; }
  const std::unordered_set<uint64_t>& hashes() const { return hashes_; }

 private:
  void lose();
  size_t max_hashes_;
  bool known_ = false;
  uint64_t last_seq_ = 0;
  uint32_t block_size_ = 0;
  std::unordered_set<uint64_t> hashes_;
};

// The most hashes one instance's view may hold, whatever pool it reports: 2^20 blocks
// (16M tokens at 16 tokens a block, beyond any single engine's KV pool today).
inline constexpr size_t kMaxViewHashes = size_t{1} << 20;
// An instance's view before its first load report holds at most one frame's hashes.
inline constexpr size_t kViewHashesWithoutLoad = contract::kMaxKvEventHashes;
// Instances that sent a heartbeat before they were admitted, remembered to ask them for a
// snapshot once they are (their first frames were not applied); more are not remembered.
inline constexpr size_t kMaxPendingAdmissions = 256;

// The bound of an instance's view: its reported pool (a block holds one hash), at most kMaxViewHashes.
size_t view_bound(const std::optional<contract::LoadReport>& load);

// Where to send an instance a resync request: the envelope of its last heartbeat, opaque here.
struct ReplyTo {
  std::string identity;
  bool delimited = false;  // the envelope has an empty delimiter frame
};

class CacheViews {
 public:
  // resync_interval: the least time between two resync requests to one instance.
  // pending_ttl: how long a heartbeat of an instance not admitted yet is remembered.
  CacheViews(std::chrono::milliseconds pending_ttl, std::chrono::milliseconds resync_interval,
             size_t max_hashes_per_instance = kMaxViewHashes)
      : pending_ttl_(pending_ttl), resync_interval_(resync_interval), max_hashes_(max_hashes_per_instance) {}

  struct Applied {
    bool changed = false;      // publish() has something new
    bool send_resync = false;  // ask this instance for a snapshot now
  };
  // A valid heartbeat. `admitted`: the instance (instance_id and boot_nonce) is in the discovered
  // set. A view exists only for an admitted instance: the heartbeat of another one changes no view
  // (a view of its id is dropped) and is remembered, with reply_to, for take_admitted().
  // A new boot_nonce starts the instance's view afresh. Each view holds at most view_bound(load)
  // hashes, capped at max_hashes_per_instance.
  Applied apply(const contract::Heartbeat& heartbeat, bool admitted, SteadyClock::time_point now,
                const ReplyTo& reply_to = {});
  // Keeps the views of admitted instances only (is_admitted(instance_id, boot_nonce)); true when
  // any was dropped. Called whenever the discovered set changes: an instance that left (expired,
  // dropped, replaced) loses its view.
  template <typename IsAdmitted>
  bool retain(IsAdmitted is_admitted) {
    return std::erase_if(entries_, [&](const auto& item) { return !is_admitted(item.first, item.second.boot_nonce); }) >
           0;
  }
  // The remembered instances now admitted: each gets an (unknown) view and is asked for a snapshot
  // now (the resync requests to send are returned), since its earlier frames were not applied.
  // Forgets them, and those remembered for pending_ttl. Returns nothing for an instance that
  // already has a view.
  template <typename IsAdmitted>
  std::vector<ReplyTo> take_admitted(IsAdmitted is_admitted, SteadyClock::time_point now) {
    std::vector<ReplyTo> out;
    std::erase_if(pending_, [&](auto& item) {
      const uint64_t boot_nonce = item.second.boot_nonce;
      if (is_admitted(item.first, boot_nonce)) {
        auto [entry, inserted] =
            entries_.try_emplace(item.first, Entry{boot_nonce, CacheTracker(bound(std::nullopt)), {}, now, nullptr});
        if (inserted) out.push_back(std::move(item.second.reply_to));
        return true;
      }
      return now - item.second.since >= pending_ttl_;
    });
    return out;
  }
  // The current index; unchanged instances share their published state.
  std::shared_ptr<const CacheIndex> publish();
  size_t size() const { return entries_.size(); }
  size_t num_pending() const { return pending_.size(); }

 private:
  struct Entry {
    uint64_t boot_nonce = 0;
    CacheTracker tracker;
    std::optional<contract::LoadReport> load;
    std::optional<SteadyClock::time_point> last_resync;
    std::shared_ptr<const InstanceCacheState> published;  // null: changed since
  };
  struct Pending {
    uint64_t boot_nonce = 0;
    SteadyClock::time_point since;
    ReplyTo reply_to;
  };
  size_t bound(const std::optional<contract::LoadReport>& load) const {
    return std::min(max_hashes_, view_bound(load));
  }
  std::chrono::milliseconds pending_ttl_;
  std::chrono::milliseconds resync_interval_;
  size_t max_hashes_;
  std::map<std::string, Entry, std::less<>> entries_;
  std::map<std::string, Pending, std::less<>> pending_;
};

}  // namespace pd::router
