// Per-request sampling parameters (validated at the server edge; the engine
// re-checks ranges because it is also a module boundary).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
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
  bool skip_special_tokens = true;

  bool greedy() const { return temperature <= 0.0f; }
  // Checks ranges; the message names the field and the bad value.
  Status validate(int32_t vocab_size) const;
};

// A digest of every parameter that shapes the distribution of a request's
// first output token (temperature, top-k/p, min-p, seed, and the ids that
// min_tokens suppresses). Two legs of one P/D request whose keys are equal
// sample their first token from the same distribution (the same token when
// seeded or greedy), so the consumer may take the producer's token instead of
// computing the last prompt token again. Length limits, stop strings and
// output formatting are not part of it: they act after sampling, on the side
// that streams.
uint64_t first_token_sampling_key(const SamplingParams& params);

}  // namespace pd::engine
