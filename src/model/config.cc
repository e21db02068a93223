#include "model/config.h"

#include <algorithm>
#include <fstream>

#include "model/fp8.h"

namespace pd::model {
namespace {

using nlohmann::json;

Result<int32_t> get_int(const json& doc, const char* key, std::optional<int32_t> fallback = std::nullopt) {
  auto it = doc.find(key);
  if (it == doc.end() || it->is_null()) {
    if (fallback) return *fallback;
    return invalid_argument("config.json: missing required field '{}'", key);
  }
  if (!it->is_number_integer())
    return invalid_argument("config.json: field '{}' must be an integer, got {}", key, it->dump());
  int64_t value = it->get<int64_t>();
  if (value < 0 || value > INT32_MAX) return invalid_argument("config.json: field '{}' out of range: {}", key, value);
  return static_cast<int32_t>(value);
}

Result<double> get_double(const json& doc, const char* key, double fallback) {
  auto it = doc.find(key);
  if (it == doc.end() || it->is_null()) return fallback;
  if (!it->is_number()) return invalid_argument("config.json: field '{}' must be a number, got {}", key, it->dump());
  return it->get<double>();
}

Result<bool> get_bool(const json& doc, const char* key, bool fallback) {
  auto it = doc.find(key);
  if (it == doc.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) return invalid_argument("config.json: field '{}' must be a boolean, got {}", key, it->dump());
  return it->get<bool>();
}

// eos_token_id is an int or a list of ints in HF files.
Status append_eos_ids(const json& doc, const char* file, std::vector<int32_t>* out) {
  auto it = doc.find("eos_token_id");
  if (it == doc.end() || it->is_null()) return Status::Ok();
  auto add = [&](const json& v) -> Status {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX)
      return invalid_argument("{}: eos_token_id must be a non-negative integer, got {}", file, v.dump());
    int32_t id = static_cast<int32_t>(v.get<int64_t>());
    if (std::find(out->begin(), out->end(), id) == out->end()) out->push_back(id);
    return Status::Ok();
  };
  if (it->is_array()) {
    for (const json& v : *it) PD_RETURN_IF_ERROR(add(v));
    return Status::Ok();
  }
  return add(*it);
}

Status parse_rope(const json& doc, ModelConfig* config) {
  // transformers >= 5 folds rope_theta into rope_parameters; older files keep
  // rope_theta at the top level and rope_scaling (possibly null) beside it.
  const json* params = nullptr;
  if (auto it = doc.find("rope_parameters"); it != doc.end() && it->is_object()) params = &*it;
  if (auto it = doc.find("rope_scaling"); params == nullptr && it != doc.end() && it->is_object()) params = &*it;
  PD_ASSIGN_OR_RETURN(config->rope_theta, get_double(doc, "rope_theta", 10000.0));
  if (params == nullptr) return Status::Ok();
  PD_ASSIGN_OR_RETURN(config->rope_theta, get_double(*params, "rope_theta", config->rope_theta));
  std::string type = "default";
  if (auto it = params->find("rope_type"); it != params->end() && it->is_string()) {
    type = it->get<std::string>();
  } else if (auto old = params->find("type"); old != params->end() && old->is_string()) {
    type = old->get<std::string>();
  }
  if (type == "default") return Status::Ok();
  if (type != "llama3") return unimplemented("config.json: rope type '{}' is not supported (default, llama3)", type);
  RopeScaling& s = config->rope_scaling;
  s.type = RopeScalingType::kLlama3;
  PD_ASSIGN_OR_RETURN(s.factor, get_double(*params, "factor", 8.0));
  PD_ASSIGN_OR_RETURN(s.low_freq_factor, get_double(*params, "low_freq_factor", 1.0));
  PD_ASSIGN_OR_RETURN(s.high_freq_factor, get_double(*params, "high_freq_factor", 4.0));
  PD_ASSIGN_OR_RETURN(s.original_max_position_embeddings, get_int(*params, "original_max_position_embeddings", 8192));
  if (!(s.factor > 0) || !(s.low_freq_factor > 0) || !(s.high_freq_factor > s.low_freq_factor) ||
      s.original_max_position_embeddings <= 0) {
    return invalid_argument("config.json: bad llama3 rope scaling (factor {}, low {}, high {}, original max {})",
                            s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings);
  }
  return Status::Ok();
}

Status parse_moe(const json& doc, ModelConfig* config) {
  MoeConfig& m = config->moe;
  // Published configs say num_experts; transformers >= 5 writes num_local_experts.
  if (doc.contains("num_experts") || !doc.contains("num_local_experts")) {
    PD_ASSIGN_OR_RETURN(m.num_experts, get_int(doc, "num_experts"));
  } else {
    PD_ASSIGN_OR_RETURN(m.num_experts, get_int(doc, "num_local_experts"));
  }
  PD_ASSIGN_OR_RETURN(m.num_experts_per_tok, get_int(doc, "num_experts_per_tok"));
  PD_ASSIGN_OR_RETURN(m.moe_intermediate_size, get_int(doc, "moe_intermediate_size"));
  PD_ASSIGN_OR_RETURN(m.norm_topk_prob, get_bool(doc, "norm_topk_prob", false));
  PD_ASSIGN_OR_RETURN(m.decoder_sparse_step, get_int(doc, "decoder_sparse_step", 1));
  if (auto it = doc.find("mlp_only_layers"); it != doc.end() && !it->is_null()) {
    if (!it->is_array()) return invalid_argument("config.json: mlp_only_layers must be a list, got {}", it->dump());
    for (const json& v : *it) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= config->num_layers)
        return invalid_argument("config.json: mlp_only_layers entry {} is not a layer index in [0, {})", v.dump(),
                                config->num_layers);
      m.mlp_only_layers.push_back(static_cast<int32_t>(v.get<int64_t>()));
    }
  }
  return Status::Ok();
}

