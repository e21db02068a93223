// Structured-output constraints over llguidance: what a request asks for (ConstraintSpec), the
// model's tokenizer as llguidance sees it (GrammarTokenizer, built once per model and shared by
// every request) and the per-request matcher the engine drives (Matcher, an
// engine::TokenConstraint).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/token_constraint.h"
#include "grammar/grammar_library.h"

namespace pd::tokenizer {
class Tokenizer;
}

namespace pd::grammar {

enum class ConstraintKind : uint8_t {
  kJsonSchema,  // source: a JSON schema (JSON text)
  kRegex,       // source: a regular expression the whole output must match
  kLark,        // source: a grammar in llguidance's Lark syntax
};
const char* constraint_kind_name(ConstraintKind kind);  // "json_schema", "regex", "lark"

struct ConstraintSpec {
  ConstraintKind kind = ConstraintKind::kJsonSchema;
  std::string source;
};

// Any JSON object (response_format json_object).
ConstraintSpec json_object_constraint();
// Exactly one of the strings (guided_choice): a regex of the escaped alternatives.
ConstraintSpec choice_constraint(const std::vector<std::string>& choices);
// The text a regex needs to match `literal` exactly.
std::string regex_escape(std::string_view literal);
// A digest of the constraint (kind and source), for first-token hand-over keys.
uint64_t constraint_digest(const ConstraintSpec& spec);

class Matcher;

class GrammarTokenizer : public std::enable_shared_from_this<GrammarTokenizer> {
 public:
  // Token i's bytes are the tokenizer's (special tokens are marked special, so no grammar
  // spells them as text); ids from the tokenizer's vocabulary up to vocab_size (the runner's,
  // which may be larger) have no bytes and are never allowed. eos_token_ids: the ids that end
  // an output (at least one).
  static Result<std::shared_ptr<const GrammarTokenizer>> create(std::shared_ptr<const GrammarLibrary> library,
                                                                std::shared_ptr<const tokenizer::Tokenizer> tokenizer,
                                                                int32_t vocab_size,
                                                                const std::vector<int32_t>& eos_token_ids);
  ~GrammarTokenizer();
  GrammarTokenizer(const GrammarTokenizer&) = delete;
  GrammarTokenizer& operator=(const GrammarTokenizer&) = delete;

  int32_t vocab_size() const { return vocab_size_; }
  // Compiles the constraint; kInvalidArgument with llguidance's message when it is invalid.
  Result<std::unique_ptr<Matcher>> new_matcher(const ConstraintSpec& spec) const;
  const GrammarLibrary& library() const { return *library_; }

 private:
  GrammarTokenizer() = default;
  std::shared_ptr<const GrammarLibrary> library_;
  std::shared_ptr<const tokenizer::Tokenizer> tokenizer_;  // the tokenize callback reads it
  llg::Tokenizer* handle_ = nullptr;
  int32_t vocab_size_ = 0;
};

// One request's position in its grammar. Not thread-safe: one owner (the engine thread once
// the request is added).
class Matcher : public engine::TokenConstraint {
 public:
  ~Matcher() override;
  Matcher(const Matcher&) = delete;
  Matcher& operator=(const Matcher&) = delete;

  Status fill_allowed_mask(std::span<uint32_t> words) override;
  Status consume_token(int32_t token_id) override;
  bool is_finished() const override;
  bool is_accepting() const;  // the output so far is complete (more may still follow)
  // An independent copy at the same position (one per choice of an n > 1 request).
  Result<std::unique_ptr<Matcher>> clone() const;

 private:
  friend class GrammarTokenizer;
  Matcher(std::shared_ptr<const GrammarTokenizer> owner, llg::Matcher* handle);
  Status error_status(const char* what) const;

  std::shared_ptr<const GrammarTokenizer> owner_;
  llg::Matcher* handle_;
  size_t mask_bytes_;
  std::vector<uint32_t> scratch_;  // when the caller's words are not exactly the matcher's size
};

}  // namespace pd::grammar
