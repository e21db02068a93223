#include "model/weights.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <string_view>

#include "model/fp8.h"

#include "model/safetensors.h"

namespace pd::model {
namespace {

int64_t shape_elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

uint64_t splitmix64(uint64_t* state) {
  uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Uniform in (0, 1]: never 0, so log() below is finite.
double uniform_open0(uint64_t* state) {
  return (static_cast<double>(splitmix64(state) >> 11) + 1.0) * 0x1.0p-53;
}

}  // namespace

std::vector<WeightSpec> weight_specs(const ModelConfig& c) {
  const int64_t hidden = c.hidden_size;
  const int64_t inter = c.intermediate_size;
  const int64_t q = c.q_size();
  const int64_t kv = c.kv_size();
  const bool fp8 = c.quant.fp8();
  std::vector<WeightSpec> specs;
  // A linear weight [out, in]; in a block-FP8 model its codes plus the scales.
  auto linear = [&](const std::string& name, int64_t out, int64_t in) {
    if (!fp8) {
      specs.push_back({name + ".weight", {out, in}, WeightInit::kNormal, WeightDtype::kF32});
      return;
    }
    specs.push_back({name + ".weight", {out, in}, WeightInit::kNormal, WeightDtype::kF8E4M3});
    specs.push_back({name + ".weight_scale_inv",
                     {fp8_num_blocks(out), fp8_num_blocks(in)},
                     WeightInit::kFp8Scale,
                     WeightDtype::kF32});
  };
  specs.push_back({"model.embed_tokens.weight", {c.vocab_size, hidden}, WeightInit::kNormal});
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    specs.push_back({p + "input_layernorm.weight", {hidden}, WeightInit::kOnes});
    linear(p + "self_attn.q_proj", q, hidden);
    linear(p + "self_attn.k_proj", kv, hidden);
    linear(p + "self_attn.v_proj", kv, hidden);
    if (c.qkv_bias) {
      specs.push_back({p + "self_attn.q_proj.bias", {q}, WeightInit::kNormal});
      specs.push_back({p + "self_attn.k_proj.bias", {kv}, WeightInit::kNormal});
      specs.push_back({p + "self_attn.v_proj.bias", {kv}, WeightInit::kNormal});
    }
    if (c.qk_norm) {
      specs.push_back({p + "self_attn.q_norm.weight", {c.head_dim}, WeightInit::kOnes});
      specs.push_back({p + "self_attn.k_norm.weight", {c.head_dim}, WeightInit::kOnes});
    }
    linear(p + "self_attn.o_proj", hidden, q);
    if (c.o_bias) specs.push_back({p + "self_attn.o_proj.bias", {hidden}, WeightInit::kNormal});
    specs.push_back({p + "post_attention_layernorm.weight", {hidden}, WeightInit::kOnes});
    if (c.is_moe_layer(l)) {
      const int64_t moe_inter = c.moe.moe_intermediate_size;
      specs.push_back({p + "mlp.gate.weight", {c.moe.num_experts, hidden}, WeightInit::kNormal});
      for (int32_t e = 0; e < c.moe.num_experts; ++e) {
        const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
        linear(x + "gate_proj", moe_inter, hidden);
        linear(x + "up_proj", moe_inter, hidden);
        linear(x + "down_proj", hidden, moe_inter);
      }
    } else {
      linear(p + "mlp.gate_proj", inter, hidden);
      linear(p + "mlp.up_proj", inter, hidden);
      linear(p + "mlp.down_proj", hidden, inter);
    }
  }
  specs.push_back({"model.norm.weight", {hidden}, WeightInit::kOnes});
  if (!c.tie_word_embeddings) specs.push_back({"lm_head.weight", {c.vocab_size, hidden}, WeightInit::kNormal});
  return specs;
}

int64_t Tensor::num_elements() const {
  return shape_elements(shape);
}

void quantize_fp8_blocks(const float* w, int64_t rows, int64_t cols, uint8_t* codes, float* scale_inv) {
  const int64_t block_cols = fp8_num_blocks(cols);
  for (int64_t br = 0; br < fp8_num_blocks(rows); ++br) {
    const int64_t r0 = br * kFp8BlockSize, r1 = std::min(rows, r0 + kFp8BlockSize);
    for (int64_t bc = 0; bc < block_cols; ++bc) {
      const int64_t c0 = bc * kFp8BlockSize, c1 = std::min(cols, c0 + kFp8BlockSize);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t col = c0; col < c1; ++col) amax = std::max(amax, std::fabs(w[r * cols + col]));
      const float scale = amax > 0.0f ? amax / kFp8E4m3Max : 1.0f;
      scale_inv[br * block_cols + bc] = scale;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t col = c0; col < c1; ++col) codes[r * cols + col] = f32_to_fp8_e4m3(w[r * cols + col] / scale);
    }
  }
}

void dequantize_fp8_blocks(const uint8_t* codes, const float* scale_inv, int64_t rows, int64_t cols, float* w) {
  const int64_t block_cols = fp8_num_blocks(cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float* scales = scale_inv + (r / kFp8BlockSize) * block_cols;
    for (int64_t col = 0; col < cols; ++col)
      w[r * cols + col] = fp8_e4m3_to_f32(codes[r * cols + col]) * scales[col / kFp8BlockSize];
  }
}