// quantization_config: only the block-FP8 scheme of the "-FP8" releases.
Status parse_quantization(const json& doc, ModelConfig* config) {
  auto it = doc.find("quantization_config");
  if (it == doc.end() || it->is_null()) return Status::Ok();
  const json& q = *it;
  if (!q.is_object()) return invalid_argument("config.json: quantization_config must be an object");
  auto str_field = [&](const char* key, const char* fallback) -> Result<std::string> {
    auto f = q.find(key);
    if (f == q.end() || f->is_null()) {
      if (fallback != nullptr) return std::string(fallback);
      return invalid_argument("config.json: quantization_config.{} is missing", key);
    }
    if (!f->is_string())
      return invalid_argument("config.json: quantization_config.{} must be a string, got {}", key, f->dump());
    return f->get<std::string>();
  };
  PD_ASSIGN_OR_RETURN(std::string method, str_field("quant_method", nullptr));
  if (method != "fp8")
    return unimplemented("config.json: quantization_config.quant_method '{}' is not supported (fp8)", method);
  PD_ASSIGN_OR_RETURN(std::string fmt, str_field("fmt", "e4m3"));
  if (fmt != "e4m3") return unimplemented("config.json: quantization_config.fmt '{}' is not supported (e4m3)", fmt);
  PD_ASSIGN_OR_RETURN(std::string scheme, str_field("activation_scheme", "dynamic"));
  if (scheme != "dynamic")
    return unimplemented("config.json: quantization_config.activation_scheme '{}' is not supported (dynamic)", scheme);
  auto block = q.find("weight_block_size");
  if (block == q.end() || block->is_null())
    return unimplemented(
        "config.json: quantization_config.weight_block_size is missing; only block-wise FP8 [128, 128] is "
        "supported (per-tensor FP8 is not)");
  if (!block->is_array() || block->size() != 2 || !(*block)[0].is_number_integer() ||
      !(*block)[1].is_number_integer() || (*block)[0].get<int64_t>() != kFp8BlockSize ||
      (*block)[1].get<int64_t>() != kFp8BlockSize)
    return unimplemented("config.json: quantization_config.weight_block_size {} is not supported ([128, 128])",
                         block->dump());
  for (const char* key : {"modules_to_not_convert", "ignored_layers"}) {
    auto skip = q.find(key);
    if (skip != q.end() && !skip->is_null() && !(skip->is_array() && skip->empty()))
      return unimplemented(
          "config.json: quantization_config.{} {} is not supported (the quantised set is fixed: attention and MLP "
          "linears)",
          key, skip->dump());
  }
  config->quant.method = QuantMethod::kFp8Block;
  config->quant.block_out = kFp8BlockSize;
  config->quant.block_in = kFp8BlockSize;
  return Status::Ok();
}

Result<json> read_json_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) return not_found("cannot open {}", path.string());
  json doc = json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return invalid_argument("{}: not valid JSON", path.string());
  if (!doc.is_object()) return invalid_argument("{}: top level must be an object", path.string());
  return doc;
}

}  // namespace

const char* model_family_name(ModelFamily family) {
  switch (family) {
    case ModelFamily::kLlama:
      return "llama";
    case ModelFamily::kQwen2:
      return "qwen2";
    case ModelFamily::kQwen3:
      return "qwen3";
    case ModelFamily::kQwen3Moe:
      return "qwen3_moe";
  }
  return "unknown";
}

