#include "connector/transfer_plan.h"

#include <algorithm>

namespace pd::connector {

Status validate_head_map(int32_t num_kv_heads, std::span<const RankHeads> ranks) {
  if (num_kv_heads < 1) return invalid_argument("head map: {} KV heads", num_kv_heads);
  if (ranks.empty() || ranks.size() > static_cast<size_t>(kMaxTpSize)) {
    return invalid_argument("head map: {} ranks, expected [1, {}]", ranks.size(), kMaxTpSize);
  }
  std::vector<bool> held(static_cast<size_t>(num_kv_heads), false);
  for (size_t r = 0; r < ranks.size(); ++r) {
    const RankHeads& h = ranks[r];
    if (h.count < 1 || h.begin < 0 || static_cast<int64_t>(h.begin) + h.count > num_kv_heads) {
      return invalid_argument("head map: rank {} holds heads [{}, {}), outside the model's {} KV heads", r, h.begin,
                              static_cast<int64_t>(h.begin) + h.count, num_kv_heads);
    }
    for (int32_t i = h.begin; i < h.begin + h.count; ++i) held[static_cast<size_t>(i)] = true;
  }
  for (int32_t i = 0; i < num_kv_heads; ++i) {
    if (!held[static_cast<size_t>(i)]) return invalid_argument("head map: KV head {} is held by no rank", i);
  }
  return Status::Ok();
}

std::vector<PlanPiece> TransferPlan::pieces() const {
  std::vector<PlanPiece> out;
  for (const auto& batch : batches) out.insert(out.end(), batch.pieces.begin(), batch.pieces.end());
  return out;
}

Result<TransferPlan> plan_transfer(int32_t num_kv_heads, std::span<const RankHeads> producer,
                                   std::span<const RankHeads> consumer) {
  PD_RETURN_IF_ERROR(validate_head_map(num_kv_heads, producer).with_context("producer"));
  PD_RETURN_IF_ERROR(validate_head_map(num_kv_heads, consumer).with_context("consumer"));
  auto holds = [&](int32_t rank, int32_t head) {
    const RankHeads& h = producer[static_cast<size_t>(rank)];
    return head >= h.begin && head < h.begin + h.count;
  };
  TransferPlan plan;
  for (size_t c = 0; c < consumer.size(); ++c) {
    ConsumerBatch batch;
    batch.consumer_rank = static_cast<int32_t>(c);
    const RankHeads& want = consumer[c];
    for (int32_t head = want.begin; head < want.begin + want.count; ++head) {
      // Keep taking from the producer rank of the previous head while it holds
      // this one too: fewer, longer pieces.
      if (!batch.pieces.empty() && holds(batch.pieces.back().producer_rank, head)) {
        ++batch.pieces.back().num_heads;
        continue;
      }
      std::vector<int32_t> holders;
      for (size_t p = 0; p < producer.size(); ++p) {
        if (holds(static_cast<int32_t>(p), head)) holders.push_back(static_cast<int32_t>(p));
      }
      // validate_head_map proved every head has a holder. Replicas: consumer
      // rank c takes the (c mod replicas)-th, so the replicas share the load.
      const int32_t from = holders[c % holders.size()];
      batch.pieces.push_back(PlanPiece{from, static_cast<int32_t>(c), head, 1});
    }
    plan.batches.push_back(std::move(batch));
  }
  return plan;
}

uint64_t KvBlockLayout::block_bytes(int32_t num_heads) const {
  uint64_t bytes = 0;
  for (uint64_t row : section_row_bytes)
    bytes += row * static_cast<uint64_t>(block_size) * static_cast<uint64_t>(num_heads);
  return bytes;
}

void append_piece_ops(const KvBlockLayout& layout, const PlanPiece& piece, const RankHeads& producer_rank,
                      const RankHeads& consumer_rank, std::span<const int32_t> blocks_producer,
                      std::span<const int32_t> blocks_consumer, bool local_is_producer, std::vector<xfer::Op>& out) {
  const uint64_t p_block = layout.block_bytes(producer_rank.count);
  const uint64_t c_block = layout.block_bytes(consumer_rank.count);
  auto push = [&](uint64_t p_offset, uint64_t c_offset, uint64_t bytes) {
    out.push_back(local_is_producer ? xfer::Op{p_offset, c_offset, bytes} : xfer::Op{c_offset, p_offset, bytes});
  };
  const size_t n = std::min(blocks_producer.size(), blocks_consumer.size());
  const bool whole = piece.num_heads == producer_rank.count && piece.num_heads == consumer_rank.count;
  const auto p_head = static_cast<uint64_t>(piece.head_begin - producer_rank.begin);
  const auto c_head = static_cast<uint64_t>(piece.head_begin - consumer_rank.begin);
  const auto bs = static_cast<uint64_t>(layout.block_size);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t p_base = static_cast<uint64_t>(blocks_producer[i]) * p_block;
    const uint64_t c_base = static_cast<uint64_t>(blocks_consumer[i]) * c_block;
    if (whole) {
      push(p_base, c_base, p_block);
      continue;
    }
    uint64_t p_section = p_base, c_section = c_base;
    for (uint64_t row : layout.section_row_bytes) {
      for (uint64_t t = 0; t < bs; ++t) {
        push(p_section + (t * static_cast<uint64_t>(producer_rank.count) + p_head) * row,
             c_section + (t * static_cast<uint64_t>(consumer_rank.count) + c_head) * row,
             static_cast<uint64_t>(piece.num_heads) * row);
      }
      p_section += bs * static_cast<uint64_t>(producer_rank.count) * row;
      c_section += bs * static_cast<uint64_t>(consumer_rank.count) * row;
    }
  }
}

