#include "engine/sampling_params.h"

#include <cmath>
#include <cstring>
#include <type_traits>

namespace pd::engine {

namespace {
constexpr int32_t kMaxLogprobs = 20;
constexpr size_t kMaxStopStrings = 64;
constexpr size_t kMaxStopStringBytes = 1024;
constexpr size_t kMaxStopTokenIds = 1024;
constexpr size_t kMaxLogitBias = 1024;
constexpr size_t kMaxBadWords = 128;
constexpr size_t kMaxBadWordTokens = 512;  // >= the tokens of a 256-byte bad word and a leading space
constexpr float kMaxAbsBias = 100.0f;

Status check_token_id(const char* field, int32_t id, int32_t vocab_size) {
  if (id < 0 || (vocab_size > 0 && id >= vocab_size)) {
    return invalid_argument("{} entry {} outside the vocabulary [0, {})", field, id, vocab_size);
  }
  return Status::Ok();
}
}  // namespace

Status SamplingParams::validate(int32_t vocab_size) const {
  if (!std::isfinite(temperature) || temperature < 0.0f || temperature > 100.0f) {
    return invalid_argument("temperature must be in [0, 100], got {}", temperature);
  }
  if (!std::isfinite(top_p) || top_p <= 0.0f || top_p > 1.0f) {
    return invalid_argument("top_p must be in (0, 1], got {}", top_p);
  }
  if (top_k < -1) return invalid_argument("top_k must be -1, 0 or positive, got {}", top_k);
  if (!std::isfinite(min_p) || min_p < 0.0f || min_p > 1.0f) {
    return invalid_argument("min_p must be in [0, 1], got {}", min_p);
  }
  if (max_tokens < 1) return invalid_argument("max_tokens must be >= 1, got {}", max_tokens);
  if (min_tokens < 0 || min_tokens > max_tokens) {
    return invalid_argument("min_tokens must be in [0, max_tokens={}], got {}", max_tokens, min_tokens);
  }
  if (logprobs < -1 || logprobs > kMaxLogprobs) {
    return invalid_argument("logprobs must be in [0, {}], got {}", kMaxLogprobs, logprobs);
  }
  if (prompt_logprobs < -1 || prompt_logprobs > kMaxLogprobs) {
    return invalid_argument("prompt_logprobs must be in [0, {}], got {}", kMaxLogprobs, prompt_logprobs);
  }
  if (stop.size() > kMaxStopStrings) {
    return invalid_argument("at most {} stop strings, got {}", kMaxStopStrings, stop.size());
  }
  for (const std::string& s : stop) {
    if (s.empty()) return invalid_argument("stop strings must not be empty");
    if (s.size() > kMaxStopStringBytes) {
      return invalid_argument("stop string longer than {} bytes ({} bytes)", kMaxStopStringBytes, s.size());
    }
  }
  if (stop_token_ids.size() > kMaxStopTokenIds) {
    return invalid_argument("at most {} stop_token_ids, got {}", kMaxStopTokenIds, stop_token_ids.size());
  }
  for (int32_t id : stop_token_ids) {
    if (id < 0 || (vocab_size > 0 && id >= vocab_size)) {
      return invalid_argument("stop_token_ids entry {} outside the vocabulary [0, {})", id, vocab_size);
    }
  }
  if (!std::isfinite(presence_penalty) || presence_penalty < -2.0f || presence_penalty > 2.0f) {
    return invalid_argument("presence_penalty must be in [-2, 2], got {}", presence_penalty);
  }
  if (!std::isfinite(frequency_penalty) || frequency_penalty < -2.0f || frequency_penalty > 2.0f) {
    return invalid_argument("frequency_penalty must be in [-2, 2], got {}", frequency_penalty);
  }
  if (!std::isfinite(repetition_penalty) || repetition_penalty <= 0.0f || repetition_penalty > 2.0f) {
    return invalid_argument("repetition_penalty must be in (0, 2], got {}", repetition_penalty);
  }
  if (logit_bias.size() > kMaxLogitBias) {
    return invalid_argument("at most {} logit_bias entries, got {}", kMaxLogitBias, logit_bias.size());
  }
  for (const auto& [id, bias] : logit_bias) {
    PD_RETURN_IF_ERROR(check_token_id("logit_bias", id, vocab_size));
    if (!std::isfinite(bias) || bias < -kMaxAbsBias || bias > kMaxAbsBias) {
      return invalid_argument("logit_bias for token {} must be in [-100, 100], got {}", id, bias);
    }
  }
  if (vocab_size > 0 && allowed_token_ids.size() > static_cast<size_t>(vocab_size)) {
    return invalid_argument("allowed_token_ids has {} entries, more than the vocabulary ({})", allowed_token_ids.size(),
                            vocab_size);
  }
  for (int32_t id : allowed_token_ids) PD_RETURN_IF_ERROR(check_token_id("allowed_token_ids", id, vocab_size));
  if (bad_words_token_ids.size() > kMaxBadWords) {
    return invalid_argument("at most {} bad_words sequences, got {}", kMaxBadWords, bad_words_token_ids.size());
  }
  for (const auto& word : bad_words_token_ids) {
    if (word.empty() || word.size() > kMaxBadWordTokens) {
      return invalid_argument("a bad_words sequence must have 1 to {} tokens, got {}", kMaxBadWordTokens, word.size());
    }
    for (int32_t id : word) PD_RETURN_IF_ERROR(check_token_id("bad_words", id, vocab_size));
  }
  return Status::Ok();
}

namespace {

// FNV-1a, 64-bit: the key travels between processes, so it must not depend on
// std::hash (which may differ between builds).
class Fnv1a {
 public:
  template <typename T>
  void add(const T& value) {
    static_assert(std::is_trivially_copyable_v<T>);
    unsigned char bytes[sizeof(T)];
    std::memcpy(bytes, &value, sizeof(T));
    for (unsigned char b : bytes) {
      hash_ ^= b;
      hash_ *= 0x100000001b3ULL;
    }
  }
  uint64_t value() const { return hash_; }

 private:
  uint64_t hash_ = 0xcbf29ce484222325ULL;
};

}  // namespace

uint64_t first_token_sampling_key(const SamplingParams& params) {
  Fnv1a h;
  h.add(params.temperature);
  h.add(params.top_p);
  h.add(params.top_k);
  h.add(params.min_p);
  h.add(params.seed.has_value());
  h.add(params.seed.value_or(0));
  h.add(params.presence_penalty);
  h.add(params.frequency_penalty);
  h.add(params.repetition_penalty);
  h.add(params.logit_bias.size());
  for (const auto& [id, bias] : params.logit_bias) {
    h.add(id);
    h.add(bias);
  }
  h.add(params.allowed_token_ids.size());
  for (int32_t id : params.allowed_token_ids) h.add(id);
  h.add(params.bad_words_token_ids.size());
  for (const auto& word : params.bad_words_token_ids) {
    h.add(word.size());
    for (int32_t id : word) h.add(id);
  }
  // Only when set, so that the keys of unconstrained requests stay what they were.
  if (params.constraint_digest != 0) h.add(params.constraint_digest);
  // The first token is drawn with EOS and stop ids suppressed iff min_tokens > 0.
  const bool suppresses = params.min_tokens > 0;
  h.add(suppresses);
  if (suppresses) {
    h.add(params.ignore_eos);
    h.add(params.stop_token_ids.size());
    for (int32_t id : params.stop_token_ids) h.add(id);
  }
  return h.value();
}

}  // namespace pd::engine
