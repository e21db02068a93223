// The cuda backend in a build without CUDA: reports itself unavailable so that the
// engine runs on its other backends.
#include "xfer/backends/factory.h"
#include "xfer/backends/staging_copier.h"

namespace pd::xfer {

Result<std::unique_ptr<Backend>> make_cuda_backend(const EngineConfig&) {
  return unavailable("this build has no CUDA support");
}

Result<std::unique_ptr<StagingCopier>> make_cuda_copier() {
  return unavailable("this build has no CUDA support");
}

}  // namespace pd::xfer
