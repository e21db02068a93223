// Fuzzes what a client can send the OpenAI server before the model or the tokenizer sees it:
// the body parser, the four request parsers, and kv_transfer_params, the one field that reaches
// the control plane (DESIGN.md §3.3). Client errors (400s) are fine; crashes, hangs, leaks,
// sanitizer reports are not, and neither is a request that parses but breaks what the parsers
// promise (checked below), or transfer parameters that name a peer the policy forbids.
#include <arpa/inet.h>

#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "connector/config.h"
#include "connector/messages.h"
#include "connector/transfer_params.h"
#include "server/openai_protocol.h"

namespace {

using pd::server::failed;

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_openai_request: %s\n", what);
  std::abort();
}

const pd::server::RequestLimits kLimits;

// What the engine will check later must already hold for anything the parser accepts, else a
// client error would surface as a server failure. max_tokens is resolved against the prompt
// later (resolve_max_tokens); any value >= min_tokens stands in for it here.
void check_generation_fields(const pd::server::GenerationFields& fields) {
  pd::engine::SamplingParams sampling = fields.sampling;
  sampling.max_tokens = std::max(1, sampling.min_tokens);
  if (!sampling.validate(/*vocab_size=*/INT32_MAX).ok()) fail("the parser accepted sampling the engine refuses");
  if (fields.max_tokens && *fields.max_tokens < 1) fail("max_tokens < 1 accepted");
  if (sampling.stop.size() > kLimits.max_stop_strings) fail("too many stop strings accepted");
  if (sampling.stop_token_ids.size() > kLimits.max_stop_token_ids) fail("too many stop ids accepted");
  if (sampling.logprobs > kLimits.max_logprobs) fail("logprobs above the limit accepted");
}

bool is_loopback_ipv4(std::string_view host_port) {
  const std::string host(host_port.substr(0, host_port.rfind(':')));
  in_addr addr{};
  return inet_pton(AF_INET, host.c_str(), &addr) == 1 && (ntohl(addr.s_addr) >> 24) == 127;
}

// kv_transfer_params as a producer and as a consumer (WRITE and READ) would parse them, with
// the default peer policy (loopback only).
void check_transfer_params(const nlohmann::ordered_json& params) {
  const nlohmann::json plain = nlohmann::json::parse(params.dump());
  for (const bool read_mode : {false, true}) {
    pd::connector::KvTransferConfig config;
    config.role = pd::connector::KvRole::kBoth;
    config.read_mode = read_mode;
    constexpr int32_t kPromptTokens = 37, kBlockSize = 16;
    auto parsed = pd::connector::parse_transfer_params(plain, config, kPromptTokens, kBlockSize);
    if (!parsed.ok()) continue;
    if (!pd::connector::is_valid_transfer_id(parsed->transfer_id)) fail("a malformed transfer id was accepted");
    if (parsed->side == pd::connector::TransferSide::kProducer) continue;
    if (!is_loopback_ipv4(parsed->remote_control)) fail("remote_control outside the default peer policy accepted");
    if (parsed->remote_instance_id.empty() || parsed->remote_instance_id.size() > pd::connector::kMaxInstanceIdBytes) {
      fail("remote_instance_id out of bounds accepted");
    }
    if (!parsed->read_mode) continue;
    if (parsed->num_tokens != kPromptTokens) fail("READ with a different prompt length accepted");
    if (parsed->remote_block_ids.size() != static_cast<size_t>((kPromptTokens + kBlockSize - 1) / kBlockSize)) {
      fail("READ block list of the wrong length accepted");
    }
    for (int32_t id : parsed->remote_block_ids) {
      if (id < 0) fail("negative block id accepted");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  auto parsed = pd::server::parse_json_object(body, kLimits.max_json_depth);
  if (failed(parsed)) return 0;
  const auto& json = std::get<nlohmann::ordered_json>(parsed);

  auto completion = pd::server::parse_completion_request(json, kLimits);
  if (!failed(completion)) {
    const auto& request = std::get<pd::server::CompletionRequest>(completion);
    check_generation_fields(request.fields);
    if (request.prompts.empty() || request.prompts.size() > kLimits.max_batch_prompts) {
      fail("a prompt count outside [1, max_batch_prompts] was accepted");
    }
    if (request.fields.kv_transfer_params) check_transfer_params(*request.fields.kv_transfer_params);
  }
  auto chat = pd::server::parse_chat_request(json, kLimits);
  if (!failed(chat)) {
    const auto& request = std::get<pd::server::ChatRequest>(chat);
    check_generation_fields(request.fields);
    if (!request.messages.is_array() || request.messages.empty()) fail("chat without messages accepted");
    if (request.fields.kv_transfer_params) check_transfer_params(*request.fields.kv_transfer_params);
  }
  (void)pd::server::parse_tokenize_request(json, kLimits);
  auto detokenize = pd::server::parse_detokenize_request(json, kLimits);
  if (!failed(detokenize)) {
    for (int32_t id : std::get<pd::server::DetokenizeRequest>(detokenize).tokens) {
      if (id < 0) fail("a negative token id was accepted for detokenize");
    }
  }
  return 0;
}
