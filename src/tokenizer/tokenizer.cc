#include "tokenizer/tokenizer.h"

#include <algorithm>
#include <atomic>
#include <fstream>
#include <sstream>

#include "common/log.h"
#include "tokenizer/bpe.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/utf8.h"

namespace pd::tokenizer {
namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

namespace {

std::atomic<uint64_t> g_next_instance_id{1};

Result<std::string> read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found("cannot open {}", path.string());
  std::ostringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// Vocab-sized files use plain json: ordered_json inserts by linear search (quadratic on 150k keys).
template <typename Json = ojson>
Result<Json> read_json(const fs::path& path) {
  PD_ASSIGN_OR_RETURN(std::string text, read_file(path));
  Json parsed = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) return data_loss("{} is not valid JSON", path.string());
  return parsed;
}

// Token text from a config field that is either a string or an AddedToken object.
std::optional<std::string> token_content(const ojson& field) {
  if (field.is_string()) return field.get<std::string>();
  if (field.is_object() && field.contains("content") && field["content"].is_string()) {
    return field["content"].get<std::string>();
  }
  return std::nullopt;
}

// obj[key], or null when obj is not an object or lacks key (const operator[] would be undefined).
template <typename Json>
const Json& field(const Json& obj, const char* key) {
  static const Json kNull;
  if (!obj.is_object()) return kNull;
  auto it = obj.find(key);
  return it == obj.end() ? kNull : *it;
}

template <typename Json>
bool json_bool(const Json& obj, const char* key, bool fallback) {
  if (!obj.is_object()) return fallback;
  auto it = obj.find(key);
  return it != obj.end() && it->is_boolean() ? it->template get<bool>() : fallback;
}

bool is_space_byte(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

// Per-thread memo of word -> ids. Words repeat heavily in real text; BPE is the costly step.
struct WordCache {
  uint64_t owner = 0;
  std::unordered_map<std::string, std::vector<int32_t>> entries;
};
constexpr size_t kMaxCachedWordBytes = 64;
constexpr size_t kMaxCacheEntries = 1 << 16;

}  // namespace

// Builds a Tokenizer from files; keeps the parsing out of the class body.
class TokenizerLoader {
 public:
  static Result<std::shared_ptr<Tokenizer>> load(const fs::path& dir);

