// Pre-tokenization: NFC normalization (ICU) and the split regex (PCRE2, UTF + UCP, JIT-compiled).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"

namespace pd::tokenizer {

// The split patterns of the families we load from vocab.json + merges.txt.
inline constexpr std::string_view kGpt2SplitPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
inline constexpr std::string_view kQwen2SplitPattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Returns text in Unicode NFC; text must be valid UTF-8. Already-normalized text (the common case)
// is returned without copying into out (out is left empty and the function returns false).
bool nfc_normalize(std::string_view text, std::string& out);

class PreTokenizer {
 public:
  // pattern: PCRE2 syntax (HF tokenizer.json regexes are Oniguruma; the families here use the
  // common subset). add_prefix_space: ByteLevel's option, a space before text not starting with one.
  static Result<std::unique_ptr<PreTokenizer>> create(std::string_view pattern, bool add_prefix_space);
  ~PreTokenizer();

  // Calls on_piece for each piece of text in order; pieces cover text exactly ("Isolated" split:
  // each match is a piece and so is each gap between matches). text must be valid UTF-8.
  void split(std::string_view text, const std::function<void(std::string_view)>& on_piece) const;

  bool add_prefix_space() const { return add_prefix_space_; }
  const std::string& pattern() const { return pattern_; }

 private:
  PreTokenizer() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string pattern_;
  bool add_prefix_space_ = false;
};

}  // namespace pd::tokenizer
