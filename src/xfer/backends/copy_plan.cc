#include "xfer/backends/copy_plan.h"

#include <algorithm>

namespace pd::xfer {

size_t launch_capacity(size_t launch_index, size_t num_ops, bool pipelined) {
  if (pipelined && launch_index == 0 && num_ops > kMaxInlineOps) return kFirstLaunchOps;
  return kMaxInlineOps;
}

uint64_t work_item_bytes(uint64_t bytes, uint64_t max_ctas, uint64_t waves, uint64_t max_chunk_bytes) {
  constexpr uint64_t kGranule = 4096;
  const uint64_t items = std::max<uint64_t>(1, max_ctas * waves);
  const uint64_t share = (bytes / items + kGranule - 1) / kGranule * kGranule;
  return std::clamp<uint64_t>(share, kGranule, std::max(kGranule, max_chunk_bytes));
}

uint64_t launch_waves(size_t launch_index, bool whole_batch, bool pipelined) {
  return whole_batch || (pipelined && launch_index == 0) ? 1 : 4;
}

LaunchShape build_copy_table(std::span<const Op> ops, Direction direction, uint64_t local_base, uint64_t remote_base,
                             uint64_t max_ctas, uint64_t waves, uint64_t max_chunk_bytes, CopyOp* table) {
  LaunchShape shape;
  shape.num_ops = static_cast<uint32_t>(ops.size());
  for (const Op& op : ops) shape.bytes += op.bytes;
  const uint64_t chunk_bytes = work_item_bytes(shape.bytes, max_ctas, waves, max_chunk_bytes);
  shape.chunk_bytes = static_cast<uint32_t>(chunk_bytes);
  for (size_t i = 0; i < ops.size(); ++i) {
    const CopyAddresses at = copy_addresses(ops[i], direction, local_base, remote_base);
    table[i] = {at.src, at.dst, ops[i].bytes, shape.num_chunks};
    shape.num_chunks += (ops[i].bytes + chunk_bytes - 1) / chunk_bytes;
  }
  shape.grid = static_cast<uint32_t>(std::min<uint64_t>(shape.num_chunks, max_ctas));
  return shape;
}

KernelLaunchPlanner::Launch KernelLaunchPlanner::next() {
  const size_t capacity = launch_capacity(launch_, num_ops_, pipelined_);
  const size_t n = merger_.next(std::span<Op>(scratch_.merged).first(capacity));
  const bool whole_batch = launch_ == 0 && merger_.done();
  const LaunchShape shape =
      build_copy_table(std::span<const Op>(scratch_.merged).first(n), direction_, local_base_, remote_base_, max_ctas_,
                       launch_waves(launch_, whole_batch, pipelined_), max_chunk_bytes_, scratch_.table.data());
  ++launch_;
  return {scratch_.table.data(), shape};
}

}  // namespace pd::xfer
