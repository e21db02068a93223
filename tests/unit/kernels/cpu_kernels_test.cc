// CPU kernels against naive double-precision references on random data.
// Outputs are poisoned (NaN) first so a kernel that skips an element fails.
#include "kernels/cpu/cpu_kernels.h"

#include "model/fp8.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

namespace pd::kernels::cpu {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

std::vector<float> random_vec(size_t n, std::mt19937* rng, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(*rng);
  return v;
}

void expect_close(const std::vector<float>& got, const std::vector<double>& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_FALSE(std::isnan(got[i])) << "element " << i << " was not written";
    ASSERT_NEAR(got[i], want[i], tol * (1.0 + std::abs(want[i]))) << "element " << i;
  }
}

TEST(CpuKernels, MatmulWithBiasMatchesNaiveForOddShapes) {
  std::mt19937 rng(1);
  for (auto [m, n, k] : {std::tuple{1, 7, 5}, {5, 67, 33}, {8, 130, 64}, {3, 1, 17}}) {
    auto x = random_vec(static_cast<size_t>(m) * k, &rng);
    auto w = random_vec(static_cast<size_t>(n) * k, &rng);
    auto b = random_vec(static_cast<size_t>(n), &rng);
    std::vector<float> out(static_cast<size_t>(m) * n, kNaN);
    matmul(x.data(), w.data(), b.data(), m, n, k, out.data());
    std::vector<double> ref(out.size());
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) {
        double s = b[j];
        for (int t = 0; t < k; ++t) s += static_cast<double>(x[i * k + t]) * w[j * k + t];
        ref[i * n + j] = s;
      }
    expect_close(out, ref, 1e-5);
  }
}

TEST(CpuKernels, MatmulWithoutBiasAddsNothing) {
  std::mt19937 rng(2);
  auto x = random_vec(4 * 9, &rng);
  auto w = random_vec(3 * 9, &rng);
  std::vector<float> out(12, kNaN);
  matmul(x.data(), w.data(), nullptr, 4, 3, 9, out.data());
  std::vector<double> ref(12);
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 3; ++j)
      for (int t = 0; t < 9; ++t) ref[i * 3 + j] += static_cast<double>(x[i * 9 + t]) * w[j * 9 + t];
  expect_close(out, ref, 1e-5);
}

TEST(CpuKernels, RmsNormAndResidualVariantMatchNaive) {
  std::mt19937 rng(3);
  const int rows = 3, dim = 37;
  const float eps = 1e-6f;
  auto x = random_vec(rows * dim, &rng);
  auto delta = random_vec(rows * dim, &rng);
  auto w = random_vec(dim, &rng);
  std::vector<double> ref(rows * dim), ref_res(rows * dim);
  for (int r = 0; r < rows; ++r) {
    double ss = 0;
    for (int i = 0; i < dim; ++i) {
      ref_res[r * dim + i] = static_cast<double>(x[r * dim + i]) + delta[r * dim + i];
      ss += ref_res[r * dim + i] * ref_res[r * dim + i];
    }
    const double inv = 1.0 / std::sqrt(ss / dim + eps);
    for (int i = 0; i < dim; ++i) ref[r * dim + i] = ref_res[r * dim + i] * inv * w[i];
  }
  std::vector<float> residual = x, out(rows * dim, kNaN);
  add_rms_norm(residual.data(), delta.data(), w.data(), rows, dim, eps, out.data());
  expect_close(residual, ref_res, 1e-6);
  expect_close(out, ref, 1e-5);

  std::vector<float> plain(rows * dim, kNaN);
  rms_norm(residual.data(), w.data(), rows, dim, eps, plain.data());
  expect_close(plain, ref, 1e-5);
}

