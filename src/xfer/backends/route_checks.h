// Checks a backend makes before a peer's memory descriptor becomes an address here. A peer's
// descriptor is its word only (DESIGN.md §3.1): the cuda backend opens the IPC handle it
// carries and adds the offset it claims, and for a peer claiming our own process it would use
// the base address it claims as is. These checks keep both inside memory the descriptor may
// name. Host code only, so the CPU build tests them.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

#include "xfer/types.h"

namespace pd::xfer {

// [offset, offset + bytes) inside [0, limit), without overflow.
inline bool span_within(uint64_t offset, uint64_t bytes, uint64_t limit) {
  return offset <= limit && bytes <= limit - offset;
}

// Device spans registered by every cuda backend of this process. A peer that claims to be
// this process (the same-process shortcut: tensor-parallel ranks are threads of one
// process, and CUDA cannot open its own process's IPC handles) must name one of them, so a
// forged owner pid never turns an arbitrary address into a copy target.
class ProcessRegions {
 public:
  static ProcessRegions& instance() {
    static ProcessRegions regions;
    return regions;
  }

  void add(const void* owner, RegionId id, uintptr_t base, uint64_t bytes) {
    std::lock_guard lock(mutex_);
    spans_[{owner, id}] = {base, bytes};
  }
  void remove(const void* owner, RegionId id) {
    std::lock_guard lock(mutex_);
    spans_.erase({owner, id});
  }
  void remove_owner(const void* owner) {
    std::lock_guard lock(mutex_);
    std::erase_if(spans_, [owner](const auto& entry) { return entry.first.first == owner; });
  }
  // [base, base + bytes) inside one registered span.
  bool contains(uintptr_t base, uint64_t bytes) const {
    std::lock_guard lock(mutex_);
    for (const auto& [key, span] : spans_) {
      if (base >= span.first && span_within(base - span.first, bytes, span.second)) return true;
    }
    return false;
  }

 private:
  mutable std::mutex mutex_;
  std::map<std::pair<const void*, RegionId>, std::pair<uintptr_t, uint64_t>> spans_;
};

}  // namespace pd::xfer