 private:
  static Status load_tokenizer_json(Tokenizer& tok, const nlohmann::json& root, bool& has_post_processor);
  static Status load_vocab_merges(Tokenizer& tok, const fs::path& dir, const ojson& config);
  static Status build_pre_tokenizer(Tokenizer& tok, const nlohmann::json& pre, const std::string& where);
};

Tokenizer::Tokenizer() = default;
Tokenizer::~Tokenizer() = default;

Result<std::shared_ptr<Tokenizer>> Tokenizer::load(const fs::path& dir) {
  // Malformed files (wrong JSON types) surface as json exceptions; they end here as a Status.
  try {
    return TokenizerLoader::load(dir);
  } catch (const std::exception& e) {
    return data_loss("{}: malformed tokenizer files: {}", dir.string(), e.what());
  }
}

Status TokenizerLoader::build_pre_tokenizer(Tokenizer& tok, const nlohmann::json& pre, const std::string& where) {
  std::vector<const nlohmann::json*> steps;
  if (pre.is_object() && pre.value("type", "") == "Sequence") {
    for (const auto& step : field(pre, "pretokenizers")) steps.push_back(&step);
  } else if (pre.is_object()) {
    steps.push_back(&pre);
  } else {
    return unimplemented("{}: a tokenizer without a ByteLevel pre-tokenizer is not supported", where);
  }
  std::optional<std::string> split_pattern;
  bool saw_byte_level = false;
  bool add_prefix_space = false;
  for (const nlohmann::json* step : steps) {
    const std::string type = step->value("type", "");
    if (type == "Split") {
      if (split_pattern) return unimplemented("{}: more than one Split pre-tokenizer", where);
      if (step->value("behavior", "") != "Isolated" || json_bool(*step, "invert", false)) {
        return unimplemented("{}: Split pre-tokenizer behaviour other than Isolated", where);
      }
      const nlohmann::json& pattern = field((*step), "pattern");
      if (pattern.contains("Regex")) {
        split_pattern = pattern["Regex"].get<std::string>();
      } else {
        return unimplemented("{}: Split pre-tokenizer with a String pattern", where);
      }
    } else if (type == "ByteLevel") {
      saw_byte_level = true;
      add_prefix_space = json_bool(*step, "add_prefix_space", false);
      if (json_bool(*step, "use_regex", true)) {
        if (split_pattern) return unimplemented("{}: Split followed by a regex ByteLevel pre-tokenizer", where);
        split_pattern = std::string(kGpt2SplitPattern);
      }
    } else {
      return unimplemented("{}: pre-tokenizer type '{}'", where, type);
    }
  }
  if (!saw_byte_level) return unimplemented("{}: pre-tokenizer without ByteLevel", where);
  PD_ASSIGN_OR_RETURN(tok.pre_tokenizer_, PreTokenizer::create(*split_pattern, add_prefix_space));
  return Status::Ok();
}

Status TokenizerLoader::load_tokenizer_json(Tokenizer& tok, const nlohmann::json& root, bool& has_post_processor) {
  const nlohmann::json& model = field(root, "model");
  if (!model.is_object() || model.value("type", "BPE") != "BPE")
    return unimplemented("tokenizer.json: model type is not BPE");
  if (json_bool(model, "byte_fallback", false)) return unimplemented("tokenizer.json: BPE byte_fallback");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(key) && model[key].is_string() && !model[key].get<std::string>().empty()) {
      return unimplemented("tokenizer.json: BPE {}", key);
    }
  }
  std::vector<std::pair<std::string, int32_t>> vocab;
  for (const auto& [token, id] : field(model, "vocab").items()) {
    auto bytes = unicode_to_bytes(token);
    if (!bytes) return data_loss("tokenizer.json: vocab token '{}' is not byte-level text", token);
    vocab.emplace_back(std::move(*bytes), id.get<int32_t>());
  }
  std::vector<std::pair<std::string, std::string>> merges;
  for (const auto& merge : field(model, "merges")) {
    std::string left, right;
    if (merge.is_string()) {
      const std::string line = merge.get<std::string>();
      const size_t space = line.find(' ', 1);
      if (space == std::string::npos) return data_loss("tokenizer.json: merge '{}' has no space", line);
      left = line.substr(0, space);
      right = line.substr(space + 1);
    } else if (merge.is_array() && merge.size() == 2) {
      left = merge[0].get<std::string>();
      right = merge[1].get<std::string>();
    } else {
      return data_loss("tokenizer.json: malformed merge entry");
    }
    auto lb = unicode_to_bytes(left);
    auto rb = unicode_to_bytes(right);
    if (!lb || !rb) return data_loss("tokenizer.json: merge '{} {}' is not byte-level text", left, right);
    merges.emplace_back(std::move(*lb), std::move(*rb));
  }
  PD_ASSIGN_OR_RETURN(tok.bpe_, BpeModel::build(std::move(vocab), merges, json_bool(model, "ignore_merges", false)));

  const nlohmann::json& normalizer = field(root, "normalizer");
  if (normalizer.is_object()) {
    const std::string type = normalizer.value("type", "");
    if (type == "NFC") {
      tok.nfc_ = true;
    } else if (type == "Sequence" && field(normalizer, "normalizers").empty()) {
    } else if (type == "Sequence" && field(normalizer, "normalizers").size() == 1 &&
               field(normalizer, "normalizers")[0].value("type", "") == "NFC") {
      tok.nfc_ = true;
    } else {
      return unimplemented("tokenizer.json: normalizer '{}'", type);
    }
  }
  PD_RETURN_IF_ERROR(build_pre_tokenizer(tok, field(root, "pre_tokenizer"), "tokenizer.json"));
  const nlohmann::json& decoder = field(root, "decoder");
  if (decoder.is_object() && decoder.value("type", "") != "ByteLevel") {
    return unimplemented("tokenizer.json: decoder '{}'", decoder.value("type", ""));
  }
  for (const auto& added : field(root, "added_tokens")) {
    AddedToken token;
    token.content = added.value("content", "");
    token.id = added.value("id", -1);
    token.special = json_bool(added, "special", false);
    token.lstrip = json_bool(added, "lstrip", false);
    token.rstrip = json_bool(added, "rstrip", false);
    if (token.content.empty() || token.id < 0) return data_loss("tokenizer.json: malformed added token");
    tok.added_tokens_.push_back(std::move(token));
  }
  // Post-processor: the special tokens TemplateProcessing wraps a single sequence with.
  std::vector<const nlohmann::json*> processors;
  const nlohmann::json& post = field(root, "post_processor");
  if (post.is_object() && post.value("type", "") == "Sequence") {
    for (const auto& p : field(post, "processors")) processors.push_back(&p);
  } else if (post.is_object()) {
    processors.push_back(&post);
  }
  has_post_processor = !processors.empty();
  for (const nlohmann::json* p : processors) {
    const std::string type = p->value("type", "");
    if (type == "ByteLevel") continue;
    if (type != "TemplateProcessing") return unimplemented("tokenizer.json: post-processor '{}'", type);
    bool after_sequence = false;
    for (const auto& piece : field((*p), "single")) {
      if (piece.contains("Sequence")) {
        after_sequence = true;
        continue;
      }
      const std::string name = field(field(piece, "SpecialToken"), "id").get<std::string>();
      const nlohmann::json& ids = field(field(field((*p), "special_tokens"), name.c_str()), "ids");
      for (const auto& id : ids) (after_sequence ? tok.suffix_ids_ : tok.prefix_ids_).push_back(id.get<int32_t>());
    }
  }
  return Status::Ok();
}

