// Timing helpers and the two ceilings (device-to-device copy bandwidth,
// cuBLASLt bf16 GEMM rate), measured in the same run as what they bound.
#pragma once

#include <algorithm>
#include <vector>

#include "kernels/cuda/gemm.h"
#include "kernels/cuda/kernels.h"
#include "tests/gpu/gpu_util.h"

namespace pd::gpu_test {

// Median of `reps` event-timed runs of fn on the default stream, after 3 warm-ups.
template <typename Fn>
float time_ms(Fn&& fn, int reps = 20) {
  cudaEvent_t start, stop;
  PD_CUDA_CHECK(cudaEventCreate(&start));
  PD_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) fn();
  std::vector<float> times;
  for (int i = 0; i < reps; ++i) {
    PD_CUDA_CHECK(cudaEventRecord(start));
    fn();
    PD_CUDA_CHECK(cudaEventRecord(stop));
    PD_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    PD_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  PD_CUDA_CHECK(cudaEventDestroy(start));
  PD_CUDA_CHECK(cudaEventDestroy(stop));
  return times[times.size() / 2];
}

// Device time of one call of fn(stream) when `calls` of them run back to back
// inside one CUDA graph, as kernels do in the runner's decode graph (so launch
// gaps are the graph's, not the host's): median of `reps` replays / calls.
// fn runs once outside the capture first (GEMM plans, one-time attributes).
template <typename Fn>
float time_in_graph_ms(Fn&& fn, int calls = 20, int reps = 10) {
  cudaStream_t stream = nullptr;
  PD_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  fn(stream);
  PD_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph = nullptr;
  PD_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < calls; ++i) fn(stream);
  PD_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  PD_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  PD_CUDA_CHECK(cudaGraphDestroy(graph));
  cudaEvent_t start, stop;
  PD_CUDA_CHECK(cudaEventCreate(&start));
  PD_CUDA_CHECK(cudaEventCreate(&stop));
  PD_CUDA_CHECK(cudaGraphLaunch(exec, stream));  // warm-up replay
  std::vector<float> times;
  for (int r = 0; r < reps; ++r) {
    PD_CUDA_CHECK(cudaEventRecord(start, stream));
    PD_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    PD_CUDA_CHECK(cudaEventRecord(stop, stream));
    PD_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    PD_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms / static_cast<float>(calls));
  }
  std::sort(times.begin(), times.end());
  PD_CUDA_CHECK(cudaEventDestroy(start));
  PD_CUDA_CHECK(cudaEventDestroy(stop));
  PD_CUDA_CHECK(cudaGraphExecDestroy(exec));
  PD_CUDA_CHECK(cudaStreamDestroy(stream));
  return times[times.size() / 2];
}

// GB/s of a 4 GiB device-to-device copy, counting bytes read plus written.
inline double measure_copy_gbs() {
  const size_t bytes = 4ull << 30;
  DeviceBuffer<uint8_t> src(bytes), dst(bytes);
  PD_STATUS_CHECK(
      kernels::cuda::fill_uniform(reinterpret_cast<__nv_bfloat16*>(src.get()), bytes / 2, 1, 1.0f, nullptr));
  const float ms =
      time_ms([&] { PD_CUDA_CHECK(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice)); });
  return 2.0 * static_cast<double>(bytes) / (ms * 1e6);
}

// TFLOP/s of an 8192^3 bf16 GEMM through the same cuBLASLt wrapper, random data.
inline double measure_gemm_tflops() {
  const int n = 8192;
  namespace kc = kernels::cuda;
  DeviceBuffer<__nv_bfloat16> a(static_cast<size_t>(n) * n), b(a.count()), c(a.count());
  PD_STATUS_CHECK(kc::fill_uniform(a.get(), a.count(), 2, 1.0f, nullptr));
  PD_STATUS_CHECK(kc::fill_uniform(b.get(), b.count(), 3, 1.0f, nullptr));
  auto gemm = kc::Gemm::create();
  PD_STATUS_CHECK(gemm.status());
  const float ms = time_ms(
      [&] { PD_STATUS_CHECK((*gemm)->run(c.get(), kc::GemmOut::kBFloat16, a.get(), b.get(), n, n, n, nullptr)); });
  return 2.0 * n * n * static_cast<double>(n) / (ms * 1e9);
}

}  // namespace pd::gpu_test
