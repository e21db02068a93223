#include "router/request_rewrite.h"

#include <gtest/gtest.h>

namespace pd::router {
namespace {

constexpr std::string_view kTransferId = "0123456789abcdef0123456789abcdef";

TEST(ParseClientRequest, DropsClientKvTransferParams) {
  auto request = parse_client_request(
      R"({"model":"m","prompt":"hi","stream":true,"kv_transfer_params":{"remote_control":"evil:1"}})");
  ASSERT_TRUE(request.ok());
  EXPECT_TRUE(request->dropped_kv_transfer_params);
  EXPECT_FALSE(request->body.contains("kv_transfer_params"));
  EXPECT_TRUE(request->stream);
  EXPECT_EQ(request->model, "m");
}

TEST(ParseClientRequest, RejectsWhatTheRouterCannotRoute) {
  EXPECT_FALSE(parse_client_request("{not json").ok());
  EXPECT_FALSE(parse_client_request("[1,2]").ok());
  EXPECT_FALSE(parse_client_request(R"({"stream":"yes"})").ok());
  EXPECT_FALSE(parse_client_request(R"({"model":5})").ok());
  auto plain = parse_client_request(R"({"prompt":"x","stream":null})");
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(plain->stream);
  EXPECT_FALSE(plain->dropped_kv_transfer_params);
}

// {"prompt":"a","x":[[...]]} nesting `depth` levels in all (the outer object is level 1).
std::string body_nested(size_t depth) {
  const size_t num_arrays = depth - 1;
  return R"({"prompt":"a","x":)" + std::string(num_arrays, '[') + std::string(num_arrays, ']') + "}";
}

TEST(ParseClientRequest, AcceptsNestingUpToPdservesLimit) {
  auto shallow = parse_client_request(body_nested(60));
  ASSERT_TRUE(shallow.ok()) << shallow.status().to_string();
  auto at_limit = parse_client_request(body_nested(kMaxJsonDepth));
  ASSERT_TRUE(at_limit.ok()) << at_limit.status().to_string();
  // The P/D path copies and re-serialises what was accepted.
  EXPECT_FALSE(make_producer_body(at_limit->body, kTransferId, TransferMode::kWrite).dump().empty());
}

TEST(ParseClientRequest, RefusesNestingBeyondPdservesLimit) {
  for (size_t depth : {kMaxJsonDepth + 1, size_t{100}}) {
    auto request = parse_client_request(body_nested(depth));
    ASSERT_FALSE(request.ok()) << "depth " << depth << " was accepted";
    EXPECT_EQ(request.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(request.status().message().find("deeper than 64"), std::string::npos) << request.status().message();
  }
}

TEST(ParseClientRequest, RefusesAHugelyNestedBodyWithoutRecursing) {
  // 400 KB of brackets: copying or dumping this as a value would overflow the stack.
  auto request = parse_client_request(body_nested(200'000));
  EXPECT_FALSE(request.ok());
}

TEST(JsonNestingDepth, IgnoresBracketsInsideStrings) {
  const std::string brackets(100, '[');
  EXPECT_EQ(json_nesting_depth(R"({"prompt":")" + brackets + R"("})"), 1u);
  EXPECT_EQ(json_nesting_depth(R"({"prompt":"\")" + brackets + R"("})"), 1u) << "an escaped quote ends nothing";
  EXPECT_EQ(json_nesting_depth(R"({"a":[{"b":[]}],"c":{}})"), 4u);
  EXPECT_EQ(json_nesting_depth("7"), 0u);
  EXPECT_TRUE(parse_client_request(R"({"prompt":")" + brackets + R"("})").ok());
}

TEST(TransferId, FormatsAs32LowercaseHex) {
  std::string id = format_transfer_id(0xfedcba9876543210ull, 1);
  EXPECT_EQ(id, "fedcba98765432100000000000000001");
  EXPECT_TRUE(is_transfer_id(id));
  EXPECT_FALSE(is_transfer_id("FEDCBA98765432100000000000000001"));
  EXPECT_FALSE(is_transfer_id("abc"));
}

TEST(ProducerBody, IsOneTokenNonStreamingWithRouterParams) {
  nlohmann::ordered_json body = {{"model", "m"},     {"prompt", "hi"},
                                 {"max_tokens", 50}, {"max_completion_tokens", 50},
                                 {"stream", true},   {"stream_options", {{"include_usage", true}}}};
  nlohmann::ordered_json leg = make_producer_body(body, kTransferId, TransferMode::kRead);
  EXPECT_EQ(leg["max_tokens"], 1);
  EXPECT_EQ(leg["max_completion_tokens"], 1);
  EXPECT_EQ(leg["stream"], false);
  EXPECT_FALSE(leg.contains("stream_options"));
  EXPECT_EQ(leg["kv_transfer_params"],
            (nlohmann::ordered_json{{"transfer_id", kTransferId}, {"do_remote_decode", true}, {"mode", "read"}}));
  EXPECT_EQ(leg["prompt"], "hi");
  EXPECT_EQ(body["max_tokens"], 50) << "the client's body is not modified";
}

TEST(ProducerBody, DoesNotInventMaxCompletionTokens) {
  nlohmann::ordered_json leg = make_producer_body({{"prompt", "x"}}, kTransferId, TransferMode::kWrite);
  EXPECT_FALSE(leg.contains("max_completion_tokens"));
  EXPECT_EQ(leg["kv_transfer_params"]["mode"], "write");
}

TEST(ProducerBody, ClampsMinTokensToOneSoTheOneTokenLegIsValid) {
  // pdserve refuses min_tokens > max_tokens; the first-token sampling key only sees min_tokens > 0.
  for (const nlohmann::ordered_json& min_tokens :
       {nlohmann::ordered_json(5), nlohmann::ordered_json(2u), nlohmann::ordered_json(7.0)}) {
    nlohmann::ordered_json body = {{"prompt", "x"}, {"max_tokens", 8}, {"min_tokens", min_tokens}};
    nlohmann::ordered_json leg = make_producer_body(body, kTransferId, TransferMode::kWrite);
    EXPECT_EQ(leg["min_tokens"], 1) << min_tokens;
    EXPECT_EQ(body["min_tokens"], min_tokens) << "the client's body (and so the consumer leg) keeps its value";
  }
}

TEST(ProducerBody, LeavesMinTokensThatNeedNoClampOrAreInvalid) {
  for (const nlohmann::ordered_json& min_tokens :
       {nlohmann::ordered_json(0), nlohmann::ordered_json(1), nlohmann::ordered_json(-3), nlohmann::ordered_json(2.5),
        nlohmann::ordered_json("4"), nlohmann::ordered_json(nullptr)}) {
    nlohmann::ordered_json leg =
        make_producer_body({{"prompt", "x"}, {"min_tokens", min_tokens}}, kTransferId, TransferMode::kRead);
    EXPECT_EQ(leg["min_tokens"], min_tokens);
  }
  EXPECT_FALSE(make_producer_body({{"prompt", "x"}}, kTransferId, TransferMode::kRead).contains("min_tokens"));
}

TEST(WriteConsumerBody, KeepsClientStreamingAndNamesTheProducer) {
  InstanceInfo producer;
  producer.instance_id = "p0";
  producer.control = HostPort{"127.0.0.1", 9100};
  producer.boot_nonce = 77;
  nlohmann::ordered_json body = {{"prompt", "hi"}, {"stream", true}, {"max_tokens", 8}};
  nlohmann::ordered_json leg = make_write_consumer_body(body, kTransferId, producer);
  EXPECT_EQ(leg["stream"], true);
  EXPECT_EQ(leg["max_tokens"], 8);
  EXPECT_EQ(leg["kv_transfer_params"], (nlohmann::ordered_json{{"transfer_id", kTransferId},
                                                               {"do_remote_prefill", true},
                                                               {"mode", "write"},
                                                               {"remote_instance_id", "p0"},
                                                               {"remote_control", "127.0.0.1:9100"},
                                                               {"remote_boot_nonce", 77}}));
}

nlohmann::ordered_json producer_response(std::string_view transfer_id) {
  return {{"choices", nlohmann::ordered_json::array()},
          {"kv_transfer_params",
           {{"transfer_id", transfer_id},
            {"remote_instance_id", "p0"},
            {"remote_control", "127.0.0.1:9100"},
            {"remote_boot_nonce", 5},
            {"block_ids", {1, 2, 3}},
            {"num_tokens", 40},
            {"do_remote_decode", true}}}};
}

TEST(ReadConsumerBody, CarriesTheProducersParamsPlusRemotePrefill) {
  auto leg = make_read_consumer_body({{"prompt", "hi"}}, kTransferId, producer_response(kTransferId).dump(), "p0");
  ASSERT_TRUE(leg.ok()) << leg.status().to_string();
  const nlohmann::ordered_json& params = (*leg)["kv_transfer_params"];
  EXPECT_EQ(params["transfer_id"], kTransferId);
  EXPECT_EQ(params["do_remote_prefill"], true);
  EXPECT_EQ(params["mode"], "read");
  EXPECT_EQ(params["block_ids"], (nlohmann::ordered_json{1, 2, 3}));
  EXPECT_EQ(params["num_tokens"], 40);
  EXPECT_FALSE(params.contains("do_remote_decode"));
}

TEST(ReadConsumerBody, FailsOnAnotherTransferIdOrMissingFields) {
  EXPECT_FALSE(
      make_read_consumer_body({}, kTransferId, producer_response("ffffffffffffffffffffffffffffffff").dump(), "").ok());
  EXPECT_FALSE(make_read_consumer_body({}, kTransferId, producer_response(kTransferId).dump(), "p1").ok());
  for (const char* key : {"remote_instance_id", "remote_control", "remote_boot_nonce", "block_ids", "num_tokens"}) {
    nlohmann::ordered_json response = producer_response(kTransferId);
    response["kv_transfer_params"].erase(key);
    EXPECT_FALSE(make_read_consumer_body({}, kTransferId, response.dump(), "").ok()) << key;
  }
  EXPECT_FALSE(make_read_consumer_body({}, kTransferId, R"({"choices":1})", "").ok());
  EXPECT_FALSE(make_read_consumer_body({}, kTransferId, "[]", "").ok());
}

// prompt_logprobs in P/D: the producer leg keeps the field (its prefill computes
// them), neither consumer leg has it (the consumer receives the prompt's KV).
TEST(PromptLogprobsLegs, OnlyTheProducerLegAsksForThem) {
  const nlohmann::ordered_json body = {{"prompt", "hi"}, {"prompt_logprobs", 2}, {"max_tokens", 4}};
  EXPECT_TRUE(wants_prompt_logprobs(body));
  EXPECT_FALSE(wants_prompt_logprobs({{"prompt", "hi"}, {"prompt_logprobs", nullptr}}));
  EXPECT_EQ(make_producer_body(body, kTransferId, TransferMode::kWrite)["prompt_logprobs"], 2);
  InstanceInfo producer;
  producer.instance_id = "p0";
  producer.control = HostPort{"127.0.0.1", 9100};
  EXPECT_FALSE(make_write_consumer_body(body, kTransferId, producer).contains("prompt_logprobs"));
  auto read_leg = make_read_consumer_body(body, kTransferId, producer_response(kTransferId).dump(), "p0");
  ASSERT_TRUE(read_leg.ok()) << read_leg.status().to_string();
  EXPECT_FALSE(read_leg->contains("prompt_logprobs"));
  EXPECT_EQ((*read_leg)["max_tokens"], 4);
}

TEST(PromptLogprobsAnswer, TheConsumersAnswerGetsTheProducersInEveryCompletionChoiceOrAtTheTopForChat) {
  const nlohmann::ordered_json list =
      nlohmann::ordered_json::parse(R"([null, {"5": {"logprob": -1.5, "rank": 2, "decoded_token": "b"}}])");
  nlohmann::ordered_json producer = {
      {"id", "p"}, {"choices", {{{"index", 0}, {"text", "x"}, {"prompt_logprobs", list}}}}, {"prompt_logprobs", list}};
  const std::string consumer = R"({"id":"c","choices":[{"index":0,"text":"xyz","prompt_logprobs":null},)"
                               R"({"index":1,"text":"xzz","prompt_logprobs":null}],"usage":{"prompt_tokens":2}})";
  auto merged = add_producer_prompt_logprobs(consumer, producer.dump(), /*chat=*/false);
  ASSERT_TRUE(merged.ok()) << merged.status().to_string();
  const auto answer = nlohmann::ordered_json::parse(*merged);
  EXPECT_EQ(answer["id"], "c");
  EXPECT_EQ(answer["choices"][0]["text"], "xyz");
  EXPECT_EQ(answer["choices"][0]["prompt_logprobs"], list);
  EXPECT_EQ(answer["choices"][1]["prompt_logprobs"], list);
  EXPECT_EQ(answer.begin().key(), "id") << "the consumer's key order stays";

  const std::string chat_consumer = R"({"id":"c","choices":[{"index":0}],"prompt_logprobs":null})";
  auto chat = add_producer_prompt_logprobs(chat_consumer, producer.dump(), /*chat=*/true);
  ASSERT_TRUE(chat.ok()) << chat.status().to_string();
  EXPECT_EQ(nlohmann::ordered_json::parse(*chat)["prompt_logprobs"], list);
}

TEST(PromptLogprobsAnswer, AProducerAnswerWithoutThemOrUnreadableAnswersFail) {
  const std::string consumer = R"({"choices":[{"index":0,"prompt_logprobs":null}],"prompt_logprobs":null})";
  EXPECT_FALSE(add_producer_prompt_logprobs(consumer, R"({"choices":[{"index":0}]})", false).ok());
  EXPECT_FALSE(add_producer_prompt_logprobs(consumer, R"({"prompt_logprobs":null})", true).ok());
  EXPECT_FALSE(add_producer_prompt_logprobs(consumer, "not json", true).ok());
  EXPECT_FALSE(add_producer_prompt_logprobs("[1]", R"({"prompt_logprobs":[null]})", true).ok());
  EXPECT_FALSE(
      add_producer_prompt_logprobs(R"({"choices":7})", R"({"choices":[{"prompt_logprobs":[null]}]})", false).ok());
}

TEST(ReadConsumerBody, RefusesAProducerAnswerNestedBeyondTheLimit) {
  // The producer's kv_transfer_params are copied into the consumer leg: 200,000 levels would overflow the stack.
  std::string response = producer_response(kTransferId).dump();
  const std::string deep = std::string(200'000, '[') + std::string(200'000, ']');
  response.insert(response.size() - 2, R"(,"extra":)" + deep);
  auto leg = make_read_consumer_body({{"prompt", "hi"}}, kTransferId, response, "p0");
  ASSERT_FALSE(leg.ok());
  EXPECT_NE(leg.status().message().find("deeper than 64"), std::string::npos) << leg.status().message();
  EXPECT_FALSE(make_read_consumer_body({}, kTransferId, "{not json", "").ok());
}

// A tool-calling chat request whose keys are deliberately not in alphabetical order, at the top
// level and inside the tool's JSON schema ("properties": city, unit, days). Chat templates such as
// Qwen2.5's render `tools` with tojson in the order given, so any reordering changes the prompt.
constexpr std::string_view kToolCallingBody =
    R"({"model":"m","messages":[{"role":"user","content":"weather?"}],)"
    R"("tools":[{"type":"function","function":{"name":"get_weather","description":"forecast",)"
    R"("parameters":{"type":"object","properties":{"city":{"type":"string"},)"
    R"("unit":{"type":"string","enum":["c","f"]},"days":{"type":"integer"}},"required":["city"]}}}],)"
    R"("tool_choice":"auto","max_tokens":64,"stream":true,"stream_options":{"include_usage":true},)"
    R"("min_tokens":3,"temperature":0})";

// kToolCallingBody up to (not including) "max_tokens": what every leg must reproduce byte for byte.
constexpr std::string_view kToolCallingPrefix =
    R"({"model":"m","messages":[{"role":"user","content":"weather?"}],)"
    R"("tools":[{"type":"function","function":{"name":"get_weather","description":"forecast",)"
    R"("parameters":{"type":"object","properties":{"city":{"type":"string"},)"
    R"("unit":{"type":"string","enum":["c","f"]},"days":{"type":"integer"}},"required":["city"]}}}],)"
    R"("tool_choice":"auto",)";

TEST(ParseClientRequest, KeepsTheClientsKeyOrderWhenKvTransferParamsAreRemoved) {
  // The collocated leg and the prefill_failed fallback re-serialise the parsed body.
  auto request = parse_client_request(R"({"prompt":"hi","kv_transfer_params":{"x":1},"model":"m","max_tokens":4})");
  ASSERT_TRUE(request.ok()) << request.status().to_string();
  EXPECT_EQ(request->body.dump(), R"({"prompt":"hi","model":"m","max_tokens":4})");
  auto tool_calling = parse_client_request(kToolCallingBody);
  ASSERT_TRUE(tool_calling.ok()) << tool_calling.status().to_string();
  EXPECT_EQ(tool_calling->body.dump(), kToolCallingBody);
}

TEST(ProducerBody, KeepsTheClientsKeyOrderAndReplacesKeysInPlace) {
  auto request = parse_client_request(kToolCallingBody);
  ASSERT_TRUE(request.ok()) << request.status().to_string();
  for (TransferMode mode : {TransferMode::kWrite, TransferMode::kRead}) {
    const std::string leg = make_producer_body(request->body, kTransferId, mode).dump();
    EXPECT_EQ(leg, std::string(kToolCallingPrefix) +
                       R"("max_tokens":1,"stream":false,"min_tokens":1,"temperature":0,)" +
                       R"("kv_transfer_params":{"transfer_id":")" + std::string(kTransferId) +
                       R"(","do_remote_decode":true,"mode":")" + std::string(mode_name(mode)) + R"("}})");
  }
}

TEST(WriteConsumerBody, KeepsTheClientsKeyOrder) {
  auto request = parse_client_request(kToolCallingBody);
  ASSERT_TRUE(request.ok()) << request.status().to_string();
  InstanceInfo producer;
  producer.instance_id = "p0";
  producer.control = HostPort{"127.0.0.1", 9100};
  producer.boot_nonce = 77;
  const std::string leg = make_write_consumer_body(request->body, kTransferId, producer).dump();
  EXPECT_EQ(leg, std::string(kToolCallingBody.substr(0, kToolCallingBody.size() - 1)) +
                     R"(,"kv_transfer_params":{"transfer_id":")" + std::string(kTransferId) +
                     R"(","do_remote_prefill":true,"mode":"write","remote_instance_id":"p0",)" +
                     R"("remote_control":"127.0.0.1:9100","remote_boot_nonce":77}})");
}

TEST(ReadConsumerBody, KeepsTheClientsKeyOrderAndTheProducersParamsOrder) {
  auto request = parse_client_request(kToolCallingBody);
  ASSERT_TRUE(request.ok()) << request.status().to_string();
  const std::string producer_text = R"({"id":"cmpl-1","kv_transfer_params":{"transfer_id":")" +
                                    std::string(kTransferId) +
                                    R"(","remote_instance_id":"p0","remote_control":"127.0.0.1:9100",)"
                                    R"("remote_boot_nonce":5,"block_ids":[3,1,2],"num_tokens":40,)"
                                    R"("do_remote_decode":true,"mode":"read"}})";
  auto leg = make_read_consumer_body(request->body, kTransferId, producer_text, "p0");
  ASSERT_TRUE(leg.ok()) << leg.status().to_string();
  EXPECT_EQ(leg->dump(), std::string(kToolCallingBody.substr(0, kToolCallingBody.size() - 1)) +
                             R"(,"kv_transfer_params":{"transfer_id":")" + std::string(kTransferId) +
                             R"(","remote_instance_id":"p0","remote_control":"127.0.0.1:9100",)"
                             R"("remote_boot_nonce":5,"block_ids":[3,1,2],"num_tokens":40,)"
                             R"("mode":"read","do_remote_prefill":true}})");
}

}  // namespace
}  // namespace pd::router