// vocab.json is one flat {"token": id, ...} object of ~150k entries; reading it directly is several
// times faster than building a JSON DOM (it dominates model load, and debug/sanitizer test runs).
// Falls back to the general parser for anything it does not expect.
static bool parse_flat_vocab(std::string_view text, std::vector<std::pair<std::string, int32_t>>& out) {
  size_t i = 0;
  auto skip_ws = [&] {
    while (i < text.size() && (text[i] == ' ' || text[i] == '\n' || text[i] == '\r' || text[i] == '\t')) ++i;
  };
  auto hex4 = [&](uint32_t& v) {
    if (i + 4 > text.size()) return false;
    v = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = text[i++];
      v <<= 4;
      if (c >= '0' && c <= '9')
        v |= static_cast<uint32_t>(c - '0');
      else if (c >= 'a' && c <= 'f')
        v |= static_cast<uint32_t>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F')
        v |= static_cast<uint32_t>(c - 'A' + 10);
      else
        return false;
    }
    return true;
  };
  skip_ws();
  if (i >= text.size() || text[i++] != '{') return false;
  skip_ws();
  if (i < text.size() && text[i] == '}') return true;
  while (true) {
    skip_ws();
    if (i >= text.size() || text[i++] != '"') return false;
    std::string key;
    while (true) {
      if (i >= text.size()) return false;
      const char c = text[i++];
      if (c == '"') break;
      if (c != '\\') {
        key.push_back(c);
        continue;
      }
      if (i >= text.size()) return false;
      const char e = text[i++];
      switch (e) {
        case '"':
          key.push_back('"');
          break;
        case '\\':
          key.push_back('\\');
          break;
        case '/':
          key.push_back('/');
          break;
        case 'b':
          key.push_back('\b');
          break;
        case 'f':
          key.push_back('\f');
          break;
        case 'n':
          key.push_back('\n');
          break;
        case 'r':
          key.push_back('\r');
          break;
        case 't':
          key.push_back('\t');
          break;
        case 'u': {
          uint32_t cp;
          if (!hex4(cp)) return false;
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            uint32_t low;
            if (i + 2 > text.size() || text[i] != '\\' || text[i + 1] != 'u') return false;
            i += 2;
            if (!hex4(low) || low < 0xDC00 || low > 0xDFFF) return false;
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            return false;
          }
          utf8_append(key, cp);
          break;
        }
        default:
          return false;
      }
    }
    skip_ws();
    if (i >= text.size() || text[i++] != ':') return false;
    skip_ws();
    int64_t id = 0;
    size_t digits = 0;
    while (i < text.size() && text[i] >= '0' && text[i] <= '9' && digits < 10) {
      id = id * 10 + (text[i++] - '0');
      ++digits;
    }
    if (digits == 0 || id > INT32_MAX) return false;
    out.emplace_back(std::move(key), static_cast<int32_t>(id));
    skip_ws();
    if (i >= text.size()) return false;
    if (text[i] == ',') {
      ++i;
      continue;
    }
    if (text[i++] != '}') return false;
    skip_ws();
    return i == text.size();
  }
}

