#include "contract/transfer_params.h"

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace pd::contract {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;

constexpr const char* kId = "0123456789abcdef0123456789abcdef";

EngineContext context_for(Role role, int32_t num_prompt_tokens = 33, int32_t block_size = 16) {
  EngineContext context;
  context.role = role;
  context.num_prompt_tokens = num_prompt_tokens;
  context.block_size = block_size;
  return context;
}

// What the receiving engine sees: the text the router wrote, parsed again.
json over_http(const ordered_json& params) {
  return json::parse(params.dump());
}

ProducerLocation producer_p0() {
  return ProducerLocation{"p0", "127.0.0.1:7000", 42};
}

ProducerAnswer read_answer() {
  ProducerAnswer answer;
  answer.transfer_id = kId;
  answer.producer = producer_p0();
  answer.mode = TransferMode::kRead;
  answer.num_tokens = 33;
  answer.block_ids = std::vector<int32_t>{4, 5, 6};
  return answer;
}

json write_consumer_params() {
  return over_http(encode_write_consumer_leg(WriteConsumerLeg{kId, producer_p0()}));
}

json read_consumer_params() {
  auto params = make_read_consumer_params(ordered_json::parse(encode_producer_answer(read_answer()).dump()), kId, "p0");
  EXPECT_TRUE(params.ok()) << params.status().to_string();
  return over_http(*params);
}

// ---- transfer ids -----------------------------------------------------------------------

TEST(TransferId, TheRouterMints32LowercaseHexDigits) {
  const std::string id = format_transfer_id(0xfedcba9876543210ull, 1);
  EXPECT_EQ(id, "fedcba98765432100000000000000001");
  EXPECT_TRUE(is_minted_transfer_id(id));
  EXPECT_TRUE(is_transfer_id(id));
  EXPECT_EQ(format_transfer_id(0, 0), std::string(32, '0'));
}

TEST(TransferId, EnginesAlsoAcceptUppercaseButTheRouterNeverMintsIt) {
  EXPECT_TRUE(is_transfer_id("FEDCBA98765432100000000000000001"));
  EXPECT_FALSE(is_minted_transfer_id("FEDCBA98765432100000000000000001"));
  for (const char* bad : {"", "abc", "0123456789abcdef0123456789abcde", "0123456789abcdef0123456789abcdef0",
                          "0123456789abcdef0123456789abcdeg", "0123456789abcdef 123456789abcdef"}) {
    EXPECT_FALSE(is_transfer_id(bad)) << bad;
    EXPECT_FALSE(is_minted_transfer_id(bad)) << bad;
  }
}

// ---- the router's and the producer's encoders ----------------------------------------------

TEST(ProducerLeg, EncodesTheThreeRouterKeysInOrder) {
  EXPECT_EQ(encode_producer_leg(ProducerLeg{kId, TransferMode::kRead}).dump(),
            std::string(R"({"transfer_id":")") + kId + R"(","do_remote_decode":true,"mode":"read"})");
  EXPECT_EQ(encode_producer_leg(ProducerLeg{kId, TransferMode::kWrite})["mode"], "write");
}

TEST(ProducerLeg, RoundTripsThroughTheProducersParser) {
  for (TransferMode mode : {TransferMode::kRead, TransferMode::kWrite}) {
    auto parsed =
        parse_transfer_params(over_http(encode_producer_leg(ProducerLeg{kId, mode})), context_for(Role::kProducer));
    ASSERT_TRUE(parsed.ok()) << parsed.status().to_string();
    TransferParams expected;
    expected.side = TransferSide::kProducer;
    expected.read_mode = mode == TransferMode::kRead;
    expected.transfer_id = kId;
    EXPECT_EQ(*parsed, expected);
  }
}

TEST(WriteConsumerLeg, EncodesTheRouterKeysInOrder) {
  EXPECT_EQ(encode_write_consumer_leg(WriteConsumerLeg{kId, producer_p0()}).dump(),
            std::string(R"({"transfer_id":")") + kId +
                R"(","do_remote_prefill":true,"mode":"write","remote_instance_id":"p0",)"
                R"("remote_control":"127.0.0.1:7000","remote_boot_nonce":42})");
}

TEST(WriteConsumerLeg, RoundTripsThroughTheConsumersParser) {
  auto parsed = parse_transfer_params(write_consumer_params(), context_for(Role::kConsumer));
  ASSERT_TRUE(parsed.ok()) << parsed.status().to_string();
  TransferParams expected;
  expected.side = TransferSide::kConsumer;
  expected.read_mode = false;
  expected.transfer_id = kId;
  expected.remote_instance_id = "p0";
  expected.remote_control = "127.0.0.1:7000";
  expected.remote_boot_nonce = 42;
  EXPECT_EQ(*parsed, expected);
}

TEST(ProducerAnswer, SerialisesWithSortedKeysAndBlockIdsOnlyWhenHeld) {
  EXPECT_EQ(encode_producer_answer(read_answer()).dump(),
            std::string(R"({"block_ids":[4,5,6],"mode":"read","num_tokens":33,"remote_boot_nonce":42,)") +
                R"("remote_control":"127.0.0.1:7000","remote_instance_id":"p0","transfer_id":")" + kId + R"("})");
  ProducerAnswer released = read_answer();
  released.block_ids.reset();
  EXPECT_FALSE(encode_producer_answer(released).contains("block_ids"));
}

TEST(ProducerAnswer, BecomesAReadConsumerLegTheConsumerAcceptsFieldForField) {
  auto parsed = parse_transfer_params(read_consumer_params(), context_for(Role::kConsumer));
  ASSERT_TRUE(parsed.ok()) << parsed.status().to_string();
  const ProducerAnswer answer = read_answer();
  EXPECT_EQ(parsed->side, TransferSide::kConsumer);
  EXPECT_TRUE(parsed->read_mode);
  EXPECT_EQ(parsed->transfer_id, answer.transfer_id);
  EXPECT_EQ(parsed->remote_instance_id, answer.producer.instance_id);
  EXPECT_EQ(parsed->remote_control, answer.producer.control);
  EXPECT_EQ(parsed->remote_boot_nonce, answer.producer.boot_nonce);
  EXPECT_EQ(parsed->num_tokens, answer.num_tokens);
  EXPECT_EQ(parsed->remote_block_ids, *answer.block_ids);
}

TEST(ReadConsumerParams, KeepTheProducersKeyOrderAndUnknownKeys) {
  auto params = make_read_consumer_params(
      ordered_json::parse(std::string(R"({"transfer_id":")") + kId +
                          R"(","do_remote_decode":true,"remote_instance_id":"p0","x_extra":[1],)"
                          R"("remote_control":"127.0.0.1:7000","remote_boot_nonce":42,"mode":"write",)"
                          R"("block_ids":[4,5,6],"num_tokens":33})"),
      kId, "");
  ASSERT_TRUE(params.ok()) << params.status().to_string();
  EXPECT_EQ(params->dump(), std::string(R"({"transfer_id":")") + kId +
                                R"(","remote_instance_id":"p0","x_extra":[1],"remote_control":"127.0.0.1:7000",)"
                                R"("remote_boot_nonce":42,"mode":"read","block_ids":[4,5,6],"num_tokens":33,)"
                                R"("do_remote_prefill":true})");
}

