#include "contract/block_hash.h"

// XXH3_state_t on the stack needs the static-linking definitions.
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

namespace pd::contract {

namespace {
// Parent of the first block: a fixed, non-zero value so an empty chain is not 0.
constexpr BlockHash kRootParentHash = 0x7064736572766531ull;  // "pdserve1"
}  // namespace

BlockHash hash_block_tokens(std::optional<BlockHash> parent, std::span<const int32_t> token_ids,
                            std::span<const uint64_t> extra_keys) {
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  const BlockHash parent_hash = parent.value_or(kRootParentHash);
  XXH3_64bits_update(&state, &parent_hash, sizeof(parent_hash));
  const uint64_t num_tokens = token_ids.size();
  XXH3_64bits_update(&state, &num_tokens, sizeof(num_tokens));
  XXH3_64bits_update(&state, token_ids.data(), token_ids.size_bytes());
  XXH3_64bits_update(&state, extra_keys.data(), extra_keys.size_bytes());
  return XXH3_64bits_digest(&state);
}

std::vector<BlockHash> hash_full_blocks(std::span<const int32_t> token_ids, int32_t block_size) {
  std::vector<BlockHash> hashes;
  if (block_size < 1) return hashes;
  const size_t bs = static_cast<size_t>(block_size);
  std::optional<BlockHash> parent;
  for (size_t start = 0; start + bs <= token_ids.size(); start += bs) {
    parent = hash_block_tokens(parent, token_ids.subspan(start, bs));
    hashes.push_back(*parent);
  }
  return hashes;
}

}  // namespace pd::contract
