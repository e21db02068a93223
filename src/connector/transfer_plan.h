// Which KV heads move between which tensor-parallel ranks (DESIGN.md §3.3), and
// the byte ranges that move them. Pure: no I/O, no state; the adapter
// (pd_connector.cc) computes one plan per peer at its handshake.
//
// Each side's head map says, per rank, the contiguous range of the model's KV
// heads that rank holds in every block (its KV shard). Ranges may overlap:
// when a side runs more ranks than the model has KV heads, each head is
// replicated on several ranks. The plan covers every (consumer rank, head)
// exactly once, from exactly one producer rank that holds the head:
//   * split:  one producer rank feeds several consumer ranks (consumer TP larger);
//   * merge:  several producer ranks feed one consumer rank (producer TP larger);
//   * replica: a head held by several producer ranks is taken from one of them,
//     chosen by consumer rank so that the replicas share the load.
// One batch per consumer rank; a batch is a list of pieces, each piece a
// contiguous head range from one producer rank (one xfer batch per layer,
// since an xfer batch joins one local and one remote region).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "common/status.h"
#include "xfer/types.h"

namespace pd::connector {

inline constexpr int32_t kMaxTpSize = 64;

// KV heads [begin, begin + count) of the model, held by one rank.
struct RankHeads {
  int32_t begin = 0;
  int32_t count = 0;
  bool operator==(const RankHeads&) const = default;
};

// Ok when every rank's range lies inside [0, num_kv_heads), is not empty, the
// map has 1..kMaxTpSize ranks, and every head is held by at least one rank;
// else kInvalidArgument naming the rank or the head.
Status validate_head_map(int32_t num_kv_heads, std::span<const RankHeads> ranks);

struct PlanPiece {
  int32_t producer_rank = 0;
  int32_t consumer_rank = 0;
  int32_t head_begin = 0;  // model head id
  int32_t num_heads = 0;
  bool operator==(const PlanPiece&) const = default;
};

struct ConsumerBatch {
  int32_t consumer_rank = 0;
  std::vector<PlanPiece> pieces;  // in head order; their heads are exactly the rank's range
};

struct TransferPlan {
  std::vector<ConsumerBatch> batches;  // one per consumer rank, in rank order
  // Every piece of every batch, batch by batch: the unit posted per layer.
  std::vector<PlanPiece> pieces() const;
};

// Both head maps must pass validate_head_map for num_kv_heads (checked: the
// maps come from peers).
Result<TransferPlan> plan_transfer(int32_t num_kv_heads, std::span<const RankHeads> producer,
                                   std::span<const RankHeads> consumer);

// A rank's KV block: `sections` one after the other, each
// [block_size tokens][the rank's heads][row bytes]; e.g. float KV is two
// sections (K, V) of head_dim * element bytes, fp8 KV four (K codes, V codes:
// head_dim bytes; K scales, V scales: 4 bytes). This is the layout of the CPU
// runner's paged cache (kernels/cpu PagedKvLayout) for any number of heads.
struct KvBlockLayout {
  int32_t block_size = 0;
  std::vector<uint64_t> section_row_bytes;
  uint64_t block_bytes(int32_t num_heads) const;
};

// The byte ranges that move `piece` for each block pair (producer block id
// blocks_producer[i] -> consumer block id blocks_consumer[i], same length),
// appended to `out` as xfer ops; local_is_producer says which side is local
// (WRITE: the producer posts; READ: the consumer). A piece that is the whole of
// both ranks' shards is one op per block; otherwise one op per (section, token).
void append_piece_ops(const KvBlockLayout& layout, const PlanPiece& piece, const RankHeads& producer_rank,
                      const RankHeads& consumer_rank, std::span<const int32_t> blocks_producer,
                      std::span<const int32_t> blocks_consumer, bool local_is_producer, std::vector<xfer::Op>& out);

// The ops of one WRITE batch, posted by the producer: plan piece `piece` (an index into
// `pieces`, the plan with that consumer) from the producer's blocks after the first
// num_skip_blocks (prompt blocks the consumer already had) into the consumer's destination
// blocks, pair by pair. kInternal when the piece is outside the plan, names a rank outside a
// head map, or the destination lists more blocks than the producer has after the skip.
Result<std::vector<xfer::Op>> write_piece_ops(const KvBlockLayout& layout, std::span<const PlanPiece> pieces,
                                              int32_t piece, std::span<const RankHeads> producer_heads,
                                              std::span<const RankHeads> consumer_heads,
                                              std::span<const int32_t> producer_blocks, int32_t num_skip_blocks,
                                              std::span<const int32_t> consumer_blocks);
// The ops of one READ batch, posted by the consumer: plan piece `piece` from the producer's
// blocks into the consumer's, pair by pair. kInternal when the piece is outside the plan or
// names a rank outside a head map.
Result<std::vector<xfer::Op>> read_piece_ops(const KvBlockLayout& layout, std::span<const PlanPiece> pieces,
                                             int32_t piece, std::span<const RankHeads> producer_heads,
                                             std::span<const RankHeads> consumer_heads,
                                             std::span<const int32_t> producer_blocks,
                                             std::span<const int32_t> consumer_blocks);

}  // namespace pd::connector
