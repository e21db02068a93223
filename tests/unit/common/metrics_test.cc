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

TEST(Metrics, OneTwoFiveBucketsStopAtTheMaximum) {
  EXPECT_EQ(one_two_five_buckets(100), (std::vector<double>{1, 2, 5, 10, 20, 50, 100}));
  EXPECT_EQ(one_two_five_buckets(4096), (std::vector<double>{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000}));
  EXPECT_EQ(one_two_five_buckets(1), (std::vector<double>{1}));
}

TEST(Metrics, ColonNamesAndLabelledHistogramsRenderAsPrometheusText) {
  Registry registry;
  registry.histogram("vllm:x_seconds", "h", {{"model_name", "m"}}, {0.5, 1.0}).observe(0.7);
  registry.counter("vllm:y_total", "c", {{"model_name", "m"}, {"finished_reason", "stop"}}).inc();
  const std::string text = registry.render_prometheus();
  EXPECT_NE(text.find("# TYPE vllm:x_seconds histogram\n"), std::string::npos) << text;
  EXPECT_NE(text.find("vllm:x_seconds_bucket{model_name=\"m\",le=\"0.5\"} 0\n"), std::string::npos) << text;
  EXPECT_NE(text.find("vllm:x_seconds_bucket{model_name=\"m\",le=\"1\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("vllm:x_seconds_count{model_name=\"m\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("vllm:y_total{model_name=\"m\",finished_reason=\"stop\"} 1\n"), std::string::npos) << text;
}

TEST(Metrics, LabelValuesAreEscaped) {
  EXPECT_EQ(render_labels({{"a", "x\"y\\z"}}), "a=\"x\\\"y\\\\z\"");
}

}  // namespace
}  // namespace pd::metrics
