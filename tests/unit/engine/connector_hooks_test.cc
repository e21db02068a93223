// The scheduler's side of the P/D connector contract (kv_connector.h), driven
// by a scripted connector: each test is one of DESIGN.md §6's failure modes.
#include <gtest/gtest.h>

#include <map>

#include "engine/kv_connector.h"
#include "scheduler_harness.h"

namespace pd::engine {
namespace {

using testing::iota_tokens;
using testing::reference_outputs;
using testing::SchedulerHarness;

// Answers from a script and records every call.
class ScriptedConnector : public KvConnector {
 public:
  ExternalMatch match;  // answer to get_num_new_matched_tokens
  bool fail_match = false;
  bool delay_free_on_finish = false;
  bool hold_on_preempt = false;
  RemoteKvTimeoutAction timeout_action = RemoteKvTimeoutAction::kFail;
  contract::ProducerAnswer finish_params = {"t-1", {}, contract::TransferMode::kWrite, 0, std::nullopt};

  int num_match_calls = 0;
  int num_alloc_calls = 0;
  std::vector<int32_t> alloc_block_ids;
  int32_t alloc_external_tokens = 0;
  std::vector<std::string> finished_ids;
  std::vector<std::vector<int32_t>> finished_blocks;
  std::vector<std::string> preempted_ids;
  std::vector<std::string> timed_out_ids;

