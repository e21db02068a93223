#include "model/tp_weight_slice.h"

#include <algorithm>

#include "model/fp8.h"

namespace pd::model {

namespace {

// A column-parallel tensor [rows][cols]: rows [begin, end) of it.
LinearPart row_part(std::string base, int64_t rows, int64_t cols, int64_t begin, int64_t end, int64_t fused_offset,
                    int64_t fused_rows) {
  LinearPart p;
  p.base = std::move(base);
  p.rows = rows;
  p.cols = cols;
  p.row_begin = begin;
  p.row_end = end;
  p.col_begin = 0;
  p.col_end = cols;
  p.fused_row_offset = fused_offset;
  p.fused_rows = fused_rows;
  return p;
}

// A row-parallel tensor [rows][cols]: columns [begin, end) of every row.
LinearPart col_part(std::string base, int64_t rows, int64_t cols, int64_t begin, int64_t end) {
  LinearPart p;
  p.base = std::move(base);
  p.rows = rows;
  p.cols = cols;
  p.row_begin = 0;
  p.row_end = rows;
  p.col_begin = begin;
  p.col_end = end;
  p.fused_row_offset = 0;
  p.fused_rows = rows;
  return p;
}

}  // namespace

std::vector<LinearPart> rank_linear_parts(const ModelConfig& c, const TpSplit& s, int32_t rank,
                                          const std::string& prefix, FusedLinear which, bool expert) {
  const int64_t h = c.hidden_size, d = c.head_dim, hq = c.num_heads, hkv = c.num_kv_heads;
  const int64_t q0 = static_cast<int64_t>(rank) * s.heads_per_rank * d, q1 = q0 + s.heads_per_rank * d;
  const int64_t kv0 = static_cast<int64_t>(s.kv_head_begin(rank, c.num_kv_heads)) * d,
                kv1 = kv0 + static_cast<int64_t>(s.kv_heads_per_rank) * d;
  const int64_t inter = expert ? c.moe.moe_intermediate_size : c.intermediate_size;
  const int64_t inter_rank = expert ? s.moe_intermediate_per_rank : s.intermediate_per_rank;
  // With expert parallelism a rank holds whole experts: nothing of an expert is cut.
  const bool whole_expert = expert && s.expert_parallel;
  const int64_t i0 = whole_expert ? 0 : static_cast<int64_t>(rank) * inter_rank;
  const int64_t i1 = whole_expert ? inter : i0 + inter_rank;
  const std::string attn = prefix + "self_attn.";
  const std::string mlp = expert ? prefix : prefix + "mlp.";
  const int64_t qkv_rows = (hq + 2 * hkv) * d;
  switch (which) {
    case FusedLinear::kQkv:
      return {row_part(attn + "q_proj", hq * d, h, q0, q1, 0, qkv_rows),
              row_part(attn + "k_proj", hkv * d, h, kv0, kv1, hq * d, qkv_rows),
              row_part(attn + "v_proj", hkv * d, h, kv0, kv1, (hq + hkv) * d, qkv_rows)};
    case FusedLinear::kOProj:
      return {col_part(attn + "o_proj", h, hq * d, q0, q1)};
    case FusedLinear::kGateUp:
      return {row_part(mlp + "gate_proj", inter, h, i0, i1, 0, 2 * inter),
              row_part(mlp + "up_proj", inter, h, i0, i1, inter, 2 * inter)};
    case FusedLinear::kDown:
      return {col_part(mlp + "down_proj", h, inter, i0, i1)};
  }
  return {};
}

std::vector<float> copy_part(const float* data, const LinearPart& p) {
  std::vector<float> out(static_cast<size_t>(p.slice_rows() * p.slice_cols()));
  for (int64_t r = 0; r < p.slice_rows(); ++r)
    std::copy_n(data + (p.row_begin + r) * p.cols + p.col_begin, p.slice_cols(), out.data() + r * p.slice_cols());
  return out;
}

std::vector<float> copy_bias_part(const float* bias, const LinearPart& p) {
  return std::vector<float>(bias + p.row_begin, bias + p.row_end);
}

Result<Fp8Part> copy_fp8_part(const uint8_t* codes, const float* scale_inv, const LinearPart& p) {
  const int64_t b = kFp8BlockSize;
  if (p.row_begin % b != 0 || p.col_begin % b != 0)
    return invalid_argument("tensor-parallel slice of '{}' starts at row {} / column {}, not on its 128x128 FP8 blocks",
                            p.base, p.row_begin, p.col_begin);
  Fp8Part out;
  out.codes.resize(static_cast<size_t>(p.slice_rows() * p.slice_cols()));
  for (int64_t r = 0; r < p.slice_rows(); ++r)
    std::copy_n(codes + (p.row_begin + r) * p.cols + p.col_begin, p.slice_cols(),
                out.codes.data() + r * p.slice_cols());
  const int64_t full_col_blocks = (p.cols + b - 1) / b;
  const int64_t rb0 = p.row_begin / b, rb1 = (p.row_end + b - 1) / b;
  const int64_t cb0 = p.col_begin / b, cb1 = (p.col_end + b - 1) / b;
  out.scale_inv.reserve(static_cast<size_t>((rb1 - rb0) * (cb1 - cb0)));
  for (int64_t rb = rb0; rb < rb1; ++rb)
    for (int64_t cb = cb0; cb < cb1; ++cb) out.scale_inv.push_back(scale_inv[rb * full_col_blocks + cb]);
  return out;
}

}  // namespace pd::model
