// The token ids of a request's prompt, as the engine will see them, for
// prefix-aware placement (README.md "Per-request decisions"). Pure.
//
// The router has no tokenizer: a prompt given as token ids is used as is, and a
// text or chat prompt is sent to an engine's POST /tokenize with exactly the
// fields that shape its tokens (prompt / messages, add_special_tokens,
// add_generation_prompt, tools, chat_template_kwargs), so the ids are the
// engine's own, chat template included. truncate_prompt_tokens is applied after.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace pd::router {

// Bound on the ids the router reads from a /tokenize answer.
inline constexpr size_t kMaxPromptTokens = 1u << 22;

struct PromptTokensPlan {
  std::optional<std::vector<int32_t>> token_ids;  // the prompt was token ids
  std::optional<std::string> tokenize_body;       // else: POST /tokenize with this body
  std::optional<int32_t> keep_last;               // truncate_prompt_tokens >= 1 (-1: nothing to cut here)
};

// For one prompt (a single completion prompt or a chat); nothing for a batch or a body
// the engine would refuse (it has been validated already, so that is not expected).
PromptTokensPlan plan_prompt_tokens(bool chat, const nlohmann::ordered_json& body);

// The "tokens" of a /tokenize answer: integers in [0, 2^31), at most kMaxPromptTokens.
Result<std::vector<int32_t>> parse_tokenize_answer(std::string_view body);

// keep_last: the last k ids are kept (truncate_prompt_tokens).
void truncate_prompt(std::vector<int32_t>& ids, std::optional<int32_t> keep_last);

}  // namespace pd::router
