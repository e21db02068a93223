#include "model/config.h"

#include <fstream>

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
  }
  return "unknown";
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
  // Guards the products below (weights are held in memory as fp32).
  constexpr int64_t kMaxDim = 1 << 20;
  for (int64_t d : {int64_t{vocab_size}, int64_t{hidden_size}, int64_t{intermediate_size}, int64_t{q_size()}}) {
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
  } else {
    return unimplemented(
        "config.json: architecture '{}' is not supported (LlamaForCausalLM, Qwen2ForCausalLM, "
        "Qwen3ForCausalLM)",
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
      c.qkv_bias = attention_bias;
      c.o_bias = attention_bias;
      c.qk_norm = true;
      break;
  }
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
