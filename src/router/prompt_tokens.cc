#include "router/prompt_tokens.h"

#include <limits>

#include "router/request_rewrite.h"

namespace pd::router {

namespace {

using ojson = nlohmann::ordered_json;

std::optional<std::vector<int32_t>> token_ids_of(const ojson& prompt) {
  if (!prompt.is_array() || prompt.empty() || prompt.size() > kMaxPromptTokens) return std::nullopt;
  std::vector<int32_t> ids;
  ids.reserve(prompt.size());
  for (const ojson& item : prompt) {
    if (!item.is_number_integer()) return std::nullopt;
    const int64_t id = item.get<int64_t>();
    if (id < 0 || id > std::numeric_limits<int32_t>::max()) return std::nullopt;
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

void copy_if_present(const ojson& from, ojson& to, const char* key) {
  if (auto it = from.find(key); it != from.end()) to[key] = *it;
}

}  // namespace

PromptTokensPlan plan_prompt_tokens(bool chat, const ojson& body) {
  PromptTokensPlan plan;
  if (!body.is_object()) return plan;
  if (auto it = body.find("truncate_prompt_tokens"); it != body.end() && it->is_number_integer()) {
    const int64_t k = it->get<int64_t>();
    if (k >= 1 && k <= std::numeric_limits<int32_t>::max()) plan.keep_last = static_cast<int32_t>(k);
  }
  ojson tokenize = ojson::object();
  copy_if_present(body, tokenize, "model");
  if (chat) {
    auto messages = body.find("messages");
    if (messages == body.end()) return plan;
    tokenize["messages"] = *messages;
    for (const char* key : {"add_special_tokens", "add_generation_prompt", "tools", "chat_template_kwargs"}) {
      copy_if_present(body, tokenize, key);
    }
  } else {
    auto prompt = body.find("prompt");
    if (prompt == body.end()) return plan;
    const ojson* text = nullptr;
    if (prompt->is_string()) {
      text = &*prompt;
    } else if (prompt->is_array() && prompt->size() == 1 && (*prompt)[0].is_string()) {
      text = &(*prompt)[0];
    } else if (prompt->is_array() && prompt->size() == 1 && (*prompt)[0].is_array()) {
      plan.token_ids = token_ids_of((*prompt)[0]);
      return plan;
    } else {
      plan.token_ids = token_ids_of(*prompt);
      return plan;
    }
    tokenize["prompt"] = *text;
    copy_if_present(body, tokenize, "add_special_tokens");
  }
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
