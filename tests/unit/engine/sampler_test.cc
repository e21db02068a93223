#include "engine/sampler.h"
#include "engine/sampling_params.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <vector>

namespace pd::engine {
namespace {

std::vector<float> ramp_logits() {
  return {0.5f, 2.0f, -1.0f, 1.5f, 0.0f, 3.0f, -2.0f, 1.0f};
}

SamplingParams random_params() {
  SamplingParams p;
  p.temperature = 1.0f;
  return p;
}

// The set of ids a filter can ever produce, observed over many seeds.
std::set<int32_t> reachable(const std::vector<float>& logits, const SamplingParams& params, int draws = 4000) {
  std::set<int32_t> ids;
  for (int i = 0; i < draws; ++i) {
    std::vector<float> row = logits;
    ids.insert(sample_token(row, params, derive_rng_seed(7, i), {}).token_id);
  }
  return ids;
}

TEST(Sampler, GreedyIsArgmax) {
  SamplingParams p;
  p.temperature = 0.0f;
  std::vector<float> row = ramp_logits();
  EXPECT_EQ(sample_token(row, p, 123, {}).token_id, 5);
}

TEST(Sampler, GreedyTieGoesToLowestId) {
  SamplingParams p;
  p.temperature = 0.0f;
  std::vector<float> row = {1.0f, 4.0f, 4.0f, 0.0f};
  EXPECT_EQ(sample_token(row, p, 0, {}).token_id, 1);
}

TEST(Sampler, SuppressedTokenIsNeverSampled) {
  SamplingParams p;
  p.temperature = 0.0f;
  std::vector<float> row = ramp_logits();
  const std::vector<int32_t> suppressed = {5, 99, -3};
  EXPECT_EQ(sample_token(row, p, 0, suppressed).token_id, 1);
  EXPECT_EQ(reachable(ramp_logits(), random_params()).count(5), 1u);
  std::set<int32_t> ids;
  for (int i = 0; i < 2000; ++i) {
    std::vector<float> r = ramp_logits();
    ids.insert(sample_token(r, random_params(), derive_rng_seed(1, i), suppressed).token_id);
  }
  EXPECT_EQ(ids.count(5), 0u);
}

TEST(Sampler, SameSeedSameToken) {
  for (int i = 0; i < 200; ++i) {
    std::vector<float> a = ramp_logits(), b = ramp_logits();
    const uint64_t seed = derive_rng_seed(42, i);
    EXPECT_EQ(sample_token(a, random_params(), seed, {}).token_id, sample_token(b, random_params(), seed, {}).token_id);
  }
}

TEST(Sampler, DifferentSeedsExploreTheDistribution) {
  // Temperature 1 over 8 tokens: every token has mass > 0.5%; 4000 draws reach all.
  EXPECT_EQ(reachable(ramp_logits(), random_params()).size(), 8u);
}

TEST(Sampler, EmpiricalFrequenciesFollowSoftmax) {
  const std::vector<float> logits = {0.0f, std::log(3.0f)};  // probabilities 0.25 / 0.75
  int ones = 0;
  constexpr int kDraws = 20000;
  for (int i = 0; i < kDraws; ++i) {
    std::vector<float> row = logits;
    ones += sample_token(row, random_params(), derive_rng_seed(3, i), {}).token_id == 1;
  }
  EXPECT_NEAR(static_cast<double>(ones) / kDraws, 0.75, 0.015);
}

TEST(Sampler, TopKKeepsExactlyTheKMostLikely) {
  SamplingParams p = random_params();
  p.top_k = 3;
  EXPECT_EQ(reachable(ramp_logits(), p), (std::set<int32_t>{5, 1, 3}));
}

TEST(Sampler, TopPKeepsTheSmallestPrefixReachingP) {
  // Probabilities 0.5, 0.25, 0.125, 0.125: top_p 0.7 keeps {0, 1}; 0.75 keeps {0, 1}; 0.76 adds one.
  const std::vector<float> logits = {std::log(4.0f), std::log(2.0f), 0.0f, 0.0f};
  SamplingParams p = random_params();
  p.top_p = 0.7f;
  EXPECT_EQ(reachable(logits, p), (std::set<int32_t>{0, 1}));
  p.top_p = 0.74f;
  EXPECT_EQ(reachable(logits, p), (std::set<int32_t>{0, 1}));
  p.top_p = 0.8f;
  EXPECT_EQ(reachable(logits, p), (std::set<int32_t>{0, 1, 2}));  // tie at 0.125 broken by lower id
  p.top_p = 0.3f;
  EXPECT_EQ(reachable(logits, p), (std::set<int32_t>{0}));
}

TEST(Sampler, TopPOverALargeVocabularySamplesOnlyFromTheExactNucleus) {
  constexpr int kVocab = 5000;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
  std::vector<float> logits(kVocab);
  for (float& v : logits) v = dist(rng);
  // Naive nucleus: full sort by probability, smallest prefix reaching 0.6.
  std::vector<int32_t> order(kVocab);
  for (int32_t i = 0; i < kVocab; ++i) order[static_cast<size_t>(i)] = i;
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return logits[static_cast<size_t>(a)] != logits[static_cast<size_t>(b)]
               ? logits[static_cast<size_t>(a)] > logits[static_cast<size_t>(b)]
               : a < b;
  });
  const float max_logit = logits[static_cast<size_t>(order[0])];
  double total = 0.0;
  for (float v : logits) total += std::exp(static_cast<double>(v - max_logit));
  std::set<int32_t> nucleus;
  double cumulative = 0.0;
  for (int32_t id : order) {
    nucleus.insert(id);
    cumulative += std::exp(static_cast<double>(logits[static_cast<size_t>(id)] - max_logit));
    if (cumulative >= 0.6 * total) break;
  }
  ASSERT_GT(nucleus.size(), 64u) << "the nucleus must be larger than the first ranking window";
  SamplingParams p = random_params();
  p.top_p = 0.6f;
  std::set<int32_t> seen;
  for (int i = 0; i < 3000; ++i) {
    std::vector<float> row = logits;
    const int32_t id = sample_token(row, p, derive_rng_seed(2, i), {}).token_id;
    EXPECT_TRUE(nucleus.contains(id)) << id;
    seen.insert(id);
  }
  EXPECT_GT(seen.size(), nucleus.size() / 2);
}