Status TokenizerLoader::load_vocab_merges(Tokenizer& tok, const fs::path& dir, const ojson& config) {
  PD_ASSIGN_OR_RETURN(std::string vocab_text, read_file(dir / "vocab.json"));
  std::vector<std::pair<std::string, int32_t>> entries;
  entries.reserve(vocab_text.size() / 16);
  if (!parse_flat_vocab(vocab_text, entries)) {
    entries.clear();
    nlohmann::json vocab_json = nlohmann::json::parse(vocab_text, nullptr, false);
    if (vocab_json.is_discarded() || !vocab_json.is_object()) return data_loss("vocab.json is not a JSON object");
    for (const auto& [token, id] : vocab_json.items()) {
      if (!id.is_number_integer()) return data_loss("vocab.json: token '{}' has a non-integer id", token);
      entries.emplace_back(token, id.get<int32_t>());
    }
  }
  std::vector<std::pair<std::string, int32_t>> vocab;
  vocab.reserve(entries.size());
  for (auto& [token, id] : entries) {
    auto bytes = unicode_to_bytes(token);
    if (!bytes) return data_loss("vocab.json: token '{}' is not byte-level text", token);
    vocab.emplace_back(std::move(*bytes), id);
  }
  PD_ASSIGN_OR_RETURN(std::string merges_text, read_file(dir / "merges.txt"));
  std::vector<std::pair<std::string, std::string>> merges;
  size_t pos = 0;
  size_t line_number = 0;
  while (pos < merges_text.size()) {
    size_t end = merges_text.find('\n', pos);
    if (end == std::string::npos) end = merges_text.size();
    std::string_view line(merges_text.data() + pos, end - pos);
    pos = end + 1;
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    // Only a first line starting with "#version" is a header: Qwen's file has none, and its
    // first line is a real merge.
    if (line_number == 1 && line.starts_with("#version")) continue;
    if (line.empty()) continue;
    const size_t space = line.find(' ', 1);
    if (space == std::string_view::npos) return data_loss("merges.txt line {}: no space in '{}'", line_number, line);
    auto left = unicode_to_bytes(line.substr(0, space));
    auto right = unicode_to_bytes(line.substr(space + 1));
    if (!left || !right) return data_loss("merges.txt line {}: not byte-level text", line_number);
    merges.emplace_back(std::move(*left), std::move(*right));
  }
  PD_ASSIGN_OR_RETURN(tok.bpe_, BpeModel::build(std::move(vocab), merges, false));
  // The slow tokenizer classes fix normalizer and split regex per family.
  const std::string tokenizer_class = config.value("tokenizer_class", "");
  const bool qwen = tokenizer_class.find("Qwen2") != std::string::npos;
  tok.nfc_ = qwen;
  PD_ASSIGN_OR_RETURN(tok.pre_tokenizer_, PreTokenizer::create(qwen ? kQwen2SplitPattern : kGpt2SplitPattern,
                                                               json_bool(config, "add_prefix_space", false)));
  return Status::Ok();
}

