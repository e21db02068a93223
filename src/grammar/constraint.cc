#include "grammar/constraint.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <string_view>

#include "tokenizer/tokenizer.h"

namespace pd::grammar {
namespace {

// llguidance's mark for a special token's bytes: such tokens never spell text.
constexpr char kSpecialTokenMarker = '\xff';
constexpr std::string_view kRegexMeta = "\\.+*?()|[]{}^$#&-~";

size_t tokenize_callback(const void* user_data, const uint8_t* bytes, size_t bytes_len, uint32_t* output,
                         size_t output_len) {
  const auto* tokenizer = static_cast<const tokenizer::Tokenizer*>(user_data);
  const std::vector<int32_t> ids = tokenizer->encode(std::string_view(reinterpret_cast<const char*>(bytes), bytes_len),
                                                     /*add_special_tokens=*/false);
  const size_t n = std::min(ids.size(), output_len);
  for (size_t i = 0; i < n; ++i) output[i] = static_cast<uint32_t>(ids[i]);
  return ids.size();
}

uint64_t fnv1a(uint64_t hash, std::string_view bytes) {
  for (unsigned char c : bytes) {
    hash ^= c;
    hash *= 0x100000001b3ull;
  }
  return hash;
}

}  // namespace

const char* constraint_kind_name(ConstraintKind kind) {
  switch (kind) {
    case ConstraintKind::kJsonSchema:
      return "json_schema";
    case ConstraintKind::kRegex:
      return "regex";
    case ConstraintKind::kLark:
      return "lark";
  }
  return "unknown";
}

ConstraintSpec json_object_constraint() {
  return ConstraintSpec{ConstraintKind::kJsonSchema, R"({"type": "object"})"};
}

std::string regex_escape(std::string_view literal) {
  std::string out;
  out.reserve(literal.size() * 2);
  for (char c : literal) {
    if (kRegexMeta.find(c) != std::string_view::npos) out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

ConstraintSpec choice_constraint(const std::vector<std::string>& choices) {
  std::string regex = "(";
  for (size_t i = 0; i < choices.size(); ++i) {
    if (i > 0) regex += '|';
    regex += regex_escape(choices[i]);
  }
  regex += ')';
  return ConstraintSpec{ConstraintKind::kRegex, std::move(regex)};
}

uint64_t constraint_digest(const ConstraintSpec& spec) {
  uint64_t hash = fnv1a(0xcbf29ce484222325ull, constraint_kind_name(spec.kind));
  hash = fnv1a(hash, std::string_view("\0", 1));
  hash = fnv1a(hash, spec.source);
  return hash == 0 ? 1 : hash;  // 0 means "no constraint"
}

Result<std::shared_ptr<const GrammarTokenizer>> GrammarTokenizer::create(
    std::shared_ptr<const GrammarLibrary> library, std::shared_ptr<const tokenizer::Tokenizer> tokenizer,
    int32_t vocab_size, const std::vector<int32_t>& eos_token_ids) {
  if (library == nullptr) return invalid_argument("grammar tokenizer needs the llguidance library");
  if (tokenizer == nullptr) return invalid_argument("structured output needs the model's tokenizer");
  if (eos_token_ids.empty()) return invalid_argument("structured output needs an end-of-sequence token id");
  const int32_t vocab = std::max(vocab_size, tokenizer->vocab_size());
  for (int32_t id : eos_token_ids) {
    if (id < 0 || id >= vocab) return invalid_argument("EOS token id {} is outside the vocabulary [0, {})", id, vocab);
  }
  std::vector<uint32_t> lens(static_cast<size_t>(vocab), 0);
  std::string bytes;
  for (int32_t id = 0; id < tokenizer->vocab_size(); ++id) {
    const std::string_view token = tokenizer->token_bytes(id);
    if (token.empty()) continue;
    const bool special = tokenizer->is_special(id);
    if (special) bytes.push_back(kSpecialTokenMarker);
    bytes.append(token);
    lens[static_cast<size_t>(id)] = static_cast<uint32_t>(token.size() + (special ? 1 : 0));
  }
  std::vector<uint32_t> extra_eos;
  for (size_t i = 1; i < eos_token_ids.size(); ++i) extra_eos.push_back(static_cast<uint32_t>(eos_token_ids[i]));

  llg::TokenizerInitV2 init{};
  init.struct_size = sizeof(init);
  init.vocab_size = static_cast<uint32_t>(vocab);
  init.tok_eos = static_cast<uint32_t>(eos_token_ids.front());
  init.token_lens = lens.data();
  init.token_bytes = reinterpret_cast<const uint8_t*>(bytes.data());
  init.tokenize_assumes_string = true;  // encode() replaces invalid UTF-8
  init.tokenize_fn = &tokenize_callback;
  init.tokenize_user_data = tokenizer.get();
  init.tok_eos_extra = extra_eos.empty() ? nullptr : extra_eos.data();
  init.tok_eos_extra_count = static_cast<uint32_t>(extra_eos.size());
  std::array<char, 1024> error{};
  llg::Tokenizer* handle = library->api().new_tokenizer_v2(&init, error.data(), error.size());
  if (handle == nullptr) return invalid_argument("llguidance refused the tokenizer: {}", error.data());

  std::shared_ptr<GrammarTokenizer> out(new GrammarTokenizer());
  out->library_ = std::move(library);
  out->tokenizer_ = std::move(tokenizer);
  out->handle_ = handle;
  out->vocab_size_ = vocab;
  return std::shared_ptr<const GrammarTokenizer>(std::move(out));
}

GrammarTokenizer::~GrammarTokenizer() {
  if (handle_ != nullptr) library_->api().free_tokenizer(handle_);
}

Result<std::unique_ptr<Matcher>> GrammarTokenizer::new_matcher(const ConstraintSpec& spec) const {
  const llg::Api& api = library_->api();
  llg::ConstraintInit init{};
  api.constraint_init_set_defaults(&init, handle_);
  init.log_stderr_level = 0;  // errors come back as messages, not on stderr
  init.limits.verbose_errors = false;
  llg::Matcher* handle = api.new_matcher(&init, constraint_kind_name(spec.kind), spec.source.c_str());
  if (handle == nullptr)
    return internal_error("llguidance returned no matcher for a {}", constraint_kind_name(spec.kind));
  std::unique_ptr<Matcher> matcher(new Matcher(shared_from_this(), handle));
  if (api.matcher_is_error(handle)) {
    const char* message = api.matcher_get_error(handle);
    return invalid_argument("invalid {}: {}", constraint_kind_name(spec.kind),
                            message != nullptr ? message : "no message");
  }
  return matcher;
}

Matcher::Matcher(std::shared_ptr<const GrammarTokenizer> owner, llg::Matcher* handle)
    : owner_(std::move(owner)),
      handle_(handle),
      mask_bytes_(owner_->library().api().matcher_get_mask_byte_size(handle)) {}

Matcher::~Matcher() {
  owner_->library().api().free_matcher(handle_);
}

Status Matcher::error_status(const char* what) const {
  const char* message = owner_->library().api().matcher_get_error(handle_);
  return invalid_argument("structured output: {}: {}", what, message != nullptr ? message : "no message");
}

Status Matcher::fill_allowed_mask(std::span<uint32_t> words) {
  const llg::Api& api = owner_->library().api();
  if (words.size_bytes() == mask_bytes_) {
    if (api.matcher_compute_mask_into(handle_, words.data(), mask_bytes_) != 0) return error_status("mask");
    return Status::Ok();
  }
  scratch_.resize(mask_bytes_ / sizeof(uint32_t));
  if (api.matcher_compute_mask_into(handle_, scratch_.data(), mask_bytes_) != 0) return error_status("mask");
  const size_t n = std::min(words.size(), scratch_.size());
  std::copy_n(scratch_.begin(), n, words.begin());
  std::fill(words.begin() + static_cast<std::ptrdiff_t>(n), words.end(), 0u);
  return Status::Ok();
}

Status Matcher::consume_token(int32_t token_id) {
  if (token_id < 0 || token_id >= owner_->vocab_size())
    return invalid_argument("structured output: token {} is outside the vocabulary", token_id);
  if (owner_->library().api().matcher_consume_token(handle_, static_cast<uint32_t>(token_id)) != 0)
    return error_status(fmt::format("token {}", token_id).c_str());
  return Status::Ok();
}

bool Matcher::is_finished() const {
  return owner_->library().api().matcher_is_stopped(handle_);
}

bool Matcher::is_accepting() const {
  return owner_->library().api().matcher_is_accepting(handle_);
}

Result<std::unique_ptr<Matcher>> Matcher::clone() const {
  llg::Matcher* copy = owner_->library().api().clone_matcher(handle_);
  if (copy == nullptr) return internal_error("llguidance could not copy a matcher");
  return std::unique_ptr<Matcher>(new Matcher(owner_, copy));
}

}  // namespace pd::grammar
