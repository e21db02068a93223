#include "xfer/ops.h"

#include <algorithm>

namespace pd::xfer {
namespace {

bool in_bounds(uint64_t offset, uint64_t bytes, uint64_t limit) {
  return bytes <= limit && offset <= limit - bytes;
}

uint64_t dst_offset(const Op& op, Direction direction) {
  return direction == Direction::kWrite ? op.remote_offset : op.local_offset;
}

}  // namespace

Result<std::vector<Op>> normalize_ops(std::span<const Op> ops, Direction direction, uint64_t local_bytes,
                                      uint64_t remote_bytes) {
  if (ops.size() > kMaxOpsPerBatch) {
    return invalid_argument("batch has {} ops, limit is {}", ops.size(), kMaxOpsPerBatch);
  }
  for (size_t i = 0; i < ops.size(); ++i) {
    const Op& op = ops[i];
    if (op.bytes == 0) return invalid_argument("op {} has zero bytes", i);
    if (!in_bounds(op.local_offset, op.bytes, local_bytes)) {
      return out_of_range("op {}: local range [{}, +{}) outside the local region of {} bytes", i, op.local_offset,
                          op.bytes, local_bytes);
    }
    if (!in_bounds(op.remote_offset, op.bytes, remote_bytes)) {
      return out_of_range("op {}: remote range [{}, +{}) outside the remote region of {} bytes", i, op.remote_offset,
                          op.bytes, remote_bytes);
    }
  }
  std::vector<size_t> order(ops.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return dst_offset(ops[a], direction) < dst_offset(ops[b], direction);
  });
  std::vector<Op> merged;
  merged.reserve(ops.size());
  for (size_t k = 0; k < order.size(); ++k) {
    const Op& op = ops[order[k]];
    if (!merged.empty()) {
      Op& last = merged.back();
      const uint64_t last_dst_end = dst_offset(last, direction) + last.bytes;
      if (dst_offset(op, direction) < last_dst_end) {
        return invalid_argument("op {} overlaps an earlier op at destination offset {} (ends at {})", order[k],
                                dst_offset(op, direction), last_dst_end);
      }
      if (op.local_offset == last.local_offset + last.bytes && op.remote_offset == last.remote_offset + last.bytes) {
        last.bytes += op.bytes;
        continue;
      }
    }
    merged.push_back(op);
  }
  return merged;
}

}  // namespace pd::xfer
