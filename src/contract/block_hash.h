// The prefix-cache key of one full KV block (docs/pd_contract.md "Load and KV cache
// events"): engines cache blocks under it and report it to the router, which hashes
// a request's prompt the same way to find how much of it an instance holds.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace pd::contract {

using BlockHash = uint64_t;

// xxh3-64 over (parent hash or a fixed root value, the number of tokens, the token ids
// as int32, extra_keys as uint64), native byte order: chained over the parent, so equal
// hashes mean equal whole prefixes. extra_keys distinguish KV that differs for the same
// tokens (e.g. a cache salt or adapter id).
BlockHash hash_block_tokens(std::optional<BlockHash> parent, std::span<const int32_t> token_ids,
                            std::span<const uint64_t> extra_keys = {});

// The chained hashes of every full block of token_ids (block_size >= 1).
std::vector<BlockHash> hash_full_blocks(std::span<const int32_t> token_ids, int32_t block_size);

}  // namespace pd::contract
