// Discovery: keeps the set of live instances and publishes it as immutable
// snapshots for the request path.
//
// Threads:
//  - control thread (an io_context): sole owner of the InstanceRegistry and of
//    the Backend objects; runs the expiry scan and the /pd/info probes of
//    static instances; publishes a new Snapshot after every change. It never
//    blocks on DNS: a registered host name is resolved by Asio's resolver
//    thread, at most kMaxPendingResolves at once, each within
//    --resolve-timeout-ms, and the instance is admitted when its address is known.
//  - registration thread: owns the ZMQ ROUTER socket; validates each message
//    (contract::decode_heartbeat) and posts valid records to the control thread. A
//    malformed message is counted and dropped; the loop never exits on bad input.
//    It also owns the CacheViews (load reports and prefix caches): applies each
//    heartbeat's load and KV events, answers a gap with a resync request on the
//    same socket, and publishes an immutable CacheIndex after every change.
// Request threads only load the published snapshot and cache index (atomic shared_ptrs).
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/status.h"
#include "router/asio.h"
#include "router/backend.h"
#include "router/cache_view.h"
#include "router/config.h"
#include "router/instance_registry.h"

namespace pd::router {

class Discovery {
 public:
  Discovery(const RouterConfig& config, size_t num_io_threads);
  ~Discovery();
  Discovery(const Discovery&) = delete;
  Discovery& operator=(const Discovery&) = delete;

  // Binds the registration socket (when configured) and starts both threads.
  Status start();
  void stop();
  // After stop() and after the io threads stopped: closes every pooled connection of every Backend ever made.
  void clear_idle_connections();

  std::shared_ptr<const Snapshot> snapshot() const { return snapshot_.load(std::memory_order_acquire); }
  // Load reports and prefix caches of registered instances (empty without registration).
  std::shared_ptr<const CacheIndex> cache_index() const { return cache_index_.load(std::memory_order_acquire); }
  // The bound registration port, or -1 when registration is disabled.
  int registration_port() const { return registration_port_; }

 private:
  struct StaticTarget {
    InstanceRole role;
    HostPort http;
    tcp::endpoint endpoint;
  };

  // Host-name lookups in flight at once; a registration beyond them is dropped (and logged).
  static constexpr size_t kMaxPendingResolves = 64;
  // The least time between two snapshot requests to one instance (a gap lasts until its reset arrives).
  static constexpr int64_t kResyncIntervalMs = 1000;

  void registration_loop();
  void admit(InstanceInfo info, bool from_probe);
  void add_backend(const InstanceInfo& info, const tcp::endpoint& endpoint, UpsertOutcome outcome, bool from_probe);
  awaitable<void> resolve_then_add(std::string instance_id, UpsertOutcome outcome, bool from_probe);
  void publish();
  awaitable<void> expiry_loop();
  awaitable<void> probe_loop(StaticTarget target);
  awaitable<Result<InstanceInfo>> probe_once(const StaticTarget& target);

  const RouterConfig config_;
  const std::string backend_authorization_;  // Authorization header value for engines; empty for none
  const size_t num_io_threads_;
  net::io_context control_;
  std::optional<net::executor_work_guard<net::io_context::executor_type>> control_work_;
  std::thread control_thread_;
  std::thread registration_thread_;
  std::atomic<bool> stopping_{false};
  int registration_port_ = -1;
  std::string registration_endpoint_;

  // Owned by the control thread.
  InstanceRegistry registry_;
  std::map<std::string, std::shared_ptr<Backend>> backends_;
  std::vector<std::weak_ptr<Backend>> every_backend_;  // pruned of dead ones on publish
  std::vector<StaticTarget> static_targets_;
  std::map<std::string, InstanceInfo> resolving_;  // instance_id -> its latest record, while its host is looked up

  std::atomic<std::shared_ptr<const Snapshot>> snapshot_;
  std::atomic<std::shared_ptr<const CacheIndex>> cache_index_{std::make_shared<const CacheIndex>()};

  struct ZmqState;
  std::unique_ptr<ZmqState> zmq_;
};

}  // namespace pd::router
