// Our declarations of the part of llguidance's C API that pdserve calls, written for
// llguidance 1.9.1 (the version scripts/install_deps.sh pins and GrammarLibrary checks at load).
// The library ships these functions, without a header, in its Python extension; it is opened
// with dlopen, so only types and function-pointer types are declared here, no symbols.
// Layouts follow the library's published C header field for field (checked against the 1.9.1
// binary: llg_constraint_init_set_defaults fills exactly sizeof(LlgConstraintInit) = 80 bytes).
#pragma once

#include <cstddef>
#include <cstdint>

namespace pd::grammar::llg {

struct Tokenizer;  // opaque: LlgTokenizer
struct Matcher;    // opaque: LlgMatcher

struct ParserLimits {
  size_t max_items_in_row;
  uint64_t initial_lexer_fuel;
  uint64_t step_lexer_fuel;
  size_t step_max_items;
  size_t max_lexer_states;
  size_t max_grammar_size;
  bool precompute_large_lexemes;
  bool verbose_errors;
};

struct ConstraintInit {
  const Tokenizer* tokenizer;
  uint32_t log_buffer_level;
  uint32_t log_stderr_level;
  bool ff_tokens_ok;
  bool backtrack_ok;
  ParserLimits limits;
};
static_assert(sizeof(ConstraintInit) == 80, "LlgConstraintInit layout of llguidance 1.9.1");

// Thread-safe; returns the number of tokens of bytes (may exceed output_len, then only
// output_len are written).
using TokenizeFn = size_t (*)(const void* user_data, const uint8_t* bytes, size_t bytes_len, uint32_t* output,
                              size_t output_len);

// LlgTokenizerInitV2: the library reads struct_size bytes of it.
struct TokenizerInitV2 {
  size_t struct_size;
  uint32_t vocab_size;
  uint32_t tok_eos;
  const uint32_t* token_lens;
  const uint8_t* token_bytes;
  const char* tokenizer_json;
  bool tokenize_assumes_string;
  TokenizeFn tokenize_fn;
  bool use_approximate_greedy_tokenize_fn;
  const void* tokenize_user_data;
  const char* const* slices;
  const uint32_t* tok_eos_extra;
  uint32_t tok_eos_extra_count;
};
static_assert(sizeof(TokenizerInitV2) == 96, "LlgTokenizerInitV2 layout of llguidance 1.9.1");

// The functions pdserve uses; names as exported by the library.
struct Api {
  const char* (*get_version)();
  void (*constraint_init_set_defaults)(ConstraintInit* init, const Tokenizer* tokenizer);
  Tokenizer* (*new_tokenizer_v2)(const TokenizerInitV2* init, char* error, size_t error_len);
  void (*free_tokenizer)(Tokenizer* tokenizer);
  Matcher* (*new_matcher)(const ConstraintInit* init, const char* constraint_type, const char* data);
  int32_t (*validate_grammar)(const ConstraintInit* init, const char* constraint_type, const char* data, char* message,
                              size_t message_len);
  int32_t (*matcher_compute_mask_into)(Matcher* matcher, uint32_t* mask, size_t mask_byte_len);
  size_t (*matcher_get_mask_byte_size)(const Matcher* matcher);
  int32_t (*matcher_consume_token)(Matcher* matcher, uint32_t token);
  const char* (*matcher_get_error)(Matcher* matcher);
  bool (*matcher_is_error)(const Matcher* matcher);
  bool (*matcher_is_accepting)(Matcher* matcher);
  bool (*matcher_is_stopped)(const Matcher* matcher);
  int32_t (*matcher_rollback)(Matcher* matcher, size_t num_tokens);
  Matcher* (*clone_matcher)(const Matcher* matcher);
  void (*free_matcher)(Matcher* matcher);
};

}  // namespace pd::grammar::llg
