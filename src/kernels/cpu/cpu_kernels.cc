#include "kernels/cpu/cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numbers>
#include <numeric>

#include "model/fp8.h"

namespace pd::kernels::cpu {
namespace {

// Dot product with 8 independent partial sums: the compiler vectorizes it
// without -ffast-math, and the fixed summation order keeps results
// reproducible run to run.
inline float dot(const float* a, const float* b, int32_t k) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int32_t i = 0;
  for (; i + 8 <= k; i += 8)
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  float tail = 0.0f;
  for (; i < k; ++i) tail += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail;
}

// Four rows of x against one row of w: w is read once for four outputs.
inline void dot4(const float* x0, const float* x1, const float* x2, const float* x3, const float* w, int32_t k,
                 float* r) {
  float a0[8] = {}, a1[8] = {}, a2[8] = {}, a3[8] = {};
  int32_t i = 0;
  for (; i + 8 <= k; i += 8) {
    for (int j = 0; j < 8; ++j) {
      const float wv = w[i + j];
      a0[j] += x0[i + j] * wv;
      a1[j] += x1[i + j] * wv;
      a2[j] += x2[i + j] * wv;
      a3[j] += x3[i + j] * wv;
    }
  }
  float t[4] = {0, 0, 0, 0};
  for (; i < k; ++i) {
    t[0] += x0[i] * w[i];
    t[1] += x1[i] * w[i];
    t[2] += x2[i] * w[i];
    t[3] += x3[i] * w[i];
  }
  auto sum = [](const float* a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); };
  r[0] = sum(a0) + t[0];
  r[1] = sum(a1) + t[1];
  r[2] = sum(a2) + t[2];
  r[3] = sum(a3) + t[3];
}

}  // namespace

void embedding(const float* table, int32_t hidden, std::span<const int32_t> ids, float* out) {
  for (size_t r = 0; r < ids.size(); ++r)
    std::memcpy(out + r * hidden, table + static_cast<int64_t>(ids[r]) * hidden, sizeof(float) * hidden);
}

void rms_norm(const float* x, const float* weight, int32_t rows, int32_t dim, float eps, float* out) {
  for (int32_t r = 0; r < rows; ++r) {
    const float* xr = x + static_cast<int64_t>(r) * dim;
    float* o = out + static_cast<int64_t>(r) * dim;
    const float mean_sq = dot(xr, xr, dim) / static_cast<float>(dim);
    const float inv = 1.0f / std::sqrt(mean_sq + eps);
    // HF multiplies the normalized fp32 activation by the weight in that order.
    for (int32_t i = 0; i < dim; ++i) o[i] = weight[i] * (xr[i] * inv);
  }
}

void add_rms_norm(float* residual, const float* delta, const float* weight, int32_t rows, int32_t dim, float eps,
                  float* out) {
  const int64_t n = static_cast<int64_t>(rows) * dim;
  for (int64_t i = 0; i < n; ++i) residual[i] += delta[i];
  rms_norm(residual, weight, rows, dim, eps, out);
}

void matmul(const float* x, const float* w, const float* bias, int32_t m, int32_t n, int32_t k, float* out) {
  // Tiles of 64 weight rows keep a slice of w in L1/L2 while four x rows at a
  // time stream against it.
  constexpr int32_t kTileN = 64;
  for (int32_t n0 = 0; n0 < n; n0 += kTileN) {
    const int32_t n1 = std::min(n, n0 + kTileN);
    int32_t r = 0;
    for (; r + 4 <= m; r += 4) {
      const float* x0 = x + static_cast<int64_t>(r) * k;
      for (int32_t j = n0; j < n1; ++j) {
        float res[4];
        dot4(x0, x0 + k, x0 + 2ll * k, x0 + 3ll * k, w + static_cast<int64_t>(j) * k, k, res);
        const float b = bias ? bias[j] : 0.0f;
        for (int t = 0; t < 4; ++t) out[static_cast<int64_t>(r + t) * n + j] = res[t] + b;
      }
    }
    for (; r < m; ++r) {
      const float* xr = x + static_cast<int64_t>(r) * k;
      for (int32_t j = n0; j < n1; ++j)
        out[static_cast<int64_t>(r) * n + j] = dot(xr, w + static_cast<int64_t>(j) * k, k) + (bias ? bias[j] : 0.0f);
    }
  }
}

