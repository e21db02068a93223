// HF config.json parsing for the three supported families.
#include "model/config.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace pd::model {
namespace {

using nlohmann::json;

json base(const std::string& arch) {
  return json{{"architectures", {arch}},  {"vocab_size", 512},      {"hidden_size", 64},
              {"intermediate_size", 128}, {"num_hidden_layers", 2}, {"num_attention_heads", 4},
              {"num_key_value_heads", 2}, {"rms_norm_eps", 1e-5},   {"max_position_embeddings", 1024},
              {"hidden_act", "silu"}};
}

TEST(ModelConfig, LlamaWithLegacyRopeScalingIsLlama3Scaled) {
  json doc = base("LlamaForCausalLM");
  doc["rope_theta"] = 500000.0;
  doc["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", 8.0},
                         {"low_freq_factor", 1.0},
                         {"high_freq_factor", 4.0},
                         {"original_max_position_embeddings", 8192}};
  doc["eos_token_id"] = {128001, 128009};
  auto c = parse_model_config(doc);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->family, ModelFamily::kLlama);
  EXPECT_EQ(c->head_dim, 16);
  EXPECT_DOUBLE_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kLlama3);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_FALSE(c->qkv_bias);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_EQ(c->eos_token_ids, (std::vector<int32_t>{128001, 128009}));
  EXPECT_FLOAT_EQ(c->rms_norm_eps, 1e-5f);
}

TEST(ModelConfig, Transformers5RopeParametersAreRead) {
  json doc = base("Qwen3ForCausalLM");
  doc["head_dim"] = 32;
  doc["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1000000.0}};
  doc["tie_word_embeddings"] = true;
  auto c = parse_model_config(doc);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->family, ModelFamily::kQwen3);
  EXPECT_EQ(c->head_dim, 32);
  EXPECT_TRUE(c->qk_norm);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_DOUBLE_EQ(c->rope_theta, 1e6);
  EXPECT_EQ(c->rope_scaling.type, RopeScalingType::kNone);
}

TEST(ModelConfig, Qwen2AlwaysHasQkvBiasButNoOutputBias) {
  auto c = parse_model_config(base("Qwen2ForCausalLM"));
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_TRUE(c->qkv_bias);
  EXPECT_FALSE(c->o_bias);
  EXPECT_FALSE(c->qk_norm);
}

TEST(ModelConfig, LlamaAttentionBiasAddsAllFourBiases) {
  json doc = base("LlamaForCausalLM");
  doc["attention_bias"] = true;
  auto c = parse_model_config(doc);
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->qkv_bias);
  EXPECT_TRUE(c->o_bias);
}

TEST(ModelConfig, UnsupportedArchitectureIsNamed) {
  auto c = parse_model_config(base("MistralForCausalLM"));
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("MistralForCausalLM"), std::string::npos);
}

TEST(ModelConfig, UnsupportedRopeTypeIsRefused) {
  json doc = base("LlamaForCausalLM");
  doc["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}};
  auto c = parse_model_config(doc);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("yarn"), std::string::npos);
}

TEST(ModelConfig, HeadsNotDivisibleByKvHeadsAreRefused) {
  json doc = base("LlamaForCausalLM");
  doc["num_key_value_heads"] = 3;
  auto c = parse_model_config(doc);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("num_key_value_heads"), std::string::npos);
}

TEST(ModelConfig, MissingFieldIsNamed) {
  json doc = base("LlamaForCausalLM");
  doc.erase("hidden_size");
  auto c = parse_model_config(doc);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("hidden_size"), std::string::npos);
}

TEST(ModelConfig, WrongTypeIsNamed) {
  json doc = base("LlamaForCausalLM");
  doc["vocab_size"] = "big";
  auto c = parse_model_config(doc);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("vocab_size"), std::string::npos);
}

TEST(ModelConfig, BuiltinTinyIsQwen3ShapedWithTheQwen3Vocabulary) {
  ModelConfig c = builtin_tiny_config();
  EXPECT_TRUE(c.validate().ok());
  EXPECT_EQ(c.architecture, "Qwen3ForCausalLM");
  EXPECT_GE(c.vocab_size, 151669);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int32_t>{151645, 151643}));
}

}  // namespace
}  // namespace pd::model
