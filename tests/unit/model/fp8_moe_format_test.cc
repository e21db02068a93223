// The e4m3 conversion, the Qwen3-MoE and block-FP8 config rules (with a refusal per
// unsupported quantization setting), the FP8/MoE weight table, block quantisation,
// the FP8 checkpoint loader and seeded FP8 dummy weights.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/fp8.h"
#include "model/weights.h"

namespace pd::model {
namespace {

using nlohmann::json;

TEST(Fp8E4m3, EveryCodeRoundTripsThroughItsValue) {
  for (int code = 0; code < 256; ++code) {
    const float v = fp8_e4m3_to_f32(static_cast<uint8_t>(code));
    if ((code & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(v)) << code;
      EXPECT_EQ(f32_to_fp8_e4m3(v), code) << "NaN keeps its sign bit";
      continue;
    }
    EXPECT_EQ(f32_to_fp8_e4m3(v), code) << "code " << code << " value " << v;
  }
}

TEST(Fp8E4m3, DecodesTheFormatsLandmarks) {
  EXPECT_EQ(fp8_e4m3_to_f32(0x7e), 448.0f);  // largest finite
  EXPECT_EQ(fp8_e4m3_to_f32(0xfe), -448.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x08), 0x1.0p-6f);  // smallest normal
  EXPECT_EQ(fp8_e4m3_to_f32(0x01), 0x1.0p-9f);  // smallest subnormal
  EXPECT_EQ(fp8_e4m3_to_f32(0x07), 7 * 0x1.0p-9f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x39), 1.125f);
  EXPECT_TRUE(std::signbit(fp8_e4m3_to_f32(0x80)));
}

TEST(Fp8E4m3, MidpointsRoundToTheEvenCodeAndOthersToTheNearest) {
  // Every pair of neighbouring finite positive codes, including subnormal -> normal.
  for (int code = 0; code < 0x7e; ++code) {
    const float lo = fp8_e4m3_to_f32(static_cast<uint8_t>(code));
    const float hi = fp8_e4m3_to_f32(static_cast<uint8_t>(code + 1));
    const float mid = (lo + hi) / 2;  // exact in fp32
    const int even = (code % 2 == 0) ? code : code + 1;
    EXPECT_EQ(f32_to_fp8_e4m3(mid), even) << "tie between " << lo << " and " << hi;
    EXPECT_EQ(f32_to_fp8_e4m3(-mid), 0x80 | even);
    EXPECT_EQ(f32_to_fp8_e4m3(std::nextafter(mid, 0.0f)), code);
    EXPECT_EQ(f32_to_fp8_e4m3(std::nextafter(mid, 1e9f)), code + 1);
  }
  EXPECT_EQ(f32_to_fp8_e4m3(34.0f), 0x60);       // between 32 (0x60) and 36 (0x61): even wins
  EXPECT_EQ(f32_to_fp8_e4m3(0x1.0p-10f), 0x00);  // half the smallest subnormal: ties to 0
}

TEST(Fp8E4m3, SaturatesInsteadOfOverflowing) {
  EXPECT_EQ(f32_to_fp8_e4m3(448.0f), 0x7e);
  EXPECT_EQ(f32_to_fp8_e4m3(463.9f), 0x7e);
  EXPECT_EQ(f32_to_fp8_e4m3(500.0f), 0x7e);
  EXPECT_EQ(f32_to_fp8_e4m3(1e30f), 0x7e);
  EXPECT_EQ(f32_to_fp8_e4m3(INFINITY), 0x7e);
  EXPECT_EQ(f32_to_fp8_e4m3(-INFINITY), 0xfe);
  EXPECT_EQ(f32_to_fp8_e4m3(1e-30f), 0x00);
}

std::filesystem::path source_dir() {
  const char* src = std::getenv("PDSERVE_SOURCE_DIR");
  return std::filesystem::path(src != nullptr ? src : PDSERVE_TEST_SOURCE_DIR);
}

