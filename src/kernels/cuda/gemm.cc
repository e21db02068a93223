#include "kernels/cuda/gemm.h"

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/device_memory.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.h"

namespace pd::kernels::cuda {
namespace {

constexpr int kTimingRounds = 3;
constexpr int kCallsPerRound = 5;

Status lt_status(cublasStatus_t st, const char* what) {
  if (st == CUBLAS_STATUS_SUCCESS) return Status::Ok();
  return internal_error("{} failed: cublas status {} ({})", what, static_cast<int>(st), cublasLtGetStatusString(st));
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) return true;  // be safe: never sync then
  return status != cudaStreamCaptureStatusNone;
}

// The skinny kernel reads a and w rows with 16-byte loads (k % 8 == 0 is checked by run()).
bool aligned_16(const void* a, const void* w) {
  return reinterpret_cast<uintptr_t>(a) % 16 == 0 && reinterpret_cast<uintptr_t>(w) % 16 == 0;
}

}  // namespace

bool Gemm::skinny_aligned(const Call& call) {
  return aligned_16(call.a, call.w) &&
         (call.fusion.norm_weight == nullptr || aligned_16(call.fusion.norm_weight, call.fusion.norm_scratch));
}

int32_t Gemm::num_skinny_variants() {
  return detail::kNumSkinnyGemmVariants;
}

int32_t Gemm::skinny_variant_max_m(int32_t variant) {
  return detail::skinny_gemm_max_m(variant);
}

bool Gemm::skinny_norm_in_kernel(int32_t variant, int32_t m, int32_t k) {
  return detail::skinny_gemm_norm_fusable(variant, m, k);
}

