// kv_transfer_params as typed values: what an engine carries from its HTTP edge to
// the connector and back (docs/pd_contract.md). No JSON here: the codecs are in
// transfer_params.h, used only at the HTTP edges of pdserve and pdrouter.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "contract/roles.h"

namespace pd::contract {

// Which side of the transfer a request is on: do_remote_decode (producer: compute the
// prompt, keep or push its KV) or do_remote_prefill (consumer: receive the prompt's KV).
enum class TransferSide : uint8_t { kProducer, kConsumer };

// The producer incarnation a consumer talks to: its registration's instance_id,
// control address ("host:port" of its control ROUTER) and boot nonce.
struct ProducerLocation {
  std::string instance_id;
  std::string control;
  uint64_t boot_nonce = 0;
  bool operator==(const ProducerLocation&) const = default;
};

// What a producer returns in its response once the prompt's KV is complete.
struct ProducerAnswer {
  std::string transfer_id;
  ProducerLocation producer;  // the producer itself
  TransferMode mode = TransferMode::kWrite;
  int32_t num_tokens = 0;  // the prompt's length
  // The blocks holding the prompt (its first ceil(num_tokens / block_size) ids), present
  // when the producer still holds them as its request finishes (the normal case); absent
  // when the transfer already ended (failed, aborted, or a WRITE already done). A READ
  // answer without them is not relayed: the READ consumer pulls exactly these blocks.
  std::optional<std::vector<int32_t>> block_ids;
  bool operator==(const ProducerAnswer&) const = default;
};

// kv_transfer_params of one request, validated against the instance receiving it
// (parse_transfer_params): holding one means its checks passed.
struct TransferParams {
  TransferSide side = TransferSide::kProducer;
  bool read_mode = false;  // "mode" when sent, else the instance's default
  std::string transfer_id;
  // Consumer only: where the producer is.
  std::string remote_instance_id;
  std::string remote_control;  // host:port, passed the peer policy
  uint64_t remote_boot_nonce = 0;
  // Consumer, READ only: the producer's blocks and how many tokens they hold.
  std::vector<int32_t> remote_block_ids;
  int32_t num_tokens = 0;
  bool operator==(const TransferParams&) const = default;
};

// Blocks covering `num_tokens` tokens.
inline int32_t blocks_for_tokens(int32_t num_tokens, int32_t block_size) {
  return (num_tokens + block_size - 1) / block_size;
}

}  // namespace pd::contract
