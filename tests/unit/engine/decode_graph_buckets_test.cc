#include "engine/decode_graph_buckets.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace pd::engine {
namespace {

int32_t bucket_for(const std::vector<int32_t>& buckets, int32_t batch) {
  auto it = std::lower_bound(buckets.begin(), buckets.end(), batch);
  return it == buckets.end() ? -1 : *it;
}

TEST(DecodeGraphBuckets, PaddingCostsLessThanTheBoundAtEveryBatchSize) {
  const std::vector<int32_t> buckets = decode_graph_buckets(kMaxDecodeGraphBatch);
  for (int32_t batch = 1; batch <= kMaxDecodeGraphBatch; ++batch) {
    const int32_t bucket = bucket_for(buckets, batch);
    ASSERT_GE(bucket, batch) << "batch " << batch << " has no graph";
    EXPECT_LT(decode_padding_fraction(batch, bucket), kMaxDecodePaddingFraction)
        << "batch " << batch << " padded to " << bucket;
  }
}

TEST(DecodeGraphBuckets, LongerContextsOnlyLowerThePaddingFraction) {
  const std::vector<int32_t> buckets = decode_graph_buckets(kMaxDecodeGraphBatch);
  DecodeStepCostModel with_kv;
  with_kv.row_kv = 1.0 / 54;  // a 2,048-token context of a Qwen3-8B shape
  for (int32_t batch = 1; batch <= kMaxDecodeGraphBatch; ++batch) {
    const int32_t bucket = bucket_for(buckets, batch);
    EXPECT_LE(decode_padding_fraction(batch, bucket, with_kv), decode_padding_fraction(batch, bucket));
  }
}

TEST(DecodeGraphBuckets, PowersOfTwoWouldBreakTheBound) {
  // The buckets this replaces: b129 padded to 256 spends 45 % of its step on padding, b17 padded to 32 9 %.
  EXPECT_GT(decode_padding_fraction(129, 256), 0.3);
  EXPECT_GT(decode_padding_fraction(17, 32), kMaxDecodePaddingFraction);
}

TEST(DecodeGraphBuckets, TheGraphCountStaysBounded) {
  // Each bucket is one captured graph (and one GEMM tuning pass at start-up).
  const std::vector<int32_t> buckets = decode_graph_buckets(kMaxDecodeGraphBatch);
  EXPECT_LE(buckets.size(), 40u);
  EXPECT_EQ(buckets.front(), 1);
  EXPECT_EQ(buckets.back(), kMaxDecodeGraphBatch);
  EXPECT_TRUE(std::is_sorted(buckets.begin(), buckets.end()));
  EXPECT_EQ(std::adjacent_find(buckets.begin(), buckets.end()), buckets.end()) << "no bucket twice";
  EXPECT_TRUE(
      std::includes(buckets.begin(), buckets.end(), std::begin(kSmallDecodeBuckets), std::end(kSmallDecodeBuckets)));
  // Fewest past the small ones: merging two neighbours would break the bound for
  // the first batch of the merged range.
  const auto small_end = static_cast<size_t>(std::size(kSmallDecodeBuckets));
  for (size_t i = small_end; i + 1 < buckets.size(); ++i) {
    const int32_t first = buckets[i - 1] + 1;
    EXPECT_GE(decode_padding_fraction(first, buckets[i + 1]), kMaxDecodePaddingFraction) << "bucket " << buckets[i];
  }
}

TEST(DecodeGraphBuckets, TheLastBucketIsTheBatchCap) {
  for (int32_t max_num_seqs : {1, 2, 7, 48, 200, 256, 1024}) {
    const std::vector<int32_t> buckets = decode_graph_buckets(max_num_seqs);
    ASSERT_FALSE(buckets.empty());
    EXPECT_EQ(buckets.back(), std::min(max_num_seqs, kMaxDecodeGraphBatch)) << "max_num_seqs " << max_num_seqs;
    for (int32_t batch = 1; batch <= buckets.back(); ++batch) {
      EXPECT_LT(decode_padding_fraction(batch, bucket_for(buckets, batch)), kMaxDecodePaddingFraction);
    }
  }
  EXPECT_EQ(decode_graph_buckets(0), std::vector<int32_t>{1}) << "clamped to one row";
}

}  // namespace
}  // namespace pd::engine
