// Token sampling from one row of logits. Pure function of its inputs: the
// same (logits, params, rng_seed, suppressed ids) always gives the same token,
// on any runner, so CPU and CUDA runners share this code for the final pick.
//
// Order (vLLM v1's): allowed_token_ids (every other id -inf), bad words
// (-inf), suppression (-inf) and logit_bias, penalties (repetition over
// prompt + output, then frequency and presence over the output), then
// temperature, min-p (relative to the most likely token), top-k, top-p (on
// the distribution renormalized after top-k). The returned logprobs are always
// the log-softmax of the RAW logits, before any of this.
#pragma once

#include <cstdint>
#include <span>

#include "engine/model_runner.h"
#include "engine/sampling_params.h"

namespace pd::engine {

// The seed of one sampling draw: counter-based (request seed, output index),
// so a request's n-th token is reproducible independent of batching, steps or
// preemption. request_seed is SamplingParams::seed when set, otherwise derived
// by the engine from --seed and the request's arrival counter.
uint64_t derive_rng_seed(uint64_t request_seed, int32_t output_index);

// Uniform double in [0, 1) from a 64-bit seed (splitmix64 finalizer).
double uniform_from_seed(uint64_t rng_seed);

// The tokens a request has seen, for penalties and bad words. Views into the
// request's token list, valid for the call.
struct SamplingHistory {
  std::span<const int32_t> prompt_token_ids;
  std::span<const int32_t> output_token_ids;
};

// Applies allowed_token_ids, bad words, suppression, logit_bias and the
// penalties to `logits` in place (the steps before temperature). Ids outside
// the vocabulary are ignored.
void apply_logits_processing(std::span<float> logits, const SamplingParams& params,
                             std::span<const int32_t> suppressed_token_ids, const SamplingHistory& history);

// Samples one token. `logits` is vocab-sized and is used as scratch (its
// contents are unspecified afterwards). Suppressed ids outside the vocab are
// ignored. If every token is suppressed the suppression is ignored (a token
// must come out; the engine only suppresses EOS/stop ids during min_tokens).
// top_logprobs has min(params.logprobs, vocab) entries, descending by logprob,
// ties by lower id; empty when params.logprobs <= 0.
SampledToken sample_token(std::span<float> logits, const SamplingParams& params, uint64_t rng_seed,
                          std::span<const int32_t> suppressed_token_ids, const SamplingHistory& history = {});

// Prompt logprobs at one position from its raw logits row: the log-softmax at
// next_token_id (the prompt token that follows), its rank (1 + the ids with a
// strictly larger logit) and the top num_top entries (ranking as above).
PromptPositionLogprobs prompt_position_logprobs(std::span<const float> logits, int32_t next_token_id, int32_t num_top);

// How many of a step's new positions need prompt logprobs: those before the
// last prompt token (its logits predict an output token, not a prompt token),
// counted from the step's first new position. 0 when the step does not ask.
int32_t num_prompt_logprob_rows(const SeqStep& step);

// Sets every id the mask does not allow to -inf (SeqStep::allowed_token_mask; ids beyond the
// mask's words are not allowed). An empty mask changes nothing.
void apply_allowed_token_mask(std::span<float> logits, std::span<const uint32_t> mask_words);

// sample_token for one sequence of a step: its params, seed, suppressed ids
// and token history, after its allowed-token mask. What every runner calls for
// a row it samples on the host.
SampledToken sample_step_token(std::span<float> logits, const SeqStep& step);

}  // namespace pd::engine
