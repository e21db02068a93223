// How many KV blocks a device instance may allocate under
// --gpu-memory-utilization, as vLLM v1 defines it: the instance may hold
// `utilization x total device memory`, whatever other processes hold. Memory
// of other processes only matters at start-up: the device must then have at
// least that share free. Pure arithmetic (the runner measures, this decides).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace pd::engine {

struct KvMemoryBudgetInput {
  size_t total_bytes = 0;          // the device's memory
  size_t free_bytes_at_start = 0;  // free before this instance allocated anything (its context excepted)
  size_t free_bytes_now = 0;       // free after weights, workspaces and buffers, before the KV cache
  double gpu_memory_utilization = 0.9;
  size_t reserve_bytes = 0;  // kept back for allocations after sizing (graphs, library workspaces)
  size_t bytes_per_block = 0;
};

// Blocks = (utilization x total - what this instance already holds - reserve)
// / bytes per block. Errors: the share is not free at start-up
// (kResourceExhausted, naming both numbers), nothing left for one block
// (kResourceExhausted), bad input (kInvalidArgument).
Result<int64_t> kv_cache_blocks_for_budget(const KvMemoryBudgetInput& input);

}  // namespace pd::engine
