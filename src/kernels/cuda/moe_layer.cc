#include "kernels/cuda/moe_layer.h"

#include <algorithm>

#include "kernels/cuda/device_memory.h"
#include "kernels/cuda/kernels.h"

namespace pd::kernels::cuda {
namespace {

template <typename T>
Status device_alloc(T** ptr, size_t count, std::vector<void*>* owned, const char* what) {
  void* p = nullptr;
  PD_RETURN_IF_ERROR(device_malloc(&p, std::max<size_t>(1, count) * sizeof(T), what));
  owned->push_back(p);
  *ptr = static_cast<T*>(p);
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<MoeLayer>> MoeLayer::create(int32_t max_tokens, int32_t top_k, int32_t num_experts,
                                                   int32_t hidden, int32_t inter) {
  if (max_tokens <= 0 || top_k <= 0 || top_k > kMoeMaxTopK || num_experts <= 0 || num_experts > kMoeMaxExperts ||
      top_k > num_experts || hidden <= 0 || inter <= 0 || hidden % 8 != 0 || inter % 8 != 0) {
    return invalid_argument("moe layer: tokens {} top_k {} experts {} hidden {} inter {}", max_tokens, top_k,
                            num_experts, hidden, inter);
  }
  std::unique_ptr<MoeLayer> l(new MoeLayer());
  l->max_tokens_ = max_tokens;
  l->top_k_ = top_k;
  l->num_experts_ = num_experts;
  l->hidden_ = hidden;
  l->inter_ = inter;
  const size_t rows = static_cast<size_t>(max_tokens) * top_k;
  auto* owned = &l->allocations_;
  PD_RETURN_IF_ERROR(device_alloc(&l->topk_ids_, rows, owned, "cudaMalloc(moe topk ids)"));
  PD_RETURN_IF_ERROR(device_alloc(&l->topk_weights_, rows, owned, "cudaMalloc(moe topk weights)"));
  MoeRouting& r = l->routing_;
  PD_RETURN_IF_ERROR(device_alloc(&r.expert_offsets, num_experts + 1, owned, "cudaMalloc(moe offsets)"));
  PD_RETURN_IF_ERROR(device_alloc(&r.padded_offsets, num_experts + 1, owned, "cudaMalloc(moe offsets)"));
  PD_RETURN_IF_ERROR(device_alloc(&r.active_experts, num_experts, owned, "cudaMalloc(moe active)"));
  PD_RETURN_IF_ERROR(device_alloc(&r.num_active, 1, owned, "cudaMalloc(moe active)"));
  PD_RETURN_IF_ERROR(device_alloc(&r.sorted_token, rows, owned, "cudaMalloc(moe sort)"));
  PD_RETURN_IF_ERROR(device_alloc(&r.slot_of_choice, rows, owned, "cudaMalloc(moe sort)"));
  PD_RETURN_IF_ERROR(device_alloc(&l->gathered_, rows * hidden, owned, "cudaMalloc(moe gathered rows)"));
  PD_RETURN_IF_ERROR(device_alloc(&l->gate_up_, rows * 2 * inter, owned, "cudaMalloc(moe gate_up)"));
  PD_RETURN_IF_ERROR(device_alloc(&l->act_, rows * inter, owned, "cudaMalloc(moe act)"));
  PD_RETURN_IF_ERROR(device_alloc(&l->down_out_, rows * hidden, owned, "cudaMalloc(moe down)"));
  const int32_t kmax = std::max(hidden, inter);
  PD_RETURN_IF_ERROR(device_alloc(&l->q_, rows * kmax, owned, "cudaMalloc(moe fp8 rows)"));
  // Per expert at most round_up(count, 4) scale columns: rows + 3 * experts in all.
  const size_t scale_cols = rows + 3ull * num_experts;
  PD_RETURN_IF_ERROR(device_alloc(&l->q_scales_, scale_cols * ((kmax + kFp8Block - 1) / kFp8Block), owned,
                                  "cudaMalloc(moe fp8 scales)"));
  PD_RETURN_IF_ERROR(
      cuda_status(cudaMallocHost(reinterpret_cast<void**>(&l->host_offsets_), 2 * (num_experts + 1) * sizeof(int32_t)),
                  "cudaMallocHost(moe offsets)"));
  // kGrouped (FP8 experts, prefill): made here, before the runner sizes its KV pool, on the
  // per-expert path's quantization scratch (q_ holds rows x max(hidden, inter) codes, q_scales_
  // at least rows x that / 128 scales).
  if (GroupedFp8Gemm::available() && hidden % kFp8Block == 0 && inter % kFp8Block == 0) {
    PD_ASSIGN_OR_RETURN(l->grouped_, GroupedFp8Gemm::create(num_experts, static_cast<int32_t>(rows),
                                                            std::max(2 * inter, hidden), kmax, l->q_, l->q_scales_));
  }
  return l;
}

MoeLayer::~MoeLayer() {
  for (void* p : allocations_) device_free(p);
  if (host_offsets_ != nullptr) cudaFreeHost(host_offsets_);
}

Status MoeLayer::expert_gemm(__nv_bfloat16* out, const __nv_bfloat16* in, const int32_t* in_rows, const void* w,
                             const float* w_scale, int32_t n, int32_t k, int32_t rows, int32_t rows_hint,
                             const MoeWeights& mw, MoePath path, cudaStream_t stream, Gemm* gemm, Fp8Gemm* fp8_gemm) {
  const int32_t scale_ld = mw.fp8 ? fp8_weight_scale_ld(k) : 0;
  const int64_t scale_stride = static_cast<int64_t>((n + kFp8Block - 1) / kFp8Block) * scale_ld;
  if (path == MoePath::kStream) {
    StreamGemmArgs a;
    a.out = out;
    a.ldo = n;
    a.a = in;
    a.lda = k;
    a.a_rows = in_rows;
    a.w = w;
    a.w_scale = mw.fp8 ? w_scale : nullptr;
    a.w_scale_ld = scale_ld;
    a.w_group_stride = static_cast<int64_t>(n) * k;
    a.scale_group_stride = scale_stride;
    a.group_offsets = routing_.expert_offsets;
    a.active_groups = routing_.active_experts;
    a.num_active = routing_.num_active;
    a.max_groups = std::min(num_experts_, rows);
    a.n = n;
    a.k = k;
    // rows_hint: the pass's tokens (an expert has at most that many rows).
    if (mw.fp8 && rows_hint >= stream_kernel_.min_tokens) a.tc_kernel = stream_kernel_.kernel;
    return stream_gemm(a, rows_hint, stream);
  }
  // kPerExpert: the rows of `in` are already in expert order; host_offsets_ holds the offsets.
  const int32_t* off = host_offsets_;
  const int32_t* padded = host_offsets_ + num_experts_ + 1;
  if (mw.fp8) {
    PD_RETURN_IF_ERROR(quantize_fp8_grouped(q_, q_scales_, in, rows, k, routing_, num_experts_, stream));
  }
  for (int32_t e = 0; e < num_experts_; ++e) {
    const int32_t count = off[e + 1] - off[e];
    if (count == 0) continue;
    __nv_bfloat16* o = out + static_cast<int64_t>(off[e]) * n;
    if (mw.fp8) {
      Fp8Weight we;
      we.data = static_cast<const uint8_t*>(w) + static_cast<int64_t>(e) * n * k;
      we.scale = w_scale + e * scale_stride;
      we.n = n;
      we.k = k;
      we.scale_ld = scale_ld;
      // The first fp8_cublas_rows(count) rows through cuBLASLt on the grouped quantization,
      // the rest (< 16, or all when cuBLASLt has no algorithm) through the streaming kernel.
      int32_t main_rows = fp8_cublas_rows(count);
      if (main_rows > 0) {
        const Status st = fp8_gemm->run_quantized(o, q_ + static_cast<int64_t>(off[e]) * k,
                                                  q_scales_ + static_cast<int64_t>(padded[e]) * (k / kFp8Block),
                                                  main_rows, we, stream);
        if (st.code() == ErrorCode::kUnimplemented) {
          main_rows = 0;
        } else {
          PD_RETURN_IF_ERROR(st);
        }
      }
      if (main_rows < count) {
        StreamGemmArgs a;
        a.out = o + static_cast<int64_t>(main_rows) * n;
        a.ldo = n;
        a.a = in + static_cast<int64_t>(off[e] + main_rows) * k;
        a.lda = k;
        a.w = we.data;
        a.w_scale = we.scale;
        a.w_scale_ld = we.scale_ld;
        a.m = count - main_rows;
        a.n = n;
        a.k = k;
        PD_RETURN_IF_ERROR(stream_gemm(a, a.m, stream));
      }
    } else {
      const auto* we = static_cast<const __nv_bfloat16*>(w) + static_cast<int64_t>(e) * n * k;
      PD_RETURN_IF_ERROR(
          gemm->run(o, GemmOut::kBFloat16, in + static_cast<int64_t>(off[e]) * k, we, count, n, k, stream));
    }
  }
  return Status::Ok();
}

// kGrouped: gate_up = quant(x rows) . W_gate_up^T, down = quant(silu(gate) * up) . W_down^T, one
// grouped GEMM each over all experts (empty experts included).
Status MoeLayer::grouped_forward(const __nv_bfloat16* x, const MoeWeights& w, int32_t rows, cudaStream_t stream) {
  const int32_t* off = routing_.expert_offsets;
  Fp8Weight gu;
  gu.data = static_cast<const uint8_t*>(w.gate_up);
  gu.scale = w.gate_up_scale;
  gu.n = 2 * inter_;
  gu.k = hidden_;
  gu.scale_ld = fp8_weight_scale_ld(hidden_);
  PD_RETURN_IF_ERROR(grouped_->quantize(x, routing_.sorted_token, false, rows, hidden_, off, num_experts_, stream));
  PD_RETURN_IF_ERROR(grouped_->run(gate_up_, gu, off, num_experts_, stream));
  Fp8Weight dw;
  dw.data = static_cast<const uint8_t*>(w.down);
  dw.scale = w.down_scale;
  dw.n = hidden_;
  dw.k = inter_;
  dw.scale_ld = fp8_weight_scale_ld(inter_);
  PD_RETURN_IF_ERROR(grouped_->quantize(gate_up_, nullptr, true, rows, inter_, off, num_experts_, stream));
  return grouped_->run(down_out_, dw, off, num_experts_, stream);
}

// silu_mul's grid has a row per y index (at most 65,535): longer runs go in pieces.
Status MoeLayer::silu_rows(int32_t rows, cudaStream_t stream) {
  constexpr int32_t kMaxRows = 65535;
  for (int32_t r = 0; r < rows; r += kMaxRows) {
    PD_RETURN_IF_ERROR(silu_mul(act_ + static_cast<int64_t>(r) * inter_,
                                gate_up_ + static_cast<int64_t>(r) * 2 * inter_, std::min(kMaxRows, rows - r), inter_,
                                stream));
  }
  return Status::Ok();
}

Status MoeLayer::forward(__nv_bfloat16* out, const __nv_bfloat16* x, const float* router_logits, int32_t num_tokens,
                         const MoeWeights& w, bool renormalize, MoePath path, cudaStream_t stream, bool accumulate,
                         Gemm* gemm, Fp8Gemm* fp8_gemm) {
  if (num_tokens == 0) return Status::Ok();
  if (num_tokens < 0 || num_tokens > max_tokens_) {
    return invalid_argument("moe layer: {} tokens (buffers for {})", num_tokens, max_tokens_);
  }
  if (w.num_experts != num_experts_ || w.hidden != hidden_ || w.inter != inter_ || w.gate_up == nullptr ||
      w.down == nullptr || (w.fp8 && (w.gate_up_scale == nullptr || w.down_scale == nullptr))) {
    return invalid_argument("moe layer: weights for {} experts {} x {} do not match the layer ({} experts {} x {})",
                            w.num_experts, w.hidden, w.inter, num_experts_, hidden_, inter_);
  }
  if (w.fp8 && (hidden_ % kFp8Block != 0 || inter_ % kFp8Block != 0)) {
    return unimplemented("moe layer: FP8 experts need hidden {} and inter {} multiples of {}", hidden_, inter_,
                         kFp8Block);
  }
  if (path == MoePath::kGrouped && (!w.fp8 || grouped_ == nullptr)) path = MoePath::kPerExpert;
  if (path == MoePath::kPerExpert && (w.fp8 ? fp8_gemm == nullptr : gemm == nullptr)) {
    return invalid_argument("moe layer: the per-expert path needs a {} GEMM", w.fp8 ? "FP8" : "bf16");
  }
  if (static_cast<const void*>(out) == static_cast<const void*>(x)) {
    return invalid_argument("moe layer: out must not alias x");
  }
  const int32_t rows = num_tokens * top_k_;
  PD_RETURN_IF_ERROR(
      moe_route(router_logits, num_tokens, num_experts_, top_k_, renormalize, topk_ids_, topk_weights_, stream));
  PD_RETURN_IF_ERROR(moe_align(topk_ids_, num_tokens, top_k_, num_experts_, routing_, stream));
  const int32_t gu_n = 2 * inter_;
  if (path == MoePath::kGrouped) {
    PD_RETURN_IF_ERROR(grouped_forward(x, w, rows, stream));
  } else if (path == MoePath::kStream) {
    // A token picks an expert at most once: an expert has at most num_tokens rows.
    PD_RETURN_IF_ERROR(expert_gemm(gate_up_, x, routing_.sorted_token, w.gate_up, w.gate_up_scale, gu_n, hidden_, rows,
                                   num_tokens, w, path, stream, gemm, fp8_gemm));
    PD_RETURN_IF_ERROR(silu_rows(rows, stream));
    PD_RETURN_IF_ERROR(expert_gemm(down_out_, act_, nullptr, w.down, w.down_scale, hidden_, inter_, rows, num_tokens, w,
                                   path, stream, gemm, fp8_gemm));
  } else {
    PD_RETURN_IF_ERROR(
        cuda_status(cudaMemcpyAsync(host_offsets_, routing_.expert_offsets, (num_experts_ + 1) * sizeof(int32_t),
                                    cudaMemcpyDeviceToHost, stream),
                    "moe offsets to host"));
    PD_RETURN_IF_ERROR(
        cuda_status(cudaMemcpyAsync(host_offsets_ + num_experts_ + 1, routing_.padded_offsets,
                                    (num_experts_ + 1) * sizeof(int32_t), cudaMemcpyDeviceToHost, stream),
                    "moe offsets to host"));
    PD_RETURN_IF_ERROR(embedding_lookup(gathered_, x, routing_.sorted_token, rows, num_tokens, hidden_, stream));
    PD_RETURN_IF_ERROR(cuda_status(cudaStreamSynchronize(stream), "moe offsets sync"));
    PD_RETURN_IF_ERROR(expert_gemm(gate_up_, gathered_, nullptr, w.gate_up, w.gate_up_scale, gu_n, hidden_, rows,
                                   num_tokens, w, path, stream, gemm, fp8_gemm));
    PD_RETURN_IF_ERROR(silu_rows(rows, stream));
    PD_RETURN_IF_ERROR(expert_gemm(down_out_, act_, nullptr, w.down, w.down_scale, hidden_, inter_, rows, num_tokens, w,
                                   path, stream, gemm, fp8_gemm));
  }
  return moe_combine(out, down_out_, routing_.slot_of_choice, topk_weights_, num_tokens, top_k_, hidden_, accumulate,
                     stream);
}

}  // namespace pd::kernels::cuda
