#include "engine/scheduler.h"

#include "engine/sampler.h"

#include <gtest/gtest.h>

#include <random>
#include <set>

#include "scheduler_harness.h"

namespace pd::engine {
namespace {

using testing::iota_tokens;
using testing::PlanView;
using testing::reference_outputs;
using testing::SchedulerHarness;
using testing::SeqView;

SchedulerConfig small_config(int32_t num_blocks = 64, int32_t budget = 256) {
  SchedulerConfig c;
  c.block_size = 16;
  c.num_blocks = num_blocks;
  c.max_num_batched_tokens = budget;
  c.max_num_seqs = 16;
  c.max_model_len = 1024;
  return c;
}

const SeqView* find_seq(const PlanView& plan, const std::string& id) {
  for (const SeqView& s : plan.seqs) {
    if (s.id == id) return &s;
  }
  return nullptr;
}

TEST(Scheduler, FullPromptPrefixHitStillComputesTheLastToken) {
  SchedulerHarness h(small_config());
  h.add("a", iota_tokens(33), 1);
  h.run_until_idle();
  h.add("b", iota_tokens(33), 1);
  PlanView plan = h.step();
  const SeqView* b = find_seq(plan, "b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->num_computed_tokens, 32);
  EXPECT_EQ(b->num_new_tokens, 1);
  EXPECT_TRUE(b->sample);
  EXPECT_EQ(h.outputs("b"), reference_outputs(iota_tokens(33), 1));
}

// vLLM v1's rule: prompt logprobs come from computing every prompt position,
// so such a request reads nothing from the prefix cache; each prefill chunk
// asks the runner for the rows of the positions before the last prompt token.
TEST(Scheduler, PromptLogprobsRequestComputesItsWholePromptInChunksWithoutPrefixHits) {
  SchedulerHarness h(small_config(64, 16));
  h.add("a", iota_tokens(33), 1);
  h.run_until_idle();
  SamplingParams sampling;
  sampling.temperature = 0.0f;
  sampling.max_tokens = 2;
  sampling.prompt_logprobs = 3;
  ASSERT_TRUE(
      h.scheduler.add_request(std::make_unique<Request>("b", 100, iota_tokens(33), sampling, std::nullopt, 0, 0, 2))
          .ok());
  std::vector<int32_t> chunk_starts, rows_per_chunk, asked;
  for (int step = 0; step < 8 && h.scheduler.has_unfinished(); ++step) {
    PlanView plan = h.step();
    ASSERT_EQ(plan.seqs.size(), 1u);
    const SeqStep& seq = h.last_input.seqs[0];
    if (plan.seqs[0].num_computed_tokens >= 33) {
      EXPECT_EQ(seq.prompt_logprobs, -1) << "a decode step asks for no prompt rows";
      continue;
    }
    chunk_starts.push_back(plan.seqs[0].num_computed_tokens);
    asked.push_back(seq.prompt_logprobs);
    EXPECT_EQ(seq.prompt_token_ids.size(), seq.prompt_logprobs >= 0 ? 33u : 0u);
    rows_per_chunk.push_back(num_prompt_logprob_rows(seq));
  }
  EXPECT_EQ(chunk_starts, (std::vector<int32_t>{0, 16, 32})) << "no prefix hit although 'a' cached the prompt";
  EXPECT_EQ(rows_per_chunk, (std::vector<int32_t>{16, 16, 0})) << "positions 0..31 predict prompt tokens 1..32";
  EXPECT_EQ(asked, (std::vector<int32_t>{3, 3, -1})) << "the last prompt token's logits predict an output token";
  EXPECT_EQ(h.scheduler.counters().num_prefix_cache_hit_tokens, 0);
}

TEST(Scheduler, BlockAlignedFullPromptHitRecomputesItsLastBlock) {
  SchedulerHarness h(small_config());
  h.add("a", iota_tokens(32), 1);
  h.run_until_idle();
  h.add("b", iota_tokens(32), 1);
  PlanView plan = h.step();
  const SeqView* b = find_seq(plan, "b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->num_computed_tokens, 16) << "the block holding the last token is not taken from the cache";
  EXPECT_EQ(b->num_new_tokens, 16);
  EXPECT_TRUE(b->sample);
  EXPECT_EQ(h.last_input.seqs[0].block_table.size(), 2u);
}

TEST(Scheduler, IdenticalPromptsInOneBatchNeverHitBlocksNotYetComputed) {
  SchedulerHarness h(small_config());
  h.add("a", iota_tokens(40), 3);
  h.add("b", iota_tokens(40), 3);
  PlanView first = h.step();
  ASSERT_EQ(first.seqs.size(), 2u);
  EXPECT_EQ(first.seqs[0].num_computed_tokens, 0);
  EXPECT_EQ(first.seqs[1].num_computed_tokens, 0) << "b must not read a's blocks before they are written";
  std::set<int32_t> a_blocks(h.last_input.seqs[0].block_table.begin(), h.last_input.seqs[0].block_table.end());
  for (int32_t id : h.last_input.seqs[1].block_table) EXPECT_FALSE(a_blocks.contains(id));
  h.run_until_idle();
  EXPECT_EQ(h.outputs("a"), reference_outputs(iota_tokens(40), 3));
  EXPECT_EQ(h.outputs("b"), h.outputs("a"));
  // Only one copy of each full block became cacheable; a newcomer hits it.
  h.add("c", iota_tokens(40), 1);
  PlanView later = h.step();
  EXPECT_EQ(find_seq(later, "c")->num_computed_tokens, 32);
}

TEST(Scheduler, RequestsInTheSameBatchShareBlocksComputedInEarlierSteps) {
  SchedulerHarness h(small_config(64, 48));
  h.add("a", iota_tokens(100), 2);
  PlanView s1 = h.step();  // a: tokens [0, 48)
  EXPECT_EQ(find_seq(s1, "a")->num_new_tokens, 48);
  h.add("b", iota_tokens(100), 2);
  PlanView s2 = h.step();  // a continues first, b admitted with the 3 blocks a finished
  ASSERT_NE(find_seq(s2, "a"), nullptr);
  const SeqView* b = find_seq(s2, "b");
  if (b == nullptr) {
    // a consumed the whole budget: b comes next step and still hits.
    s2 = h.step();
    b = find_seq(s2, "b");
  }
  ASSERT_NE(b, nullptr);
  EXPECT_GE(b->num_computed_tokens, 48);
  EXPECT_EQ(b->num_computed_tokens % 16, 0);
  h.run_until_idle();
  EXPECT_EQ(h.outputs("a"), reference_outputs(iota_tokens(100), 2));
  EXPECT_EQ(h.outputs("b"), h.outputs("a"));
}

TEST(Scheduler, TokenBudgetSplitsPrefillIntoChunksAndServesRunningFirst) {
  SchedulerHarness h(small_config(64, 32));
  h.add("a", iota_tokens(80), 4);
  PlanView s1 = h.step();
  EXPECT_EQ(s1.num_batched_tokens, 32);
  EXPECT_FALSE(s1.seqs[0].sample);
  h.add("b", iota_tokens(20, 500), 4);
  PlanView s2 = h.step();
  ASSERT_EQ(s2.seqs.size(), 1u) << "the running chunked prefill takes the whole budget first";
  EXPECT_EQ(s2.seqs[0].id, "a");
  PlanView s3 = h.step();  // a's last 16 tokens, then b's first 16
  ASSERT_EQ(s3.seqs.size(), 2u);
  EXPECT_EQ(s3.seqs[0].num_new_tokens, 16);
  EXPECT_TRUE(s3.seqs[0].sample);
  EXPECT_EQ(s3.seqs[1].num_new_tokens, 16);
  EXPECT_FALSE(s3.seqs[1].sample);
  for (int i = 0; i < 20; ++i) {
    PlanView p = h.step();
    EXPECT_LE(p.num_batched_tokens, 32);
  }
  h.run_until_idle();
  EXPECT_EQ(h.outputs("a"), reference_outputs(iota_tokens(80), 4));
  EXPECT_EQ(h.outputs("b"), reference_outputs(iota_tokens(20, 500), 4));
}

TEST(Scheduler, WithoutChunkedPrefillAPromptWaitsForRoomForAllOfIt) {
  SchedulerConfig c = small_config(64, 40);
  c.enable_chunked_prefill = false;
  SchedulerHarness h(c);
  h.add("a", iota_tokens(30), 3);
  h.add("b", iota_tokens(30, 100), 3);
  PlanView s1 = h.step();
  ASSERT_EQ(s1.seqs.size(), 1u);
  EXPECT_EQ(s1.seqs[0].num_new_tokens, 30);
  PlanView s2 = h.step();  // a decodes (1 token), b's 30 fit into the remaining 39
  ASSERT_EQ(s2.seqs.size(), 2u);
  EXPECT_EQ(s2.seqs[1].num_new_tokens, 30);
}

TEST(Scheduler, MaxNumSeqsCapsTheRunningSet) {
  SchedulerConfig c = small_config();
  c.max_num_seqs = 2;
  SchedulerHarness h(c);
  for (int i = 0; i < 4; ++i) h.add("r" + std::to_string(i), iota_tokens(5, 10 * i), 3);
  PlanView s1 = h.step();
  EXPECT_EQ(s1.seqs.size(), 2u);
  EXPECT_EQ(h.scheduler.num_running(), 2);
  EXPECT_EQ(h.scheduler.num_waiting(), 2);
  h.run_until_idle();
  EXPECT_EQ(h.finished.size(), 4u);
}

TEST(Scheduler, PreemptionTakesTheTailAndItsRecomputeGivesTheSameOutput) {
  // 6 blocks of 16: two 40-token prompts take 3 blocks each, so the first
  // decode token past 48 needs a 4th block and preempts the tail request.
  SchedulerHarness h(small_config(6, 256));
  h.add("a", iota_tokens(40), 12);
  h.add("b", iota_tokens(40, 300), 12);
  int64_t preemptions = 0;
  std::string first_preempted;
  for (int i = 0; i < 200 && h.scheduler.has_unfinished(); ++i) {
    PlanView p = h.step();
    if (!p.preempted_request_ids.empty() && first_preempted.empty()) first_preempted = p.preempted_request_ids[0];
    preemptions += static_cast<int64_t>(p.preempted_request_ids.size());
  }
  EXPECT_GE(preemptions, 1);
  EXPECT_EQ(first_preempted, "b");
  EXPECT_EQ(h.outputs("a"), reference_outputs(iota_tokens(40), 12));
  EXPECT_EQ(h.outputs("b"), reference_outputs(iota_tokens(40, 300), 12));
  EXPECT_EQ(h.scheduler.block_pool().num_free_blocks(), 6);
}

TEST(Scheduler, PreemptionAfterAPrefixHitKeepsTheSharedBlocksAndHitsAgain) {
  SchedulerHarness h(small_config(8, 256));
  h.add("warm", iota_tokens(33), 1);
  h.run_until_idle();                    // blocks for tokens [0, 32) cached
  h.add("a", iota_tokens(40, 700), 40);  // 3 blocks, grows to 5
  h.add("b", iota_tokens(33), 30);       // hits 2 blocks, grows to 4
  PlanView s1 = h.step();
  EXPECT_EQ(find_seq(s1, "b")->num_computed_tokens, 32);
  bool b_preempted = false;
  bool b_hit_again = false;
  for (int i = 0; i < 200 && h.scheduler.has_unfinished(); ++i) {
    PlanView p = h.step();
    for (const auto& id : p.preempted_request_ids) b_preempted |= id == "b";
    const SeqView* b = find_seq(p, "b");
    if (b_preempted && b != nullptr && b->newly_admitted) b_hit_again = b->num_computed_tokens >= 32;
  }
  EXPECT_TRUE(b_preempted);
  EXPECT_TRUE(b_hit_again) << "the prompt blocks kept their hashes after the preemption";
  EXPECT_EQ(h.outputs("a"), reference_outputs(iota_tokens(40, 700), 40));
  EXPECT_EQ(h.outputs("b"), reference_outputs(iota_tokens(33), 30));
  EXPECT_EQ(h.scheduler.block_pool().num_free_blocks(), 8);
}

TEST(Scheduler, StepInputCarriesTokensBlockTablesAndSeeds) {
  SchedulerHarness h(small_config());
  h.add("a", iota_tokens(20), 2);
  h.step();
  const StepInput& in = h.last_input;
  ASSERT_EQ(in.seqs.size(), 1u);
  EXPECT_EQ(in.token_ids, iota_tokens(20));
  EXPECT_EQ(in.seqs[0].block_table.size(), 2u);
  EXPECT_TRUE(in.seqs[0].sample);
  h.step();
  ASSERT_EQ(h.last_input.token_ids.size(), 1u);
  EXPECT_EQ(h.last_input.seqs[0].num_computed_tokens, 20);
  EXPECT_EQ(h.last_input.seqs[0].num_output_tokens, 1);
}

TEST(Scheduler, MinTokensSuppressesEosAndStopIds) {
  SchedulerConfig c = small_config();
  c.eos_token_ids = {2};
  Scheduler s(c, nullptr);
  SamplingParams p;
  p.min_tokens = 1;
  p.stop_token_ids = {7};
  ASSERT_TRUE(s.add_request(std::make_unique<Request>("a", 0, iota_tokens(4), p, std::nullopt, 0, 0, 4)).ok());
  std::vector<FinishedRequest> failed;
  StepPlan plan = s.schedule(&failed);
  StepInput in = s.build_step_input(plan);
  EXPECT_EQ(std::set<int32_t>(in.seqs[0].suppressed_token_ids.begin(), in.seqs[0].suppressed_token_ids.end()),
            (std::set<int32_t>{2, 7}));
}

TEST(Scheduler, DuplicateLiveIdIsRejected) {
  Scheduler s(small_config(), nullptr);
  ASSERT_TRUE(
      s.add_request(std::make_unique<Request>("x", 0, iota_tokens(4), SamplingParams{}, std::nullopt, 0, 0, 4)).ok());
  EXPECT_EQ(
      s.add_request(std::make_unique<Request>("x", 1, iota_tokens(4), SamplingParams{}, std::nullopt, 0, 0, 4)).code(),
      ErrorCode::kInvalidArgument);
}

// Property: after any mix of finished, aborted and preempted requests, every
// block is back in the pool with ref count 0, and every finished request's
// output equals the reference (no wrong prefix hit, no lost KV).
TEST(Scheduler, RandomMixReturnsEveryBlockAndKeepsOutputsExact) {
  for (uint32_t seed : {1u, 2u, 3u, 4u, 5u}) {
    std::mt19937 rng(seed);
    SchedulerConfig c = small_config(12, 64);
    c.max_num_seqs = 6;
    c.enable_chunked_prefill = seed % 2 == 1;
    if (!c.enable_chunked_prefill) c.max_num_batched_tokens = 128;
    SchedulerHarness h(c);
    // Few distinct prefixes so prompts share cached blocks.
    std::vector<std::vector<int32_t>> prefixes = {iota_tokens(32, 1), iota_tokens(48, 100), iota_tokens(16, 900)};
    std::map<std::string, std::pair<std::vector<int32_t>, int32_t>> specs;
    std::set<std::string> aborted;
    int next_id = 0;
    for (int op = 0; op < 1500; ++op) {
      const int kind = static_cast<int>(rng() % 10);
      if (kind < 3) {
        std::vector<int32_t> prompt = prefixes[rng() % prefixes.size()];
        const size_t cut = std::min<size_t>(rng() % 20, prompt.size() - 1);
        prompt.resize(prompt.size() - cut);
        for (uint32_t k = rng() % 12; k > 0; --k) prompt.push_back(static_cast<int32_t>(rng() % 50));
        const int32_t max_tokens = 1 + static_cast<int32_t>(rng() % 40);
        const std::string id = "r" + std::to_string(next_id++);
        specs[id] = {prompt, max_tokens};
        h.add(id, prompt, max_tokens);
      } else if (kind == 3) {
        auto live = h.scheduler.live_requests();
        if (!live.empty()) {
          const std::string id = live[rng() % live.size()]->request_id();
          aborted.insert(id);
          h.abort(id);
        }
      } else {
        h.step();
      }
      if (::testing::Test::HasFatalFailure()) return;
    }
    h.run_until_idle();
    EXPECT_EQ(h.scheduler.block_pool().num_free_blocks(), 12) << "seed " << seed;
    for (int32_t id = 0; id < 12; ++id) EXPECT_EQ(h.scheduler.block_pool().ref_count(id), 0);
    EXPECT_TRUE(h.scheduler.block_pool().check_invariants().ok());
    EXPECT_GT(h.scheduler.counters().num_preemptions, 0) << "seed " << seed << " never preempted";
    EXPECT_GT(h.scheduler.counters().num_prefix_cache_hit_tokens, 0) << "seed " << seed << " never hit";
    for (const auto& [id, spec] : specs) {
      if (aborted.contains(id)) continue;
      ASSERT_EQ(h.outputs(id), reference_outputs(spec.first, spec.second)) << "seed " << seed << " request " << id;
    }
  }
}

TEST(Scheduler, QueuedPrefillTokensAreThePromptTokensNotComputedYet) {
  SchedulerHarness h(small_config(64, 32));
  h.add("a", iota_tokens(80), 1);
  h.add("b", iota_tokens(40, 1000), 1);
  EXPECT_EQ(h.scheduler.num_queued_prefill_tokens(), 120);
  h.step();  // 32 tokens of a's prompt
  EXPECT_EQ(h.scheduler.num_queued_prefill_tokens(), 88);
  h.run_until_idle();
  EXPECT_EQ(h.scheduler.num_queued_prefill_tokens(), 0);
}

TEST(Scheduler, RecordsCacheEventsForTheConnectorWhenConfigured) {
  SchedulerConfig config = small_config();
  config.record_cache_events = true;
  SchedulerHarness h(config);
  h.add("a", iota_tokens(40), 1);
  h.run_until_idle();
  const std::vector<KvCacheEvent> events = h.scheduler.take_cache_events();
  ASSERT_EQ(events.size(), 2u);  // two full prompt blocks
  for (const KvCacheEvent& e : events) EXPECT_TRUE(e.stored);
  const std::vector<int32_t> prompt = iota_tokens(40);
  const std::span<const int32_t> tokens(prompt);
  const BlockHash first = hash_block_tokens(std::nullopt, tokens.subspan(0, 16));
  EXPECT_EQ(events[0].hash, first);
  EXPECT_EQ(events[1].hash, hash_block_tokens(first, tokens.subspan(16, 16)));  // chained on the first
}

}  // namespace
}  // namespace pd::engine
