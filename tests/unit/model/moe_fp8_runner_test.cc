// The CPU runner with the fp8 KV cache (--kv-cache-dtype fp8) and with MoE / FP8
// models loaded through load_model (safetensors and seeded dummy weights). Logits
// parity of the MoE / FP8 formats with transformers is golden_parity_test.cc.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "engine/runner/cpu_model_runner.h"
#include "engine/runner/load_model.h"
#include "runner_test_util.h"

namespace pd::engine {
namespace {

using runner_test::golden_dir;

TEST(KvCacheDtype, Fp8BlocksHoldCodesPlusOneScalePerTokenAndHead) {
  KvCacheSpec spec;
  spec.num_layers = 1;
  spec.num_kv_heads = 8;
  spec.head_dim = 128;
  spec.block_size = 16;
  spec.dtype = KvDtype::kBFloat16;
  const size_t bf16 = spec.bytes_per_block();
  spec.dtype = KvDtype::kFp8E4m3;
  EXPECT_EQ(spec.bytes_per_block(), 2u * 16 * 8 * (128 + 4));  // 132 bytes per head-token vs 256
  EXPECT_GE(static_cast<double>(bf16) / static_cast<double>(spec.bytes_per_block()), 1.9);
  EXPECT_STREQ(kv_dtype_name(KvDtype::kFp8E4m3), "fp8_e4m3");
}

TEST(KvCacheDtype, LoadModelSizesTheFp8PoolFromTheSameBytes) {
  ModelLoadOptions opts;
  opts.model = golden_dir("qwen3_moe").string();
  opts.kv_cache_bytes = 4 << 20;
  auto f32 = load_model(opts);
  ASSERT_TRUE(f32.ok()) << f32.status().to_string();
  opts.kv_cache_dtype = "fp8";
  auto fp8 = load_model(opts);
  ASSERT_TRUE(fp8.ok()) << fp8.status().to_string();
  const KvCacheSpec& a = f32->runner->kv_cache_spec();
  const KvCacheSpec& b = fp8->runner->kv_cache_spec();
  EXPECT_EQ(a.dtype, KvDtype::kFloat32);
  EXPECT_EQ(b.dtype, KvDtype::kFp8E4m3);
  // head_dim 32: 4 * 32 = 128 bytes per head-token in fp32, 32 + 4 = 36 in fp8.
  EXPECT_EQ(b.bytes_per_block(), 2u * b.block_size * b.num_kv_heads * 36);
  EXPECT_EQ(b.num_blocks, (4 << 20) / static_cast<int64_t>(b.bytes_per_block() * b.num_layers));
  EXPECT_GT(b.num_blocks, 3 * a.num_blocks);
}

TEST(KvCacheDtype, UnknownDtypeIsRefusedNamingIt) {
  ModelLoadOptions opts;
  opts.model = golden_dir("qwen3_moe").string();
  opts.kv_cache_dtype = "fp8_e5m2";
  auto m = load_model(opts);
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("kv_cache_dtype"), std::string::npos) << m.status().message();
  EXPECT_NE(m.status().message().find("fp8_e5m2"), std::string::npos) << m.status().message();
}

struct Golden {
  std::vector<int32_t> prompt, greedy;
  int32_t vocab = 0;
  std::vector<float> prompt_logits;
};

Golden read_golden(const std::string& family) {
  Golden g;
  std::ifstream in(golden_dir(family) / "golden.json");
  const nlohmann::json meta = nlohmann::json::parse(in);
  g.prompt = meta["prompt_token_ids"].get<std::vector<int32_t>>();
  g.greedy = meta["greedy_token_ids"].get<std::vector<int32_t>>();
  g.vocab = meta["vocab_size"].get<int32_t>();
  g.prompt_logits.resize(g.prompt.size() * static_cast<size_t>(g.vocab));
  std::ifstream f(golden_dir(family) / "prompt_logits.f32", std::ios::binary);
  f.read(reinterpret_cast<char*>(g.prompt_logits.data()), static_cast<std::streamsize>(g.prompt_logits.size() * 4));
  EXPECT_TRUE(f.good());
  return g;
}

// The prompt in chunks (so later chunks read earlier positions from the fp8 cache):
// logits stay near transformers' (fp32 KV) logits, but are not identical to them
// (the cache really holds fp8). e4m3 keeps 3 mantissa bits, and this toy model
// (head_dim 32, q/k-normed heads with sharp softmaxes) moves its logits by about
// 10% under that; the exact check of the fp8 read path is the kernel test
// (Fp8PagedAttentionEqualsAttentionOverTheDequantisedValues).
TEST(Fp8KvCache, MoeLogitsStayCloseToTheFloatReferenceWhenReadBackFromFp8Blocks) {
  const Golden g = read_golden("qwen3_moe");
  ModelLoadOptions opts;
  opts.model = golden_dir("qwen3_moe").string();
  opts.kv_cache_dtype = "fp8";
  opts.block_size = 4;
  opts.num_kv_blocks = 32;
  auto m = load_model(opts);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  auto* runner = dynamic_cast<CpuModelRunner*>(m->runner.get());
  ASSERT_NE(runner, nullptr);
  int32_t done = 0;
  double max_rel = 0.0;
  for (int32_t chunk : {6, 9, 6}) {
    StepInput in;
    in.token_ids.assign(g.prompt.begin() + done, g.prompt.begin() + done + chunk);
    SeqStep s;
    s.num_new_tokens = chunk;
    s.num_computed_tokens = done;
    for (int32_t b = 0; b * 4 < done + chunk; ++b) s.block_table.push_back((b * 7 + 3) % 32);
    in.seqs.push_back(s);
    auto logits = runner->forward(in, CpuModelRunner::LogitsRows::kAll);
    ASSERT_TRUE(logits.ok()) << logits.status().to_string();
    for (int32_t r = 0; r < chunk; ++r) {
      const float* ours = logits->data() + static_cast<size_t>(r) * g.vocab;
      const float* ref = g.prompt_logits.data() + static_cast<size_t>(done + r) * g.vocab;
      double d2 = 0.0, r2 = 0.0;
      for (int32_t i = 0; i < g.vocab; ++i) {
        d2 += (static_cast<double>(ours[i]) - ref[i]) * (static_cast<double>(ours[i]) - ref[i]);
        r2 += static_cast<double>(ref[i]) * ref[i];
      }
      const double rel = std::sqrt(d2 / r2);
      EXPECT_LT(rel, 0.25) << "position " << done + r;
      max_rel = std::max(max_rel, rel);
    }
    done += chunk;
  }
  EXPECT_GT(max_rel, 1e-5) << "fp8 KV gave the fp32 result: the cache is not quantised";
  std::printf("qwen3_moe with fp8 KV: max relative row error %.3g\n", max_rel);
}

// --load-format dummy for an FP8 MoE config: seeded FP8 weights with scales, so two
// instances with the same seed agree token for token.
TEST(Fp8MoeDummy, SameSeedSameGreedyTokensOtherSeedOtherTokens) {
  auto run = [](uint64_t seed) {
    ModelLoadOptions opts;
    opts.model = golden_dir("qwen3_moe_fp8").string();
    opts.load_format = "dummy";
    opts.seed = seed;
    opts.num_kv_blocks = 16;
    opts.kv_cache_dtype = "fp8";
    auto m = load_model(opts);
    EXPECT_TRUE(m.ok()) << m.status().to_string();
    std::vector<int32_t> out;
    if (!m.ok()) return out;
    StepInput in;
    in.token_ids = {5, 17, 300, 42, 7, 99, 123};
    SeqStep s;
    s.num_new_tokens = static_cast<int32_t>(in.token_ids.size());
    s.block_table = {0, 1};
    s.sample = true;
    s.sampling.temperature = 0.0f;
    in.seqs.push_back(s);
    for (int i = 0; i < 6; ++i) {
      auto r = m->runner->execute(in);
      EXPECT_TRUE(r.ok()) << r.status().to_string();
      if (!r.ok()) return out;
      out.push_back(r->sampled[0].token_id);
      in.seqs[0].num_computed_tokens += in.seqs[0].num_new_tokens;
      in.seqs[0].num_new_tokens = 1;
      in.token_ids = {out.back()};
    }
    return out;
  };
  const auto a = run(3), b = run(3), c = run(4);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

}  // namespace
}  // namespace pd::engine
