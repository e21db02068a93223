#include "engine/kv_memory_budget.h"

#include <algorithm>
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
  const double own = static_cast<double>(input.own_bytes);
  const double reserve = static_cast<double>(input.reserve_bytes);
  const double budget = share - own - reserve;
  const double free_now = static_cast<double>(input.free_bytes_now) - reserve;
  const double per_block = static_cast<double>(input.bytes_per_block);
  if (budget < per_block) {
    return resource_exhausted(
        "no memory left for the KV cache: the share of {:.2f} GiB (--gpu-memory-utilization {}) minus this "
        "instance's {:.2f} GiB (weights, buffers) and a {:.2f} GiB reserve leaves less than one block",
        share / kGiB, input.gpu_memory_utilization, own / kGiB, reserve / kGiB);
  }
  if (free_now < per_block) {
    return resource_exhausted(
        "no memory left for the KV cache: only {:.2f} GiB of the device are free now (other processes hold the "
        "rest) and a {:.2f} GiB reserve is kept",
        static_cast<double>(input.free_bytes_now) / kGiB, reserve / kGiB);
  }
  const int64_t blocks = static_cast<int64_t>(std::floor(std::min(budget, free_now) / per_block));
  return blocks;
}

}  // namespace pd::engine
