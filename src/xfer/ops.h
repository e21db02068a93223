// Batch normalisation: the pure core every backend posts from.
#pragma once

#include <span>
#include <vector>

#include "common/status.h"
#include "xfer/types.h"

namespace pd::xfer {

inline constexpr size_t kMaxOpsPerBatch = size_t{1} << 20;

// Validates and canonicalises one batch:
//  * every op has bytes > 0 and lies inside both regions (no overflow);
//  * destination ranges (remote for writes, local for reads) do not overlap, since two
//    writers of one byte would race; sources may overlap (one block fanned out twice);
//  * ops are sorted by destination offset and runs that are contiguous on both sides
//    merged into one op.
// Any violation rejects the whole batch with a message naming the op; nothing is posted.
Result<std::vector<Op>> normalize_ops(std::span<const Op> ops, Direction direction, uint64_t local_bytes,
                                      uint64_t remote_bytes);
// The same into `out` (cleared first), reusing its capacity.
Status normalize_ops_into(std::span<const Op> ops, Direction direction, uint64_t local_bytes, uint64_t remote_bytes,
                          std::vector<Op>& out);

// The checks of normalize_ops (same rules, same error codes) without reordering or
// copying the batch, for backends that post ops in the caller's order. Destinations are
// proven disjoint in O(n) when they ascend, or when they fit a small bitmap in units of
// their common alignment (KV blocks: one bit per block); otherwise their offsets are
// radix-sorted. Nothing about the batch is kept.
Status validate_ops(std::span<const Op> ops, Direction direction, uint64_t local_bytes, uint64_t remote_bytes);

// Which of validate_ops' overlap proofs a batch takes (for tests and the cost benchmark).
enum class OverlapCheck : uint8_t { kAscending, kBitmap, kSorted };
OverlapCheck overlap_check_for(std::span<const Op> ops, Direction direction);

// Merges validated ops in the caller's order: an op that continues the previous one on
// both sides extends it. Feeding it a whole batch in one call or in several gives the
// same ops, and a batch already sorted by destination gives normalize_ops' result.
class ConsecutiveMerger {
 public:
  explicit ConsecutiveMerger(std::span<const Op> ops) : ops_(ops) {}
  bool done() const { return next_ == ops_.size(); }
  // Writes up to out.size() merged ops (at least one unless done or out is empty) and
  // returns how many. A merged op is never split across two calls.
  size_t next(std::span<Op> out);
  // Input ops consumed so far.
  size_t consumed() const { return next_; }

 private:
  std::span<const Op> ops_;
  size_t next_ = 0;
};

}  // namespace pd::xfer
