// Helpers shared by the GPU test and benchmark binaries: checked CUDA calls,
// device buffers, bf16 conversion, error norms. Host code only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "common/status.h"

namespace pd::gpu_test {

#define PD_CUDA_CHECK(expr)                                                                                   \
  do {                                                                                                        \
    cudaError_t pd_err_ = (expr);                                                                             \
    if (pd_err_ != cudaSuccess) {                                                                             \
      std::fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(pd_err_)); \
      std::exit(2);                                                                                           \
    }                                                                                                         \
  } while (0)

#define PD_STATUS_CHECK(expr)                                                                         \
  do {                                                                                                \
    ::pd::Status pd_st_ = (expr);                                                                     \
    if (!pd_st_.ok()) {                                                                               \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, pd_st_.to_string().c_str()); \
      std::exit(2);                                                                                   \
    }                                                                                                 \
  } while (0)

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t count) : count_(count) {
    if (count > 0) PD_CUDA_CHECK(cudaMalloc(&ptr_, count * sizeof(T)));
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), count_(o.count_) { o.ptr_ = nullptr; }
  T* get() const { return ptr_; }
  size_t count() const { return count_; }
  void upload(const std::vector<T>& host) {
    PD_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    PD_CUDA_CHECK(cudaDeviceSynchronize());
    PD_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, count_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  // 0xFF bytes: NaN in bf16 and fp32, so an element the kernel forgot shows up.
  void poison() { PD_CUDA_CHECK(cudaMemset(ptr_, 0xFF, count_ * sizeof(T))); }

 private:
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

inline float bf16_round(float x) {
  return __bfloat162float(__float2bfloat16(x));
}

// Random bf16 data: returns the device copy and fills `exact` with the bf16 values as floats.
inline std::vector<__nv_bfloat16> random_bf16(size_t n, float scale, std::mt19937_64& rng, std::vector<float>* exact) {
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<__nv_bfloat16> out(n);
  exact->resize(n);
  for (size_t i = 0; i < n; ++i) {
    out[i] = __float2bfloat16(dist(rng));
    (*exact)[i] = __bfloat162float(out[i]);
  }
  return out;
}

inline std::vector<float> to_float(const std::vector<__nv_bfloat16>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(v[i]);
  return out;
}

struct ErrorStats {
  double rel_l2 = 0.0;  // ||out - ref|| / ||ref||
  double max_abs = 0.0;
  size_t num_nan = 0;  // NaN or inf in the output (also unwritten, poisoned elements)
  size_t count = 0;
};

inline ErrorStats compare(const std::vector<float>& out, const std::vector<float>& ref) {
  ErrorStats s;
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < ref.size() && i < out.size(); ++i) {
    if (!std::isfinite(out[i])) {
      ++s.num_nan;
      continue;
    }
    const double d = static_cast<double>(out[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
    s.max_abs = std::max(s.max_abs, std::abs(d));
  }
  s.count = ref.size();
  if (out.size() != ref.size()) s.num_nan += 1;
  s.rel_l2 = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  return s;
}

}  // namespace pd::gpu_test
