// CudaModelRunner::upload_weights: the rank's slices of every weight
// (model::rank_linear_parts), stacked into the runner's fused tensors, from the
// host tensors or generated on the GPU. At tensor_parallel_size 1 every part is
// a whole tensor and the uploads are the ones of a single-GPU runner.
#include <algorithm>
#include <cmath>

#include "engine/runner_cuda/cuda_model_runner.h"
#include "kernels/cpu/cpu_kernels.h"
#include "model/tp_weight_slice.h"

namespace pd::engine {
namespace {

namespace kc = pd::kernels::cuda;
using bf16 = __nv_bfloat16;
using model::FusedLinear;
using model::LinearPart;

constexpr float kDummyStdDev = 0.02f;

bool all_whole(const std::vector<LinearPart>& parts) {
  return std::all_of(parts.begin(), parts.end(), [](const LinearPart& p) { return p.whole(); });
}

int64_t stacked_rows(const std::vector<LinearPart>& parts) {
  int64_t rows = 0;
  for (const LinearPart& p : parts) rows += p.slice_rows();
  return rows;
}

// A column-parallel bias as a [rows][1] tensor (its parts keep their rows).
std::vector<LinearPart> as_bias(std::vector<LinearPart> parts) {
  for (LinearPart& p : parts) {
    p.cols = 1;
    p.col_begin = 0;
    p.col_end = 1;
  }
  return parts;
}

}  // namespace

Status CudaModelRunner::upload_weights(const model::ModelWeights* host_weights) {
  const auto& c = config_;
  const model::TpSplit& split = split_;
  const int32_t rank = tp_.rank;
  const int64_t h = c.hidden_size, d = c.head_dim, hq = heads_, hkv = kv_heads_, inter = inter_, vocab = c.vocab_size;
  const int64_t qkv_rows = (hq + 2 * hkv) * d;
  uint64_t tensor_index = 0;

  auto device_tensor = [&](int64_t count) -> Result<bf16*> {
    auto* p = static_cast<bf16*>(alloc(static_cast<size_t>(count) * sizeof(bf16)));
    if (p == nullptr) return resource_exhausted("cuda runner: out of device memory for weights ({} elements)", count);
    weight_bytes_ += static_cast<size_t>(count) * sizeof(bf16);
    return p;
  };
  std::vector<bf16> staging;
  auto stage = [&](const std::vector<float>& values) {
    for (float v : values) staging.push_back(__float2bfloat16(v));
  };
  auto flush = [&](bf16* dst) {
    return kc::cuda_status(cudaMemcpy(dst, staging.data(), staging.size() * sizeof(bf16), cudaMemcpyHostToDevice),
                           "weight upload");
  };
  // Uploads the concatenation of the named (replicated) host tensors, each checked against its element count.
  auto upload = [&](bf16* dst, std::initializer_list<std::pair<std::string, int64_t>> parts) -> Status {
    staging.clear();
    for (const auto& [name, count] : parts) {
      const model::Tensor* t = host_weights->find(name);
      if (t == nullptr) return not_found("cuda runner: weight {} missing", name);
      if (static_cast<int64_t>(t->data.size()) != count) {
        return invalid_argument("cuda runner: weight {} has {} elements, expected {}", name, t->data.size(), count);
      }
      stage(t->data);
    }
    return flush(dst);
  };
  // Uploads the rank's rectangles of the parts' "<base>.weight" (or ".bias") tensors, stacked by rows.
  auto upload_parts = [&](bf16* dst, const std::vector<LinearPart>& parts, const char* suffix) -> Status {
    staging.clear();
    for (const LinearPart& p : parts) {
      const std::string name = p.base + suffix;
      const model::Tensor* t = host_weights->find(name);
      if (t == nullptr) return not_found("cuda runner: weight {} missing", name);
      if (static_cast<int64_t>(t->data.size()) != p.rows * p.cols) {
        return invalid_argument("cuda runner: weight {} has {} elements, expected {}", name, t->data.size(),
                                p.rows * p.cols);
      }
      stage(p.whole() ? t->data : model::copy_part(t->data.data(), p));
    }
    return flush(dst);
  };
  const float uniform_scale = kDummyStdDev * std::sqrt(3.0f);  // uniform with the same std dev
  auto dummy = [&](bf16* dst, int64_t count) {
    return kc::fill_uniform(dst, static_cast<size_t>(count), options_.dummy_seed * 1000003ull + tensor_index++,
                            uniform_scale, stream_);
  };
  // Generated weights are generated per fused tensor (one seed each, as a single GPU
  // generates them), so a rank generates the whole fused tensor and keeps its rectangles.
  void* scratch = nullptr;  // freed on every return (cudaFree waits for the copies reading it)
  size_t scratch_bytes = 0;
  struct ScratchFree {
    void** p;
    ~ScratchFree() {
      if (*p != nullptr) cudaFree(*p);
    }
  } scratch_free{&scratch};
  auto keep_parts = [&](void* dst, const void* full, const std::vector<LinearPart>& parts, size_t elem) -> Status {
    auto* out = static_cast<uint8_t*>(dst);
    for (const LinearPart& p : parts) {
      const auto* src = static_cast<const uint8_t*>(full) +
                        ((p.fused_row_offset + p.row_begin) * p.cols + p.col_begin) * static_cast<int64_t>(elem);
      const size_t width = static_cast<size_t>(p.slice_cols()) * elem;
      PD_RETURN_IF_ERROR(
          kc::cuda_status(cudaMemcpy2DAsync(out, width, src, static_cast<size_t>(p.cols) * elem, width,
                                            static_cast<size_t>(p.slice_rows()), cudaMemcpyDeviceToDevice, stream_),
                          "weight slice copy"));
      out += width * static_cast<size_t>(p.slice_rows());
    }
    return Status::Ok();
  };
  auto full_scratch = [&](size_t bytes) -> Result<void*> {
    if (bytes > scratch_bytes) {
      PD_RETURN_IF_ERROR(kc::cuda_status(cudaStreamSynchronize(stream_), "weight scratch sync"));
      if (scratch != nullptr) cudaFree(scratch);
      scratch = nullptr;
      scratch_bytes = 0;
      PD_RETURN_IF_ERROR(kc::cuda_status(cudaMalloc(&scratch, bytes), "weight scratch"));
      scratch_bytes = bytes;
    }
    return scratch;
  };
  auto dummy_parts = [&](bf16* dst, const std::vector<LinearPart>& parts) -> Status {
    const int64_t full = parts.front().fused_rows * parts.front().cols;
    if (all_whole(parts)) return dummy(dst, full);
    PD_ASSIGN_OR_RETURN(void* tmp, full_scratch(static_cast<size_t>(full) * sizeof(bf16)));
    PD_RETURN_IF_ERROR(dummy(static_cast<bf16*>(tmp), full));
    return keep_parts(dst, tmp, parts, sizeof(bf16));
  };
  auto ones = [&](bf16* dst, int64_t count) {
    std::vector<bf16> v(static_cast<size_t>(count), __float2bfloat16(1.0f));
    return kc::cuda_status(cudaMemcpy(dst, v.data(), v.size() * sizeof(bf16), cudaMemcpyHostToDevice), "ones");
  };
  const bool real = host_weights != nullptr;
  const bool fp8 = c.quant.fp8();

  // Block-FP8 linear: the parts' e4m3 codes stacked by rows ([rows][k] each, rows a
  // multiple of 128 except the last part's, so the 128 x 128 scale blocks stay aligned), and
  // their weight_scale_inv rows padded to fp8_weight_scale_ld(k). Dummy: uniform codes, one
  // scale for the whole tensor (values uniform with the bf16 dummies' std dev).
  // codes_at / scales_at: where to put it (an expert inside its layer's packed tensors), else allocated here.
  auto fp8_linear = [&](kc::Fp8Weight* out, const std::vector<LinearPart>& parts, uint8_t* codes_at = nullptr,
                        float* scales_at = nullptr) -> Status {
    const int64_t k = parts.front().slice_cols();
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      if (parts[i].slice_rows() % kc::kFp8Block != 0) {
        return unimplemented(
            "cuda runner: FP8 weight {} has {} rows, not a multiple of {} (its scale blocks would "
            "straddle the fused tensor)",
            parts[i].base, parts[i].slice_rows(), kc::kFp8Block);
      }
    }
    const int64_t rows = stacked_rows(parts);
    const int32_t ld = kc::fp8_weight_scale_ld(static_cast<int32_t>(k));
    const int64_t scale_rows = (rows + kc::kFp8Block - 1) / kc::kFp8Block;
    uint8_t* codes = codes_at;
    float* scales = scales_at;
    if (codes == nullptr) {
      codes = static_cast<uint8_t*>(alloc(static_cast<size_t>(rows * k)));
      scales = static_cast<float*>(alloc(static_cast<size_t>(scale_rows * ld) * sizeof(float)));
      if (codes == nullptr || scales == nullptr) {
        return resource_exhausted("cuda runner: out of device memory (FP8 weights)");
      }
      weight_bytes_ += static_cast<size_t>(rows * k) + static_cast<size_t>(scale_rows * ld) * sizeof(float);
    }
    out->data = codes;
    out->scale = scales;
    out->n = static_cast<int32_t>(rows);
    out->k = static_cast<int32_t>(k);
    out->scale_ld = ld;
    if (!real) {
      const int64_t full = parts.front().fused_rows * parts.front().cols;
      const uint64_t seed = options_.dummy_seed * 1000003ull + tensor_index++;
      if (all_whole(parts)) {
        PD_RETURN_IF_ERROR(kc::fill_uniform_fp8(codes, static_cast<size_t>(full), seed, 1.0f, stream_));
      } else {
        PD_ASSIGN_OR_RETURN(void* tmp, full_scratch(static_cast<size_t>(full)));
        PD_RETURN_IF_ERROR(
            kc::fill_uniform_fp8(static_cast<uint8_t*>(tmp), static_cast<size_t>(full), seed, 1.0f, stream_));
        PD_RETURN_IF_ERROR(keep_parts(codes, tmp, parts, 1));
      }
      const std::vector<float> v(static_cast<size_t>(scale_rows * ld), uniform_scale);
      return kc::cuda_status(cudaMemcpy(scales, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice),
                             "fp8 scale upload");
    }
    std::vector<uint8_t> code_staging;
    std::vector<float> scale_staging;
    for (const LinearPart& p : parts) {
      const model::Tensor* t = host_weights->find(p.base + ".weight");
      const model::Tensor* si = host_weights->find(p.base + ".weight_scale_inv");
      if (t == nullptr || si == nullptr) return not_found("cuda runner: FP8 weight {} or its scale missing", p.base);
      if (t->dtype != model::WeightDtype::kF8E4M3 || static_cast<int64_t>(t->fp8.size()) != p.rows * p.cols) {
        return invalid_argument("cuda runner: weight {} is not {} x {} e4m3 codes", p.base, p.rows, p.cols);
      }
      const int64_t kb = (p.cols + kc::kFp8Block - 1) / kc::kFp8Block,
                    rb = (p.rows + kc::kFp8Block - 1) / kc::kFp8Block;
      if (static_cast<int64_t>(si->data.size()) != rb * kb) {
        return invalid_argument("cuda runner: {}.weight_scale_inv has {} entries, expected {}", p.base, si->data.size(),
                                rb * kb);
      }
      std::vector<float> padded;
      if (p.whole()) {
        code_staging.insert(code_staging.end(), t->fp8.begin(), t->fp8.end());
        padded = kc::pad_fp8_weight_scales(si->data, static_cast<int32_t>(p.rows), static_cast<int32_t>(p.cols));
      } else {
        PD_ASSIGN_OR_RETURN(model::Fp8Part part, model::copy_fp8_part(t->fp8.data(), si->data.data(), p));
        code_staging.insert(code_staging.end(), part.codes.begin(), part.codes.end());
        padded = kc::pad_fp8_weight_scales(part.scale_inv, static_cast<int32_t>(p.slice_rows()),
                                           static_cast<int32_t>(p.slice_cols()));
      }
      scale_staging.insert(scale_staging.end(), padded.begin(), padded.end());
    }
    PD_RETURN_IF_ERROR(kc::cuda_status(
        cudaMemcpy(codes, code_staging.data(), code_staging.size(), cudaMemcpyHostToDevice), "fp8 weight upload"));
    return kc::cuda_status(
        cudaMemcpy(scales, scale_staging.data(), scale_staging.size() * sizeof(float), cudaMemcpyHostToDevice),
        "fp8 scale upload");
  };
  auto parts_of = [&](const std::string& prefix, FusedLinear which, bool expert = false) {
    return model::rank_linear_parts(c, split, rank, prefix, which, expert);
  };

