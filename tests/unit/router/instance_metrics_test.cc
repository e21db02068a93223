#include "router/instance_metrics.h"

#include <gtest/gtest.h>

namespace pd::router {
namespace {

bool has(const std::string& text, const std::string& line) {
  return text.find(line) != std::string::npos;
}

TEST(InstanceMetrics, AnInstancesSeriesLiveFromItsAdmissionToItsDeparture) {
  InstanceMetrics m;
  m.admit("p0", "producer");
  m.set_outstanding("p0", 2);
  m.observe_leg_latency("p0", "prefill", 0.2);
  m.count_leg_failure("p0", "prefill", "deadline");
  m.count_leg_failure("p0", "prefill", "deadline");
  std::string text = m.render_prometheus();
  EXPECT_TRUE(has(text, "pd_router_instance_outstanding{instance=\"p0\",role=\"producer\"} 2\n"));
  EXPECT_TRUE(has(text, "pd_router_leg_latency_seconds_bucket{instance=\"p0\",leg=\"prefill\",le=\"0.25\"} 1\n"));
  EXPECT_TRUE(has(text, "pd_router_leg_latency_seconds_count{instance=\"p0\",leg=\"prefill\"} 1\n"));
  EXPECT_TRUE(
      has(text, "pd_router_instance_leg_failures_total{instance=\"p0\",leg=\"prefill\",reason=\"deadline\"} 2\n"));

  m.remove("p0");
  text = m.render_prometheus();
  EXPECT_FALSE(has(text, "p0"));
  EXPECT_EQ(m.num_instances(), 0u);
  // A leg that ends after its instance left brings nothing back.
  m.observe_leg_latency("p0", "prefill", 0.1);
  m.count_leg_failure("p0", "prefill", "transport");
  m.set_outstanding("p0", 0);
  EXPECT_FALSE(has(m.render_prometheus(), "p0"));
  // Admitted again: its series start afresh.
  m.admit("p0", "producer");
  text = m.render_prometheus();
  EXPECT_TRUE(has(text, "pd_router_instance_outstanding{instance=\"p0\",role=\"producer\"} 0\n"));
  EXPECT_FALSE(has(text, "pd_router_instance_leg_failures_total{instance=\"p0\""));
}

TEST(InstanceMetrics, EachFamilyIsDeclaredOnceWhateverTheInstances) {
  InstanceMetrics m;
  m.admit("a", "consumer");
  m.admit("b", "both");
  const std::string text = m.render_prometheus();
  size_t count = 0;
  for (size_t at = text.find("# TYPE pd_router_instance_outstanding gauge"); at != std::string::npos;
       at = text.find("# TYPE pd_router_instance_outstanding gauge", at + 1)) {
    ++count;
  }
  EXPECT_EQ(count, 1u);
  EXPECT_TRUE(has(text, "pd_router_instance_outstanding{instance=\"b\",role=\"both\"} 0\n"));
}

}  // namespace
}  // namespace pd::router