TEST(Qwen3MoeConfig, PublishedShapesParse) {
  const auto models = source_dir() / "tests" / "gpu" / "models";
  for (const char* name : {"qwen3-30b-a3b-shape", "qwen3-235b-a22b-shape", "qwen3-30b-a3b-fp8-shape",
                           "qwen3-235b-a22b-fp8-shape", "qwen3-8b-fp8-shape", "qwen3-32b-fp8-shape"}) {
    auto c = load_model_config(models / name);
    ASSERT_TRUE(c.ok()) << name << ": " << c.status().to_string();
    const bool moe = std::string(name).starts_with("qwen3-30b") || std::string(name).starts_with("qwen3-235b");
    EXPECT_EQ(c->family == ModelFamily::kQwen3Moe, moe) << name;
    EXPECT_EQ(c->quant.fp8(), std::string(name).find("fp8") != std::string::npos) << name;
    if (moe) {
      EXPECT_EQ(c->moe.num_experts, 128) << name;
      EXPECT_EQ(c->moe.num_experts_per_tok, 8) << name;
      EXPECT_TRUE(c->moe.norm_topk_prob) << name;
      EXPECT_TRUE(c->qk_norm) << name;
      for (int32_t l = 0; l < c->num_layers; ++l) EXPECT_TRUE(c->is_moe_layer(l)) << name << " layer " << l;
    }
  }
  auto a3b = load_model_config(models / "qwen3-30b-a3b-shape");
  ASSERT_TRUE(a3b.ok());
  EXPECT_EQ(a3b->moe.moe_intermediate_size, 768);
  EXPECT_EQ(a3b->num_layers, 48);
}

json tiny_moe() {
  return json{{"architectures", {"Qwen3MoeForCausalLM"}},
              {"vocab_size", 512},
              {"hidden_size", 64},
              {"intermediate_size", 128},
              {"num_hidden_layers", 4},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 2},
              {"head_dim", 32},
              {"max_position_embeddings", 256},
              {"hidden_act", "silu"},
              {"num_experts", 8},
              {"num_experts_per_tok", 2},
              {"moe_intermediate_size", 32},
              {"norm_topk_prob", true},
              {"decoder_sparse_step", 2},
              {"mlp_only_layers", {3}}};
}

TEST(Qwen3MoeConfig, SparseLayersFollowDecoderSparseStepAndMlpOnlyLayers) {
  auto c = parse_model_config(tiny_moe());
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  // (l + 1) % 2 == 0 -> layers 1 and 3; layer 3 is listed in mlp_only_layers.
  EXPECT_FALSE(c->is_moe_layer(0));
  EXPECT_TRUE(c->is_moe_layer(1));
  EXPECT_FALSE(c->is_moe_layer(2));
  EXPECT_FALSE(c->is_moe_layer(3));
}

TEST(Qwen3MoeConfig, Transformers5NumLocalExpertsIsRead) {
  json doc = tiny_moe();
  doc.erase("num_experts");
  doc["num_local_experts"] = 16;
  auto c = parse_model_config(doc);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->moe.num_experts, 16);
}

TEST(Qwen3MoeConfig, BadMoeFieldsAreRefusedNamingThem) {
  struct Case {
    const char* key;
    json value;
    const char* fragment;
  };
  for (const Case& k : {Case{"num_experts_per_tok", 9, "num_experts_per_tok 9 exceeds num_experts 8"},
                        Case{"decoder_sparse_step", 0, "decoder_sparse_step"},
                        Case{"mlp_only_layers", json::array({7}), "mlp_only_layers"},
                        Case{"moe_intermediate_size", 0, "moe_intermediate_size"}}) {
    json doc = tiny_moe();
    doc[k.key] = k.value;
    auto c = parse_model_config(doc);
    ASSERT_FALSE(c.ok()) << k.key;
    EXPECT_NE(c.status().message().find(k.fragment), std::string::npos) << c.status().message();
  }
}

json fp8_quant() {
  return json{
      {"quant_method", "fp8"}, {"fmt", "e4m3"}, {"weight_block_size", {128, 128}}, {"activation_scheme", "dynamic"}};
}

TEST(Fp8Config, BlockFp8E4m3DynamicIsAccepted) {
  json doc = tiny_moe();
  doc["quantization_config"] = fp8_quant();
  auto c = parse_model_config(doc);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_TRUE(c->quant.fp8());
  EXPECT_EQ(c->quant.block_out, 128);
  EXPECT_EQ(c->quant.block_in, 128);
}

