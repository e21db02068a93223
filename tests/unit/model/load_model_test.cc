// load_model(): builtin:tiny, HF directories, and option errors; plus runner
// behaviour that is not parity (hooks order, input validation).
#include "engine/runner/load_model.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "engine/runner/cpu_model_runner.h"

namespace pd::engine {
namespace {

std::filesystem::path source_dir() {
  const char* src = std::getenv("PDSERVE_SOURCE_DIR");
  return src != nullptr ? src : PDSERVE_TEST_SOURCE_DIR;
}

StepInput prefill(const std::vector<int32_t>& prompt, int32_t block_size) {
  StepInput in;
  in.token_ids = prompt;
  SeqStep s;
  s.num_new_tokens = static_cast<int32_t>(prompt.size());
  for (int32_t b = 0; b * block_size < s.num_new_tokens + 16; ++b) s.block_table.push_back(b);
  s.sample = true;
  s.sampling.temperature = 0.0f;
  in.seqs.push_back(s);
  return in;
}

// Greedy continuation of `prompt` for n tokens through execute().
std::vector<int32_t> greedy(ModelRunner* runner, std::vector<int32_t> prompt, int n) {
  const int32_t bs = runner->kv_cache_spec().block_size;
  StepInput in = prefill(prompt, bs);
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    auto r = runner->execute(in);
    EXPECT_TRUE(r.ok()) << r.status().to_string();
    if (!r.ok()) return out;
    out.push_back(r->sampled[0].token_id);
    SeqStep& s = in.seqs[0];
    s.num_computed_tokens += s.num_new_tokens;
    s.num_new_tokens = 1;
    in.token_ids = {out.back()};
  }
  return out;
}

// builtin:tiny with default options, loaded once: dummy weights for a
// 151936-token vocabulary take a while under ASan.
class BuiltinTiny : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto m = load_model({});
    ASSERT_TRUE(m.ok()) << m.status().to_string();
    model_ = new LoadedModel(std::move(*m));
  }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }
  static LoadedModel* model_;
};
LoadedModel* BuiltinTiny::model_ = nullptr;

TEST_F(BuiltinTiny, IsAQwen3ShapedModelWithQwen3EosIdsAnd256MiBOfKvBlocks) {
  LoadedModel* m = model_;
  EXPECT_EQ(m->architecture, "Qwen3ForCausalLM");
  EXPECT_EQ(m->runner->vocab_size(), 151936);
  EXPECT_EQ(m->max_model_len, 4096);
  EXPECT_EQ(m->eos_token_ids, (std::vector<int32_t>{151645, 151643}));
  const KvCacheSpec& spec = m->runner->kv_cache_spec();
  EXPECT_EQ(static_cast<int64_t>(spec.bytes_per_layer()) * spec.num_layers, kDefaultCpuKvCacheBytes);
  EXPECT_EQ(spec.num_blocks, 16384);
  EXPECT_EQ(spec.num_layers, 2);
  EXPECT_EQ(spec.num_kv_heads, 2);
  EXPECT_EQ(spec.head_dim, 32);
  EXPECT_FALSE(m->runner->kv_on_device());
  EXPECT_NE(m->runner->kv_layer_base(1), nullptr);
  EXPECT_EQ(m->runner->kv_layer_base(2), nullptr);
}

TEST_F(BuiltinTiny, GreedyOutputDependsOnThePromptAndIsReproducible) {
  LoadedModel* m = model_;
  auto a = greedy(m->runner.get(), {9707, 11, 1879, 0}, 6);
  auto b = greedy(m->runner.get(), {785, 6722, 315, 9625, 374}, 6);
  auto a2 = greedy(m->runner.get(), {9707, 11, 1879, 0}, 6);
  EXPECT_NE(a, b);
  EXPECT_EQ(a, a2);
}

TEST_F(BuiltinTiny, GreedyOutputIsNotOneRepeatedToken) {
  auto out = greedy(model_->runner.get(), {9707, 11, 1879, 0}, 8);
  std::sort(out.begin(), out.end());
  EXPECT_GE(std::unique(out.begin(), out.end()) - out.begin(), 3);
}

TEST_F(BuiltinTiny, DummySeedChangesTheWeights) {
  ModelLoadOptions opts;
  opts.num_kv_blocks = 16;
  opts.seed = 1;
  auto m1 = load_model(opts);
  ASSERT_TRUE(m1.ok());
  LoadedModel* m0 = model_;
  auto* r0 = dynamic_cast<CpuModelRunner*>(m0->runner.get());
  auto* r1 = dynamic_cast<CpuModelRunner*>(m1->runner.get());
  ASSERT_TRUE(r0 && r1);
  auto l0 = r0->forward(prefill({1, 2, 3}, 16), CpuModelRunner::LogitsRows::kSampled);
  auto l1 = r1->forward(prefill({1, 2, 3}, 16), CpuModelRunner::LogitsRows::kSampled);
  ASSERT_TRUE(l0.ok() && l1.ok());
  EXPECT_NE(*l0, *l1);
}

