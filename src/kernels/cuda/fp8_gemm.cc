#include "kernels/cuda/fp8_gemm.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/device_memory.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.h"

namespace pd::kernels::cuda {
namespace {

constexpr int kTimingRounds = 3;
constexpr int kCallsPerRound = 5;
// Untuned shapes (tuning off or inside a capture) at or below this M take the streaming kernel.
constexpr int32_t kDefaultStreamMaxM = 16;

Status lt_status(cublasStatus_t st, const char* what) {
  if (st == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  return internal_error("{} failed: cublas status {} ({})", what, static_cast<int>(st), cublasLtGetStatusString(st));
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) return true;
  return status != cudaStreamCaptureStatusNone;
}

Status check_weight(const Fp8Weight& w, const char* what) {
  if (w.data == nullptr || w.scale == nullptr || w.n <= 0 || w.k <= 0 || w.k % kFp8Block != 0 || w.n % 16 != 0 ||
      w.scale_ld < (w.k + kFp8Block - 1) / kFp8Block) {
    return invalid_argument("{}: FP8 weight n {} k {} scale_ld {} (need data and scales, k a multiple of {}, n of 16)",
                            what, w.n, w.k, w.scale_ld, kFp8Block);
  }
  return Status::Ok();
}

}  // namespace

std::vector<float> pad_fp8_weight_scales(const std::vector<float>& scales, int32_t n, int32_t k) {
  const int32_t rows = (n + kFp8Block - 1) / kFp8Block, cols = (k + kFp8Block - 1) / kFp8Block;
  const int32_t ld = fp8_weight_scale_ld(k);
  std::vector<float> out(static_cast<size_t>(rows) * ld, 0.0f);
  for (int32_t r = 0; r < rows; ++r) {
    for (int32_t c = 0; c < cols; ++c) {
      out[static_cast<size_t>(r) * ld + c] = scales[static_cast<size_t>(r) * cols + c];
    }
  }
  return out;
}

Result<std::unique_ptr<Fp8Gemm>> Fp8Gemm::create(int32_t max_m, int32_t max_k, Fp8GemmPolicy policy,
                                                 size_t workspace_bytes) {
  if (max_m <= 0 || max_k <= 0 || max_k % kFp8Block != 0) {
    return invalid_argument("fp8 gemm: scratch for {} x {} (need k a multiple of {})", max_m, max_k, kFp8Block);
  }
  std::unique_ptr<Fp8Gemm> g(new Fp8Gemm());
  g->policy_ = policy;
  g->max_m_ = max_m;
  g->max_k_ = max_k;
  PD_RETURN_IF_ERROR(lt_status(cublasLtCreate(&g->handle_), "cublasLtCreate"));
  PD_RETURN_IF_ERROR(device_malloc(&g->workspace_, workspace_bytes, "cudaMalloc(fp8 gemm workspace)"));
  g->workspace_bytes_ = workspace_bytes;
  PD_RETURN_IF_ERROR(device_malloc(reinterpret_cast<void**>(&g->act_q_), static_cast<size_t>(max_m) * max_k,
                                   "cudaMalloc(fp8 activations)"));
  const size_t scale_count = static_cast<size_t>(max_k / kFp8Block) * fp8_act_scale_ld(max_m);
  PD_RETURN_IF_ERROR(device_malloc(reinterpret_cast<void**>(&g->act_scales_), scale_count * sizeof(float),
                                   "cudaMalloc(fp8 activation scales)"));
  return g;
}

Fp8Gemm::~Fp8Gemm() {
  for (auto& [key, plan] : plans_) {
    cublasLtMatrixLayoutDestroy(plan.a);
    cublasLtMatrixLayoutDestroy(plan.b);
    cublasLtMatrixLayoutDestroy(plan.c);
    cublasLtMatmulDescDestroy(plan.desc);
  }
  device_free(act_scales_);
  device_free(act_q_);
  device_free(workspace_);
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

// Column-major view as in Gemm: out^T [N x M] = w (K x N, transposed) * a^T (K x M).
Result<Fp8Gemm::Plan*> Fp8Gemm::plan_for(int32_t m, const Fp8Weight& w, bool accumulate, const uint8_t* a_q,
                                         const float* a_scales) {
  const auto key = std::make_tuple(m, w.n, w.k, accumulate);
  auto it = plans_.find(key);
  if (it != plans_.end()) return &it->second;
  Plan plan;
  // cuBLASLt runs the first fp8_cublas_rows(m) rows; below 16 rows the shape only streams.
  const int32_t main_rows = fp8_cublas_rows(m);
  if (main_rows == 0) {
    plan.path = Fp8GemmPath::kStream;
    plan.stream_cuda_cores = m <= kCudaCoreStreamMaxM;
    auto [pos, inserted] = plans_.emplace(key, plan);
    return &pos->second;
  }
  PD_RETURN_IF_ERROR(
      lt_status(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate"));
  const cublasOperation_t trans = CUBLAS_OP_T, no_trans = CUBLAS_OP_N;
  const int32_t a_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, b_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
  const void* a_scale_ptr = w.scale;
  const void* b_scale_ptr = a_scales;
  PD_RETURN_IF_ERROR(lt_status(
      cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof(trans)), "set TRANSA"));
  PD_RETURN_IF_ERROR(
      lt_status(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, &no_trans, sizeof(no_trans)),
                "set TRANSB"));
  PD_RETURN_IF_ERROR(
      lt_status(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &a_mode, sizeof(a_mode)),
                "set A_SCALE_MODE"));
  PD_RETURN_IF_ERROR(
      lt_status(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &b_mode, sizeof(b_mode)),
                "set B_SCALE_MODE"));
  PD_RETURN_IF_ERROR(lt_status(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                              &a_scale_ptr, sizeof(a_scale_ptr)),
                               "set A_SCALE_POINTER"));
  PD_RETURN_IF_ERROR(lt_status(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                              &b_scale_ptr, sizeof(b_scale_ptr)),
                               "set B_SCALE_POINTER"));
  PD_RETURN_IF_ERROR(lt_status(cublasLtMatrixLayoutCreate(&plan.a, CUDA_R_8F_E4M3, w.k, w.n, w.k), "layout A"));
  PD_RETURN_IF_ERROR(lt_status(cublasLtMatrixLayoutCreate(&plan.b, CUDA_R_8F_E4M3, w.k, main_rows, w.k), "layout B"));
  PD_RETURN_IF_ERROR(lt_status(cublasLtMatrixLayoutCreate(&plan.c, CUDA_R_16BF, w.n, main_rows, w.n), "layout C"));
  cublasLtMatmulPreference_t pref = nullptr;
  PD_RETURN_IF_ERROR(lt_status(cublasLtMatmulPreferenceCreate(&pref), "preference create"));
  const uint64_t ws = workspace_bytes_;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(handle_, plan.desc, plan.a, plan.b, plan.c, plan.c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st == CUBLAS_STATUS_SUCCESS && found > 0) {
    plan.algo = result.algo;
    plan.cublas_ok = true;
  } else {
    fallbacks_.push_back(
        fmt::format("m={} n={} k={}: cuBLASLt block-scaled FP8 has no algorithm ({}); streaming kernel", m, w.n, w.k,
                    st == CUBLAS_STATUS_SUCCESS ? "0 results" : cublasLtGetStatusString(st)));
  }
  plan.path = plan.cublas_ok ? Fp8GemmPath::kCublas : Fp8GemmPath::kStream;
  if (plan.cublas_ok &&
      (policy_ == Fp8GemmPolicy::kStream || (policy_ == Fp8GemmPolicy::kAuto && m <= kDefaultStreamMaxM))) {
    plan.path = Fp8GemmPath::kStream;
  }
  auto [pos, inserted] = plans_.emplace(key, plan);
  return &pos->second;
}