TEST(Fp8Config, EveryOtherQuantizationSettingIsRefusedNamingIt) {
  struct Case {
    const char* key;
    json value;  // null: remove the key
    const char* fragment;
  };
  const std::vector<Case> cases = {
      {"quant_method", "gptq", "quant_method 'gptq'"},
      {"quant_method", "compressed-tensors", "quant_method 'compressed-tensors'"},
      {"fmt", "e5m2", "fmt 'e5m2'"},
      {"weight_block_size", json::array({64, 64}), "weight_block_size [64,64]"},
      {"weight_block_size", json::array({128, 64}), "weight_block_size [128,64]"},
      {"weight_block_size", nullptr, "weight_block_size is missing"},
      {"activation_scheme", "static", "activation_scheme 'static'"},
      {"modules_to_not_convert", json::array({"model.layers.0.mlp"}), "modules_to_not_convert"},
  };
  for (const Case& k : cases) {
    json doc = tiny_moe();
    doc["quantization_config"] = fp8_quant();
    if (k.value.is_null()) {
      doc["quantization_config"].erase(k.key);
    } else {
      doc["quantization_config"][k.key] = k.value;
    }
    auto c = parse_model_config(doc);
    ASSERT_FALSE(c.ok()) << k.key << " " << k.value.dump();
    EXPECT_EQ(c.status().code(), ErrorCode::kUnimplemented) << c.status().to_string();
    EXPECT_NE(c.status().message().find(k.fragment), std::string::npos) << c.status().message();
  }
}

ModelConfig tiny_moe_fp8_config() {
  json doc = tiny_moe();
  doc["hidden_size"] = 128;
  doc["num_attention_heads"] = 3;
  doc["num_key_value_heads"] = 1;
  doc["head_dim"] = 64;
  doc["moe_intermediate_size"] = 192;
  doc["quantization_config"] = fp8_quant();
  return *parse_model_config(doc);
}

const WeightSpec* find_spec(const std::vector<WeightSpec>& specs, const std::string& name) {
  for (const WeightSpec& s : specs)
    if (s.name == name) return &s;
  return nullptr;
}

TEST(Fp8MoeWeightSpecs, QuantisedLinearsCarryCeilBlockScalesAndTheRouterStaysUnquantised) {
  const ModelConfig c = tiny_moe_fp8_config();
  const auto specs = weight_specs(c);
  const WeightSpec* q = find_spec(specs, "model.layers.0.self_attn.q_proj.weight");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->dtype, WeightDtype::kF8E4M3);
  EXPECT_EQ(q->shape, (std::vector<int64_t>{192, 128}));
  const WeightSpec* qs = find_spec(specs, "model.layers.0.self_attn.q_proj.weight_scale_inv");
  ASSERT_NE(qs, nullptr);
  EXPECT_EQ(qs->shape, (std::vector<int64_t>{2, 1}));  // ceil(192/128), ceil(128/128)
  EXPECT_EQ(qs->dtype, WeightDtype::kF32);
  const WeightSpec* down = find_spec(specs, "model.layers.1.mlp.experts.7.down_proj.weight_scale_inv");
  ASSERT_NE(down, nullptr);
  EXPECT_EQ(down->shape, (std::vector<int64_t>{1, 2}));  // [128, 192]
  const WeightSpec* router = find_spec(specs, "model.layers.1.mlp.gate.weight");
  ASSERT_NE(router, nullptr);
  EXPECT_EQ(router->dtype, WeightDtype::kF32);
  EXPECT_EQ(router->shape, (std::vector<int64_t>{8, 128}));
  EXPECT_EQ(find_spec(specs, "model.layers.1.mlp.gate.weight_scale_inv"), nullptr);
  // Dense layers (0, 2, 3) have the plain MLP and no router.
  EXPECT_NE(find_spec(specs, "model.layers.3.mlp.down_proj.weight_scale_inv"), nullptr);
  EXPECT_EQ(find_spec(specs, "model.layers.3.mlp.gate.weight"), nullptr);
  for (const char* unquantised : {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                                  "model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_norm.weight"}) {
    const WeightSpec* s = find_spec(specs, unquantised);
    ASSERT_NE(s, nullptr) << unquantised;
    EXPECT_EQ(s->dtype, WeightDtype::kF32) << unquantised;
  }
}