  void bind_engine_wakeup(std::function<void()>) override {}
  Result<ExternalMatch> get_num_new_matched_tokens(const Request&, int32_t) override {
    ++num_match_calls;
    if (fail_match) return invalid_argument("kv_transfer_params: missing transfer_id");
    return match;
  }
  void update_state_after_alloc(const Request&, std::span<const int32_t> block_ids, int32_t num_external) override {
    ++num_alloc_calls;
    alloc_block_ids.assign(block_ids.begin(), block_ids.end());
    alloc_external_tokens = num_external;
  }
  LayerKvHooks* build_step_hooks(const StepInput&, const StepPlan&) override { return nullptr; }
  void after_step(const StepPlan&, const Status&) override {}
  ConnectorEvents poll() override { return {}; }
  bool request_preempted(const Request& r, std::span<const int32_t>) override {
    preempted_ids.push_back(r.request_id());
    return hold_on_preempt;
  }
  FinishDecision request_finished(const Request& r, std::span<const int32_t> block_ids) override {
    finished_ids.push_back(r.request_id());
    finished_blocks.emplace_back(block_ids.begin(), block_ids.end());
    return FinishDecision{delay_free_on_finish, finish_params};
  }
  RemoteKvTimeoutAction on_remote_kv_timeout(const Request& r) override {
    timed_out_ids.push_back(r.request_id());
    return timeout_action;
  }
};

SchedulerConfig config(int32_t num_blocks = 32) {
  SchedulerConfig c;
  c.block_size = 16;
  c.num_blocks = num_blocks;
  c.max_num_batched_tokens = 256;
  c.max_num_seqs = 8;
  c.max_model_len = 1024;
  return c;
}

contract::TransferParams consumer_params() {
  contract::TransferParams params;
  params.side = contract::TransferSide::kConsumer;
  params.transfer_id = "t-1";
  return params;
}
const contract::TransferParams kParams = consumer_params();

void deliver(SchedulerHarness& h, ConnectorEvents events) {
  h.scheduler.apply_load_errors(events.load_errors);
  h.scheduler.apply_connector_events(events);
}

TEST(ConnectorHooks, RequestWithoutTransferParamsNeverAsksForExternalKv) {
  ScriptedConnector conn;
  conn.match = {40, true, 1000};
  SchedulerHarness h(config(), &conn);
  h.add("plain", iota_tokens(50), 3);
  h.run_until_idle();
  EXPECT_EQ(conn.num_match_calls, 0);
  EXPECT_EQ(conn.num_alloc_calls, 0);
  EXPECT_EQ(h.outputs("plain"), reference_outputs(iota_tokens(50), 3));
  EXPECT_EQ(conn.finished_ids, std::vector<std::string>{"plain"}) << "request_finished is called for every request";
}

TEST(ConnectorHooks, AsyncLoadWaitsForRemoteKvThenComputesOnlyTheRest) {
  ScriptedConnector conn;
  conn.match = {48, true, 60'000};
  SchedulerHarness h(config(), &conn);
  Request* r = h.add("pd", iota_tokens(50), 2, kParams);
  auto plan = h.step();
  EXPECT_TRUE(plan.seqs.empty());
  EXPECT_EQ(r->state(), RequestState::kWaitingForRemoteKv);
  EXPECT_EQ(conn.alloc_external_tokens, 48);
  EXPECT_EQ(conn.alloc_block_ids.size(), 3u) << "blocks for the 48 external tokens";
  EXPECT_EQ(h.scheduler.num_waiting(), 1);
  h.step();  // nothing arrives: still waiting
  EXPECT_EQ(r->state(), RequestState::kWaitingForRemoteKv);
  deliver(h, ConnectorEvents{{"pd"}, {}, {}, {}, {}});
  plan = h.step();
  ASSERT_EQ(plan.seqs.size(), 1u);
  EXPECT_EQ(plan.seqs[0].num_computed_tokens, 48);
  EXPECT_EQ(plan.seqs[0].num_new_tokens, 2);
  h.run_until_idle();
  EXPECT_EQ(h.outputs("pd"), reference_outputs(iota_tokens(50), 2));
  EXPECT_EQ(conn.num_match_calls, 1);
}

TEST(ConnectorHooks, ExternalMatchOfTheWholePromptStillComputesTheLastToken) {
  ScriptedConnector conn;
  conn.match = {64, false, 0};
  SchedulerHarness h(config(), &conn);
  h.add("pd", iota_tokens(64), 1, kParams);
  auto plan = h.step();
  ASSERT_EQ(plan.seqs.size(), 1u);
  EXPECT_EQ(plan.seqs[0].num_computed_tokens, 63);
  EXPECT_EQ(plan.seqs[0].num_new_tokens, 1);
  EXPECT_EQ(conn.alloc_external_tokens, 63);
}

TEST(ConnectorHooks, PreemptedRequestRecomputesLocallyInsteadOfWaitingAgain) {
  ScriptedConnector conn;
  conn.match = {32, true, 60'000};
  SchedulerHarness h(config(5), &conn);
  h.add("pd", iota_tokens(40), 30, kParams);  // grows to 70 tokens = 5 blocks
  h.step();
  deliver(h, ConnectorEvents{{"pd"}, {}, {}, {}, {}});
  h.add("other", iota_tokens(20, 500), 20);  // competes for the 5 blocks
  bool preempted = false;
  for (int i = 0; i < 200 && h.scheduler.has_unfinished(); ++i) {
    auto p = h.step();
    for (const auto& id : p.preempted_request_ids) preempted |= id == "pd" || id == "other";
    ASSERT_EQ(h.scheduler.num_remote_waiting(), 0) << "a re-admitted request never waits for KV again";
  }
  EXPECT_TRUE(preempted);
  EXPECT_EQ(conn.num_match_calls, 1);
  EXPECT_EQ(h.outputs("pd"), reference_outputs(iota_tokens(40), 30));
  EXPECT_EQ(h.outputs("other"), reference_outputs(iota_tokens(20, 500), 20));
}

TEST(ConnectorHooks, AbortWhileWaitingForRemoteKvFreesItsBlocks) {
  ScriptedConnector conn;
  conn.match = {48, true, 60'000};
  SchedulerHarness h(config(8), &conn);
  h.add("pd", iota_tokens(50), 2, kParams);
  h.step();
  EXPECT_EQ(h.scheduler.block_pool().num_free_blocks(), 5);
  h.abort("pd");
  ASSERT_EQ(conn.finished_ids, std::vector<std::string>{"pd"});
  EXPECT_EQ(conn.finished_blocks[0].size(), 3u);
  EXPECT_EQ(h.scheduler.block_pool().num_free_blocks(), 8);
  EXPECT_FALSE(h.scheduler.is_id_in_use("pd"));
}

TEST(ConnectorHooks, AbortedWaiterWhoseWriteMayStillLandKeepsBlocksUntilReported) {
  ScriptedConnector conn;
  conn.match = {48, true, 60'000};
  conn.delay_free_on_finish = true;
  SchedulerHarness h(config(8), &conn);
  h.add("pd", iota_tokens(50), 2, kParams);
  h.step();
  h.abort("pd");
  EXPECT_EQ(h.scheduler.block_pool().num_free_blocks(), 5) << "held: a producer write may still land";
  EXPECT_TRUE(h.scheduler.is_id_in_use("pd"));
  deliver(h, ConnectorEvents{{"pd"}, {}, {}, {}, {}});
  EXPECT_EQ(h.scheduler.block_pool().num_free_blocks(), 8);
  EXPECT_FALSE(h.scheduler.is_id_in_use("pd"));
}

TEST(ConnectorHooks, ProducerHoldsBlocksUntilSendingCompletesEvenWhenItsOnlyTokenEnds) {
  ScriptedConnector conn;
  conn.delay_free_on_finish = true;
  SchedulerHarness h(config(8), &conn);
  h.add("prefill", iota_tokens(40), 1, contract::TransferParams{});  // a producer's
  h.step();  // computes the prompt, samples the single token, finishes
  EXPECT_EQ(h.finished.count("prefill"), 1u);
  EXPECT_EQ(h.scheduler.block_pool().num_free_blocks(), 5) << "3 blocks still readable by the transfer";
  EXPECT_EQ(h.scheduler.num_holds(), 1);
  deliver(h, ConnectorEvents{{}, {"unknown-id"}, {}, {}, {}});
  EXPECT_EQ(h.scheduler.num_unknown_connector_ids(), 1);
  EXPECT_EQ(h.scheduler.block_pool().num_free_blocks(), 5);
  deliver(h, ConnectorEvents{{}, {"prefill"}, {}, {}, {}});
  EXPECT_EQ(h.scheduler.block_pool().num_free_blocks(), 8);
  EXPECT_EQ(h.scheduler.num_holds(), 0);
  // The computed prompt blocks stay in the prefix cache after release.
  h.add("again", iota_tokens(40), 1);
  auto plan = h.step();
  EXPECT_EQ(plan.seqs[0].num_computed_tokens, 32);
}

TEST(ConnectorHooks, LoadErrorRecomputesFromTheFirstFailedBlock) {
  ScriptedConnector conn;
  conn.match = {48, true, 60'000};
  SchedulerHarness h(config(), &conn);
  Request* r = h.add("pd", iota_tokens(50), 2, kParams);
  h.step();
  ASSERT_EQ(conn.alloc_block_ids.size(), 3u);
  const int32_t bad_block = conn.alloc_block_ids[1];
  deliver(h, ConnectorEvents{{"pd"}, {}, {LoadError{"pd", {bad_block}}}, {}, {}});
  EXPECT_EQ(r->num_computed_tokens, 16) << "only the first block arrived intact";
  auto plan = h.step();
  ASSERT_EQ(plan.seqs.size(), 1u);
  EXPECT_EQ(plan.seqs[0].num_computed_tokens, 16);
  EXPECT_EQ(plan.seqs[0].num_new_tokens, 34);
  h.run_until_idle();
  EXPECT_EQ(h.outputs("pd"), reference_outputs(iota_tokens(50), 2));
}

// A 50-token request whose connector promises the whole prompt's KV (the last token
// included), after the step that allocated its blocks and started the load.
struct WholePromptLoad {
  ScriptedConnector conn;
  SchedulerHarness h{config(), &conn};
  Request* r = nullptr;
  WholePromptLoad() {
    conn.match = ExternalMatch{50, true, 60'000};
    conn.match.includes_last_prompt_token = true;
    r = h.add("pd", iota_tokens(50), 2, kParams);
    h.step();
  }
  std::vector<Scheduler::HandedOver> finish_with_token(int32_t token_id) {
    return h.scheduler.apply_connector_events(ConnectorEvents{{"pd"}, {}, {}, {}, {HandedOverToken{"pd", token_id}}});
  }
};

TEST(ConnectorHooks, AWholePromptLoadWithAHandedOverTokenRunsAsIfPrefilledHere) {
  WholePromptLoad load;
  ASSERT_EQ(load.conn.alloc_block_ids.size(), 4u) << "blocks for all 50 tokens";
  auto handed = load.finish_with_token(7);
  ASSERT_EQ(handed.size(), 1u);
  EXPECT_EQ(handed[0].request, load.r);
  EXPECT_EQ(handed[0].token_id, 7);
  EXPECT_EQ(load.r->state(), RequestState::kRunning);
  EXPECT_EQ(load.r->num_computed_tokens, 50);
}

TEST(ConnectorHooks, AHandedOverTokenWhoseLoadFailedInPartIsNotTaken) {
  // A load error in the same poll voids block 1: the token is dropped and the
  // prompt is recomputed from block 1, so the output is the model's own.
  WholePromptLoad load;
  ASSERT_EQ(load.conn.alloc_block_ids.size(), 4u);
  load.h.scheduler.apply_load_errors({LoadError{"pd", {load.conn.alloc_block_ids[1]}}});
  EXPECT_TRUE(load.finish_with_token(7).empty());
  EXPECT_EQ(load.r->num_computed_tokens, 16) << "only the first block arrived intact";
  EXPECT_EQ(load.r->state(), RequestState::kWaiting);
  load.h.run_until_idle();
  EXPECT_EQ(load.h.outputs("pd"), reference_outputs(iota_tokens(50), 2));
}

TEST(ConnectorHooks, SynchronousLoadFailureVoidsTheStepAndRecomputes) {
  ScriptedConnector conn;
  conn.match = {32, false, 0};
  SchedulerHarness h(config(), &conn);
  Request* r = h.add("pd", iota_tokens(40), 2, kParams);
  std::vector<FinishedRequest> failed;
  StepPlan plan = h.scheduler.schedule(&failed);
  ASSERT_EQ(plan.seqs.size(), 1u);
  EXPECT_EQ(plan.seqs[0].num_external_tokens, 32);
  // The runner ran; the connector reports the second block failed to load.
  auto moved = h.scheduler.apply_load_errors({LoadError{"pd", {r->block_ids[1]}}});
  EXPECT_TRUE(moved.contains("pd"));
  h.scheduler.complete_step(plan, moved);
  EXPECT_EQ(r->num_computed_tokens, 16);
  h.run_until_idle();
  EXPECT_EQ(h.outputs("pd"), reference_outputs(iota_tokens(40), 2));
}

TEST(ConnectorHooks, RemoteKvDeadlineFailsTheRequestWhenThePolicySaysSo) {
  ScriptedConnector conn;
  conn.match = {48, true, 0};  // deadline = now
  SchedulerHarness h(config(8), &conn);
  h.add("pd", iota_tokens(50), 2, kParams);
  h.step();
  auto failed = h.scheduler.expire_remote_kv_waits(INT64_MAX);
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].request->state(), RequestState::kFinishedError);
  EXPECT_FALSE(failed[0].error.empty());
  EXPECT_EQ(conn.timed_out_ids, std::vector<std::string>{"pd"});
  EXPECT_EQ(h.scheduler.block_pool().num_free_blocks(), 8);
}

TEST(ConnectorHooks, RemoteKvDeadlineCanFallBackToLocalRecompute) {
  ScriptedConnector conn;
  conn.match = {48, true, 0};
  conn.timeout_action = RemoteKvTimeoutAction::kRecomputeLocally;
  SchedulerHarness h(config(8), &conn);
  h.add("pd", iota_tokens(50), 2, kParams);
  h.step();
  EXPECT_TRUE(h.scheduler.expire_remote_kv_waits(INT64_MAX).empty());
  EXPECT_EQ(h.scheduler.num_remote_waiting(), 0);
  auto plan = h.step();
  ASSERT_EQ(plan.seqs.size(), 1u);
  EXPECT_EQ(plan.seqs[0].num_computed_tokens, 0);
  h.run_until_idle();
  EXPECT_EQ(h.outputs("pd"), reference_outputs(iota_tokens(50), 2));
  EXPECT_EQ(conn.num_match_calls, 1);
}

TEST(ConnectorHooks, MalformedTransferParamsFailOnlyThatRequest) {
  ScriptedConnector conn;
  conn.fail_match = true;
  SchedulerHarness h(config(), &conn);
  h.add("bad", iota_tokens(20), 2, kParams);
  h.add("good", iota_tokens(20, 300), 2);
  std::vector<FinishedRequest> failed;
  StepPlan plan = h.scheduler.schedule(&failed);
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_EQ(failed[0].request->request_id(), "bad");
  EXPECT_NE(failed[0].error.find("transfer_id"), std::string::npos);
  ASSERT_EQ(plan.seqs.size(), 1u);
  EXPECT_EQ(plan.seqs[0].request->request_id(), "good");
}

}  // namespace
}  // namespace pd::engine

namespace pd::engine {
namespace {

// Two P/D requests receive their KV and wait, each holding 4 of 9 blocks. With
// one running slot the first decodes until it needs a block none can give,
// preempts itself and can no longer be readmitted (it needs 6 blocks, 5 are
// free) while nothing runs. The waiting request's blocks must be reclaimed,
// or the engine stalls forever (a real-process repro of this hang existed).
TEST(ConnectorHooks, WaitingRequestsHoldingReceivedKvCannotStallAHeadThatNeedsTheirBlocks) {
  ScriptedConnector conn;
  conn.match = {63, true, 60'000};
  SchedulerConfig c = config(/*num_blocks=*/9);
  c.max_num_seqs = 1;
  c.remote_output_reserve = -1.0;  // the reserve would keep "b" from taking blocks at all
  SchedulerHarness h(c, &conn);
  std::vector<int32_t> prompt_a = iota_tokens(64);
  std::vector<int32_t> prompt_b = iota_tokens(64);
  for (int32_t& t : prompt_b) t += 1000;
  h.add("a", prompt_a, 30, kParams);
  h.add("b", prompt_b, 30, kParams);
  h.step();  // only one slot: "a" waits for remote KV (4 blocks), "b" after it
  h.step();
  ASSERT_EQ(h.scheduler.num_remote_waiting(), 2);
  deliver(h, ConnectorEvents{{"a", "b"}, {}, {}, {}, {}});
  h.run_until_idle(/*max_steps=*/500);
  EXPECT_EQ(h.outputs("a"), reference_outputs(prompt_a, 30));
  EXPECT_EQ(h.outputs("b"), reference_outputs(prompt_b, 30));
  EXPECT_GE(h.scheduler.counters().num_preemptions, 1);
  EXPECT_EQ(h.scheduler.block_pool().num_free_blocks(), 9);
}

// A P/D request that finds no room is asked again on its next attempt and
// still waits for its KV instead of silently recomputing the whole prompt.
TEST(ConnectorHooks, RequestWithoutRoomIsAskedAgainAndKeepsItsTransfer) {
  ScriptedConnector conn;
  conn.match = {48, true, 60'000};
  SchedulerHarness h(config(/*num_blocks=*/6), &conn);
  h.add("plain", iota_tokens(70), 4);  // 5 blocks while it runs
  h.step();
  std::vector<int32_t> pd_prompt = iota_tokens(50);
  for (int32_t& t : pd_prompt) t += 1000;            // no prefix shared with "plain"
  Request* pd = h.add("pd", pd_prompt, 2, kParams);  // needs 3 blocks, 1 is free: no room yet
  h.step();
  EXPECT_EQ(pd->state(), RequestState::kWaiting);
  while (h.scheduler.find("plain") != nullptr) h.step();
  h.step();
  EXPECT_EQ(pd->state(), RequestState::kWaitingForRemoteKv);
  EXPECT_EQ(conn.alloc_external_tokens, 48);
  EXPECT_GE(conn.num_match_calls, 2);
}

// A P/D consumer under KV pressure: eight requests whose 32-token prompts
// arrive from a producer (2 blocks each) and which each grow by 4 blocks of
// output, on 20 blocks. Every waiting load is delivered after each step.
struct ConsumerRun {
  int32_t max_requests_holding_blocks = 0;
  int64_t num_preemptions = 0;
  int64_t num_recomputed_tokens = 0;
  int64_t num_deferred = 0;
  bool outputs_match = true;
};

ConsumerRun run_consumer_under_pressure(double reserve) {
  ScriptedConnector conn;
  conn.match = {32, true, 60'000};
  SchedulerConfig c = config(/*num_blocks=*/20);
  c.remote_output_reserve = reserve;
  c.kv_watermark = 0.0;
  SchedulerHarness h(c, &conn);
  std::vector<std::vector<int32_t>> prompts;
  for (int32_t i = 0; i < 8; ++i) {
    prompts.push_back(iota_tokens(32, 1 + 100 * i));  // no shared prefix
    h.add("r" + std::to_string(i), prompts.back(), 64, kParams);
  }
  ConsumerRun run;
  for (int i = 0; i < 2000 && h.scheduler.has_unfinished(); ++i) {
    h.step();
    ConnectorEvents arrived;
    int32_t holding = 0;
    for (Request* r : h.scheduler.live_requests()) {
      holding += !r->block_ids.empty();
      if (r->state() == RequestState::kWaitingForRemoteKv) arrived.finished_recving.push_back(r->request_id());
    }
    run.max_requests_holding_blocks = std::max(run.max_requests_holding_blocks, holding);
    deliver(h, arrived);
  }
  EXPECT_FALSE(h.scheduler.has_unfinished());
  for (int32_t i = 0; i < 8; ++i) {
    run.outputs_match = run.outputs_match && h.outputs("r" + std::to_string(i)) == reference_outputs(prompts[i], 64);
  }
  run.num_preemptions = h.scheduler.counters().num_preemptions;
  run.num_recomputed_tokens = h.scheduler.counters().num_recomputed_tokens;
  run.num_deferred = h.scheduler.counters().num_remote_admissions_deferred;
  EXPECT_EQ(h.scheduler.block_pool().num_free_blocks(), 20);
  return run;
}

TEST(ConnectorHooks, AConsumerUnderKvPressureAdmitsFewerAndNeverPreempts) {
  // 6 blocks per request at its end: the reserve admits three at a time.
  const ConsumerRun reserved = run_consumer_under_pressure(1.0);
  EXPECT_TRUE(reserved.outputs_match);
  EXPECT_EQ(reserved.num_preemptions, 0);
  EXPECT_EQ(reserved.num_recomputed_tokens, 0);
  EXPECT_EQ(reserved.max_requests_holding_blocks, 3);
  // Three run in lockstep and finish together, so the next three are admitted
  // at once: only the head of each later wave (r3, r6) waited, each counted
  // once although it waited many steps.
  EXPECT_EQ(reserved.num_deferred, 2);

  // Without it every prompt fits at first, and growing forces preemptions
  // that throw received prompts away.
  const ConsumerRun unreserved = run_consumer_under_pressure(-1.0);
  EXPECT_TRUE(unreserved.outputs_match);
  EXPECT_GT(unreserved.max_requests_holding_blocks, 3);
  EXPECT_GT(unreserved.num_preemptions, 0);
  EXPECT_GT(unreserved.num_recomputed_tokens, 0);
  EXPECT_EQ(unreserved.num_deferred, 0);
}

TEST(ConnectorHooks, TheReserveCountsAFractionOfTheOutputAndTheWatermark) {
  // Half the output reserved (4 blocks per request at the end of its reserve)
  // and a watermark of 2 blocks on 20: four requests fit (4 x 4 + 2 = 18 <= 20),
  // a fifth does not (22).
  ScriptedConnector conn;
  conn.match = {32, true, 60'000};
  SchedulerConfig c = config(/*num_blocks=*/20);
  c.remote_output_reserve = 0.5;
  c.kv_watermark = 0.1;
  SchedulerHarness h(c, &conn);
  for (int32_t i = 0; i < 6; ++i) h.add("r" + std::to_string(i), iota_tokens(32, 1 + 100 * i), 64, kParams);
  h.step();
  EXPECT_EQ(h.scheduler.num_remote_waiting(), 4);
  EXPECT_EQ(h.scheduler.counters().num_remote_admissions_deferred, 1) << "only the head of the rest was asked";
}

TEST(ConnectorHooks, ARemoteRequestAloneIsAdmittedWhateverTheReserve) {
  // Its reserve (6 blocks) plus the watermark (3) exceed the 6-block cache;
  // with nothing else holding blocks it still runs, or it would never run.
  ScriptedConnector conn;
  conn.match = {32, true, 60'000};
  SchedulerConfig c = config(/*num_blocks=*/6);
  c.kv_watermark = 0.5;
  SchedulerHarness h(c, &conn);
  h.add("pd", iota_tokens(32), 64, kParams);
  h.step();
  ASSERT_EQ(h.scheduler.num_remote_waiting(), 1);
  deliver(h, ConnectorEvents{{"pd"}, {}, {}, {}, {}});
  h.run_until_idle();
  EXPECT_EQ(h.outputs("pd"), reference_outputs(iota_tokens(32), 64));
  EXPECT_EQ(h.scheduler.counters().num_preemptions, 0);
}

}  // namespace
}  // namespace pd::engine
