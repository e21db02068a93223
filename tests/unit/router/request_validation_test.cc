#include "router/request_validation.h"

#include <gtest/gtest.h>

#include "server/openai_protocol.h"

namespace pd::router {
namespace {

using nlohmann::ordered_json;

std::optional<server::ApiError> check(GenerationRoute route, const char* text, ValidatedRequest* out = nullptr) {
  ValidatedRequest ignored;
  return validate_generation_request(route, ordered_json::parse(text), out ? *out : ignored);
}

TEST(RequestValidation, RefusesWhatTheEngineRefusesWithTheEnginesError) {
  // A negative max_tokens is rewritten to 1 on the producer leg, which would then accept it.
  const char* body = R"({"model":"m","prompt":"hi","max_tokens":-1})";
  auto error = check(GenerationRoute::kCompletions, body);
  ASSERT_TRUE(error);
  // pdserve's answer (its parser, not a copy of it): same status, type, param and code; the message
  // names the upper bound, which is the engine's context length there and unknown here.
  auto engine = server::parse_completion_request(ordered_json::parse(body), server::RequestLimits{});
  ASSERT_TRUE(std::holds_alternative<server::ApiError>(engine));
  const server::ApiError& expected = std::get<server::ApiError>(engine);
  EXPECT_EQ(error->http_status, expected.http_status);
  EXPECT_EQ(error->type, expected.type);
  EXPECT_EQ(error->param, expected.param);
  EXPECT_EQ(error->code, expected.code);
  EXPECT_EQ(error->http_status, 400);
  EXPECT_EQ(error->param, "max_tokens");
  EXPECT_NE(error->message.find("'max_tokens' must be an integer between 1 and"), std::string::npos);
  // Where no model-dependent bound is involved the whole answer is the same.
  const char* bad_temperature = R"({"model":"m","prompt":"hi","temperature":-1})";
  auto engine_temperature =
      server::parse_completion_request(ordered_json::parse(bad_temperature), server::RequestLimits{});
  ASSERT_TRUE(std::holds_alternative<server::ApiError>(engine_temperature));
  auto router_temperature = check(GenerationRoute::kCompletions, bad_temperature);
  ASSERT_TRUE(router_temperature);
  EXPECT_EQ(router_temperature->to_json(), std::get<server::ApiError>(engine_temperature).to_json());
}

TEST(RequestValidation, ChecksSamplingFieldsOfBothRoutes) {
  EXPECT_TRUE(check(GenerationRoute::kCompletions, R"({"prompt":"x","temperature":-1})"));
  EXPECT_TRUE(check(GenerationRoute::kCompletions, R"({"prompt":"x","top_p":0})"));
  EXPECT_TRUE(check(GenerationRoute::kCompletions, R"({"prompt":"x","max_tokens":4,"min_tokens":5})"));
  EXPECT_TRUE(check(GenerationRoute::kCompletions, R"({"prompt":"x","n":0})"));
  EXPECT_TRUE(check(GenerationRoute::kCompletions, R"({"prompt":""})"));
  EXPECT_TRUE(check(GenerationRoute::kCompletions, R"({"max_tokens":4})"));
  EXPECT_TRUE(check(GenerationRoute::kChat, R"({"messages":[]})"));
  EXPECT_TRUE(check(GenerationRoute::kChat, R"({"messages":[{"role":"user","content":"x"}],"max_tokens":0})"));
  EXPECT_TRUE(check(GenerationRoute::kChat, R"({"messages":[{"role":"wizard","content":"x"}]})"));
  EXPECT_FALSE(check(GenerationRoute::kChat, R"({"messages":[{"role":"user","content":"x"}],"max_tokens":8})"));
}

TEST(RequestValidation, LeavesTheContextLengthToTheEngine) {
  // The router does not know an instance's max_model_len: a large max_tokens is the engine's call.
  EXPECT_FALSE(check(GenerationRoute::kCompletions, R"({"prompt":"x","max_tokens":1000000})"));
}

TEST(RequestValidation, CountsBatchedPrompts) {
  ValidatedRequest out;
  EXPECT_FALSE(check(GenerationRoute::kCompletions, R"({"prompt":"x"})", &out));
  EXPECT_EQ(out.num_prompts, 1u);
  EXPECT_FALSE(check(GenerationRoute::kCompletions, R"({"prompt":[1,2,3]})", &out));
  EXPECT_EQ(out.num_prompts, 1u);
  EXPECT_FALSE(check(GenerationRoute::kCompletions, R"({"prompt":["a","b","c"]})", &out));
  EXPECT_EQ(out.num_prompts, 3u);
  EXPECT_FALSE(check(GenerationRoute::kCompletions, R"({"prompt":[[1,2],[3]]})", &out));
  EXPECT_EQ(out.num_prompts, 2u);
}

}  // namespace
}  // namespace pd::router