TEST(Fp8Blocks, QuantiseUsesAmaxOver448PerBlockIncludingPartialBlocks) {
  const int64_t rows = 130, cols = 200;  // blocks: 2 x 2, the last ones partial
  std::vector<float> w(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows * cols; ++i) w[static_cast<size_t>(i)] = std::sin(0.37f * static_cast<float>(i));
  w[static_cast<size_t>(129 * cols + 199)] = 3.5f;  // the largest value of block (1, 1)
  for (int64_t r = 0; r < 128; ++r)                 // block (0, 0) all zero
    for (int64_t c = 0; c < 128; ++c) w[static_cast<size_t>(r * cols + c)] = 0.0f;
  std::vector<uint8_t> codes(w.size());
  std::vector<float> scales(4), back(w.size());
  quantize_fp8_blocks(w.data(), rows, cols, codes.data(), scales.data());
  EXPECT_EQ(scales[0], 1.0f) << "an all-zero block keeps scale 1";
  EXPECT_EQ(scales[3], 3.5f / 448.0f);
  dequantize_fp8_blocks(codes.data(), scales.data(), rows, cols, back.data());
  EXPECT_EQ(back[static_cast<size_t>(129 * cols + 199)], 3.5f) << "the block's amax maps to 448 exactly";
  for (size_t i = 0; i < w.size(); ++i) {
    const float scale = scales[static_cast<size_t>((static_cast<int64_t>(i) / cols / 128) * 2 +
                                                   (static_cast<int64_t>(i) % cols) / 128)];
    EXPECT_EQ(codes[i], f32_to_fp8_e4m3(w[i] / scale)) << i;
    EXPECT_LE(std::fabs(back[i] - w[i]), std::fabs(w[i]) / 16 + scale * 0x1.0p-10f) << i;
  }
}

TEST(Fp8DummyWeights, AreSeededFp8CodesWithBlockScales) {
  const ModelConfig c = tiny_moe_fp8_config();
  ModelWeights a = dummy_weights(c, 5), b = dummy_weights(c, 5), other = dummy_weights(c, 6);
  const std::string name = "model.layers.1.mlp.experts.3.up_proj.weight";
  const Tensor* w = a.find(name);
  const Tensor* s = a.find(name + "_scale_inv");
  ASSERT_NE(w, nullptr);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(w->dtype, WeightDtype::kF8E4M3);
  EXPECT_EQ(w->fp8.size(), 192u * 128u);
  EXPECT_TRUE(w->data.empty());
  EXPECT_EQ(s->shape, (std::vector<int64_t>{2, 1}));
  EXPECT_EQ(w->fp8, b.find(name)->fp8);
  EXPECT_EQ(s->data, b.find(name + "_scale_inv")->data);
  EXPECT_NE(w->fp8, other.find(name)->fp8);
  // Each block's largest code is +-448: the scale is that block's amax / 448.
  for (int64_t br = 0; br < 2; ++br) {
    int max_code = 0;
    for (int64_t r = br * 128; r < std::min<int64_t>(192, br * 128 + 128); ++r)
      for (int64_t col = 0; col < 128; ++col)
        max_code = std::max(max_code, w->fp8[static_cast<size_t>(r * 128 + col)] & 0x7f);
    EXPECT_EQ(max_code, 0x7e) << "block " << br;
  }
  EXPECT_EQ(a.num_tensors(), weight_specs(c).size());
  EXPECT_EQ(a.find("model.layers.1.mlp.gate.weight")->dtype, WeightDtype::kF32);
}

