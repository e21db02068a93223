#include "xfer/ops.h"

#include <algorithm>
#include <bit>
#include <utility>

namespace pd::xfer {
namespace {

bool in_bounds(uint64_t offset, uint64_t bytes, uint64_t limit) {
  return bytes <= limit && offset <= limit - bytes;
}

uint64_t dst_offset(const Op& op, Direction direction) {
  return direction == Direction::kWrite ? op.remote_offset : op.local_offset;
}

// What one pass over a batch learns about its destinations.
struct Destinations {
  bool ascending = true;  // each starts at or after the end of the one before: disjoint
  uint64_t min = UINT64_MAX;
  uint64_t max_end = 0;
  uint64_t offset_bits = 0;  // OR of (offset - first offset) and length: their common alignment
};

// The first op that breaks a per-op rule, with the error naming it. Run only once the
// fast pass below has found that some op does.
Status first_bad_op(std::span<const Op> ops, uint64_t local_bytes, uint64_t remote_bytes) {
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
  return internal_error("batch of {} ops failed the bounds pass but no op breaks a rule", ops.size());
}

// Count, zero lengths and bounds on both sides; fills `dst`. Every later step may assume
// offset + bytes does not overflow. The pass has no branch per op (it accumulates one
// "bad" bit and the destination summary): it runs on every batch, on the critical path.
Status check_each_op(std::span<const Op> ops, Direction direction, uint64_t local_bytes, uint64_t remote_bytes,
                     Destinations& dst) {
  if (ops.size() > kMaxOpsPerBatch) {
    return invalid_argument("batch has {} ops, limit is {}", ops.size(), kMaxOpsPerBatch);
  }
  if (ops.empty()) return Status::Ok();
  const bool write = direction == Direction::kWrite;
  const uint64_t first = dst_offset(ops[0], direction);
  uint64_t previous_end = 0;
  bool bad = false;
  bool ascending = true;
  uint64_t min = UINT64_MAX, max_end = 0, offset_bits = 0;
  for (const Op& op : ops) {
    const uint64_t local_end = op.local_offset + op.bytes;
    const uint64_t remote_end = op.remote_offset + op.bytes;
    // An end below its offset wrapped around: out of range like an end past the region.
    bad |= (op.bytes == 0) | (local_end < op.bytes) | (local_end > local_bytes) | (remote_end < op.bytes) |
           (remote_end > remote_bytes);
    const uint64_t begin = write ? op.remote_offset : op.local_offset;
    const uint64_t end = write ? remote_end : local_end;
    ascending &= begin >= previous_end;
    previous_end = end;
    min = std::min(min, begin);
    max_end = std::max(max_end, end);
    offset_bits |= (begin - first) | op.bytes;  // modular difference: only its low bits matter
  }
  if (bad) return first_bad_op(ops, local_bytes, remote_bytes);
  dst = {ascending, min, max_end, offset_bits};
  return Status::Ok();
}

// A bitmap proof costs one word per 64 units to clear and scan; allowed while that stays
// within a few words per op (KV blocks of one layer or of a whole prompt: far below).
bool bitmap_fits(const Destinations& dst, size_t num_ops) {
  const int shift = std::countr_zero(dst.offset_bits);
  const uint64_t units = (dst.max_end - dst.min) >> shift;
  return units / 64 <= 4 * uint64_t{num_ops} + 64;
}

OverlapCheck choose_overlap_check(const Destinations& dst, size_t num_ops) {
  if (dst.ascending) return OverlapCheck::kAscending;
  if (bitmap_fits(dst, num_ops)) return OverlapCheck::kBitmap;
  return OverlapCheck::kSorted;
}

// Destinations in units of 2^shift from dst.min: bit u set = unit u is written. Every
// destination starts and ends on a unit boundary (shift is their common alignment). The
// first pass only accumulates whether any unit was written twice (one-unit ops, the KV
// case, take no branch); a second pass finds the op to name when one was.
Status check_disjoint_by_bitmap(std::span<const Op> ops, Direction direction, const Destinations& dst) {
  const int shift = std::countr_zero(dst.offset_bits);
  const uint64_t units = (dst.max_end - dst.min) >> shift;
  thread_local std::vector<uint64_t> words;
  // Marks [begin, end) and returns the bits that were already set.
  auto mark = [](uint64_t* w, uint64_t begin, uint64_t end) {
    uint64_t clash = 0;
    for (uint64_t u = begin; u < end;) {
      const uint64_t bit = u % 64;
      const uint64_t span = std::min<uint64_t>(64 - bit, end - u);
      const uint64_t mask = (span == 64 ? ~uint64_t{0} : ((uint64_t{1} << span) - 1)) << bit;
      clash |= w[u / 64] & mask;
      w[u / 64] |= mask;
      u += span;
    }
    return clash;
  };
  words.assign(units / 64 + 1, 0);
  uint64_t* w = words.data();
  uint64_t clash = 0;
  for (const Op& op : ops) {
    const uint64_t begin = (dst_offset(op, direction) - dst.min) >> shift;
    const uint64_t count = op.bytes >> shift;
    if (count == 1) {
      const uint64_t bit = uint64_t{1} << (begin % 64);
      clash |= w[begin / 64] & bit;
      w[begin / 64] |= bit;
    } else {
      clash |= mark(w, begin, begin + count);
    }
  }
  if (clash == 0) return Status::Ok();
  words.assign(units / 64 + 1, 0);
  for (size_t i = 0; i < ops.size(); ++i) {
    const uint64_t begin = (dst_offset(ops[i], direction) - dst.min) >> shift;
    if (mark(words.data(), begin, begin + (ops[i].bytes >> shift)) != 0) {
      return invalid_argument("op {} at destination offset {} (+{}) overlaps another op of the batch", i,
                              dst_offset(ops[i], direction), ops[i].bytes);
    }
  }
  return internal_error("bitmap found an overlap the second pass did not");
}

struct Keyed {
  uint64_t key;
  uint64_t index;
};

// (destination offset, index) pairs in destination order, by an LSD radix sort, 11 bits a
// pass, on (offset - min) >> common alignment so that only as many passes run as the
// spread of the batch needs (a layer of KV blocks: one pass; a whole prompt: two). A KV
// batch of thousands of ops sorts in microseconds, where std::sort took hundreds.
// Scratch is per thread and reused, so no page is touched anew.
const std::vector<Keyed>& sort_by_destination(std::span<const Op> ops, Direction direction, const Destinations& dst) {
  thread_local std::vector<Keyed> keyed, spare;
  keyed.resize(ops.size());
  spare.resize(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) keyed[i] = {dst_offset(ops[i], direction), i};
  if (dst.ascending) return keyed;
  const int shift = std::countr_zero(dst.offset_bits);
  const uint64_t max_digit_key = (dst.max_end - dst.min) >> shift;
  constexpr int kDigitBits = 11;
  constexpr size_t kBuckets = size_t{1} << kDigitBits;
  for (int pass = 0; pass < 64 && (max_digit_key >> pass) != 0; pass += kDigitBits) {
    const int digit_shift = shift + pass;
    auto digit = [&](const Keyed& k) { return ((k.key - dst.min) >> digit_shift) & (kBuckets - 1); };
    size_t counts[kBuckets] = {};
    for (const Keyed& k : keyed) ++counts[digit(k)];
    size_t position = 0;
    for (size_t& c : counts) position += std::exchange(c, position);
    for (const Keyed& k : keyed) spare[counts[digit(k)]++] = k;
    keyed.swap(spare);
  }
  return keyed;
}

}  // namespace

Status normalize_ops_into(std::span<const Op> ops, Direction direction, uint64_t local_bytes, uint64_t remote_bytes,
                          std::vector<Op>& out) {
  out.clear();
  Destinations dst;
  PD_RETURN_IF_ERROR(check_each_op(ops, direction, local_bytes, remote_bytes, dst));
  if (ops.empty()) return Status::Ok();
  const std::vector<Keyed>& keyed = sort_by_destination(ops, direction, dst);
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

Status validate_ops(std::span<const Op> ops, Direction direction, uint64_t local_bytes, uint64_t remote_bytes) {
  Destinations dst;
  PD_RETURN_IF_ERROR(check_each_op(ops, direction, local_bytes, remote_bytes, dst));
  if (ops.empty()) return Status::Ok();
  switch (choose_overlap_check(dst, ops.size())) {
    case OverlapCheck::kAscending:
      return Status::Ok();
    case OverlapCheck::kBitmap:
      return check_disjoint_by_bitmap(ops, direction, dst);
    case OverlapCheck::kSorted:
      break;
  }
  const std::vector<Keyed>& keyed = sort_by_destination(ops, direction, dst);
  for (size_t i = 1; i < keyed.size(); ++i) {
    const Op& previous = ops[keyed[i - 1].index];
    const uint64_t previous_end = keyed[i - 1].key + previous.bytes;
    if (keyed[i].key < previous_end) {
      return invalid_argument("op {} at destination offset {} (+{}) overlaps the op ending at {}", keyed[i].index,
                              keyed[i].key, ops[keyed[i].index].bytes, previous_end);
    }
  }
  return Status::Ok();
}

OverlapCheck overlap_check_for(std::span<const Op> ops, Direction direction) {
  Destinations dst;
  if (!check_each_op(ops, direction, UINT64_MAX, UINT64_MAX, dst).ok() || ops.empty()) return OverlapCheck::kAscending;
  return choose_overlap_check(dst, ops.size());
}

size_t ConsecutiveMerger::next(std::span<Op> out) {
  size_t n = 0;
  while (next_ < ops_.size()) {
    const Op& op = ops_[next_];
    if (n > 0) {
      Op& last = out[n - 1];
      if (op.local_offset == last.local_offset + last.bytes && op.remote_offset == last.remote_offset + last.bytes) {
        last.bytes += op.bytes;
        ++next_;
        continue;
      }
    }
    if (n == out.size()) break;
    out[n++] = op;
    ++next_;
  }
  return n;
}

}  // namespace pd::xfer
