// kv_transfer_params at pdserve's HTTP edge (docs/pd_contract.md): the client's object is parsed
// once, against this instance and the request's prompt, into the contract's typed params, which
// the engine and the connector carry; a producer's answer comes back typed and is written once,
// into the response. The only place between HTTP and the engine where these params are JSON.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <optional>

#include "common/status.h"
#include "contract/transfer_types.h"
#include "server/openai_protocol.h"

namespace pd::server {

// The P/D connector's parser (PdConnector::parse_request_params): the contract's checks against
// this instance's role, default mode, block size and peer policy, and the prompt's length.
// Called on an HTTP thread.
using KvParamsParser =
    std::function<Result<contract::TransferParams>(const nlohmann::json& params, int32_t num_prompt_tokens)>;

// The request's kv_transfer_params, typed. nullopt when it has none, or when this instance runs no
// P/D connector (`parse` empty): such an instance ignores them, as vLLM does without a connector.
// A refusal is a 400 naming `kv_transfer_params`, with the parser's message (which names the field
// inside it, e.g. "kv_transfer_params.transfer_id ...").
Parsed<std::optional<contract::TransferParams>> parse_kv_params(const std::optional<nlohmann::ordered_json>& params,
                                                                int32_t num_prompt_tokens, const KvParamsParser& parse);

// A producer's answer as the response's kv_transfer_params.
ResponseJson kv_params_json(const contract::ProducerAnswer& answer);

}  // namespace pd::server