Result<std::shared_ptr<Tokenizer>> TokenizerLoader::load(const fs::path& dir) {
  std::shared_ptr<Tokenizer> tok(new Tokenizer());
  tok->instance_id_ = g_next_instance_id.fetch_add(1);
  ojson config = ojson::object();
  std::error_code ec;
  if (fs::exists(dir / "tokenizer_config.json", ec)) {
    PD_ASSIGN_OR_RETURN(config, read_json(dir / "tokenizer_config.json"));
    if (!config.is_object()) return data_loss("{}: tokenizer_config.json is not an object", dir.string());
  }
  bool has_post_processor = false;
  if (fs::exists(dir / "tokenizer.json", ec)) {
    PD_ASSIGN_OR_RETURN(nlohmann::json root, read_json<nlohmann::json>(dir / "tokenizer.json"));
    PD_RETURN_IF_ERROR(load_tokenizer_json(*tok, root, has_post_processor).with_context(dir.string()));
  } else if (fs::exists(dir / "vocab.json", ec) && fs::exists(dir / "merges.txt", ec)) {
    PD_RETURN_IF_ERROR(load_vocab_merges(*tok, dir, config).with_context(dir.string()));
  } else {
    return not_found("{}: neither tokenizer.json nor vocab.json + merges.txt", dir.string());
  }

  // Added tokens from tokenizer_config.json (the same ones tokenizer.json lists, when both exist).
  auto add_token = [&](AddedToken token) {
    for (auto& existing : tok->added_tokens_) {
      if (existing.content == token.content) {
        existing.special = existing.special || token.special;
        return;
      }
    }
    tok->added_tokens_.push_back(std::move(token));
  };
  if (config.contains("added_tokens_decoder") && field(config, "added_tokens_decoder").is_object()) {
    for (const auto& [id_text, added] : field(config, "added_tokens_decoder").items()) {
      AddedToken token;
      token.id = std::atoi(id_text.c_str());
      token.content = added.value("content", "");
      token.special = json_bool(added, "special", false);
      token.lstrip = json_bool(added, "lstrip", false);
      token.rstrip = json_bool(added, "rstrip", false);
      if (token.content.empty()) return data_loss("{}: added token {} has no content", dir.string(), id_text);
      add_token(std::move(token));
    }
  }
  // Named special tokens (bos, eos, unk, pad, additional) are special added tokens in HF; a name not
  // yet in the vocab gets the next free id, as HF's add_special_tokens does.
  auto resolve_special = [&](const std::string& content) -> int32_t {
    for (auto& added : tok->added_tokens_) {
      if (added.content == content) {
        added.special = true;
        return added.id;
      }
    }
    int32_t id;
    if (auto bytes = unicode_to_bytes(content); bytes && tok->bpe_->id_of(*bytes)) {
      id = *tok->bpe_->id_of(*bytes);
    } else {
      id = tok->bpe_->max_id() + 1;
      for (const auto& added : tok->added_tokens_) id = std::max(id, added.id + 1);
    }
    tok->added_tokens_.push_back(AddedToken{content, id, true, false, false});
    return id;
  };
  for (const char* key : {"bos_token", "eos_token", "unk_token", "pad_token"}) {
    if (!config.contains(key)) continue;
    auto content = token_content(config[key]);
    if (!content || content->empty()) continue;
    const int32_t id = resolve_special(*content);
    if (std::string_view(key) == "bos_token") {
      tok->bos_token_ = *content;
      tok->bos_id_ = id;
    } else if (std::string_view(key) == "eos_token") {
      tok->eos_token_ = *content;
      tok->eos_id_ = id;
    }
  }
  for (const char* key : {"additional_special_tokens", "extra_special_tokens"}) {
    if (!config.contains(key) || !config[key].is_array()) continue;
    for (const auto& entry : config[key]) {
      if (auto content = token_content(entry)) resolve_special(*content);
    }
  }
  if (!has_post_processor) {
    if (json_bool(config, "add_bos_token", false) && tok->bos_id_) tok->prefix_ids_.push_back(*tok->bos_id_);
    if (json_bool(config, "add_eos_token", false) && tok->eos_id_) tok->suffix_ids_.push_back(*tok->eos_id_);
  }

  // Id tables.
  int32_t max_id = tok->bpe_->max_id();
  for (const auto& added : tok->added_tokens_) max_id = std::max(max_id, added.id);
  tok->vocab_size_ = max_id + 1;
  tok->id_to_added_.assign(static_cast<size_t>(tok->vocab_size_), std::string());
  tok->special_.assign(static_cast<size_t>(tok->vocab_size_), 0);
  tok->added_bytes_.assign(static_cast<size_t>(tok->vocab_size_), std::string());
  for (const auto& added : tok->added_tokens_) {
    if (added.id < 0) return data_loss("{}: added token '{}' has a negative id", dir.string(), added.content);
    tok->id_to_added_[static_cast<size_t>(added.id)] = added.content;
    // HF's ByteLevel decoder maps a token char by char through the byte alphabet when every char is
    // in it, else emits its UTF-8 text ("<|im_end|>" is the same either way).
    auto mapped = unicode_to_bytes(added.content);
    tok->added_bytes_[static_cast<size_t>(added.id)] = mapped ? std::move(*mapped) : added.content;
    tok->special_[static_cast<size_t>(added.id)] = added.special ? 1 : 0;
    tok->added_to_id_[added.content] = added.id;
  }
  // Matcher: longest content first within each first byte gives leftmost-longest matching.
  std::vector<uint32_t> order(tok->added_tokens_.size());
  for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
    return tok->added_tokens_[a].content.size() > tok->added_tokens_[b].content.size();
  });
  tok->added_by_first_byte_.assign(256, {});
  for (uint32_t i : order) {
    tok->added_by_first_byte_[static_cast<uint8_t>(tok->added_tokens_[i].content[0])].push_back(i);
  }

  PD_ASSIGN_OR_RETURN(tok->chat_template_, ChatTemplate::load(dir));
  PD_LOG_DEBUG("tokenizer {}: vocab_size={} added={} nfc={} chat_template={}", dir.string(), tok->vocab_size_,
               tok->added_tokens_.size(), tok->nfc_, tok->has_chat_template());
  return tok;
}

