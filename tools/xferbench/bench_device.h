// GPU helpers of xferbench (bench_device.cu): allocation, the verification
// pattern, byte-exact checks and the cudaMemcpyPeer reference. C++17 so that nvcc
// compiles it; host-only builds use the CPU versions in main.cc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#ifdef __CUDACC__
#define PD_HOST_DEVICE __host__ __device__
#else
#define PD_HOST_DEVICE
#endif

namespace pd::xferbench {

// Byte at source offset i of pattern `seed`: every byte depends on seed and position.
PD_HOST_DEVICE inline uint8_t pattern_byte(uint64_t seed, uint64_t i) {
  uint64_t x = (seed + 1) * 0x9e3779b97f4a7c15ULL ^ (i >> 3) * 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 31;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 29;
  return static_cast<uint8_t>((x >> ((i & 7) * 8)) & 0xff);
}

struct CheckOp {
  uint64_t src_offset;  // offset in the initiator's (pattern) region
  uint64_t dst_offset;  // offset in the checked region
  uint64_t bytes;
};

int gpu_count();
// Keeps every SM of each device busy for `ms` (clocks up before a measurement).
void gpu_spin(const std::vector<int>& devices, int ms);
void* gpu_alloc(int device, size_t bytes);
void gpu_free(int device, void* ptr);
bool gpu_fill_pattern(int device, void* ptr, size_t bytes, uint64_t seed);
bool gpu_poison(int device, void* ptr, size_t bytes);
// Bytes under `ops` in [base, ...) that differ from the pattern; UINT64_MAX on a CUDA error.
uint64_t gpu_count_mismatches(int device, const void* base, const std::vector<CheckOp>& ops, uint64_t seed);
// Seconds per cudaMemcpyPeer of `bytes` from src_device to dst_device (peer access
// enabled both ways), one entry per timed iteration; empty on error.
std::vector<double> gpu_memcpy_peer_seconds(int dst_device, int src_device, size_t bytes, int warmup, int iters);

// The engine's copy kernel alone: `ops` between two buffers of this process (src on
// src_device, dst on dst_device, peer access on), op table uploaded once, launches back
// to back; seconds per launch+sync. Empty on error.
std::vector<double> gpu_kernel_copy_seconds(int dst_device, int src_device, size_t region_bytes,
                                            const std::vector<CheckOp>& ops, uint32_t chunk_bytes, uint32_t ctas_per_sm,
                                            uint32_t threads, int warmup, int iters);

}  // namespace pd::xferbench
