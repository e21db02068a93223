#include "tokenizer/utf8.h"

#include <gtest/gtest.h>

namespace pd::tokenizer {
namespace {

TEST(Utf8Test, ValidTextIsLeftUnchanged) {
  const std::string text = "a\xC3\xA9\xE4\xB8\xAD\xF0\x9F\x98\x80";  // a é 中 😀
  EXPECT_TRUE(is_valid_utf8(text));
  EXPECT_EQ(utf8_lossy(text), text);
}

TEST(Utf8Test, EachMaximalInvalidSubpartBecomesOneReplacementChar) {
  const std::string fffd = std::string(kReplacementChar);
  // Truncated 3-byte sequence then ASCII: one U+FFFD for the two bytes.
  EXPECT_EQ(utf8_lossy("\xE2\x82 x"), fffd + " x");
  // Surrogate encodings are invalid byte by byte (ED A0 is not a valid prefix).
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), fffd + fffd + fffd);
  // Overlong and out-of-range leads.
  EXPECT_EQ(utf8_lossy("\xC0\xAF"), fffd + fffd);
  EXPECT_EQ(utf8_lossy("\xF4\x90\x80\x80"), fffd + fffd + fffd + fffd);
  // Stray continuation bytes.
  EXPECT_EQ(utf8_lossy("a\x80\x81"), "a" + fffd + fffd);
  // Truncated 4-byte sequence at the end is one U+FFFD.
  EXPECT_EQ(utf8_lossy("\xF0\x9F\x98"), fffd);
}

TEST(Utf8Test, StepReportsTruncationOnlyAtTheEnd) {
  const Utf8Step cut = utf8_step("\xF0\x9F", 0);
  EXPECT_FALSE(cut.valid);
  EXPECT_TRUE(cut.truncated);
  const Utf8Step broken = utf8_step(
      "\xF0\x9F"
      "a",
      0);
  EXPECT_FALSE(broken.valid);
  EXPECT_FALSE(broken.truncated);
  EXPECT_EQ(broken.num_bytes, 2u);
}

TEST(Utf8Test, EncodesAndDecodesCodePoints) {
  for (uint32_t cp : {0x41u, 0xE9u, 0x4E2Du, 0x1F600u, 0x10FFFFu}) {
    std::string s;
    utf8_append(s, cp);
    size_t i = 0;
    EXPECT_EQ(utf8_next(s, i), cp);
    EXPECT_EQ(i, s.size());
  }
}

}  // namespace
}  // namespace pd::tokenizer
