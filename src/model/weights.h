// Model weights in host memory, keyed by their HF tensor names, plus the
// per-family table of which tensors a model needs, their shapes and dtypes.
// Unquantised tensors are fp32; the linears of a block-FP8 model keep their
// float8_e4m3fn codes and an fp32 `weight_scale_inv` tensor beside them.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/config.h"

namespace pd::model {

// How dummy weights fill a tensor. kFp8Scale: the weight_scale_inv of the FP8
// weight listed just before it, produced together with that weight.
enum class WeightInit : uint8_t { kNormal, kOnes, kFp8Scale };

// How a tensor is held in memory (and which safetensors dtypes load into it):
// kF32 from F32/F16/BF16; kF8E4M3 from F8_E4M3 only (the codes, unconverted).
enum class WeightDtype : uint8_t { kF32, kF8E4M3 };

struct WeightSpec {
  std::string name;            // HF name, e.g. "model.layers.0.self_attn.q_proj.weight"
  std::vector<int64_t> shape;  // HF shape ([out, in] for linear weights)
  WeightInit init = WeightInit::kNormal;
  WeightDtype dtype = WeightDtype::kF32;
};

// Every tensor the model reads, in a fixed order. Follows the family's HF
// module layout: Qwen2 adds q/k/v biases, Qwen3 adds q_norm/k_norm, and
// lm_head.weight is listed only when embeddings are not tied. Qwen3-MoE: a
// sparse layer (config.is_moe_layer) has the router `mlp.gate.weight`
// [num_experts, hidden] and per expert e `mlp.experts.{e}.{gate,up}_proj.weight`
// [moe_intermediate, hidden] and `mlp.experts.{e}.down_proj.weight` [hidden,
// moe_intermediate]; a dense layer has the usual mlp.{gate,up,down}_proj at
// intermediate_size. Block FP8 (config.quant.fp8()): every attention and MLP
// linear weight (dense or expert; not the router, embeddings, norms, lm_head) is
// kF8E4M3 and followed by `<linear>.weight_scale_inv`, fp32
// [ceil(out/128), ceil(in/128)]. Biases stay fp32.
std::vector<WeightSpec> weight_specs(const ModelConfig& config);

struct Tensor {
  std::vector<int64_t> shape;
  WeightDtype dtype = WeightDtype::kF32;
  std::vector<float> data;   // kF32: the values, row-major
  std::vector<uint8_t> fp8;  // kF8E4M3: the e4m3 codes, row-major
  int64_t num_elements() const;
};

class ModelWeights {
 public:
  // Null when absent.
  const Tensor* find(const std::string& name) const;
  // Adds or replaces a tensor (the shape must match data.size()).
  void put(std::string name, Tensor tensor);
  // Drops a tensor (no-op when absent).
  void erase(const std::string& name) { tensors_.erase(name); }
  size_t num_tensors() const { return tensors_.size(); }
  size_t num_parameters() const;

 private:
  std::map<std::string, Tensor> tensors_;
};

// Reads every tensor of weight_specs(config) from the directory's safetensors
// (F32/F16/BF16 converted to fp32; F8_E4M3 kept as codes). A missing tensor, a
// shape mismatch, a dtype that does not fit the spec (e.g. BF16 where the FP8
// config needs F8_E4M3, or F8_E5M2) or a non-finite / negative weight_scale_inv
// is an error naming the tensor, expected vs got. Extra tensors are ignored.
Result<ModelWeights> load_safetensors_weights(const ModelConfig& config, const std::filesystem::path& model_dir);

// Seeded random weights in the spirit of HF's init: N(0, std_dev) for
// matrices and biases, ones for norms. Each tensor's stream is derived from
// (seed, tensor name), so a tensor does not change when others are added. An
// FP8 weight is that N(0, std_dev) matrix quantised with quantize_fp8_blocks.
ModelWeights dummy_weights(const ModelConfig& config, uint64_t seed, float std_dev = 0.02f);

// Block FP8 as the checkpoints define it, for a weight w [rows][cols] and blocks
// of 128 x 128 (the last row/column block may be partial): scale_inv[b] =
// amax(|w| in block b) / 448 (1 when the block is all zero), code = e4m3(w /
// scale_inv) (round to nearest even, saturating). codes: rows*cols bytes;
// scale_inv: ceil(rows/128) * ceil(cols/128) floats.
void quantize_fp8_blocks(const float* w, int64_t rows, int64_t cols, uint8_t* codes, float* scale_inv);
// The inverse used by the reference: w[r][c] = e4m3_value(code) * scale_inv[r/128][c/128].
void dequantize_fp8_blocks(const uint8_t* codes, const float* scale_inv, int64_t rows, int64_t cols, float* w);
inline int64_t fp8_num_blocks(int64_t dim) {
  return (dim + 127) / 128;
}

}  // namespace pd::model
