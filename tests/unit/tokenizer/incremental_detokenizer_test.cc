#include "tokenizer/incremental_detokenizer.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <random>

#include "tokenizer/utf8.h"

namespace pd::tokenizer {
namespace {

std::shared_ptr<const Tokenizer> qwen3() {
  static const std::shared_ptr<const Tokenizer> tok = [] {
    const char* root = std::getenv("PDSERVE_SOURCE_DIR");
    auto loaded = Tokenizer::load(std::filesystem::path(root != nullptr ? root : ".") / "assets/tokenizers/qwen3");
    return loaded.ok() ? std::shared_ptr<const Tokenizer>(std::move(loaded).value()) : nullptr;
  }();
  return tok;
}

std::string stream(const std::shared_ptr<const Tokenizer>& tok, const std::vector<int32_t>& ids, bool skip) {
  IncrementalDetokenizer detok(tok, {}, skip);
  std::string all;
  for (int32_t id : ids) {
    const std::string chunk = detok.push(id);
    EXPECT_TRUE(is_valid_utf8(chunk));
    all += chunk;
  }
  const std::string tail = detok.flush();
  EXPECT_TRUE(is_valid_utf8(tail));
  return all + tail;
}

TEST(IncrementalDetokenizerTest, HoldsBackAPartialCharacterUntilItCompletes) {
  auto tok = qwen3();
  ASSERT_NE(tok, nullptr);
  // "😀" is F0 9F 98 80: push it one byte token at a time.
  std::vector<int32_t> byte_ids;
  for (const char* t : {"ð", "Ł", "ĺ", "Ģ"}) byte_ids.push_back(*tok->token_to_id(t));
  IncrementalDetokenizer detok(tok, {}, true);
  EXPECT_EQ(detok.push(byte_ids[0]), "");
  EXPECT_EQ(detok.push(byte_ids[1]), "");
  EXPECT_EQ(detok.push(byte_ids[2]), "");
  EXPECT_EQ(detok.push(byte_ids[3]), "\xF0\x9F\x98\x80");
  EXPECT_EQ(detok.flush(), "");
}

TEST(IncrementalDetokenizerTest, FlushReplacesAnUnfinishedCharacter) {
  auto tok = qwen3();
  ASSERT_NE(tok, nullptr);
  IncrementalDetokenizer detok(tok, {}, true);
  EXPECT_EQ(detok.push(*tok->token_to_id("ä")), "");
  EXPECT_EQ(detok.flush(), "\xEF\xBF\xBD");
}

TEST(IncrementalDetokenizerTest, ChunksConcatenateToDecodeOnRandomSequences) {
  auto tok = qwen3();
  ASSERT_NE(tok, nullptr);
  std::mt19937 rng(42);
  std::vector<int32_t> byte_ids;
  for (const char* t : {"ä", "¸", "Ń", "ð", "Ł", "ĺ", "Ģ", "í", "ķ"}) byte_ids.push_back(*tok->token_to_id(t));
  const std::vector<std::string> texts = {"中文分词测试，我们今天去北京", "😀👍🏽👨‍👩‍👧‍👦 emoji",
                                          "한국어 텍스트", "plain ascii"};
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<int32_t> ids;
    const int n = 1 + static_cast<int>(rng() % 40);
    for (int i = 0; i < n; ++i) {
      switch (rng() % 3) {
        case 0:
          ids.push_back(static_cast<int32_t>(rng() % static_cast<uint32_t>(tok->vocab_size())));
          break;
        case 1:
          ids.push_back(byte_ids[rng() % byte_ids.size()]);
          break;
        default: {
          const auto more = tok->encode(texts[rng() % texts.size()], false);
          ids.insert(ids.end(), more.begin(), more.end());
        }
      }
    }
    for (bool skip : {true, false}) {
      ASSERT_EQ(stream(tok, ids, skip), tok->decode(ids, skip)) << "trial " << trial;
    }
  }
}

TEST(IncrementalDetokenizerTest, SkipsSpecialTokensWhenAsked) {
  auto tok = qwen3();
  ASSERT_NE(tok, nullptr);
  const auto ids = tok->encode("a<|im_end|>b", false);
  EXPECT_EQ(stream(tok, ids, true), "ab");
  EXPECT_EQ(stream(tok, ids, false), "a<|im_end|>b");
}

}  // namespace
}  // namespace pd::tokenizer
