// The set of live instances, keyed by instance_id. Pure: time is passed in,
// no threads or sockets. Owned by the router's control thread (README.md).
//
// An entry lives while it is refreshed: a registration heartbeat or a
// successful /pd/info probe of a static instance. expire() removes every entry
// not refreshed for `ttl` (a full scan, so no silent instance is missed).
// The same instance_id with any change (a new boot nonce above all) replaces
// the old entry: the old incarnation is gone and its state with it.
#pragma once

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "common/clock.h"
#include "router/instance_info.h"

namespace pd::router {

enum class UpsertOutcome { kAdded, kRefreshed, kReplaced };

struct RegistryEntry {
  InstanceInfo info;
  SteadyClock::time_point last_seen;
};

class InstanceRegistry {
 public:
  explicit InstanceRegistry(std::chrono::milliseconds ttl) : ttl_(ttl) {}

  UpsertOutcome upsert(const InstanceInfo& info, SteadyClock::time_point now);
  // Removes and returns every entry whose last refresh is at least ttl before now.
  std::vector<InstanceInfo> expire(SteadyClock::time_point now);
  bool erase(const std::string& instance_id) { return entries_.erase(instance_id) > 0; }

  const std::map<std::string, RegistryEntry>& entries() const { return entries_; }
  size_t size() const { return entries_.size(); }
  std::chrono::milliseconds ttl() const { return ttl_; }

 private:
  std::chrono::milliseconds ttl_;
  std::map<std::string, RegistryEntry> entries_;
};

}  // namespace pd::router
