// Per-request sampling parameters (validated at the server edge; the engine
// re-checks ranges because it is also a module boundary).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace pd::engine {

struct SamplingParams {
  float temperature = 1.0f;      // 0 = greedy
  float top_p = 1.0f;            // (0, 1]
  int32_t top_k = 0;             // 0 or -1 = disabled
  float min_p = 0.0f;            // [0, 1]
  std::optional<uint64_t> seed;  // per-request seed; absent = engine-seeded
  int32_t max_tokens = 16;       // >= 1 (producer legs of P/D use 1)
  int32_t min_tokens = 0;        // stop/eos ignored until this many tokens
  bool ignore_eos = false;
  std::vector<std::string> stop;        // stop strings (need a tokenizer)
  std::vector<int32_t> stop_token_ids;  // extra stop ids besides EOS
  bool include_stop_str_in_output = false;
  int32_t logprobs = -1;  // -1 = none; n >= 0 = sampled token's logprob + top-n (n <= 20)
  // -1 = none; n >= 0 = for every prompt token after the first, its logprob and
  // rank given the tokens before it, plus the top-n there (n <= 20). Computed by
  // the prefill: such a request never reads the prefix cache for its prompt.
  int32_t prompt_logprobs = -1;
  bool skip_special_tokens = true;

  // Logits processing before temperature (vLLM's order, see sampler.h).
  float presence_penalty = 0.0f;    // [-2, 2]: subtracted once from every token already generated
  float frequency_penalty = 0.0f;   // [-2, 2]: subtracted per occurrence among generated tokens
  float repetition_penalty = 1.0f;  // (0, 2]: tokens of prompt or output: positive logits / p, negative * p
  std::vector<std::pair<int32_t, float>> logit_bias;  // added to the logit of each id ([-100, 100])
  std::vector<int32_t> allowed_token_ids;             // non-empty = only these ids may be sampled
  // Token sequences that must not be generated: the last token of a sequence
  // is banned whenever the generated tokens end with the rest of it.
  std::vector<std::vector<int32_t>> bad_words_token_ids;
  // Structured output: a digest of the request's constraint (kind and source), 0 = none. The
  // constraint itself travels as GenerateRequest::constraint; the digest keys the first token.
  uint64_t constraint_digest = 0;

  bool greedy() const { return temperature <= 0.0f; }
  // True when any of the processors above changes the logits.
  bool has_logits_processing() const {
    return presence_penalty != 0.0f || frequency_penalty != 0.0f || repetition_penalty != 1.0f || !logit_bias.empty() ||
           !allowed_token_ids.empty() || !bad_words_token_ids.empty();
  }
  // Checks ranges; the message names the field and the bad value.
  Status validate(int32_t vocab_size) const;
};

// A digest of every parameter that shapes the distribution of a request's
// first output token (temperature, top-k/p, min-p, seed, the ids that
// min_tokens suppresses, penalties, logit_bias, allowed and banned ids, the structured-output constraint). Two legs of
// one P/D request whose keys are equal sample their first token from the same distribution (the same token when seeded
// or greedy), so the consumer may take the producer's token instead of computing the last prompt token again. Length
// limits, stop strings and output formatting are not part of it: they act after sampling, on the side that streams.
uint64_t first_token_sampling_key(const SamplingParams& params);

}  // namespace pd::engine
