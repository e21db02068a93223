// How many KV blocks a device instance may allocate under
// --gpu-memory-utilization, as vLLM v1 defines it: the instance may hold
// `utilization x total device memory`, whatever other processes hold. What
// this instance holds is counted by its own allocator (weights, buffers), so
// another process starting on the same GPU at the same time does not count
// against it. Memory of other processes only matters twice: the device must
// have the share free at start-up, and the pool never takes more than is free
// when it is sized. Pure arithmetic (the runner measures, this decides).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/status.h"

namespace pd::engine {

struct KvMemoryBudgetInput {
  size_t total_bytes = 0;          // the device's memory
  size_t free_bytes_at_start = 0;  // free before this instance allocated anything (its context excepted)
  size_t free_bytes_now = 0;       // free on the device when the pool is sized
  size_t own_bytes = 0;            // what this instance holds (weights, workspaces, buffers), counted
  double gpu_memory_utilization = 0.9;
  size_t reserve_bytes = 0;  // kept back for allocations after sizing and inside libraries (graphs, cuBLASLt)
  size_t bytes_per_block = 0;
};

// Blocks = min(utilization x total - own - reserve, free now - reserve)
// / bytes per block. Errors: the share is not free at start-up
// (kResourceExhausted, naming both numbers), nothing left for one block
// (kResourceExhausted, saying which limit), bad input (kInvalidArgument).
Result<int64_t> kv_cache_blocks_for_budget(const KvMemoryBudgetInput& input);

}  // namespace pd::engine
