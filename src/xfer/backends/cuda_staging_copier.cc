// The cuda staging copier: pinned host buffers, one non-blocking stream per device
// (created on first use), cudaMemcpyAsync per piece, then a stream sync. Called only
// from the ucx backend's progress thread, so the streams need no lock of their own;
// the caller thread's current device is restored after every call.
#include <cuda_runtime.h>

#include <map>
#include <mutex>

#include "xfer/backends/staging_copier.h"

namespace pd::xfer {
namespace {

Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return Status::Ok();
  return unavailable("{}: {}", what, cudaGetErrorString(e));
}

class CurrentDevice {
 public:
  explicit CurrentDevice(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) status_ = cudaSetDevice(device);
  }
  ~CurrentDevice() {
    int now = previous_;
    cudaGetDevice(&now);
    if (now != previous_) cudaSetDevice(previous_);
  }
  cudaError_t status() const { return status_; }

 private:
  int previous_ = 0;
  cudaError_t status_ = cudaSuccess;
};

class CudaCopier : public StagingCopier {
 public:
  ~CudaCopier() override {
    for (auto& [device, stream] : streams_) {
      CurrentDevice current(device);
      cudaStreamDestroy(stream);
    }
  }
  std::string_view name() const override { return "cuda"; }

  Status to_staging(int device, const uint8_t* region, uint8_t* staging,
                    std::span<const StagingPiece> pieces) override {
    return copy(device, pieces, [&](const StagingPiece& p, cudaStream_t s) {
      return cudaMemcpyAsync(staging + p.staging_offset, region + p.region_offset, p.bytes, cudaMemcpyDeviceToHost, s);
    });
  }
  Status to_region(int device, uint8_t* region, const uint8_t* staging, std::span<const StagingPiece> pieces) override {
    return copy(device, pieces, [&](const StagingPiece& p, cudaStream_t s) {
      return cudaMemcpyAsync(region + p.region_offset, staging + p.staging_offset, p.bytes, cudaMemcpyHostToDevice, s);
    });
  }
  Result<uint8_t*> allocate_host(uint64_t bytes) override {
    void* ptr = nullptr;
    PD_RETURN_IF_ERROR(cuda_status(cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable), "cudaHostAlloc (staging)"));
    return static_cast<uint8_t*>(ptr);
  }
  void free_host(uint8_t* ptr) override { cudaFreeHost(ptr); }

 private:
  template <typename CopyOne>
  Status copy(int device, std::span<const StagingPiece> pieces, CopyOne copy_one) {
    CurrentDevice current(device);
    PD_RETURN_IF_ERROR(cuda_status(current.status(), "cudaSetDevice"));
    cudaStream_t stream = nullptr;
    {
      std::lock_guard lock(mutex_);
      auto it = streams_.find(device);
      if (it == streams_.end()) {
        PD_RETURN_IF_ERROR(
            cuda_status(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate (staging)"));
        streams_.emplace(device, stream);
      } else {
        stream = it->second;
      }
    }
    for (const StagingPiece& p : pieces) {
      PD_RETURN_IF_ERROR(cuda_status(copy_one(p, stream), "cudaMemcpyAsync (staging)"));
    }
    return cuda_status(cudaStreamSynchronize(stream), "cudaStreamSynchronize (staging)");
  }

  std::mutex mutex_;  // guards streams_ (created lazily)
  std::map<int, cudaStream_t> streams_;
};

}  // namespace

Result<std::unique_ptr<StagingCopier>> make_cuda_copier() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the sticky "no device" error for other users of the runtime
    return unavailable("no CUDA device visible");
  }
  return std::unique_ptr<StagingCopier>(std::make_unique<CudaCopier>());
}

}  // namespace pd::xfer