TEST(Sampler, MinPDropsTokensBelowFractionOfTheMax) {
  // Probabilities relative to max: 1, 0.5, 0.25, 0.125.
  const std::vector<float> logits = {std::log(8.0f), std::log(4.0f), std::log(2.0f), 0.0f};
  SamplingParams p = random_params();
  p.min_p = 0.3f;
  EXPECT_EQ(reachable(logits, p), (std::set<int32_t>{0, 1}));
  p.min_p = 0.2f;
  EXPECT_EQ(reachable(logits, p), (std::set<int32_t>{0, 1, 2}));
}

TEST(Sampler, LogprobsAreLogSoftmaxOfRawLogitsAndSumToOne) {
  SamplingParams p = random_params();
  p.temperature = 0.3f;  // must not change the reported logprobs
  p.logprobs = 8;
  std::vector<float> row = ramp_logits();
  SampledToken t = sample_token(row, p, 9, {});
  ASSERT_EQ(t.top_logprobs.size(), 8u);
  double total = 0.0;
  std::map<int32_t, float> by_id;
  for (auto [id, lp] : t.top_logprobs) {
    total += std::exp(lp);
    by_id[id] = lp;
  }
  EXPECT_NEAR(total, 1.0, 1e-5);
  EXPECT_FLOAT_EQ(by_id.at(t.token_id), t.logprob);
  const std::vector<float> raw = ramp_logits();
  EXPECT_NEAR(by_id.at(5) - by_id.at(1), raw[5] - raw[1], 1e-5);
  for (size_t i = 1; i < t.top_logprobs.size(); ++i) EXPECT_GE(t.top_logprobs[i - 1].second, t.top_logprobs[i].second);
}