bool ModelConfig::is_moe_layer(int32_t layer) const {
  if (moe.num_experts <= 0 || moe.decoder_sparse_step <= 0) return false;
  if (std::find(moe.mlp_only_layers.begin(), moe.mlp_only_layers.end(), layer) != moe.mlp_only_layers.end())
    return false;
  return (layer + 1) % moe.decoder_sparse_step == 0;
}

Status ModelConfig::validate() const {
  auto positive = [](const char* name, int64_t v) -> Status {
    if (v <= 0) return invalid_argument("model config: {} must be > 0, got {}", name, v);
    return Status::Ok();
  };
  PD_RETURN_IF_ERROR(positive("vocab_size", vocab_size));
  PD_RETURN_IF_ERROR(positive("hidden_size", hidden_size));
  PD_RETURN_IF_ERROR(positive("intermediate_size", intermediate_size));
  PD_RETURN_IF_ERROR(positive("num_hidden_layers", num_layers));
  PD_RETURN_IF_ERROR(positive("num_attention_heads", num_heads));
  PD_RETURN_IF_ERROR(positive("num_key_value_heads", num_kv_heads));
  PD_RETURN_IF_ERROR(positive("head_dim", head_dim));
  PD_RETURN_IF_ERROR(positive("max_position_embeddings", max_position_embeddings));
  if (num_heads % num_kv_heads != 0)
    return invalid_argument("model config: num_attention_heads {} is not a multiple of num_key_value_heads {}",
                            num_heads, num_kv_heads);
  if (head_dim % 2 != 0) return invalid_argument("model config: head_dim must be even for RoPE, got {}", head_dim);
  if (!(rms_norm_eps > 0)) return invalid_argument("model config: rms_norm_eps must be > 0, got {}", rms_norm_eps);
  if (!(rope_theta > 0)) return invalid_argument("model config: rope_theta must be > 0, got {}", rope_theta);
  if (family == ModelFamily::kQwen3Moe) {
    PD_RETURN_IF_ERROR(positive("num_experts", moe.num_experts));
    PD_RETURN_IF_ERROR(positive("num_experts_per_tok", moe.num_experts_per_tok));
    PD_RETURN_IF_ERROR(positive("moe_intermediate_size", moe.moe_intermediate_size));
    PD_RETURN_IF_ERROR(positive("decoder_sparse_step", moe.decoder_sparse_step));
    if (moe.num_experts_per_tok > moe.num_experts)
      return invalid_argument("model config: num_experts_per_tok {} exceeds num_experts {}", moe.num_experts_per_tok,
                              moe.num_experts);
    if (moe.num_experts > 4096) return invalid_argument("model config: num_experts {} exceeds 4096", moe.num_experts);
    for (int32_t l : moe.mlp_only_layers)
      if (l < 0 || l >= num_layers)
        return invalid_argument("model config: mlp_only_layers entry {} is outside [0, {})", l, num_layers);
  } else if (moe.num_experts != 0) {
    return invalid_argument("model config: num_experts is set for the dense family {}", model_family_name(family));
  }
  if (quant.fp8() && (quant.block_out != kFp8BlockSize || quant.block_in != kFp8BlockSize))
    return invalid_argument("model config: FP8 block size must be [128, 128], got [{}, {}]", quant.block_out,
                            quant.block_in);
  // Guards the products below (weights are held in memory as fp32).
  constexpr int64_t kMaxDim = 1 << 20;
  for (int64_t d : {int64_t{vocab_size}, int64_t{hidden_size}, int64_t{intermediate_size}, int64_t{q_size()},
                    int64_t{moe.moe_intermediate_size}}) {
    if (d > kMaxDim) return invalid_argument("model config: dimension {} exceeds {}", d, kMaxDim);
  }
  return Status::Ok();
}

