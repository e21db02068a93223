// Model weights in fp32 host memory, keyed by their HF tensor names, plus the
// per-family table of which tensors a model needs and their shapes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/config.h"

namespace pd::model {

enum class WeightInit : uint8_t { kNormal, kOnes };  // how dummy weights fill a tensor

struct WeightSpec {
  std::string name;            // HF name, e.g. "model.layers.0.self_attn.q_proj.weight"
  std::vector<int64_t> shape;  // HF shape ([out, in] for linear weights)
  WeightInit init = WeightInit::kNormal;
};

// Every tensor the model reads, in a fixed order. Follows the family's HF
// module layout: Qwen2 adds q/k/v biases, Qwen3 adds q_norm/k_norm, and
// lm_head.weight is listed only when embeddings are not tied.
std::vector<WeightSpec> weight_specs(const ModelConfig& config);

struct Tensor {
  std::vector<int64_t> shape;
  std::vector<float> data;
};

class ModelWeights {
 public:
  // Null when absent.
  const Tensor* find(const std::string& name) const;
  // Adds or replaces a tensor (the shape must match data.size()).
  void put(std::string name, Tensor tensor);
  size_t num_tensors() const { return tensors_.size(); }
  size_t num_parameters() const;

 private:
  std::map<std::string, Tensor> tensors_;
};

// Reads every tensor of weight_specs(config) from the directory's safetensors
// (F32/F16/BF16 converted to fp32). A missing tensor or a shape mismatch is an
// error naming the tensor, expected vs got. Extra tensors are ignored.
Result<ModelWeights> load_safetensors_weights(const ModelConfig& config, const std::filesystem::path& model_dir);

// Seeded random weights in the spirit of HF's init: N(0, std_dev) for
// matrices and biases, ones for norms. Each tensor's stream is derived from
// (seed, tensor name), so a tensor does not change when others are added.
ModelWeights dummy_weights(const ModelConfig& config, uint64_t seed, float std_dev = 0.02f);

}  // namespace pd::model