Status Fp8Gemm::launch_cublas(Plan& plan, __nv_bfloat16* out, const uint8_t* a_q, const float* a_scales, int32_t m,
                              const Fp8Weight& w, cudaStream_t stream, bool accumulate) {
  (void)m;
  const void* a_scale_ptr = w.scale;
  const void* b_scale_ptr = a_scales;
  PD_RETURN_IF_ERROR(lt_status(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                              &a_scale_ptr, sizeof(a_scale_ptr)),
                               "set A_SCALE_POINTER"));
  PD_RETURN_IF_ERROR(lt_status(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                              &b_scale_ptr, sizeof(b_scale_ptr)),
                               "set B_SCALE_POINTER"));
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  return lt_status(cublasLtMatmul(handle_, plan.desc, &alpha, w.data, plan.a, a_q, plan.b, &beta, out, plan.c, out,
                                  plan.c, &plan.algo, workspace_, workspace_bytes_, stream),
                   "cublasLtMatmul (fp8 block-scaled)");
}

Status Fp8Gemm::launch_stream(__nv_bfloat16* out, const __nv_bfloat16* a, int32_t m, const Fp8Weight& w,
                              cudaStream_t stream, bool accumulate, bool cuda_cores) {
  if (m <= kTensorCoreStreamMaxM && !cuda_cores) {
    // Tensor cores (fp8.cu): check_weight guarantees k % 128 == 0 and n % 16 == 0.
    return cuda_status(
        detail::launch_fp8_tc_stream(out, a, w.data, w.scale, w.scale_ld, m, w.n, w.k, accumulate, stream),
        "fp8 tensor-core streaming gemm launch");
  }
  StreamGemmArgs args;
  args.out = out;
  args.ldo = w.n;
  args.a = a;
  args.lda = w.k;
  args.w = w.data;
  args.w_scale = w.scale;
  args.w_scale_ld = w.scale_ld;
  args.m = m;
  args.n = w.n;
  args.k = w.k;
  args.accumulate = accumulate;
  args.cuda_cores = cuda_cores;
  return stream_gemm(args, m, stream);
}

