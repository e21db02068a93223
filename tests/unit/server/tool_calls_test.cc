#include "server/tool_calls.h"

#include <gtest/gtest.h>

#include <regex>
#include <set>
#include <string>

namespace pd::server {
namespace {

using ojson = nlohmann::ordered_json;

ToolCallIdFn counting_ids() {
  auto n = std::make_shared<int>(0);
  return [n] { return "id" + std::to_string((*n)++); };
}

ParsedToolCalls parse(ToolCallFormat format, std::string_view text) {
  return parse_tool_calls(format, text, counting_ids());
}

// Feeds text in pieces cut at the given offsets and gathers what the stream said.
ParsedToolCalls stream(ToolCallFormat format, std::string_view text, const std::vector<size_t>& cuts,
                       std::vector<std::string>* contents = nullptr) {
  ToolCallStreamParser parser(format, counting_ids());
  ParsedToolCalls out;
  std::string content;
  auto take = [&](const ToolCallStreamDelta& delta) {
    content += delta.content;
    if (contents && !delta.content.empty()) contents->push_back(delta.content);
    for (const auto& call : delta.calls) {
      if (call.id) {
        EXPECT_EQ(call.index, static_cast<int32_t>(out.calls.size()));
        EXPECT_TRUE(call.name.has_value());
        EXPECT_EQ(call.arguments, "");
        out.calls.push_back({*call.id, *call.name, ""});
      } else {
        EXPECT_FALSE(call.name.has_value());
        EXPECT_EQ(call.index, static_cast<int32_t>(out.calls.size()) - 1);
        out.calls.back().arguments += call.arguments;
      }
    }
  };
  size_t from = 0;
  for (size_t cut : cuts) {
    take(parser.feed(text.substr(from, cut - from)));
    from = cut;
  }
  take(parser.feed(text.substr(from)));
  take(parser.finish());
  EXPECT_EQ(parser.num_calls(), static_cast<int32_t>(out.calls.size()));
  if (!content.empty()) out.content = content;
  return out;
}

void expect_same(const ParsedToolCalls& a, const ParsedToolCalls& b, const std::string& where) {
  EXPECT_EQ(a.content, b.content) << where;
  ASSERT_EQ(a.calls.size(), b.calls.size()) << where;
  for (size_t i = 0; i < a.calls.size(); ++i) {
    EXPECT_EQ(a.calls[i].id, b.calls[i].id) << where;
    EXPECT_EQ(a.calls[i].name, b.calls[i].name) << where;
    EXPECT_EQ(a.calls[i].arguments, b.calls[i].arguments) << where;
  }
}

// Every split into two pieces, and one byte at a time, says what the whole text says.
void expect_stream_matches_whole(ToolCallFormat format, std::string_view text) {
  const ParsedToolCalls whole = parse(format, text);
  for (size_t cut = 0; cut <= text.size(); ++cut)
    expect_same(stream(format, text, {cut}), whole, "cut at " + std::to_string(cut) + ": " + std::string(text));
  std::vector<size_t> every;
  for (size_t i = 1; i < text.size(); ++i) every.push_back(i);
  expect_same(stream(format, text, every), whole, "byte by byte: " + std::string(text));
}

TEST(ToolCallFormat, FollowsTheChatTemplate) {
  EXPECT_EQ(tool_call_format_for_template(
                "{{- '<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call>' }}"),
            ToolCallFormat::kHermes);
  EXPECT_EQ(tool_call_format_for_template("<tool_call>\\n<function=name>\\n<parameter=x>"), ToolCallFormat::kNone);
  EXPECT_EQ(tool_call_format_for_template("<|start_header_id|>user<|end_header_id|> Respond in the format "
                                          "{\"name\": function name, \"parameters\": dictionary of argument name "
                                          "and its value}."),
            ToolCallFormat::kLlama3Json);
  EXPECT_EQ(tool_call_format_for_template("{% for m in messages %}{{ m.content }}{% endfor %}"), ToolCallFormat::kNone);
}

TEST(ToolCallIds, LookLikeVllmsAndDiffer) {
  std::set<std::string> seen;
  for (int i = 0; i < 100; ++i) {
    std::string id = random_tool_call_id();
    EXPECT_TRUE(std::regex_match(id, std::regex("chatcmpl-tool-[0-9a-f]{32}"))) << id;
    seen.insert(id);
  }
  EXPECT_EQ(seen.size(), 100u);
}

TEST(HermesToolCalls, OneCallIsTheWholeReply) {
  auto parsed = parse(ToolCallFormat::kHermes,
                      "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": "
                      "[1,2]}}\n</tool_call>");
  EXPECT_FALSE(parsed.content.has_value());
  ASSERT_EQ(parsed.calls.size(), 1u);
  EXPECT_EQ(parsed.calls[0].id, "id0");
  EXPECT_EQ(parsed.calls[0].name, "get_weather");
  EXPECT_EQ(parsed.calls[0].arguments, R"({"city": "Paris", "days": [1, 2]})");
  EXPECT_EQ(ojson::parse(parsed.calls[0].arguments)["city"], "Paris");
}

TEST(HermesToolCalls, SeveralCallsAndTheTextAroundThem) {
  auto parsed = parse(ToolCallFormat::kHermes,
                      "Let me look.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n"
                      "<tool_call>\n{\"name\": \"b\", \"arguments\": {\"x\": \"</tool\"}}\n</tool_call>\nDone.");
  ASSERT_EQ(parsed.calls.size(), 2u);
  EXPECT_EQ(parsed.calls[0].name, "a");
  EXPECT_EQ(parsed.calls[0].arguments, "{}");
  EXPECT_EQ(parsed.calls[1].name, "b");
  EXPECT_EQ(parsed.calls[1].arguments, R"({"x": "</tool"})");
  EXPECT_EQ(parsed.calls[1].id, "id1");
  EXPECT_EQ(parsed.content, "Let me look.\n\nDone.");
}

// Arguments nested a million levels deep (a model can write that) are content,
// not a call: before the depth bound, re-spelling them recursed once per level
// and overflowed the stack.
TEST(HermesToolCalls, ArgumentsNestedTooDeepStayContent) {
  const size_t depth = 1'000'000;
  const std::string text = "<tool_call>{\"name\": \"a\", \"arguments\": {\"x\": " + std::string(depth, '[') +
                           std::string(depth, ']') + "}}</tool_call>";
  auto parsed = parse(ToolCallFormat::kHermes, text);
  EXPECT_TRUE(parsed.calls.empty());
  EXPECT_EQ(parsed.content, text);
  // A call within the bound is still a call.
  const std::string nested = "<tool_call>{\"name\": \"a\", \"arguments\": {\"x\": [[[1]]]}}</tool_call>";
  parsed = parse(ToolCallFormat::kHermes, nested);
  ASSERT_EQ(parsed.calls.size(), 1u);
  EXPECT_EQ(parsed.calls[0].arguments, "{\"x\": [[[1]]]}");
}

TEST(HermesToolCalls, MalformedCallsStayContent) {
  const std::string bad_json = "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": }\n</tool_call>";
  auto parsed = parse(ToolCallFormat::kHermes, bad_json);
  EXPECT_TRUE(parsed.calls.empty());
  EXPECT_EQ(parsed.content, bad_json);
  for (const char* body : {"[1, 2]", "{\"arguments\": {}}", "{\"name\": \"\", \"arguments\": {}}",
                           "{\"name\": \"a\", \"arguments\": \"x\"}", "{\"name\": 3}"}) {
    std::string text = std::string("<tool_call>") + body + "</tool_call>";
    parsed = parse(ToolCallFormat::kHermes, text);
    EXPECT_TRUE(parsed.calls.empty()) << body;
    EXPECT_EQ(parsed.content, text);
  }
  // A good call beside a bad one: the good one is a call, the bad one content.
  parsed = parse(ToolCallFormat::kHermes, "<tool_call>{\"name\": \"a\"}</tool_call><tool_call>oops</tool_call>");
  ASSERT_EQ(parsed.calls.size(), 1u);
  EXPECT_EQ(parsed.calls[0].arguments, "{}");
  EXPECT_EQ(parsed.content, "<tool_call>oops</tool_call>");
}

TEST(HermesToolCalls, UnclosedBlockAtTheEnd) {
  auto parsed = parse(ToolCallFormat::kHermes, "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"k\": 1}}\n");
  ASSERT_EQ(parsed.calls.size(), 1u);
  EXPECT_EQ(parsed.calls[0].arguments, R"({"k": 1})");
  EXPECT_FALSE(parsed.content.has_value());
  parsed = parse(ToolCallFormat::kHermes, "hi <tool_call>\n{\"name\": \"a\", \"argu");
  EXPECT_TRUE(parsed.calls.empty());
  EXPECT_EQ(parsed.content, "hi <tool_call>\n{\"name\": \"a\", \"argu");
}

TEST(HermesToolCalls, PlainTextIsUntouched) {
  for (const char* text : {"hello", "a < b and <tool", "<tool_cal", "  \n", "x <tool_call"}) {
    auto parsed = parse(ToolCallFormat::kHermes, text);
    EXPECT_TRUE(parsed.calls.empty());
    EXPECT_EQ(parsed.content, text);
  }
  EXPECT_FALSE(parse(ToolCallFormat::kHermes, "").content.has_value());
}

TEST(HermesToolCalls, StreamSplitAtEveryByteMatchesTheWholeReply) {
  for (const char* text :
       {"<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
        "Sure.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", "
        "\"arguments\": {\"s\": \"}{\"}}\n</tool_call>\nok <tool",
        "<tool_call>{\"name\": \"a\", \"arguments\": {\"x\": }</tool_call> tail", "a <b> <tool_cal> <tool_call",
        "  <tool_call>{\"name\": \"z\"}"}) {
    expect_stream_matches_whole(ToolCallFormat::kHermes, text);
  }
}

TEST(HermesToolCalls, StreamHoldsBackOnlyAPossibleTag) {
  const std::string text = "abc <tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>";
  std::vector<size_t> every;
  for (size_t i = 1; i < text.size(); ++i) every.push_back(i);
  std::vector<std::string> contents;
  auto parsed = stream(ToolCallFormat::kHermes, text, every, &contents);
  // "abc" goes out as it arrives; nothing of the tag or the call is content.
  ASSERT_GE(contents.size(), 2u);
  EXPECT_EQ(contents[0], "a");
  EXPECT_EQ(parsed.content, "abc ");
  ASSERT_EQ(parsed.calls.size(), 1u);
  EXPECT_EQ(parsed.calls[0].name, "f");

  ToolCallStreamParser parser(ToolCallFormat::kHermes, counting_ids());
  EXPECT_EQ(parser.feed("x <tool_").content, "x ");
  EXPECT_EQ(parser.feed("box>").content, "<tool_box>");
}

TEST(Llama3ToolCalls, TheWholeReplyIsACall) {
  auto parsed = parse(ToolCallFormat::kLlama3Json,
                      "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\", \"n\": 2}}");
  EXPECT_FALSE(parsed.content.has_value());
  ASSERT_EQ(parsed.calls.size(), 1u);
  EXPECT_EQ(parsed.calls[0].name, "get_weather");
  EXPECT_EQ(parsed.calls[0].arguments, R"({"city": "Paris", "n": 2})");

  parsed = parse(ToolCallFormat::kLlama3Json,
                 "<|python_tag|>{\"name\": \"a\", \"arguments\": {}}; {\"name\": \"b\", \"parameters\": {\"q\": "
                 "\"x;}\"}}");
  ASSERT_EQ(parsed.calls.size(), 2u);
  EXPECT_EQ(parsed.calls[0].name, "a");
  EXPECT_EQ(parsed.calls[1].name, "b");
  EXPECT_EQ(parsed.calls[1].arguments, R"({"q": "x;}"})");
  EXPECT_FALSE(parsed.content.has_value());
}

