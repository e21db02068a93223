// The expert part of a MoE layer (Qwen3-MoE: softmax router, top-k, optional
// renormalization, SwiGLU experts, no shared expert), from router logits to the weighted sum
// of the chosen experts' outputs:
//   route (moe_route) -> sort (token, choice) pairs by expert (moe_align) -> per expert:
//   gate_up = x_rows . W_gate_up^T, act = silu(gate) * up, y = act . W_down^T -> out[t] (+)=
//   sum_j weight[t][j] * y[t, j] (moe_combine).
// Expert weights, bf16 or FP8 block-scaled (fp8_args.h), all experts back to back:
//   gate_up [E][2 * inter][hidden] (gate rows, then up rows), down [E][hidden][inter].
// Two ways to run the expert GEMMs:
// - kStream: the weight-streaming kernel over the active experts (stream_gemm, grouped);
//   each routed expert's weights are read once per 16 of its rows, nothing waits for the
//   host, so it can be captured in a CUDA graph. For decode. FP8 experts take a warp-item
//   kernel (moe_decode.cu) from 2 tokens on and the tiled one at 1 (MoeStreamKernel); bf16
//   experts the CUDA-core kernel (8 rows per pass).
// - kPerExpert: copies the expert offsets to the host (one stream synchronization), then one
//   GEMM per active expert over its contiguous rows: cuBLASLt's block-scaled FP8 GEMM on
//   activations quantized once per GEMM for all experts (quantize_fp8_grouped) for the first
//   fp8_cublas_rows(count) rows and the streaming kernel for the rest, or the bf16 Gemm.
//   For prefill (not capturable).
// - kGrouped: FP8 experts through GroupedFp8Gemm (grouped_fp8_gemm.h): the rows quantized once
//   per projection (gathered from x, then silu(gate) * up on the way into down), one grouped
//   GEMM over all experts per projection, no host synchronization. The prefill default where
//   GroupedFp8Gemm::available(); bf16 experts or a build without it run kPerExpert instead.
// Not thread-safe; buffers are owned here, sized at create().
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "common/status.h"
#include "kernels/cuda/fp8_args.h"
#include "kernels/cuda/fp8_gemm.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/grouped_fp8_gemm.h"

namespace pd::kernels::cuda {

struct MoeWeights {
  int32_t num_experts = 0;
  int32_t hidden = 0;
  int32_t inter = 0;  // moe_intermediate_size
  bool fp8 = false;
  const void* gate_up = nullptr;  // bf16 or e4m3
  const void* down = nullptr;
  const float* gate_up_scale = nullptr;  // fp8: [E][ceil(2 inter / 128)][fp8_weight_scale_ld(hidden)]
  const float* down_scale = nullptr;     // fp8: [E][ceil(hidden / 128)][fp8_weight_scale_ld(inter)]
};

enum class MoePath : uint8_t { kStream, kPerExpert, kGrouped };

// Kernels of the kStream path's FP8 expert GEMMs (bf16 experts take the CUDA-core kernel):
// `kernel` for passes of at least min_tokens tokens, the tiled kernel below.
struct MoeStreamKernel {
  Fp8TcKernel kernel = Fp8TcKernel::kWarpItems;
  int32_t min_tokens = 2;
};

class MoeLayer {
 public:
  static Result<std::unique_ptr<MoeLayer>> create(int32_t max_tokens, int32_t top_k, int32_t num_experts,
                                                  int32_t hidden, int32_t inter);
  ~MoeLayer();
  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;

  // out [num_tokens][hidden] (+)= the MoE output for x [num_tokens][hidden] given the router
  // logits [num_tokens][num_experts] (fp32). kPerExpert needs gemm (bf16 weights) or
  // fp8_gemm (FP8 weights), and so does kGrouped where it falls back to kPerExpert; out must
  // not alias x.
  Status forward(__nv_bfloat16* out, const __nv_bfloat16* x, const float* router_logits, int32_t num_tokens,
                 const MoeWeights& w, bool renormalize, MoePath path, cudaStream_t stream, bool accumulate,
                 Gemm* gemm = nullptr, Fp8Gemm* fp8_gemm = nullptr);

  // Kernels of the kStream path (default: MoeStreamKernel{}); read at each forward, so a
  // captured graph keeps the choice it was captured with.
  void set_stream_kernel(const MoeStreamKernel& k) { stream_kernel_ = k; }
  const MoeStreamKernel& stream_kernel() const { return stream_kernel_; }

  // After forward (the routing of its tokens), on the stream: the experts chosen per token
  // and the number of distinct experts (device buffers).
  const int32_t* topk_ids() const { return topk_ids_; }
  const int32_t* num_active() const { return routing_.num_active; }
  // The routing of the last forward (device buffers; fp8_args.h).
  const MoeRouting& routing() const { return routing_; }
  int32_t top_k() const { return top_k_; }

 private:
  MoeLayer() = default;
  Status silu_rows(int32_t rows, cudaStream_t stream);
  Status grouped_forward(const __nv_bfloat16* x, const MoeWeights& w, int32_t rows, cudaStream_t stream);
  Status expert_gemm(__nv_bfloat16* out, const __nv_bfloat16* in, const int32_t* in_rows, const void* w,
                     const float* w_scale, int32_t n, int32_t k, int32_t rows, int32_t rows_hint, const MoeWeights& mw,
                     MoePath path, cudaStream_t stream, Gemm* gemm, Fp8Gemm* fp8_gemm);

  int32_t max_tokens_ = 0, top_k_ = 0, num_experts_ = 0, hidden_ = 0, inter_ = 0;
  MoeStreamKernel stream_kernel_;
  int32_t* topk_ids_ = nullptr;
  float* topk_weights_ = nullptr;
  MoeRouting routing_;
  __nv_bfloat16* gathered_ = nullptr;  // [T * k][hidden]: rows in expert order (kPerExpert)
  __nv_bfloat16* gate_up_ = nullptr;   // [T * k][2 inter]
  __nv_bfloat16* act_ = nullptr;       // [T * k][inter]
  __nv_bfloat16* down_out_ = nullptr;  // [T * k][hidden]
  uint8_t* q_ = nullptr;               // [T * k][max(hidden, inter)] e4m3 (kPerExpert, FP8)
  float* q_scales_ = nullptr;
  int32_t* host_offsets_ = nullptr;          // pinned [2 * (E + 1)]: expert_offsets, padded_offsets
  std::unique_ptr<GroupedFp8Gemm> grouped_;  // kGrouped (built with CUTLASS, hidden and inter multiples of 128)
  std::vector<void*> allocations_;
};

}  // namespace pd::kernels::cuda
