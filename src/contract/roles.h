// The roles an instance plays and the two transfer modes: one definition for
// the router, the connector and the registration record (docs/pd_contract.md).
#pragma once

#include <cstdint>
#include <string_view>

#include "common/status.h"

namespace pd::contract {

// What an instance serves: producer = prefill (computes the prompt's KV), consumer =
// decode (receives it), both = collocated (serves whole requests, and may still take
// either side of a transfer).
enum class Role : uint8_t { kProducer, kConsumer, kBoth };

// How KV moves: kWrite = the producer pushes into blocks the consumer names (both legs
// run at once); kRead = the consumer pulls blocks the producer holds (legs in sequence).
enum class TransferMode : uint8_t { kRead, kWrite };

// "producer" | "consumer" | "both": the spelling on every wire (registration, /pd/info).
const char* role_name(Role role);
// "read" | "write"
const char* mode_name(TransferMode mode);

// Exact spellings only; anything else is kInvalidArgument quoting (at most 32 bytes of) the text.
Result<Role> parse_role(std::string_view text);
Result<TransferMode> parse_mode(std::string_view text);

}  // namespace pd::contract
