// Byte-level BPE tokenizer (GPT-2 / Qwen2 / Qwen3 families) with HF-identical encoding, and the
// model's chat template. Immutable after load(): every method is const and safe to call from
// any number of threads at once.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/status.h"

namespace pd::tokenizer {

class BpeModel;
class ChatTemplate;
class PreTokenizer;

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false;
  bool lstrip = false;  // absorbs whitespace to its left
  bool rstrip = false;  // absorbs whitespace to its right
};

class Tokenizer {
 public:
  // dir holds tokenizer.json, or vocab.json + merges.txt; plus tokenizer_config.json (added tokens,
  // bos/eos, chat_template; a separate chat_template.jinja next to it is also honoured and wins).
  // A chat template with a construct the interpreter does not support fails the load (kUnimplemented,
  // naming the construct and its line:column).
  static Result<std::shared_ptr<Tokenizer>> load(const std::filesystem::path& dir);

  // Invalid UTF-8 in text is first replaced (each maximal invalid subpart -> U+FFFD, as Python's
  // bytes.decode(errors="replace") does), then encoded; so the ids equal HF's on that replaced text.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = true) const;
  // Concatenates the tokens' bytes and replaces invalid UTF-8 with U+FFFD (HF's ByteLevel decoder).
  // Unknown ids are skipped.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = true) const;

  int32_t vocab_size() const { return vocab_size_; }  // including added tokens (max id + 1)
  std::optional<int32_t> token_to_id(std::string_view token) const;
  std::optional<std::string> id_to_token(int32_t id) const;
  std::optional<int32_t> bos_token_id() const { return bos_id_; }
  std::optional<int32_t> eos_token_id() const { return eos_id_; }
  const std::string& bos_token() const { return bos_token_; }  // "" when none
  const std::string& eos_token() const { return eos_token_; }  // "" when none
  bool is_special(int32_t id) const;
  const std::vector<AddedToken>& added_tokens() const { return added_tokens_; }

  // Raw bytes of one token as decode() would emit them (empty for unknown ids). The view lives as
  // long as the Tokenizer.
  std::string_view token_bytes(int32_t id) const;

  bool has_chat_template() const { return chat_template_ != nullptr; }
  const ChatTemplate* chat_template() const { return chat_template_.get(); }
  // messages: OpenAI-style array of {role, content, [tool_calls], ...}; tools: array or null;
  // extra: extra template variables (e.g. {"enable_thinking": false}). Errors: kInvalidArgument for
  // raise_exception from the template (its message) and for runtime type errors;
  // kFailedPrecondition when the model has no chat template.
  Result<std::string> apply_chat_template(const nlohmann::json& messages, bool add_generation_prompt,
                                          const nlohmann::json& tools = nullptr,
                                          const nlohmann::json& extra = nlohmann::json::object()) const;
  // Same, keeping the callers' object key order (Python dicts keep insertion order, and templates
  // print tool schemas with tojson; nlohmann::json sorts keys). Prefer this one when parsing requests.
  Result<std::string> apply_chat_template_ordered(
      const nlohmann::ordered_json& messages, bool add_generation_prompt, const nlohmann::ordered_json& tools = nullptr,
      const nlohmann::ordered_json& extra = nlohmann::ordered_json::object()) const;

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

 private:
  Tokenizer();
  friend class TokenizerLoader;

  // Appends the ids of text with no added tokens in it (normalize, pre-tokenize, BPE).
  void encode_plain(std::string_view text, std::vector<int32_t>& ids) const;

  std::unique_ptr<BpeModel> bpe_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  bool nfc_ = false;
  std::vector<AddedToken> added_tokens_;  // sorted by content for the matcher
  // Added-token matcher: first byte -> indices into added_tokens_, longest content first.
  std::vector<std::vector<uint32_t>> added_by_first_byte_;
  std::unordered_map<std::string, int32_t> added_to_id_;
  std::vector<std::string> id_to_added_;  // by id; empty when not an added token
  std::vector<std::string> added_bytes_;  // by id: what decode() emits for an added token
  std::vector<uint8_t> special_;          // by id
  std::vector<int32_t> prefix_ids_;       // added when add_special_tokens
  std::vector<int32_t> suffix_ids_;
  int32_t vocab_size_ = 0;
  std::optional<int32_t> bos_id_, eos_id_;
  std::string bos_token_, eos_token_;
  std::unique_ptr<ChatTemplate> chat_template_;
  uint64_t instance_id_ = 0;  // keys the per-thread BPE cache
};

}  // namespace pd::tokenizer
