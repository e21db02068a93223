#include "server/openai_protocol.h"

#include <gtest/gtest.h>

#include <string>

namespace pd::server {
namespace {

using ojson = nlohmann::ordered_json;

RequestLimits limits() {
  RequestLimits l;
  l.max_model_len = 128;
  return l;
}

template <typename T>
const ApiError& error_of(const Parsed<T>& parsed) {
  EXPECT_TRUE(failed(parsed));
  return std::get<ApiError>(parsed);
}

CompletionRequest completion(const char* body) {
  auto parsed = parse_completion_request(ojson::parse(body), limits());
  if (failed(parsed)) ADD_FAILURE() << std::get<ApiError>(parsed).message;
  return std::get<CompletionRequest>(std::move(parsed));
}

ApiError completion_error(const char* body) {
  return error_of(parse_completion_request(ojson::parse(body), limits()));
}
ApiError chat_error(const char* body) {
  return error_of(parse_chat_request(ojson::parse(body), limits()));
}

TEST(ParseJsonObject, RejectsMalformedJsonWith400) {
  auto parsed = parse_json_object("{\"prompt\": ", 64);
  EXPECT_EQ(error_of(parsed).http_status, 400);
  EXPECT_NE(error_of(parsed).message.find("not valid JSON"), std::string::npos);
}

TEST(ParseJsonObject, RejectsNonObjectBodies) {
  EXPECT_EQ(error_of(parse_json_object("[1,2]", 64)).http_status, 400);
  EXPECT_EQ(error_of(parse_json_object("\"x\"", 64)).http_status, 400);
}

TEST(ParseJsonObject, RejectsDeepNestingBeforeParsing) {
  std::string deep = "{\"a\":" + std::string(100000, '[') + std::string(100000, ']') + "}";
  EXPECT_NE(error_of(parse_json_object(deep, 64)).message.find("deeper"), std::string::npos);
}

TEST(ParseJsonObject, IgnoresBracketsInsideStrings) {
  std::string body = "{\"prompt\": \"" + std::string(200, '[') + "\\\"" + std::string(200, '{') + "\"}";
  EXPECT_FALSE(failed(parse_json_object(body, 4)));
}

TEST(ParseJsonObject, KeepsKeyOrder) {
  auto parsed = parse_json_object(R"({"z": 1, "a": 2})", 64);
  ASSERT_FALSE(failed(parsed));
  EXPECT_EQ(std::get<ojson>(parsed).dump(), R"({"z":1,"a":2})");
}

TEST(CompletionRequestParsing, AcceptsTextPrompt) {
  auto request = completion(R"({"model": "m", "prompt": "hello", "max_tokens": 5, "temperature": 0})");
  ASSERT_EQ(request.prompts.size(), 1u);
  EXPECT_EQ(*request.prompts[0].text, "hello");
  EXPECT_EQ(request.fields.model, "m");
  EXPECT_EQ(request.fields.max_tokens, 5);
  EXPECT_TRUE(request.fields.sampling.greedy());
}

TEST(CompletionRequestParsing, AcceptsBatchOfTextPrompts) {
  auto request = completion(R"({"prompt": ["a", "b", "c"]})");
  ASSERT_EQ(request.prompts.size(), 3u);
  EXPECT_EQ(*request.prompts[2].text, "c");
}

TEST(CompletionRequestParsing, AcceptsTokenIdPromptAndBatchOfThem) {
  auto single = completion(R"({"prompt": [1, 2, 3]})");
  ASSERT_EQ(single.prompts.size(), 1u);
  EXPECT_FALSE(single.prompts[0].text);
  EXPECT_EQ(single.prompts[0].token_ids, (std::vector<int32_t>{1, 2, 3}));
  auto batch = completion(R"({"prompt": [[1, 2], [3]]})");
  ASSERT_EQ(batch.prompts.size(), 2u);
  EXPECT_EQ(batch.prompts[1].token_ids, (std::vector<int32_t>{3}));
}

TEST(CompletionRequestParsing, RejectsBadPromptShapes) {
  for (const char* body :
       {R"({})", R"({"prompt": ""})", R"({"prompt": []})", R"({"prompt": 5})", R"({"prompt": ["a", 1]})",
        R"({"prompt": [1, "a"]})", R"({"prompt": [[1], "a"]})", R"({"prompt": [-1]})", R"({"prompt": [1.5]})",
        R"({"prompt": [[]]})", R"({"prompt": [4294967296]})"}) {
    auto error = completion_error(body);
    EXPECT_EQ(error.http_status, 400) << body;
    EXPECT_EQ(error.param, "prompt") << body;
  }
}

TEST(CompletionRequestParsing, RejectsWrongTypesNamingTheField) {
  EXPECT_EQ(completion_error(R"({"prompt": "a", "max_tokens": "5"})").param, "max_tokens");
  EXPECT_EQ(completion_error(R"({"prompt": "a", "temperature": "hot"})").param, "temperature");
  EXPECT_EQ(completion_error(R"({"prompt": "a", "stream": 1})").param, "stream");
  EXPECT_EQ(completion_error(R"({"prompt": "a", "stop": 3})").param, "stop");
  EXPECT_EQ(completion_error(R"({"prompt": "a", "model": 3})").param, "model");
  EXPECT_EQ(completion_error(R"({"prompt": "a", "kv_transfer_params": "x"})").param, "kv_transfer_params");
}

TEST(CompletionRequestParsing, RejectsNegativeAndAbsurdParameters) {
  EXPECT_EQ(completion_error(R"({"prompt": "a", "max_tokens": -1})").param, "max_tokens");
  EXPECT_EQ(completion_error(R"({"prompt": "a", "max_tokens": 0})").param, "max_tokens");
  EXPECT_EQ(completion_error(R"({"prompt": "a", "max_tokens": 1000000000000})").param, "max_tokens");
  EXPECT_EQ(completion_error(R"({"prompt": "a", "temperature": -0.5})").param, "temperature");
  EXPECT_EQ(completion_error(R"({"prompt": "a", "temperature": 1e300})").param, "temperature");
  EXPECT_EQ(completion_error(R"({"prompt": "a", "top_p": 0})").param, "top_p");
  EXPECT_EQ(completion_error(R"({"prompt": "a", "top_p": 1.5})").param, "top_p");
  EXPECT_EQ(completion_error(R"({"prompt": "a", "top_k": -2})").param, "top_k");
  EXPECT_EQ(completion_error(R"({"prompt": "a", "min_p": 2})").param, "min_p");
  EXPECT_EQ(completion_error(R"({"prompt": "a", "logprobs": 21})").param, "logprobs");
  EXPECT_EQ(completion_error(R"({"prompt": "a", "logprobs": -1})").param, "logprobs");
  EXPECT_EQ(completion_error(R"({"prompt": "a", "min_tokens": 9, "max_tokens": 4})").param, "min_tokens");
}

TEST(CompletionRequestParsing, NEchoAndBestOfEqualToN) {
  EXPECT_EQ(completion(R"({"prompt": "a", "n": 3})").fields.n, 3);
  EXPECT_EQ(completion(R"({"prompt": "a"})").fields.n, 1);
  EXPECT_EQ(completion_error(R"({"prompt": "a", "n": 0})").param, "n");
  EXPECT_EQ(completion_error(R"({"prompt": "a", "n": 65})").param, "n");
  EXPECT_EQ(completion_error(R"({"prompt": ["a", "b", "c", "d", "e"], "n": 64})").param, "n");  // 320 choices
  EXPECT_EQ(completion_error(R"({"prompt": "a", "n": 2, "kv_transfer_params": {}})").param, "kv_transfer_params");
  EXPECT_TRUE(completion(R"({"prompt": "a", "echo": true})").echo);
  EXPECT_FALSE(completion(R"({"prompt": "a"})").echo);
  auto echo_logprobs = completion_error(R"({"prompt": "a", "echo": true, "logprobs": 1})");
  EXPECT_EQ(echo_logprobs.param, "echo");
  EXPECT_EQ(echo_logprobs.code, "unsupported_parameter");
  EXPECT_EQ(completion_error(R"({"prompt": "a", "best_of": 3})").param, "best_of");
  completion(R"({"prompt": "a", "n": 3, "best_of": 3})");
  EXPECT_EQ(chat_error(R"({"messages": [{"role": "user", "content": "x"}], "echo": true})").param, "echo");
}

TEST(CompletionRequestParsing, ReadsPenaltiesBiasAllowedIdsAndBadWords) {
  auto request = completion(R"({"prompt": "a", "presence_penalty": -1.5, "frequency_penalty": 2,
      "repetition_penalty": 1.3, "logit_bias": {"7": 5.5, "12": -300}, "allowed_token_ids": [1, 2, 3],
      "bad_words": ["foo", " bar baz"], "truncate_prompt_tokens": 5, "add_special_tokens": false})");
  const auto& s = request.fields.sampling;
  EXPECT_FLOAT_EQ(s.presence_penalty, -1.5f);
  EXPECT_FLOAT_EQ(s.frequency_penalty, 2.0f);
  EXPECT_FLOAT_EQ(s.repetition_penalty, 1.3f);
  ASSERT_EQ(s.logit_bias.size(), 2u);
  EXPECT_EQ(s.logit_bias[0], (std::pair<int32_t, float>{7, 5.5f}));
  EXPECT_EQ(s.logit_bias[1], (std::pair<int32_t, float>{12, -100.0f})) << "clamped to [-100, 100] as vLLM does";
  EXPECT_EQ(s.allowed_token_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(request.fields.bad_words, (std::vector<std::string>{"foo", " bar baz"}));
  EXPECT_EQ(request.fields.truncate_prompt_tokens, 5);
  EXPECT_FALSE(request.add_special_tokens);
  EXPECT_EQ(completion(R"({"prompt": "a", "truncate_prompt_tokens": -1})").fields.truncate_prompt_tokens, 128);
}

TEST(CompletionRequestParsing, RejectsBadPenaltiesBiasAllowedIdsAndBadWordsNamingTheField) {
  for (auto [body, param] : std::vector<std::pair<const char*, const char*>>{
           {R"({"prompt": "a", "presence_penalty": 2.5})", "presence_penalty"},
           {R"({"prompt": "a", "frequency_penalty": -2.5})", "frequency_penalty"},
           {R"({"prompt": "a", "repetition_penalty": 0})", "repetition_penalty"},
           {R"({"prompt": "a", "repetition_penalty": 2.5})", "repetition_penalty"},
           {R"({"prompt": "a", "logit_bias": {"x": 1}})", "logit_bias"},
           {R"({"prompt": "a", "logit_bias": {"-1": 1}})", "logit_bias"},
           {R"({"prompt": "a", "logit_bias": {"99999999999": 1}})", "logit_bias"},
           {R"({"prompt": "a", "logit_bias": {"1": "x"}})", "logit_bias"},
           {R"({"prompt": "a", "logit_bias": [1]})", "logit_bias"},
           {R"({"prompt": "a", "allowed_token_ids": []})", "allowed_token_ids"},
           {R"({"prompt": "a", "allowed_token_ids": [-1]})", "allowed_token_ids"},
           {R"({"prompt": "a", "allowed_token_ids": "1"})", "allowed_token_ids"},
           {R"({"prompt": "a", "bad_words": "foo"})", "bad_words"},
           {R"({"prompt": "a", "bad_words": ["  "]})", "bad_words"},
           {R"({"prompt": "a", "bad_words": [1]})", "bad_words"},
           {R"({"prompt": "a", "truncate_prompt_tokens": 0})", "truncate_prompt_tokens"},
           {R"({"prompt": "a", "truncate_prompt_tokens": -2})", "truncate_prompt_tokens"},
           {R"({"prompt": "a", "truncate_prompt_tokens": 129})", "truncate_prompt_tokens"},
       }) {
    auto error = completion_error(body);
    EXPECT_EQ(error.http_status, 400) << body;
    EXPECT_EQ(error.param, param) << body;
  }
}

// Every vLLM request field this server does not implement is refused with a
// 400 naming it when set to anything but its "off" value, never ignored.
TEST(RequestParsing, UnimplementedVllmFieldsAreRefusedNamingTheField) {
  const std::vector<std::pair<const char*, const char*>> refused = {
      {"use_beam_search", "true"},
      {"length_penalty", "0.5"},
      {"guided_decoding_backend", R"("xgrammar")"},
      {"structural_tag", R"("x")"},
      {"response_format", R"({"type": "structural_tag"})"},
      {"logits_processors", R"(["x"])"},
      {"vllm_xargs", R"({"a": 1})"},
      {"spaces_between_special_tokens", "false"},
      {"priority", "1"},
      {"cache_salt", R"("s")"},
      {"prompt_embeds", R"("AAAA")"},
      {"mm_processor_kwargs", R"({"a": 1})"},
      {"parallel_tool_calls", "false"},
      {"functions", R"([{"name": "f"}])"},
      {"function_call", R"("auto")"},
      {"reasoning_effort", R"("low")"},
      {"include_reasoning", "false"},
      {"prediction", R"({"type": "content", "content": "x"})"},
      {"suffix", R"("x")"},
  };
  for (const auto& [field, value] : refused) {
    for (bool chat : {false, true}) {
      ojson body = chat ? ojson::parse(R"({"messages": [{"role": "user", "content": "x"}]})")
                        : ojson::parse(R"({"prompt": "a"})");
      body[field] = ojson::parse(value);
      if (chat && std::string(field) == "suffix") continue;  // a completions field
      auto error =
          chat ? error_of(parse_chat_request(body, limits())) : error_of(parse_completion_request(body, limits()));
      EXPECT_EQ(error.http_status, 400) << body.dump();
      EXPECT_EQ(error.param, field) << body.dump();
      EXPECT_EQ(error.type, "invalid_request_error") << body.dump();
      EXPECT_EQ(error.code, "unsupported_parameter") << body.dump();
    }
  }
}

TEST(RequestParsing, OffValuesOfUnimplementedFieldsAreAccepted) {
  for (const char* extra : {R"("use_beam_search": false)", R"("length_penalty": 1)", R"("prompt_logprobs": null)",
                            R"("guided_json": null)", R"("spaces_between_special_tokens": true)", R"("priority": 0)",
                            R"("tools": [])", R"("logits_processors": [])", R"("response_format": {"type": "text"})",
                            R"("include_reasoning": true)", R"("best_of": 1)", R"("stream_options": null)"}) {
    std::string body = std::string(R"({"prompt": "a", )") + extra + "}";
    auto parsed = parse_completion_request(ojson::parse(body), limits());
    EXPECT_FALSE(failed(parsed)) << body << ": " << (failed(parsed) ? std::get<ApiError>(parsed).message : "");
  }
}

TEST(RequestParsing, PromptLogprobsAreParsedForBothEndpoints) {
  for (bool chat : {false, true}) {
    ojson body =
        chat ? ojson::parse(R"({"messages": [{"role": "user", "content": "x"}]})") : ojson::parse(R"({"prompt": "a"})");
    body["prompt_logprobs"] = 3;
    const engine::SamplingParams sampling =
        chat ? std::get<ChatRequest>(parse_chat_request(body, limits())).fields.sampling
             : std::get<CompletionRequest>(parse_completion_request(body, limits())).fields.sampling;
    EXPECT_EQ(sampling.prompt_logprobs, 3);
    EXPECT_EQ(sampling.logprobs, -1) << "prompt logprobs do not turn on output logprobs";
  }
  auto absent = parse_completion_request(ojson::parse(R"({"prompt": "a"})"), limits());
  EXPECT_EQ(std::get<CompletionRequest>(absent).fields.sampling.prompt_logprobs, -1);
}

TEST(RequestParsing, PromptLogprobsOutOfRangeWithAStreamOrOnAConsumerAreRefusedNamingTheField) {
  for (const char* body :
       {R"({"prompt": "a", "prompt_logprobs": 21})", R"({"prompt": "a", "prompt_logprobs": -1})",
        R"({"prompt": "a", "prompt_logprobs": "2"})", R"({"prompt": "a", "prompt_logprobs": 0, "stream": true})",
        R"({"prompt": "a", "prompt_logprobs": 1, "kv_transfer_params": {"do_remote_prefill": true}})"}) {
    auto error = error_of(parse_completion_request(ojson::parse(body), limits()));
    EXPECT_EQ(error.http_status, 400) << body;
    EXPECT_EQ(error.param, "prompt_logprobs") << body;
  }
  auto producer = parse_completion_request(
      ojson::parse(R"({"prompt": "a", "prompt_logprobs": 1, "kv_transfer_params": {"do_remote_decode": true}})"),
      limits());
  EXPECT_FALSE(failed(producer)) << "a P/D producer computes them";
}

// vLLM's shape: null for the first prompt token, then per token an object keyed
// by token id: the prompt token itself first (its vocabulary rank), then the top-n
// with ranks 1..n in rank order.
TEST(ResponseShaping, PromptLogprobsListStartsWithNullAndKeysEntriesByTokenId) {
  engine::PromptTokenLogprob a{7, -2.5f, 3, {{4, -0.5f}, {9, -1.0f}}};
  engine::PromptTokenLogprob b{4, -0.25f, 1, {{4, -0.25f}, {1, -2.0f}}};
  TokenTextFn text = [](int32_t id) { return "t" + std::to_string(id); };
  ResponseJson list = prompt_logprobs_json({a, b}, text);
  ASSERT_EQ(list.size(), 3u);
  EXPECT_TRUE(list[0].is_null());
  ASSERT_EQ(list[1].size(), 3u);
  EXPECT_EQ(list[1].begin().key(), "7");
  EXPECT_EQ(list[1]["7"], ResponseJson({{"logprob", -2.5}, {"rank", 3}, {"decoded_token", "t7"}}));
  EXPECT_EQ(list[1]["4"]["rank"], 1);
  EXPECT_EQ(list[1]["9"]["rank"], 2);
  ASSERT_EQ(list[2].size(), 2u) << "the prompt token among the top-n appears once";
  EXPECT_EQ(list[2]["4"]["rank"], 1);
  EXPECT_TRUE(prompt_logprobs_json({}, text) == ResponseJson::array({nullptr})) << "a one-token prompt";

  ChoiceResult choice{"x", nullptr, engine::FinishReason::kLength, nullptr, std::nullopt};
  choice.prompt_logprobs = list;
  ResponseHeader header{"id", 1, "m"};
  EXPECT_EQ(completion_response(header, {choice}, Usage{}, std::nullopt)["choices"][0]["prompt_logprobs"], list);
  ResponseJson chat = chat_response(header, {choice}, Usage{}, std::nullopt);
  EXPECT_EQ(chat["prompt_logprobs"], list) << "chat carries them once, at the top";
  EXPECT_FALSE(chat["choices"][0].contains("prompt_logprobs"));
  ChoiceResult plain{"x", nullptr, engine::FinishReason::kLength, nullptr, std::nullopt};
  EXPECT_TRUE(completion_response(header, {plain}, Usage{}, std::nullopt)["choices"][0]["prompt_logprobs"].is_null());
  EXPECT_TRUE(chat_response(header, {plain}, Usage{}, std::nullopt)["prompt_logprobs"].is_null());
}

ojson chat_body_with_tools() {
  return ojson::parse(R"({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "get_weather", "description": "d",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]})");
}

TEST(ChatRequestParsing, ToolChoiceAutoIsTheDefaultWithTools) {
  ojson body = chat_body_with_tools();
  auto parsed = parse_chat_request(body, limits());
  ASSERT_FALSE(failed(parsed)) << std::get<ApiError>(parsed).message;
  EXPECT_TRUE(std::get<ChatRequest>(parsed).parse_tool_calls);
  EXPECT_EQ(std::get<ChatRequest>(parsed).tools, body["tools"]);
  body["tool_choice"] = "auto";
  parsed = parse_chat_request(body, limits());
  ASSERT_FALSE(failed(parsed));
  EXPECT_TRUE(std::get<ChatRequest>(parsed).parse_tool_calls);
  // "none": the tools still reach the template (as in vLLM), the reply is text.
  body["tool_choice"] = "none";
  parsed = parse_chat_request(body, limits());
  ASSERT_FALSE(failed(parsed));
  EXPECT_FALSE(std::get<ChatRequest>(parsed).parse_tool_calls);
  EXPECT_EQ(std::get<ChatRequest>(parsed).tools.size(), 1u);
  // No tools: nothing to parse.
  parsed =
      parse_chat_request(ojson::parse(R"({"messages": [{"role": "user", "content": "x"}], "tools": []})"), limits());
  ASSERT_FALSE(failed(parsed));
  EXPECT_FALSE(std::get<ChatRequest>(parsed).parse_tool_calls);
}

TEST(ChatRequestParsing, RequiredAndNamedToolChoiceHoldTheReplyToAJsonSchema) {
  ojson body = chat_body_with_tools();
  body["tool_choice"] = "required";
  auto parsed = parse_chat_request(body, limits());
  ASSERT_FALSE(failed(parsed)) << error_of(std::move(parsed)).message;
  const ChatRequest& required = std::get<ChatRequest>(parsed);
  EXPECT_EQ(required.forced_tool, ChatRequest::ForcedTool::kRequired);
  EXPECT_FALSE(required.parse_tool_calls);
  ASSERT_TRUE(required.fields.structured_output.has_value());
  EXPECT_EQ(required.fields.structured_output->field, "tool_choice");
  EXPECT_EQ(required.fields.structured_output->kind, StructuredOutput::Kind::kJsonSchema);
  EXPECT_EQ(ojson::parse(required.fields.structured_output->source),
            std::get<ojson>(tool_choice_schema(body["tools"], ChatRequest::ForcedTool::kRequired, "")));

  body["tool_choice"] = ojson::parse(R"({"type": "function", "function": {"name": "get_weather"}})");
  parsed = parse_chat_request(body, limits());
  ASSERT_FALSE(failed(parsed));
  const ChatRequest& named = std::get<ChatRequest>(parsed);
  EXPECT_EQ(named.forced_tool, ChatRequest::ForcedTool::kNamed);
  EXPECT_EQ(named.forced_tool_name, "get_weather");
  EXPECT_EQ(ojson::parse(named.fields.structured_output->source), body["tools"][0]["function"]["parameters"]);

  body["tool_choice"] = ojson::parse(R"({"type": "function", "function": {"name": "not_a_tool"}})");
  auto error = error_of(parse_chat_request(body, limits()));
  EXPECT_EQ(error.param, "tool_choice");
  EXPECT_NE(error.message.find("not_a_tool"), std::string::npos) << error.message;

  // A forced tool call is a constraint: another one in the same request is a 400 naming both.
  body["tool_choice"] = "required";
  body["guided_regex"] = "a+";
  error = error_of(parse_chat_request(body, limits()));
  EXPECT_EQ(error.param, "tool_choice");
  EXPECT_NE(error.message.find("guided_regex"), std::string::npos) << error.message;
  body.erase("guided_regex");
  for (const char* choice : {R"("sometimes")", "3", R"({"type": "function"})", R"({"function": {"name": 1}})"}) {
    body["tool_choice"] = ojson::parse(choice);
    EXPECT_EQ(error_of(parse_chat_request(body, limits())).param, "tool_choice") << choice;
  }
  ojson no_tools = ojson::parse(R"({"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"})");
  EXPECT_EQ(error_of(parse_chat_request(no_tools, limits())).param, "tool_choice");
  no_tools["tool_choice"] = "none";
  EXPECT_FALSE(failed(parse_chat_request(no_tools, limits())));
}

TEST(ChatRequestParsing, BadToolsNameTheField) {
  const std::pair<const char*, const char*> cases[] = {
      {R"({"type": "function"})", "tools"},
      {R"([3])", "tools[0]"},
      {R"([{"type": "retrieval", "function": {"name": "f"}}])", "tools[0].type"},
      {R"([{"function": {"name": "f"}}])", "tools[0].type"},
      {R"([{"type": "function"}])", "tools[0].function"},
      {R"([{"type": "function", "function": {"name": ""}}])", "tools[0].function.name"},
      {R"([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {}}])",
       "tools[1].function.name"},
      {R"([{"type": "function", "function": {"name": "f", "description": 1}}])", "tools[0].function.description"},
      {R"([{"type": "function", "function": {"name": "f", "parameters": "object"}}])", "tools[0].function.parameters"},
  };
  for (const auto& [tools, param] : cases) {
    ojson body = ojson::parse(R"({"messages": [{"role": "user", "content": "x"}]})");
    body["tools"] = ojson::parse(tools);
    auto error = error_of(parse_chat_request(body, limits()));
    EXPECT_EQ(error.http_status, 400) << tools;
    EXPECT_EQ(error.param, param) << tools;
    ojson tokenize = ojson::parse(R"({"messages": [{"role": "user", "content": "x"}]})");
    tokenize["tools"] = ojson::parse(tools);
    EXPECT_EQ(error_of(parse_tokenize_request(tokenize, limits())).param, param) << tools;
  }
  ojson many = ojson::parse(R"({"messages": [{"role": "user", "content": "x"}], "tools": []})");
  for (int i = 0; i < 300; ++i) many["tools"].push_back(chat_body_with_tools()["tools"][0]);
  EXPECT_EQ(error_of(parse_chat_request(many, limits())).param, "tools");
}

TEST(ChatRequestParsing, ToolCallHistoryReachesTheTemplateWithParsedArguments) {
  ojson body = chat_body_with_tools();
  body["messages"] = ojson::parse(R"([
      {"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "chatcmpl-tool-1", "type": "function",
          "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
      {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "sunny"}])");
  auto parsed = parse_chat_request(body, limits());
  ASSERT_FALSE(failed(parsed)) << std::get<ApiError>(parsed).message;
  const auto& messages = std::get<ChatRequest>(parsed).messages;
  EXPECT_EQ(messages[1]["tool_calls"][0]["function"]["arguments"], ojson::parse(R"({"city": "Paris"})"));
  EXPECT_EQ(messages[2]["tool_call_id"], "chatcmpl-tool-1");
  EXPECT_EQ(messages[2]["content"], "sunny");
}

TEST(ChatRequestParsing, BadToolCallHistoryNamesTheField) {
  const std::pair<const char*, const char*> cases[] = {
      {R"({"role": "assistant", "content": null, "tool_calls": {}})", "messages[1].tool_calls"},
      {R"({"role": "user", "content": "x", "tool_calls": []})", "messages[1].tool_calls"},
      {R"({"role": "assistant", "tool_calls": [{"type": "function"}]})", "messages[1].tool_calls[0].function"},
      {R"({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]})",
       "messages[1].tool_calls[0].function.name"},
      {R"({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]})",
       "messages[1].tool_calls[0].function.arguments"},
      {R"({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]})",
       "messages[1].tool_calls[0].function.arguments"},
      {R"({"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f", "arguments": "{}"}}]})",
       "messages[1].tool_calls[0].type"},
      {R"({"role": "tool", "tool_call_id": 7, "content": "x"})", "messages[1].tool_call_id"},
  };
  for (const auto& [message, param] : cases) {
    ojson body = ojson::parse(R"({"messages": [{"role": "user", "content": "x"}]})");
    body["messages"].push_back(ojson::parse(message));
    auto error = error_of(parse_chat_request(body, limits()));
    EXPECT_EQ(error.http_status, 400) << message;
    EXPECT_EQ(error.param, param) << message;
  }
}

TEST(CompletionRequestParsing, ContinuousUsageStatsIsRead) {
  auto request = completion(
      R"({"prompt": "a", "stream": true, "stream_options": {"include_usage": true, "continuous_usage_stats": true}})");
  EXPECT_TRUE(request.fields.include_usage);
  EXPECT_TRUE(request.fields.continuous_usage_stats);
}

TEST(CompletionRequestParsing, ReadsSamplingFields) {
  auto request = completion(R"({"prompt": "a", "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
      "seed": 42, "stop": ["x", "yz"], "stop_token_ids": [7, 8], "ignore_eos": true, "min_tokens": 2,
      "max_tokens": 10, "logprobs": 3, "include_stop_str_in_output": true})");
  const auto& s = request.fields.sampling;
  EXPECT_FLOAT_EQ(s.temperature, 0.7f);
  EXPECT_FLOAT_EQ(s.top_p, 0.9f);
  EXPECT_EQ(s.top_k, 5);
  EXPECT_FLOAT_EQ(s.min_p, 0.1f);
  EXPECT_EQ(s.seed, 42u);
  EXPECT_EQ(s.stop, (std::vector<std::string>{"x", "yz"}));
  EXPECT_EQ(s.stop_token_ids, (std::vector<int32_t>{7, 8}));
  EXPECT_TRUE(s.ignore_eos);
  EXPECT_TRUE(s.include_stop_str_in_output);
  EXPECT_EQ(s.min_tokens, 2);
  EXPECT_EQ(s.logprobs, 3);
}

TEST(CompletionRequestParsing, StopAcceptsASingleStringAndRejectsEmptyOnes) {
  EXPECT_EQ(completion(R"({"prompt": "a", "stop": "END"})").fields.sampling.stop, (std::vector<std::string>{"END"}));
  EXPECT_EQ(completion_error(R"({"prompt": "a", "stop": ""})").param, "stop");
  EXPECT_EQ(completion_error(R"({"prompt": "a", "stop": ["a", ""]})").param, "stop");
}

TEST(CompletionRequestParsing, NullMeansAbsent) {
  auto request = completion(R"({"prompt": "a", "max_tokens": null, "temperature": null, "stop": null, "seed": null})");
  EXPECT_FALSE(request.fields.max_tokens);
  EXPECT_FALSE(request.fields.sampling.seed);
}

TEST(CompletionRequestParsing, IntegralFloatsAreIntegers) {
  EXPECT_EQ(completion(R"({"prompt": "a", "max_tokens": 16.0})").fields.max_tokens, 16);
  EXPECT_EQ(completion_error(R"({"prompt": "a", "max_tokens": 16.5})").param, "max_tokens");
}

TEST(CompletionRequestParsing, StreamOptionsNeedStream) {
  EXPECT_TRUE(
      completion(R"({"prompt": "a", "stream": true, "stream_options": {"include_usage": true}})").fields.include_usage);
  EXPECT_EQ(completion_error(R"({"prompt": "a", "stream_options": {"include_usage": true}})").param, "stream_options");
  EXPECT_EQ(completion_error(R"({"prompt": "a", "stream": true, "stream_options": {"include_usage": 1}})").param,
            "include_usage");
}

TEST(CompletionRequestParsing, CarriesKvTransferParams) {
  auto request = completion(R"({"prompt": "a", "kv_transfer_params": {"do_remote_decode": true}})");
  ASSERT_TRUE(request.fields.kv_transfer_params);
  EXPECT_TRUE((*request.fields.kv_transfer_params)["do_remote_decode"].get<bool>());
}

TEST(CompletionRequestParsing, KvTransferParamsNeedExactlyOnePrompt) {
  for (const char* body : {R"({"prompt": ["a", "b"], "kv_transfer_params": {"do_remote_decode": true}})",
                           R"({"prompt": [[1, 2], [3]], "kv_transfer_params": {"do_remote_decode": true}})"}) {
    auto error = completion_error(body);
    EXPECT_EQ(error.http_status, 400) << body;
    EXPECT_EQ(error.param, "kv_transfer_params") << body;
    EXPECT_NE(error.message.find("exactly one prompt"), std::string::npos) << error.message;
  }
  EXPECT_EQ(completion(R"({"prompt": ["a"], "kv_transfer_params": {"do_remote_decode": true}})").prompts.size(), 1u);
  EXPECT_EQ(completion(R"({"prompt": [[1, 2]], "kv_transfer_params": {}})").prompts.size(), 1u);
  EXPECT_EQ(completion(R"({"prompt": [1, 2, 3], "kv_transfer_params": {}})").prompts.size(), 1u);
  EXPECT_EQ(completion(R"({"prompt": ["a", "b"], "kv_transfer_params": null})").prompts.size(), 2u);
}

TEST(CompletionRequestParsing, ResponseFormatOfAnUnknownTypeIs400EvenWhenTypeIsNotAString) {
  for (const char* body :
       {R"({"prompt": "a", "response_format": {"type": 5}})", R"({"prompt": "a", "response_format": {"type": null}})",
        R"({"prompt": "a", "response_format": {"type": ["text"]}})", R"({"prompt": "a", "response_format": {}})",
        R"({"prompt": "a", "response_format": {"type": "xml"}})", R"({"prompt": "a", "response_format": "text"})"}) {
    auto error = completion_error(body);
    EXPECT_EQ(error.http_status, 400) << body;
    EXPECT_EQ(error.param, "response_format") << body;
  }
  EXPECT_EQ(chat_error(R"({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": 5}})").param,
            "response_format");
  completion(R"({"prompt": "a", "response_format": {"type": "text"}})");
}

