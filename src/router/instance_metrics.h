// The router's per-instance series (README.md "Metrics"): pd_router_instance_outstanding{instance,role},
// pd_router_leg_latency_seconds{instance,leg} and pd_router_instance_leg_failures_total{instance,leg,reason}.
// Unlike the process registry (src/common/metrics), whose series live as long as the process, an
// instance's series exist from its admission to its departure (expiry, a dropped registration): a
// router that sees instances come and go does not render every one it ever saw. Updates for an instance
// not admitted now (a leg that ends after its instance left) are dropped. Thread-safe (one mutex); no I/O.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/metrics.h"

namespace pd::router {

class InstanceMetrics {
 public:
  // Starts an instance's series (its outstanding gauge at 0); kept when it already has them.
  void admit(const std::string& instance, const std::string& role);
  // Removes every series of the instance.
  void remove(const std::string& instance);

  void set_outstanding(const std::string& instance, int64_t outstanding);
  void observe_leg_latency(const std::string& instance, const std::string& leg, double seconds);
  void count_leg_failure(const std::string& instance, const std::string& leg, const std::string& reason);

  // The three families in Prometheus text format (appended to the registry's at GET /metrics).
  std::string render_prometheus() const;
  size_t num_instances() const;

  // The one pdrouter renders.
  static InstanceMetrics& global();

 private:
  struct Series {
    std::string role;
    int64_t outstanding = 0;
    std::map<std::string, std::unique_ptr<metrics::Histogram>> latency;  // by leg
    std::map<std::pair<std::string, std::string>, uint64_t> failures;    // by (leg, reason)
  };
  mutable std::mutex mutex_;
  std::map<std::string, Series> instances_;
};

// The buckets of pd_router_leg_latency_seconds.
const std::vector<double>& leg_latency_buckets();

}  // namespace pd::router
