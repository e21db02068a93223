// llguidance through our own declarations: the library loads at the pinned version, and
// matchers built over pdserve's tokenizers allow exactly the right tokens.
#include "grammar/constraint.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "grammar/grammar_library.h"
#include "tokenizer/tokenizer.h"

namespace pd::grammar {
namespace {

namespace fs = std::filesystem;

std::shared_ptr<const GrammarLibrary> library() {
  static const std::shared_ptr<const GrammarLibrary> lib = [] {
    auto loaded = GrammarLibrary::load(default_library_paths());
    EXPECT_TRUE(loaded.ok()) << loaded.status().to_string();
    return loaded.ok() ? *loaded : nullptr;
  }();
  return lib;
}

// Byte-level vocab: 0 a, 1 b, 2 {, 3 }, 4 ", 5 :, 6 1, 7 ab, 8 x, 9 <eos> (special).
class TinyTokenizerDir {
 public:
  TinyTokenizerDir() {
    path_ = fs::temp_directory_path() / ("pd_grammar_test_" + std::to_string(::getpid()));
    fs::create_directories(path_);
    std::ofstream(path_ / "vocab.json") << R"({"a":0,"b":1,"{":2,"}":3,"\"":4,":":5,"1":6,"ab":7,"x":8})";
    std::ofstream(path_ / "merges.txt") << "a b\n";
    std::ofstream(path_ / "tokenizer_config.json")
        << R"({"tokenizer_class":"GPT2Tokenizer","eos_token":"<eos>","added_tokens_decoder":{"9":{"content":"<eos>","special":true}}})";
  }
  ~TinyTokenizerDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

constexpr int32_t kTinyEos = 9;

std::shared_ptr<const GrammarTokenizer> tiny_grammar_tokenizer(int32_t vocab_size = 10) {
  static TinyTokenizerDir dir;
  auto tok = tokenizer::Tokenizer::load(dir.path());
  EXPECT_TRUE(tok.ok()) << tok.status().to_string();
  if (!tok.ok() || library() == nullptr) return nullptr;
  auto made = GrammarTokenizer::create(library(), *tok, vocab_size, {kTinyEos});
  EXPECT_TRUE(made.ok()) << made.status().to_string();
  return made.ok() ? *made : nullptr;
}

std::shared_ptr<const tokenizer::Tokenizer> qwen3() {
  static const std::shared_ptr<const tokenizer::Tokenizer> tok = []() -> std::shared_ptr<const tokenizer::Tokenizer> {
    const char* root = std::getenv("PDSERVE_SOURCE_DIR");
    const fs::path dir = fs::path(root != nullptr ? root : ".") / "assets" / "tokenizers" / "qwen3";
    auto loaded = tokenizer::Tokenizer::load(dir);
    EXPECT_TRUE(loaded.ok()) << loaded.status().to_string();
    return loaded.ok() ? *loaded : nullptr;
  }();
  return tok;
}

// builtin:tiny's vocabulary: its tokenizer (Qwen3's) in a 151936-wide logits row.
std::shared_ptr<const GrammarTokenizer> qwen3_grammar_tokenizer() {
  static const std::shared_ptr<const GrammarTokenizer> made = []() -> std::shared_ptr<const GrammarTokenizer> {
    if (qwen3() == nullptr || library() == nullptr) return nullptr;
    auto created = GrammarTokenizer::create(library(), qwen3(), 151936, {*qwen3()->eos_token_id()});
    EXPECT_TRUE(created.ok()) << created.status().to_string();
    return created.ok() ? *created : nullptr;
  }();
  return made;
}

std::set<int32_t> allowed_ids(Matcher& matcher, int32_t vocab_size) {
  std::vector<uint32_t> words((static_cast<size_t>(vocab_size) + 31) / 32, 0xdeadbeefu);
  Status status = matcher.fill_allowed_mask(words);
  EXPECT_TRUE(status.ok()) << status.to_string();
  std::set<int32_t> out;
  for (int32_t id = 0; id < vocab_size; ++id)
    if (engine::mask_allows(words, id)) out.insert(id);
  return out;
}

std::unique_ptr<Matcher> matcher_for(const std::shared_ptr<const GrammarTokenizer>& tok, ConstraintSpec spec) {
  auto made = tok->new_matcher(spec);
  EXPECT_TRUE(made.ok()) << made.status().to_string();
  return made.ok() ? std::move(made).value() : nullptr;
}

TEST(GrammarLibraryTest, LoadsThePinnedVersion) {
  ASSERT_NE(library(), nullptr);
  EXPECT_EQ(library()->version().rfind(std::string("llguidance@") + kRequiredLlguidanceVersion + " ", 0), 0u)
      << library()->version();
}

TEST(GrammarLibraryTest, AMissingLibraryIsUnavailableNamingThePath) {
  auto loaded = GrammarLibrary::load(LibraryPaths{"", "/nonexistent/_lib.abi3.so"});
  ASSERT_FALSE(loaded.ok());
  EXPECT_EQ(loaded.status().code(), ErrorCode::kUnavailable);
  EXPECT_NE(loaded.status().message().find("/nonexistent/_lib.abi3.so"), std::string::npos);
}

TEST(GrammarTest, RegexMasksFollowThePrefix) {
  auto tok = tiny_grammar_tokenizer();
  ASSERT_NE(tok, nullptr);
  auto m = matcher_for(tok, {ConstraintKind::kRegex, "ab|b"});
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(allowed_ids(*m, 10), (std::set<int32_t>{0, 1, 7}));  // a, b, ab
  ASSERT_TRUE(m->consume_token(0).ok());                         // "a"
  EXPECT_EQ(allowed_ids(*m, 10), (std::set<int32_t>{1}));
  EXPECT_FALSE(m->is_accepting());
  ASSERT_TRUE(m->consume_token(1).ok());  // "ab"
  EXPECT_TRUE(m->is_accepting());
  EXPECT_TRUE(m->is_finished());
  EXPECT_EQ(allowed_ids(*m, 10), (std::set<int32_t>{kTinyEos}));
}

TEST(GrammarTest, ATokenOutsideTheMaskIsAnError) {
  auto tok = tiny_grammar_tokenizer();
  ASSERT_NE(tok, nullptr);
  auto m = matcher_for(tok, {ConstraintKind::kRegex, "ab|b"});
  ASSERT_NE(m, nullptr);
  Status status = m->consume_token(8);  // "x"
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("structured output"), std::string::npos) << status.message();
  EXPECT_FALSE(m->consume_token(-1).ok());
}

