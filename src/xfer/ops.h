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

}  // namespace pd::xfer
