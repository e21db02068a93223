// The copy kernel's op table entry, shared by the kernel (nvcc, C++17) and the host-only
// launch planning (copy_plan.h), which must build without CUDA.
#pragma once

#include <cstdint>

namespace pd::xfer {

// One op of a batch as the kernel sees it (device addresses in this process).
struct CopyOp {
  uint64_t src;
  uint64_t dst;
  uint64_t bytes;
  uint64_t chunk_begin;  // index of this op's first chunk_bytes chunk within the launch
};

// Launches of at most this many ops pass their table inside the launch parameters
// (CUDA 12.1+: up to 32,764 bytes of parameters).
constexpr uint32_t kMaxInlineOps = 1000;

}  // namespace pd::xfer
