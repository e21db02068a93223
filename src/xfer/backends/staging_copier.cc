#include "xfer/backends/staging_copier.h"

#include <cstdlib>
#include <cstring>

namespace pd::xfer {
namespace {

class MemcpyCopier : public StagingCopier {
 public:
  std::string_view name() const override { return "memcpy"; }
  Status to_staging(int, const uint8_t* region, uint8_t* staging, std::span<const StagingPiece> pieces) override {
    for (const StagingPiece& p : pieces) std::memcpy(staging + p.staging_offset, region + p.region_offset, p.bytes);
    return Status::Ok();
  }
  Status to_region(int, uint8_t* region, const uint8_t* staging, std::span<const StagingPiece> pieces) override {
    for (const StagingPiece& p : pieces) std::memcpy(region + p.region_offset, staging + p.staging_offset, p.bytes);
    return Status::Ok();
  }
  Result<uint8_t*> allocate_host(uint64_t bytes) override {
    void* ptr = nullptr;
    if (posix_memalign(&ptr, 4096, bytes) != 0) return resource_exhausted("staging buffer of {} bytes", bytes);
    return static_cast<uint8_t*>(ptr);
  }
  void free_host(uint8_t* ptr) override { std::free(ptr); }
};

}  // namespace

std::unique_ptr<StagingCopier> make_memcpy_copier() {
  return std::make_unique<MemcpyCopier>();
}

}  // namespace pd::xfer
