// pd_tokenizer_cli: drives the tokenizer and chat templates from JSON lines, for the parity tests.
//
//   pd_tokenizer_cli --dir <tokenizer folder>            full tokenizer (+ its chat template)
//   pd_tokenizer_cli --template-dir <folder>             chat template only (tokenizer_config.json)
//
// Each stdin line is one request object; each answer is one stdout line:
//   {"op":"encode","text":s | "text_hex":hex,"add_special_tokens":b}  -> {"ids":[...]}
//   {"op":"decode","ids":[...],"skip_special_tokens":b}              -> {"text":s}
//   {"op":"stream","ids":[...],"skip_special_tokens":b}              -> {"chunks":[...]}  (incremental detokenizer)
//   {"op":"render","messages":[...],"add_generation_prompt":b,"tools":...,"extra":{...}}
//                                                                    -> {"text":s} | {"error":s,"code":s}
//   {"op":"info"}                                                    -> vocab size and special tokens
// A malformed request line is answered with {"error":...} and the CLI keeps reading.
#include <iostream>
#include <string>

#include "tokenizer/chat_template.h"
#include "tokenizer/incremental_detokenizer.h"
#include "tokenizer/tokenizer.h"

namespace {

using ojson = nlohmann::ordered_json;

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2)
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

ojson handle(const ojson& req, const std::shared_ptr<pd::tokenizer::Tokenizer>& tok,
             const pd::tokenizer::ChatTemplate* tmpl) {
  const std::string op = req.value("op", "");
  if (op == "render") {
    if (tmpl == nullptr) return {{"error", "no chat template"}, {"code", "FAILED_PRECONDITION"}};
    auto result = tmpl->apply(req.value("messages", ojson::array()), req.value("add_generation_prompt", false),
                              req.value("tools", ojson()), req.value("extra", ojson::object()));
    if (!result.ok()) {
      return {{"error", result.status().message()}, {"code", pd::error_code_name(result.status().code())}};
    }
    return {{"text", *result}};
  }
  if (!tok) return {{"error", "no tokenizer loaded"}};
  if (op == "encode") {
    const std::string text =
        req.contains("text_hex") ? from_hex(req["text_hex"].get<std::string>()) : req.value("text", std::string());
    return {{"ids", tok->encode(text, req.value("add_special_tokens", true))}};
  }
  if (op == "decode" || op == "stream") {
    const std::vector<int32_t> ids = req.value("ids", std::vector<int32_t>());
    const bool skip = req.value("skip_special_tokens", true);
    if (op == "decode") return {{"text", tok->decode(ids, skip)}};
    pd::tokenizer::IncrementalDetokenizer detok(tok, {}, skip);
    ojson chunks = ojson::array();
    for (int32_t id : ids) chunks.push_back(detok.push(id));
    chunks.push_back(detok.flush());
    return {{"chunks", chunks}};
  }
  if (op == "info") {
    ojson info = {{"vocab_size", tok->vocab_size()}, {"bos_token", tok->bos_token()}, {"eos_token", tok->eos_token()}};
    info["bos_token_id"] = tok->bos_token_id() ? ojson(*tok->bos_token_id()) : ojson();
    info["eos_token_id"] = tok->eos_token_id() ? ojson(*tok->eos_token_id()) : ojson();
    return info;
  }
  return {{"error", "unknown op '" + op + "'"}};
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir, template_dir;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--dir")
      dir = argv[i + 1];
    else if (flag == "--template-dir")
      template_dir = argv[i + 1];
  }
  if (dir.empty() == template_dir.empty()) {
    std::cerr << "usage: pd_tokenizer_cli --dir <tokenizer folder> | --template-dir <folder>\n";
    return 2;
  }
  std::shared_ptr<pd::tokenizer::Tokenizer> tok;
  std::unique_ptr<pd::tokenizer::ChatTemplate> owned_template;
  const pd::tokenizer::ChatTemplate* tmpl = nullptr;
  if (!dir.empty()) {
    auto loaded = pd::tokenizer::Tokenizer::load(dir);
    if (!loaded.ok()) {
      std::cerr << "load failed: " << loaded.status().to_string() << "\n";
      return 1;
    }
    tok = std::move(loaded).value();
    tmpl = tok->chat_template();
  } else {
    auto loaded = pd::tokenizer::ChatTemplate::load(template_dir);
    if (!loaded.ok()) {
      std::cerr << "load failed: " << loaded.status().to_string() << "\n";
      return 1;
    }
    owned_template = std::move(loaded).value();
    tmpl = owned_template.get();
  }
  std::cout << ojson{{"ready", true}}.dump() << std::endl;
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line.empty()) continue;
    ojson req = ojson::parse(line, nullptr, false);
    ojson answer;
    if (req.is_discarded() || !req.is_object()) {
      answer = {{"error", "request is not a JSON object"}};
    } else {
      try {
        answer = handle(req, tok, tmpl);
      } catch (const std::exception& e) {
        answer = {{"error", std::string("bad request: ") + e.what()}};
      }
    }
    // The parity suite compares exact strings, so invalid UTF-8 must never reach here; replace to be safe.
    std::cout << answer.dump(-1, ' ', false, ojson::error_handler_t::replace) << std::endl;
  }
  return 0;
}