TEST(Llama3ToolCalls, TextAndMalformedJsonStayContent) {
  for (const char* text : {"The weather is fine.", "{\"name\": \"a\", \"parameters\": {", "{\"answer\": 42}",
                           "{\"name\": \"a\", \"parameters\": {}} and more", "  {\"name\": \"a\"}; {\"x\": 1}",
                           "Call {\"name\": \"a\", \"parameters\": {}}"}) {
    auto parsed = parse(ToolCallFormat::kLlama3Json, text);
    EXPECT_TRUE(parsed.calls.empty()) << text;
    EXPECT_EQ(parsed.content, text);
  }
}

TEST(Llama3ToolCalls, StreamSplitAtEveryByteMatchesTheWholeReply) {
  for (const char* text : {"{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}",
                           "\n<|python_tag|>{\"name\": \"a\", \"parameters\": {}};{\"name\": \"b\"}",
                           "Plain answer with {braces}", "{\"name\": \"a\", \"parameters\": {", "<|pyth", " "}) {
    expect_stream_matches_whole(ToolCallFormat::kLlama3Json, text);
  }
}

TEST(Llama3ToolCalls, StreamsPlainTextAsItComes) {
  ToolCallStreamParser parser(ToolCallFormat::kLlama3Json, counting_ids());
  EXPECT_EQ(parser.feed("Hel").content, "Hel");
  EXPECT_EQ(parser.feed("lo").content, "lo");
  EXPECT_TRUE(parser.finish().empty());
}

