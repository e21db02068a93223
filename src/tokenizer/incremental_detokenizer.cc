#include "tokenizer/incremental_detokenizer.h"

#include "tokenizer/utf8.h"

namespace pd::tokenizer {

IncrementalDetokenizer::IncrementalDetokenizer(std::shared_ptr<const Tokenizer> tokenizer,
                                               std::span<const int32_t> /*prompt_ids*/, bool skip_special_tokens)
    : tokenizer_(std::move(tokenizer)), skip_special_tokens_(skip_special_tokens) {}

std::string IncrementalDetokenizer::push(int32_t token_id) {
  if (skip_special_tokens_ && tokenizer_->is_special(token_id)) return {};
  pending_.append(tokenizer_->token_bytes(token_id));
  std::string out;
  size_t i = 0;
  while (i < pending_.size()) {
    const Utf8Step step = utf8_step(pending_, i);
    // A prefix cut off by the end of what we have may still complete: hold it back.
    if (step.truncated) break;
    if (step.valid) {
      out.append(pending_, i, step.num_bytes);
    } else {
      out.append(kReplacementChar);
    }
    i += step.num_bytes;
  }
  pending_.erase(0, i);
  return out;
}

std::string IncrementalDetokenizer::flush() {
  std::string out = utf8_lossy(pending_);
  pending_.clear();
  return out;
}

}  // namespace pd::tokenizer