Result<ModelConfig> parse_model_config(const json& doc) {
  if (!doc.is_object()) return invalid_argument("config.json: top level must be an object");
  ModelConfig c;
  auto arch = doc.find("architectures");
  if (arch == doc.end() || !arch->is_array() || arch->empty() || !(*arch)[0].is_string())
    return invalid_argument("config.json: 'architectures' must be a non-empty list of strings");
  c.architecture = (*arch)[0].get<std::string>();
  if (c.architecture == "LlamaForCausalLM") {
    c.family = ModelFamily::kLlama;
  } else if (c.architecture == "Qwen2ForCausalLM") {
    c.family = ModelFamily::kQwen2;
  } else if (c.architecture == "Qwen3ForCausalLM") {
    c.family = ModelFamily::kQwen3;
  } else if (c.architecture == "Qwen3MoeForCausalLM") {
    c.family = ModelFamily::kQwen3Moe;
  } else {
    return unimplemented(
        "config.json: architecture '{}' is not supported (LlamaForCausalLM, Qwen2ForCausalLM, "
        "Qwen3ForCausalLM, Qwen3MoeForCausalLM)",
        c.architecture);
  }
  PD_ASSIGN_OR_RETURN(c.vocab_size, get_int(doc, "vocab_size"));
  PD_ASSIGN_OR_RETURN(c.hidden_size, get_int(doc, "hidden_size"));
  PD_ASSIGN_OR_RETURN(c.intermediate_size, get_int(doc, "intermediate_size"));
  PD_ASSIGN_OR_RETURN(c.num_layers, get_int(doc, "num_hidden_layers"));
  PD_ASSIGN_OR_RETURN(c.num_heads, get_int(doc, "num_attention_heads"));
  PD_ASSIGN_OR_RETURN(c.num_kv_heads, get_int(doc, "num_key_value_heads", c.num_heads));
  if (c.num_heads <= 0) return invalid_argument("config.json: num_attention_heads must be > 0");
  PD_ASSIGN_OR_RETURN(c.head_dim, get_int(doc, "head_dim", c.hidden_size / c.num_heads));
  PD_ASSIGN_OR_RETURN(c.max_position_embeddings, get_int(doc, "max_position_embeddings", 2048));
  PD_ASSIGN_OR_RETURN(double eps, get_double(doc, "rms_norm_eps", 1e-6));
  c.rms_norm_eps = static_cast<float>(eps);
  PD_ASSIGN_OR_RETURN(c.tie_word_embeddings, get_bool(doc, "tie_word_embeddings", false));
  PD_ASSIGN_OR_RETURN(bool attention_bias, get_bool(doc, "attention_bias", false));
  PD_ASSIGN_OR_RETURN(bool mlp_bias, get_bool(doc, "mlp_bias", false));
  if (mlp_bias) return unimplemented("config.json: mlp_bias=true is not supported");
  if (auto act = doc.find("hidden_act"); act != doc.end() && !(act->is_string() && act->get<std::string>() == "silu"))
    return unimplemented("config.json: hidden_act {} is not supported (silu)", act->dump());
  if (auto sw = doc.find("use_sliding_window"); sw != doc.end() && sw->is_boolean() && sw->get<bool>())
    return unimplemented("config.json: use_sliding_window=true is not supported");
  switch (c.family) {
    case ModelFamily::kLlama:
      c.qkv_bias = attention_bias;
      c.o_bias = attention_bias;
      break;
    case ModelFamily::kQwen2:  // Qwen2Attention: q/k/v always carry a bias, o_proj never
      c.qkv_bias = true;
      c.o_bias = false;
      break;
    case ModelFamily::kQwen3:
    case ModelFamily::kQwen3Moe:
      c.qkv_bias = attention_bias;
      c.o_bias = attention_bias;
      c.qk_norm = true;
      break;
  }
  if (c.family == ModelFamily::kQwen3Moe) PD_RETURN_IF_ERROR(parse_moe(doc, &c));
  PD_RETURN_IF_ERROR(parse_quantization(doc, &c));
  PD_RETURN_IF_ERROR(parse_rope(doc, &c));
  PD_RETURN_IF_ERROR(append_eos_ids(doc, "config.json", &c.eos_token_ids));
  PD_RETURN_IF_ERROR(c.validate());
  return c;
}

Result<ModelConfig> load_model_config(const std::filesystem::path& model_dir) {
  PD_ASSIGN_OR_RETURN(json doc, read_json_file(model_dir / "config.json"));
  auto config = parse_model_config(doc);
  if (!config.ok()) return config.status().with_context(model_dir.string());
  std::filesystem::path gen = model_dir / "generation_config.json";
  std::error_code ec;
  if (std::filesystem::exists(gen, ec)) {
    PD_ASSIGN_OR_RETURN(json gen_doc, read_json_file(gen));
    PD_RETURN_IF_ERROR(append_eos_ids(gen_doc, "generation_config.json", &config->eos_token_ids));
  }
  return config;
}

ModelConfig builtin_tiny_config() {
  ModelConfig c;
  c.architecture = "Qwen3ForCausalLM";
  c.family = ModelFamily::kQwen3;
  c.vocab_size = 151936;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 32;
  c.rms_norm_eps = 1e-6f;
  c.rope_theta = 1e6;
  c.max_position_embeddings = 40960;
  c.tie_word_embeddings = true;
  c.qk_norm = true;
  c.eos_token_ids = {151645, 151643};  // <|im_end|>, <|endoftext|>
  return c;
}

}  // namespace pd::model
