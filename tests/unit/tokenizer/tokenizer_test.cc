#include "tokenizer/tokenizer.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "tokenizer/chat_template.h"

namespace pd::tokenizer {
namespace {

namespace fs = std::filesystem;

fs::path assets_dir() {
  const char* root = std::getenv("PDSERVE_SOURCE_DIR");
  return fs::path(root != nullptr ? root : ".") / "assets" / "tokenizers";
}

std::shared_ptr<Tokenizer> load_or_die(const fs::path& dir) {
  auto loaded = Tokenizer::load(dir);
  EXPECT_TRUE(loaded.ok()) << loaded.status().to_string();
  return loaded.ok() ? std::move(loaded).value() : nullptr;
}

const std::shared_ptr<Tokenizer>& qwen3() {
  static const std::shared_ptr<Tokenizer> tok = load_or_die(assets_dir() / "qwen3");
  return tok;
}

// A temporary tokenizer folder with a tiny byte-level vocab.
class TinyTokenizerDir {
 public:
  explicit TinyTokenizerDir(bool with_version_header) {
    path_ =
        fs::temp_directory_path() / ("pd_tok_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++));
    fs::create_directories(path_);
    // Bytes 'a','b','c',' ' ("Ġ") plus merges "a b" -> "ab", "ab c" -> "abc".
    std::ofstream(path_ / "vocab.json") << R"({"a":0,"b":1,"c":2,"Ġ":3,"ab":4,"abc":5})";
    std::ofstream merges(path_ / "merges.txt");
    if (with_version_header) merges << "#version: 0.2\n";
    merges << "a b\nab c\n";
    merges.close();
    std::ofstream(path_ / "tokenizer_config.json")
        << R"({"tokenizer_class":"GPT2Tokenizer","eos_token":"<eos>","added_tokens_decoder":{"6":{"content":"<eos>","special":true},"7":{"content":"<e","special":false}}})";
  }
  ~TinyTokenizerDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

TEST(TokenizerTest, EncodesLikeHuggingFaceOnAKnownSentence) {
  ASSERT_NE(qwen3(), nullptr);
  // Reference ids from transformers.AutoTokenizer on the same folder.
  const std::vector<int32_t> expected = {14990, 1154, 1879, 659, 220, 151643, 432, 364, 82, 220, 1513, 944};
  EXPECT_EQ(qwen3()->encode("hello , world . <|endoftext|> it 's  don't"), expected);
}

TEST(TokenizerTest, QwenMergesWithoutVersionHeaderKeepTheFirstMerge) {
  ASSERT_NE(qwen3(), nullptr);
  // The first line of Qwen's merges.txt is the merge "Ġ Ġ"; dropping it would split two spaces.
  const auto ids = qwen3()->encode("x  ", false);
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_EQ(qwen3()->id_to_token(ids[1]), std::optional<std::string>("ĠĠ"));
}

TEST(TokenizerTest, MergesHeaderIsSkippedOnlyWhenPresent) {
  for (bool header : {false, true}) {
    TinyTokenizerDir dir(header);
    auto tok = load_or_die(dir.path());
    ASSERT_NE(tok, nullptr);
    EXPECT_EQ(tok->encode("abc", false), std::vector<int32_t>({5})) << "header=" << header;
  }
}

TEST(TokenizerTest, AddedTokensMatchLongestFirstAndSpecialOnesAreSkippedOnDecode) {
  TinyTokenizerDir dir(false);
  auto tok = load_or_die(dir.path());
  ASSERT_NE(tok, nullptr);
  // "<eos>" wins over its prefix "<e"; "<e" alone is an added (non-special) token.
  EXPECT_EQ(tok->encode("ab<eos>c<e", false), std::vector<int32_t>({4, 6, 2, 7}));
  EXPECT_EQ(tok->decode(std::vector<int32_t>{4, 6, 2}, true), "abc");
  EXPECT_EQ(tok->decode(std::vector<int32_t>{4, 6, 2}, false), "ab<eos>c");
  EXPECT_EQ(tok->eos_token_id(), 6);
  EXPECT_TRUE(tok->is_special(6));
  EXPECT_FALSE(tok->is_special(7));
  EXPECT_EQ(tok->vocab_size(), 8);
  EXPECT_FALSE(tok->has_chat_template());
}

TEST(TokenizerTest, InvalidUtf8InputIsEncodedAsReplacementCharacters) {
  ASSERT_NE(qwen3(), nullptr);
  const std::string invalid = "ok \x80\xFF end";
  const std::string replaced = "ok \xEF\xBF\xBD\xEF\xBF\xBD end";
  EXPECT_EQ(qwen3()->encode(invalid), qwen3()->encode(replaced));
}

TEST(TokenizerTest, DecodeReplacesBrokenUtf8AndSkipsUnknownIds) {
  ASSERT_NE(qwen3(), nullptr);
  const auto ids = qwen3()->encode("中", false);
  ASSERT_EQ(ids.size(), 1u);
  // A lone first byte of a 3-byte character.
  const auto byte_e4 = qwen3()->token_to_id("ä");
  ASSERT_TRUE(byte_e4.has_value());
  EXPECT_EQ(qwen3()->decode(std::vector<int32_t>{*byte_e4, -5, 99999999}), "\xEF\xBF\xBD");
}

TEST(TokenizerTest, NfcNormalizationAppliesToQwen) {
  ASSERT_NE(qwen3(), nullptr);
  EXPECT_EQ(qwen3()->encode("cafe\xCC\x81"), qwen3()->encode("caf\xC3\xA9"));
}

TEST(TokenizerTest, ConcurrentEncodesGiveTheSameIds) {
  ASSERT_NE(qwen3(), nullptr);
  std::vector<std::string> texts;
  std::mt19937 rng(5);
  const std::vector<std::string> words = {"hello", " world", "中文", "😀", "  ", "\n", "don't", "123", "<|im_end|>"};
  for (int i = 0; i < 50; ++i) {
    std::string t;
    for (int j = 0; j < 40; ++j) t += words[rng() % words.size()];
    texts.push_back(t);
  }
  std::vector<std::vector<int32_t>> expected;
  for (const auto& t : texts) expected.push_back(qwen3()->encode(t));
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int w = 0; w < 4; ++w) {
    threads.emplace_back([&, w] {
      for (int round = 0; round < 5; ++round) {
        for (size_t i = 0; i < texts.size(); ++i)
          mismatches[static_cast<size_t>(w)] += qwen3()->encode(texts[i]) != expected[i];
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int m : mismatches) EXPECT_EQ(m, 0);
}

TEST(TokenizerTest, LoadFailsClearlyForMissingOrMalformedFiles) {
  auto missing = Tokenizer::load("/nonexistent/tokenizer/dir");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), ErrorCode::kNotFound);

  TinyTokenizerDir dir(false);
  std::ofstream(dir.path() / "merges.txt") << "a zz\n";  // "zz" is not in the vocab
  auto bad_merge = Tokenizer::load(dir.path());
  ASSERT_FALSE(bad_merge.ok());
  EXPECT_NE(bad_merge.status().message().find("missing from the vocab"), std::string::npos);

  std::ofstream(dir.path() / "vocab.json") << R"({"a": "not an id")";
  EXPECT_FALSE(Tokenizer::load(dir.path()).ok());
}

TEST(TokenizerTest, UnsupportedTemplateConstructFailsTheLoadNamingIt) {
  TinyTokenizerDir dir(false);
  std::ofstream(dir.path() / "chat_template.jinja") << "hello\n{% include 'other.jinja' %}";
  auto loaded = Tokenizer::load(dir.path());
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), ErrorCode::kUnimplemented);
  EXPECT_NE(loaded.status().message().find("include"), std::string::npos) << loaded.status().message();
  EXPECT_NE(loaded.status().message().find("line 2"), std::string::npos) << loaded.status().message();
}

TEST(TokenizerTest, AppliesTheModelsChatTemplate) {
  ASSERT_NE(qwen3(), nullptr);
  ASSERT_TRUE(qwen3()->has_chat_template());
  const auto messages = nlohmann::json::parse(R"([{"role":"user","content":"hi"}])");
  auto prompt = qwen3()->apply_chat_template(messages, true, nullptr, {{"enable_thinking", false}});
  ASSERT_TRUE(prompt.ok()) << prompt.status().to_string();
  EXPECT_EQ(*prompt, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
}

}  // namespace
}  // namespace pd::tokenizer
