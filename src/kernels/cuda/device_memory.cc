#include "kernels/cuda/device_memory.h"

#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "kernels/cuda/kernels.h"

namespace pd::kernels::cuda {
namespace {

struct Ledger {
  std::mutex mu;
  std::unordered_map<void*, std::pair<int, size_t>> blocks;  // pointer -> (device, bytes)
  std::map<int, size_t> held;                                // device -> bytes
};

Ledger& ledger() {
  static Ledger* l = new Ledger();  // never destroyed: frees may run from static destructors
  return *l;
}

}  // namespace

Status device_malloc(void** ptr, size_t bytes, const char* what) {
  *ptr = nullptr;
  int device = 0;
  PD_RETURN_IF_ERROR(cuda_status(cudaGetDevice(&device), "cudaGetDevice"));
  void* p = nullptr;
  PD_RETURN_IF_ERROR(cuda_status(cudaMalloc(&p, bytes), what));
  Ledger& l = ledger();
  std::lock_guard<std::mutex> lock(l.mu);
  l.blocks[p] = {device, bytes};
  l.held[device] += bytes;
  *ptr = p;
  return Status::Ok();
}

void device_free(void* ptr) {
  if (ptr == nullptr) return;
  {
    Ledger& l = ledger();
    std::lock_guard<std::mutex> lock(l.mu);
    auto it = l.blocks.find(ptr);
    if (it != l.blocks.end()) {
      l.held[it->second.first] -= it->second.second;
      l.blocks.erase(it);
    }
  }
  cudaFree(ptr);
}

size_t device_bytes_held(int device) {
  Ledger& l = ledger();
  std::lock_guard<std::mutex> lock(l.mu);
  auto it = l.held.find(device);
  return it == l.held.end() ? 0 : it->second;
}

}  // namespace pd::kernels::cuda