Status Fp8Gemm::launch_path(Plan& plan, Fp8GemmPath path, __nv_bfloat16* out, const __nv_bfloat16* a, int32_t m,
                            const Fp8Weight& w, cudaStream_t stream, bool accumulate) {
  last_path_ = path;
  if (path == Fp8GemmPath::kStream) return launch_stream(out, a, m, w, stream, accumulate, plan.stream_cuda_cores);
  if (m > max_m_ || w.k > max_k_) {
    return invalid_argument("fp8 gemm: activations {} x {} exceed the quantization scratch ({} x {})", m, w.k, max_m_,
                            max_k_);
  }
  // The plan's M is fp8_cublas_rows(m); the remaining rows (< 16) stream.
  const int32_t main_rows = fp8_cublas_rows(m);
  PD_RETURN_IF_ERROR(quantize_fp8(act_q_, act_scales_, a, main_rows, w.k, stream));
  PD_RETURN_IF_ERROR(launch_cublas(plan, out, act_q_, act_scales_, main_rows, w, stream, accumulate));
  if (main_rows == m) return Status::Ok();
  return launch_stream(out + static_cast<int64_t>(main_rows) * w.n, a + static_cast<int64_t>(main_rows) * w.k,
                       m - main_rows, w, stream, accumulate);
}

