// Grouped block-scaled FP8 GEMM for MoE prefill: one launch multiplies every group's rows
// (the expert-sorted rows of one MoE projection) by that group's FP8 weight, through CUTLASS's
// SM90 pointer-array kernel with blockwise scaling (TMA loads, wgmma, FP8 accumulation promoted
// to fp32 with the 1 x 128 activation and 128 x 128 weight scales every 128 columns of K). One
// instantiation: 128 x 128 x 128 tiles, cooperative (two consumer warpgroups), no cluster.
// Built only with CUTLASS's headers (PD_HAVE_CUTLASS) for sm_90a; the quantization kernel is
// always built. Layouts: grouped_fp8_launch.h.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/fp8_args.h"
#include "kernels/cuda/grouped_fp8_launch.h"
#include "kernels/cuda/warp_util.cuh"

#if PD_HAVE_CUTLASS
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#endif

namespace pd::kernels::cuda::detail {
namespace {

constexpr int kQuantWarps = 8;

__device__ __forceinline__ void bf16x4_to_float(uint2 raw, float* v) {
  v[0] = __uint_as_float(raw.x << 16);
  v[1] = __uint_as_float(raw.x & 0xffff0000u);
  v[2] = __uint_as_float(raw.y << 16);
  v[3] = __uint_as_float(raw.y & 0xffff0000u);
}

// One warp per (row, 128-wide group), 4 elements per lane.
__global__ void __launch_bounds__(kQuantWarps * 32)
    grouped_quantize_kernel(uint8_t* __restrict__ out, float* __restrict__ scales, const __nv_bfloat16* __restrict__ x,
                            const int32_t* __restrict__ src_rows, bool silu, int32_t rows, int32_t k,
                            const int32_t* __restrict__ offsets, int32_t num_groups) {
  const int kb = k / kFp8Block;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kQuantWarps + threadIdx.x / 32;
  if (item >= static_cast<int64_t>(rows) * kb) return;
  const int row = static_cast<int>(item / kb), g = static_cast<int>(item % kb);
  const int lane = threadIdx.x % 32;
  const int64_t src = src_rows != nullptr ? src_rows[row] : row;
  const int col = g * kFp8Block + lane * 4;
  float v[4];
  if (silu) {
    const __nv_bfloat16* base = x + src * 2 * k;
    float gate[4], up[4];
    bf16x4_to_float(*reinterpret_cast<const uint2*>(base + col), gate);
    bf16x4_to_float(*reinterpret_cast<const uint2*>(base + k + col), up);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // silu_mul's arithmetic: silu(gate) rounded to bf16, times up, the product rounded to bf16.
      const float s = __bfloat162float(__float2bfloat16(gate[j] / (1.0f + __expf(-gate[j]))));
      v[j] = __bfloat162float(__float2bfloat16(s * up[j]));
    }
  } else {
    bf16x4_to_float(*reinterpret_cast<const uint2*>(x + src * k + col), v);
  }
  float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
  amax = warp_max(amax);
  const float scale = amax > 0.0f ? amax / kFp8E4m3Max : 1.0f;
  const __nv_fp8x2_storage_t lo =
      __nv_cvt_float2_to_fp8x2(make_float2(v[0] / scale, v[1] / scale), __NV_SATFINITE, __NV_E4M3);
  const __nv_fp8x2_storage_t hi =
      __nv_cvt_float2_to_fp8x2(make_float2(v[2] / scale, v[3] / scale), __NV_SATFINITE, __NV_E4M3);
  *reinterpret_cast<uint32_t*>(out + static_cast<int64_t>(row) * k + col) =
      static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  if (lane == 0) {
    const int e = find_group(offsets, num_groups, row);
    const int count = offsets[e + 1] - offsets[e];
    scales[static_cast<int64_t>(offsets[e]) * kb + static_cast<int64_t>(g) * count + (row - offsets[e])] = scale;
  }
}

__global__ void compact_scales_kernel(float* __restrict__ out, const float* __restrict__ in, int64_t total,
                                      int32_t k_blocks, int32_t scale_ld) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = i / k_blocks, c = i % k_blocks;
    out[i] = in[row * scale_ld + c];
  }
}

