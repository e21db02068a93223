// The device side of the ucx backend's staging (ucx_staging.h): copies between a
// registered region's memory and a host staging buffer. Two implementations:
// `cuda` (cudaMemcpyAsync on a stream of the region's device, then a stream sync)
// and `memcpy` (the region is host memory standing in for a device: what the CPU
// tests run, through the same staging protocol).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "common/status.h"

namespace pd::xfer {

// One contiguous copy between a region (at region_offset) and a staging buffer (at
// staging_offset).
struct StagingPiece {
  uint64_t region_offset = 0;
  uint64_t staging_offset = 0;
  uint64_t bytes = 0;
};

class StagingCopier {
 public:
  virtual ~StagingCopier() = default;
  virtual std::string_view name() const = 0;
  // Each returns once every piece is complete in the destination (the staging
  // protocol reports a batch done only after its last copy returned).
  virtual Status to_staging(int device, const uint8_t* region, uint8_t* staging,
                            std::span<const StagingPiece> pieces) = 0;
  virtual Status to_region(int device, uint8_t* region, const uint8_t* staging,
                           std::span<const StagingPiece> pieces) = 0;
  // Host memory for staging buffers (pinned for cuda, so copies run at full speed
  // and asynchronously); freed by free_host.
  virtual Result<uint8_t*> allocate_host(uint64_t bytes) = 0;
  virtual void free_host(uint8_t* ptr) = 0;
};

std::unique_ptr<StagingCopier> make_memcpy_copier();
// kUnavailable when built without CUDA or when no GPU is visible.
Result<std::unique_ptr<StagingCopier>> make_cuda_copier();

}  // namespace pd::xfer
