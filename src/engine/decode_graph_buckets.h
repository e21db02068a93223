// Batch sizes the CUDA runner captures a decode graph for (runner_cuda), chosen
// so that padding a batch up to its bucket costs less than a bound fraction of
// the step, at every batch size. Pure; unit-tested without a GPU.
//
// Cost model of one decode step of b rows, in units of one read of the weights:
//   step(b) = 1 + b * (row_activation + row_kv)
// Decode is bound by reading the weights once per step; each row adds its own
// KV read (row_kv, proportional to its context) and its share of the GEMM work,
// norms, lm_head and sampling (row_activation). A padding row reads no context
// and writes no KV (CudaModelRunner::append_padding_rows: length 0, slot -1), so
// it costs row_activation only:
//   padding_fraction(b, bucket) = (bucket - b) * row_activation / step(b).
// The bound is checked with row_kv = 0 (a context of no tokens), the worst case.
// row_activation is bounded by the compute roofline: a row adds 2 FLOPs per
// parameter against 2 bytes per parameter read (bf16), so at most
// copy bandwidth / GEMM rate = 4,268 GB/s / 802 TFLOP/s = 1/188 of a weight read
// (FP8 block weights: 1 byte per parameter at ~1,300 TFLOP/s, 1/152); we take
// 1/150. Measured steps put it far lower: Qwen3-8B decode at 2,048-token contexts
// grows 0.0807 ms per row from b1 (4.377 ms) to b128 (14.627 ms), of which a row's
// KV read at copy bandwidth is 0.071 ms, leaving ~0.010 ms per row, about 1/430 of
// the step (docs/perf/engine.md, "Decode graph buckets").
#pragma once

#include <cstdint>
#include <vector>

namespace pd::engine {

// Largest decode batch served by a graph; larger ones run eagerly.
inline constexpr int32_t kMaxDecodeGraphBatch = 256;
// Padding may cost at most this fraction of a step.
inline constexpr double kMaxDecodePaddingFraction = 0.03;
// A row's non-KV cost relative to one read of the weights (see above).
inline constexpr double kDecodeRowActivationCost = 1.0 / 150.0;
// The smallest batches keep their own graphs although the model would let b1
// pad to 5: the GEMMs pick skinny kernels per M there (a b1 step runs M = 1
// kernels), which a row count cannot model; 1, 2, 4, 8 cost 4 graphs.
inline constexpr int32_t kSmallDecodeBuckets[] = {1, 2, 4, 8};

struct DecodeStepCostModel {
  double row_activation = kDecodeRowActivationCost;
  double row_kv = 0.0;  // worst case for the padding fraction
};

// Fraction of step(batch) spent on the padding rows of `bucket` (>= batch).
double decode_padding_fraction(int32_t batch, int32_t bucket, const DecodeStepCostModel& model = {});

// Ascending buckets covering 1 .. min(max_num_seqs, kMaxDecodeGraphBatch):
// kSmallDecodeBuckets, then the fewest such that every larger batch size, padded
// to the first bucket >= it, pays less than kMaxDecodePaddingFraction under
// `model`. The last bucket is the cap itself.
std::vector<int32_t> decode_graph_buckets(int32_t max_num_seqs, const DecodeStepCostModel& model = {});

}  // namespace pd::engine
