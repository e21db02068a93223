#include "kernels/cuda/grouped_fp8_gemm.h"

#include "kernels/cuda/device_memory.h"
#include "kernels/cuda/grouped_fp8_launch.h"
#include "kernels/cuda/kernels.h"

namespace pd::kernels::cuda {

bool GroupedFp8Gemm::available() {
  return detail::grouped_fp8_gemm_built();
}

Result<std::unique_ptr<GroupedFp8Gemm>> GroupedFp8Gemm::create(int32_t max_groups, int32_t max_rows, int32_t max_n,
                                                               int32_t max_k, uint8_t* a_q, float* a_scales) {
  if (!available()) {
    return unimplemented("grouped FP8 GEMM: built without CUTLASS's SM90 headers (pip package nvidia-cutlass)");
  }
  if (max_groups <= 0 || max_rows <= 0 || max_n <= 0 || max_k <= 0 || max_n % kFp8Block != 0 ||
      max_k % kFp8Block != 0) {
    return invalid_argument("grouped FP8 GEMM: {} groups {} rows n {} k {} (need n and k multiples of {})", max_groups,
                            max_rows, max_n, max_k, kFp8Block);
  }
  std::unique_ptr<GroupedFp8Gemm> g(new GroupedFp8Gemm());
  g->max_groups_ = max_groups;
  g->max_rows_ = max_rows;
  g->max_n_ = max_n;
  g->max_k_ = max_k;
  PD_RETURN_IF_ERROR(cuda_status(cudaGetDevice(&g->device_), "cudaGetDevice"));
  PD_RETURN_IF_ERROR(cuda_status(cudaDeviceGetAttribute(&g->sm_count_, cudaDevAttrMultiProcessorCount, g->device_),
                                 "multiprocessor count"));
  const int64_t k_blocks = max_k / kFp8Block;
  if (a_q != nullptr && a_scales != nullptr) {
    g->owns_a_ = false;
    g->a_q_ = a_q;
    g->a_scales_ = a_scales;
  } else {
    PD_RETURN_IF_ERROR(device_malloc(reinterpret_cast<void**>(&g->a_q_), static_cast<size_t>(max_rows) * max_k,
                                     "cudaMalloc(grouped fp8 activations)"));
    PD_RETURN_IF_ERROR(device_malloc(reinterpret_cast<void**>(&g->a_scales_),
                                     static_cast<size_t>(max_rows) * k_blocks * sizeof(float),
                                     "cudaMalloc(grouped fp8 activation scales)"));
  }
  PD_RETURN_IF_ERROR(device_malloc(reinterpret_cast<void**>(&g->w_scales_),
                                   static_cast<size_t>(max_groups) * (max_n / kFp8Block) * k_blocks * sizeof(float),
                                   "cudaMalloc(grouped fp8 weight scales)"));
  PD_RETURN_IF_ERROR(
      device_malloc(&g->args_, detail::grouped_fp8_arg_bytes(max_groups), "cudaMalloc(grouped fp8 args)"));
  g->workspace_bytes_ = detail::grouped_fp8_workspace_bytes(max_groups, g->sm_count_);
  PD_RETURN_IF_ERROR(
      device_malloc(&g->workspace_, std::max<size_t>(g->workspace_bytes_, 256), "cudaMalloc(grouped fp8 workspace)"));
  return g;
}

GroupedFp8Gemm::~GroupedFp8Gemm() {
  if (owns_a_) {
    device_free(a_q_);
    device_free(a_scales_);
  }
  for (void* p : {static_cast<void*>(w_scales_), args_, workspace_}) {
    device_free(p);
  }
}

Status GroupedFp8Gemm::quantize(const __nv_bfloat16* x, const int32_t* src_rows, bool silu, int32_t rows, int32_t k,
                                const int32_t* offsets, int32_t groups, cudaStream_t stream) {
  if (rows < 0 || rows > max_rows_ || k <= 0 || k > max_k_ || k % kFp8Block != 0 || groups <= 0 ||
      groups > max_groups_ || offsets == nullptr || x == nullptr) {
    return invalid_argument("grouped FP8 quantize: {} rows k {} {} groups (buffers for {} rows k {} {} groups)", rows,
                            k, groups, max_rows_, max_k_, max_groups_);
  }
  PD_RETURN_IF_ERROR(
      cuda_status(detail::launch_grouped_quantize(a_q_, a_scales_, x, src_rows, silu, rows, k, offsets, groups, stream),
                  "grouped fp8 quantize launch"));
  quantized_k_ = k;
  return Status::Ok();
}

Status GroupedFp8Gemm::run(__nv_bfloat16* out, const Fp8Weight& w, const int32_t* offsets, int32_t groups,
                           cudaStream_t stream) {
  if (w.data == nullptr || w.scale == nullptr || w.k != quantized_k_ || w.n <= 0 || w.n > max_n_ ||
      w.n % kFp8Block != 0 || w.scale_ld < w.k / kFp8Block || groups <= 0 || groups > max_groups_ ||
      offsets == nullptr) {
    return invalid_argument(
        "grouped FP8 GEMM: n {} k {} scale_ld {} {} groups (quantized k {}, buffers n {} {} groups)", w.n, w.k,
        w.scale_ld, groups, quantized_k_, max_n_, max_groups_);
  }
  const int32_t n_blocks = w.n / kFp8Block, k_blocks = w.k / kFp8Block;
  const float* w_scales = w.scale;
  if (w.scale_ld != k_blocks) {
    PD_RETURN_IF_ERROR(
        cuda_status(detail::launch_compact_scales(w_scales_, w.scale, groups, n_blocks, k_blocks, w.scale_ld, stream),
                    "grouped fp8 scale compaction"));
    w_scales = w_scales_;
  }
  detail::GroupedFp8Args a;
  a.out = out;
  a.a = a_q_;
  a.a_scales = a_scales_;
  a.w = w.data;
  a.w_scales = w_scales;
  a.offsets = offsets;
  a.groups = groups;
  a.n = w.n;
  a.k = w.k;
  a.arg_buffer = args_;
  a.workspace = workspace_;
  a.workspace_bytes = workspace_bytes_;
  a.device = device_;
  a.sm_count = sm_count_;
  const int rc = detail::launch_grouped_fp8_gemm(a, stream);
  if (rc == 0) return Status::Ok();
  if (rc > 0) return cuda_status(static_cast<cudaError_t>(rc), "grouped fp8 gemm");
  return internal_error("grouped FP8 GEMM n {} k {} {} groups: CUTLASS {}", w.n, w.k, groups,
                        rc == -1   ? "not built"
                        : rc == -2 ? "refused the problem (can_implement)"
                        : rc == -3 ? "initialize failed"
                                   : "launch failed");
}

}  // namespace pd::kernels::cuda