#if PD_HAVE_CUTLASS
using namespace cute;

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
using ElementA = cutlass::float_e4m3_t;
using ElementB = cutlass::float_e4m3_t;
using ElementD = cutlass::bfloat16_t;
using LayoutA = cutlass::layout::RowMajor;     // activations [M][K]
using LayoutB = cutlass::layout::ColumnMajor;  // weights [N][K]: K x N column-major
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignA = 16, kAlignB = 16, kAlignD = 8;
using TileShape = Shape<_128, _128, _128>;
using ClusterShape = Shape<_1, _1, _1>;
// Activation scales per row (M-major within a group), weight scales per 128 x 128 block, K-major.
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::MN, cute::GMMA::Major::K>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, kAlignD, ElementD, LayoutD*, kAlignD,
    cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
    cutlass::epilogue::fusion::LinearCombination<ElementD, float, void, float>>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, cute::tuple<LayoutA*, LayoutSFA*>, kAlignA, ElementB,
    cute::tuple<LayoutB*, LayoutSFB*>, kAlignB, float, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename CollectiveEpilogue::SharedStorage))>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
using StrideA = typename GemmKernel::InternalStrideA;
using StrideB = typename GemmKernel::InternalStrideB;
using StrideD = typename GemmKernel::InternalStrideD;
using UnderlyingShape = typename ProblemShape::UnderlyingProblemShape;

// The per-group argument arrays, carved out of one device buffer.
struct ArgArrays {
  UnderlyingShape* shapes;
  const ElementA** a;
  const ElementB** b;
  const float** sfa;
  const float** sfb;
  ElementD** d;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideD* stride_d;
  LayoutSFA* layout_sfa;
  LayoutSFB* layout_sfb;
};

constexpr size_t align_up(size_t v) {
  return (v + 255) / 256 * 256;
}

template <typename T>
T* carve(char*& p, int32_t count) {
  T* out = reinterpret_cast<T*>(p);
  p += align_up(sizeof(T) * static_cast<size_t>(count));
  return out;
}

ArgArrays carve_args(void* buffer, int32_t groups) {
  char* p = static_cast<char*>(buffer);
  ArgArrays a;
  a.shapes = carve<UnderlyingShape>(p, groups);
  a.a = carve<const ElementA*>(p, groups);
  a.b = carve<const ElementB*>(p, groups);
  a.sfa = carve<const float*>(p, groups);
  a.sfb = carve<const float*>(p, groups);
  a.d = carve<ElementD*>(p, groups);
  a.stride_a = carve<StrideA>(p, groups);
  a.stride_b = carve<StrideB>(p, groups);
  a.stride_d = carve<StrideD>(p, groups);
  a.layout_sfa = carve<LayoutSFA>(p, groups);
  a.layout_sfb = carve<LayoutSFB>(p, groups);
  return a;
}

size_t arg_bytes(int32_t groups) {
  return align_up(sizeof(UnderlyingShape) * groups) + 5 * align_up(sizeof(void*) * groups) +
         align_up(sizeof(StrideA) * groups) + align_up(sizeof(StrideB) * groups) + align_up(sizeof(StrideD) * groups) +
         align_up(sizeof(LayoutSFA) * groups) + align_up(sizeof(LayoutSFB) * groups);
}

// One thread per group: the group's shape, operand pointers, strides and scale layouts from
// the device offsets (nothing waits for the host).
__global__ void grouped_setup_kernel(ArgArrays arr, GroupedFp8Args args) {
  const int g = blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= args.groups) return;
  const int begin = args.offsets[g];
  const int m = args.offsets[g + 1] - begin;
  const int n = args.n, k = args.k;
  const int64_t kb = k / kFp8Block;
  arr.shapes[g] = UnderlyingShape(m, n, k);
  arr.a[g] = reinterpret_cast<const ElementA*>(args.a + static_cast<int64_t>(begin) * k);
  arr.b[g] = reinterpret_cast<const ElementB*>(args.w + static_cast<int64_t>(g) * n * k);
  arr.sfa[g] = args.a_scales + static_cast<int64_t>(begin) * kb;
  arr.sfb[g] = args.w_scales + static_cast<int64_t>(g) * (n / kFp8Block) * kb;
  arr.d[g] = reinterpret_cast<ElementD*>(args.out + static_cast<int64_t>(begin) * n);
  arr.stride_a[g] = cutlass::make_cute_packed_stride(StrideA{}, make_shape(m, k, 1));
  arr.stride_b[g] = cutlass::make_cute_packed_stride(StrideB{}, make_shape(n, k, 1));
  arr.stride_d[g] = cutlass::make_cute_packed_stride(StrideD{}, make_shape(m, n, 1));
  arr.layout_sfa[g] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(m, n, k, 1));
  arr.layout_sfb[g] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(m, n, k, 1));
}

