#include "kernels/cuda/gemm.h"

#include "kernels/cuda/kernels.h"

namespace pd::kernels::cuda {
namespace {

Status lt_status(cublasStatus_t st, const char* what) {
  if (st == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  return internal_error("{} failed: cublas status {} ({})", what, static_cast<int>(st), cublasLtGetStatusString(st));
}

}  // namespace

Result<std::unique_ptr<Gemm>> Gemm::create(size_t workspace_bytes) {
  std::unique_ptr<Gemm> g(new Gemm());
  PD_RETURN_IF_ERROR(lt_status(cublasLtCreate(&g->handle_), "cublasLtCreate"));
  PD_RETURN_IF_ERROR(cuda_status(cudaMalloc(&g->workspace_, workspace_bytes), "cudaMalloc(gemm workspace)"));
  g->workspace_bytes_ = workspace_bytes;
  return g;
}

Gemm::~Gemm() {
  for (auto& [key, plan] : plans_) {
    cublasLtMatrixLayoutDestroy(plan.a);
    cublasLtMatrixLayoutDestroy(plan.b);
    cublasLtMatrixLayoutDestroy(plan.c);
    cublasLtMatmulDescDestroy(plan.desc);
  }
  if (workspace_ != nullptr) cudaFree(workspace_);
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

// Column-major view: out^T [N x M] = w [N x K] (stored K x N, transposed) * a^T (K x M).
Result<Gemm::Plan*> Gemm::plan_for(int32_t m, int32_t n, int32_t k, GemmOut out_type) {
  const auto key = std::make_tuple(m, n, k, out_type);
  auto it = plans_.find(key);
  if (it != plans_.end()) return &it->second;
  Plan plan;
  const cudaDataType_t c_type = out_type == GemmOut::kFloat32 ? CUDA_R_32F : CUDA_R_16BF;
  PD_RETURN_IF_ERROR(
      lt_status(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate"));
  const cublasOperation_t trans = CUBLAS_OP_T, no_trans = CUBLAS_OP_N;
  PD_RETURN_IF_ERROR(lt_status(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof(trans)), "set TRANSA"));
  PD_RETURN_IF_ERROR(
      lt_status(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &no_trans, sizeof(no_trans)),
                "set TRANSB"));
  PD_RETURN_IF_ERROR(lt_status(cublasLtMatrixLayoutCreate(&plan.a, CUDA_R_16BF, k, n, k), "layout A"));
  PD_RETURN_IF_ERROR(lt_status(cublasLtMatrixLayoutCreate(&plan.b, CUDA_R_16BF, k, m, k), "layout B"));
  PD_RETURN_IF_ERROR(lt_status(cublasLtMatrixLayoutCreate(&plan.c, c_type, n, m, n), "layout C"));
  cublasLtMatmulPreference_t pref = nullptr;
  PD_RETURN_IF_ERROR(lt_status(cublasLtMatmulPreferenceCreate(&pref), "preference create"));
  const uint64_t ws = workspace_bytes_;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(handle_, plan.desc, plan.a, plan.b, plan.c, plan.c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  PD_RETURN_IF_ERROR(lt_status(st, "cublasLtMatmulAlgoGetHeuristic"));
  if (found == 0) return internal_error("cuBLASLt has no algorithm for bf16 GEMM m={} n={} k={}", m, n, k);
  plan.algo = result.algo;
  auto [pos, inserted] = plans_.emplace(key, plan);
  return &pos->second;
}

Status Gemm::run(void* out, GemmOut out_type, const __nv_bfloat16* a, const __nv_bfloat16* w, int32_t m, int32_t n,
                 int32_t k, cudaStream_t stream) {
  if (m == 0) return Status::Ok();
  if (m < 0 || n <= 0 || k <= 0 || k % 8 != 0 || n % 8 != 0) {
    return invalid_argument("gemm shape m={} n={} k={}: need m >= 0, n, k > 0 and multiples of 8", m, n, k);
  }
  PD_ASSIGN_OR_RETURN(Plan * plan, plan_for(m, n, k, out_type));
  const float alpha = 1.0f, beta = 0.0f;
  return lt_status(cublasLtMatmul(handle_, plan->desc, &alpha, w, plan->a, a, plan->b, &beta, out, plan->c, out,
                                  plan->c, &plan->algo, workspace_, workspace_bytes_, stream),
                   "cublasLtMatmul");
}

}  // namespace pd::kernels::cuda