TEST(Sampler, LogprobsZeroReportsOnlyTheSampledToken) {
  SamplingParams p;
  p.temperature = 0.0f;
  p.logprobs = 0;
  std::vector<float> row = {0.0f, 0.0f};
  SampledToken t = sample_token(row, p, 0, {});
  EXPECT_TRUE(t.top_logprobs.empty());
  EXPECT_NEAR(t.logprob, std::log(0.5f), 1e-6);
}

TEST(Sampler, TinyTemperatureDoesNotOverflow) {
  SamplingParams p = random_params();
  p.temperature = 1e-6f;
  for (int i = 0; i < 50; ++i) {
    std::vector<float> row = ramp_logits();
    EXPECT_EQ(sample_token(row, p, derive_rng_seed(5, i), {}).token_id, 5);
  }
}

TEST(Sampler, RngSeedDependsOnRequestSeedAndIndex) {
  EXPECT_NE(derive_rng_seed(1, 0), derive_rng_seed(1, 1));
  EXPECT_NE(derive_rng_seed(1, 0), derive_rng_seed(2, 0));
  EXPECT_EQ(derive_rng_seed(1, 5), derive_rng_seed(1, 5));
  const double u = uniform_from_seed(derive_rng_seed(1, 5));
  EXPECT_GE(u, 0.0);
  EXPECT_LT(u, 1.0);
}

// ---- logits processing (vLLM semantics) ----

SamplingParams greedy_params() {
  SamplingParams p;
  p.temperature = 0.0f;
  return p;
}

std::vector<float> processed(std::vector<float> logits, const SamplingParams& p, std::vector<int32_t> prompt,
                             std::vector<int32_t> output, std::vector<int32_t> suppressed = {}) {
  apply_logits_processing(logits, p, suppressed, SamplingHistory{prompt, output});
  return logits;
}

TEST(LogitsProcessing, NothingSetLeavesTheLogitsAlone) {
  const std::vector<float> raw = ramp_logits();
  EXPECT_EQ(processed(raw, SamplingParams{}, {1, 2, 3}, {5, 5}), raw);
  EXPECT_FALSE(SamplingParams{}.has_logits_processing());
}

TEST(LogitsProcessing, PresencePenaltySubtractsOnceForEveryGeneratedTokenNotThePrompt) {
  SamplingParams p;
  p.presence_penalty = 0.5f;
  const std::vector<float> raw = ramp_logits();
  auto out = processed(raw, p, /*prompt=*/{0, 1}, /*output=*/{5, 5, 5, 3});
  EXPECT_FLOAT_EQ(out[5], raw[5] - 0.5f);
  EXPECT_FLOAT_EQ(out[3], raw[3] - 0.5f);
  EXPECT_FLOAT_EQ(out[0], raw[0]);  // prompt tokens are not penalized
  EXPECT_FLOAT_EQ(out[1], raw[1]);
  EXPECT_FLOAT_EQ(out[7], raw[7]);
}

TEST(LogitsProcessing, FrequencyPenaltyScalesWithTheCountAmongGeneratedTokens) {
  SamplingParams p;
  p.frequency_penalty = 0.25f;
  const std::vector<float> raw = ramp_logits();
  auto out = processed(raw, p, {0}, {5, 5, 5, 3});
  EXPECT_FLOAT_EQ(out[5], raw[5] - 0.75f);
  EXPECT_FLOAT_EQ(out[3], raw[3] - 0.25f);
  EXPECT_FLOAT_EQ(out[0], raw[0]);
  p.frequency_penalty = -0.5f;  // negative values encourage repetition
  out = processed(raw, p, {0}, {5, 5});
  EXPECT_FLOAT_EQ(out[5], raw[5] + 1.0f);
}