  PD_ASSIGN_OR_RETURN(embed_, device_tensor(vocab * h));
  PD_RETURN_IF_ERROR(real ? upload(embed_, {{"model.embed_tokens.weight", vocab * h}}) : dummy(embed_, vocab * h));
  PD_ASSIGN_OR_RETURN(final_norm_, device_tensor(h));
  PD_RETURN_IF_ERROR(real ? upload(final_norm_, {{"model.norm.weight", h}}) : ones(final_norm_, h));
  if (c.tie_word_embeddings) {
    lm_head_ = embed_;
  } else if (rank != 0) {
    // Only rank 0 computes logits (the lm_head is replicated, not vocabulary-parallel): the
    // other ranks skip the tensor but not its seed, so later generated weights match.
    if (!real) ++tensor_index;
  } else {
    PD_ASSIGN_OR_RETURN(lm_head_, device_tensor(vocab * h));
    PD_RETURN_IF_ERROR(real ? upload(lm_head_, {{"lm_head.weight", vocab * h}}) : dummy(lm_head_, vocab * h));
  }
  layers_.resize(static_cast<size_t>(c.num_layers));
  const int64_t num_experts = c.moe.num_experts, moe_inter = moe_inter_;
  for (int32_t l = 0; l < c.num_layers; ++l) {
    LayerWeights& w = layers_[static_cast<size_t>(l)];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const bool sparse = c.family == model::ModelFamily::kQwen3Moe && c.is_moe_layer(l);
    const std::vector<LinearPart> qkv_parts = parts_of(p, FusedLinear::kQkv);
    const std::vector<LinearPart> o_parts = parts_of(p, FusedLinear::kOProj);
    const std::vector<LinearPart> gate_up_parts =
        sparse ? std::vector<LinearPart>{} : parts_of(p, FusedLinear::kGateUp);
    const std::vector<LinearPart> down_parts = sparse ? std::vector<LinearPart>{} : parts_of(p, FusedLinear::kDown);
    PD_ASSIGN_OR_RETURN(w.input_norm, device_tensor(h));
    PD_ASSIGN_OR_RETURN(w.post_norm, device_tensor(h));
    if (!fp8) {
      PD_ASSIGN_OR_RETURN(w.qkv, device_tensor(qkv_rows * h));
      PD_ASSIGN_OR_RETURN(w.o_proj, device_tensor(h * hq * d));
      if (!sparse) {
        PD_ASSIGN_OR_RETURN(w.gate_up, device_tensor(2 * inter * h));
        PD_ASSIGN_OR_RETURN(w.down, device_tensor(h * inter));
      }
    }
    if (c.qkv_bias) {
      PD_ASSIGN_OR_RETURN(w.qkv_bias, device_tensor(qkv_rows));
    }
    if (c.o_bias) {
      PD_ASSIGN_OR_RETURN(w.o_bias, device_tensor(h));
    }
    if (c.qk_norm) {
      PD_ASSIGN_OR_RETURN(w.q_norm, device_tensor(d));
      PD_ASSIGN_OR_RETURN(w.k_norm, device_tensor(d));
    }
    if (fp8) {
      PD_RETURN_IF_ERROR(fp8_linear(&w.qkv8, qkv_parts));
      PD_RETURN_IF_ERROR(fp8_linear(&w.o_proj8, o_parts));
      if (!sparse) {
        PD_RETURN_IF_ERROR(fp8_linear(&w.gate_up8, gate_up_parts));
        PD_RETURN_IF_ERROR(fp8_linear(&w.down8, down_parts));
      }
    }
    if (sparse) {
      PD_ASSIGN_OR_RETURN(w.router, device_tensor(num_experts * h));
      PD_RETURN_IF_ERROR(real ? upload(w.router, {{p + "mlp.gate.weight", num_experts * h}})
                              : dummy(w.router, num_experts * h));
      kc::MoeWeights& e = w.experts;
      e.num_experts = static_cast<int32_t>(num_experts);
      e.hidden = static_cast<int32_t>(h);
      e.inter = static_cast<int32_t>(moe_inter);
      e.fp8 = fp8;
      if (fp8) {
        // Experts back to back: each expert's gate|up (and down) fused like a dense MLP's.
        auto packed = [&](int64_t n, int64_t k, uint8_t** codes, float** scales, int64_t* codes_per,
                          int64_t* scales_per) -> Status {
          *codes_per = n * k;
          *scales_per = (n + kc::kFp8Block - 1) / kc::kFp8Block * kc::fp8_weight_scale_ld(static_cast<int32_t>(k));
          *codes = static_cast<uint8_t*>(alloc(static_cast<size_t>(*codes_per * num_experts)));
          *scales = static_cast<float*>(alloc(static_cast<size_t>(*scales_per * num_experts) * sizeof(float)));
          if (*codes == nullptr || *scales == nullptr)
            return resource_exhausted("cuda runner: out of device memory (experts)");
          weight_bytes_ += static_cast<size_t>(*codes_per * num_experts) +
                           static_cast<size_t>(*scales_per * num_experts) * sizeof(float);
          return Status::Ok();
        };
        uint8_t *gu_codes = nullptr, *dn_codes = nullptr;
        float *gu_scales = nullptr, *dn_scales = nullptr;
        int64_t gu_cp = 0, gu_sp = 0, dn_cp = 0, dn_sp = 0;
        PD_RETURN_IF_ERROR(packed(2 * moe_inter, h, &gu_codes, &gu_scales, &gu_cp, &gu_sp));
        PD_RETURN_IF_ERROR(packed(h, moe_inter, &dn_codes, &dn_scales, &dn_cp, &dn_sp));
        for (int64_t x = 0; x < num_experts; ++x) {
          const std::string ep = p + "mlp.experts." + std::to_string(x) + ".";
          kc::Fp8Weight unused;
          PD_RETURN_IF_ERROR(fp8_linear(&unused, parts_of(ep, FusedLinear::kGateUp, true), gu_codes + x * gu_cp,
                                        gu_scales + x * gu_sp));
          PD_RETURN_IF_ERROR(
              fp8_linear(&unused, parts_of(ep, FusedLinear::kDown, true), dn_codes + x * dn_cp, dn_scales + x * dn_sp));
        }
        e.gate_up = gu_codes;
        e.gate_up_scale = gu_scales;
        e.down = dn_codes;
        e.down_scale = dn_scales;
      } else {
        PD_ASSIGN_OR_RETURN(bf16 * gate_up, device_tensor(num_experts * 2 * moe_inter * h));
        PD_ASSIGN_OR_RETURN(bf16 * down, device_tensor(num_experts * h * moe_inter));
        for (int64_t x = 0; x < num_experts; ++x) {
          const std::string ep = p + "mlp.experts." + std::to_string(x) + ".";
          bf16* gu = gate_up + x * 2 * moe_inter * h;
          bf16* dn = down + x * h * moe_inter;
          const std::vector<LinearPart> gu_parts = parts_of(ep, FusedLinear::kGateUp, true);
          const std::vector<LinearPart> dn_parts = parts_of(ep, FusedLinear::kDown, true);
          PD_RETURN_IF_ERROR(real ? upload_parts(gu, gu_parts, ".weight") : dummy_parts(gu, gu_parts));
          PD_RETURN_IF_ERROR(real ? upload_parts(dn, dn_parts, ".weight") : dummy_parts(dn, dn_parts));
        }
        e.gate_up = gate_up;
        e.down = down;
      }
    }
    if (real) {
      PD_RETURN_IF_ERROR(upload(w.input_norm, {{p + "input_layernorm.weight", h}}));
      PD_RETURN_IF_ERROR(upload(w.post_norm, {{p + "post_attention_layernorm.weight", h}}));
      if (!fp8) {
        PD_RETURN_IF_ERROR(upload_parts(w.qkv, qkv_parts, ".weight"));
        PD_RETURN_IF_ERROR(upload_parts(w.o_proj, o_parts, ".weight"));
        if (!sparse) {
          PD_RETURN_IF_ERROR(upload_parts(w.gate_up, gate_up_parts, ".weight"));
          PD_RETURN_IF_ERROR(upload_parts(w.down, down_parts, ".weight"));
        }
      }
      if (w.qkv_bias != nullptr) PD_RETURN_IF_ERROR(upload_parts(w.qkv_bias, as_bias(qkv_parts), ".bias"));
      // o_proj's bias is replicated: added once, after the ranks' partial sums are reduced.
      if (w.o_bias != nullptr) PD_RETURN_IF_ERROR(upload(w.o_bias, {{p + "self_attn.o_proj.bias", h}}));
      if (w.q_norm != nullptr) {
        PD_RETURN_IF_ERROR(upload(w.q_norm, {{p + "self_attn.q_norm.weight", d}}));
        PD_RETURN_IF_ERROR(upload(w.k_norm, {{p + "self_attn.k_norm.weight", d}}));
      }
    } else {
      PD_RETURN_IF_ERROR(ones(w.input_norm, h));
      PD_RETURN_IF_ERROR(ones(w.post_norm, h));
      if (w.qkv != nullptr) PD_RETURN_IF_ERROR(dummy_parts(w.qkv, qkv_parts));
      if (w.o_proj != nullptr) PD_RETURN_IF_ERROR(dummy_parts(w.o_proj, o_parts));
      if (w.gate_up != nullptr) PD_RETURN_IF_ERROR(dummy_parts(w.gate_up, gate_up_parts));
      if (w.down != nullptr) PD_RETURN_IF_ERROR(dummy_parts(w.down, down_parts));
      if (w.qkv_bias != nullptr) PD_RETURN_IF_ERROR(dummy_parts(w.qkv_bias, as_bias(qkv_parts)));
      if (w.o_bias != nullptr) PD_RETURN_IF_ERROR(dummy(w.o_bias, h));
      if (w.q_norm != nullptr) {
        PD_RETURN_IF_ERROR(ones(w.q_norm, d));
        PD_RETURN_IF_ERROR(ones(w.k_norm, d));
      }
    }
  }
  if (scratch != nullptr) PD_RETURN_IF_ERROR(kc::cuda_status(cudaStreamSynchronize(stream_), "weight slice sync"));
  kernels::cpu::RopeScalingParams scaling;
  if (c.rope_scaling.type == model::RopeScalingType::kLlama3) {
    scaling.llama3 = true;
    scaling.factor = c.rope_scaling.factor;
    scaling.low_freq_factor = c.rope_scaling.low_freq_factor;
    scaling.high_freq_factor = c.rope_scaling.high_freq_factor;
    scaling.original_max_position_embeddings = c.rope_scaling.original_max_position_embeddings;
  }
  const std::vector<float> inv_freq = kernels::cpu::rope_inv_freq(c.head_dim, c.rope_theta, scaling);
  inv_freq_ = static_cast<float*>(alloc(inv_freq.size() * sizeof(float)));
  if (inv_freq_ == nullptr) return resource_exhausted("cuda runner: out of device memory (rope table)");
  return kc::cuda_status(
      cudaMemcpy(inv_freq_, inv_freq.data(), inv_freq.size() * sizeof(float), cudaMemcpyHostToDevice), "rope upload");
}

}  // namespace pd::engine