typename Gemm::Arguments make_arguments(const ArgArrays& arr, const GroupedFp8Args& args) {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = args.device;
  hw.sm_count = args.sm_count;
  typename Gemm::Arguments g{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {args.groups, arr.shapes, nullptr},
      {arr.a, arr.stride_a, arr.b, arr.stride_b, arr.sfa, arr.layout_sfa, arr.sfb, arr.layout_sfb},
      {{}, nullptr, nullptr, arr.d, arr.stride_d},
      hw};
  auto& fusion = g.epilogue.thread;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  fusion.alpha_ptr = nullptr;
  fusion.beta_ptr = nullptr;
  fusion.alpha_ptr_array = nullptr;
  fusion.beta_ptr_array = nullptr;
  fusion.dAlpha = {_0{}, _0{}, 0};
  fusion.dBeta = {_0{}, _0{}, 0};
  return g;
}
#endif  // PD_HAVE_CUTLASS

}  // namespace

bool grouped_fp8_gemm_built() {
  return PD_HAVE_CUTLASS != 0;
}

size_t grouped_fp8_arg_bytes(int32_t max_groups) {
#if PD_HAVE_CUTLASS
  return arg_bytes(max_groups);
#else
  (void)max_groups;
  return 0;
#endif
}

size_t grouped_fp8_workspace_bytes(int32_t max_groups, int32_t sm_count) {
#if PD_HAVE_CUTLASS
  GroupedFp8Args args;
  args.groups = max_groups;
  args.sm_count = sm_count;
  args.n = kFp8Block;
  args.k = kFp8Block;
  const ArgArrays arr{};
  return Gemm::get_workspace_size(make_arguments(arr, args));
#else
  (void)max_groups;
  (void)sm_count;
  return 0;
#endif
}

cudaError_t launch_grouped_quantize(uint8_t* out, float* scales, const __nv_bfloat16* x, const int32_t* src_rows,
                                    bool silu, int32_t rows, int32_t k, const int32_t* offsets, int32_t num_groups,
                                    cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int64_t items = static_cast<int64_t>(rows) * (k / kFp8Block);
  const unsigned blocks = static_cast<unsigned>((items + kQuantWarps - 1) / kQuantWarps);
  grouped_quantize_kernel<<<blocks, kQuantWarps * 32, 0, stream>>>(out, scales, x, src_rows, silu, rows, k, offsets,
                                                                   num_groups);
  return cudaGetLastError();
}

cudaError_t launch_compact_scales(float* out, const float* in, int32_t groups, int32_t n_blocks, int32_t k_blocks,
                                  int32_t scale_ld, cudaStream_t stream) {
  const int64_t total = static_cast<int64_t>(groups) * n_blocks * k_blocks;
  if (total == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((total + 255) / 256, 1024));
  compact_scales_kernel<<<blocks, 256, 0, stream>>>(out, in, total, k_blocks, scale_ld);
  return cudaGetLastError();
}

int launch_grouped_fp8_gemm(const GroupedFp8Args& args, cudaStream_t stream) {
#if PD_HAVE_CUTLASS
  if (args.groups == 0) return 0;
  const ArgArrays arr = carve_args(args.arg_buffer, args.groups);
  grouped_setup_kernel<<<(args.groups + 127) / 128, 128, 0, stream>>>(arr, args);
  if (const cudaError_t err = cudaGetLastError(); err != cudaSuccess) return static_cast<int>(err);
  Gemm gemm;
  const typename Gemm::Arguments ga = make_arguments(arr, args);
  if (gemm.can_implement(ga) != cutlass::Status::kSuccess) return -2;
  if (Gemm::get_workspace_size(ga) > args.workspace_bytes) return -3;
  if (gemm.initialize(ga, args.workspace, stream) != cutlass::Status::kSuccess) return -3;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return -4;
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? 0 : static_cast<int>(err);
#else
  (void)args;
  (void)stream;
  return -1;
#endif
}

}  // namespace pd::kernels::cuda::detail
