// A per-request constraint on which tokens may be sampled next (structured output). The
// engine asks it for a mask before sampling a constrained row and feeds it every token the
// request takes (sampled, or handed over by a P/D producer). Implemented outside the engine
// (src/grammar: llguidance matchers); used on the engine thread only, one object per request.
#pragma once

#include <cstdint>
#include <span>

#include "common/status.h"

namespace pd::engine {

class TokenConstraint {
 public:
  virtual ~TokenConstraint() = default;
  // Writes the ids allowed next: token id t is allowed iff bit (t % 32) of words[t / 32] is
  // set. words covers the runner's vocabulary ((vocab + 31) / 32 words); ids the constraint
  // does not know are not allowed. An error ends the request.
  virtual Status fill_allowed_mask(std::span<uint32_t> words) = 0;
  // Advances past token_id; an error (a token the mask did not allow) ends the request.
  virtual Status consume_token(int32_t token_id) = 0;
  // The constraint is complete and allows nothing but ending the output.
  virtual bool is_finished() const = 0;
};

// True when mask words allow token_id (ids beyond the words are not allowed).
inline bool mask_allows(std::span<const uint32_t> words, int32_t token_id) {
  if (token_id < 0) return false;
  const auto word = static_cast<size_t>(token_id) / 32;
  return word < words.size() && ((words[word] >> (static_cast<uint32_t>(token_id) % 32)) & 1u) != 0;
}

}  // namespace pd::engine
