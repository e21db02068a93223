// kv_transfer_params of a request, validated into native types at the edge
// against this instance: the schema, its checks and their order are the
// contract's (src/contract/transfer_params.h, docs/pd_contract.md); this adds
// what only the connector knows: its role, its default mode and its peer
// policy. Anything malformed is kInvalidArgument (HTTP 400); a remote_control
// the peer policy refuses is a 400 too: a request can never make this instance
// connect to an address it chose.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>

#include "common/status.h"
#include "connector/config.h"
#include "contract/transfer_params.h"

namespace pd::connector {

using contract::blocks_for_tokens;
using contract::TransferParams;
using contract::TransferSide;  // do_remote_decode / do_remote_prefill

// num_prompt_tokens and block_size check the READ block list: exactly
// ceil(num_tokens / block_size) ids and num_tokens == num_prompt_tokens.
Result<TransferParams> parse_transfer_params(const nlohmann::json& params, const KvTransferConfig& config,
                                             int32_t num_prompt_tokens, int32_t block_size);

}  // namespace pd::connector