namespace {

Result<PlanPiece> checked_piece(std::span<const PlanPiece> pieces, int32_t piece,
                                std::span<const RankHeads> producer_heads, std::span<const RankHeads> consumer_heads) {
  if (piece < 0 || static_cast<size_t>(piece) >= pieces.size()) {
    return internal_error("plan piece {} of {}", piece, pieces.size());
  }
  const PlanPiece& p = pieces[static_cast<size_t>(piece)];
  if (p.producer_rank < 0 || static_cast<size_t>(p.producer_rank) >= producer_heads.size() || p.consumer_rank < 0 ||
      static_cast<size_t>(p.consumer_rank) >= consumer_heads.size()) {
    return internal_error("plan piece {} names producer rank {} of {} and consumer rank {} of {}", piece,
                          p.producer_rank, producer_heads.size(), p.consumer_rank, consumer_heads.size());
  }
  return p;
}

}  // namespace

Result<std::vector<xfer::Op>> write_piece_ops(const KvBlockLayout& layout, std::span<const PlanPiece> pieces,
                                              int32_t piece, std::span<const RankHeads> producer_heads,
                                              std::span<const RankHeads> consumer_heads,
                                              std::span<const int32_t> producer_blocks, int32_t num_skip_blocks,
                                              std::span<const int32_t> consumer_blocks) {
  if (num_skip_blocks < 0 || static_cast<size_t>(num_skip_blocks) + consumer_blocks.size() > producer_blocks.size()) {
    return internal_error("{} local blocks for {} + {} destination blocks", producer_blocks.size(), num_skip_blocks,
                          consumer_blocks.size());
  }
  PD_ASSIGN_OR_RETURN(PlanPiece p, checked_piece(pieces, piece, producer_heads, consumer_heads));
  std::vector<xfer::Op> ops;
  append_piece_ops(layout, p, producer_heads[static_cast<size_t>(p.producer_rank)],
                   consumer_heads[static_cast<size_t>(p.consumer_rank)],
                   producer_blocks.subspan(static_cast<size_t>(num_skip_blocks)), consumer_blocks,
                   /*local_is_producer=*/true, ops);
  return ops;
}

Result<std::vector<xfer::Op>> read_piece_ops(const KvBlockLayout& layout, std::span<const PlanPiece> pieces,
                                             int32_t piece, std::span<const RankHeads> producer_heads,
                                             std::span<const RankHeads> consumer_heads,
                                             std::span<const int32_t> producer_blocks,
                                             std::span<const int32_t> consumer_blocks) {
  PD_ASSIGN_OR_RETURN(PlanPiece p, checked_piece(pieces, piece, producer_heads, consumer_heads));
  std::vector<xfer::Op> ops;
  append_piece_ops(layout, p, producer_heads[static_cast<size_t>(p.producer_rank)],
                   consumer_heads[static_cast<size_t>(p.consumer_rank)], producer_blocks, consumer_blocks,
                   /*local_is_producer=*/false, ops);
  return ops;
}

}  // namespace pd::connector