// Every field each parser reads, and values of every JSON type in the shapes
// the parsers look inside (objects with the keys they read, message lists):
// a parser must answer each with a value or a 400, never an exception (which
// the HTTP layer could only turn into a 500).
TEST(RequestParsing, NoFieldValueOfAnyTypeMakesAParserThrow) {
  const std::vector<std::string> fields = {"model",
                                           "stream",
                                           "stream_options",
                                           "temperature",
                                           "top_p",
                                           "top_k",
                                           "min_p",
                                           "seed",
                                           "max_tokens",
                                           "max_completion_tokens",
                                           "min_tokens",
                                           "ignore_eos",
                                           "skip_special_tokens",
                                           "include_stop_str_in_output",
                                           "stop",
                                           "stop_token_ids",
                                           "n",
                                           "best_of",
                                           "presence_penalty",
                                           "frequency_penalty",
                                           "repetition_penalty",
                                           "logit_bias",
                                           "response_format",
                                           "user",
                                           "kv_transfer_params",
                                           "return_tokens_as_token_ids",
                                           "return_token_ids",
                                           "request_id",
                                           "logprobs",
                                           "top_logprobs",
                                           "echo",
                                           "suffix",
                                           "prompt",
                                           "messages",
                                           "add_generation_prompt",
                                           "continue_final_message",
                                           "tools",
                                           "tool_choice",
                                           "chat_template_kwargs",
                                           "chat_template",
                                           "add_special_tokens",
                                           "return_token_strs",
                                           "tokens",
                                           "allowed_token_ids",
                                           "bad_words",
                                           "truncate_prompt_tokens",
                                           "use_beam_search",
                                           "length_penalty",
                                           "prompt_logprobs",
                                           "guided_json",
                                           "guided_choice",
                                           "guided_regex",
                                           "guided_grammar",
                                           "guided_decoding_backend",
                                           "guided_whitespace_pattern",
                                           "structured_outputs",
                                           "priority",
                                           "spaces_between_special_tokens",
                                           "include_reasoning"};
  const std::vector<ojson> scalars = {
      nullptr, true,           false,          0, 5, -1, 2.5, -1e300, 18446744073709551615u, "", "x",
      "text",  ojson::array(), ojson::object()};
  std::vector<ojson> values = scalars;
  for (const auto& v : scalars) {
    values.push_back(ojson::array({v}));
    values.push_back(ojson::array({ojson::array({v})}));
    for (const char* key : {"type", "include_usage", "continuous_usage_stats", "text", "json_schema", "json", "choice",
                            "json_object", "disable_any_whitespace"})
      values.push_back(ojson::object({{key, v}}));
    values.push_back(ojson::array({ojson::object({{"role", v}, {"content", "x"}})}));
    values.push_back(ojson::array({ojson::object({{"role", "user"}, {"content", v}})}));
    values.push_back(ojson::array({ojson::object({{"role", "assistant"}, {"content", v}})}));
    values.push_back(ojson::array({ojson::object({{"role", "user"}, {"content", "x"}, {"name", v}})}));
    values.push_back(ojson::array({ojson::object({{"role", "user"}, {"content", ojson::array({v})}})}));
    values.push_back(
        ojson::array({ojson::object({{"role", "user"}, {"content", ojson::array({ojson::object({{"type", v}})})}})}));
    values.push_back(ojson::array({ojson::object(
        {{"role", "user"}, {"content", ojson::array({ojson::object({{"type", "text"}, {"text", v}})})}})}));
  }
  const std::vector<ojson> bases = {ojson::parse(R"({"prompt": "a"})"),
                                    ojson::parse(R"({"messages": [{"role": "user", "content": "x"}]})"),
                                    ojson::parse(R"({"tokens": [1]})"), ojson::object()};
  auto expect_value_or_400 = [](const auto& parsed, const ojson& body) {
    if (failed(parsed)) {
      EXPECT_EQ(std::get<ApiError>(parsed).http_status, 400) << body.dump();
    }
  };
  size_t num_bodies = 0;
  for (const auto& base : bases) {
    for (const auto& field : fields) {
      for (const auto& value : values) {
        ojson body = base;
        body[field] = value;
        ++num_bodies;
        ASSERT_NO_THROW(expect_value_or_400(parse_completion_request(body, limits()), body)) << body.dump();
        ASSERT_NO_THROW(expect_value_or_400(parse_chat_request(body, limits()), body)) << body.dump();
        ASSERT_NO_THROW(expect_value_or_400(parse_tokenize_request(body, limits()), body)) << body.dump();
        ASSERT_NO_THROW(expect_value_or_400(parse_detokenize_request(body, limits()), body)) << body.dump();
      }
    }
  }
  EXPECT_GT(num_bodies, 10000u);
}