const Tensor* ModelWeights::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

void ModelWeights::put(std::string name, Tensor tensor) {
  tensors_[std::move(name)] = std::move(tensor);
}

size_t ModelWeights::num_parameters() const {
  size_t n = 0;
  for (const auto& [name, t] : tensors_) n += t.data.size() + t.fp8.size();
  return n;
}

Result<ModelWeights> load_safetensors_weights(const ModelConfig& config, const std::filesystem::path& model_dir) {
  PD_ASSIGN_OR_RETURN(SafetensorsCheckpoint ckpt, SafetensorsCheckpoint::open_dir(model_dir));
  ModelWeights weights;
  for (const WeightSpec& spec : weight_specs(config)) {
    auto entry = ckpt.find(spec.name);
    if (!entry.ok()) return entry.status().with_context(model_dir.string());
    const TensorInfo& info = *entry->info;
    const std::string file = entry->file->path().string();
    if (info.shape != spec.shape)
      return invalid_argument("{}: tensor '{}' has shape {}, the {} config needs {}", file, spec.name,
                              shape_str(info.shape), config.architecture, shape_str(spec.shape));
    Tensor t;
    t.shape = spec.shape;
    t.dtype = spec.dtype;
    const size_t n = static_cast<size_t>(shape_elements(spec.shape));
    if (spec.dtype == WeightDtype::kF8E4M3) {
      if (info.dtype != TensorDtype::kF8E4M3)
        return invalid_argument("{}: tensor '{}' has dtype {}, the block-FP8 config needs F8_E4M3", file, spec.name,
                                tensor_dtype_name(info.dtype));
      t.fp8.resize(n);
      PD_RETURN_IF_ERROR(entry->file->read_fp8_e4m3(info, t.fp8));
    } else {
      if (info.dtype == TensorDtype::kF8E4M3 || info.dtype == TensorDtype::kF8E5M2)
        return invalid_argument("{}: tensor '{}' has dtype {}, but the config does not quantise it ({})", file,
                                spec.name, tensor_dtype_name(info.dtype),
                                config.quant.fp8() ? "embeddings, norms, lm_head and the router stay unquantised"
                                                   : "no quantization_config");
      t.data.resize(n);
      PD_RETURN_IF_ERROR(entry->file->read_as_f32(info, t.data));
      if (spec.init == WeightInit::kFp8Scale) {
        for (float v : t.data)
          if (!std::isfinite(v) || v < 0.0f)
            return invalid_argument("{}: tensor '{}' holds the scale {}; FP8 block scales must be finite and >= 0",
                                    file, spec.name, v);
      }
    }
    weights.put(spec.name, std::move(t));
  }
  return weights;
}

ModelWeights dummy_weights(const ModelConfig& config, uint64_t seed, float std_dev) {
  ModelWeights weights;
  for (const WeightSpec& spec : weight_specs(config)) {
    if (spec.init == WeightInit::kFp8Scale) continue;  // made with its weight below
    Tensor t;
    t.shape = spec.shape;
    t.data.resize(static_cast<size_t>(shape_elements(spec.shape)));
    if (spec.init == WeightInit::kOnes) {
      std::fill(t.data.begin(), t.data.end(), 1.0f);
    } else {
      uint64_t state = XXH3_64bits_withSeed(spec.name.data(), spec.name.size(), seed);
      // Marsaglia's polar method: two normals per accepted pair, no sin/cos.
      for (size_t i = 0; i < t.data.size(); i += 2) {
        double u, v, s2;
        do {
          u = 2.0 * uniform_open0(&state) - 1.0;
          v = 2.0 * uniform_open0(&state) - 1.0;
          s2 = u * u + v * v;
        } while (s2 >= 1.0 || s2 == 0.0);
        const double scale = std_dev * std::sqrt(-2.0 * std::log(s2) / s2);
        t.data[i] = static_cast<float>(u * scale);
        if (i + 1 < t.data.size()) t.data[i + 1] = static_cast<float>(v * scale);
      }
    }
    if (spec.dtype == WeightDtype::kF8E4M3) {
      const int64_t rows = spec.shape[0], cols = spec.shape[1];
      Tensor scales;
      scales.shape = {fp8_num_blocks(rows), fp8_num_blocks(cols)};
      scales.data.resize(static_cast<size_t>(shape_elements(scales.shape)));
      t.dtype = WeightDtype::kF8E4M3;
      t.fp8.resize(t.data.size());
      quantize_fp8_blocks(t.data.data(), rows, cols, t.fp8.data(), scales.data.data());
      t.data.clear();
      t.data.shrink_to_fit();
      std::string scale_name = spec.name;
      scale_name.replace(scale_name.size() - std::string_view(".weight").size(), std::string::npos,
                         ".weight_scale_inv");
      weights.put(std::move(scale_name), std::move(scales));
    }
    weights.put(spec.name, std::move(t));
  }
  return weights;
}

}  // namespace pd::model