TEST(LoadModel, AssetsDirFromEnvironmentGivesTheTokenizerDir) {
  const auto dir = std::filesystem::temp_directory_path() / ("pd_assets_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir / "tokenizers" / "qwen3");
  std::ofstream(dir / "tokenizers" / "qwen3" / "tokenizer.json") << "{}";
  ::setenv("PDSERVE_ASSETS_DIR", dir.c_str(), 1);
  ModelLoadOptions opts;
  opts.num_kv_blocks = 4;
  auto m = load_model(opts);
  ::unsetenv("PDSERVE_ASSETS_DIR");
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->tokenizer_dir, dir / "tokenizers" / "qwen3");
}

TEST(LoadModel, HfDirectoryLoadsWithEosFromConfigAndGenerationConfig) {
  ModelLoadOptions opts;
  opts.model = (source_dir() / "tests" / "data" / "golden" / "qwen3").string();
  opts.num_kv_blocks = 8;
  auto m = load_model(opts);
  ASSERT_TRUE(m.ok()) << m.status().to_string();
  EXPECT_EQ(m->architecture, "Qwen3ForCausalLM");
  EXPECT_EQ(m->max_model_len, 256);  // min(max_position_embeddings 256, 4096)
  EXPECT_EQ(m->eos_token_ids, (std::vector<int32_t>{2}));
  EXPECT_EQ(m->tokenizer_dir, std::filesystem::path());
}

TEST(LoadModel, BadOptionsAreRefusedWithTheirName) {
  ModelLoadOptions opts;
  opts.load_format = "pt";
  EXPECT_NE(load_model(opts).status().message().find("load_format"), std::string::npos);
  opts = {};
  opts.device = "tpu";
  EXPECT_NE(load_model(opts).status().message().find("tpu"), std::string::npos);
  opts = {};
  opts.model = "/nonexistent/model";
  EXPECT_EQ(load_model(opts).status().code(), ErrorCode::kNotFound);
  opts = {};
  opts.model = (source_dir() / "tests" / "data" / "golden" / "llama").string();
  opts.max_model_len = 100000;
  EXPECT_NE(load_model(opts).status().message().find("max_position_embeddings"), std::string::npos);
  opts = {};
  opts.kv_cache_bytes = 100;
  EXPECT_NE(load_model(opts).status().message().find("kv_cache_bytes"), std::string::npos);
}

class RecordingHooks : public LayerKvHooks {
 public:
  void wait_for_layer_load(int32_t layer) override { calls.push_back("wait" + std::to_string(layer)); }
  void save_layer(int32_t layer) override { calls.push_back("save" + std::to_string(layer)); }
  std::vector<std::string> calls;
};

TEST_F(BuiltinTiny, RunnerCallsLayerHooksInLayerOrderWaitBeforeSave) {
  LoadedModel* m = model_;
  RecordingHooks hooks;
  StepInput in = prefill({1, 2, 3}, 16);
  in.layer_hooks = &hooks;
  ASSERT_TRUE(m->runner->execute(in).ok());
  EXPECT_EQ(hooks.calls, (std::vector<std::string>{"wait0", "save0", "wait1", "save1"}));
}

TEST_F(BuiltinTiny, RunnerRejectsMalformedStepInputsNamingTheProblem) {
  ModelRunner* r = model_->runner.get();
  StepInput bad_token = prefill({1, 151936}, 16);
  EXPECT_NE(r->execute(bad_token).status().message().find("token_ids[1]"), std::string::npos);
  StepInput short_table = prefill({1, 2}, 16);
  short_table.seqs[0].block_table.clear();
  EXPECT_NE(r->execute(short_table).status().message().find("block table"), std::string::npos);
  StepInput bad_block = prefill({1, 2}, 16);
  bad_block.seqs[0].block_table = {16384};
  EXPECT_NE(r->execute(bad_block).status().message().find("block_table[0] = 16384"), std::string::npos);
  StepInput too_long = prefill({1}, 16);
  too_long.seqs[0].num_computed_tokens = 4096;
  too_long.seqs[0].block_table.resize(257, 0);
  EXPECT_NE(r->execute(too_long).status().message().find("max_model_len"), std::string::npos);
  StepInput overrun = prefill({1, 2}, 16);
  overrun.seqs[0].num_new_tokens = 3;
  EXPECT_NE(r->execute(overrun).status().message().find("run past"), std::string::npos);
}

}  // namespace
}  // namespace pd::engine