TEST(ReadConsumerParams, RefuseAnotherTransferOrAnotherProducer) {
  const ordered_json answer = ordered_json::parse(encode_producer_answer(read_answer()).dump());
  auto other_id = make_read_consumer_params(answer, "ffffffffffffffffffffffffffffffff", "");
  ASSERT_FALSE(other_id.ok());
  EXPECT_NE(other_id.status().message().find("transfer_id"), std::string::npos);
  auto other_producer = make_read_consumer_params(answer, kId, "p1");
  ASSERT_FALSE(other_producer.ok());
  EXPECT_NE(other_producer.status().message().find("not the chosen producer 'p1'"), std::string::npos);
  EXPECT_TRUE(make_read_consumer_params(answer, kId, "p0").ok());
  EXPECT_FALSE(check_producer_answer(ordered_json::array(), kId, "").ok());
}

TEST(ReadConsumerParams, RefuseAnAnswerMissingAnyRoutedFieldNamingIt) {
  const ordered_json answer = ordered_json::parse(encode_producer_answer(read_answer()).dump());
  for (const char* key : {"remote_instance_id", "remote_control", "remote_boot_nonce", "block_ids", "num_tokens"}) {
    ordered_json missing = answer;
    missing.erase(key);
    Status status = check_producer_answer(missing, kId, "");
    ASSERT_FALSE(status.ok()) << key;
    EXPECT_EQ(status.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(status.message().find(std::string("kv_transfer_params.") + key), std::string::npos) << status.message();
    ordered_json wrong_type = answer;
    wrong_type[key] = key == std::string("remote_instance_id") || key == std::string("remote_control")
                          ? ordered_json(7)
                          : ordered_json(-1);
    EXPECT_FALSE(check_producer_answer(wrong_type, kId, "").ok()) << key;
  }
}

// ---- what engines accept ----------------------------------------------------------------

TEST(ParseTransferParams, AnAbsentModeIsTheInstancesDefault) {
  json params = write_consumer_params();
  params.erase("mode");
  EngineContext context = context_for(Role::kConsumer);
  auto parsed = parse_transfer_params(params, context);
  ASSERT_TRUE(parsed.ok()) << parsed.status().to_string();
  EXPECT_FALSE(parsed->read_mode);
  context.default_mode = TransferMode::kRead;
  params["mode"] = nullptr;
  params["num_tokens"] = 33;
  params["block_ids"] = {1, 2, 3};
  parsed = parse_transfer_params(params, context);
  ASSERT_TRUE(parsed.ok()) << parsed.status().to_string();
  EXPECT_TRUE(parsed->read_mode);
}

TEST(ParseTransferParams, EachSideGoesOnlyToAnInstanceThatTakesIt) {
  const json producer_leg = over_http(encode_producer_leg(ProducerLeg{kId, TransferMode::kWrite}));
  EXPECT_TRUE(parse_transfer_params(producer_leg, context_for(Role::kProducer)).ok());
  EXPECT_TRUE(parse_transfer_params(producer_leg, context_for(Role::kBoth)).ok());
  auto refused = parse_transfer_params(producer_leg, context_for(Role::kConsumer));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("do_remote_decode sent to a consumer instance"), std::string::npos);
  EXPECT_TRUE(parse_transfer_params(write_consumer_params(), context_for(Role::kConsumer)).ok());
  EXPECT_TRUE(parse_transfer_params(write_consumer_params(), context_for(Role::kBoth)).ok());
  refused = parse_transfer_params(write_consumer_params(), context_for(Role::kProducer));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("do_remote_prefill sent to a producer instance"), std::string::npos);
}

