#include "router/prompt_tokens.h"

#include <limits>

#include "router/request_rewrite.h"

namespace pd::router {

namespace {

using ojson = nlohmann::ordered_json;

std::optional<int32_t> keep_last_of(const server::GenerationFields& fields) {
  if (fields.truncate_prompt_tokens && *fields.truncate_prompt_tokens >= 1) return fields.truncate_prompt_tokens;
  return std::nullopt;
}

}  // namespace

PromptTokensPlan plan_prompt_tokens(const server::CompletionRequest& request) {
  PromptTokensPlan plan;
  if (request.prompts.size() != 1) return plan;
  plan.keep_last = keep_last_of(request.fields);
  const server::PromptInput& prompt = request.prompts.front();
  if (!prompt.text) {
    plan.token_ids = prompt.token_ids;
    return plan;
  }
  ojson tokenize = ojson::object();
  if (!request.fields.model.empty()) tokenize["model"] = request.fields.model;
  tokenize["prompt"] = *prompt.text;
  tokenize["add_special_tokens"] = request.add_special_tokens;
  plan.tokenize_body = tokenize.dump();
  return plan;
}

PromptTokensPlan plan_prompt_tokens(const server::ChatRequest& request) {
  PromptTokensPlan plan;
  plan.keep_last = keep_last_of(request.fields);
  ojson tokenize = ojson::object();
  if (!request.fields.model.empty()) tokenize["model"] = request.fields.model;
  tokenize["messages"] = request.messages;
  tokenize["add_special_tokens"] = request.add_special_tokens;
  tokenize["add_generation_prompt"] = request.add_generation_prompt;
  if (!request.tools.is_null()) tokenize["tools"] = request.tools;
  if (!request.chat_template_kwargs.empty()) tokenize["chat_template_kwargs"] = request.chat_template_kwargs;
  plan.tokenize_body = tokenize.dump();
  return plan;
}

Result<std::vector<int32_t>> parse_tokenize_answer(std::string_view body) {
  Result<ojson> parsed = parse_json_bounded(body, kMaxJsonDepth);
  if (!parsed.ok()) return parsed.status();
  auto tokens = parsed->find("tokens");
  if (!parsed->is_object() || tokens == parsed->end() || !tokens->is_array()) {
    return invalid_argument("tokenize answer has no 'tokens' array");
  }
  if (tokens->size() > kMaxPromptTokens) {
    return invalid_argument("tokenize answer has {} tokens, max {}", tokens->size(), kMaxPromptTokens);
  }
  std::vector<int32_t> ids;
  ids.reserve(tokens->size());
  for (const ojson& item : *tokens) {
    if (!item.is_number_integer() || item.get<int64_t>() < 0 ||
        item.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return invalid_argument("tokenize answer holds a token that is not an id");
    }
    ids.push_back(static_cast<int32_t>(item.get<int64_t>()));
  }
  return ids;
}

void truncate_prompt(std::vector<int32_t>& ids, std::optional<int32_t> keep_last) {
  if (keep_last && static_cast<size_t>(*keep_last) < ids.size()) {
    ids.erase(ids.begin(), ids.end() - *keep_last);
  }
}

}  // namespace pd::router