TEST(LogitsProcessing, RepetitionPenaltyDividesPositiveAndMultipliesNegativeOverPromptAndOutput) {
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  const std::vector<float> raw = ramp_logits();  // raw[1] = 2, raw[2] = -1, raw[5] = 3, raw[6] = -2
  auto out = processed(raw, p, /*prompt=*/{1, 2, 2}, /*output=*/{5, 6});
  EXPECT_FLOAT_EQ(out[1], 1.0f);   // prompt, positive: divided
  EXPECT_FLOAT_EQ(out[2], -2.0f);  // prompt, negative: multiplied
  EXPECT_FLOAT_EQ(out[5], 1.5f);   // output, positive
  EXPECT_FLOAT_EQ(out[6], -4.0f);  // output, negative
  EXPECT_FLOAT_EQ(out[3], raw[3]);
  EXPECT_FLOAT_EQ(out[4], raw[4]);  // 0 stays 0 either way
}

TEST(LogitsProcessing, RepetitionThenFrequencyThenPresence) {
  SamplingParams p;
  p.repetition_penalty = 2.0f;
  p.frequency_penalty = 0.5f;
  p.presence_penalty = 0.25f;
  auto out = processed(ramp_logits(), p, {}, {5, 5});
  EXPECT_FLOAT_EQ(out[5], 3.0f / 2.0f - 2 * 0.5f - 0.25f);
}

TEST(LogitsProcessing, LogitBiasAddsToTheNamedIds) {
  SamplingParams p;
  p.logit_bias = {{2, 10.0f}, {5, -100.0f}, {99, 5.0f}};
  const std::vector<float> raw = ramp_logits();
  auto out = processed(raw, p, {}, {});
  EXPECT_FLOAT_EQ(out[2], raw[2] + 10.0f);
  EXPECT_FLOAT_EQ(out[5], raw[5] - 100.0f);
  std::vector<float> row = ramp_logits();
  EXPECT_EQ(sample_token(row, greedy_params(), 0, {}, {}).token_id, 5);
  SamplingParams g = greedy_params();
  g.logit_bias = p.logit_bias;
  row = ramp_logits();
  EXPECT_EQ(sample_token(row, g, 0, {}).token_id, 2);
}

TEST(LogitsProcessing, AllowedTokenIdsAreTheOnlyOnesEverSampled) {
  SamplingParams p = random_params();
  p.allowed_token_ids = {0, 4, 6};
  EXPECT_EQ(reachable(ramp_logits(), p), (std::set<int32_t>{0, 4, 6}));
  SamplingParams g = greedy_params();
  g.allowed_token_ids = {2, 6};
  std::vector<float> row = ramp_logits();
  EXPECT_EQ(sample_token(row, g, 0, {}).token_id, 2);
}

TEST(LogitsProcessing, BadWordBansItsLastTokenOnlyAfterItsPrefix) {
  SamplingParams p = greedy_params();
  p.bad_words_token_ids = {{7, 5}, {1}};
  // Single-token word: always banned. Two-token word: 5 banned only right after 7.
  std::vector<float> row = ramp_logits();
  std::vector<int32_t> output = {3};
  EXPECT_EQ(sample_token(row, p, 0, {}, SamplingHistory{{}, output}).token_id, 5);
  row = ramp_logits();
  output = {3, 7};
  EXPECT_EQ(sample_token(row, p, 0, {}, SamplingHistory{{}, output}).token_id, 3);  // 5 and 1 banned
  auto out = processed(ramp_logits(), p, /*prompt=*/{7}, /*output=*/{});
  EXPECT_FLOAT_EQ(out[5], 3.0f);  // the prefix must be among the generated tokens, not the prompt
  EXPECT_EQ(out[1], -std::numeric_limits<float>::infinity());
}

