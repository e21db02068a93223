#include "connector/config.h"

#include <gtest/gtest.h>

namespace pd::connector {
namespace {

TEST(KvTransferConfig, ParsesTheVllmSpelling) {
  auto config = parse_kv_transfer_config(R"({"kv_connector":"PdConnector","kv_role":"kv_consumer",
    "kv_connector_extra_config":{"read_mode":true,"backend":"ucx","handshake_port":7001,"proxy_ip":"127.0.0.1",
    "proxy_ping_port":7100,"http_port":8001,"transfer_timeout":2.5,"defer_timeout":60,"recv_abort_timeout":120,
    "handshake_timeout":5,"on_failure":"fail","control_secret_file":"/tmp/s","allowed_peers":["10.0.0.0/8","127.0.0.1:9000"]}})");
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  EXPECT_EQ(config->role, KvRole::kConsumer);
  EXPECT_TRUE(config->read_mode);
  EXPECT_EQ(config->backend, TransferBackend::kUcx);
  EXPECT_EQ(config->handshake_port, 7001);
  EXPECT_EQ(config->proxy_ping_port, 7100);
  EXPECT_EQ(config->http_port, 8001);
  EXPECT_EQ(config->transfer_timeout_ms, 2500);
  EXPECT_EQ(config->defer_timeout_ms, 60'000);
  EXPECT_EQ(config->recv_abort_timeout_ms, 120'000);
  EXPECT_EQ(config->handshake_timeout_ms, 5'000);
  EXPECT_EQ(config->on_failure, FailurePolicy::kFail);
  EXPECT_EQ(config->control_secret_file, "/tmp/s");
  EXPECT_TRUE(config->registers_with_router());
  EXPECT_TRUE(config->is_consumer());
  EXPECT_FALSE(config->is_producer());
}

TEST(KvTransferConfig, DefaultsMatchTheDesign) {
  auto config = parse_kv_transfer_config(R"({"kv_connector":"PdConnector","kv_role":"kv_producer"})");
  ASSERT_TRUE(config.ok());
  EXPECT_FALSE(config->read_mode);
  EXPECT_EQ(config->backend, TransferBackend::kAuto);
  EXPECT_EQ(config->transfer_timeout_ms, 30'000);
  EXPECT_EQ(config->defer_timeout_ms, 60'000);
  EXPECT_EQ(config->recv_abort_timeout_ms, 120'000);
  EXPECT_EQ(config->handshake_timeout_ms, 5'000);
  EXPECT_EQ(config->on_failure, FailurePolicy::kRecompute);
  EXPECT_FALSE(config->registers_with_router());
}

TEST(KvTransferConfig, RefusesWhatItCannotMeanWithTheKeyNamed) {
  struct Case {
    const char* json;
    const char* expected_fragment;
  };
  const Case cases[] = {
      {"not json", "not valid JSON"},
      {"[]", "expected a JSON object"},
      {R"({"kv_connector":"NixlConnector","kv_role":"kv_both"})", "PdConnector"},
      {R"({"kv_connector":"PdConnector","kv_role":"kv_prefill"})", "kv_prefill"},
      {R"({"kv_connector":"PdConnector","kv_role":"kv_both","bogus":1})", "unknown key 'bogus'"},
      {R"({"kv_connector":"PdConnector","kv_role":"kv_both","kv_connector_extra_config":{"transfer_timout":3}})",
       "unknown key 'transfer_timout'"},
      {R"({"kv_connector":"PdConnector","kv_role":"kv_both","kv_connector_extra_config":{"transfer_timeout":0}})",
       "transfer_timeout"},
      {R"({"kv_connector":"PdConnector","kv_role":"kv_both","kv_connector_extra_config":{"transfer_timeout":"30"}})",
       "expected a number"},
      {R"({"kv_connector":"PdConnector","kv_role":"kv_both","kv_connector_extra_config":{"handshake_port":70000}})",
       "handshake_port"},
      {R"({"kv_connector":"PdConnector","kv_role":"kv_both","kv_connector_extra_config":{"backend":"rdma"}})",
       "backend"},
      {R"({"kv_connector":"PdConnector","kv_role":"kv_both","kv_connector_extra_config":{"on_failure":"retry"}})",
       "on_failure"},
      {R"({"kv_connector":"PdConnector","kv_role":"kv_both","kv_connector_extra_config":{"read_mode":"yes"}})",
       "read_mode"},
      {R"({"kv_connector":"PdConnector","kv_role":"kv_both","kv_connector_extra_config":{"proxy_ip":"127.0.0.1"}})",
       "proxy_ping_port"},
      {R"({"kv_connector":"PdConnector","kv_role":"kv_both","kv_connector_extra_config":{"allowed_peers":["evil.example"]}})",
       "allowed_peers"},
      {R"({"kv_connector":"PdConnector","kv_role":"kv_both","kv_connector_extra_config":{"allowed_peers":["10.0.0.0/40"]}})",
       "allowed_peers"},
  };
  for (const auto& c : cases) {
    auto config = parse_kv_transfer_config(c.json);
    ASSERT_FALSE(config.ok()) << c.json;
    EXPECT_EQ(config.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(config.status().message().find(c.expected_fragment), std::string::npos)
        << c.json << " -> " << config.status().message();
  }
}

TEST(KvTransferConfig, AControlPlaneBeyondLoopbackNeedsASecretOrAnExplicitOptOut) {
  auto with = [](const char* extra) {
    return parse_kv_transfer_config(fmt::format(
        R"({{"kv_connector":"PdConnector","kv_role":"kv_producer","kv_ip":"10.1.2.3","kv_connector_extra_config":{{{}}}}})",
        extra));
  };
  auto open = with("");
  ASSERT_FALSE(open.ok());
  EXPECT_NE(open.status().message().find("control_secret_file"), std::string::npos) << open.status().message();
  EXPECT_FALSE(
      parse_kv_transfer_config(R"({"kv_connector":"PdConnector","kv_role":"kv_producer","kv_ip":"10.1.2.3"})").ok())
      << "no extra config at all is the same";
  EXPECT_TRUE(with(R"("control_secret_file":"/run/pd/secret")").ok());
  auto opted_out = with(R"("allow_unauthenticated_control":true)");
  ASSERT_TRUE(opted_out.ok());
  EXPECT_TRUE(opted_out->allow_unauthenticated_control);
  EXPECT_TRUE(
      parse_kv_transfer_config(R"({"kv_connector":"PdConnector","kv_role":"kv_producer","kv_ip":"127.0.0.2"})").ok())
      << "loopback needs neither";
}

TEST(PeerPolicy, LoopbackOnlyWhenNoListIsGiven) {
  EXPECT_TRUE(peer_allowed({}, "127.0.0.1:5000"));
  EXPECT_TRUE(peer_allowed({}, "127.3.2.1:5000"));
  EXPECT_FALSE(peer_allowed({}, "10.0.0.1:5000"));
}

TEST(PeerPolicy, NamesAreNeverResolvedAndNeverAllowed) {
  EXPECT_FALSE(peer_allowed({"10.0.0.0/8"}, "localhost:5000"));
  EXPECT_FALSE(peer_allowed({"10.0.0.0/8"}, "evil.example:5000"));
  EXPECT_FALSE(peer_allowed({"10.0.0.0/8"}, "10.0.0.1"));  // no port
  EXPECT_FALSE(peer_allowed({"10.0.0.0/8"}, "10.0.0.1:0"));
}

TEST(PeerPolicy, MatchesHostsSubnetsAndExactAddresses) {
  const std::vector<std::string> allowed = {"10.1.0.0/16", "192.168.5.5", "172.16.0.1:7000"};
  EXPECT_TRUE(peer_allowed(allowed, "10.1.200.3:1"));
  EXPECT_FALSE(peer_allowed(allowed, "10.2.0.3:1"));
  EXPECT_TRUE(peer_allowed(allowed, "192.168.5.5:9999"));
  EXPECT_TRUE(peer_allowed(allowed, "172.16.0.1:7000"));
  EXPECT_FALSE(peer_allowed(allowed, "172.16.0.1:7001"));
  EXPECT_FALSE(peer_allowed(allowed, "127.0.0.1:7000"));
}

}  // namespace
}  // namespace pd::connector

namespace pd::connector {
namespace {

TEST(KvTransferConfigFromFlags, ARoleFlagAloneGivesDefaults) {
  auto config = kv_transfer_config_from_flags("", "producer");
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  EXPECT_EQ(config->role, KvRole::kProducer);
  EXPECT_FALSE(config->read_mode);
}

TEST(KvTransferConfigFromFlags, TheFlagAndTheJsonMustAgree) {
  EXPECT_TRUE(kv_transfer_config_from_flags(R"({"kv_role":"kv_consumer"})", "consumer").ok());
  EXPECT_FALSE(kv_transfer_config_from_flags(R"({"kv_role":"kv_consumer"})", "kv_producer").ok());
  EXPECT_FALSE(kv_transfer_config_from_flags("", "").ok()) << "no role at all";
}

}  // namespace
}  // namespace pd::connector
