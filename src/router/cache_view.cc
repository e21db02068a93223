#include "router/cache_view.h"

namespace pd::router {

int64_t cached_prefix_tokens(const InstanceCacheState& state, std::span<const contract::BlockHash> block_hashes) {
  if (!state.hashes) return 0;
  int64_t num_blocks = 0;
  for (contract::BlockHash h : block_hashes) {
    if (!state.hashes->contains(h)) break;
    ++num_blocks;
  }
  return num_blocks * state.block_size;
}

void annotate_candidates(std::span<Candidate> candidates, std::span<const InstanceInfo* const> infos,
                         const CacheIndex& index, const std::vector<int32_t>* prompt_ids) {
  std::map<uint32_t, std::vector<contract::BlockHash>> hashes_by_block_size;
  for (size_t i = 0; i < candidates.size() && i < infos.size(); ++i) {
    auto it = index.find(infos[i]->instance_id);
    if (it == index.end() || it->second->boot_nonce != infos[i]->boot_nonce) continue;
    const InstanceCacheState& state = *it->second;
    candidates[i].load = state.load;
    if (prompt_ids == nullptr || !state.hashes) continue;
    auto [hashes, inserted] = hashes_by_block_size.try_emplace(state.block_size);
    if (inserted) hashes->second = contract::hash_full_blocks(*prompt_ids, static_cast<int32_t>(state.block_size));
    candidates[i].cached_tokens = cached_prefix_tokens(state, hashes->second);
  }
}

size_t view_bound(const std::optional<contract::LoadReport>& load) {
  if (!load) return kViewHashesWithoutLoad;
  return std::min<size_t>(kMaxViewHashes, load->num_kv_blocks_total);
}

void CacheTracker::lose() {
  known_ = false;
  hashes_.clear();
}

bool CacheTracker::set_max_hashes(size_t max_hashes) {
  max_hashes_ = max_hashes;
  if (hashes_.size() <= max_hashes_) return false;
  lose();
  return true;
}

CacheTracker::Outcome CacheTracker::apply(const contract::KvEventBatch& batch) {
  if (batch.reset) {
    hashes_.clear();
    known_ = true;
  } else if (!known_) {
    return Outcome::kGap;  // waiting for a reset
  } else if (!batch.has_events()) {
    if (batch.seq == last_seq_) return Outcome::kUnchanged;
    lose();  // frames with events were missed
    return Outcome::kGap;
  } else if (batch.seq != last_seq_ + 1 || batch.block_size != block_size_) {
    lose();
    return Outcome::kGap;
  }
  last_seq_ = batch.seq;
  block_size_ = batch.block_size;
  for (uint64_t h : batch.stored) {
    hashes_.insert(h);
    // Removals come after, but a view never grows past its bound on the way: one past it is a broken peer.
    if (hashes_.size() > max_hashes_) {
      lose();
      return Outcome::kGap;
    }
  }
  for (uint64_t h : batch.removed) hashes_.erase(h);
  return Outcome::kApplied;
}

CacheViews::Applied CacheViews::apply(const contract::Heartbeat& heartbeat, bool admitted, SteadyClock::time_point now,
                                      const ReplyTo& reply_to) {
  Applied applied;
  const std::string& id = heartbeat.record.instance_id;
  auto it = entries_.find(id);
  if (!admitted) {
    if (it != entries_.end()) {
      entries_.erase(it);
      applied.changed = true;
    }
    auto pending = pending_.find(id);
    if (pending != pending_.end()) {
      pending->second = Pending{heartbeat.record.boot_nonce, pending->second.since, reply_to};
    } else if (pending_.size() < kMaxPendingAdmissions) {
      pending_.emplace(id, Pending{heartbeat.record.boot_nonce, now, reply_to});
    }
    return applied;
  }
  if (it == entries_.end() || it->second.boot_nonce != heartbeat.record.boot_nonce) {
    if (it != entries_.end()) entries_.erase(it);
    it = entries_.emplace(id, Entry{heartbeat.record.boot_nonce, CacheTracker(bound(heartbeat.load)), {}, {}, nullptr})
             .first;
    applied.changed = true;
  }
  Entry& e = it->second;
  if (heartbeat.load != e.load) {
    e.load = heartbeat.load;
    e.tracker.set_max_hashes(bound(e.load));
    applied.changed = true;
  }
  if (heartbeat.kv) {
    const bool was_known = e.tracker.known();
    const CacheTracker::Outcome outcome = e.tracker.apply(*heartbeat.kv);
    if (outcome == CacheTracker::Outcome::kApplied || was_known != e.tracker.known()) applied.changed = true;
    if (outcome == CacheTracker::Outcome::kGap && (!e.last_resync || now - *e.last_resync >= resync_interval_)) {
      e.last_resync = now;
      applied.send_resync = true;
    }
  }
  if (applied.changed) e.published.reset();
  return applied;
}

std::shared_ptr<const CacheIndex> CacheViews::publish() {
  auto index = std::make_shared<CacheIndex>();
  for (auto& [id, e] : entries_) {
    if (!e.published) {
      auto state = std::make_shared<InstanceCacheState>();
      state->boot_nonce = e.boot_nonce;
      state->load = e.load;
      if (e.tracker.known()) {
        state->block_size = e.tracker.block_size();
        state->hashes = std::make_shared<const std::unordered_set<uint64_t>>(e.tracker.hashes());
      }
      e.published = std::move(state);
    }
    index->emplace(id, e.published);
  }
  return index;
}

}  // namespace pd::router