TEST(LogitsProcessing, LogprobsStayThoseOfTheRawLogits) {
  SamplingParams p = greedy_params();
  p.logprobs = 2;
  p.logit_bias = {{0, 50.0f}};
  p.presence_penalty = 2.0f;
  std::vector<float> row = ramp_logits();
  std::vector<int32_t> output = {5};
  SampledToken t = sample_token(row, p, 0, {}, SamplingHistory{{}, output});
  EXPECT_EQ(t.token_id, 0);
  ASSERT_EQ(t.top_logprobs.size(), 2u);
  EXPECT_EQ(t.top_logprobs[0].first, 5);  // rank of the raw distribution
  EXPECT_EQ(t.top_logprobs[1].first, 1);
  std::vector<float> plain = ramp_logits();
  SamplingParams q = greedy_params();
  q.logprobs = 0;
  EXPECT_FLOAT_EQ(t.logprob, sample_token(plain, q, 0, {}).logprob - (3.0f - 0.5f));
}

TEST(LogitsProcessing, SampleStepTokenUsesTheStepsHistory) {
  SeqStep step;
  step.sample = true;
  step.sampling = greedy_params();
  step.sampling.frequency_penalty = 2.0f;
  const std::vector<int32_t> output = {5, 5};
  step.output_token_ids = output;
  std::vector<float> row = ramp_logits();
  EXPECT_EQ(sample_step_token(row, step).token_id, 1);  // 3 - 4 < 2
  step.output_token_ids = {};
  row = ramp_logits();
  EXPECT_EQ(sample_step_token(row, step).token_id, 5);
}

TEST(SamplingParamsValidation, NamesTheFieldOfEveryOutOfRangeValue) {
  auto error_of = [](auto mutate) {
    SamplingParams p;
    mutate(p);
    Status s = p.validate(8);
    return s.ok() ? std::string() : s.message();
  };
  EXPECT_NE(error_of([](SamplingParams& p) { p.presence_penalty = 2.5f; }).find("presence_penalty"), std::string::npos);
  EXPECT_NE(error_of([](SamplingParams& p) { p.frequency_penalty = -3.0f; }).find("frequency_penalty"),
            std::string::npos);
  EXPECT_NE(error_of([](SamplingParams& p) { p.repetition_penalty = 0.0f; }).find("repetition_penalty"),
            std::string::npos);
  EXPECT_NE(error_of([](SamplingParams& p) { p.logit_bias = {{8, 1.0f}}; }).find("logit_bias"), std::string::npos);
  EXPECT_NE(error_of([](SamplingParams& p) { p.logit_bias = {{1, 101.0f}}; }).find("logit_bias"), std::string::npos);
  EXPECT_NE(error_of([](SamplingParams& p) { p.allowed_token_ids = {9}; }).find("allowed_token_ids"),
            std::string::npos);
  EXPECT_NE(error_of([](SamplingParams& p) { p.bad_words_token_ids = {{1, 8}}; }).find("bad_words"), std::string::npos);
  EXPECT_NE(error_of([](SamplingParams& p) { p.bad_words_token_ids = {{}}; }).find("bad_words"), std::string::npos);
  EXPECT_EQ(error_of([](SamplingParams& p) {
              p.presence_penalty = -2.0f;
              p.frequency_penalty = 2.0f;
              p.repetition_penalty = 2.0f;
              p.logit_bias = {{7, -100.0f}};
              p.allowed_token_ids = {0, 7};
              p.bad_words_token_ids = {{3, 4}};
            }),
            "");
}

