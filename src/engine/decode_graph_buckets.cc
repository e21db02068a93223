#include "engine/decode_graph_buckets.h"

#include <algorithm>

namespace pd::engine {

double decode_padding_fraction(int32_t batch, int32_t bucket, const DecodeStepCostModel& model) {
  const double step = 1.0 + batch * (model.row_activation + model.row_kv);
  return (bucket - batch) * model.row_activation / step;
}

std::vector<int32_t> decode_graph_buckets(int32_t max_num_seqs, const DecodeStepCostModel& model) {
  const int32_t cap = std::clamp(max_num_seqs, 1, kMaxDecodeGraphBatch);
  std::vector<int32_t> buckets;
  for (int32_t small : kSmallDecodeBuckets) {
    const int32_t bucket = std::min(small, cap);
    if (buckets.empty() || buckets.back() != bucket) buckets.push_back(bucket);
  }
  int32_t first = buckets.back() + 1;  // smallest batch not yet covered
  while (first <= cap) {
    // Within a bucket the padding fraction is largest for its smallest batch
    // (`first`): grow the bucket while that batch stays under the bound.
    int32_t bucket = first;
    while (bucket < cap && decode_padding_fraction(first, bucket + 1, model) < kMaxDecodePaddingFraction) ++bucket;
    buckets.push_back(bucket);
    first = bucket + 1;
  }
  return buckets;
}

}  // namespace pd::engine
