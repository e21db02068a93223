// Host-side planning of the cuda backend's posts: op tables and work-item sizes of the
// copy kernel, and how a batch is cut into launches. Plain C++ with no CUDA, so the CPU
// tests (and ASan) cover it; cuda_backend.cc only adds the runtime calls.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "xfer/backends/copy_op.h"
#include "xfer/ops.h"
#include "xfer/types.h"

namespace pd::xfer {

// A large batch posted as a pipeline starts with a launch of at most this many ops, so
// that the GPU starts copying while the host builds the (larger) tables after it.
inline constexpr size_t kFirstLaunchOps = 128;

// Op-table size of launch `launch_index` of a batch of `num_ops` (merged or not) ops:
// kMaxInlineOps each, except that a pipelined batch too large for one launch starts with
// kFirstLaunchOps.
size_t launch_capacity(size_t launch_index, size_t num_ops, bool pipelined);

// Bytes per work item (what one CTA copies at a time) for `bytes` spread over about
// waves x max_ctas items: a multiple of 4 KiB within [4 KiB, max(4 KiB, max_chunk_bytes)].
uint64_t work_item_bytes(uint64_t bytes, uint64_t max_ctas, uint64_t waves, uint64_t max_chunk_bytes);

// Waves of work items for launch `launch_index`: one when the launch is the whole batch
// or the small first launch of a pipeline (few bytes: every CTA gets one item), four for
// the launches of a batch cut into several (short tails between launches).
uint64_t launch_waves(size_t launch_index, bool whole_batch, bool pipelined);

// One copy-kernel launch as planned on the host.
struct LaunchShape {
  uint32_t num_ops = 0;
  uint64_t num_chunks = 0;
  uint32_t chunk_bytes = 0;
  uint32_t grid = 0;
  uint64_t bytes = 0;
};

// Writes the kernel's view of `ops` (source and destination device addresses from the
// two region bases, chunk indices) to table[0 .. ops.size()) and sizes the launch:
// grid = min(chunks, max_ctas). Precondition: ops validated, max_ctas > 0.
LaunchShape build_copy_table(std::span<const Op> ops, Direction direction, uint64_t local_base, uint64_t remote_base,
                             uint64_t max_ctas, uint64_t waves, uint64_t max_chunk_bytes, CopyOp* table);

// Buffers of one launch's planning, reused from post to post (a thread keeps one).
struct LaunchScratch {
  std::vector<Op> merged = std::vector<Op>(kMaxInlineOps);
  std::vector<CopyOp> table = std::vector<CopyOp>(kMaxInlineOps);
};

// Cuts a validated batch into launch-parameter launches of the copy kernel, one at a
// time, so that the caller launches each before the next is planned: ops merged in the
// caller's order (ConsecutiveMerger), launch_capacity() ops a launch, launch_waves()
// work-item sizing.
class KernelLaunchPlanner {
 public:
  struct Launch {
    const CopyOp* table;  // kMaxInlineOps entries readable, shape.num_ops meaningful
    LaunchShape shape;
  };
  KernelLaunchPlanner(std::span<const Op> ops, Direction direction, uint64_t local_base, uint64_t remote_base,
                      uint64_t max_ctas, uint64_t max_chunk_bytes, bool pipelined, LaunchScratch& scratch)
      : merger_(ops),
        num_ops_(ops.size()),
        direction_(direction),
        local_base_(local_base),
        remote_base_(remote_base),
        max_ctas_(max_ctas),
        max_chunk_bytes_(max_chunk_bytes),
        pipelined_(pipelined),
        scratch_(scratch) {}
  bool done() const { return merger_.done(); }
  // Precondition: !done(). The table stays valid until the next call.
  Launch next();

 private:
  ConsecutiveMerger merger_;
  size_t num_ops_;
  Direction direction_;
  uint64_t local_base_, remote_base_, max_ctas_, max_chunk_bytes_;
  bool pipelined_;
  LaunchScratch& scratch_;
  size_t launch_ = 0;
};

// Device addresses of one op for the copy-engine modes.
struct CopyAddresses {
  uint64_t src;
  uint64_t dst;
};
inline CopyAddresses copy_addresses(const Op& op, Direction direction, uint64_t local_base, uint64_t remote_base) {
  const uint64_t local = local_base + op.local_offset;
  const uint64_t remote = remote_base + op.remote_offset;
  return direction == Direction::kWrite ? CopyAddresses{local, remote} : CopyAddresses{remote, local};
}

}  // namespace pd::xfer
