// A model's chat template: the parsed Jinja source plus the special-token strings it may print.
#pragma once

#include <nlohmann/json.hpp>

#include <filesystem>
#include <memory>
#include <string>

#include "common/status.h"

namespace pd::tokenizer {

namespace jinja {
class Template;
}

class ChatTemplate {
 public:
  // Parses source; kUnimplemented / kInvalidArgument name the construct and its line:column.
  static Result<std::unique_ptr<ChatTemplate>> create(std::string source, std::string bos_token, std::string eos_token);
  // The template of a model folder: chat_template.jinja if present (it wins, as in transformers),
  // else tokenizer_config.json's chat_template (a string, or the "default" of a named list).
  // Returns nullptr when the folder has none.
  static Result<std::unique_ptr<ChatTemplate>> load(const std::filesystem::path& dir);
  ~ChatTemplate();

  // Renders as transformers' apply_chat_template(tokenize=False) does: variables are the special
  // tokens, the extra kwargs, then messages, tools, documents=None, add_generation_prompt. Messages
  // carrying reasoning under "reasoning_content", "thinking" or "reasoning" get it under the first
  // two as well (transformers' aliasing, so each template finds the name it reads).
  Result<std::string> apply(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                            const nlohmann::ordered_json& tools, const nlohmann::ordered_json& extra) const;

  const std::string& source() const { return source_; }

 private:
  ChatTemplate() = default;
  std::string source_;
  std::string bos_token_;
  std::string eos_token_;
  std::shared_ptr<const jinja::Template> template_;
};

// Reads a config field that is a token string or an AddedToken object {"content": ...}.
std::string special_token_text(const nlohmann::ordered_json& field);

}  // namespace pd::tokenizer
