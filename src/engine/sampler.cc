#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace pd::engine {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Descending by value, ties by lower id: the one total order every ranking here uses.
struct Candidate {
  int32_t id;
  float value;
};
bool ranks_before(const Candidate& a, const Candidate& b) {
  if (a.value != b.value) return a.value > b.value;
  return a.id < b.id;
}

// log(sum(exp(logits))), shifted by the max so no term overflows.
float log_normalizer(std::span<const float> logits) {
  float max_logit = kNegInf;
  for (float v : logits) max_logit = std::max(max_logit, v);
  double sum = 0.0;
  for (float v : logits) sum += std::exp(static_cast<double>(v) - max_logit);
  return max_logit + static_cast<float>(std::log(sum));
}

// The num_top best ids of a row as (id, logit - log_norm), in rank order.
std::vector<std::pair<int32_t, float>> top_entries(std::span<const float> logits, int32_t num_top, float log_norm) {
  std::vector<std::pair<int32_t, float>> out;
  if (num_top <= 0) return out;
  const size_t k = std::min(static_cast<size_t>(num_top), logits.size());
  std::vector<Candidate> all(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) all[i] = {static_cast<int32_t>(i), logits[i]};
  std::partial_sort(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(k), all.end(), ranks_before);
  out.reserve(k);
  for (size_t i = 0; i < k; ++i) out.emplace_back(all[i].id, all[i].value - log_norm);
  return out;
}

void fill_logprobs(std::span<const float> logits, int32_t num_top, int32_t sampled_id, SampledToken* out) {
  const float log_norm = log_normalizer(logits);
  out->logprob = logits[static_cast<size_t>(sampled_id)] - log_norm;
  out->top_logprobs = top_entries(logits, num_top, log_norm);
}

int32_t argmax(std::span<const float> logits) {
  int32_t best = 0;
  for (size_t i = 1; i < logits.size(); ++i) {
    if (logits[i] > logits[static_cast<size_t>(best)]) best = static_cast<int32_t>(i);
  }
  return best;
}

}  // namespace

uint64_t derive_rng_seed(uint64_t request_seed, int32_t output_index) {
  return splitmix64(splitmix64(request_seed) ^ (static_cast<uint64_t>(static_cast<uint32_t>(output_index)) + 1));
}

double uniform_from_seed(uint64_t rng_seed) {
  return static_cast<double>(splitmix64(rng_seed) >> 11) * 0x1.0p-53;
}

void apply_logits_processing(std::span<float> logits, const SamplingParams& params,
                             std::span<const int32_t> suppressed_token_ids, const SamplingHistory& history) {
  const auto vocab = static_cast<int32_t>(logits.size());
  auto in_vocab = [vocab](int32_t id) { return id >= 0 && id < vocab; };
  if (!params.allowed_token_ids.empty()) {
    std::vector<char> allowed(logits.size(), 0);
    for (int32_t id : params.allowed_token_ids)
      if (in_vocab(id)) allowed[static_cast<size_t>(id)] = 1;
    for (size_t i = 0; i < logits.size(); ++i)
      if (!allowed[i]) logits[i] = kNegInf;
  }
  const std::span<const int32_t> output = history.output_token_ids;
  for (const std::vector<int32_t>& word : params.bad_words_token_ids) {
    if (word.empty() || word.size() - 1 > output.size()) continue;
    const size_t prefix = word.size() - 1;
    if (std::equal(word.begin(), word.end() - 1, output.end() - static_cast<std::ptrdiff_t>(prefix)) &&
        in_vocab(word.back())) {
      logits[static_cast<size_t>(word.back())] = kNegInf;
    }
  }
  // Suppression, unless it would leave nothing to sample.
  std::vector<float> saved;
  for (int32_t id : suppressed_token_ids) {
    if (!in_vocab(id)) continue;
    saved.push_back(logits[static_cast<size_t>(id)]);
    logits[static_cast<size_t>(id)] = kNegInf;
  }
  if (!saved.empty() && std::all_of(logits.begin(), logits.end(), [](float v) { return v == kNegInf; })) {
    size_t j = 0;
    for (int32_t id : suppressed_token_ids) {
      if (!in_vocab(id)) continue;
      logits[static_cast<size_t>(id)] = saved[j++];
    }
  }
  for (const auto& [id, bias] : params.logit_bias)
    if (in_vocab(id)) logits[static_cast<size_t>(id)] += bias;

  if (params.repetition_penalty != 1.0f) {
    std::vector<char> seen(logits.size(), 0);
    for (std::span<const int32_t> ids : {history.prompt_token_ids, output}) {
      for (int32_t id : ids)
        if (in_vocab(id)) seen[static_cast<size_t>(id)] = 1;
    }
    const float p = params.repetition_penalty;
    for (size_t i = 0; i < logits.size(); ++i) {
      if (!seen[i]) continue;
      logits[i] = logits[i] > 0.0f ? logits[i] / p : logits[i] * p;
    }
  }
  if ((params.frequency_penalty != 0.0f || params.presence_penalty != 0.0f) && !output.empty()) {
    std::vector<int32_t> counts(logits.size(), 0);
    for (int32_t id : output)
      if (in_vocab(id)) ++counts[static_cast<size_t>(id)];
    for (size_t i = 0; i < logits.size(); ++i) {
      if (counts[i] == 0) continue;
      logits[i] -= params.frequency_penalty * static_cast<float>(counts[i]) + params.presence_penalty;
    }
  }
}

