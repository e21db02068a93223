#include "server/kv_params.h"

#include <gtest/gtest.h>

#include <string>

#include "contract/transfer_params.h"

namespace pd::server {
namespace {

using ojson = nlohmann::ordered_json;

// The parser a P/D consumer in WRITE mode hands the server: the contract's checks with this
// instance's role and block size, and the request's prompt.
KvParamsParser consumer_parser() {
  return [](const nlohmann::json& params, int32_t num_prompt_tokens) {
    contract::EngineContext context;
    context.role = contract::Role::kConsumer;
    context.num_prompt_tokens = num_prompt_tokens;
    context.block_size = 16;
    return contract::parse_transfer_params(params, context);
  };
}

// As the protocol parser holds a client's object: parsed from the request's text.
ojson write_consumer_params() {
  return ojson::parse(R"({"transfer_id": ")" + std::string(32, 'a') +
                      R"(", "do_remote_prefill": true, "mode": "write", "remote_instance_id": "producer-1",)"
                      R"( "remote_control": "127.0.0.1:7001", "remote_boot_nonce": 42})");
}

const ApiError& error_of(const Parsed<std::optional<contract::TransferParams>>& parsed) {
  return std::get<ApiError>(parsed);
}

TEST(KvParamsAtTheEdge, ValidParamsBecomeTheTypedParamsTheEngineCarries) {
  auto parsed = parse_kv_params(write_consumer_params(), 20, consumer_parser());
  ASSERT_FALSE(failed(parsed)) << error_of(parsed).message;
  const std::optional<contract::TransferParams>& params = std::get<0>(parsed);
  ASSERT_TRUE(params.has_value());
  EXPECT_EQ(params->side, contract::TransferSide::kConsumer);
  EXPECT_EQ(params->transfer_id, std::string(32, 'a'));
  EXPECT_EQ(params->remote_instance_id, "producer-1");
  EXPECT_EQ(params->remote_control, "127.0.0.1:7001");
  EXPECT_EQ(params->remote_boot_nonce, 42u);
  EXPECT_FALSE(params->read_mode);
}

TEST(KvParamsAtTheEdge, ARequestWithoutParamsCarriesNone) {
  auto parsed = parse_kv_params(std::nullopt, 20, consumer_parser());
  ASSERT_FALSE(failed(parsed));
  EXPECT_FALSE(std::get<0>(parsed).has_value());
}

TEST(KvParamsAtTheEdge, AnInstanceWithoutAConnectorIgnoresThem) {
  ojson garbage = {{"anything", 1}};
  auto parsed = parse_kv_params(garbage, 20, KvParamsParser());
  ASSERT_FALSE(failed(parsed));
  EXPECT_FALSE(std::get<0>(parsed).has_value());
}

TEST(KvParamsAtTheEdge, EachRefusalIsA400NamingKvTransferParamsWithTheFieldInItsMessage) {
  struct Case {
    const char* what;
    ojson params;
    int32_t num_prompt_tokens;
    const char* needle;
  };
  ojson no_id = write_consumer_params();
  no_id.erase("transfer_id");
  ojson short_id = write_consumer_params();
  short_id["transfer_id"] = "abc";
  ojson producer_side = write_consumer_params();
  producer_side.erase("do_remote_prefill");
  producer_side["do_remote_decode"] = true;
  ojson bad_control = write_consumer_params();
  bad_control["remote_control"] = "no-port";
  ojson read_wrong_length = write_consumer_params();
  read_wrong_length["mode"] = "read";
  read_wrong_length["num_tokens"] = 21u;
  read_wrong_length["block_ids"] = {1u, 2u};
  const Case cases[] = {
      {"no transfer_id", no_id, 20, "transfer_id"},
      {"short transfer_id", short_id, 20, "transfer_id must be 32 hex digits"},
      {"the side this consumer does not take", producer_side, 20, "do_remote_decode"},
      {"remote_control without a port", bad_control, 20, "remote_control"},
      {"a READ transfer of another prompt", read_wrong_length, 20, "num_tokens is 21 but the prompt has 20"},
  };
  for (const Case& c : cases) {
    auto parsed = parse_kv_params(c.params, c.num_prompt_tokens, consumer_parser());
    ASSERT_TRUE(failed(parsed)) << c.what;
    const ApiError& error = error_of(parsed);
    EXPECT_EQ(error.http_status, 400) << c.what;
    EXPECT_EQ(error.type, "invalid_request_error") << c.what;
    EXPECT_EQ(error.param, "kv_transfer_params") << c.what;
    EXPECT_NE(error.message.find(c.needle), std::string::npos) << c.what << ": " << error.message;
  }
}

TEST(KvParamsAtTheEdge, AProducersAnswerIsWrittenWithTheContractsKeys) {
  contract::ProducerAnswer answer;
  answer.transfer_id = std::string(32, 'b');
  answer.producer = contract::ProducerLocation{"producer-1", "127.0.0.1:7001", 7};
  answer.mode = contract::TransferMode::kRead;
  answer.num_tokens = 20;
  answer.block_ids = std::vector<int32_t>{3, 4};
  const ResponseJson written = kv_params_json(answer);
  EXPECT_EQ(written.dump(), R"({"block_ids":[3,4],"mode":"read","num_tokens":20,"remote_boot_nonce":7,)"
                            R"("remote_control":"127.0.0.1:7001","remote_instance_id":"producer-1","transfer_id":")" +
                                std::string(32, 'b') + "\"}");
}

}  // namespace
}  // namespace pd::server
