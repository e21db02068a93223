// The BPE model: merges applied to the raw bytes of one pre-tokenized word. Immutable after build().
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/status.h"

namespace pd::tokenizer {

// Byte-level alphabet of GPT-2: every byte maps to one printable code point, so vocab files can
// store arbitrary bytes as text.
const std::string& byte_to_unicode(uint8_t byte);  // UTF-8 of the code point for a byte
// Maps a byte-level string back to bytes; nullopt when a character is outside the alphabet.
std::optional<std::string> unicode_to_bytes(std::string_view token);

class BpeModel {
 public:
  // vocab: token bytes -> id. merges: (left, right) token bytes, in rank order.
  static Result<std::unique_ptr<BpeModel>> build(std::vector<std::pair<std::string, int32_t>> vocab,
                                                 const std::vector<std::pair<std::string, std::string>>& merges,
                                                 bool ignore_merges);

  // Appends the ids of one word (raw bytes). Bytes with no id are dropped (no unk token in byte-level BPE).
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;

  std::optional<int32_t> id_of(std::string_view token_bytes) const;
  const std::string* bytes_of(int32_t id) const;
  int32_t max_id() const { return static_cast<int32_t>(id_to_bytes_.size()) - 1; }
  size_t num_merges() const { return num_merges_; }

 private:
  BpeModel() = default;
  // Open-addressing map from (left_id, right_id) to (rank, merged id).
  struct MergeSlot {
    uint64_t key;  // kEmptyKey when unused
    uint32_t rank;
    int32_t merged_id;
  };
  static constexpr uint64_t kEmptyKey = ~0ULL;
  const MergeSlot* find_merge(int32_t left, int32_t right) const;

  std::unordered_map<std::string, int32_t> bytes_to_id_;
  std::vector<std::string> id_to_bytes_;  // holes are empty strings with has_id_ false
  std::vector<uint8_t> has_id_;
  std::vector<MergeSlot> merge_table_;
  uint64_t merge_mask_ = 0;
  size_t num_merges_ = 0;
  int32_t byte_ids_[256];
  bool ignore_merges_ = false;
};

}  // namespace pd::tokenizer