SampledToken sample_token(std::span<float> logits, const SamplingParams& params, uint64_t rng_seed,
                          std::span<const int32_t> suppressed_token_ids, const SamplingHistory& history) {
  SampledToken out;
  if (logits.empty()) return out;
  const auto vocab = static_cast<int32_t>(logits.size());

  // Raw logits are needed for logprobs after the filters overwrote the row.
  std::vector<float> raw;
  if (params.logprobs >= 0) raw.assign(logits.begin(), logits.end());

  apply_logits_processing(logits, params, suppressed_token_ids, history);

  auto finish_greedy_fallback = [&]() {
    out.token_id = argmax(logits);
    if (params.logprobs >= 0) fill_logprobs(raw, params.logprobs, out.token_id, &out);
    return out;
  };
  if (params.greedy()) {
    out.token_id = argmax(logits);
  } else {
    // Temperature-scaled softmax probabilities (unnormalized weights are enough).
    // Shifted by the max before scaling so a tiny temperature cannot overflow.
    const float inv_temperature = 1.0f / params.temperature;
    float max_raw = kNegInf;
    for (float v : logits) max_raw = std::max(max_raw, v);
    if (max_raw == kNegInf) return finish_greedy_fallback();
    for (float& v : logits) v = v == kNegInf ? kNegInf : (v - max_raw) * inv_temperature;
    const float max_scaled = 0.0f;
    std::vector<Candidate> kept;
    kept.reserve(logits.size());
    // min-p: weight >= min_p * max weight, i.e. scaled logit >= max + log(min_p).
    const float min_scaled = params.min_p > 0.0f ? max_scaled + std::log(params.min_p) : kNegInf;
    for (int32_t i = 0; i < vocab; ++i) {
      const float v = logits[static_cast<size_t>(i)];
      if (v == kNegInf || v < min_scaled) continue;
      kept.push_back({i, std::exp(v - max_scaled)});
    }
    // Whenever top-k is set, the kept list is in rank order.
    if (params.top_k > 0 && static_cast<size_t>(params.top_k) < kept.size()) {
      std::partial_sort(kept.begin(), kept.begin() + params.top_k, kept.end(), ranks_before);
      kept.resize(static_cast<size_t>(params.top_k));
    } else if (params.top_k > 0) {
      std::sort(kept.begin(), kept.end(), ranks_before);
    }
    double total = 0.0;
    for (const Candidate& c : kept) total += c.value;
    if (params.top_p < 1.0f) {
      // Smallest prefix (in rank order) whose mass reaches top_p; always >= 1
      // token. Only as much of a large vocabulary is ranked as the nucleus
      // needs: partial sorts of a growing prefix give a full sort's order.
      const double target = static_cast<double>(params.top_p) * total;
      size_t ranked = params.top_k > 0 ? kept.size() : 0;
      double cumulative = 0.0;
      size_t keep = 0;
      while (keep < kept.size()) {
        if (keep == ranked) {
          const size_t next = std::min(kept.size(), std::max<size_t>(64, ranked * 4));
          std::partial_sort(kept.begin() + static_cast<std::ptrdiff_t>(ranked),
                            kept.begin() + static_cast<std::ptrdiff_t>(next), kept.end(), ranks_before);
          ranked = next;
        }
        cumulative += kept[keep].value;
        ++keep;
        if (cumulative >= target) break;
      }
      kept.resize(keep);
      total = cumulative;
    }
    if (kept.empty()) return finish_greedy_fallback();
    // Inverse CDF over the kept list in its (deterministic) order.
    const double u = uniform_from_seed(rng_seed) * total;
    double cumulative = 0.0;
    out.token_id = kept.back().id;
    for (const Candidate& c : kept) {
      cumulative += c.value;
      if (u < cumulative) {
        out.token_id = c.id;
        break;
      }
    }
  }

  if (params.logprobs >= 0) fill_logprobs(raw, params.logprobs, out.token_id, &out);
  return out;
}

PromptPositionLogprobs prompt_position_logprobs(std::span<const float> logits, int32_t next_token_id, int32_t num_top) {
  PromptPositionLogprobs out;
  out.token_id = next_token_id;
  if (logits.empty() || next_token_id < 0 || static_cast<size_t>(next_token_id) >= logits.size()) return out;
  const float log_norm = log_normalizer(logits);
  const float value = logits[static_cast<size_t>(next_token_id)];
  out.logprob = value - log_norm;
  out.rank =
      1 + static_cast<int32_t>(std::count_if(logits.begin(), logits.end(), [value](float v) { return v > value; }));
  out.top_logprobs = top_entries(logits, num_top, log_norm);
  return out;
}

int32_t num_prompt_logprob_rows(const SeqStep& step) {
  if (step.prompt_logprobs < 0) return 0;
  const auto last_predicting = static_cast<int32_t>(step.prompt_token_ids.size()) - 1;
  const int32_t end = std::min(step.num_computed_tokens + step.num_new_tokens, last_predicting);
  return std::max(0, end - step.num_computed_tokens);
}

void apply_allowed_token_mask(std::span<float> logits, std::span<const uint32_t> mask_words) {
  if (mask_words.empty()) return;
  for (size_t word = 0; word * 32 < logits.size(); ++word) {
    const uint32_t bits = word < mask_words.size() ? mask_words[word] : 0u;
    if (bits == ~0u) continue;
    const size_t end = std::min(logits.size(), word * 32 + 32);
    for (size_t i = word * 32; i < end; ++i)
      if (((bits >> (i - word * 32)) & 1u) == 0) logits[i] = kNegInf;
  }
}

SampledToken sample_step_token(std::span<float> logits, const SeqStep& step) {
  apply_allowed_token_mask(logits, step.allowed_token_mask);
  return sample_token(logits, step.sampling, step.rng_seed, step.suppressed_token_ids,
                      SamplingHistory{step.prompt_token_ids, step.output_token_ids});
}

}  // namespace pd::engine
