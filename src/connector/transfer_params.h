// kv_transfer_params as the router sends them (pd_contract.md), validated into
// native types at the edge. Anything malformed is kInvalidArgument (HTTP 400);
// a remote_control that fails the peer policy is kPermissionDenied-as-400 too:
// a request can never make this instance connect to an address it chose.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "connector/config.h"

namespace pd::connector {

enum class TransferSide : uint8_t { kProducer, kConsumer };  // do_remote_decode / do_remote_prefill

struct TransferParams {
  TransferSide side = TransferSide::kProducer;
  bool read_mode = false;
  std::string transfer_id;
  // Consumer only: where the producer is.
  std::string remote_instance_id;
  std::string remote_control;  // host:port, passed the peer policy
  uint64_t remote_boot_nonce = 0;
  // Consumer, READ only: the producer's blocks and how many tokens they hold.
  std::vector<int32_t> remote_block_ids;
  int32_t num_tokens = 0;
};

// num_prompt_tokens and block_size check the READ block list: exactly
// ceil(num_tokens / block_size) ids and num_tokens == num_prompt_tokens.
Result<TransferParams> parse_transfer_params(const nlohmann::json& params, const KvTransferConfig& config,
                                             int32_t num_prompt_tokens, int32_t block_size);

// Blocks covering `num_tokens` tokens.
inline int32_t blocks_for_tokens(int32_t num_tokens, int32_t block_size) {
  return (num_tokens + block_size - 1) / block_size;
}

}  // namespace pd::connector