TEST(CpuKernels, RopeRotatesHalvesByPositionTimesFrequency) {
  std::mt19937 rng(4);
  const int rows = 3, heads = 2, d = 8;
  auto x = random_vec(rows * heads * d, &rng);
  const std::vector<int32_t> positions = {0, 5, 1000};
  auto inv = rope_inv_freq(d, 10000.0, {});
  ASSERT_EQ(inv.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(inv[i], std::pow(10000.0, -2.0 * i / d), 1e-7);
  std::vector<float> y = x;
  apply_rope(y.data(), rows, heads, d, positions.data(), inv);
  std::vector<double> ref(y.size());
  for (int r = 0; r < rows; ++r)
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < d / 2; ++i) {
        const double angle = positions[r] * static_cast<double>(inv[i]);
        const size_t base = (r * heads + h) * d;
        const double a = x[base + i], b = x[base + i + d / 2];
        ref[base + i] = a * std::cos(angle) - b * std::sin(angle);
        ref[base + i + d / 2] = b * std::cos(angle) + a * std::sin(angle);
      }
  expect_close(y, ref, 1e-4);
  // Position 0 is the identity.
  for (int i = 0; i < heads * d; ++i) EXPECT_EQ(y[i], x[i]);
}

TEST(CpuKernels, Llama3RopeScalingKeepsHighDividesLowAndBlendsMedium) {
  RopeScalingParams s;
  s.llama3 = true;
  s.factor = 8.0;
  s.low_freq_factor = 1.0;
  s.high_freq_factor = 4.0;
  s.original_max_position_embeddings = 64;
  const int d = 16;
  const double theta = 500000.0;
  auto plain = rope_inv_freq(d, theta, {});
  auto scaled = rope_inv_freq(d, theta, s);
  int num_high = 0, num_low = 0, num_medium = 0;
  for (int i = 0; i < d / 2; ++i) {
    const double wavelen = 2 * M_PI / plain[i];
    if (wavelen < 64.0 / 4.0) {
      EXPECT_FLOAT_EQ(scaled[i], plain[i]);
      ++num_high;
    } else if (wavelen > 64.0) {
      EXPECT_FLOAT_EQ(scaled[i], plain[i] / 8.0f);
      ++num_low;
    } else {
      const double smooth = (64.0 / wavelen - 1.0) / 3.0;
      EXPECT_NEAR(scaled[i], (1 - smooth) * plain[i] / 8.0 + smooth * plain[i], 1e-6 * plain[i]);
      ++num_medium;
    }
  }
  EXPECT_GT(num_high, 0);
  EXPECT_GT(num_low, 0);
  EXPECT_GT(num_medium, 0);
}

TEST(CpuKernels, SiluMulMatchesDefinition) {
  std::mt19937 rng(5);
  auto g = random_vec(50, &rng, 3.0f);
  auto u = random_vec(50, &rng);
  std::vector<float> out(50, kNaN);
  silu_mul(g.data(), u.data(), 50, out.data());
  std::vector<double> ref(50);
  for (int i = 0; i < 50; ++i) ref[i] = g[i] / (1.0 + std::exp(-static_cast<double>(g[i]))) * u[i];
  expect_close(out, ref, 1e-6);
}

TEST(CpuKernels, EmbeddingCopiesRows) {
  std::vector<float> table = {0, 1, 10, 11, 20, 21};
  std::vector<int32_t> ids = {2, 0, 2};
  std::vector<float> out(6, kNaN);
  embedding(table.data(), 2, ids, out.data());
  EXPECT_EQ(out, (std::vector<float>{20, 21, 0, 1, 20, 21}));
}

TEST(CpuKernels, KvCacheWriteLandsInItsBlockSlotAndNowhereElse) {
  PagedKvLayout layout{4, 2, 2, 3};  // 4 blocks of 2 tokens, 2 kv heads, head_dim 3
  std::vector<float> cache(static_cast<size_t>(layout.block_stride() * 4), -1.0f);
  std::vector<float> k = {1, 2, 3, 4, 5, 6}, v = {7, 8, 9, 10, 11, 12};
  const int64_t slot = 2 * 2 + 1;  // block 2, offset 1
  write_kv_cache(cache.data(), layout, k.data(), v.data(), 1, &slot);
  const int64_t k_at = 2 * layout.block_stride() + 1 * layout.token_stride();
  const int64_t v_at = k_at + layout.block_size * layout.token_stride();
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(cache[k_at + i], k[i]);
    EXPECT_EQ(cache[v_at + i], v[i]);
  }
  int64_t untouched = std::count(cache.begin(), cache.end(), -1.0f);
  EXPECT_EQ(untouched, static_cast<int64_t>(cache.size()) - 12);
}

