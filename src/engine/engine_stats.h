// The engine's statistics: each counter has one owner, and one snapshot type
// (EngineStats) carries them to readers (Engine::stats, the `/metrics` series).
#pragma once

#include <cstdint>

namespace pd::engine {

// Owned by the scheduler (Scheduler::counters), cumulative.
struct SchedulerCounters {
  // Requests whose computed KV was dropped for lack of blocks (tail
  // preemption, or blocks taken back from a waiting request); each computes
  // its tokens again.
  int64_t num_preemptions = 0;
  int64_t num_recomputed_tokens = 0;  // computed (or received) tokens those drops threw away
  // Remote requests that had to wait at least once for the reserve (room for
  // their prompt alone was there); counted once per request.
  int64_t num_remote_admissions_deferred = 0;
  int64_t num_prefix_cache_queries = 0;     // tokens looked up on admission
  int64_t num_prefix_cache_hit_tokens = 0;  // of those, served from the cache
  int64_t num_external_hit_tokens = 0;      // served by the connector
};

// Owned by the engine thread, cumulative.
struct EngineCounters {
  int64_t num_prompt_tokens = 0;  // of admitted requests
  int64_t num_generation_tokens = 0;
  int64_t num_steps = 0;
  int64_t num_step_errors = 0;         // runner failures (each failed its step's requests)
  int64_t num_handed_over_tokens = 0;  // first tokens taken from a P/D producer
  int64_t num_handed_over_tokens_ignored = 0;
};

// A consistent snapshot, cheap to take from any thread. Each counter has one
// owner (the scheduler or the engine thread) and is copied here as part of its
// owner's struct; the `/metrics` series are written from this snapshot only.
struct EngineStats {
  int32_t num_running = 0;
  int32_t num_waiting = 0;
  int32_t num_waiting_for_remote_kv = 0;  // included in num_waiting
  int32_t num_blocks_total = 0;
  int32_t num_blocks_free = 0;    // free, including cached-but-unreferenced blocks
  int32_t num_blocks_in_use = 0;  // referenced by a live request (or held for a transfer)
  SchedulerCounters scheduler;
  EngineCounters engine;
  int64_t num_first_tokens_streamed_on_arrival = 0;  // handed-over tokens streamed before the engine thread took them
};

}  // namespace pd::engine