TEST(ChatRequestParsing, NormalizesTextPartsAndKeepsOrder) {
  auto parsed = parse_chat_request(ojson::parse(R"({"messages": [
      {"role": "system", "content": "be brief"},
      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
      {"role": "assistant", "content": null}],
      "max_completion_tokens": 7, "max_tokens": 3, "chat_template_kwargs": {"enable_thinking": false}})"),
                                   limits());
  ASSERT_FALSE(failed(parsed));
  const auto& request = std::get<ChatRequest>(parsed);
  EXPECT_EQ(request.messages[1]["content"], "a\nb");
  EXPECT_TRUE(request.messages[2]["content"].is_null());
  EXPECT_EQ(request.fields.max_tokens, 7);  // max_completion_tokens wins
  EXPECT_FALSE(request.chat_template_kwargs["enable_thinking"].get<bool>());
  EXPECT_TRUE(request.add_generation_prompt);
}

TEST(ChatRequestParsing, RejectsInvalidMessages) {
  EXPECT_EQ(chat_error(R"({})").param, "messages");
  EXPECT_EQ(chat_error(R"({"messages": []})").param, "messages");
  EXPECT_EQ(chat_error(R"({"messages": "hi"})").param, "messages");
  EXPECT_EQ(chat_error(R"({"messages": [1]})").param, "messages[0]");
  EXPECT_EQ(chat_error(R"({"messages": [{"content": "x"}]})").param, "messages[0].role");
  EXPECT_EQ(chat_error(R"({"messages": [{"role": "wizard", "content": "x"}]})").param, "messages[0].role");
  EXPECT_EQ(chat_error(R"({"messages": [{"role": "user"}]})").param, "messages[0].content");
  EXPECT_EQ(chat_error(R"({"messages": [{"role": "user", "content": 5}]})").param, "messages[0].content");
  EXPECT_EQ(chat_error(R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})").param,
            "messages[0].content");
}

