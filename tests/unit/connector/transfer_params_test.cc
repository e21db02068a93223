#include "connector/transfer_params.h"

#include <gtest/gtest.h>

namespace pd::connector {
namespace {

using nlohmann::json;

const char* kId = "0123456789abcdef0123456789abcdef";

KvTransferConfig config_for(KvRole role) {
  KvTransferConfig config;
  config.role = role;
  return config;
}

json consumer_params() {
  return json{{"transfer_id", kId},         {"do_remote_prefill", true},          {"mode", "write"},
              {"remote_instance_id", "p0"}, {"remote_control", "127.0.0.1:7000"}, {"remote_boot_nonce", 42u}};
}

TEST(TransferParams, ProducerLegParses) {
  auto p = parse_transfer_params(json{{"transfer_id", kId}, {"do_remote_decode", true}, {"mode", "read"}},
                                 config_for(KvRole::kProducer), 10, 16);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->side, TransferSide::kProducer);
  EXPECT_TRUE(p->read_mode);
  EXPECT_EQ(p->transfer_id, kId);
}

TEST(TransferParams, ConsumerWriteLegParses) {
  auto p = parse_transfer_params(consumer_params(), config_for(KvRole::kConsumer), 10, 16);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->side, TransferSide::kConsumer);
  EXPECT_FALSE(p->read_mode);
  EXPECT_EQ(p->remote_control, "127.0.0.1:7000");
  EXPECT_EQ(p->remote_boot_nonce, 42u);
}

TEST(TransferParams, ConsumerReadLegChecksBlockCountAgainstThePrompt) {
  auto params = consumer_params();
  params["mode"] = "read";
  params["num_tokens"] = 33;
  params["block_ids"] = {4, 5, 6};
  auto p = parse_transfer_params(params, config_for(KvRole::kConsumer), 33, 16);
  ASSERT_TRUE(p.ok()) << p.status().to_string();
  EXPECT_EQ(p->remote_block_ids, (std::vector<int32_t>{4, 5, 6}));
  params["block_ids"] = {4, 5};
  EXPECT_FALSE(parse_transfer_params(params, config_for(KvRole::kConsumer), 33, 16).ok());
  params["block_ids"] = {4, 5, -6};
  EXPECT_FALSE(parse_transfer_params(params, config_for(KvRole::kConsumer), 33, 16).ok());
  params["block_ids"] = {4, 5, 6};
  EXPECT_FALSE(parse_transfer_params(params, config_for(KvRole::kConsumer), 34, 16).ok());  // other prompt
}

TEST(TransferParams, MalformedParamsAreInvalidArgument) {
  const auto consumer = config_for(KvRole::kConsumer);
  std::vector<json> bad;
  bad.push_back(json::array());
  bad.push_back(json{{"transfer_id", kId}});  // neither side
  bad.push_back(json{{"transfer_id", kId}, {"do_remote_prefill", true}, {"do_remote_decode", true}});
  auto p = consumer_params();
  p["transfer_id"] = "short";
  bad.push_back(p);
  p = consumer_params();
  p["transfer_id"] = 5;
  bad.push_back(p);
  p = consumer_params();
  p["do_remote_prefill"] = "true";
  bad.push_back(p);
  p = consumer_params();
  p["remote_boot_nonce"] = -1;
  bad.push_back(p);
  p = consumer_params();
  p.erase("remote_instance_id");
  bad.push_back(p);
  p = consumer_params();
  p["mode"] = "push";
  bad.push_back(p);
  p = consumer_params();
  p["remote_control"] = "127.0.0.1";
  bad.push_back(p);
  for (const auto& params : bad) {
    auto parsed = parse_transfer_params(params, consumer, 10, 16);
    EXPECT_FALSE(parsed.ok()) << params.dump();
    EXPECT_EQ(parsed.status().code(), ErrorCode::kInvalidArgument) << params.dump();
  }
}

TEST(TransferParams, ARequestCannotPointTheConsumerAtAnAddressOutsideThePeerPolicy) {
  auto params = consumer_params();
  params["remote_control"] = "203.0.113.9:7000";
  auto parsed = parse_transfer_params(params, config_for(KvRole::kConsumer), 10, 16);
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("not an allowed peer"), std::string::npos);
  params["remote_control"] = "attacker.example:7000";
  EXPECT_FALSE(parse_transfer_params(params, config_for(KvRole::kConsumer), 10, 16).ok());
}

TEST(TransferParams, TheWrongRoleIsRefused) {
  EXPECT_FALSE(parse_transfer_params(consumer_params(), config_for(KvRole::kProducer), 10, 16).ok());
  EXPECT_FALSE(parse_transfer_params(json{{"transfer_id", kId}, {"do_remote_decode", true}},
                                     config_for(KvRole::kConsumer), 10, 16)
                   .ok());
  EXPECT_TRUE(parse_transfer_params(consumer_params(), config_for(KvRole::kBoth), 10, 16).ok());
}

}  // namespace
}  // namespace pd::connector
