#include "model/weights.h"

#include <xxhash.h>

#include <cmath>

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
  std::vector<WeightSpec> specs;
  specs.push_back({"model.embed_tokens.weight", {c.vocab_size, hidden}, WeightInit::kNormal});
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    specs.push_back({p + "input_layernorm.weight", {hidden}, WeightInit::kOnes});
    specs.push_back({p + "self_attn.q_proj.weight", {q, hidden}, WeightInit::kNormal});
    specs.push_back({p + "self_attn.k_proj.weight", {kv, hidden}, WeightInit::kNormal});
    specs.push_back({p + "self_attn.v_proj.weight", {kv, hidden}, WeightInit::kNormal});
    if (c.qkv_bias) {
      specs.push_back({p + "self_attn.q_proj.bias", {q}, WeightInit::kNormal});
      specs.push_back({p + "self_attn.k_proj.bias", {kv}, WeightInit::kNormal});
      specs.push_back({p + "self_attn.v_proj.bias", {kv}, WeightInit::kNormal});
    }
    if (c.qk_norm) {
      specs.push_back({p + "self_attn.q_norm.weight", {c.head_dim}, WeightInit::kOnes});
      specs.push_back({p + "self_attn.k_norm.weight", {c.head_dim}, WeightInit::kOnes});
    }
    specs.push_back({p + "self_attn.o_proj.weight", {hidden, q}, WeightInit::kNormal});
    if (c.o_bias) specs.push_back({p + "self_attn.o_proj.bias", {hidden}, WeightInit::kNormal});
    specs.push_back({p + "post_attention_layernorm.weight", {hidden}, WeightInit::kOnes});
    specs.push_back({p + "mlp.gate_proj.weight", {inter, hidden}, WeightInit::kNormal});
    specs.push_back({p + "mlp.up_proj.weight", {inter, hidden}, WeightInit::kNormal});
    specs.push_back({p + "mlp.down_proj.weight", {hidden, inter}, WeightInit::kNormal});
  }
  specs.push_back({"model.norm.weight", {hidden}, WeightInit::kOnes});
  if (!c.tie_word_embeddings) specs.push_back({"lm_head.weight", {c.vocab_size, hidden}, WeightInit::kNormal});
  return specs;
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
  for (const auto& [name, t] : tensors_) n += t.data.size();
  return n;
}

Result<ModelWeights> load_safetensors_weights(const ModelConfig& config, const std::filesystem::path& model_dir) {
  PD_ASSIGN_OR_RETURN(SafetensorsCheckpoint ckpt, SafetensorsCheckpoint::open_dir(model_dir));
  ModelWeights weights;
  for (const WeightSpec& spec : weight_specs(config)) {
    auto entry = ckpt.find(spec.name);
    if (!entry.ok()) return entry.status().with_context(model_dir.string());
    const TensorInfo& info = *entry->info;
    if (info.shape != spec.shape)
      return invalid_argument("{}: tensor '{}' has shape {}, the {} config needs {}", entry->file->path().string(),
                              spec.name, shape_str(info.shape), config.architecture, shape_str(spec.shape));
    Tensor t;
    t.shape = spec.shape;
    t.data.resize(static_cast<size_t>(shape_elements(spec.shape)));
    PD_RETURN_IF_ERROR(entry->file->read_as_f32(info, t.data));
    weights.put(spec.name, std::move(t));
  }
  return weights;
}

ModelWeights dummy_weights(const ModelConfig& config, uint64_t seed, float std_dev) {
  ModelWeights weights;
  for (const WeightSpec& spec : weight_specs(config)) {
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
    weights.put(spec.name, std::move(t));
  }
  return weights;
}

}  // namespace pd::model
