// Metrics registry rendered as Prometheus text (exposition format 0.0.4).
//
// Owners: any thread may update a metric (atomics); render() may run
// concurrently with updates. Metrics are created once (get-or-create under a
// mutex) and live as long as the registry: hold the returned reference.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace pd::metrics {

// Label pairs, e.g. {{"instance", "p0"}}. Order is kept as given.
using Labels = std::vector<std::pair<std::string, std::string>>;

class Counter {
 public:
  void inc(double amount = 1.0);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Gauge {
 public:
  void set(double value) { value_.store(value, std::memory_order_relaxed); }
  void add(double delta);
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double value);
  uint64_t count() const { return count_.load(std::memory_order_relaxed); }
  double sum() const { return sum_.load(std::memory_order_relaxed); }
  const std::vector<double>& upper_bounds() const { return upper_bounds_; }
  // Cumulative count of observations <= upper_bounds()[i].
  uint64_t cumulative_count(size_t bucket) const;

 private:
  std::vector<double> upper_bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> bucket_counts_;
  std::atomic<uint64_t> count_{0};
  std::atomic<double> sum_{0.0};
};

// Latency buckets in seconds, 1 ms .. 60 s.
std::vector<double> latency_buckets_seconds();
// 1, 2, 5, 10, 20, 50, ... up to and including the last one <= max_value
// (token-count histograms, as vLLM buckets them).
std::vector<double> one_two_five_buckets(double max_value);

class Registry {
 public:
  Counter& counter(const std::string& name, const std::string& help, const Labels& labels = {});
  Gauge& gauge(const std::string& name, const std::string& help, const Labels& labels = {});
  Histogram& histogram(const std::string& name, const std::string& help, const Labels& labels = {},
                       std::vector<double> upper_bounds = latency_buckets_seconds());

  std::string render_prometheus() const;

  // The process-wide registry that /metrics renders.
  static Registry& global();

 private:
  enum class Kind { kCounter, kGauge, kHistogram };
  struct Family {
    Kind kind;
    std::string help;
    // Keyed by the rendered label set, e.g. `instance="p0"`.
    std::map<std::string, std::unique_ptr<Counter>> counters;
    std::map<std::string, std::unique_ptr<Gauge>> gauges;
    std::map<std::string, std::unique_ptr<Histogram>> histograms;
  };
  Family& family(const std::string& name, Kind kind, const std::string& help);

  mutable std::mutex mutex_;
  std::map<std::string, Family> families_;
};

// Renders labels as `a="x",b="y"` with Prometheus escaping.
std::string render_labels(const Labels& labels);

}  // namespace pd::metrics
