// kv_transfer_params: the per-request P/D fields (docs/pd_contract.md), typed,
// with their JSON codecs for the HTTP edges (router legs, engine requests and
// responses). Three shapes travel:
//
//   producer leg      router -> producer   {transfer_id, do_remote_decode: true, mode}
//   WRITE consumer    router -> consumer   {transfer_id, do_remote_prefill: true, mode: "write",
//                                           remote_instance_id, remote_control, remote_boot_nonce}
//   producer answer   producer -> router   {transfer_id, remote_instance_id, remote_control,
//                                           remote_boot_nonce, mode, num_tokens[, block_ids]}
//   READ consumer     router -> consumer   the producer answer as received, plus
//                                           do_remote_prefill: true, mode: "read"
//
// Engines validate what they receive with parse_transfer_params (every error is
// kInvalidArgument naming the field: HTTP 400), once, at their HTTP edge; the
// typed values (transfer_types.h, no JSON) travel on from there. The router relays the producer
// answer after check_producer_answer; the consumer then checks every field.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "contract/roles.h"
#include "contract/transfer_types.h"

namespace pd::contract {

// ---- transfer ids -----------------------------------------------------------
// The router mints one per P/D request: 128 random bits as 32 lowercase hex digits.
inline constexpr size_t kTransferIdChars = 32;
std::string format_transfer_id(uint64_t high, uint64_t low);
// Exactly what format_transfer_id writes: 32 lowercase hex digits.
bool is_minted_transfer_id(std::string_view text);
// What engines accept (in kv_transfer_params and control messages): 32 hex digits, either case.
bool is_transfer_id(std::string_view text);

// ---- bounds -----------------------------------------------------------------
inline constexpr size_t kMaxParamsKeys = 32;          // keys in one kv_transfer_params object
inline constexpr size_t kMaxInstanceIdBytes = 128;    // remote_instance_id, registration instance_id
inline constexpr size_t kMaxRemoteControlBytes = 64;  // remote_control ("host:port")

// ---- the shapes the router and the producer write -----------------------------

struct ProducerLeg {
  std::string transfer_id;
  TransferMode mode = TransferMode::kWrite;
};
// {"transfer_id", "do_remote_decode": true, "mode"}, in that order.
nlohmann::ordered_json encode_producer_leg(const ProducerLeg& leg);

struct WriteConsumerLeg {
  std::string transfer_id;
  ProducerLocation producer;
};
// {"transfer_id", "do_remote_prefill": true, "mode": "write", "remote_instance_id",
//  "remote_control", "remote_boot_nonce"}, in that order.
nlohmann::ordered_json encode_write_consumer_leg(const WriteConsumerLeg& leg);

// {"block_ids"?, "mode", "num_tokens", "remote_boot_nonce", "remote_control",
//  "remote_instance_id", "transfer_id"}: a nlohmann::json, whose keys serialise sorted.
nlohmann::json encode_producer_answer(const ProducerAnswer& answer);

// The router's check of a producer answer before relaying it (READ): transfer_id equal
// to the minted one; remote_instance_id, remote_control strings; remote_boot_nonce and
// num_tokens non-negative integers; block_ids an array; remote_instance_id equal to
// `expected_producer_id` unless that is empty. Only what routing relies on: the consumer
// validates every field again (parse_transfer_params). Errors name the field.
Status check_producer_answer(const nlohmann::ordered_json& params, std::string_view minted_transfer_id,
                             std::string_view expected_producer_id);

// The READ consumer leg's params: check_producer_answer, then the answer as received (its
// keys in the producer's order, unknown keys kept) with do_remote_prefill = true,
// mode = "read" and no do_remote_decode.
Result<nlohmann::ordered_json> make_read_consumer_params(const nlohmann::ordered_json& producer_params,
                                                         std::string_view minted_transfer_id,
                                                         std::string_view expected_producer_id);

// ---- what an engine accepts ---------------------------------------------------

// The receiving instance, as far as the params are checked against it.
struct EngineContext {
  Role role = Role::kBoth;
  TransferMode default_mode = TransferMode::kWrite;  // when "mode" is absent or null
  int32_t num_prompt_tokens = 0;                     // the request's prompt
  int32_t block_size = 16;                           // tokens per KV block (> 0)
  // Peer policy for remote_control, asked after its syntax passed; empty: allow any.
  std::function<bool(std::string_view host_port)> peer_allowed;
};

// Checks, in this order (the first failure is the answer):
//   an object of at most kMaxParamsKeys keys; do_remote_decode, do_remote_prefill booleans
//   (absent/null = false), exactly one true, and the context's role takes that side;
//   transfer_id 32 hex digits; mode "read" | "write" | absent/null;
//   consumer: remote_instance_id 1..kMaxInstanceIdBytes bytes; remote_control
//   1..kMaxRemoteControlBytes bytes, host:port, allowed by the peer policy;
//   remote_boot_nonce an unsigned integer;
//   READ consumer: num_tokens an integer equal to the prompt's length; block_ids an array
//   of exactly ceil(num_tokens / block_size) ids, each in [0, INT32_MAX].
// Keys not named here are ignored. Every error is kInvalidArgument naming the field.
Result<TransferParams> parse_transfer_params(const nlohmann::json& params, const EngineContext& context);

}  // namespace pd::contract
