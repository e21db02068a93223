// Streaming detokenization: one instance per streamed request, used by one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "tokenizer/tokenizer.h"

namespace pd::tokenizer {

// Invariant: concatenating every push() result and the final flush() equals
// tokenizer.decode(all pushed ids, skip_special_tokens). Each chunk is valid UTF-8.
//
// Byte-level BPE decodes by concatenating token bytes, so the only state is the tail of bytes
// that may still become a character once later tokens arrive (at most 3 bytes). Bytes that can
// no longer become valid are emitted as U+FFFD exactly as the whole-sequence decode would.
class IncrementalDetokenizer {
 public:
  // prompt_ids: the request's prompt. Byte-level decoding does not depend on preceding tokens, so it
  // is only kept for the interface's sake (other tokenizer kinds need it for leading spaces).
  IncrementalDetokenizer(std::shared_ptr<const Tokenizer> tokenizer, std::span<const int32_t> prompt_ids,
                         bool skip_special_tokens);

  std::string push(int32_t token_id);  // newly completed text; never a broken UTF-8 sequence
  std::string flush();                 // any held-back text at the end (invalid bytes -> U+FFFD as HF does)

  size_t num_pending_bytes() const { return pending_.size(); }

 private:
  std::shared_ptr<const Tokenizer> tokenizer_;
  bool skip_special_tokens_;
  std::string pending_;  // bytes not yet emitted: a strict prefix of a UTF-8 sequence
};

}  // namespace pd::tokenizer