TEST(FirstTokenSamplingKey, EqualForLegsThatSampleAlikeAndDifferentOtherwise) {
  SamplingParams a;
  a.temperature = 0.7f;
  a.top_p = 0.9f;
  a.seed = 42;
  SamplingParams leg = a;
  leg.max_tokens = 1;  // the producer leg: lengths, stop strings, formatting do not matter
  leg.stop = {"###"};
  leg.skip_special_tokens = false;
  EXPECT_EQ(first_token_sampling_key(a), first_token_sampling_key(leg));
  auto differs = [&](auto mutate) {
    SamplingParams b = a;
    mutate(b);
    return first_token_sampling_key(b) != first_token_sampling_key(a);
  };
  EXPECT_TRUE(differs([](SamplingParams& b) { b.temperature = 0.8f; }));
  EXPECT_TRUE(differs([](SamplingParams& b) { b.top_k = 5; }));
  EXPECT_TRUE(differs([](SamplingParams& b) { b.min_p = 0.1f; }));
  EXPECT_TRUE(differs([](SamplingParams& b) { b.seed = 43; }));
  EXPECT_TRUE(differs([](SamplingParams& b) { b.seed.reset(); }));
  EXPECT_TRUE(differs([](SamplingParams& b) { b.min_tokens = 2; }));             // EOS suppressed at the first token
  EXPECT_TRUE(differs([](SamplingParams& b) { b.repetition_penalty = 1.2f; }));  // the prompt counts
  EXPECT_TRUE(differs([](SamplingParams& b) { b.presence_penalty = 0.5f; }));
  EXPECT_TRUE(differs([](SamplingParams& b) { b.frequency_penalty = 0.5f; }));
  EXPECT_TRUE(differs([](SamplingParams& b) { b.logit_bias = {{3, 1.0f}}; }));
  EXPECT_TRUE(differs([](SamplingParams& b) { b.allowed_token_ids = {3}; }));
  EXPECT_TRUE(differs([](SamplingParams& b) { b.bad_words_token_ids = {{3}}; }));
  SamplingParams suppressing = a;
  suppressing.min_tokens = 2;
  SamplingParams other_ids = suppressing;
  other_ids.stop_token_ids = {7};
  EXPECT_NE(first_token_sampling_key(suppressing), first_token_sampling_key(other_ids));
  SamplingParams unsuppressed_ids = a;
  unsuppressed_ids.stop_token_ids = {7};  // min_tokens 0: stop ids act after sampling only
  EXPECT_EQ(first_token_sampling_key(a), first_token_sampling_key(unsuppressed_ids));
}

// A prompt position's entry: the next prompt token's log-softmax over the raw
// logits, its rank among all ids, and the top-n in rank order.
TEST(PromptLogprobs, EntryHasTheNextTokensLogprobRankAndTheTopN) {
  const std::vector<float> row = ramp_logits();  // ids by value: 5, 1, 3, 7, 0, 4, 2, 6
  double sum = 0.0;
  for (float v : row) sum += std::exp(static_cast<double>(v));
  const double log_norm = std::log(sum);
  const PromptPositionLogprobs entry = prompt_position_logprobs(row, /*next_token_id=*/7, /*num_top=*/3);
  EXPECT_EQ(entry.token_id, 7);
  EXPECT_NEAR(entry.logprob, 1.0 - log_norm, 1e-5);
  EXPECT_EQ(entry.rank, 4);
  ASSERT_EQ(entry.top_logprobs.size(), 3u);
  EXPECT_EQ(entry.top_logprobs[0].first, 5);
  EXPECT_EQ(entry.top_logprobs[1].first, 1);
  EXPECT_EQ(entry.top_logprobs[2].first, 3);
  EXPECT_NEAR(entry.top_logprobs[0].second, 3.0 - log_norm, 1e-5);
  EXPECT_EQ(prompt_position_logprobs(row, 5, 0).rank, 1);
  EXPECT_TRUE(prompt_position_logprobs(row, 5, 0).top_logprobs.empty());
}

TEST(PromptLogprobs, TiedLogitsShareTheBestRank) {
  const std::vector<float> row = {1.0f, 2.0f, 2.0f, 0.0f};
  EXPECT_EQ(prompt_position_logprobs(row, 2, 1).rank, 1);
  EXPECT_EQ(prompt_position_logprobs(row, 1, 1).rank, 1);
  EXPECT_EQ(prompt_position_logprobs(row, 0, 1).rank, 3);
  EXPECT_EQ(prompt_position_logprobs(row, 2, 1).top_logprobs[0].first, 1) << "top entries break ties by lower id";
}

