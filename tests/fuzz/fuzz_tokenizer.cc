// Fuzzes encode/decode/streaming of the Qwen3 tokenizer (the built-in model's) with arbitrary bytes.
// Checks, besides "no crash, no sanitizer report": streamed chunks concatenate to decode(), and
// valid ASCII text round-trips exactly.
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string_view>

#include "tokenizer/incremental_detokenizer.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace {

std::shared_ptr<const pd::tokenizer::Tokenizer> load() {
  const char* root = std::getenv("PDSERVE_SOURCE_DIR");
  const std::filesystem::path dir =
      std::filesystem::path(root != nullptr ? root : PD_SOURCE_DIR) / "assets/tokenizers/qwen3";
  auto loaded = pd::tokenizer::Tokenizer::load(dir);
  if (!loaded.ok()) {
    fprintf(stderr, "fuzz_tokenizer: %s\n", loaded.status().to_string().c_str());
    std::abort();
  }
  return std::move(loaded).value();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const auto tok = load();
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const auto ids = tok->encode(text, true);
  for (int32_t id : ids) {
    if (id < 0 || id >= tok->vocab_size()) std::abort();
  }
  const std::string decoded = tok->decode(ids, false);
  if (!pd::tokenizer::is_valid_utf8(decoded)) std::abort();
  bool ascii = true;
  for (unsigned char c : text) ascii = ascii && c < 0x80;
  if (ascii && decoded != text) std::abort();

  // The same bytes read as token ids: arbitrary sequences must stream exactly like decode().
  std::vector<int32_t> raw_ids(size / 4);
  if (!raw_ids.empty()) std::memcpy(raw_ids.data(), data, raw_ids.size() * 4);
  for (int32_t& id : raw_ids)
    id = static_cast<int32_t>(static_cast<uint32_t>(id) % static_cast<uint32_t>(tok->vocab_size() + 3)) - 1;
  for (bool skip : {true, false}) {
    pd::tokenizer::IncrementalDetokenizer detok(tok, {}, skip);
    std::string streamed;
    for (int32_t id : raw_ids) {
      const std::string chunk = detok.push(id);
      if (!pd::tokenizer::is_valid_utf8(chunk)) std::abort();
      streamed += chunk;
    }
    streamed += detok.flush();
    if (streamed != tok->decode(raw_ids, skip)) std::abort();
  }
  return 0;
}