TEST(ChatRequestParsing, LogprobsFlagAndTopLogprobs) {
  auto parsed = parse_chat_request(
      ojson::parse(R"({"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 4})"),
      limits());
  ASSERT_FALSE(failed(parsed));
  EXPECT_EQ(std::get<ChatRequest>(parsed).fields.sampling.logprobs, 4);
  EXPECT_EQ(chat_error(R"({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 4})").param, "top_logprobs");
  auto none = parse_chat_request(ojson::parse(R"({"messages": [{"role": "user", "content": "x"}]})"), limits());
  EXPECT_EQ(std::get<ChatRequest>(none).fields.sampling.logprobs, -1);
}

TEST(TokenizeRequestParsing, PromptOrMessages) {
  auto prompt = parse_tokenize_request(ojson::parse(R"({"prompt": "hi"})"), limits());
  ASSERT_FALSE(failed(prompt));
  EXPECT_TRUE(std::get<TokenizeRequest>(prompt).add_special_tokens);
  auto chat = parse_tokenize_request(ojson::parse(R"({"messages": [{"role": "user", "content": "x"}]})"), limits());
  ASSERT_FALSE(failed(chat));
  EXPECT_FALSE(std::get<TokenizeRequest>(chat).add_special_tokens);
  EXPECT_EQ(error_of(parse_tokenize_request(ojson::parse(R"({})"), limits())).param, "prompt");
}

