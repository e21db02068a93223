// UTF-8 helpers shared by the tokenizer, the detokenizer and the template engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace pd::tokenizer {

inline constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD

// Length of the valid UTF-8 sequence starting at s[i], or 0 when the bytes there are
// not a complete well-formed sequence (Unicode Table 3-7).
size_t utf8_valid_length(std::string_view s, size_t i);

// What the lossy decoder does at s[i]: returns the number of bytes consumed and whether they
// formed a valid character. For an invalid sequence it consumes the maximal subpart of a
// well-formed sequence (at least 1 byte) — the rule Rust's from_utf8_lossy and Python's
// errors='replace' follow, so each maximal subpart becomes one U+FFFD.
struct Utf8Step {
  size_t num_bytes;
  bool valid;
  // True when the bytes at i are a strict prefix of a well-formed sequence cut off by the end
  // of s: more bytes could still complete it.
  bool truncated;
};
Utf8Step utf8_step(std::string_view s, size_t i);

bool is_valid_utf8(std::string_view s);
// Each maximal invalid subpart replaced with U+FFFD.
std::string utf8_lossy(std::string_view s);

// Decodes the (valid) code point at s[i] and advances i. Precondition: s is valid UTF-8.
uint32_t utf8_next(std::string_view s, size_t& i);
void utf8_append(std::string& out, uint32_t cp);

}  // namespace pd::tokenizer