TEST(ParseTransferParams, TheConsumerAsksThePeerPolicyAboutRemoteControl) {
  EngineContext context = context_for(Role::kConsumer);
  std::vector<std::string> asked;
  context.peer_allowed = [&asked](std::string_view host_port) {
    asked.emplace_back(host_port);
    return host_port == "127.0.0.1:7000";
  };
  EXPECT_TRUE(parse_transfer_params(write_consumer_params(), context).ok());
  json params = write_consumer_params();
  params["remote_control"] = "203.0.113.9:7000";
  auto refused = parse_transfer_params(params, context);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("remote_control 203.0.113.9:7000 is not an allowed peer"),
            std::string::npos);
  EXPECT_EQ(asked, (std::vector<std::string>{"127.0.0.1:7000", "203.0.113.9:7000"}));
  params["remote_control"] = "127.0.0.1";  // syntax is checked before the policy is asked
  EXPECT_FALSE(parse_transfer_params(params, context).ok());
  EXPECT_EQ(asked.size(), 2u);
}

// One malformed field each; the error must name it.
TEST(ParseTransferParams, EveryMalformedFieldIsAnInvalidArgumentNamingIt) {
  using Mutation = std::function<void(json&)>;
  const std::vector<std::tuple<const char*, Mutation, const char*>> cases = {
      {"not an object", [](json& p) { p = json::array(); }, "kv_transfer_params must be an object"},
      {"33 keys",
       [](json& p) {
         for (int i = 0; i < 27; ++i) p["x" + std::to_string(i)] = i;
       },
       "limit 32"},
      {"neither side", [](json& p) { p.erase("do_remote_prefill"); }, "exactly one of"},
      {"both sides", [](json& p) { p["do_remote_decode"] = true; }, "exactly one of"},
      {"side not a bool", [](json& p) { p["do_remote_prefill"] = "true"; }, "do_remote_prefill must be a boolean"},
      {"no transfer id", [](json& p) { p.erase("transfer_id"); }, "transfer_id must be a string"},
      {"numeric transfer id", [](json& p) { p["transfer_id"] = 5; }, "transfer_id must be a string"},
      {"short transfer id", [](json& p) { p["transfer_id"] = "short"; }, "transfer_id must be 32 hex digits"},
      {"long transfer id", [](json& p) { p["transfer_id"] = std::string(33, 'a'); }, "transfer_id must be 1..32"},
      {"unknown mode", [](json& p) { p["mode"] = "push"; }, "mode must be"},
      {"numeric mode", [](json& p) { p["mode"] = 1; }, "mode must be"},
      {"no instance id", [](json& p) { p.erase("remote_instance_id"); }, "remote_instance_id must be a string"},
      {"empty instance id", [](json& p) { p["remote_instance_id"] = ""; }, "remote_instance_id must be 1..128"},
      {"long instance id", [](json& p) { p["remote_instance_id"] = std::string(129, 'p'); }, "remote_instance_id"},
      {"control without port", [](json& p) { p["remote_control"] = "127.0.0.1"; }, "remote_control"},
      {"control port 0", [](json& p) { p["remote_control"] = "127.0.0.1:0"; }, "remote_control"},
      {"long control", [](json& p) { p["remote_control"] = std::string(60, '1') + ":7000"; }, "remote_control"},
      {"negative nonce", [](json& p) { p["remote_boot_nonce"] = -1; }, "remote_boot_nonce"},
      {"string nonce", [](json& p) { p["remote_boot_nonce"] = "42"; }, "remote_boot_nonce"},
      {"no nonce", [](json& p) { p.erase("remote_boot_nonce"); }, "remote_boot_nonce"},
  };
  for (const auto& [what, mutate, needle] : cases) {
    json params = write_consumer_params();
    mutate(params);
    auto parsed = parse_transfer_params(params, context_for(Role::kConsumer));
    ASSERT_FALSE(parsed.ok()) << what;
    EXPECT_EQ(parsed.status().code(), ErrorCode::kInvalidArgument) << what;
    EXPECT_NE(parsed.status().message().find(needle), std::string::npos) << what << ": " << parsed.status().message();
  }
}