// Positions before the last prompt token predict prompt tokens; the last one
// (and every decode position) predicts an output token.
TEST(PromptLogprobs, RowsAreThePositionsBeforeTheLastPromptToken) {
  const std::vector<int32_t> prompt = {1, 2, 3, 4, 5};
  SeqStep step;
  step.prompt_token_ids = prompt;
  step.num_computed_tokens = 0;
  step.num_new_tokens = 5;
  EXPECT_EQ(num_prompt_logprob_rows(step), 0) << "not asked for";
  step.prompt_logprobs = 0;
  EXPECT_EQ(num_prompt_logprob_rows(step), 4);
  step.num_new_tokens = 2;
  EXPECT_EQ(num_prompt_logprob_rows(step), 2);
  step.num_computed_tokens = 3;
  EXPECT_EQ(num_prompt_logprob_rows(step), 1);
  step.num_computed_tokens = 4;
  step.num_new_tokens = 1;
  EXPECT_EQ(num_prompt_logprob_rows(step), 0);
}

TEST(PromptLogprobs, ValidationBoundsTheCount) {
  SamplingParams p;
  p.prompt_logprobs = 20;
  EXPECT_TRUE(p.validate(100).ok());
  p.prompt_logprobs = 21;
  EXPECT_FALSE(p.validate(100).ok());
  p.prompt_logprobs = -2;
  EXPECT_FALSE(p.validate(100).ok());
}

// ---- structured output: the allowed-token mask ----

TEST(SamplerMask, OnlyMaskedIdsAreSampledAndLogprobsSeeTheMaskedRow) {
  // 40 ids: the mask allows 3 and 35 (bits across two words); 7 has the largest raw logit.
  std::vector<float> row(40, 0.0f);
  row[7] = 9.0f;
  row[3] = 1.0f;
  row[35] = 2.0f;
  const std::vector<uint32_t> mask = {1u << 3, 1u << (35 - 32)};
  SeqStep step;
  step.sample = true;
  step.sampling.temperature = 0.0f;
  step.sampling.logprobs = 2;
  step.allowed_token_mask = mask;
  std::vector<float> logits = row;
  SampledToken greedy = sample_step_token(logits, step);
  EXPECT_EQ(greedy.token_id, 35);
  // vLLM applies its grammar bitmask to the logits the sampler sees: the rest are -inf there.
  const float norm = std::log(std::exp(1.0f) + std::exp(2.0f));
  EXPECT_NEAR(greedy.logprob, 2.0f - norm, 1e-5);
  ASSERT_EQ(greedy.top_logprobs.size(), 2u);
  EXPECT_EQ(greedy.top_logprobs[0].first, 35);
  EXPECT_EQ(greedy.top_logprobs[1].first, 3);
  step.sampling.temperature = 1.0f;
  step.sampling.logprobs = -1;
  std::set<int32_t> seen;
  for (uint64_t seed = 0; seed < 200; ++seed) {
    logits = row;
    step.rng_seed = seed;
    seen.insert(sample_step_token(logits, step).token_id);
  }
  EXPECT_EQ(seen, (std::set<int32_t>{3, 35}));
}

TEST(SamplerMask, IdsBeyondTheMaskWordsAreNotAllowedAndAnEmptyMaskChangesNothing) {
  std::vector<float> logits(70, 0.5f);
  const std::vector<uint32_t> one_word = {1u << 4};
  apply_allowed_token_mask(logits, one_word);
  for (size_t i = 0; i < logits.size(); ++i)
    EXPECT_EQ(logits[i], i == 4 ? 0.5f : -std::numeric_limits<float>::infinity()) << i;
  std::vector<float> untouched(70, 0.5f);
  apply_allowed_token_mask(untouched, {});
  EXPECT_TRUE(std::all_of(untouched.begin(), untouched.end(), [](float v) { return v == 0.5f; }));
}

}  // namespace
}  // namespace pd::engine