// Contiguous causal GQA attention in double: the reference for the paged kernel.
std::vector<double> contiguous_attention(const std::vector<float>& q, const std::vector<float>& k,
                                         const std::vector<float>& v, int num_queries, int first_pos, int heads,
                                         int kv_heads, int d) {
  std::vector<double> out(static_cast<size_t>(num_queries) * heads * d, 0.0);
  const int group = heads / kv_heads;
  for (int r = 0; r < num_queries; ++r)
    for (int h = 0; h < heads; ++h) {
      const int kvh = h / group, n = first_pos + r + 1;
      std::vector<double> s(n);
      double mx = -1e300;
      for (int p = 0; p < n; ++p) {
        double dot = 0;
        for (int i = 0; i < d; ++i)
          dot += static_cast<double>(q[(r * heads + h) * d + i]) * k[(p * kv_heads + kvh) * d + i];
        s[p] = dot / std::sqrt(static_cast<double>(d));
        mx = std::max(mx, s[p]);
      }
      double den = 0;
      for (double& x : s) den += (x = std::exp(x - mx));
      for (int p = 0; p < n; ++p)
        for (int i = 0; i < d; ++i) out[(r * heads + h) * d + i] += s[p] / den * v[(p * kv_heads + kvh) * d + i];
    }
  return out;
}

