// bf16 GEMM through cuBLASLt: out[M][N] = a[M][K] * w[N][K]^T (HF's row-major
// [out_features][in_features] weights), fp32 accumulate, bf16 or fp32 output.
// The algorithm is chosen once per (M, N, K, output type) by cuBLASLt's
// heuristic and cached; the workspace is owned here, so calls are safe inside
// CUDA graph capture once a shape has been seen outside it.
// Not thread-safe: one Gemm per stream owner.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include "common/status.h"

namespace pd::kernels::cuda {

enum class GemmOut : uint8_t { kBFloat16, kFloat32 };

class Gemm {
 public:
  static Result<std::unique_ptr<Gemm>> create(size_t workspace_bytes = 64ull << 20);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  Status run(void* out, GemmOut out_type, const __nv_bfloat16* a, const __nv_bfloat16* w, int32_t m, int32_t n,
             int32_t k, cudaStream_t stream);

 private:
  Gemm() = default;
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  Result<Plan*> plan_for(int32_t m, int32_t n, int32_t k, GemmOut out_type);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<std::tuple<int32_t, int32_t, int32_t, GemmOut>, Plan> plans_;
};

}  // namespace pd::kernels::cuda