class Fp8CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("pd_fp8_ckpt_" + std::to_string(::getpid()) + "_" +
                                                     ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Writes every tensor of `c` from `w` in its checkpoint dtype (F8_E4M3 codes, F32
  // otherwise); `override_dtype` rewrites one tensor's dtype tag (same byte size).
  void write_checkpoint(const ModelConfig& c, const ModelWeights& w, const std::string& override_name = "",
                        const std::string& override_dtype = "", float scale_value = -1.0f) {
    json header = json::object();
    std::vector<uint8_t> data;
    for (const WeightSpec& s : weight_specs(c)) {
      const Tensor* t = w.find(s.name);
      const size_t begin = data.size();
      std::string dtype;
      if (t->dtype == WeightDtype::kF8E4M3) {
        data.insert(data.end(), t->fp8.begin(), t->fp8.end());
        dtype = "F8_E4M3";
      } else if (s.name == override_name && override_dtype == "F8_E4M3") {
        data.resize(data.size() + t->data.size());  // one zero code per element
      } else {
        std::vector<float> values = t->data;
        if (s.name == override_name && scale_value >= 0.0f) values[0] = NAN;
        const auto* p = reinterpret_cast<const uint8_t*>(values.data());
        data.insert(data.end(), p, p + values.size() * 4);
        dtype = "F32";
      }
      if (s.name == override_name && !override_dtype.empty()) dtype = override_dtype;
      header[s.name] = {{"dtype", dtype}, {"shape", s.shape}, {"data_offsets", {begin, data.size()}}};
    }
    const std::string h = header.dump();
    std::ofstream out(dir_ / "model.safetensors", std::ios::binary);
    const uint64_t len = h.size();
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>((len >> (8 * i)) & 0xff));
    out.write(h.data(), static_cast<std::streamsize>(h.size()));
    out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
  }

  std::filesystem::path dir_;
};

TEST_F(Fp8CheckpointTest, LoadsCodesAndScalesAsWritten) {
  const ModelConfig c = tiny_moe_fp8_config();
  const ModelWeights w = dummy_weights(c, 11);
  write_checkpoint(c, w);
  auto loaded = load_safetensors_weights(c, dir_);
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  const std::string name = "model.layers.0.self_attn.o_proj.weight";
  EXPECT_EQ(loaded->find(name)->fp8, w.find(name)->fp8);
  EXPECT_EQ(loaded->find(name + "_scale_inv")->data, w.find(name + "_scale_inv")->data);
}

TEST_F(Fp8CheckpointTest, Bf16WhereTheConfigNeedsFp8IsRefusedNamingTheTensor) {
  const ModelConfig c = tiny_moe_fp8_config();
  const ModelWeights w = dummy_weights(c, 11);
  // 128 x 128 bytes read as U8 / I8: right size, wrong dtype.
  write_checkpoint(c, w, "model.layers.0.self_attn.k_proj.weight", "U8");
  auto loaded = load_safetensors_weights(c, dir_);
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find("'model.layers.0.self_attn.k_proj.weight' has dtype U8"), std::string::npos)
      << loaded.status().message();
}

TEST_F(Fp8CheckpointTest, E5m2WeightsAreRefusedNamingTheDtype) {
  const ModelConfig c = tiny_moe_fp8_config();
  write_checkpoint(c, dummy_weights(c, 11), "model.layers.1.mlp.experts.0.gate_proj.weight", "F8_E5M2");
  auto loaded = load_safetensors_weights(c, dir_);
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find("F8_E5M2"), std::string::npos) << loaded.status().message();
  EXPECT_NE(loaded.status().message().find("experts.0.gate_proj"), std::string::npos) << loaded.status().message();
}

TEST_F(Fp8CheckpointTest, Fp8TensorForAnUnquantisedWeightIsRefused) {
  const ModelConfig c = tiny_moe_fp8_config();
  write_checkpoint(c, dummy_weights(c, 11), "model.layers.1.mlp.gate.weight", "F8_E4M3");
  auto loaded = load_safetensors_weights(c, dir_);
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find("'model.layers.1.mlp.gate.weight' has dtype F8_E4M3"), std::string::npos)
      << loaded.status().message();
}

TEST_F(Fp8CheckpointTest, NonFiniteScaleIsRefusedNamingTheTensor) {
  const ModelConfig c = tiny_moe_fp8_config();
  write_checkpoint(c, dummy_weights(c, 11), "model.layers.0.self_attn.v_proj.weight_scale_inv", "", 0.0f);
  auto loaded = load_safetensors_weights(c, dir_);
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find("v_proj.weight_scale_inv"), std::string::npos) << loaded.status().message();
}

}  // namespace
}  // namespace pd::model