TEST(CpuKernels, PagedAttentionWithShuffledBlockTableEqualsContiguousAttention) {
  std::mt19937 rng(6);
  const int heads = 4, kv_heads = 2, d = 16, block_size = 4, num_blocks = 12;
  const int seq_len = 29, num_queries = 5, first_pos = seq_len - num_queries;
  PagedKvLayout layout{num_blocks, block_size, kv_heads, d};
  std::vector<int32_t> table(num_blocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  table.resize((seq_len + block_size - 1) / block_size);

  auto k = random_vec(static_cast<size_t>(seq_len) * kv_heads * d, &rng);
  auto v = random_vec(k.size(), &rng);
  auto q = random_vec(static_cast<size_t>(num_queries) * heads * d, &rng);
  std::vector<float> cache(static_cast<size_t>(layout.block_stride() * num_blocks), kNaN);
  std::vector<int64_t> slots(seq_len);
  for (int p = 0; p < seq_len; ++p)
    slots[p] = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
  write_kv_cache(cache.data(), layout, k.data(), v.data(), seq_len, slots.data());

  std::vector<int32_t> positions(num_queries);
  std::iota(positions.begin(), positions.end(), first_pos);
  std::vector<float> out(q.size(), kNaN), scratch(seq_len);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  paged_attention(q.data(), num_queries, positions.data(), cache.data(), layout, table, heads, scale, out.data(),
                  scratch.data());
  expect_close(out, contiguous_attention(q, k, v, num_queries, first_pos, heads, kv_heads, d), 1e-5);
}

TEST(CpuKernels, Fp8ActivationsQuantisePerTokenPer128ColumnGroupWithAPartialLastGroup) {
  std::mt19937 rng(21);
  const int rows = 3, cols = 192;  // groups [0, 128) and [128, 192)
  auto x = random_vec(static_cast<size_t>(rows) * cols, &rng);
  for (int c = 128; c < cols; ++c) x[static_cast<size_t>(cols + c)] *= 100.0f;  // row 1, group 1: another scale
  for (int c = 0; c < 128; ++c) x[static_cast<size_t>(2 * cols + c)] = 0.0f;    // row 2, group 0: all zero
  std::vector<float> out(x.size(), kNaN);
  fp8_quantize_activations(x.data(), rows, cols, out.data());
  for (int r = 0; r < rows; ++r) {
    for (int g = 0; g < 2; ++g) {
      const int c0 = g * 128, c1 = std::min(cols, c0 + 128);
      float amax = 0.0f;
      for (int c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(x[static_cast<size_t>(r * cols + c)]));
      const float s = amax > 0.0f ? amax / 448.0f : 1.0f;
      for (int c = c0; c < c1; ++c) {
        const float v = x[static_cast<size_t>(r * cols + c)];
        EXPECT_EQ(out[static_cast<size_t>(r * cols + c)], model::fp8_e4m3_to_f32(model::f32_to_fp8_e4m3(v / s)) * s)
            << "row " << r << " col " << c;
      }
    }
  }
  // The largest magnitude of each group maps to 448 and comes back (448 * (amax / 448): within an ulp).
  const auto it = std::max_element(x.begin() + cols + 128, x.begin() + 2 * cols,
                                   [](float a, float b) { return std::fabs(a) < std::fabs(b); });
  EXPECT_FLOAT_EQ(out[static_cast<size_t>(it - x.begin())], *it);
  for (int c = 0; c < 128; ++c) EXPECT_EQ(out[static_cast<size_t>(2 * cols + c)], 0.0f);
}

TEST(CpuKernels, MoeRouteIsSoftmaxTopKAndOptionalRenormalisation) {
  const int rows = 2, experts = 6, top_k = 3;
  const std::vector<float> logits = {0.5f, 2.0f, -1.0f, 1.5f, 1.0f, 0.0f,   // top: 1, 3, 4
                                     3.0f, 3.0f, -2.0f, 0.0f, 2.5f, 1.0f};  // tie 0/1: lower id first; then 4
  for (bool norm : {false, true}) {
    std::vector<int32_t> ids(rows * top_k, -1);
    std::vector<float> weights(rows * top_k, kNaN);
    moe_route(logits.data(), rows, experts, top_k, norm, ids.data(), weights.data());
    EXPECT_EQ(ids, (std::vector<int32_t>{1, 3, 4, 0, 1, 4}));
    for (int r = 0; r < rows; ++r) {
      double denom = 0.0, top = 0.0;
      for (int e = 0; e < experts; ++e) denom += std::exp(static_cast<double>(logits[r * experts + e]));
      for (int i = 0; i < top_k; ++i) top += std::exp(static_cast<double>(logits[r * experts + ids[r * top_k + i]]));
      for (int i = 0; i < top_k; ++i) {
        const double p = std::exp(static_cast<double>(logits[r * experts + ids[r * top_k + i]])) / denom;
        EXPECT_NEAR(weights[r * top_k + i], norm ? p / (top / denom) : p, 1e-6) << "row " << r << " k " << i;
      }
    }
  }
}

TEST(CpuKernels, Fp8KvCacheStoresCodesThenPerTokenHeadScalesInsideTheBlock) {
  std::mt19937 rng(8);
  const int kv_heads = 2, d = 8, block_size = 4, num_blocks = 3;
  PagedKvLayout layout{num_blocks, block_size, kv_heads, d};
  EXPECT_EQ(layout.fp8_block_bytes(), 2 * block_size * kv_heads * (d + 4));
  std::vector<uint8_t> cache(static_cast<size_t>(layout.fp8_block_bytes() * num_blocks), 0xAB);
  auto k = random_vec(static_cast<size_t>(kv_heads) * d, &rng);
  auto v = random_vec(k.size(), &rng, 3.0f);
  const int64_t slot = 2 * block_size + 3;  // block 2, offset 3
  write_kv_cache_fp8(cache.data(), layout, k.data(), v.data(), 1, &slot);
  const uint8_t* block = cache.data() + 2 * layout.fp8_block_bytes();
  const int heads_per_block = block_size * kv_heads;
  for (int h = 0; h < kv_heads; ++h) {
    const int row = 3 * kv_heads + h;
    for (int tensor = 0; tensor < 2; ++tensor) {
      const float* src = (tensor == 0 ? k.data() : v.data()) + h * d;
      float amax = 0.0f;
      for (int i = 0; i < d; ++i) amax = std::max(amax, std::fabs(src[i]));
      float scale;
      std::memcpy(&scale, block + 2 * block_size * kv_heads * d + 4 * (tensor * heads_per_block + row), 4);
      EXPECT_EQ(scale, amax / 448.0f);
      const uint8_t* codes = block + tensor * block_size * kv_heads * d + row * d;
      for (int i = 0; i < d; ++i) EXPECT_EQ(codes[i], model::f32_to_fp8_e4m3(src[i] / scale)) << h << " " << i;
    }
  }
  // Nothing else changed: blocks 0 and 1 and the other slots of block 2 keep the poison.
  size_t written = 0;
  for (uint8_t b : cache) written += b != 0xAB;
  EXPECT_LE(written, static_cast<size_t>(2 * kv_heads * (d + 4)));
  for (int64_t i = 0; i < 2 * layout.fp8_block_bytes(); ++i) ASSERT_EQ(cache[static_cast<size_t>(i)], 0xAB) << i;
}

TEST(CpuKernels, Fp8PagedAttentionEqualsAttentionOverTheDequantisedValues) {
  std::mt19937 rng(9);
  const int heads = 4, kv_heads = 2, d = 16, block_size = 4, num_blocks = 12;
  const int seq_len = 29, num_queries = 5, first_pos = seq_len - num_queries;
  PagedKvLayout layout{num_blocks, block_size, kv_heads, d};
  std::vector<int32_t> table(num_blocks);
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);
  table.resize((seq_len + block_size - 1) / block_size);
  auto k = random_vec(static_cast<size_t>(seq_len) * kv_heads * d, &rng);
  auto v = random_vec(k.size(), &rng);
  for (int i = 0; i < d; ++i) k[static_cast<size_t>(5 * kv_heads * d + i)] = 0.0f;  // an all-zero key row
  auto q = random_vec(static_cast<size_t>(num_queries) * heads * d, &rng);
  std::vector<uint8_t> cache(static_cast<size_t>(layout.fp8_block_bytes() * num_blocks), 0xFF);  // 0xff = NaN codes
  std::vector<int64_t> slots(seq_len);
  for (int p = 0; p < seq_len; ++p)
    slots[p] = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
  write_kv_cache_fp8(cache.data(), layout, k.data(), v.data(), seq_len, slots.data());

  // The reference reads the values the cache denotes: each row quantised on its own.
  auto dequantised = [&](const std::vector<float>& x) {
    std::vector<float> out(x.size());
    for (size_t row = 0; row < x.size() / d; ++row) {
      std::vector<uint8_t> codes(d);
      float scale;
      quantize_kv_row(x.data() + row * d, d, codes.data(), &scale);
      for (int i = 0; i < d; ++i) out[row * d + i] = model::fp8_e4m3_to_f32(codes[static_cast<size_t>(i)]) * scale;
    }
    return out;
  };
  std::vector<int32_t> positions(num_queries);
  std::iota(positions.begin(), positions.end(), first_pos);
  std::vector<float> out(q.size(), kNaN), scratch(seq_len);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  paged_attention_fp8(q.data(), num_queries, positions.data(), cache.data(), layout, table, heads, scale, out.data(),
                      scratch.data());
  expect_close(out, contiguous_attention(q, dequantised(k), dequantised(v), num_queries, first_pos, heads, kv_heads, d),
               1e-5);
  // ...and differs from the unquantised attention by e4m3's precision only.
  expect_close(out, contiguous_attention(q, k, v, num_queries, first_pos, heads, kv_heads, d), 0.1);
}

}  // namespace
}  // namespace pd::kernels::cpu

namespace pd::kernels::cpu {
namespace {

// The ranks' partials are summed in rank order, whatever the caller: with
// (1e8, 1, -1e8) fp32 gives (1e8 + 1) - 1e8 = 0, any other order of the last
// two a different value; the answer must be the rank-order one every time.
TEST(SumRankPartials, AddsInRankOrder) {
  const std::vector<float> p0 = {1e8f, 2.0f}, p1 = {1.0f, 3.0f}, p2 = {-1e8f, 4.0f};
  const std::vector<const float*> parts = {p0.data(), p1.data(), p2.data()};
  std::vector<float> out(2, -7.0f);
  sum_rank_partials(parts, 2, out.data());
  EXPECT_EQ(out[0], (1e8f + 1.0f) + -1e8f);
  EXPECT_EQ(out[0], 0.0f);
  EXPECT_EQ(out[1], 9.0f);
  // In place on rank 0's buffer.
  std::vector<float> q0 = p0;
  const std::vector<const float*> in_place = {q0.data(), p1.data(), p2.data()};
  sum_rank_partials(in_place, 2, q0.data());
  EXPECT_EQ(q0, out);
}

}  // namespace
}  // namespace pd::kernels::cpu
