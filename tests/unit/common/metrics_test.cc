#include "common/metrics.h"

#include <gtest/gtest.h>

#include <thread>
#include <vector>

namespace pd::metrics {
namespace {

TEST(Metrics, RendersCountersGaugesAndCumulativeHistogramBuckets) {
  Registry registry;
  registry.counter("pd_requests_total", "Requests", {{"route", "/v1/completions"}}).inc(3);
  registry.gauge("pd_kv_blocks_free", "Free blocks").set(12);
  auto& hist = registry.histogram("pd_ttft_seconds", "TTFT", {}, {0.1, 1.0});
  hist.observe(0.05);
  hist.observe(0.5);
  hist.observe(5.0);
  std::string text = registry.render_prometheus();
  EXPECT_NE(text.find("pd_requests_total{route=\"/v1/completions\"} 3\n"), std::string::npos) << text;
  EXPECT_NE(text.find("pd_kv_blocks_free 12\n"), std::string::npos) << text;
  EXPECT_NE(text.find("pd_ttft_seconds_bucket{le=\"0.1\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("pd_ttft_seconds_bucket{le=\"1\"} 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("pd_ttft_seconds_bucket{le=\"+Inf\"} 3\n"), std::string::npos) << text;
  EXPECT_NE(text.find("pd_ttft_seconds_count 3\n"), std::string::npos) << text;
}

TEST(Metrics, ConcurrentIncrementsAreNotLost) {
  Registry registry;
  Counter& counter = registry.counter("c", "c");
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 10000; ++i) counter.inc();
    });
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(counter.value(), 40000);
}

TEST(Metrics, LabelValuesAreEscaped) {
  EXPECT_EQ(render_labels({{"a", "x\"y\\z"}}), "a=\"x\\\"y\\\\z\"");
}

}  // namespace
}  // namespace pd::metrics
