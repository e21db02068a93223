#include "router/instance_metrics.h"

#include <fmt/format.h>

namespace pd::router {

const std::vector<double>& leg_latency_buckets() {
  static const std::vector<double> buckets = {0.005, 0.01, 0.025, 0.05, 0.1,  0.25,  0.5,  1.0,
                                              2.5,   5.0,  10.0,  30.0, 60.0, 120.0, 300.0};
  return buckets;
}

void InstanceMetrics::admit(const std::string& instance, const std::string& role) {
  std::lock_guard lock(mutex_);
  instances_[instance].role = role;
}

void InstanceMetrics::remove(const std::string& instance) {
  std::lock_guard lock(mutex_);
  instances_.erase(instance);
}

void InstanceMetrics::set_outstanding(const std::string& instance, int64_t outstanding) {
  std::lock_guard lock(mutex_);
  if (auto it = instances_.find(instance); it != instances_.end()) it->second.outstanding = outstanding;
}

void InstanceMetrics::observe_leg_latency(const std::string& instance, const std::string& leg, double seconds) {
  std::lock_guard lock(mutex_);
  auto it = instances_.find(instance);
  if (it == instances_.end()) return;
  auto& histogram = it->second.latency[leg];
  if (!histogram) histogram = std::make_unique<metrics::Histogram>(leg_latency_buckets());
  histogram->observe(seconds);
}

void InstanceMetrics::count_leg_failure(const std::string& instance, const std::string& leg,
                                        const std::string& reason) {
  std::lock_guard lock(mutex_);
  if (auto it = instances_.find(instance); it != instances_.end()) ++it->second.failures[{leg, reason}];
}

size_t InstanceMetrics::num_instances() const {
  std::lock_guard lock(mutex_);
  return instances_.size();
}

std::string InstanceMetrics::render_prometheus() const {
  std::lock_guard lock(mutex_);
  std::string out;
  out +=
      "# HELP pd_router_instance_outstanding Legs in flight per instance (a stream counts until its end)\n"
      "# TYPE pd_router_instance_outstanding gauge\n";
  for (const auto& [id, s] : instances_) {
    out += fmt::format("pd_router_instance_outstanding{{{}}} {}\n",
                       metrics::render_labels({{"instance", id}, {"role", s.role}}), s.outstanding);
  }
  out +=
      "# HELP pd_router_leg_latency_seconds Backend legs that were answered: time to their answer's end\n"
      "# TYPE pd_router_leg_latency_seconds histogram\n";
  for (const auto& [id, s] : instances_) {
    for (const auto& [leg, h] : s.latency) {
      const std::string labels = metrics::render_labels({{"instance", id}, {"leg", leg}});
      for (size_t i = 0; i < h->upper_bounds().size(); ++i) {
        out += fmt::format("pd_router_leg_latency_seconds_bucket{{{},le=\"{}\"}} {}\n", labels, h->upper_bounds()[i],
                           h->cumulative_count(i));
      }
      out += fmt::format("pd_router_leg_latency_seconds_bucket{{{},le=\"+Inf\"}} {}\n", labels, h->count());
      out += fmt::format("pd_router_leg_latency_seconds_sum{{{}}} {}\n", labels, h->sum());
      out += fmt::format("pd_router_leg_latency_seconds_count{{{}}} {}\n", labels, h->count());
    }
  }
  out +=
      "# HELP pd_router_instance_leg_failures_total Backend legs that failed, by instance, leg and reason\n"
      "# TYPE pd_router_instance_leg_failures_total counter\n";
  for (const auto& [id, s] : instances_) {
    for (const auto& [key, count] : s.failures) {
      out += fmt::format("pd_router_instance_leg_failures_total{{{}}} {}\n",
                         metrics::render_labels({{"instance", id}, {"leg", key.first}, {"reason", key.second}}), count);
    }
  }
  return out;
}

InstanceMetrics& InstanceMetrics::global() {
  static InstanceMetrics metrics;
  return metrics;
}

}  // namespace pd::router