Status Fp8Gemm::tune(Plan& plan, __nv_bfloat16* out, const __nv_bfloat16* a, int32_t m, const Fp8Weight& w,
                     cudaStream_t stream, bool accumulate) {
  Fp8GemmTuning t;
  t.m = m;
  t.n = w.n;
  t.k = w.k;
  cudaEvent_t start = nullptr, stop = nullptr;
  PD_RETURN_IF_ERROR(cuda_status(cudaEventCreate(&start), "fp8 tuning event"));
  PD_RETURN_IF_ERROR(cuda_status(cudaEventCreate(&stop), "fp8 tuning event"));
  const size_t out_bytes = static_cast<size_t>(m) * w.n * sizeof(__nv_bfloat16);
  void* saved = nullptr;
  Status st = Status::Ok();
  if (accumulate) {
    st = cuda_status(cudaMalloc(&saved, out_bytes), "cudaMalloc(fp8 tuning backup)");
    if (st.ok()) {
      st = cuda_status(cudaMemcpyAsync(saved, out, out_bytes, cudaMemcpyDeviceToDevice, stream), "fp8 tuning backup");
    }
  }
  auto time_path = [&](Fp8GemmPath path) -> Result<float> {
    PD_RETURN_IF_ERROR(launch_path(plan, path, out, a, m, w, stream, accumulate));
    float best = 0.0f;
    for (int r = 0; r < kTimingRounds; ++r) {
      PD_RETURN_IF_ERROR(cuda_status(cudaEventRecord(start, stream), "fp8 tuning record"));
      for (int i = 0; i < kCallsPerRound; ++i) {
        PD_RETURN_IF_ERROR(launch_path(plan, path, out, a, m, w, stream, accumulate));
      }
      PD_RETURN_IF_ERROR(cuda_status(cudaEventRecord(stop, stream), "fp8 tuning record"));
      PD_RETURN_IF_ERROR(cuda_status(cudaEventSynchronize(stop), "fp8 tuning sync"));
      float ms = 0.0f;
      PD_RETURN_IF_ERROR(cuda_status(cudaEventElapsedTime(&ms, start, stop), "fp8 tuning elapsed"));
      best = r == 0 ? ms : std::min(best, ms);
    }
    return best * 1000.0f / kCallsPerRound;
  };
  if (st.ok()) {
    plan.stream_cuda_cores = false;
    Result<float> s = time_path(Fp8GemmPath::kStream);
    st = s.status();
    if (st.ok()) t.stream_us = *s;
  }
  if (st.ok() && m <= kCudaCoreStreamMaxM) {
    plan.stream_cuda_cores = true;
    Result<float> s = time_path(Fp8GemmPath::kStream);
    st = s.status();
    if (st.ok()) t.stream_cuda_core_us = *s;
    plan.stream_cuda_cores = st.ok() && t.stream_cuda_core_us < t.stream_us;
  }
  if (st.ok() && plan.cublas_ok) {
    Result<float> c = time_path(Fp8GemmPath::kCublas);
    if (c.ok()) {
      t.cublas_us = *c;
    } else {
      // An algorithm the heuristic offered but that fails to run: the shape falls back.
      cudaGetLastError();
      plan.cublas_ok = false;
      fallbacks_.push_back(fmt::format("m={} n={} k={}: cuBLASLt launch failed ({}); streaming kernel", m, w.n, w.k,
                                       c.status().to_string()));
    }
  }
  const float best_stream = plan.stream_cuda_cores ? t.stream_cuda_core_us : t.stream_us;
  plan.path = t.cublas_us >= 0.0f && t.cublas_us < best_stream ? Fp8GemmPath::kCublas : Fp8GemmPath::kStream;
  t.chose = plan.path;
  t.chose_cuda_cores = plan.path == Fp8GemmPath::kStream && plan.stream_cuda_cores;
  if (saved != nullptr) {
    const Status restored =
        cuda_status(cudaMemcpyAsync(out, saved, out_bytes, cudaMemcpyDeviceToDevice, stream), "fp8 tuning restore");
    if (st.ok()) st = restored;
    if (st.ok()) st = cuda_status(cudaStreamSynchronize(stream), "fp8 tuning restore sync");
    cudaFree(saved);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  PD_RETURN_IF_ERROR(st);
  tunings_.push_back(t);
  return Status::Ok();
}

Status Fp8Gemm::run(__nv_bfloat16* out, const __nv_bfloat16* a, int32_t m, const Fp8Weight& w, cudaStream_t stream,
                    bool accumulate) {
  if (m == 0) return Status::Ok();
  if (m < 0) return invalid_argument("fp8 gemm: m {}", m);
  PD_RETURN_IF_ERROR(check_weight(w, "fp8 gemm"));
  if (accumulate && static_cast<const void*>(out) == static_cast<const void*>(a)) {
    return invalid_argument("fp8 gemm m={} n={} k={}: an accumulating call's out must not alias a", m, w.n, w.k);
  }
  const bool new_shape = plans_.count(std::make_tuple(m, w.n, w.k, accumulate)) == 0;
  PD_ASSIGN_OR_RETURN(Plan * plan, plan_for(m, w, accumulate, act_q_, act_scales_));
  if (new_shape && policy_ == Fp8GemmPolicy::kAuto && m <= kMaxTunedM && tuning_enabled_ &&
      !stream_is_capturing(stream)) {
    PD_RETURN_IF_ERROR(tune(*plan, out, a, m, w, stream, accumulate));
  }
  const Fp8GemmPath path = plan->cublas_ok ? plan->path : Fp8GemmPath::kStream;
  return launch_path(*plan, path, out, a, m, w, stream, accumulate);
}

Status Fp8Gemm::run_quantized(__nv_bfloat16* out, const uint8_t* a_q, const float* a_scales, int32_t m,
                              const Fp8Weight& w, cudaStream_t stream, bool accumulate) {
  if (m == 0) return Status::Ok();
  if (m < 0) return invalid_argument("fp8 gemm: m {}", m);
  PD_RETURN_IF_ERROR(check_weight(w, "fp8 gemm"));
  if (fp8_cublas_rows(m) != m) {
    return unimplemented("fp8 gemm m={} n={} k={}: pre-quantized input needs M a multiple of {}", m, w.n, w.k,
                         kFp8CublasRowMultiple);
  }
  PD_ASSIGN_OR_RETURN(Plan * plan, plan_for(m, w, accumulate, a_q, a_scales));
  if (!plan->cublas_ok) {
    return unimplemented("fp8 gemm m={} n={} k={}: cuBLASLt has no block-scaled algorithm for pre-quantized input", m,
                         w.n, w.k);
  }
  last_path_ = Fp8GemmPath::kCublas;
  return launch_cublas(*plan, out, a_q, a_scales, m, w, stream, accumulate);
}

}  // namespace pd::kernels::cuda
