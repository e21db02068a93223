#include "contract/block_hash.h"

#include <gtest/gtest.h>

#include <vector>

namespace pd::contract {
namespace {

TEST(BlockHash, FullBlocksAreChainedAndAPartialTailIsLeftOut) {
  std::vector<int32_t> tokens(40);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(i * 7);
  const std::vector<BlockHash> hashes = hash_full_blocks(tokens, 16);
  ASSERT_EQ(hashes.size(), 2u);
  const std::span<const int32_t> all(tokens);
  EXPECT_EQ(hashes[0], hash_block_tokens(std::nullopt, all.subspan(0, 16)));
  EXPECT_EQ(hashes[1], hash_block_tokens(hashes[0], all.subspan(16, 16)));
  EXPECT_TRUE(hash_full_blocks(tokens, 0).empty());
}

TEST(BlockHash, EqualHashesMeanEqualWholePrefixes) {
  std::vector<int32_t> a(32, 1);
  std::vector<int32_t> b(32, 1);
  b[3] = 2;  // differs in the first block only
  EXPECT_NE(hash_full_blocks(a, 16)[1], hash_full_blocks(b, 16)[1]);
  const std::vector<BlockHash> longer = hash_full_blocks(std::vector<int32_t>(48, 1), 16);
  EXPECT_EQ(hash_full_blocks(a, 16), std::vector<BlockHash>(longer.begin(), longer.begin() + 2));
}

}  // namespace
}  // namespace pd::contract
