#include "engine/output_processor.h"

#include <algorithm>

#include "tokenizer/incremental_detokenizer.h"

namespace pd::engine {

RequestOutputState::RequestOutputState(std::shared_ptr<const tokenizer::Tokenizer> tokenizer, const Request& request,
                                       std::vector<int32_t> eos_token_ids, int32_t max_model_len)
    : eos_token_ids_(std::move(eos_token_ids)), max_model_len_(max_model_len) {
  if (tokenizer != nullptr) {
    detokenizer_ = std::make_unique<tokenizer::IncrementalDetokenizer>(
        std::move(tokenizer),
        std::span<const int32_t>(request.token_ids()).first(static_cast<size_t>(request.num_prompt_tokens())),
        request.sampling().skip_special_tokens);
  }
  for (const std::string& s : request.sampling().stop) max_stop_bytes_ = std::max(max_stop_bytes_, s.size());
}

RequestOutputState::~RequestOutputState() = default;
RequestOutputState::RequestOutputState(RequestOutputState&&) noexcept = default;
RequestOutputState& RequestOutputState::operator=(RequestOutputState&&) noexcept = default;

TokenVerdict RequestOutputState::on_token(const Request& request, int32_t token_id) {
  TokenVerdict verdict;
  const SamplingParams& sp = request.sampling();
  const bool stops_allowed = request.num_output_tokens() >= sp.min_tokens;
  bool stop_token = false;
  if (stops_allowed && !sp.ignore_eos &&
      std::find(eos_token_ids_.begin(), eos_token_ids_.end(), token_id) != eos_token_ids_.end()) {
    stop_token = true;
  } else if (stops_allowed &&
             std::find(sp.stop_token_ids.begin(), sp.stop_token_ids.end(), token_id) != sp.stop_token_ids.end()) {
    stop_token = true;
    verdict.stop_token_id = token_id;
  }
  if (stop_token) {
    verdict.finished = true;
    verdict.final_state = RequestState::kFinishedStopped;
    verdict.reason = FinishReason::kStop;
    // The stop token's own text is shown only when asked for (never EOS's).
    if (detokenizer_ != nullptr && verdict.stop_token_id && sp.include_stop_str_in_output) {
      pending_text_ += detokenizer_->push(token_id);
    }
    if (detokenizer_ != nullptr) pending_text_ += detokenizer_->flush();
    verdict.text_delta = std::move(pending_text_);
    pending_text_.clear();
    return verdict;
  }

  const bool at_length =
      request.num_output_tokens() >= request.max_output_tokens() || request.num_tokens() >= max_model_len_;
  if (detokenizer_ != nullptr) {
    pending_text_ += detokenizer_->push(token_id);
    if (at_length) pending_text_ += detokenizer_->flush();
  }
  scan_stop_strings(request, at_length, &verdict);
  if (!verdict.finished && at_length) {
    verdict.finished = true;
    verdict.final_state = RequestState::kFinishedLength;
    verdict.reason = FinishReason::kLength;
  }
  return verdict;
}

void RequestOutputState::scan_stop_strings(const Request& request, bool final, TokenVerdict* verdict) {
  const SamplingParams& sp = request.sampling();
  if (sp.stop.empty() || request.num_output_tokens() < sp.min_tokens) {
    verdict->text_delta = std::move(pending_text_);
    pending_text_.clear();
    return;
  }
  // Earliest match wins; pending_text_ never starts inside an emitted match
  // because possible stop-string prefixes are held back.
  size_t best_pos = std::string::npos;
  const std::string* best = nullptr;
  for (const std::string& s : sp.stop) {
    const size_t pos = pending_text_.find(s);
    if (pos != std::string::npos && (pos < best_pos || (pos == best_pos && s.size() > best->size()))) {
      best_pos = pos;
      best = &s;
    }
  }
  if (best != nullptr) {
    verdict->finished = true;
    verdict->final_state = RequestState::kFinishedStopped;
    verdict->reason = FinishReason::kStop;
    verdict->stop_string = *best;
    verdict->text_delta = pending_text_.substr(0, best_pos + (sp.include_stop_str_in_output ? best->size() : 0));
    pending_text_.clear();
    return;
  }
  if (final) {
    verdict->text_delta = std::move(pending_text_);
    pending_text_.clear();
    return;
  }
  // Hold back the longest suffix that is a prefix of some stop string.
  size_t hold = 0;
  for (const std::string& s : sp.stop) {
    for (size_t k = std::min(s.size() - 1, pending_text_.size()); k > hold; --k) {
      if (pending_text_.compare(pending_text_.size() - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
    }
  }
  verdict->text_delta = pending_text_.substr(0, pending_text_.size() - hold);
  pending_text_.erase(0, pending_text_.size() - hold);
}

std::string RequestOutputState::flush() {
  if (detokenizer_ != nullptr) pending_text_ += detokenizer_->flush();
  std::string out = std::move(pending_text_);
  pending_text_.clear();
  return out;
}

}  // namespace pd::engine
