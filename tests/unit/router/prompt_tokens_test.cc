#include "router/prompt_tokens.h"

#include "router/request_validation.h"

#include <gtest/gtest.h>

namespace pd::router {
namespace {

using ojson = nlohmann::ordered_json;

// The plan comes from the body as the engine's own parser read it (validate_generation_request): the
// router parses each body once.
PromptTokensPlan plan_of(bool chat, const char* body) {
  ValidatedRequest out;
  const std::optional<server::ApiError> error = validate_generation_request(
      chat ? GenerationRoute::kChat : GenerationRoute::kCompletions, ojson::parse(body), out);
  EXPECT_FALSE(error.has_value()) << (error ? error->message : "");
  return out.prompt;
}

TEST(PromptTokens, ATokenIdPromptIsUsedAsIs) {
  PromptTokensPlan plan = plan_of(false, R"({"model":"m","prompt":[5,6,7]})");
  ASSERT_TRUE(plan.token_ids.has_value());
  EXPECT_EQ(*plan.token_ids, (std::vector<int32_t>{5, 6, 7}));
  EXPECT_FALSE(plan.tokenize_body.has_value());
  plan = plan_of(false, R"({"prompt":[[1,2]]})");
  EXPECT_EQ(*plan.token_ids, (std::vector<int32_t>{1, 2}));
}

TEST(PromptTokens, ATextPromptIsTokenizedWithTheFieldsThatShapeItsTokens) {
  PromptTokensPlan plan =
      plan_of(false, R"({"model":"m","prompt":"hi","add_special_tokens":false,"max_tokens":3,"stream":true})");
  ASSERT_TRUE(plan.tokenize_body.has_value());
  EXPECT_EQ(*plan.tokenize_body, R"({"model":"m","prompt":"hi","add_special_tokens":false})");
  // The engine's default, written out: the /tokenize answer cannot differ from the request's own tokens.
  plan = plan_of(false, R"({"prompt":["only"]})");
  EXPECT_EQ(*plan.tokenize_body, R"({"prompt":"only","add_special_tokens":true})");
}

TEST(PromptTokens, AChatIsTokenizedWithItsTemplateInputs) {
  PromptTokensPlan plan =
      plan_of(true, R"({"model":"m","messages":[{"role":"user","content":"x"}],"temperature":0,)"
                    R"("chat_template_kwargs":{"enable_thinking":false},"add_generation_prompt":true})");
  ASSERT_TRUE(plan.tokenize_body.has_value());
  EXPECT_EQ(*plan.tokenize_body,
            R"({"model":"m","messages":[{"role":"user","content":"x"}],"add_special_tokens":false,)"
            R"("add_generation_prompt":true,"chat_template_kwargs":{"enable_thinking":false}})");
  // Message content as the engine renders it: text parts joined into one string.
  plan = plan_of(true, R"({"messages":[{"role":"user","content":[{"type":"text","text":"a"}]}]})");
  EXPECT_EQ(*plan.tokenize_body,
            R"({"messages":[{"role":"user","content":"a"}],"add_special_tokens":false,"add_generation_prompt":true})");
}

TEST(PromptTokens, ABatchHasNoSinglePrompt) {
  PromptTokensPlan plan = plan_of(false, R"({"prompt":["a","b"]})");
  EXPECT_FALSE(plan.token_ids.has_value());
  EXPECT_FALSE(plan.tokenize_body.has_value());
}

TEST(PromptTokens, TruncationKeepsTheLastTokens) {
  PromptTokensPlan plan = plan_of(false, R"({"prompt":[1,2,3,4],"truncate_prompt_tokens":2})");
  std::vector<int32_t> ids = *plan.token_ids;
  truncate_prompt(ids, plan.keep_last);
  EXPECT_EQ(ids, (std::vector<int32_t>{3, 4}));
  // -1 is the context length (the engine's): nothing is cut here.
  plan = plan_of(false, R"({"prompt":[1,2],"truncate_prompt_tokens":-1})");
  ids = *plan.token_ids;
  truncate_prompt(ids, plan.keep_last);
  EXPECT_EQ(ids, (std::vector<int32_t>{1, 2}));
}

TEST(PromptTokens, TheTokenizeAnswerIsReadAndChecked) {
  auto ids = parse_tokenize_answer(R"({"count":2,"max_model_len":4096,"tokens":[9,10]})");
  ASSERT_TRUE(ids.ok()) << ids.status().to_string();
  EXPECT_EQ(*ids, (std::vector<int32_t>{9, 10}));
  EXPECT_FALSE(parse_tokenize_answer(R"({"tokens":[-1]})").ok());
  EXPECT_FALSE(parse_tokenize_answer(R"({"tokens":[2147483648]})").ok());
  EXPECT_FALSE(parse_tokenize_answer(R"({"tokens":"x"})").ok());
  EXPECT_FALSE(parse_tokenize_answer(R"([1,2])").ok());
  EXPECT_FALSE(parse_tokenize_answer("not json").ok());
}

}  // namespace
}  // namespace pd::router
