// Which part of each checkpoint tensor a tensor-parallel rank uploads, for
// runners that stack a layer's linears into fused tensors (q|k|v rows, gate|up
// rows) and shard them by model::plan_tensor_parallel: column-parallel linears
// keep a range of output rows, row-parallel ones (o_proj, down_proj) a range of
// input columns. At tensor_parallel_size 1 every part is the whole tensor.
// Pure host code: the CUDA runner's loader reads these plans; the CPU unit tests
// check them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "model/config.h"
#include "model/tp_shard.h"

namespace pd::model {

// A rank's rectangle of one checkpoint tensor [rows][cols] (row-major), and where
// that tensor sits in the runner's fused tensor (for weights generated on the
// device, which are generated per fused tensor).
struct LinearPart {
  std::string base;  // tensor name without ".weight" / ".bias" / ".weight_scale_inv"
  int64_t rows = 0, cols = 0;
  int64_t row_begin = 0, row_end = 0;
  int64_t col_begin = 0, col_end = 0;
  int64_t fused_row_offset = 0;  // first row of this tensor inside the fused tensor
  int64_t fused_rows = 0;        // rows of the whole fused tensor

  int64_t slice_rows() const { return row_end - row_begin; }
  int64_t slice_cols() const { return col_end - col_begin; }
  bool whole() const { return row_begin == 0 && row_end == rows && col_begin == 0 && col_end == cols; }
};

// The fused linears of one decoder layer (or of one expert, with `prefix` the
// expert's "model.layers.L.mlp.experts.E." and `expert` set). With expert
// parallelism an expert's parts are whole (the rank holds the expert whole).
enum class FusedLinear : uint8_t { kQkv, kOProj, kGateUp, kDown };

// The parts of `which` that `rank` holds, in the order they are stacked by rows.
// prefix: "model.layers.L." for attention and dense MLPs ("self_attn." / "mlp."
// are appended), the expert's prefix for experts (expert = true).
std::vector<LinearPart> rank_linear_parts(const ModelConfig& config, const TpSplit& split, int32_t rank,
                                          const std::string& prefix, FusedLinear which, bool expert = false);

// The rank's rectangle of a row-major fp32 tensor holding part.rows x part.cols values.
std::vector<float> copy_part(const float* data, const LinearPart& part);
// A column-parallel bias (1-D, part.rows values): entries [row_begin, row_end).
std::vector<float> copy_bias_part(const float* bias, const LinearPart& part);

// The rank's rectangle of a block-FP8 tensor: its e4m3 codes [slice_rows][slice_cols]
// and its weight_scale_inv [ceil(slice_rows / 128)][ceil(slice_cols / 128)]. The
// rectangle must start on 128 x 128 block boundaries (plan_tensor_parallel refuses
// splits that would not); otherwise INVALID_ARGUMENT naming the tensor.
struct Fp8Part {
  std::vector<uint8_t> codes;
  std::vector<float> scale_inv;
};
Result<Fp8Part> copy_fp8_part(const uint8_t* codes, const float* scale_inv, const LinearPart& part);

}  // namespace pd::model
