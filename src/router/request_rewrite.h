// Request rewriting for the P/D legs (docs/pd_contract.md "Request legs"). Pure
// JSON in, JSON out; the kv_transfer_params themselves are the contract's
// (src/contract/transfer_params.h). The client's own kv_transfer_params are
// removed when the request is parsed, so no later step can forward them by
// accident.
//
// Bodies are nlohmann::ordered_json, so every leg keeps the client's key order
// at every depth: chat templates (Qwen2.5 and others) render `tools` and JSON
// schemas with tojson in the order given, and pdserve keeps that order, so a
// sorted body would render a different prompt from the same request sent
// collocated (its bytes pass through) or to vLLM. A key the router sets keeps
// its place when the client sent it and is appended otherwise.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <string_view>

#include "common/json_depth.h"
#include "common/status.h"
#include "contract/transfer_params.h"
#include "router/instance_info.h"

namespace pd::router {

struct ClientRequest {
  nlohmann::ordered_json body;  // a JSON object in the client's key order, never containing "kv_transfer_params"
  bool stream = false;
  std::string model;  // empty when the client sent none
  bool dropped_kv_transfer_params = false;
};

// The deepest [ / { nesting the router accepts in a JSON text, the same limit
// as pdserve (server::RequestLimits::max_json_depth). nlohmann parses
// iteratively but copies and serialises recursively, one stack frame per
// level, so a 2 MB body of brackets would overflow the stack on the P/D path.
inline constexpr size_t kMaxJsonDepth = 64;

// Parses JSON text that nests at most `max_depth` levels; deeper text is
// refused before a value exists, so nothing downstream can recurse through it.
// Objects keep the order of their keys in `text`.
Result<nlohmann::ordered_json> parse_json_bounded(std::string_view text, size_t max_depth = kMaxJsonDepth);

// Parses a completions / chat completions body. Only what the router relies
// on is checked (an object nested at most kMaxJsonDepth levels; "stream" a
// bool; "model" a string); the engine validates the rest and its 400 reaches
// the client unchanged.
Result<ClientRequest> parse_client_request(std::string_view body);

// 32 lowercase hex chars from 128 random bits.
using contract::format_transfer_id;
// Exactly what format_transfer_id writes.
inline bool is_transfer_id(std::string_view text) {
  return contract::is_minted_transfer_id(text);
}

// Producer leg: max_tokens (and max_completion_tokens) = 1, min_tokens at
// most 1, stream = false, no stream_options, kv_transfer_params =
// {transfer_id, do_remote_decode, mode}.
nlohmann::ordered_json make_producer_body(const nlohmann::ordered_json& body, std::string_view transfer_id,
                                          TransferMode mode);

// WRITE consumer leg: the body as the client sent it (less prompt_logprobs, below) plus the producer's address.
// Precondition: producer.control is set (a P/D producer always has one).
nlohmann::ordered_json make_write_consumer_body(const nlohmann::ordered_json& body, std::string_view transfer_id,
                                                const InstanceInfo& producer);

// READ consumer leg from the producer's response text: a JSON object nested
// at most kMaxJsonDepth levels (its kv_transfer_params are copied into the
// leg, in the producer's key order), whose kv_transfer_params must be an
// object with transfer_id == `transfer_id` and the fields the consumer needs
// to pull (remote_instance_id, remote_control, remote_boot_nonce, block_ids,
// num_tokens). When `expected_producer_id` is not empty, the response must
// name that producer.
Result<nlohmann::ordered_json> make_read_consumer_body(const nlohmann::ordered_json& body, std::string_view transfer_id,
                                                       std::string_view producer_response,
                                                       std::string_view expected_producer_id);

// prompt_logprobs through P/D (docs/pd_contract.md): the producer leg keeps the
// client's field and computes them during its prefill; both consumer legs above
// drop it (the consumer receives the prompt's KV and computes none of it). The
// request is not streamed (the engine's validation refuses prompt_logprobs with
// stream), so the consumer's answer is one JSON object: its prompt_logprobs
// (null) are replaced with the producer's, in every choice for completions, at
// the top for chat. The result keeps the consumer's key order.
bool wants_prompt_logprobs(const nlohmann::ordered_json& body);
Result<std::string> add_producer_prompt_logprobs(std::string_view consumer_answer, std::string_view producer_answer,
                                                 bool chat);

}  // namespace pd::router
