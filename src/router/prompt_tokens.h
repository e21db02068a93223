// The token ids of a request's prompt, as the engine will see them, for
// prefix-aware placement (README.md "Per-request decisions"). Pure.
//
// The router has no tokenizer: a prompt given as token ids is used as is, and a
// text or chat prompt is sent to an engine's POST /tokenize with exactly the
// fields that shape its tokens (prompt / messages, add_special_tokens,
// add_generation_prompt, tools, chat_template_kwargs) as pdserve's own parser read
// them, so the ids are the engine's own, chat template included.
// truncate_prompt_tokens is applied after.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "server/openai_protocol.h"

namespace pd::router {

// Bound on the ids the router reads from a /tokenize answer (2^20: beyond any model's context today).
inline constexpr size_t kMaxPromptTokens = 1u << 20;
// Bound on a /tokenize answer's bytes: kMaxPromptTokens ids of up to 10 digits and a separator, and room
// for the rest of the object. A longer answer is not read (the request is planned without its tokens).
inline constexpr uint64_t kMaxTokenizeAnswerBytes = 16u << 20;

struct PromptTokensPlan {
  std::optional<std::vector<int32_t>> token_ids;  // the prompt was token ids
  std::optional<std::string> tokenize_body;       // else: POST /tokenize with this body
  std::optional<int32_t> keep_last;               // truncate_prompt_tokens as parsed (-1: the context length)
};

// From the request as pdserve's parser read it (request_validation.h parses each body once): for a
// single prompt or a chat; nothing for a batch.
PromptTokensPlan plan_prompt_tokens(const server::CompletionRequest& request);
PromptTokensPlan plan_prompt_tokens(const server::ChatRequest& request);

// The "tokens" of a /tokenize answer: integers in [0, 2^31), at most kMaxPromptTokens.
Result<std::vector<int32_t>> parse_tokenize_answer(std::string_view body);

// keep_last: the last k ids are kept (truncate_prompt_tokens).
void truncate_prompt(std::vector<int32_t>& ids, std::optional<int32_t> keep_last);

}  // namespace pd::router