TEST(GrammarTest, ChoiceAllowsThePrefixesOfEachOption) {
  auto tok = tiny_grammar_tokenizer();
  ASSERT_NE(tok, nullptr);
  auto m = matcher_for(tok, choice_constraint({"ab", "x"}));
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(allowed_ids(*m, 10), (std::set<int32_t>{0, 7, 8}));  // a, ab, x
  ASSERT_TRUE(m->consume_token(8).ok());
  EXPECT_TRUE(m->is_finished());
}

TEST(GrammarTest, ChoiceEscapesRegexCharacters) {
  EXPECT_EQ(regex_escape("a.b*(c)|d"), "a\\.b\\*\\(c\\)\\|d");
  auto tok = tiny_grammar_tokenizer();
  ASSERT_NE(tok, nullptr);
  auto m = matcher_for(tok, choice_constraint({"{}"}));  // braces are regex syntax unless escaped
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(allowed_ids(*m, 10), (std::set<int32_t>{2}));
}

TEST(GrammarTest, JsonSchemaWalksAnObject) {
  auto tok = tiny_grammar_tokenizer();
  ASSERT_NE(tok, nullptr);
  auto m = matcher_for(
      tok,
      {ConstraintKind::kJsonSchema,
       R"({"type":"object","properties":{"a":{"type":"integer"}},"required":["a"],"additionalProperties":false})"});
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(allowed_ids(*m, 10), (std::set<int32_t>{2}));  // {
  ASSERT_TRUE(m->consume_token(2).ok());
  EXPECT_EQ(allowed_ids(*m, 10), (std::set<int32_t>{4}));  // "
  ASSERT_TRUE(m->consume_token(4).ok());
  EXPECT_EQ(allowed_ids(*m, 10), (std::set<int32_t>{0}));               // a (the only key)
  for (int32_t id : {0, 4, 5}) ASSERT_TRUE(m->consume_token(id).ok());  // a":
  EXPECT_EQ(allowed_ids(*m, 10), (std::set<int32_t>{6}));               // an integer: 1
  ASSERT_TRUE(m->consume_token(6).ok());
  EXPECT_EQ(allowed_ids(*m, 10), (std::set<int32_t>{3, 6}));  // more digits or }
  ASSERT_TRUE(m->consume_token(3).ok());
  EXPECT_TRUE(m->is_finished());
}

