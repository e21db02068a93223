#include "common/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

namespace pd::metrics {
namespace {

void atomic_add(std::atomic<double>& target, double delta) {
  double current = target.load(std::memory_order_relaxed);
  while (!target.compare_exchange_weak(current, current + delta, std::memory_order_relaxed)) {
  }
}

std::string escape_label_value(const std::string& value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '"')
      out += "\\\"";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

std::string format_number(double value) {
  return fmt::format("{}", value);
}

std::string join_labels(const std::string& base, const std::string& extra) {
  if (base.empty()) return extra;
  if (extra.empty()) return base;
  return base + "," + extra;
}

std::string braces(const std::string& labels) {
  return labels.empty() ? "" : "{" + labels + "}";
}

}  // namespace

void Counter::inc(double amount) {
  if (amount < 0) return;  // counters never go down
  atomic_add(value_, amount);
}

void Gauge::add(double delta) {
  atomic_add(value_, delta);
}

Histogram::Histogram(std::vector<double> upper_bounds) : upper_bounds_(std::move(upper_bounds)) {
  std::sort(upper_bounds_.begin(), upper_bounds_.end());
  bucket_counts_ = std::make_unique<std::atomic<uint64_t>[]>(upper_bounds_.size());
  for (size_t i = 0; i < upper_bounds_.size(); ++i) bucket_counts_[i].store(0);
}

void Histogram::observe(double value) {
  auto it = std::lower_bound(upper_bounds_.begin(), upper_bounds_.end(), value);
  if (it != upper_bounds_.end()) bucket_counts_[it - upper_bounds_.begin()].fetch_add(1, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
  atomic_add(sum_, value);
}

uint64_t Histogram::cumulative_count(size_t bucket) const {
  uint64_t total = 0;
  for (size_t i = 0; i <= bucket && i < upper_bounds_.size(); ++i)
    total += bucket_counts_[i].load(std::memory_order_relaxed);
  return total;
}

std::vector<double> latency_buckets_seconds() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0};
}

std::vector<double> one_two_five_buckets(double max_value) {
  std::vector<double> out;
  for (double decade = 1.0; decade <= max_value; decade *= 10.0) {
    for (double step : {1.0, 2.0, 5.0}) {
      if (step * decade <= max_value) out.push_back(step * decade);
    }
  }
  return out;
}

std::string render_labels(const Labels& labels) {
  std::string out;
  for (const auto& [key, value] : labels) {
    if (!out.empty()) out += ",";
    out += key + "=\"" + escape_label_value(value) + "\"";
  }
  return out;
}

Registry::Family& Registry::family(const std::string& name, Kind kind, const std::string& help) {
  auto [it, inserted] = families_.try_emplace(name);
  if (inserted) {
    it->second.kind = kind;
    it->second.help = help;
  } else if (it->second.kind != kind) {
    throw std::logic_error("metric " + name + " registered twice with different kinds");
  }
  return it->second;
}

Counter& Registry::counter(const std::string& name, const std::string& help, const Labels& labels) {
  std::lock_guard lock(mutex_);
  auto& slot = family(name, Kind::kCounter, help).counters[render_labels(labels)];
  if (!slot) slot = std::make_unique<Counter>();
  return *slot;
}

Gauge& Registry::gauge(const std::string& name, const std::string& help, const Labels& labels) {
  std::lock_guard lock(mutex_);
  auto& slot = family(name, Kind::kGauge, help).gauges[render_labels(labels)];
  if (!slot) slot = std::make_unique<Gauge>();
  return *slot;
}

Histogram& Registry::histogram(const std::string& name, const std::string& help, const Labels& labels,
                               std::vector<double> upper_bounds) {
  std::lock_guard lock(mutex_);
  auto& slot = family(name, Kind::kHistogram, help).histograms[render_labels(labels)];
  if (!slot) slot = std::make_unique<Histogram>(std::move(upper_bounds));
  return *slot;
}

std::string Registry::render_prometheus() const {
  std::lock_guard lock(mutex_);
  std::string out;
  for (const auto& [name, fam] : families_) {
    const char* type = fam.kind == Kind::kCounter ? "counter" : fam.kind == Kind::kGauge ? "gauge" : "histogram";
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, fam.help, name, type);
    for (const auto& [labels, counter] : fam.counters)
      out += fmt::format("{}{} {}\n", name, braces(labels), format_number(counter->value()));
    for (const auto& [labels, gauge] : fam.gauges)
      out += fmt::format("{}{} {}\n", name, braces(labels), format_number(gauge->value()));
    for (const auto& [labels, hist] : fam.histograms) {
      const auto& bounds = hist->upper_bounds();
      for (size_t i = 0; i < bounds.size(); ++i) {
        out += fmt::format("{}_bucket{{{}}} {}\n", name, join_labels(labels, "le=\"" + format_number(bounds[i]) + "\""),
                           hist->cumulative_count(i));
      }
      out += fmt::format("{}_bucket{{{}}} {}\n", name, join_labels(labels, "le=\"+Inf\""), hist->count());
      out += fmt::format("{}_sum{} {}\n", name, braces(labels), format_number(hist->sum()));
      out += fmt::format("{}_count{} {}\n", name, braces(labels), hist->count());
    }
  }
  return out;
}

Registry& Registry::global() {
  static Registry registry;
  return registry;
}

}  // namespace pd::metrics