TEST(ToolCallResponses, ChatResponseCarriesTheParsedCalls) {
  ChoiceResult result;
  result.text = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>";
  result.finish_reason = engine::FinishReason::kStop;
  apply_tool_calls(result, ToolCallFormat::kHermes, counting_ids());
  ChoiceResult plain;
  plain.text = "no call here";
  plain.finish_reason = engine::FinishReason::kStop;
  apply_tool_calls(plain, ToolCallFormat::kHermes, counting_ids());
  auto response = chat_response(ResponseHeader{"chatcmpl-x", 1, "m"}, {result, plain}, Usage{}, std::nullopt);
  const auto& first = response["choices"][0];
  EXPECT_EQ(first["finish_reason"], "tool_calls");
  EXPECT_TRUE(first["message"]["content"].is_null());
  ASSERT_EQ(first["message"]["tool_calls"].size(), 1u);
  EXPECT_EQ(first["message"]["tool_calls"][0]["id"], "id0");
  EXPECT_EQ(first["message"]["tool_calls"][0]["type"], "function");
  EXPECT_EQ(first["message"]["tool_calls"][0]["function"]["name"], "f");
  EXPECT_EQ(first["message"]["tool_calls"][0]["function"]["arguments"], R"({"a": 1})");
  const auto& second = response["choices"][1];
  EXPECT_EQ(second["finish_reason"], "stop");
  EXPECT_EQ(second["message"]["content"], "no call here");
  EXPECT_TRUE(second["message"]["tool_calls"].empty());
}