Result<std::unique_ptr<Gemm>> Gemm::create(size_t workspace_bytes, GemmPolicy policy, int32_t skinny_variant) {
  if (skinny_variant < 0 || skinny_variant >= detail::kNumSkinnyGemmVariants) {
    return invalid_argument("gemm: skinny variant {} (have 0..{})", skinny_variant, detail::kNumSkinnyGemmVariants - 1);
  }
  std::unique_ptr<Gemm> g(new Gemm());
  g->policy_ = policy;
  g->forced_skinny_variant_ = skinny_variant;
  PD_RETURN_IF_ERROR(lt_status(cublasLtCreate(&g->handle_), "cublasLtCreate"));
  PD_RETURN_IF_ERROR(device_malloc(&g->workspace_, workspace_bytes, "cudaMalloc(gemm workspace)"));
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
  device_free(workspace_);
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

Status Gemm::launch(const Plan& plan, const Call& c) {
  // The plan is per shape, the pointers per call: a misaligned call takes the plan's cuBLASLt algorithm.
  const bool skinny = plan.skinny_variant >= 0 && skinny_aligned(c);
  const bool normed = c.fusion.norm_weight != nullptr;
  const bool norm_in_kernel =
      normed && skinny && plan.norm_in_kernel && detail::skinny_gemm_norm_fusable(plan.skinny_variant, c.m, c.k);
  const __nv_bfloat16* a = c.a;
  if (normed && !norm_in_kernel) {
    PD_RETURN_IF_ERROR(
        rmsnorm(c.fusion.norm_scratch, c.a, nullptr, c.fusion.norm_weight, c.m, c.k, c.fusion.norm_eps, c.stream));
    a = c.fusion.norm_scratch;
  }
  if (skinny) {
    detail::SkinnyFusion fusion;
    fusion.accumulate = c.fusion.accumulate;
    if (norm_in_kernel) {
      fusion.norm_weight = c.fusion.norm_weight;
      fusion.norm_eps = c.fusion.norm_eps;
    }
    return cuda_status(detail::launch_skinny_gemm(c.out, c.out_type == GemmOut::kFloat32, a, c.w, c.m, c.n, c.k,
                                                  plan.skinny_variant, c.stream, fusion),
                       "skinny gemm launch");
  }
  // Accumulating: D = A * B + C with C = D, in place (same layout, which cuBLASLt allows).
  const float alpha = 1.0f, beta = c.fusion.accumulate ? 1.0f : 0.0f;
  return lt_status(cublasLtMatmul(handle_, plan.desc, &alpha, c.w, plan.a, a, plan.b, &beta, c.out, plan.c, c.out,
                                  plan.c, &plan.algo, workspace_, workspace_bytes_, c.stream),
                   "cublasLtMatmul");
}

Result<float> Gemm::time_plan(const Plan& plan, const Call& call, cudaEvent_t start, cudaEvent_t stop) {
  PD_RETURN_IF_ERROR(launch(plan, call));  // warm-up (first-use costs of the algorithm)
  float best_ms = 0.0f;
  for (int round = 0; round < kTimingRounds; ++round) {
    PD_RETURN_IF_ERROR(cuda_status(cudaEventRecord(start, call.stream), "gemm tuning event"));
    for (int i = 0; i < kCallsPerRound; ++i) PD_RETURN_IF_ERROR(launch(plan, call));
    PD_RETURN_IF_ERROR(cuda_status(cudaEventRecord(stop, call.stream), "gemm tuning event"));
    PD_RETURN_IF_ERROR(cuda_status(cudaEventSynchronize(stop), "gemm tuning sync"));
    float ms = 0.0f;
    PD_RETURN_IF_ERROR(cuda_status(cudaEventElapsedTime(&ms, start, stop), "gemm tuning elapsed"));
    best_ms = round == 0 ? ms : std::min(best_ms, ms);
  }
  return best_ms * 1000.0f / kCallsPerRound;
}

Status Gemm::tune(Plan& plan, const Call& call, const std::vector<cublasLtMatmulHeuristicResult_t>& candidates) {
  cudaEvent_t start = nullptr, stop = nullptr;
  PD_RETURN_IF_ERROR(cuda_status(cudaEventCreate(&start), "gemm tuning event create"));
  const Status created = cuda_status(cudaEventCreate(&stop), "gemm tuning event create");
  if (!created.ok()) {
    cudaEventDestroy(start);
    return created;
  }
  GemmTuning t;
  t.m = call.m;
  t.n = call.n;
  t.k = call.k;
  t.out_type = call.out_type;
  t.normed = call.fusion.norm_weight != nullptr;
  t.accumulate = call.fusion.accumulate;
  // Timing an accumulating call adds into `out` dozens of times: keep its contents and put them back.
  void* saved_out = nullptr;
  const size_t out_bytes = static_cast<size_t>(call.m) * call.n * (call.out_type == GemmOut::kFloat32 ? 4 : 2);
  if (call.fusion.accumulate) {
    Status saved = cuda_status(cudaMalloc(&saved_out, out_bytes), "cudaMalloc(gemm tuning backup)");
    if (saved.ok()) {
      saved = cuda_status(cudaMemcpyAsync(saved_out, call.out, out_bytes, cudaMemcpyDeviceToDevice, call.stream),
                          "gemm tuning backup");
    }
    if (!saved.ok()) {
      cudaFree(saved_out);
      cudaEventDestroy(start);
      cudaEventDestroy(stop);
      return saved;
    }
  }
  Status st = Status::Ok();
  cublasLtMatmulAlgo_t best_algo = plan.algo;
  for (size_t i = 0; i < candidates.size(); ++i) {
    Plan trial = plan;
    trial.algo = candidates[i].algo;
    trial.skinny_variant = -1;
    Result<float> us = time_plan(trial, call, start, stop);
    if (!us.ok()) {
      // A candidate the heuristic offered but that fails to run is skipped, not fatal.
      cudaGetLastError();
      continue;
    }
    ++t.num_candidates;
    if (i == 0) t.heuristic_us = *us;
    if (t.best_cublas_us < 0.0f || *us < t.best_cublas_us) {
      t.best_cublas_us = *us;
      best_algo = candidates[i].algo;
    }
  }
  plan.algo = best_algo;
  plan.skinny_variant = -1;
  plan.norm_in_kernel = false;
  // Skinny variants; for a normed call each both with the norm kernel before it and with the norm in-kernel.
  for (int in_kernel = 0; in_kernel <= (t.normed ? 1 : 0) && st.ok(); ++in_kernel) {
    for (int32_t v = 0; v < detail::kNumSkinnyGemmVariants && st.ok() && skinny_aligned(call); ++v) {
      if (call.m > detail::skinny_gemm_max_m(v)) continue;
      if (in_kernel != 0 && !detail::skinny_gemm_norm_fusable(v, call.m, call.k)) continue;
      Plan trial = plan;
      trial.skinny_variant = v;
      trial.norm_in_kernel = in_kernel != 0;
      Result<float> us = time_plan(trial, call, start, stop);
      st = us.status();
      if (!st.ok()) break;
      float& best = in_kernel != 0 ? t.skinny_norm_in_kernel_us : t.skinny_us;
      int32_t& best_variant = in_kernel != 0 ? t.skinny_norm_in_kernel_variant : t.skinny_variant;
      if (best < 0.0f || *us < best) {
        best = *us;
        best_variant = v;
      }
    }
  }
  if (st.ok()) {
    float best_us = t.best_cublas_us;
    if (t.skinny_variant >= 0 && (best_us < 0.0f || t.skinny_us < best_us)) {
      plan.skinny_variant = t.skinny_variant;
      best_us = t.skinny_us;
    }
    if (t.skinny_norm_in_kernel_variant >= 0 && (best_us < 0.0f || t.skinny_norm_in_kernel_us < best_us)) {
      plan.skinny_variant = t.skinny_norm_in_kernel_variant;
      plan.norm_in_kernel = true;
    }
  }
  t.chose_skinny = plan.skinny_variant >= 0;
  t.chose_norm_in_kernel = plan.norm_in_kernel;
  if (saved_out != nullptr) {
    const Status restored = cuda_status(
        cudaMemcpyAsync(call.out, saved_out, out_bytes, cudaMemcpyDeviceToDevice, call.stream), "gemm tuning restore");
    if (st.ok()) st = restored;
    if (st.ok()) st = cuda_status(cudaStreamSynchronize(call.stream), "gemm tuning restore sync");
    cudaFree(saved_out);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  PD_RETURN_IF_ERROR(st);
  if (t.num_candidates == 0 && plan.skinny_variant < 0) {
    return internal_error("gemm m={} n={} k={}: no cuBLASLt candidate ran", call.m, call.n, call.k);
  }
  tunings_.push_back(t);
  return Status::Ok();
}

bool Gemm::borrow_tuned_choice(Plan& plan, const Call& call) const {
  const Plan* donor = nullptr;
  int32_t donor_m = 0;
  for (const auto& [key, candidate] : plans_) {
    const auto& [m, n, k, out_type, fusion] = key;
    if (!candidate.tuned || n != call.n || k != call.k || out_type != call.out_type || m < call.m ||
        fusion != fusion_kind(call.fusion)) {
      continue;
    }
    if (donor == nullptr || m < donor_m) {
      donor = &candidate;
      donor_m = m;
    }
  }
  if (donor == nullptr) return false;
  if (donor->skinny_variant >= 0) {
    if (call.m > detail::skinny_gemm_max_m(donor->skinny_variant)) return false;
    plan.skinny_variant = donor->skinny_variant;
    plan.norm_in_kernel = donor->norm_in_kernel;
    return true;
  }
  // An algorithm (tile, split-K, ...) tuned for M' is usually right for a slightly smaller M,
  // but cuBLASLt decides whether it supports this shape and fits the workspace.
  cublasLtMatmulHeuristicResult_t check{};
  const cublasStatus_t st =
      cublasLtMatmulAlgoCheck(handle_, plan.desc, plan.a, plan.b, plan.c, plan.c, &donor->algo, &check);
  if (st != CUBLAS_STATUS_SUCCESS || check.workspaceSize > workspace_bytes_) return false;
  plan.algo = donor->algo;
  return true;
}

// Column-major view: out^T [N x M] = w [N x K] (stored K x N, transposed) * a^T (K x M).
Result<Gemm::Plan*> Gemm::plan_for(const Call& call) {
  const auto key = std::make_tuple(call.m, call.n, call.k, call.out_type, fusion_kind(call.fusion));
  auto it = plans_.find(key);
  if (it != plans_.end()) return &it->second;
  const int32_t m = call.m, n = call.n, k = call.k;
  Plan plan;
  const cudaDataType_t c_type = call.out_type == GemmOut::kFloat32 ? CUDA_R_32F : CUDA_R_16BF;
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
  const bool autotuned_size = policy_ == GemmPolicy::kAutotune && m <= kMaxTunedM;
  const bool tuned = autotuned_size && tuning_enabled_ && !stream_is_capturing(call.stream);
  cublasLtMatmulPreference_t pref = nullptr;
  PD_RETURN_IF_ERROR(lt_status(cublasLtMatmulPreferenceCreate(&pref), "preference create"));
  const uint64_t ws = workspace_bytes_;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  std::vector<cublasLtMatmulHeuristicResult_t> results(tuned ? kTunedAlgos : 1);
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle_, plan.desc, plan.a, plan.b, plan.c, plan.c, pref,
                                                           static_cast<int>(results.size()), results.data(), &found);
  cublasLtMatmulPreferenceDestroy(pref);
  PD_RETURN_IF_ERROR(lt_status(st, "cublasLtMatmulAlgoGetHeuristic"));
  if (found == 0) return internal_error("cuBLASLt has no algorithm for bf16 GEMM m={} n={} k={}", m, n, k);
  results.resize(static_cast<size_t>(found));
  plan.algo = results[0].algo;
  if (policy_ == GemmPolicy::kSkinny && m <= detail::skinny_gemm_max_m(forced_skinny_variant_)) {
    plan.skinny_variant = forced_skinny_variant_;
    plan.norm_in_kernel = true;  // checks and benchmarks of a variant run its fused form
  }
  if (tuned) {
    PD_RETURN_IF_ERROR(tune(plan, call, results));
    plan.tuned = true;
  } else if (autotuned_size) {
    if (borrow_tuned_choice(plan, call)) {
      ++num_borrowed_plans_;
    } else {
      ++num_untuned_plans_;
    }
  }
  auto [pos, inserted] = plans_.emplace(key, plan);
  return &pos->second;
}

Status Gemm::run(void* out, GemmOut out_type, const __nv_bfloat16* a, const __nv_bfloat16* w, int32_t m, int32_t n,
                 int32_t k, cudaStream_t stream, const GemmFusion& fusion) {
  if (m == 0) return Status::Ok();
  if (m < 0 || n <= 0 || k <= 0 || k % 8 != 0 || n % 8 != 0) {
    return invalid_argument("gemm shape m={} n={} k={}: need m >= 0, n, k > 0 and multiples of 8", m, n, k);
  }
  const bool normed = fusion.norm_weight != nullptr;
  if ((normed || fusion.accumulate) && out_type != GemmOut::kBFloat16) {
    return invalid_argument("gemm m={} n={} k={}: norm and accumulate fusions need bf16 output", m, n, k);
  }
  if (normed && fusion.accumulate) {
    return invalid_argument("gemm m={} n={} k={}: norm and accumulate fusions exclude each other", m, n, k);
  }
  // A normed GEMM reads all of `a` in every CTA (and the norm kernel writes the scratch the GEMM
  // reads), so none of a, the scratch and out may share memory.
  if (normed && (fusion.norm_scratch == nullptr || fusion.norm_scratch == a || fusion.norm_scratch == out ||
                 out == static_cast<const void*>(a) || !(fusion.norm_eps > 0.0f))) {
    return invalid_argument(
        "gemm m={} n={} k={}: a norm fusion needs a scratch buffer apart from a and out, out apart from a, and eps > 0",
        m, n, k);
  }
  if (fusion.accumulate && out == static_cast<const void*>(a)) {
    return invalid_argument("gemm m={} n={} k={}: an accumulating call's out must not alias a", m, n, k);
  }
  const Call call{out, out_type, a, w, m, n, k, stream, fusion};
  PD_ASSIGN_OR_RETURN(Plan * plan, plan_for(call));
  return launch(*plan, call);
}

}  // namespace pd::kernels::cuda