void Tokenizer::encode_plain(std::string_view text, std::vector<int32_t>& ids) const {
  if (text.empty()) return;
  std::string normalized;
  if (nfc_ && nfc_normalize(text, normalized)) text = normalized;
  std::string prefixed;
  if (pre_tokenizer_->add_prefix_space() && text.front() != ' ') {
    prefixed = " " + std::string(text);
    text = prefixed;
  }
  thread_local WordCache cache;
  if (cache.owner != instance_id_) {
    cache.entries.clear();
    cache.owner = instance_id_;
  }
  pre_tokenizer_->split(text, [&](std::string_view word) {
    if (word.size() > kMaxCachedWordBytes) {
      bpe_->encode_word(word, ids);
      return;
    }
    auto it = cache.entries.find(std::string(word));
    if (it != cache.entries.end()) {
      ids.insert(ids.end(), it->second.begin(), it->second.end());
      return;
    }
    const size_t before = ids.size();
    bpe_->encode_word(word, ids);
    if (cache.entries.size() >= kMaxCacheEntries) cache.entries.clear();
    cache.entries.emplace(std::string(word),
                          std::vector<int32_t>(ids.begin() + static_cast<ptrdiff_t>(before), ids.end()));
  });
}

std::vector<int32_t> Tokenizer::encode(std::string_view raw_text, bool add_special_tokens) const {
  std::string repaired;
  std::string_view text = raw_text;
  if (!is_valid_utf8(text)) {
    repaired = utf8_lossy(text);
    text = repaired;
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (add_special_tokens) ids.insert(ids.end(), prefix_ids_.begin(), prefix_ids_.end());
  size_t segment_start = 0;
  size_t pos = 0;
  bool strip_left_of_next_segment = false;
  while (pos < text.size()) {
    const auto& candidates = added_by_first_byte_[static_cast<uint8_t>(text[pos])];
    const AddedToken* match = nullptr;
    for (uint32_t index : candidates) {
      const AddedToken& token = added_tokens_[index];
      if (text.compare(pos, token.content.size(), token.content) == 0) {
        match = &token;
        break;
      }
    }
    if (match == nullptr) {
      ++pos;
      continue;
    }
    std::string_view segment = text.substr(segment_start, pos - segment_start);
    if (strip_left_of_next_segment) {
      while (!segment.empty() && is_space_byte(segment.front())) segment.remove_prefix(1);
    }
    if (match->lstrip) {
      while (!segment.empty() && is_space_byte(segment.back())) segment.remove_suffix(1);
    }
    encode_plain(segment, ids);
    ids.push_back(match->id);
    strip_left_of_next_segment = match->rstrip;
    pos += match->content.size();
    segment_start = pos;
  }
  std::string_view tail = text.substr(segment_start);
  if (strip_left_of_next_segment) {
    while (!tail.empty() && is_space_byte(tail.front())) tail.remove_prefix(1);
  }
  encode_plain(tail, ids);
  if (add_special_tokens) ids.insert(ids.end(), suffix_ids_.begin(), suffix_ids_.end());
  return ids;
}

std::string_view Tokenizer::token_bytes(int32_t id) const {
  if (id < 0 || id >= vocab_size_) return {};
  if (!id_to_added_[static_cast<size_t>(id)].empty()) return added_bytes_[static_cast<size_t>(id)];
  const std::string* bytes = bpe_->bytes_of(id);
  return bytes == nullptr ? std::string_view() : std::string_view(*bytes);
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::string bytes;
  bytes.reserve(ids.size() * 4);
  for (int32_t id : ids) {
    if (skip_special_tokens && is_special(id)) continue;
    bytes.append(token_bytes(id));
  }
  if (is_valid_utf8(bytes)) return bytes;
  return utf8_lossy(bytes);
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (auto it = added_to_id_.find(std::string(token)); it != added_to_id_.end()) return it->second;
  auto bytes = unicode_to_bytes(token);
  if (!bytes) return std::nullopt;
  return bpe_->id_of(*bytes);
}

std::optional<std::string> Tokenizer::id_to_token(int32_t id) const {
  if (id < 0 || id >= vocab_size_) return std::nullopt;
  if (!id_to_added_[static_cast<size_t>(id)].empty()) return id_to_added_[static_cast<size_t>(id)];
  const std::string* bytes = bpe_->bytes_of(id);
  if (bytes == nullptr) return std::nullopt;
  std::string token;
  for (char c : *bytes) token += byte_to_unicode(static_cast<uint8_t>(c));
  return token;
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && id < vocab_size_ && special_[static_cast<size_t>(id)] != 0;
}

Result<std::string> Tokenizer::apply_chat_template_ordered(const ojson& messages, bool add_generation_prompt,
                                                           const ojson& tools, const ojson& extra) const {
  if (!chat_template_) return failed_precondition("the model has no chat template");
  return chat_template_->apply(messages, add_generation_prompt, tools, extra);
}

Result<std::string> Tokenizer::apply_chat_template(const nlohmann::json& messages, bool add_generation_prompt,
                                                   const nlohmann::json& tools, const nlohmann::json& extra) const {
  return apply_chat_template_ordered(ojson(messages), add_generation_prompt, ojson(tools), ojson(extra));
}

}  // namespace pd::tokenizer
