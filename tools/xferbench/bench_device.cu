#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>

#include "bench_device.h"
#include "xfer/backends/copy_kernel.h"

namespace pd::xferbench {
namespace {

__global__ void fill_kernel(uint8_t* p, size_t bytes, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < bytes; i += size_t{gridDim.x} * blockDim.x) {
    p[i] = pattern_byte(seed, i);
  }
}

__global__ void check_kernel(const uint8_t* base, const CheckOp* ops, size_t num_ops, uint64_t seed,
                             unsigned long long* mismatches) {
  unsigned long long local = 0;
  for (size_t o = blockIdx.x; o < num_ops; o += gridDim.x) {
    const CheckOp op = ops[o];
    for (size_t i = threadIdx.x; i < op.bytes; i += blockDim.x) {
      local += base[op.dst_offset + i] != pattern_byte(seed, op.src_offset + i);
    }
  }
  if (local != 0) atomicAdd(mismatches, local);
}

__global__ void spin_kernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// Persistent scratch of the checker (no cudaMalloc/cudaFree between iterations).
struct CheckScratch {
  int device = -1;
  CheckOp* ops = nullptr;
  size_t capacity = 0;
  unsigned long long* count = nullptr;
};
CheckScratch g_scratch;

}  // namespace

void gpu_spin(const std::vector<int>& devices, int ms) {
  for (int d : devices) {
    cudaSetDevice(d);
    int khz = 0, sms = 0;
    cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, d);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, d);
    spin_kernel<<<sms, 32>>>(static_cast<long long>(khz) * ms);
  }
  for (int d : devices) {
    cudaSetDevice(d);
    cudaDeviceSynchronize();
  }
}

int gpu_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

void* gpu_alloc(int device, size_t bytes) {
  void* p = nullptr;
  if (cudaSetDevice(device) != cudaSuccess || cudaMalloc(&p, bytes) != cudaSuccess) return nullptr;
  return p;
}

void gpu_free(int device, void* ptr) {
  cudaSetDevice(device);
  cudaFree(ptr);
}

bool gpu_fill_pattern(int device, void* ptr, size_t bytes, uint64_t seed) {
  cudaSetDevice(device);
  fill_kernel<<<1024, 256>>>(static_cast<uint8_t*>(ptr), bytes, seed);
  return cudaDeviceSynchronize() == cudaSuccess;
}

bool gpu_poison(int device, void* ptr, size_t bytes) {
  cudaSetDevice(device);
  return cudaMemset(ptr, 0xa5, bytes) == cudaSuccess && cudaDeviceSynchronize() == cudaSuccess;
}

uint64_t gpu_count_mismatches(int device, const void* base, const std::vector<CheckOp>& ops, uint64_t seed) {
  cudaSetDevice(device);
  CheckScratch& s = g_scratch;
  if (s.device != device || s.capacity < ops.size()) {
    if (s.ops != nullptr) {
      cudaSetDevice(s.device);
      cudaFree(s.ops);
      cudaFree(s.count);
      cudaSetDevice(device);
    }
    s = CheckScratch{};
    if (cudaMalloc(&s.ops, ops.size() * sizeof(CheckOp)) != cudaSuccess ||
        cudaMalloc(&s.count, sizeof(unsigned long long)) != cudaSuccess) {
      return UINT64_MAX;
    }
    s.device = device;
    s.capacity = ops.size();
  }
  unsigned long long count = 0;
  bool ok = cudaMemcpy(s.ops, ops.data(), ops.size() * sizeof(CheckOp), cudaMemcpyHostToDevice) == cudaSuccess &&
            cudaMemset(s.count, 0, sizeof(count)) == cudaSuccess;
  if (ok) {
    check_kernel<<<2048, 256>>>(static_cast<const uint8_t*>(base), s.ops, ops.size(), seed, s.count);
    ok = cudaMemcpy(&count, s.count, sizeof(count), cudaMemcpyDeviceToHost) == cudaSuccess;
  }
  return ok ? count : UINT64_MAX;
}

std::vector<double> gpu_memcpy_peer_seconds(int dst_device, int src_device, size_t bytes, int warmup, int iters) {
  std::vector<double> seconds;
  void* src = gpu_alloc(src_device, bytes);
  void* dst = gpu_alloc(dst_device, bytes);
  if (src == nullptr || dst == nullptr) return seconds;
  cudaSetDevice(src_device);
  cudaDeviceEnablePeerAccess(dst_device, 0);
  cudaSetDevice(dst_device);
  cudaDeviceEnablePeerAccess(src_device, 0);
  cudaGetLastError();  // "already enabled" is fine
  cudaSetDevice(src_device);
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  for (int i = 0; i < warmup + iters; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    cudaMemcpyPeerAsync(dst, dst_device, src, src_device, bytes, stream);
    if (cudaStreamSynchronize(stream) != cudaSuccess) {
      seconds.clear();
      break;
    }
    auto t1 = std::chrono::steady_clock::now();
    if (i >= warmup) seconds.push_back(std::chrono::duration<double>(t1 - t0).count());
  }
  cudaStreamDestroy(stream);
  gpu_free(src_device, src);
  gpu_free(dst_device, dst);
  return seconds;
}

std::vector<double> gpu_kernel_copy_seconds(int dst_device, int src_device, size_t region_bytes,
                                            const std::vector<CheckOp>& ops, uint32_t chunk_bytes, uint32_t ctas_per_sm,
                                            uint32_t threads, int warmup, int iters) {
  std::vector<double> seconds;
  char* src = static_cast<char*>(gpu_alloc(src_device, region_bytes));
  char* dst = static_cast<char*>(gpu_alloc(dst_device, region_bytes));
  if (src == nullptr || dst == nullptr) return seconds;
  cudaSetDevice(dst_device);
  cudaDeviceEnablePeerAccess(src_device, 0);
  cudaSetDevice(src_device);
  cudaDeviceEnablePeerAccess(dst_device, 0);
  cudaGetLastError();
  std::vector<xfer::CopyOp> table;
  uint64_t chunks = 0;
  for (const CheckOp& op : ops) {
    table.push_back({reinterpret_cast<uint64_t>(src + op.src_offset), reinterpret_cast<uint64_t>(dst + op.dst_offset),
                     op.bytes, chunks});
    chunks += (op.bytes + chunk_bytes - 1) / chunk_bytes;
  }
  xfer::CopyOp* d_table = nullptr;
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, src_device);
  cudaStream_t stream;
  cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (cudaMalloc(&d_table, table.size() * sizeof(xfer::CopyOp)) == cudaSuccess &&
      cudaMemcpy(d_table, table.data(), table.size() * sizeof(xfer::CopyOp), cudaMemcpyHostToDevice) == cudaSuccess) {
    const unsigned grid =
        static_cast<unsigned>(std::min<uint64_t>(chunks, uint64_t(prop.multiProcessorCount) * ctas_per_sm));
    for (int i = 0; i < warmup + iters; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      xfer::launch_gather_scatter(d_table, static_cast<uint32_t>(table.size()), chunks, chunk_bytes, grid, threads,
                                  stream);
      if (cudaStreamSynchronize(stream) != cudaSuccess) {
        seconds.clear();
        break;
      }
      auto t1 = std::chrono::steady_clock::now();
      if (i >= warmup) seconds.push_back(std::chrono::duration<double>(t1 - t0).count());
    }
  }
  cudaStreamDestroy(stream);
  cudaFree(d_table);
  gpu_free(src_device, src);
  gpu_free(dst_device, dst);
  return seconds;
}

}  // namespace pd::xferbench
