#include "tokenizer/utf8.h"

namespace pd::tokenizer {
namespace {

// Allowed range of the second byte for a lead byte (Unicode Table 3-7); later bytes are 80..BF.
struct LeadInfo {
  uint8_t length;
  uint8_t second_lo;
  uint8_t second_hi;
};

LeadInfo lead_info(uint8_t b) {
  if (b < 0x80) return {1, 0, 0};
  if (b < 0xC2) return {0, 0, 0};
  if (b < 0xE0) return {2, 0x80, 0xBF};
  if (b == 0xE0) return {3, 0xA0, 0xBF};
  if (b == 0xED) return {3, 0x80, 0x9F};
  if (b < 0xF0) return {3, 0x80, 0xBF};
  if (b == 0xF0) return {4, 0x90, 0xBF};
  if (b < 0xF4) return {4, 0x80, 0xBF};
  if (b == 0xF4) return {4, 0x80, 0x8F};
  return {0, 0, 0};
}

}  // namespace

Utf8Step utf8_step(std::string_view s, size_t i) {
  const auto lead = static_cast<uint8_t>(s[i]);
  const LeadInfo info = lead_info(lead);
  if (info.length == 1) return {1, true, false};
  if (info.length == 0) return {1, false, false};
  size_t k = 1;
  for (; k < info.length; ++k) {
    if (i + k >= s.size()) return {k, false, true};
    const auto b = static_cast<uint8_t>(s[i + k]);
    const uint8_t lo = k == 1 ? info.second_lo : 0x80;
    const uint8_t hi = k == 1 ? info.second_hi : 0xBF;
    if (b < lo || b > hi) return {k, false, false};
  }
  return {info.length, true, false};
}

size_t utf8_valid_length(std::string_view s, size_t i) {
  const Utf8Step step = utf8_step(s, i);
  return step.valid ? step.num_bytes : 0;
}

bool is_valid_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    // ASCII fast path: 8 bytes at a time.
    while (i + 8 <= s.size()) {
      uint64_t word;
      __builtin_memcpy(&word, s.data() + i, 8);
      if (word & 0x8080808080808080ULL) break;
      i += 8;
    }
    if (i >= s.size()) break;
    const Utf8Step step = utf8_step(s, i);
    if (!step.valid) return false;
    i += step.num_bytes;
  }
  return true;
}

std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 8);
  size_t i = 0;
  while (i < s.size()) {
    const Utf8Step step = utf8_step(s, i);
    if (step.valid) {
      out.append(s.substr(i, step.num_bytes));
    } else {
      out.append(kReplacementChar);
    }
    i += step.num_bytes;
  }
  return out;
}

uint32_t utf8_next(std::string_view s, size_t& i) {
  const auto b0 = static_cast<uint8_t>(s[i]);
  if (b0 < 0x80) {
    ++i;
    return b0;
  }
  auto cont = [&](size_t k) { return static_cast<uint32_t>(static_cast<uint8_t>(s[i + k]) & 0x3F); };
  uint32_t cp;
  if (b0 < 0xE0) {
    cp = ((b0 & 0x1Fu) << 6) | cont(1);
    i += 2;
  } else if (b0 < 0xF0) {
    cp = ((b0 & 0x0Fu) << 12) | (cont(1) << 6) | cont(2);
    i += 3;
  } else {
    cp = ((b0 & 0x07u) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3);
    i += 4;
  }
  return cp;
}

void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace pd::tokenizer
