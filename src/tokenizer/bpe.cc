#include "tokenizer/bpe.h"

#include <algorithm>
#include <array>
#include <queue>

#include "tokenizer/utf8.h"

namespace pd::tokenizer {
namespace {

struct ByteTables {
  static constexpr uint32_t kMaxCodepoint = 0x200;  // the alphabet is U+0021..U+0143
  std::array<std::string, 256> to_unicode;
  std::array<int16_t, kMaxCodepoint> from_codepoint;  // -1 when not in the alphabet
  ByteTables() {
    // Printable Latin-1 bytes map to themselves; the rest to 256 + n in byte order (GPT-2's table).
    from_codepoint.fill(-1);
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      const uint32_t cp = printable ? b : next++;
      utf8_append(to_unicode[b], cp);
      from_codepoint[cp] = static_cast<int16_t>(b);
    }
  }
};

const ByteTables& byte_tables() {
  static const ByteTables tables;
  return tables;
}

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return x;
}

}  // namespace

const std::string& byte_to_unicode(uint8_t byte) {
  return byte_tables().to_unicode[byte];
}

std::optional<std::string> unicode_to_bytes(std::string_view token) {
  if (!is_valid_utf8(token)) return std::nullopt;
  const auto& table = byte_tables().from_codepoint;
  std::string out;
  out.reserve(token.size());
  size_t i = 0;
  while (i < token.size()) {
    const uint32_t cp = utf8_next(token, i);
    if (cp >= ByteTables::kMaxCodepoint || table[cp] < 0) return std::nullopt;
    out.push_back(static_cast<char>(table[cp]));
  }
  return out;
}

Result<std::unique_ptr<BpeModel>> BpeModel::build(std::vector<std::pair<std::string, int32_t>> vocab,
                                                  const std::vector<std::pair<std::string, std::string>>& merges,
                                                  bool ignore_merges) {
  std::unique_ptr<BpeModel> model(new BpeModel());
  model->ignore_merges_ = ignore_merges;
  int32_t max_id = -1;
  for (const auto& [bytes, id] : vocab) {
    if (id < 0) return invalid_argument("vocab entry has negative id {}", id);
    max_id = std::max(max_id, id);
  }
  if (max_id > 16'000'000) return invalid_argument("vocab id {} is implausibly large", max_id);
  model->id_to_bytes_.resize(static_cast<size_t>(max_id + 1));
  model->has_id_.assign(static_cast<size_t>(max_id + 1), 0);
  model->bytes_to_id_.reserve(vocab.size());
  for (auto& [bytes, id] : vocab) {
    model->id_to_bytes_[static_cast<size_t>(id)] = bytes;
    model->has_id_[static_cast<size_t>(id)] = 1;
    model->bytes_to_id_.emplace(std::move(bytes), id);
  }
  for (int b = 0; b < 256; ++b) {
    const auto id = model->id_of(std::string(1, static_cast<char>(b)));
    model->byte_ids_[b] = id ? *id : -1;
  }
  size_t capacity = 16;
  while (capacity < merges.size() * 2 + 16) capacity <<= 1;
  model->merge_table_.assign(capacity, MergeSlot{kEmptyKey, 0, 0});
  model->merge_mask_ = capacity - 1;
  uint32_t rank = 0;
  for (const auto& [left, right] : merges) {
    const auto left_id = model->id_of(left);
    const auto right_id = model->id_of(right);
    const auto merged_id = model->id_of(left + right);
    if (!left_id || !right_id || !merged_id) {
      return invalid_argument("merge #{} ('{}' '{}') uses a token missing from the vocab", rank, left, right);
    }
    const uint64_t key = pair_key(*left_id, *right_id);
    size_t slot = mix(key) & model->merge_mask_;
    while (model->merge_table_[slot].key != kEmptyKey && model->merge_table_[slot].key != key) {
      slot = (slot + 1) & model->merge_mask_;
    }
    // A repeated pair keeps its first (lowest) rank, as HF does.
    if (model->merge_table_[slot].key == kEmptyKey) model->merge_table_[slot] = MergeSlot{key, rank, *merged_id};
    ++rank;
  }
  model->num_merges_ = merges.size();
  return model;
}

const BpeModel::MergeSlot* BpeModel::find_merge(int32_t left, int32_t right) const {
  const uint64_t key = pair_key(left, right);
  size_t slot = mix(key) & merge_mask_;
  while (true) {
    const MergeSlot& s = merge_table_[slot];
    if (s.key == key) return &s;
    if (s.key == kEmptyKey) return nullptr;
    slot = (slot + 1) & merge_mask_;
  }
}

std::optional<int32_t> BpeModel::id_of(std::string_view token_bytes) const {
  auto it = bytes_to_id_.find(std::string(token_bytes));
  if (it == bytes_to_id_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::bytes_of(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= id_to_bytes_.size() || !has_id_[static_cast<size_t>(id)]) return nullptr;
  return &id_to_bytes_[static_cast<size_t>(id)];
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    if (auto id = id_of(word)) {
      out.push_back(*id);
      return;
    }
  }
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
  };
  struct Candidate {
    uint32_t rank;
    int32_t pos;
    int32_t left_id;
    int32_t right_id;
    int32_t merged_id;
    // Lowest rank first, then leftmost: the order HF applies merges in.
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  thread_local std::vector<Symbol> symbols;
  thread_local std::vector<Candidate> heap_storage;
  symbols.clear();
  for (char c : word) {
    const int32_t id = byte_ids_[static_cast<uint8_t>(c)];
    if (id < 0) continue;
    const auto n = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, n - 1, n + 1});
  }
  if (symbols.empty()) return;
  const auto num_symbols = static_cast<int32_t>(symbols.size());
  symbols.back().next = -1;
  heap_storage.clear();
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> heap(std::greater<>{},
                                                                              std::move(heap_storage));
  auto consider = [&](int32_t pos) {
    const int32_t next = symbols[static_cast<size_t>(pos)].next;
    if (next < 0) return;
    const int32_t left = symbols[static_cast<size_t>(pos)].id;
    const int32_t right = symbols[static_cast<size_t>(next)].id;
    if (const MergeSlot* m = find_merge(left, right)) heap.push({m->rank, pos, left, right, m->merged_id});
  };
  for (int32_t i = 0; i + 1 < num_symbols; ++i) consider(i);
  constexpr int32_t kDeleted = -1;
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    Symbol& left = symbols[static_cast<size_t>(c.pos)];
    if (left.id != c.left_id || left.next < 0) continue;
    Symbol& right = symbols[static_cast<size_t>(left.next)];
    if (right.id != c.right_id) continue;
    left.id = c.merged_id;
    right.id = kDeleted;
    left.next = right.next;
    if (left.next >= 0) symbols[static_cast<size_t>(left.next)].prev = c.pos;
    if (left.prev >= 0) consider(left.prev);
    consider(c.pos);
  }
  for (int32_t i = 0; i >= 0; i = symbols[static_cast<size_t>(i)].next)
    out.push_back(symbols[static_cast<size_t>(i)].id);
}

}  // namespace pd::tokenizer
