// FP8 GEMM with 128 x 128 block-scaled weights (DeepSeek / Qwen3 "fp8" checkpoints):
// out[M][N] (+)= a[M][K] . dequant(w[N][K])^T, bf16 in and out, fp32 accumulate.
//
// Two paths:
// - kCublas: the activations are quantized per token per 128-wide group (quantize_fp8,
//   scale = amax / 448) into a scratch buffer this object owns, then cuBLASLt's block-scaled
//   FP8 GEMM runs with CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F on the weights (cuBLASLt's
//   A, row-major [N][K] seen as column-major K x N, transposed) and VEC128_32F on the
//   activations (its B). Layouts: fp8_args.h.
//   cuBLASLt runs only M a multiple of 16 (fp8_args.h, fp8_cublas_rows): the first
//   fp8_cublas_rows(M) rows take it, the rest (< 16) the streaming kernel; M < 16 only streams.
// - kStream: weight streaming on the bf16 activations, no quantization: for M <= 16 a
//   tensor-core kernel (each weight byte read once, converted to bf16 times its block scale
//   in registers, mma m16n8k16), above that stream_gemm (CUDA cores, one weight pass per 8
//   rows). For small M.
// Policy kAuto: the first call of a shape with M <= kMaxTunedM outside a graph capture times
// both paths on the call's buffers and keeps the faster (the call synchronizes its stream;
// `out` is restored for accumulating calls); larger M takes cuBLASLt. When cuBLASLt has no
// algorithm for a shape (or its first launch fails) the shape falls back to kStream, and
// fallbacks() says which shapes and why. Not thread-safe: one Fp8Gemm per stream owner.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "common/status.h"
#include "kernels/cuda/fp8_args.h"

namespace pd::kernels::cuda {

enum class Fp8GemmPolicy : uint8_t { kAuto, kCublas, kStream };
enum class Fp8GemmPath : uint8_t { kCublas, kStream };

struct Fp8GemmTuning {
  int32_t m = 0, n = 0, k = 0;
  float cublas_us = -1.0f;            // quantize + cuBLASLt (< 0: not available)
  float stream_us = -1.0f;            // the tensor-core streaming kernel (M <= 16)
  float stream_cuda_core_us = -1.0f;  // the CUDA-core streaming kernel (timed for M <= kCudaCoreStreamMaxM)
  Fp8GemmPath chose = Fp8GemmPath::kCublas;
  bool chose_cuda_cores = false;  // kStream: the CUDA-core kernel won
};

class Fp8Gemm {
 public:
  static constexpr int32_t kMaxTunedM = 64;
  // The streaming path runs the tensor-core kernel up to this M (fp8.cu), the CUDA-core
  // stream_gemm above it.
  static constexpr int32_t kTensorCoreStreamMaxM = 16;
  // Up to this M the tuner also times the CUDA-core streaming kernel (lane-strided weight rows,
  // no mma), and an untuned shape takes it: it won every M = 1 shape of the 32B / 30B-A3B / 235B
  // FP8 layers (32B qkv 20.1 vs 25.7 us, gate_up 64.5 vs 103.3) and took Qwen3-32B-FP8 decode b1
  // from 1.90x to 1.28x the floor (docs/perf/engine.md, 2026-12-02 00:01 UTC).
  static constexpr int32_t kCudaCoreStreamMaxM = 4;

  // max_m x max_k: the largest activation the owned quantization scratch holds (run()).
  static Result<std::unique_ptr<Fp8Gemm>> create(int32_t max_m, int32_t max_k,
                                                 Fp8GemmPolicy policy = Fp8GemmPolicy::kAuto,
                                                 size_t workspace_bytes = 64ull << 20);
  ~Fp8Gemm();
  Fp8Gemm(const Fp8Gemm&) = delete;
  Fp8Gemm& operator=(const Fp8Gemm&) = delete;

  // bf16 activations a [m][lda = k]; quantizes them into the scratch when cuBLASLt runs.
  Status run(__nv_bfloat16* out, const __nv_bfloat16* a, int32_t m, const Fp8Weight& w, cudaStream_t stream,
             bool accumulate = false);
  // Activations already quantized (quantize_fp8 / quantize_fp8_grouped layout, scale
  // ld = m): always cuBLASLt; m must be a multiple of 16 (UNIMPLEMENTED otherwise, or when
  // cuBLASLt has no algorithm for the shape).
  Status run_quantized(__nv_bfloat16* out, const uint8_t* a_q, const float* a_scales, int32_t m, const Fp8Weight& w,
                       cudaStream_t stream, bool accumulate = false);

  Fp8GemmPolicy policy() const { return policy_; }
  void set_tuning(bool enabled) { tuning_enabled_ = enabled; }
  // The path of the last run() / run_quantized().
  Fp8GemmPath last_path() const { return last_path_; }
  const std::vector<Fp8GemmTuning>& tunings() const { return tunings_; }
  // "m=.. n=.. k=..: reason" for every shape whose cuBLASLt plan was unavailable.
  const std::vector<std::string>& fallbacks() const { return fallbacks_; }

 private:
  Fp8Gemm() = default;
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
    bool cublas_ok = false;
    Fp8GemmPath path = Fp8GemmPath::kCublas;
    bool stream_cuda_cores = false;  // kStream runs the CUDA-core kernel (M <= kCudaCoreStreamMaxM)
  };
  Result<Plan*> plan_for(int32_t m, const Fp8Weight& w, bool accumulate, const uint8_t* a_q, const float* a_scales);
  Status launch_cublas(Plan& plan, __nv_bfloat16* out, const uint8_t* a_q, const float* a_scales, int32_t m,
                       const Fp8Weight& w, cudaStream_t stream, bool accumulate);
  Status launch_stream(__nv_bfloat16* out, const __nv_bfloat16* a, int32_t m, const Fp8Weight& w, cudaStream_t stream,
                       bool accumulate, bool cuda_cores = false);
  Status launch_path(Plan& plan, Fp8GemmPath path, __nv_bfloat16* out, const __nv_bfloat16* a, int32_t m,
                     const Fp8Weight& w, cudaStream_t stream, bool accumulate);
  Status tune(Plan& plan, __nv_bfloat16* out, const __nv_bfloat16* a, int32_t m, const Fp8Weight& w,
              cudaStream_t stream, bool accumulate);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  uint8_t* act_q_ = nullptr;
  float* act_scales_ = nullptr;
  int32_t max_m_ = 0, max_k_ = 0;
  Fp8GemmPolicy policy_ = Fp8GemmPolicy::kAuto;
  bool tuning_enabled_ = true;
  Fp8GemmPath last_path_ = Fp8GemmPath::kCublas;
  std::map<std::tuple<int32_t, int32_t, int32_t, bool>, Plan> plans_;
  std::vector<Fp8GemmTuning> tunings_;
  std::vector<std::string> fallbacks_;
};

// Device copy of a checkpoint's block scales [ceil(n/128)][ceil(k/128)] (row-major, fp32)
// in the padded layout Fp8Weight expects ([ceil(n/128)][fp8_weight_scale_ld(k)], padding 0).
std::vector<float> pad_fp8_weight_scales(const std::vector<float>& scales, int32_t n, int32_t k);

}  // namespace pd::kernels::cuda
