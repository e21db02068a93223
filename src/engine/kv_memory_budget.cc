#include "engine/kv_memory_budget.h"

#include <cmath>

namespace pd::engine {

Result<int64_t> kv_cache_blocks_for_budget(const KvMemoryBudgetInput& input) {
  if (!(input.gpu_memory_utilization > 0.0 && input.gpu_memory_utilization <= 1.0)) {
    return invalid_argument("gpu_memory_utilization must be in (0, 1], got {}", input.gpu_memory_utilization);
  }
  if (input.bytes_per_block == 0) return invalid_argument("bytes per KV block must be > 0");
  if (input.free_bytes_at_start > input.total_bytes || input.free_bytes_now > input.total_bytes) {
    return invalid_argument("free memory ({} at start, {} now) exceeds the device's {} bytes",
                            input.free_bytes_at_start, input.free_bytes_now, input.total_bytes);
  }
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  const double share = input.gpu_memory_utilization * static_cast<double>(input.total_bytes);
  if (static_cast<double>(input.free_bytes_at_start) < share) {
    return resource_exhausted(
        "free device memory at start-up ({:.2f} GiB of {:.2f} GiB) is less than the requested share "
        "(--gpu-memory-utilization {} = {:.2f} GiB); lower it or free the device",
        static_cast<double>(input.free_bytes_at_start) / kGiB, static_cast<double>(input.total_bytes) / kGiB,
        input.gpu_memory_utilization, share / kGiB);
  }
  // Memory this instance took since start-up; another process allocating at
  // the same time makes it look larger (fewer blocks, never an overcommit).
  const double own = input.free_bytes_now < input.free_bytes_at_start
                         ? static_cast<double>(input.free_bytes_at_start - input.free_bytes_now)
                         : 0.0;
  const double budget = share - own - static_cast<double>(input.reserve_bytes);
  const int64_t blocks =
      budget > 0.0 ? static_cast<int64_t>(std::floor(budget / static_cast<double>(input.bytes_per_block))) : 0;
  if (blocks <= 0) {
    return resource_exhausted(
        "no memory left for the KV cache: the share of {:.2f} GiB (--gpu-memory-utilization {}) minus this "
        "instance's {:.2f} GiB (weights, buffers) and a {:.2f} GiB reserve leaves less than one block",
        share / kGiB, input.gpu_memory_utilization, own / kGiB, static_cast<double>(input.reserve_bytes) / kGiB);
  }
  return blocks;
}

}  // namespace pd::engine
