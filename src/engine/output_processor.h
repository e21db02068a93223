// Per-request output state on the engine thread: incremental detokenization,
// stop-string hold-back and the stop/length decision for each new token.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/engine_request.h"
#include "engine/generate_api.h"

namespace pd::tokenizer {
class Tokenizer;
class IncrementalDetokenizer;
}  // namespace pd::tokenizer

namespace pd::engine {

// What one token did to a request.
struct TokenVerdict {
  std::string text_delta;  // text now safe to emit
  bool finished = false;
  RequestState final_state = RequestState::kRunning;
  FinishReason reason = FinishReason::kNone;
  std::optional<std::string> stop_string;
  std::optional<int32_t> stop_token_id;
};

class RequestOutputState {
 public:
  // tokenizer may be null: no text, and no stop strings (rejected earlier).
  RequestOutputState(std::shared_ptr<const tokenizer::Tokenizer> tokenizer, const Request& request,
                     std::vector<int32_t> eos_token_ids, int32_t max_model_len);
  ~RequestOutputState();
  RequestOutputState(RequestOutputState&&) noexcept;
  RequestOutputState& operator=(RequestOutputState&&) noexcept;

  // `request` already holds token_id as its last output token. Decides, in
  // this order: EOS (unless ignore_eos), stop_token_ids, stop strings (all
  // only once min_tokens outputs exist), then max_tokens / max_model_len.
  TokenVerdict on_token(const Request& request, int32_t token_id);
  // Remaining held-back text when the request ends for another reason (abort,
  // error): everything the detokenizer still holds.
  std::string flush();

 private:
  // Emits what cannot be the start of a stop string; on a stop-string match
  // fills the verdict and truncates.
  void scan_stop_strings(const Request& request, bool final, TokenVerdict* verdict);

  std::unique_ptr<tokenizer::IncrementalDetokenizer> detokenizer_;
  std::vector<int32_t> eos_token_ids_;
  int32_t max_model_len_;
  std::string pending_text_;  // detokenized, not yet emitted (possible stop-string prefix)
  size_t max_stop_bytes_ = 0;
};

}  // namespace pd::engine