TEST(GrammarTest, JsonObjectAcceptsAnyObjectOnly) {
  auto tok = tiny_grammar_tokenizer();
  ASSERT_NE(tok, nullptr);
  auto m = matcher_for(tok, json_object_constraint());
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(allowed_ids(*m, 10), (std::set<int32_t>{2}));
  ASSERT_TRUE(m->consume_token(2).ok());
  ASSERT_TRUE(m->consume_token(3).ok());
  EXPECT_TRUE(m->is_accepting());
}

TEST(GrammarTest, LarkGrammar) {
  auto tok = tiny_grammar_tokenizer();
  ASSERT_NE(tok, nullptr);
  auto m = matcher_for(tok, {ConstraintKind::kLark, "start: \"x\" item\nitem: \"a\" | \"b\"\n"});
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(allowed_ids(*m, 10), (std::set<int32_t>{8}));
  ASSERT_TRUE(m->consume_token(8).ok());
  EXPECT_EQ(allowed_ids(*m, 10), (std::set<int32_t>{0, 1}));
}

TEST(GrammarTest, InvalidConstraintsAreRefusedWithTheLibrarysMessage) {
  auto tok = tiny_grammar_tokenizer();
  ASSERT_NE(tok, nullptr);
  for (const ConstraintSpec& spec :
       {ConstraintSpec{ConstraintKind::kRegex, "(ab"}, ConstraintSpec{ConstraintKind::kJsonSchema, R"({"type": 5})"},
        ConstraintSpec{ConstraintKind::kJsonSchema, "not json"},
        ConstraintSpec{ConstraintKind::kLark, "start: undefined_rule\n"}}) {
    auto made = tok->new_matcher(spec);
    ASSERT_FALSE(made.ok()) << spec.source;
    EXPECT_EQ(made.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(made.status().message().find(std::string("invalid ") + constraint_kind_name(spec.kind)),
              std::string::npos)
        << made.status().message();
    EXPECT_GT(made.status().message().size(), std::string("invalid regex: ").size() + 5) << made.status().message();
  }
}

TEST(GrammarTest, IdsBeyondTheTokenizerAreNeverAllowed) {
  // The runner's row is wider than the tokenizer (padding ids, as in builtin:tiny).
  auto tok = tiny_grammar_tokenizer(/*vocab_size=*/70);
  ASSERT_NE(tok, nullptr);
  auto m = matcher_for(tok, {ConstraintKind::kRegex, "[ab]+"});
  ASSERT_NE(m, nullptr);
  EXPECT_EQ(allowed_ids(*m, 70), (std::set<int32_t>{0, 1, 7}));
  // A caller's mask narrower or wider than the matcher's is filled up to its own size.
  std::vector<uint32_t> wide(5, ~0u);
  ASSERT_TRUE(m->fill_allowed_mask(wide).ok());
  EXPECT_EQ(wide[0], (1u << 0) | (1u << 1) | (1u << 7));
  EXPECT_EQ(wide[3], 0u);
  EXPECT_EQ(wide[4], 0u);
}

TEST(GrammarTest, ACloneAdvancesOnItsOwn) {
  auto tok = tiny_grammar_tokenizer();
  ASSERT_NE(tok, nullptr);
  auto m = matcher_for(tok, {ConstraintKind::kRegex, "ab|b"});
  ASSERT_NE(m, nullptr);
  auto copy = m->clone();
  ASSERT_TRUE(copy.ok());
  ASSERT_TRUE(m->consume_token(1).ok());
  EXPECT_TRUE(m->is_finished());
  EXPECT_FALSE((*copy)->is_finished());
  EXPECT_EQ(allowed_ids(**copy, 10), (std::set<int32_t>{0, 1, 7}));
}

void digit_regex_allows_exactly_the_short_digit_tokens() {
  auto tok = qwen3_grammar_tokenizer();
  ASSERT_NE(tok, nullptr);
  auto m = matcher_for(tok, {ConstraintKind::kRegex, "[0-9]{3}"});
  ASSERT_NE(m, nullptr);
  std::set<int32_t> expected;
  for (int32_t id = 0; id < qwen3()->vocab_size(); ++id) {
    const std::string_view bytes = qwen3()->token_bytes(id);
    if (bytes.empty() || bytes.size() > 3 || qwen3()->is_special(id)) continue;
    if (bytes.find_first_not_of("0123456789") == std::string_view::npos) expected.insert(id);
  }
  ASSERT_FALSE(expected.empty());
  EXPECT_EQ(allowed_ids(*m, 151936), expected);
}

void choice_allows_the_prefix_tokens_and_ends_with_eos() {
  auto tok = qwen3_grammar_tokenizer();
  ASSERT_NE(tok, nullptr);
  auto m = matcher_for(tok, choice_constraint({"yes", "no"}));
  ASSERT_NE(m, nullptr);
  std::set<int32_t> expected;
  for (int32_t id = 0; id < qwen3()->vocab_size(); ++id) {
    const std::string_view bytes = qwen3()->token_bytes(id);
    if (bytes.empty() || qwen3()->is_special(id)) continue;
    if (std::string_view("yes").starts_with(bytes) || std::string_view("no").starts_with(bytes)) expected.insert(id);
  }
  EXPECT_EQ(allowed_ids(*m, 151936), expected);
  const std::vector<int32_t> yes = qwen3()->encode("yes", false);
  for (int32_t id : yes) ASSERT_TRUE(m->consume_token(id).ok());
  EXPECT_TRUE(m->is_finished());
  EXPECT_EQ(allowed_ids(*m, 151936), (std::set<int32_t>{*qwen3()->eos_token_id()}));
}

void json_schema_after_a_prefix_allows_only_the_keys_continuation() {
  auto tok = qwen3_grammar_tokenizer();
  ASSERT_NE(tok, nullptr);
  auto m = matcher_for(tok, {ConstraintKind::kJsonSchema,
                             R"({"type":"object","properties":{"name":{"type":"string"}},"required":["name"],)"
                             R"("additionalProperties":false})"});
  ASSERT_NE(m, nullptr);
  // Every allowed first token starts a JSON object (optionally after whitespace).
  for (int32_t id : allowed_ids(*m, 151936)) {
    const std::string_view bytes = qwen3()->token_bytes(id);
    const size_t first = bytes.find_first_not_of(" \t\n\r");
    ASSERT_NE(first, std::string_view::npos) << id;
    EXPECT_EQ(bytes[first], '{') << "token " << id << " '" << bytes << "'";
  }
  for (int32_t id : qwen3()->encode("{\"na", false)) ASSERT_TRUE(m->consume_token(id).ok()) << id;
  // Only "me" ... can follow: every allowed token's bytes continue the key "name".
  const std::set<int32_t> allowed = allowed_ids(*m, 151936);
  ASSERT_FALSE(allowed.empty());
  for (int32_t id : allowed) {
    const std::string bytes(qwen3()->token_bytes(id));
    const std::string rest = "me\":";
    EXPECT_TRUE(rest.starts_with(bytes) || bytes.starts_with(rest)) << "token " << id << " '" << bytes << "'";
  }
  EXPECT_TRUE(allowed.contains(qwen3()->encode("me", false).front()));
}

// Qwen3's tokenizer (builtin:tiny's): the masks equal what the token bytes say. One test, so that
// the 151k-token tokenizer is built once (seconds under ASan).
TEST(GrammarQwen3Test, MasksEqualWhatTheTokenBytesSay) {
  {
    SCOPED_TRACE("regex [0-9]{3}");
    digit_regex_allows_exactly_the_short_digit_tokens();
  }
  {
    SCOPED_TRACE("choice yes / no");
    choice_allows_the_prefix_tokens_and_ends_with_eos();
  }
  {
    SCOPED_TRACE("JSON schema after {\"na");
    json_schema_after_a_prefix_allows_only_the_keys_continuation();
  }
}

}  // namespace
}  // namespace pd::grammar
