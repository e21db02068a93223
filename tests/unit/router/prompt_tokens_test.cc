#include "router/prompt_tokens.h"

#include <gtest/gtest.h>

namespace pd::router {
namespace {

using ojson = nlohmann::ordered_json;

TEST(PromptTokens, ATokenIdPromptIsUsedAsIs) {
  PromptTokensPlan plan = plan_prompt_tokens(false, ojson::parse(R"({"model":"m","prompt":[5,6,7]})"));
  ASSERT_TRUE(plan.token_ids.has_value());
  EXPECT_EQ(*plan.token_ids, (std::vector<int32_t>{5, 6, 7}));
  EXPECT_FALSE(plan.tokenize_body.has_value());
  plan = plan_prompt_tokens(false, ojson::parse(R"({"prompt":[[1,2]]})"));
  EXPECT_EQ(*plan.token_ids, (std::vector<int32_t>{1, 2}));
}

TEST(PromptTokens, ATextPromptIsTokenizedWithTheFieldsThatShapeItsTokens) {
  PromptTokensPlan plan = plan_prompt_tokens(
      false, ojson::parse(R"({"model":"m","prompt":"hi","add_special_tokens":false,"max_tokens":3,"stream":true})"));
  ASSERT_TRUE(plan.tokenize_body.has_value());
  EXPECT_EQ(*plan.tokenize_body, R"({"model":"m","prompt":"hi","add_special_tokens":false})");
  plan = plan_prompt_tokens(false, ojson::parse(R"({"prompt":["only"]})"));
  EXPECT_EQ(*plan.tokenize_body, R"({"prompt":"only"})");
}

TEST(PromptTokens, AChatIsTokenizedWithItsTemplateInputs) {
  PromptTokensPlan plan = plan_prompt_tokens(
      true, ojson::parse(R"({"model":"m","messages":[{"role":"user","content":"x"}],"tools":[],"temperature":0,)"
                         R"("chat_template_kwargs":{"enable_thinking":false},"add_generation_prompt":true})"));
  ASSERT_TRUE(plan.tokenize_body.has_value());
  EXPECT_EQ(*plan.tokenize_body,
            R"({"model":"m","messages":[{"role":"user","content":"x"}],"add_generation_prompt":true,"tools":[],)"
            R"("chat_template_kwargs":{"enable_thinking":false}})");
}

TEST(PromptTokens, ABatchHasNoSinglePrompt) {
  PromptTokensPlan plan = plan_prompt_tokens(false, ojson::parse(R"({"prompt":["a","b"]})"));
  EXPECT_FALSE(plan.token_ids.has_value());
  EXPECT_FALSE(plan.tokenize_body.has_value());
}

TEST(PromptTokens, TruncationKeepsTheLastTokens) {
  PromptTokensPlan plan = plan_prompt_tokens(false, ojson::parse(R"({"prompt":[1,2,3,4],"truncate_prompt_tokens":2})"));
  std::vector<int32_t> ids = *plan.token_ids;
  truncate_prompt(ids, plan.keep_last);
  EXPECT_EQ(ids, (std::vector<int32_t>{3, 4}));
  plan = plan_prompt_tokens(false, ojson::parse(R"({"prompt":[1,2],"truncate_prompt_tokens":-1})"));
  EXPECT_FALSE(plan.keep_last.has_value());
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