TEST(ParseTransferParams, AReadConsumerChecksTokensAndBlocksAgainstItsPrompt) {
  using Mutation = std::function<void(json&)>;
  const std::vector<std::tuple<const char*, Mutation, const char*>> cases = {
      {"no num_tokens", [](json& p) { p.erase("num_tokens"); }, "num_tokens must be an integer"},
      {"float num_tokens", [](json& p) { p["num_tokens"] = 33.0; }, "num_tokens must be an integer"},
      {"another prompt", [](json& p) { p["num_tokens"] = 34; }, "num_tokens is 34 but the prompt has 33"},
      {"huge num_tokens", [](json& p) { p["num_tokens"] = UINT64_MAX; },
       "num_tokens is 18446744073709551615 but the prompt has 33"},
      {"no block ids", [](json& p) { p.erase("block_ids"); }, "block_ids must be an array"},
      {"too few ids",
       [](json& p) {
         p["block_ids"] = {4, 5};
       },
       "block_ids has 2 ids, 33 tokens need 3"},
      {"too many ids",
       [](json& p) {
         p["block_ids"] = {4, 5, 6, 7};
       },
       "block_ids has 4 ids"},
      {"negative id",
       [](json& p) {
         p["block_ids"] = {4, 5, -6};
       },
       "non-negative int32"},
      {"id above int32",
       [](json& p) {
         p["block_ids"] = {4, 5, 2147483648ll};
       },
       "non-negative int32"},
      {"string id",
       [](json& p) {
         p["block_ids"] = {4, 5, "6"};
       },
       "non-negative int32"},
  };
  ASSERT_TRUE(parse_transfer_params(read_consumer_params(), context_for(Role::kConsumer)).ok());
  for (const auto& [what, mutate, needle] : cases) {
    json params = read_consumer_params();
    mutate(params);
    auto parsed = parse_transfer_params(params, context_for(Role::kConsumer));
    ASSERT_FALSE(parsed.ok()) << what;
    EXPECT_EQ(parsed.status().code(), ErrorCode::kInvalidArgument) << what;
    EXPECT_NE(parsed.status().message().find(needle), std::string::npos) << what << ": " << parsed.status().message();
  }
}

TEST(ParseTransferParams, AWriteConsumerIgnoresReadOnlyFieldsAndUnknownKeys) {
  json params = write_consumer_params();
  params["num_tokens"] = "anything";
  params["block_ids"] = 7;
  params["future_field"] = {{"x", 1}};
  EXPECT_TRUE(parse_transfer_params(params, context_for(Role::kConsumer)).ok());
}

TEST(ParseTransferParams, BlockCountFollowsTheBlockSize) {
  json params = read_consumer_params();  // 33 tokens, 3 ids: right for 16-token blocks
  EXPECT_FALSE(parse_transfer_params(params, context_for(Role::kConsumer, 33, 32)).ok());  // needs 2
  params["block_ids"] = {4, 5};
  EXPECT_TRUE(parse_transfer_params(params, context_for(Role::kConsumer, 33, 32)).ok());
  EXPECT_EQ(blocks_for_tokens(32, 16), 2);
  EXPECT_EQ(blocks_for_tokens(33, 16), 3);
  EXPECT_EQ(blocks_for_tokens(1, 16), 1);
}

}  // namespace
}  // namespace pd::contract