std::vector<float> rope_inv_freq(int32_t head_dim, double theta, const RopeScalingParams& s) {
  const int32_t half = head_dim / 2;
  std::vector<float> inv(half);
  for (int32_t i = 0; i < half; ++i) {
    // HF: 1 / theta^(arange(0, d, 2) / d) in fp32.
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    double f = 1.0 / std::pow(theta, static_cast<double>(exponent));
    if (s.llama3) {
      const double low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
      const double high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
      const double wavelen = 2.0 * std::numbers::pi / f;
      if (wavelen > low_wavelen) {
        f = f / s.factor;  // low frequencies: fully interpolated
      } else if (wavelen >= high_wavelen) {
        // Medium band: blend between interpolated and original frequency.
        const double smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) /
                              (s.high_freq_factor - s.low_freq_factor);
        f = (1.0 - smooth) * f / s.factor + smooth * f;
      }
    }
    inv[i] = static_cast<float>(f);
  }
  return inv;
}

void apply_rope(float* x, int32_t rows, int32_t num_heads, int32_t head_dim, const int32_t* positions,
                std::span<const float> inv_freq) {
  const int32_t half = head_dim / 2;
  std::vector<float> cos_v(half), sin_v(half);
  for (int32_t r = 0; r < rows; ++r) {
    for (int32_t i = 0; i < half; ++i) {
      // HF forms the angle as an fp32 product, then cos/sin in fp32.
      const float angle = static_cast<float>(positions[r]) * inv_freq[i];
      cos_v[i] = std::cos(angle);
      sin_v[i] = std::sin(angle);
    }
    for (int32_t h = 0; h < num_heads; ++h) {
      float* v = x + (static_cast<int64_t>(r) * num_heads + h) * head_dim;
      for (int32_t i = 0; i < half; ++i) {
        const float a = v[i];
        const float b = v[i + half];
        v[i] = a * cos_v[i] - b * sin_v[i];
        v[i + half] = b * cos_v[i] + a * sin_v[i];
      }
    }
  }
}

