#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/pre_tokenizer.h"

#include <pcre2.h>
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/stringpiece.h>

namespace pd::tokenizer {

bool nfc_normalize(std::string_view text, std::string& out) {
  // Below U+0300 every character is NFC and no following character composes with it unless that
  // one is >= U+0300, so pure low text needs no ICU call at all.
  bool all_low = true;
  for (unsigned char c : text) {
    if (c >= 0xCC) {  // lead bytes of U+0300 and above
      all_low = false;
      break;
    }
  }
  if (all_low) return false;
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(status);
  if (U_FAILURE(status)) return false;
  const icu::StringPiece piece(text.data(), static_cast<int32_t>(text.size()));
  if (nfc->isNormalizedUTF8(piece, status) && U_SUCCESS(status)) return false;
  status = U_ZERO_ERROR;
  out.clear();
  icu::StringByteSink<std::string> sink(&out);
  nfc->normalizeUTF8(0, piece, sink, nullptr, status);
  if (U_FAILURE(status)) {
    out.clear();
    return false;
  }
  return true;
}

struct PreTokenizer::Impl {
  pcre2_code* code = nullptr;
  ~Impl() {
    if (code != nullptr) pcre2_code_free(code);
  }
};

PreTokenizer::~PreTokenizer() = default;

Result<std::unique_ptr<PreTokenizer>> PreTokenizer::create(std::string_view pattern, bool add_prefix_space) {
  std::unique_ptr<PreTokenizer> pre(new PreTokenizer());
  pre->impl_ = std::make_unique<Impl>();
  pre->pattern_ = std::string(pattern);
  pre->add_prefix_space_ = add_prefix_space;
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  pre->impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &error_code, &error_offset, nullptr);
  if (pre->impl_->code == nullptr) {
    PCRE2_UCHAR buffer[256];
    pcre2_get_error_message(error_code, buffer, sizeof(buffer));
    return invalid_argument("pre-tokenizer regex does not compile at offset {}: {}", error_offset,
                            reinterpret_cast<const char*>(buffer));
  }
  // JIT failure (e.g. an unsupported platform) leaves the interpreter, which gives the same matches.
  pcre2_jit_compile(pre->impl_->code, PCRE2_JIT_COMPLETE);
  return pre;
}

namespace {

// Per-thread match state: pcre2 match data and a JIT stack large enough for long whitespace runs.
struct MatchState {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;
  MatchState() {
    data = pcre2_match_data_create(4, nullptr);
    context = pcre2_match_context_create(nullptr);
    jit_stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
    if (context != nullptr && jit_stack != nullptr) pcre2_jit_stack_assign(context, nullptr, jit_stack);
  }
  ~MatchState() {
    pcre2_match_data_free(data);
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(jit_stack);
  }
};

}  // namespace

void PreTokenizer::split(std::string_view text, const std::function<void(std::string_view)>& on_piece) const {
  thread_local MatchState state;
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t offset = 0;
  while (offset < text.size()) {
    int rc = pcre2_match(impl_->code, subject, text.size(), offset, PCRE2_NO_UTF_CHECK, state.data, state.context);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT || rc == PCRE2_ERROR_MATCHLIMIT) {
      // Interpreter fallback for pathological input; same semantics, no JIT stack limit.
      rc = pcre2_match(impl_->code, subject, text.size(), offset, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, state.data,
                       nullptr);
    }
    if (rc < 0) {
      on_piece(text.substr(offset));
      return;
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.data);
    size_t start = ovector[0];
    size_t end = ovector[1];
    if (start > offset) on_piece(text.substr(offset, start - offset));
    if (end == start) {
      // Empty match: step one character so the loop always advances; the character joins the next gap.
      size_t next = start + 1;
      while (next < text.size() && (static_cast<unsigned char>(text[next]) & 0xC0) == 0x80) ++next;
      if (next >= text.size()) {
        if (start < text.size()) on_piece(text.substr(start));
        return;
      }
      on_piece(text.substr(start, next - start));
      offset = next;
      continue;
    }
    on_piece(text.substr(start, end - start));
    offset = end;
  }
}

}  // namespace pd::tokenizer