TEST(DetokenizeRequestParsing, NeedsAListOfIds) {
  auto ok = parse_detokenize_request(ojson::parse(R"({"tokens": [1, 2]})"), limits());
  ASSERT_FALSE(failed(ok));
  EXPECT_EQ(std::get<DetokenizeRequest>(ok).tokens, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(error_of(parse_detokenize_request(ojson::parse(R"({"tokens": "12"})"), limits())).param, "tokens");
  EXPECT_EQ(error_of(parse_detokenize_request(ojson::parse(R"({"tokens": [-3]})"), limits())).param, "tokens");
}

TEST(ResolveMaxTokens, FollowsVllmRules) {
  EXPECT_EQ(std::get<int32_t>(resolve_max_tokens(10, std::nullopt, 16, 100)), 16);
  EXPECT_EQ(std::get<int32_t>(resolve_max_tokens(90, std::nullopt, 16, 100)), 10);  // clamped to the room left
  EXPECT_EQ(std::get<int32_t>(resolve_max_tokens(10, 90, 16, 100)), 90);
  EXPECT_EQ(error_of(resolve_max_tokens(10, 91, 16, 100)).param, "max_tokens");
  EXPECT_EQ(error_of(resolve_max_tokens(100, std::nullopt, 16, 100)).param, "prompt");
  EXPECT_EQ(error_of(resolve_max_tokens(150, 1, 16, 100)).http_status, 400);
}

std::string token_text(int32_t id) {
  return "t" + std::to_string(id);
}

TEST(ResponseShaping, CompletionLogprobsCarryOffsetsAndTopCandidates) {
  std::vector<engine::TokenLogprob> logprobs = {{5, -0.5f, {{5, -0.5f}, {6, -1.5f}}},
                                                {70, -2.0f, {{70, -2.0f}, {1, -2.5f}}}};
  int64_t offset = 3;
  auto json = completion_logprobs_json(logprobs, token_text, offset);
  EXPECT_EQ(json["tokens"], ResponseJson({"t5", "t70"}));
  EXPECT_EQ(json["text_offset"], ResponseJson({3, 5}));
  EXPECT_EQ(offset, 8);
  EXPECT_DOUBLE_EQ(json["top_logprobs"][1]["t1"].get<double>(), -2.5);
  EXPECT_DOUBLE_EQ(json["token_logprobs"][0].get<double>(), -0.5);
}

TEST(ResponseShaping, CompletionTopLogprobsHoldTheSampledTokenInRankOrder) {
  // Sampled token 9 is not among the top-2: it joins them at its rank (3 entries).
  std::vector<engine::TokenLogprob> logprobs = {{9, -3.0f, {{20, -0.1f}, {3, -2.0f}}},
                                                // Sampled token among the top-2: 2 entries, no duplicate.
                                                {3, -2.0f, {{20, -0.1f}, {3, -2.0f}}},
                                                // Sampled token between the candidates.
                                                {4, -1.0f, {{20, -0.1f}, {3, -2.0f}}}};
  int64_t offset = 0;
  auto json = completion_logprobs_json(logprobs, token_text, offset);
  auto keys = [&](size_t step) {
    std::vector<std::string> out;
    for (auto it = json["top_logprobs"][step].begin(); it != json["top_logprobs"][step].end(); ++it)
      out.push_back(it.key());
    return out;
  };
  EXPECT_EQ(keys(0), (std::vector<std::string>{"t20", "t3", "t9"}));
  EXPECT_EQ(keys(1), (std::vector<std::string>{"t20", "t3"}));
  EXPECT_EQ(keys(2), (std::vector<std::string>{"t20", "t4", "t3"}));
  EXPECT_DOUBLE_EQ(json["top_logprobs"][0]["t9"].get<double>(), -3.0);
  // The dump keeps the rank order (not alphabetical: "t20" < "t3" < "t9" would hide it at step 2).
  EXPECT_NE(json.dump().find(R"({"t20":-0.10000000149011612,"t4":-1.0,"t3":-2.0})"), std::string::npos) << json.dump();
}

TEST(ResponseShaping, CompletionLogprobsZeroGivesOnlyTheSampledToken) {
  std::vector<engine::TokenLogprob> logprobs = {{9, -3.0f, {}}};
  int64_t offset = 0;
  auto json = completion_logprobs_json(logprobs, token_text, offset);
  ASSERT_EQ(json["top_logprobs"][0].size(), 1u);
  EXPECT_DOUBLE_EQ(json["top_logprobs"][0]["t9"].get<double>(), -3.0);
}

TEST(ResponseShaping, CompletionTextOffsetCountsCharactersNotBytes) {
  // "é" is 2 bytes, "€" 3, "😀" 4: one character each, as Python's len() counts them.
  std::vector<std::string> texts = {"é", "€x", "😀", "ab"};
  std::vector<engine::TokenLogprob> logprobs;
  for (int32_t i = 0; i < 4; ++i) logprobs.push_back({i, -1.0f, {}});
  int64_t offset = 0;
  auto json = completion_logprobs_json(
      logprobs, [&](int32_t id) { return texts[static_cast<size_t>(id)]; }, offset);
  EXPECT_EQ(json["text_offset"], ResponseJson({0, 1, 3, 4}));
  EXPECT_EQ(offset, 6);
  EXPECT_EQ(utf8_length("h\xc3\xa9llo"), 5);
}

TEST(ResponseShaping, ChatLogprobsHaveBytesAndTopList) {
  std::vector<engine::TokenLogprob> logprobs = {{5, -0.25f, {{5, -0.25f}, {6, -3.0f}}}};
  auto json = chat_logprobs_json(logprobs, token_text);
  const auto& entry = json["content"][0];
  EXPECT_EQ(entry["token"], "t5");
  EXPECT_EQ(entry["bytes"], ResponseJson({'t', '5'}));
  ASSERT_EQ(entry["top_logprobs"].size(), 2u);
  EXPECT_EQ(entry["top_logprobs"][1]["token"], "t6");
}

TEST(ResponseShaping, InfiniteLogprobsBecomeFiniteJson) {
  EXPECT_DOUBLE_EQ(json_logprob(-std::numeric_limits<float>::infinity()), -9999.0);
  EXPECT_DOUBLE_EQ(json_logprob(std::numeric_limits<float>::quiet_NaN()), -9999.0);
}

TEST(ResponseShaping, UsageTotalsAndChunks) {
  ResponseHeader header{"cmpl-1", 123, "m"};
  auto chunk = usage_chunk(header, "text_completion", Usage{4, 6, 0});
  EXPECT_TRUE(chunk["choices"].empty());
  EXPECT_EQ(chunk["usage"]["total_tokens"], 10);
  auto response =
      completion_response(header, {ChoiceResult{"hi", nullptr, engine::FinishReason::kLength, nullptr, std::nullopt}},
                          Usage{1, 2, 0}, ResponseJson{{"transfer_id", "x"}});
  EXPECT_EQ(response["choices"][0]["finish_reason"], "length");
  EXPECT_FALSE(response["choices"][0].contains("token_ids")) << "only when return_token_ids asked for them";
  auto with_ids = completion_response(
      header, {ChoiceResult{"hi", nullptr, engine::FinishReason::kLength, nullptr, std::vector<int32_t>{5, 9}}},
      Usage{1, 2, 0}, std::nullopt);
  EXPECT_EQ(with_ids["choices"][0]["token_ids"], ResponseJson::array({5, 9}));
  EXPECT_EQ(response["kv_transfer_params"]["transfer_id"], "x");
  EXPECT_EQ(response["usage"]["total_tokens"], 3);
  auto chat = chat_chunk(header, 0, {{"content", "x"}}, nullptr, "stop", "</s>");
  EXPECT_EQ(chat["object"], "chat.completion.chunk");
  EXPECT_EQ(chat["choices"][0]["stop_reason"], "</s>");
}

TEST(ResponseShaping, SseEventsAreFramedAndSurviveInvalidUtf8) {
  EXPECT_EQ(sse_event({{"a", 1}}), "data: {\"a\":1}\n\n");
  std::string event = sse_event({{"text", std::string("\xff")}});
  EXPECT_EQ(event.rfind("data: ", 0), 0u);
  EXPECT_EQ(event.substr(event.size() - 2), "\n\n");
}

// ---- structured output ----

StructuredOutput structured_of(const std::string& extra, bool chat = false) {
  const std::string body =
      chat ? R"({"messages": [{"role": "user", "content": "x"}], )" + extra + "}" : R"({"prompt": "a", )" + extra + "}";
  if (chat) {
    auto parsed = parse_chat_request(ojson::parse(body), limits());
    EXPECT_FALSE(failed(parsed)) << body << ": " << (failed(parsed) ? std::get<ApiError>(parsed).message : "");
    if (failed(parsed) || !std::get<ChatRequest>(parsed).fields.structured_output) return {};
    return *std::get<ChatRequest>(parsed).fields.structured_output;
  }
  auto parsed = parse_completion_request(ojson::parse(body), limits());
  EXPECT_FALSE(failed(parsed)) << body << ": " << (failed(parsed) ? std::get<ApiError>(parsed).message : "");
  if (failed(parsed) || !std::get<CompletionRequest>(parsed).fields.structured_output) return {};
  return *std::get<CompletionRequest>(parsed).fields.structured_output;
}

TEST(StructuredOutputParsing, EachVllmFieldBecomesOneConstraintNamingItsField) {
  using Kind = StructuredOutput::Kind;
  for (bool chat : {false, true}) {
    StructuredOutput s = structured_of(R"("guided_json": {"type": "integer"})", chat);
    EXPECT_EQ(s.kind, Kind::kJsonSchema);
    EXPECT_EQ(ojson::parse(s.source), ojson::parse(R"({"type": "integer"})"));
    EXPECT_EQ(s.field, "guided_json");
    s = structured_of(R"("guided_json": "{\"type\": \"integer\"}")", chat);  // a schema in a string, as vLLM takes
    EXPECT_EQ(ojson::parse(s.source), ojson::parse(R"({"type": "integer"})"));
    s = structured_of(R"("guided_regex": "a+b")", chat);
    EXPECT_EQ(s.kind, Kind::kRegex);
    EXPECT_EQ(s.source, "a+b");
    EXPECT_EQ(s.field, "guided_regex");
    s = structured_of(R"("guided_choice": ["yes", "no"])", chat);
    EXPECT_EQ(s.kind, Kind::kChoice);
    EXPECT_EQ(s.choices, (std::vector<std::string>{"yes", "no"}));
    s = structured_of(R"("guided_grammar": "start: \"a\"")", chat);
    EXPECT_EQ(s.kind, Kind::kGrammar);
    EXPECT_EQ(s.source, "start: \"a\"");
    s = structured_of(R"("response_format": {"type": "json_object"})", chat);
    EXPECT_EQ(s.kind, Kind::kJsonObject);
    EXPECT_EQ(s.field, "response_format");
    s = structured_of(
        R"("response_format": {"type": "json_schema", "json_schema": {"name": "n", "strict": true, "schema": {"type": "object"}}})",
        chat);
    EXPECT_EQ(s.kind, Kind::kJsonSchema);
    EXPECT_EQ(ojson::parse(s.source), ojson::parse(R"({"type": "object"})"));
    s = structured_of(R"("structured_outputs": {"regex": "[0-9]+", "disable_fallback": true})", chat);
    EXPECT_EQ(s.kind, Kind::kRegex);
    EXPECT_EQ(s.field, "structured_outputs.regex");
    s = structured_of(R"("structured_outputs": {"json_object": true})", chat);
    EXPECT_EQ(s.kind, Kind::kJsonObject);
    s = structured_of(R"("structured_outputs": {"choice": ["a"]})", chat);
    EXPECT_EQ(s.kind, Kind::kChoice);
    s = structured_of(R"("structured_outputs": {"grammar": "start: \"a\""})", chat);
    EXPECT_EQ(s.kind, Kind::kGrammar);
    s = structured_of(R"("structured_outputs": {"json": {"type": "object"}}, "guided_decoding_backend": "guidance")",
                      chat);
    EXPECT_EQ(s.field, "structured_outputs.json");
  }
}

TEST(StructuredOutputParsing, JsonWhitespaceOptionsAreKept) {
  auto parsed = parse_completion_request(
      ojson::parse(R"({"prompt": "a", "guided_json": {}, "structured_outputs": {"disable_any_whitespace": true}})"),
      limits());
  ASSERT_FALSE(failed(parsed));
  EXPECT_TRUE(std::get<CompletionRequest>(parsed).fields.json_compact_whitespace);
  parsed = parse_completion_request(
      ojson::parse(R"({"prompt": "a", "guided_json": {}, "guided_whitespace_pattern": "[ ]?"})"), limits());
  ASSERT_FALSE(failed(parsed));
  EXPECT_EQ(std::get<CompletionRequest>(parsed).fields.json_whitespace_pattern, "[ ]?");
}

TEST(StructuredOutputParsing, TwoConstraintsAre400NamingBothFields) {
  for (const char* extra :
       {R"("guided_json": {}, "guided_regex": "a")", R"("guided_choice": ["a"], "guided_grammar": "x")",
        R"("response_format": {"type": "json_object"}, "guided_regex": "a")",
        R"("guided_regex": "a", "structured_outputs": {"choice": ["a"]})",
        R"("structured_outputs": {"regex": "a", "choice": ["a"]})"}) {
    auto error = completion_error((std::string(R"({"prompt": "a", )") + extra + "}").c_str());
    EXPECT_EQ(error.http_status, 400) << extra;
    EXPECT_NE(error.message.find("one structured-output constraint"), std::string::npos) << error.message;
    EXPECT_FALSE(error.param.empty());
    EXPECT_NE(error.message.find(error.param), std::string::npos) << error.message;
  }
}

TEST(StructuredOutputParsing, MalformedFieldsAre400NamingTheField) {
  const std::vector<std::pair<const char*, const char*>> cases = {
      {R"("guided_json": 5)", "guided_json"},
      {R"("guided_json": "not json")", "guided_json"},
      {R"("guided_json": "[1]")", "guided_json"},
      {R"("guided_regex": "")", "guided_regex"},
      {R"("guided_regex": ["a"])", "guided_regex"},
      {R"("guided_choice": [])", "guided_choice"},
      {R"("guided_choice": ["a", 1])", "guided_choice"},
      {R"("guided_grammar": 3)", "guided_grammar"},
      {R"("structured_outputs": 3)", "structured_outputs"},
      {R"("structured_outputs": {"jsn": {}})", "structured_outputs.jsn"},
      {R"("structured_outputs": {"json_object": "yes"})", "structured_outputs.json_object"},
      {R"("structured_outputs": {"structural_tag": "x"})", "structured_outputs.structural_tag"},
      {R"("structured_outputs": {"disable_additional_properties": true})",
       "structured_outputs.disable_additional_properties"},
      {R"("response_format": {"type": "json_schema"})", "response_format.json_schema"},
      {R"("response_format": {"type": "json_schema", "json_schema": {"schema": {}}})",
       "response_format.json_schema.name"},
      {R"("response_format": {"type": "json_schema", "json_schema": {"name": "n"}})",
       "response_format.json_schema.schema"},
      {R"("response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": "{}"}})",
       "response_format.json_schema.schema"},
      {R"("guided_decoding_backend": "outlines")", "guided_decoding_backend"},
      {R"("guided_whitespace_pattern": 1)", "guided_whitespace_pattern"},
  };
  for (const auto& [extra, param] : cases) {
    auto error = completion_error((std::string(R"({"prompt": "a", )") + extra + "}").c_str());
    EXPECT_EQ(error.http_status, 400) << extra;
    EXPECT_EQ(error.param, param) << extra << ": " << error.message;
  }
}

TEST(StructuredOutputParsing, ToolChoiceSchemasAreVllms) {
  const ojson tools = ojson::parse(R"([
      {"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {"x": {"$ref": "#/$defs/X"}},
                                                                     "$defs": {"X": {"type": "integer"}}}}},
      {"type": "function", "function": {"name": "b"}}])");
  auto named = tool_choice_schema(tools, ChatRequest::ForcedTool::kNamed, "b");
  ASSERT_FALSE(failed(named));
  EXPECT_EQ(std::get<ojson>(named), ojson::parse(R"({"type": "object"})"));
  auto required = tool_choice_schema(tools, ChatRequest::ForcedTool::kRequired, "");
  ASSERT_FALSE(failed(required));
  EXPECT_EQ(std::get<ojson>(required), ojson::parse(R"({"type": "array", "minItems": 1, "items": {"type": "object",
      "anyOf": [{"properties": {"name": {"type": "string", "enum": ["a"]},
                                "parameters": {"type": "object", "properties": {"x": {"$ref": "#/$defs/X"}}}},
                 "required": ["name", "parameters"]},
                {"properties": {"name": {"type": "string", "enum": ["b"]}, "parameters": {"type": "object"}},
                 "required": ["name", "parameters"]}]},
      "$defs": {"X": {"type": "integer"}}})"));
  EXPECT_EQ(error_of(tool_choice_schema(tools, ChatRequest::ForcedTool::kNamed, "c")).param, "tool_choice");
}

}  // namespace
}  // namespace pd::server