void silu_mul(const float* gate, const float* up, int64_t count, float* out) {
  for (int64_t i = 0; i < count; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void write_kv_cache(float* kv_layer, const PagedKvLayout& layout, const float* k, const float* v, int32_t rows,
                    const int64_t* slots) {
  const int64_t row_floats = layout.token_stride();
  const int64_t v_offset = static_cast<int64_t>(layout.block_size) * row_floats;
  for (int32_t r = 0; r < rows; ++r) {
    const int64_t block = slots[r] / layout.block_size;
    const int64_t offset = slots[r] % layout.block_size;
    float* base = kv_layer + block * layout.block_stride() + offset * row_floats;
    std::memcpy(base, k + r * row_floats, sizeof(float) * row_floats);
    std::memcpy(base + v_offset, v + r * row_floats, sizeof(float) * row_floats);
  }
}

namespace {

// Causal GQA attention over a paged cache; key(block, offset, kvh) and
// value(block, offset, kvh) return a pointer to head_dim floats (valid until the
// next call of the same accessor).
template <typename KeyRow, typename ValueRow>
void attend(const float* q, int32_t num_queries, const int32_t* positions, const PagedKvLayout& layout,
            std::span<const int32_t> block_table, int32_t num_heads, float scale, float* out, float* scratch,
            KeyRow key_row, ValueRow value_row) {
  const int32_t d = layout.head_dim;
  const int32_t group = num_heads / layout.num_kv_heads;
  for (int32_t r = 0; r < num_queries; ++r) {
    const int32_t num_keys = positions[r] + 1;
    for (int32_t h = 0; h < num_heads; ++h) {
      const int32_t kvh = h / group;
      const float* qv = q + (static_cast<int64_t>(r) * num_heads + h) * d;
      float* o = out + (static_cast<int64_t>(r) * num_heads + h) * d;
      float max_score = -INFINITY;
      for (int32_t p = 0; p < num_keys; ++p) {
        const float* key = key_row(block_table[p / layout.block_size], p % layout.block_size, kvh);
        scratch[p] = dot(qv, key, d) * scale;
        max_score = std::max(max_score, scratch[p]);
      }
      float denom = 0.0f;
      for (int32_t p = 0; p < num_keys; ++p) {
        scratch[p] = std::exp(scratch[p] - max_score);
        denom += scratch[p];
      }
      const float inv_denom = 1.0f / denom;
      std::fill(o, o + d, 0.0f);
      for (int32_t p = 0; p < num_keys; ++p) {
        const float* val = value_row(block_table[p / layout.block_size], p % layout.block_size, kvh);
        const float weight = scratch[p] * inv_denom;
        for (int32_t i = 0; i < d; ++i) o[i] += weight * val[i];
      }
    }
  }
}

// Reads one (block, offset, head) row of an fp8 cache as floats.
class Fp8RowReader {
 public:
  Fp8RowReader(const uint8_t* kv_layer, const PagedKvLayout& layout, bool value)
      : kv_layer_(kv_layer), layout_(layout), value_(value), row_(static_cast<size_t>(layout.head_dim)) {}
  const float* operator()(int64_t block, int32_t offset, int32_t kvh) {
    const uint8_t* base = kv_layer_ + block * layout_.fp8_block_bytes();
    const int64_t row = static_cast<int64_t>(offset) * layout_.num_kv_heads + kvh;
    const uint8_t* codes =
        base + (value_ ? layout_.fp8_codes_bytes() : 0) + row * static_cast<int64_t>(layout_.head_dim);
    float scale;
    std::memcpy(
        &scale,
        base + layout_.fp8_scales_offset() +
            static_cast<int64_t>(sizeof(float)) * ((value_ ? layout_.block_size * layout_.num_kv_heads : 0) + row),
        sizeof scale);
    for (int32_t i = 0; i < layout_.head_dim; ++i)
      row_[static_cast<size_t>(i)] = model::fp8_e4m3_to_f32(codes[i]) * scale;
    return row_.data();
  }

 private:
  const uint8_t* kv_layer_;
  PagedKvLayout layout_;
  bool value_;
  std::vector<float> row_;
};

float fp8_scale_for(float amax) {
  const float scale = amax / model::kFp8E4m3Max;
  return scale > 0.0f ? scale : 1.0f;  // all-zero (or underflowing) rows: any scale gives zero codes
}

}  // namespace

void paged_attention(const float* q, int32_t num_queries, const int32_t* positions, const float* kv_layer,
                     const PagedKvLayout& layout, std::span<const int32_t> block_table, int32_t num_heads, float scale,
                     float* out, float* scratch) {
  const int64_t row_floats = layout.token_stride();
  const int64_t v_offset = static_cast<int64_t>(layout.block_size) * row_floats;
  auto row = [&](int64_t extra) {
    return [&, extra](int64_t block, int32_t offset, int32_t kvh) {
      return kv_layer + block * layout.block_stride() + extra + offset * row_floats +
             static_cast<int64_t>(kvh) * layout.head_dim;
    };
  };
  attend(q, num_queries, positions, layout, block_table, num_heads, scale, out, scratch, row(0), row(v_offset));
}

void quantize_kv_row(const float* x, int32_t head_dim, uint8_t* codes, float* scale) {
  float amax = 0.0f;
  for (int32_t i = 0; i < head_dim; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float s = fp8_scale_for(amax);
  for (int32_t i = 0; i < head_dim; ++i) codes[i] = model::f32_to_fp8_e4m3(x[i] / s);
  *scale = s;
}

void write_kv_cache_fp8(uint8_t* kv_layer, const PagedKvLayout& layout, const float* k, const float* v, int32_t rows,
                        const int64_t* slots) {
  const int32_t d = layout.head_dim;
  const int64_t heads_per_block = static_cast<int64_t>(layout.block_size) * layout.num_kv_heads;
  for (int32_t r = 0; r < rows; ++r) {
    uint8_t* base = kv_layer + (slots[r] / layout.block_size) * layout.fp8_block_bytes();
    const int64_t offset = slots[r] % layout.block_size;
    for (int32_t h = 0; h < layout.num_kv_heads; ++h) {
      const int64_t row = offset * layout.num_kv_heads + h;
      const int64_t src = (static_cast<int64_t>(r) * layout.num_kv_heads + h) * d;
      float k_scale, v_scale;
      quantize_kv_row(k + src, d, base + row * d, &k_scale);
      quantize_kv_row(v + src, d, base + layout.fp8_codes_bytes() + row * d, &v_scale);
      uint8_t* scales = base + layout.fp8_scales_offset();
      std::memcpy(scales + sizeof(float) * row, &k_scale, sizeof k_scale);
      std::memcpy(scales + sizeof(float) * (heads_per_block + row), &v_scale, sizeof v_scale);
    }
  }
}

void paged_attention_fp8(const float* q, int32_t num_queries, const int32_t* positions, const uint8_t* kv_layer,
                         const PagedKvLayout& layout, std::span<const int32_t> block_table, int32_t num_heads,
                         float scale, float* out, float* scratch) {
  attend(q, num_queries, positions, layout, block_table, num_heads, scale, out, scratch,
         Fp8RowReader(kv_layer, layout, /*value=*/false), Fp8RowReader(kv_layer, layout, /*value=*/true));
}

void fp8_quantize_activations(const float* x, int32_t rows, int32_t cols, float* out) {
  for (int32_t r = 0; r < rows; ++r) {
    const float* xr = x + static_cast<int64_t>(r) * cols;
    float* o = out + static_cast<int64_t>(r) * cols;
    for (int32_t c0 = 0; c0 < cols; c0 += model::kFp8BlockSize) {
      const int32_t c1 = std::min(cols, c0 + model::kFp8BlockSize);
      float amax = 0.0f;
      for (int32_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(xr[c]));
      const float s = fp8_scale_for(amax);
      for (int32_t c = c0; c < c1; ++c) o[c] = model::fp8_e4m3_to_f32(model::f32_to_fp8_e4m3(xr[c] / s)) * s;
    }
  }
}

void moe_route(const float* router_logits, int32_t rows, int32_t num_experts, int32_t top_k, bool norm_topk_prob,
               int32_t* expert_ids, float* weights) {
  std::vector<float> probs(static_cast<size_t>(num_experts));
  std::vector<int32_t> order(static_cast<size_t>(num_experts));
  for (int32_t r = 0; r < rows; ++r) {
    const float* logits = router_logits + static_cast<int64_t>(r) * num_experts;
    const float max_logit = *std::max_element(logits, logits + num_experts);
    float sum = 0.0f;
    for (int32_t e = 0; e < num_experts; ++e) {
      probs[static_cast<size_t>(e)] = std::exp(logits[e] - max_logit);
      sum += probs[static_cast<size_t>(e)];
    }
    for (float& p : probs) p /= sum;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [&](int32_t a, int32_t b) {
      const float pa = probs[static_cast<size_t>(a)], pb = probs[static_cast<size_t>(b)];
      return pa > pb || (pa == pb && a < b);
    });
    float top_sum = 0.0f;
    for (int32_t i = 0; i < top_k; ++i) top_sum += probs[static_cast<size_t>(order[static_cast<size_t>(i)])];
    for (int32_t i = 0; i < top_k; ++i) {
      const int32_t e = order[static_cast<size_t>(i)];
      expert_ids[static_cast<int64_t>(r) * top_k + i] = e;
      const float p = probs[static_cast<size_t>(e)];
      weights[static_cast<int64_t>(r) * top_k + i] = norm_topk_prob ? p / top_sum : p;
    }
  }
}

void sum_rank_partials(std::span<const float* const> partials, int64_t count, float* out) {
  if (partials.empty()) return;
  if (out != partials[0]) std::copy_n(partials[0], count, out);
  for (size_t r = 1; r < partials.size(); ++r) {
    const float* p = partials[r];
    for (int64_t i = 0; i < count; ++i) out[i] += p[i];
  }
}

}  // namespace pd::kernels::cpu
