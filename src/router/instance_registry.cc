#include "router/instance_registry.h"

namespace pd::router {

UpsertOutcome InstanceRegistry::upsert(const InstanceInfo& info, SteadyClock::time_point now) {
  auto [it, inserted] = entries_.try_emplace(info.instance_id, RegistryEntry{info, now});
  if (inserted) return UpsertOutcome::kAdded;
  it->second.last_seen = now;
  if (it->second.info == info) return UpsertOutcome::kRefreshed;
  it->second.info = info;
  return UpsertOutcome::kReplaced;
}

std::vector<InstanceInfo> InstanceRegistry::expire(SteadyClock::time_point now) {
  std::vector<InstanceInfo> expired;
  for (auto it = entries_.begin(); it != entries_.end();) {
    if (now - it->second.last_seen >= ttl_) {
      expired.push_back(std::move(it->second.info));
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
  return expired;
}

}  // namespace pd::router
