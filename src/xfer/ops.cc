#include "xfer/ops.h"

#include <algorithm>
#include <utility>

namespace pd::xfer {
namespace {

bool in_bounds(uint64_t offset, uint64_t bytes, uint64_t limit) {
  return bytes <= limit && offset <= limit - bytes;
}

uint64_t dst_offset(const Op& op, Direction direction) {
  return direction == Direction::kWrite ? op.remote_offset : op.local_offset;
}

}  // namespace

Status normalize_ops_into(std::span<const Op> ops, Direction direction, uint64_t local_bytes, uint64_t remote_bytes,
                          std::vector<Op>& out) {
  out.clear();
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
  // Destination order by an LSD radix sort of (offset, index) pairs, 11 bits a pass and
  // only as many passes as the largest offset needs: a KV batch of thousands of ops sorts
  // in tens of microseconds, where std::sort took hundreds (the batch is on the critical
  // path of every transfer). Scratch is per thread and reused, so no page is touched anew.
  struct Keyed {
    uint64_t key;
    uint64_t index;
  };
  thread_local std::vector<Keyed> keyed, spare;
  keyed.resize(ops.size());
  spare.resize(ops.size());
  uint64_t max_key = 0;
  bool sorted = true;
  for (size_t i = 0; i < ops.size(); ++i) {
    keyed[i] = {dst_offset(ops[i], direction), i};
    max_key = std::max(max_key, keyed[i].key);
    if (i > 0 && keyed[i].key < keyed[i - 1].key) sorted = false;
  }
  if (!sorted) {
    constexpr int kDigitBits = 11;
    constexpr size_t kBuckets = size_t{1} << kDigitBits;
    for (int shift = 0; shift < 64 && (max_key >> shift) != 0; shift += kDigitBits) {
      size_t counts[kBuckets] = {};
      for (const Keyed& k : keyed) ++counts[(k.key >> shift) & (kBuckets - 1)];
      size_t position = 0;
      for (size_t& c : counts) position += std::exchange(c, position);
      for (const Keyed& k : keyed) spare[counts[(k.key >> shift) & (kBuckets - 1)]++] = k;
      keyed.swap(spare);
    }
  }
  out.clear();
  out.reserve(ops.size());
  for (const Keyed& k : keyed) {
    const Op& op = ops[k.index];
    if (!out.empty()) {
      Op& last = out.back();
      const uint64_t last_dst_end = dst_offset(last, direction) + last.bytes;
      if (dst_offset(op, direction) < last_dst_end) {
        return invalid_argument("op {} at destination offset {} (+{}) overlaps the op ending at {}", k.index,
                                dst_offset(op, direction), op.bytes, last_dst_end);
      }
      if (op.local_offset == last.local_offset + last.bytes && op.remote_offset == last.remote_offset + last.bytes) {
        last.bytes += op.bytes;
        continue;
      }
    }
    out.push_back(op);
  }
  return Status::Ok();
}

Result<std::vector<Op>> normalize_ops(std::span<const Op> ops, Direction direction, uint64_t local_bytes,
                                      uint64_t remote_bytes) {
  std::vector<Op> merged;
  PD_RETURN_IF_ERROR(normalize_ops_into(ops, direction, local_bytes, remote_bytes, merged));
  return merged;
}

}  // namespace pd::xfer
