// bf16 GEMM: out[M][N] = a[M][K] * w[N][K]^T (HF's row-major
// [out_features][in_features] weights), fp32 accumulate, bf16 or fp32 output.
// Backends: cuBLASLt, and for M <= 16 the skinny kernel (skinny_gemm.cu).
// The plan is chosen once per (M, N, K, output type) and cached; the cuBLASLt
// workspace is owned here, so calls are safe inside CUDA graph capture once a
// shape has been seen outside it.
//
// Policy kAutotune (the default): while tuning is on, the first call of a shape
// with M <= 256 (decode buckets, short prefills) that is not inside a graph
// capture times up to kTunedAlgos of cuBLASLt's heuristic candidates and, for
// M <= 16, each variant of the skinny kernel, on the call's own buffers, and
// keeps the fastest. The first call of a tuned shape therefore synchronizes the
// stream, takes tens of milliseconds on large weights and writes `out` several
// times (out must not alias a or w, as for any call). A server tunes its decode
// buckets at load and then turns tuning off (set_tuning(false)): a new M in a
// serving step (a chunked-prefill remainder plus decode rows takes any value)
// must not stall every running request. With tuning off, a new shape with
// M <= 256 borrows the plan of the smallest tuned M' >= M of the same N, K and
// output (the skinny kernel fits any M <= M'; a cuBLASLt algorithm only if
// cuBLASLt confirms it for the new shape); anything else takes cuBLASLt's first
// heuristic choice.
// Fusions (GemmFusion, per call): the residual add as an accumulating store (out += a * w^T;
// cuBLASLt with beta = 1 in place, the skinny kernels read-add-write), and an RMSNorm of the
// input rows (a holds the residual stream; the GEMM multiplies rmsnorm(a) * norm_weight). A
// skinny plan may compute the norm in-kernel (skinny_gemm.cu: variants 0..4, M <= 4, with the
// same arithmetic as the norm kernel); any other plan runs the norm kernel into norm_scratch first. The tuner times the
// in-kernel and the separate-kernel forms and keeps the fastest, so the norm kernel leaves the decode chain only where
// that measures faster. A tuned accumulating call restores `out` after timing. With programmatic launch on (kernels.h),
// the skinny kernels read their first weight chunks before waiting for the kernel launched just before them on the
// stream (pdl.cuh), so that kernel must not write `w`; a model's weights are written only at load. Not thread-safe: one
// Gemm per stream owner.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "common/status.h"

namespace pd::kernels::cuda {

enum class GemmOut : uint8_t { kBFloat16, kFloat32 };
// kHeuristic: cuBLASLt's first heuristic choice (the first version; kept for
// before/after runs). kSkinny: the skinny kernel variant given to create()
// whenever M fits it (checks and benchmarks).
enum class GemmPolicy : uint8_t { kAutotune, kHeuristic, kSkinny };

// See the header comment. norm_weight and accumulate exclude each other; both need bf16 out.
struct GemmFusion {
  const __nv_bfloat16* norm_weight = nullptr;  // [k]: multiply rmsnorm(a) * norm_weight
  float norm_eps = 1e-6f;
  __nv_bfloat16* norm_scratch = nullptr;  // [m][k]: where a separate norm kernel writes (required with norm_weight)
  bool accumulate = false;                // out += a * w^T
};

// What the tuner measured for one shape (times of one call, microseconds; < 0 = not run).
struct GemmTuning {
  int32_t m = 0, n = 0, k = 0;
  GemmOut out_type = GemmOut::kBFloat16;
  float heuristic_us = -1.0f;    // cuBLASLt's first choice
  float best_cublas_us = -1.0f;  // fastest of the timed cuBLASLt candidates
  float skinny_us = -1.0f;       // fastest skinny variant
  int32_t skinny_variant = -1;   // which one
  int32_t num_candidates = 0;
  bool chose_skinny = false;
  bool normed = false;                     // a norm-fused call: every time includes the norm
  bool accumulate = false;                 // an accumulating call
  float skinny_norm_in_kernel_us = -1.0f;  // normed: fastest skinny variant with the norm in-kernel
  int32_t skinny_norm_in_kernel_variant = -1;
  bool chose_norm_in_kernel = false;
};

class Gemm {
 public:
  static constexpr int32_t kMaxTunedM = 256;
  static constexpr int kTunedAlgos = 16;

  static Result<std::unique_ptr<Gemm>> create(size_t workspace_bytes = 64ull << 20,
                                              GemmPolicy policy = GemmPolicy::kAutotune, int32_t skinny_variant = 0);
  static int32_t num_skinny_variants();
  static int32_t skinny_variant_max_m(int32_t variant);
  // Whether a skinny variant can compute a fused norm in-kernel at this M and K.
  static bool skinny_norm_in_kernel(int32_t variant, int32_t m, int32_t k);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  Status run(void* out, GemmOut out_type, const __nv_bfloat16* a, const __nv_bfloat16* w, int32_t m, int32_t n,
             int32_t k, cudaStream_t stream, const GemmFusion& fusion = {});

  GemmPolicy policy() const { return policy_; }
  // Whether a new shape may still be tuned (kAutotune only; on after create()).
  void set_tuning(bool enabled) { tuning_enabled_ = enabled; }
  bool tuning() const { return tuning_enabled_; }
  // Shapes planned with tuning off: borrowed from a tuned M, or cuBLASLt's first choice.
  int32_t num_borrowed_plans() const { return num_borrowed_plans_; }
  int32_t num_untuned_plans() const { return num_untuned_plans_; }
  // One entry per tuned shape, in the order they were tuned.
  const std::vector<GemmTuning>& tunings() const { return tunings_; }

 private:
  Gemm() = default;
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
    int32_t skinny_variant = -1;  // >= 0: the skinny kernel runs instead of algo
    bool norm_in_kernel = false;  // normed calls with a skinny variant: the kernel computes the norm
    bool tuned = false;           // chosen by timing (a plan other shapes may borrow)
  };
  struct Call {
    void* out;
    GemmOut out_type;
    const __nv_bfloat16* a;
    const __nv_bfloat16* w;
    int32_t m, n, k;
    cudaStream_t stream;
    GemmFusion fusion;
  };
  // Plans differ by fusion: 0 none, 1 norm, 2 accumulate.
  static int32_t fusion_kind(const GemmFusion& f) { return f.norm_weight != nullptr ? 1 : f.accumulate ? 2 : 0; }
  static bool skinny_aligned(const Call& call);
  Result<Plan*> plan_for(const Call& call);
  Status launch(const Plan& plan, const Call& call);
  // Time of one call in microseconds: the fastest of a few rounds of back-to-back calls.
  Result<float> time_plan(const Plan& plan, const Call& call, cudaEvent_t start, cudaEvent_t stop);
  Status tune(Plan& plan, const Call& call, const std::vector<cublasLtMatmulHeuristicResult_t>& candidates);
  // With tuning off: takes the choice of the smallest tuned M' >= call.m of the same
  // N, K and output into `plan` where it is valid for call.m. True if it did.
  bool borrow_tuned_choice(Plan& plan, const Call& call) const;

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  GemmPolicy policy_ = GemmPolicy::kAutotune;
  int32_t forced_skinny_variant_ = 0;  // kSkinny
  bool tuning_enabled_ = true;
  int32_t num_borrowed_plans_ = 0;
  int32_t num_untuned_plans_ = 0;
  std::map<std::tuple<int32_t, int32_t, int32_t, GemmOut, int32_t>, Plan> plans_;
  std::vector<GemmTuning> tunings_;
};

}  // namespace pd::kernels::cuda
