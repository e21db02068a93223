// The tensor-parallel ranks' collectives through NCCL: one process, one thread
// per rank, one communicator per rank (ncclCommInitAll over the ranks' devices).
// NCCL is loaded at run time (dlopen of libnccl.so.2, or $PDSERVE_NCCL_LIBRARY):
// the build needs only nccl.h (CUDA toolkit), an instance at tensor_parallel_size
// 1 never loads it, and a missing library is a clear error at start-up instead
// of a binary that does not start. On the GPU machine the library comes with
// PyTorch (site-packages/nvidia/nccl/lib on LD_LIBRARY_PATH).
//
// Threads: rank r's calls (all_reduce_bf16, all_gather) come from rank r's
// thread only; every rank issues the same collectives in the same order (the
// runner's ranks execute the same step plan). Collectives are enqueued on the
// caller's stream and may be captured into a CUDA graph. abort() may be called
// from any thread once the ranks stopped issuing collectives.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace pd::engine {

struct NcclApi;  // the resolved symbols of the loaded library

class NcclGroup {
 public:
  // Loads NCCL (once per process) and creates one communicator per entry of
  // `devices` (rank r on device devices[r]). Fails with a clear message when the
  // library or one of its symbols is missing, when it is older than 2.10 (graph
  // capture of collectives), or when NCCL refuses the devices.
  static Result<std::unique_ptr<NcclGroup>> create(const std::vector<int32_t>& devices);
  ~NcclGroup();
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  int32_t size() const { return static_cast<int32_t>(comms_.size()); }
  // "2.21.5": the loaded library's version.
  const std::string& version() const { return version_; }

  // In place: data[0, count) = the sum over the ranks of their data[0, count) (bf16).
  Status all_reduce_bf16(int32_t rank, void* data, size_t count, cudaStream_t stream);
  // recv [size()][count] = every rank's send [count], in rank order (same dtype on every rank).
  Status all_gather(int32_t rank, const void* send, void* recv, size_t count, ncclDataType_t type, cudaStream_t stream);
  // Ends every communicator's outstanding work (a rank failed mid-step and its peers
  // wait in a collective that will never complete). The group is unusable afterwards.
  void abort();
  bool aborted() const { return aborted_; }

 private:
  NcclGroup() = default;
  Status check(ncclResult_t result, int32_t rank, const char* what) const;

  const NcclApi* api_ = nullptr;
  std::vector<ncclComm_t> comms_;
  std::string version_;
  bool aborted_ = false;
};

}  // namespace pd::engine