TEST(ToolCallResponses, StreamDeltaJsonHasVllmsShape) {
  ToolCallStreamParser parser(ToolCallFormat::kHermes, counting_ids());
  auto first = tool_call_stream_delta_json(parser.feed("Hi <tool_call>{\"name\": \"f\", \"arguments\": {\"a\": "));
  EXPECT_EQ(first, ojson::parse(R"({"content": "Hi "})"));
  auto second = tool_call_stream_delta_json(parser.feed("1}}</tool_call>"));
  EXPECT_EQ(second, ojson::parse(R"({"tool_calls": [
      {"index": 0, "id": "id0", "type": "function", "function": {"name": "f", "arguments": ""}},
      {"index": 0, "function": {"arguments": "{\"a\": 1}"}}]})"));
  EXPECT_TRUE(tool_call_stream_delta_json(parser.finish()).empty());
}

// ---- tool_choice "required" / named: the constrained reply is the call ----

TEST(ForcedToolCalls, ANamedCallsArgumentsAreTheReplyAndFinishAsTheEngineSaid) {
  ChoiceResult result;
  result.text = R"({"city": "Paris"})";
  result.finish_reason = engine::FinishReason::kStop;
  apply_forced_tool_calls(result, ChatRequest::ForcedTool::kNamed, "get_weather", counting_ids());
  ASSERT_EQ(result.tool_calls.size(), 1u);
  EXPECT_EQ(result.tool_calls[0].id, "id0");
  EXPECT_EQ(result.tool_calls[0].name, "get_weather");
  EXPECT_EQ(result.tool_calls[0].arguments, R"({"city": "Paris"})");
  EXPECT_EQ(result.text, "");
  EXPECT_FALSE(result.content_is_null);
  const ResponseJson response = chat_response({"id", 0, "m"}, {result}, Usage{}, std::nullopt);
  EXPECT_EQ(response["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(response["choices"][0]["message"]["content"], "");
}

TEST(ForcedToolCalls, ARequiredReplyIsAListOfCallsFinishingWithToolCalls) {
  ChoiceResult result;
  result.text = R"([{"name":"a","parameters":{"x":1,"y":["é"]}},{"name":"b","parameters":{}}])";
  result.finish_reason = engine::FinishReason::kStop;
  apply_forced_tool_calls(result, ChatRequest::ForcedTool::kRequired, "", counting_ids());
  ASSERT_EQ(result.tool_calls.size(), 2u);
  EXPECT_EQ(result.tool_calls[0].name, "a");
  EXPECT_EQ(result.tool_calls[0].arguments, R"({"x": 1, "y": ["é"]})");  // json.dumps(ensure_ascii=False)
  EXPECT_EQ(result.tool_calls[1].name, "b");
  EXPECT_EQ(result.tool_calls[1].arguments, "{}");
  const ResponseJson response = chat_response({"id", 0, "m"}, {result}, Usage{}, std::nullopt);
  EXPECT_EQ(response["choices"][0]["finish_reason"], "tool_calls");
}

TEST(ForcedToolCalls, ARequiredReplyCutShortStaysContent) {
  ChoiceResult result;
  result.text = R"([{"name":"a","parameters":{"x":1)";
  result.finish_reason = engine::FinishReason::kLength;
  apply_forced_tool_calls(result, ChatRequest::ForcedTool::kRequired, "", counting_ids());
  EXPECT_TRUE(result.tool_calls.empty());
  EXPECT_EQ(result.text, R"([{"name":"a","parameters":{"x":1)");
}

TEST(ForcedToolCalls, StreamsANamedCallAsItsArgumentsArrive) {
  ForcedToolCallStream stream(ChatRequest::ForcedTool::kNamed, "f", counting_ids());
  ToolCallStreamDelta first = stream.feed("{\"a\"", false);
  ASSERT_EQ(first.calls.size(), 1u);
  EXPECT_EQ(first.calls[0].id, "id0");
  EXPECT_EQ(first.calls[0].name, "f");
  EXPECT_EQ(first.calls[0].arguments, "{\"a\"");
  ToolCallStreamDelta next = stream.feed(": 1}", false);
  ASSERT_EQ(next.calls.size(), 1u);
  EXPECT_FALSE(next.calls[0].id.has_value());
  EXPECT_EQ(next.calls[0].arguments, ": 1}");
  EXPECT_TRUE(stream.feed("", true).empty());
  EXPECT_FALSE(stream.finishes_with_tool_calls());
  EXPECT_EQ(tool_call_stream_delta_json(first)["tool_calls"][0]["function"]["name"], "f");
}

TEST(ForcedToolCalls, StreamsARequiredReplyAtTheEndAsTheWholeReplyParses) {
  const std::string text = R"([{"name":"a","parameters":{"x":1}},{"name":"b","parameters":{}}])";
  ForcedToolCallStream stream(ChatRequest::ForcedTool::kRequired, "", counting_ids());
  EXPECT_TRUE(stream.feed(text.substr(0, 10), false).empty());
  ToolCallStreamDelta tail = stream.feed(text.substr(10), true);
  ASSERT_EQ(tail.calls.size(), 4u);
  EXPECT_EQ(tail.calls[0].name, "a");
  EXPECT_EQ(tail.calls[1].arguments, R"({"x": 1})");
  EXPECT_EQ(tail.calls[2].index, 1);
  EXPECT_EQ(tail.calls[2].name, "b");
  EXPECT_TRUE(stream.finishes_with_tool_calls());

  ForcedToolCallStream cut(ChatRequest::ForcedTool::kRequired, "", counting_ids());
  ToolCallStreamDelta content = cut.feed(text.substr(0, 12), true);
  EXPECT_TRUE(content.calls.empty());
  EXPECT_EQ(content.content, text.substr(0, 12));
  EXPECT_FALSE(cut.finishes_with_tool_calls());
}

}  // namespace
}  // namespace pd::server
