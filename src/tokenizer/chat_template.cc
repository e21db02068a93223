#include "tokenizer/chat_template.h"

#include <fstream>
#include <sstream>

#include "tokenizer/jinja.h"

namespace pd::tokenizer {
namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

std::string special_token_text(const ojson& field) {
  if (field.is_string()) return field.get<std::string>();
  if (field.is_object() && field.contains("content") && field["content"].is_string()) {
    return field["content"].get<std::string>();
  }
  return {};
}

ChatTemplate::~ChatTemplate() = default;

Result<std::unique_ptr<ChatTemplate>> ChatTemplate::create(std::string source, std::string bos_token,
                                                           std::string eos_token) {
  PD_ASSIGN_OR_RETURN(auto parsed, jinja::Template::parse(source));
  std::unique_ptr<ChatTemplate> t(new ChatTemplate());
  t->source_ = std::move(source);
  t->bos_token_ = std::move(bos_token);
  t->eos_token_ = std::move(eos_token);
  t->template_ = std::move(parsed);
  return t;
}

Result<std::unique_ptr<ChatTemplate>> ChatTemplate::load(const fs::path& dir) {
  auto read = [](const fs::path& path) -> Result<std::string> {
    std::ifstream in(path, std::ios::binary);
    if (!in) return not_found("cannot open {}", path.string());
    std::ostringstream buffer;
    buffer << in.rdbuf();
    return buffer.str();
  };
  ojson config = ojson::object();
  std::error_code ec;
  if (fs::exists(dir / "tokenizer_config.json", ec)) {
    PD_ASSIGN_OR_RETURN(std::string text, read(dir / "tokenizer_config.json"));
    config = ojson::parse(text, nullptr, false);
    if (config.is_discarded() || !config.is_object()) {
      return data_loss("{}: tokenizer_config.json is not a JSON object", dir.string());
    }
  }
  std::string source;
  std::string origin;
  if (fs::exists(dir / "chat_template.jinja", ec)) {
    PD_ASSIGN_OR_RETURN(source, read(dir / "chat_template.jinja"));
    origin = "chat_template.jinja";
  } else if (config.contains("chat_template")) {
    const ojson& field = config["chat_template"];
    if (field.is_string()) {
      source = field.get<std::string>();
    } else if (field.is_array()) {
      for (const auto& named : field) {
        if (named.is_object() && named.value("name", "") == "default" && named.contains("template") &&
            named["template"].is_string()) {
          source = named["template"].get<std::string>();
        }
      }
    }
    origin = "tokenizer_config.json chat_template";
  }
  if (source.empty()) return std::unique_ptr<ChatTemplate>();
  auto created = create(std::move(source), special_token_text(config.value("bos_token", ojson())),
                        special_token_text(config.value("eos_token", ojson())));
  if (!created.ok()) return created.status().with_context(fmt::format("{}: {}", dir.string(), origin));
  return created;
}

Result<std::string> ChatTemplate::apply(const ojson& messages, bool add_generation_prompt, const ojson& tools,
                                        const ojson& extra) const {
  if (!messages.is_array()) return invalid_argument("messages must be an array, got {}", messages.type_name());
  if (!tools.is_null() && !tools.is_array()) return invalid_argument("tools must be an array or null");
  if (!extra.is_null() && !extra.is_object()) return invalid_argument("extra template variables must be an object");
  ojson aliased = ojson::array();
  for (const auto& message : messages) {
    if (!message.is_object()) return invalid_argument("each message must be an object, got {}", message.type_name());
    const ojson* reasoning = nullptr;
    for (const char* key : {"reasoning_content", "thinking", "reasoning"}) {
      auto it = message.find(key);
      if (it != message.end() && !it->is_null()) {
        reasoning = &*it;
        break;
      }
    }
    if (reasoning == nullptr) {
      aliased.push_back(message);
      continue;
    }
    // {"thinking": r, **message, "reasoning_content": r} keeps Python's key order.
    ojson m = ojson::object();
    m["thinking"] = *reasoning;
    for (const auto& [k, v] : message.items()) m[k] = v;
    m["reasoning_content"] = *reasoning;
    aliased.push_back(std::move(m));
  }
  ojson context = ojson::object();
  // A special token the model does not define is absent (undefined), as in transformers.
  if (!bos_token_.empty()) context["bos_token"] = bos_token_;
  if (!eos_token_.empty()) context["eos_token"] = eos_token_;
  if (extra.is_object()) {
    for (const auto& [k, v] : extra.items()) context[k] = v;
  }
  context["messages"] = std::move(aliased);
  context["tools"] = tools;
  context["documents"] = nullptr;
  context["add_generation_prompt"] = add_generation_prompt;
  return template_->render(context);
}

}  // namespace pd::tokenizer
