#include "connector/transfer_plan.h"

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>

namespace pd::connector {
namespace {

// The head map a runner of tp ranks has for a model of num_kv_heads (model::TpSplit):
// contiguous equal ranges when tp divides the heads, one head on tp / heads ranks each
// when the heads divide tp. Empty when neither divides the other (refused at start-up).
std::vector<RankHeads> runner_head_map(int32_t num_kv_heads, int32_t tp) {
  std::vector<RankHeads> out;
  if (tp <= num_kv_heads) {
    if (num_kv_heads % tp != 0) return out;
    for (int32_t r = 0; r < tp; ++r) out.push_back({r * (num_kv_heads / tp), num_kv_heads / tp});
  } else {
    if (tp % num_kv_heads != 0) return out;
    for (int32_t r = 0; r < tp; ++r) out.push_back({r * num_kv_heads / tp, 1});
  }
  return out;
}

// Checks the plan's promises: one batch per consumer rank, in order; its pieces
// cover exactly the rank's heads, in order, each from a producer rank holding them.
void expect_plan_covers_each_consumer_head_once(const TransferPlan& plan, std::span<const RankHeads> producer,
                                                std::span<const RankHeads> consumer, const std::string& what) {
  ASSERT_EQ(plan.batches.size(), consumer.size()) << what;
  for (size_t c = 0; c < consumer.size(); ++c) {
    const ConsumerBatch& batch = plan.batches[c];
    EXPECT_EQ(batch.consumer_rank, static_cast<int32_t>(c)) << what;
    int32_t next = consumer[c].begin;
    for (const PlanPiece& piece : batch.pieces) {
      EXPECT_EQ(piece.consumer_rank, static_cast<int32_t>(c)) << what;
      EXPECT_EQ(piece.head_begin, next) << what << ": a gap or a head sent twice in consumer rank " << c;
      EXPECT_GE(piece.num_heads, 1) << what;
      ASSERT_GE(piece.producer_rank, 0) << what;
      ASSERT_LT(piece.producer_rank, static_cast<int32_t>(producer.size())) << what;
      const RankHeads& p = producer[static_cast<size_t>(piece.producer_rank)];
      EXPECT_GE(piece.head_begin, p.begin) << what << ": producer rank " << piece.producer_rank << " lacks the heads";
      EXPECT_LE(piece.head_begin + piece.num_heads, p.begin + p.count) << what;
      next = piece.head_begin + piece.num_heads;
    }
    EXPECT_EQ(next, consumer[c].begin + consumer[c].count) << what << ": consumer rank " << c << " not covered";
  }
  size_t num_pieces = 0;
  for (const auto& b : plan.batches) num_pieces += b.pieces.size();
  EXPECT_EQ(plan.pieces().size(), num_pieces);
}

// Each rank's cache as bytes: num_blocks blocks of `layout` with the rank's heads.
// A producer byte encodes (block, section, token, model head, byte) so that a
// misplaced copy shows.
uint8_t pattern(int32_t block, size_t section, uint64_t token, int32_t head, uint64_t byte) {
  return static_cast<uint8_t>(block * 131 + static_cast<int32_t>(section) * 61 + static_cast<int32_t>(token) * 29 +
                              head * 17 + static_cast<int32_t>(byte) * 7 + 1);
}

// Moves the plan's bytes from producer-rank caches into zeroed consumer-rank caches
// and checks every consumer byte: written exactly once, with its head's value.
void expect_ops_move_every_head(const KvBlockLayout& layout, int32_t num_blocks, const TransferPlan& plan,
                                std::span<const RankHeads> producer, std::span<const RankHeads> consumer,
                                bool local_is_producer, const std::string& what) {
  std::vector<std::vector<uint8_t>> p_mem(producer.size()), c_mem(consumer.size());
  std::vector<std::vector<int>> c_writes(consumer.size());
  const uint64_t bs = static_cast<uint64_t>(layout.block_size);
  for (size_t r = 0; r < producer.size(); ++r) {
    p_mem[r].resize(layout.block_bytes(producer[r].count) * static_cast<uint64_t>(num_blocks));
    for (int32_t b = 0; b < num_blocks; ++b) {
      uint64_t off = static_cast<uint64_t>(b) * layout.block_bytes(producer[r].count);
      for (size_t s = 0; s < layout.section_row_bytes.size(); ++s)
        for (uint64_t t = 0; t < bs; ++t)
          for (int32_t h = 0; h < producer[r].count; ++h)
            for (uint64_t x = 0; x < layout.section_row_bytes[s]; ++x)
              p_mem[r][off++] = pattern(b, s, t, producer[r].begin + h, x);
    }
  }
  for (size_t r = 0; r < consumer.size(); ++r) {
    c_mem[r].assign(layout.block_bytes(consumer[r].count) * static_cast<uint64_t>(num_blocks), 0);
    c_writes[r].assign(c_mem[r].size(), 0);
  }
  // Producer block i goes to consumer block num_blocks - 1 - i (ids need not match).
  std::vector<int32_t> p_ids, c_ids;
  for (int32_t b = 0; b < num_blocks; ++b) {
    p_ids.push_back(b);
    c_ids.push_back(num_blocks - 1 - b);
  }
  for (const PlanPiece& piece : plan.pieces()) {
    std::vector<xfer::Op> ops;
    const auto pr = static_cast<size_t>(piece.producer_rank), cr = static_cast<size_t>(piece.consumer_rank);
    append_piece_ops(layout, piece, producer[pr], consumer[cr], p_ids, c_ids, local_is_producer, ops);
    for (const xfer::Op& op : ops) {
      const uint64_t p_off = local_is_producer ? op.local_offset : op.remote_offset;
      const uint64_t c_off = local_is_producer ? op.remote_offset : op.local_offset;
      ASSERT_LE(p_off + op.bytes, p_mem[pr].size()) << what << ": op outside the producer rank's region";
      ASSERT_LE(c_off + op.bytes, c_mem[cr].size()) << what << ": op outside the consumer rank's region";
      std::memcpy(c_mem[cr].data() + c_off, p_mem[pr].data() + p_off, op.bytes);
      for (uint64_t i = 0; i < op.bytes; ++i) ++c_writes[cr][c_off + i];
    }
  }
  for (size_t r = 0; r < consumer.size(); ++r) {
    for (int32_t b = 0; b < num_blocks; ++b) {
      const int32_t from_block = num_blocks - 1 - b;
      uint64_t off = static_cast<uint64_t>(b) * layout.block_bytes(consumer[r].count);
      for (size_t s = 0; s < layout.section_row_bytes.size(); ++s)
        for (uint64_t t = 0; t < bs; ++t)
          for (int32_t h = 0; h < consumer[r].count; ++h)
            for (uint64_t x = 0; x < layout.section_row_bytes[s]; ++x, ++off) {
              ASSERT_EQ(c_writes[r][off], 1) << what << ": consumer rank " << r << " byte " << off;
              ASSERT_EQ(c_mem[r][off], pattern(from_block, s, t, consumer[r].begin + h, x))
                  << what << ": consumer rank " << r << " block " << b << " head " << consumer[r].begin + h;
            }
    }
  }
}

TEST(TransferPlan, EveryProducerAndConsumerTpFromOneToEightAndOneToEightKvHeads) {
  // Odd row sizes and two kinds of section (like fp8 codes and scales).
  const KvBlockLayout layout{2, {3, 3, 2, 2}};
  int32_t num_pairs = 0;
  for (int32_t heads = 1; heads <= 8; ++heads) {
    for (int32_t ptp = 1; ptp <= 8; ++ptp) {
      for (int32_t ctp = 1; ctp <= 8; ++ctp) {
        const auto producer = runner_head_map(heads, ptp);
        const auto consumer = runner_head_map(heads, ctp);
        if (producer.empty() || consumer.empty()) continue;
        const std::string what = fmt::format("{} kv heads, producer tp {}, consumer tp {}", heads, ptp, ctp);
        auto plan = plan_transfer(heads, producer, consumer);
        ASSERT_TRUE(plan.ok()) << what << ": " << plan.status().to_string();
        expect_plan_covers_each_consumer_head_once(*plan, producer, consumer, what);
        expect_ops_move_every_head(layout, 3, *plan, producer, consumer, /*local_is_producer=*/(ptp + ctp) % 2 == 0,
                                   what);
        ++num_pairs;
      }
    }
  }
  // Runner-valid TP sizes in 1..8 for 1..8 heads: 8, 5, 3, 4, 2, 4, 2, 4; every pair of each.
  EXPECT_EQ(num_pairs, 64 + 25 + 9 + 16 + 4 + 16 + 4 + 16);
}

TEST(TransferPlan, EqualShardsAreOnePiecePerRankAndOneOpPerBlock) {
  const auto map = runner_head_map(8, 4);
  auto plan = plan_transfer(8, map, map);
  ASSERT_TRUE(plan.ok());
  const auto pieces = plan->pieces();
  ASSERT_EQ(pieces.size(), 4u);
  for (int32_t r = 0; r < 4; ++r) EXPECT_EQ(pieces[r], (PlanPiece{r, r, 2 * r, 2}));
  std::vector<xfer::Op> ops;
  const KvBlockLayout layout{16, {128, 128}};
  const std::vector<int32_t> p{5, 6}, c{9, 2};
  append_piece_ops(layout, pieces[1], map[1], map[1], p, c, /*local_is_producer=*/true, ops);
  const uint64_t block = layout.block_bytes(2);
  EXPECT_EQ(ops, (std::vector<xfer::Op>{{5 * block, 9 * block, block}, {6 * block, 2 * block, block}}));
}

TEST(TransferPlan, WritePieceOpsSkipTheBlocksTheConsumerHasAndMapPairByPair) {
  const auto map = runner_head_map(2, 1);
  const std::vector<PlanPiece> pieces{{0, 0, 0, 2}};
  const KvBlockLayout layout{16, {64, 64}};
  const uint64_t block = layout.block_bytes(2);
  // Producer blocks 3 4 5 7 (7: a decode block past the prompt); the consumer had the first one.
  const std::vector<int32_t> local{3, 4, 5, 7}, dest{10, 11};
  auto ops = write_piece_ops(layout, pieces, 0, map, map, local, /*num_skip_blocks=*/1, dest);
  ASSERT_TRUE(ops.ok()) << ops.status().to_string();
  // WRITE: the local side is the producer, so the producer's offset comes first.
  EXPECT_EQ(*ops, (std::vector<xfer::Op>{{4 * block, 10 * block, block}, {5 * block, 11 * block, block}}));
}

TEST(TransferPlan, ReadPieceOpsPutTheConsumerBlockFirst) {
  const auto map = runner_head_map(2, 1);
  const std::vector<PlanPiece> pieces{{0, 0, 0, 2}};
  const KvBlockLayout layout{16, {64, 64}};
  const uint64_t block = layout.block_bytes(2);
  const std::vector<int32_t> remote{8, 9}, local{1, 2};
  auto ops = read_piece_ops(layout, pieces, 0, map, map, remote, local);
  ASSERT_TRUE(ops.ok()) << ops.status().to_string();
  EXPECT_EQ(*ops, (std::vector<xfer::Op>{{1 * block, 8 * block, block}, {2 * block, 9 * block, block}}));
}

TEST(TransferPlan, PieceOpsRefuseWhatDoesNotLineUp) {
  const auto map = runner_head_map(2, 1);
  const std::vector<PlanPiece> pieces{{0, 0, 0, 2}};
  const KvBlockLayout layout{16, {64, 64}};
  const std::vector<int32_t> local{3, 4}, dest{10, 11};
  // More destination blocks than the producer has after the skip.
  auto too_many = write_piece_ops(layout, pieces, 0, map, map, local, 1, dest);
  ASSERT_FALSE(too_many.ok());
  EXPECT_EQ(too_many.status().code(), ErrorCode::kInternal);
  EXPECT_NE(too_many.status().message().find("2 local blocks for 1 + 2 destination blocks"), std::string::npos)
      << too_many.status().message();
  // A piece index outside the plan, either way.
  for (int32_t piece : {-1, 1}) {
    EXPECT_FALSE(write_piece_ops(layout, pieces, piece, map, map, local, 0, dest).ok()) << piece;
    EXPECT_FALSE(read_piece_ops(layout, pieces, piece, map, map, local, dest).ok()) << piece;
  }
  // A piece naming a rank the head maps do not have.
  const std::vector<PlanPiece> stray{{1, 0, 0, 2}};
  auto bad_rank = read_piece_ops(layout, stray, 0, map, map, local, dest);
  ASSERT_FALSE(bad_rank.ok());
  EXPECT_NE(bad_rank.status().message().find("producer rank 1 of 1"), std::string::npos) << bad_rank.status().message();
}

TEST(TransferPlan, SplitMergeAndReplicaChoice) {
  // Producer TP 1 (2 heads) -> consumer TP 2: a split, both consumer ranks read rank 0.
  auto split = plan_transfer(2, runner_head_map(2, 1), runner_head_map(2, 2));
  ASSERT_TRUE(split.ok());
  EXPECT_EQ(split->pieces(), (std::vector<PlanPiece>{{0, 0, 0, 1}, {0, 1, 1, 1}}));
  // Producer TP 2 -> consumer TP 1: a merge, one batch of two pieces.
  auto merge = plan_transfer(2, runner_head_map(2, 2), runner_head_map(2, 1));
  ASSERT_TRUE(merge.ok());
  ASSERT_EQ(merge->batches.size(), 1u);
  EXPECT_EQ(merge->batches[0].pieces, (std::vector<PlanPiece>{{0, 0, 0, 1}, {1, 0, 1, 1}}));
  // Producer TP 4 (each of 2 heads on two ranks) -> consumer TP 4: every producer rank
  // feeds exactly one consumer rank, each head taken from one replica per consumer rank.
  auto replicas = plan_transfer(2, runner_head_map(2, 4), runner_head_map(2, 4));
  ASSERT_TRUE(replicas.ok());
  EXPECT_EQ(replicas->pieces(), (std::vector<PlanPiece>{{0, 0, 0, 1}, {1, 1, 0, 1}, {2, 2, 1, 1}, {3, 3, 1, 1}}));
  // Producer TP 4 -> consumer TP 2: one replica of each head, never both.
  auto pick = plan_transfer(2, runner_head_map(2, 4), runner_head_map(2, 2));
  ASSERT_TRUE(pick.ok());
  EXPECT_EQ(pick->pieces(), (std::vector<PlanPiece>{{0, 0, 0, 1}, {3, 1, 1, 1}}));
}

TEST(TransferPlan, ReplicasShareTheLoad) {
  // 1 KV head on 8 producer ranks, 8 consumer ranks: each producer rank sends once.
  auto plan = plan_transfer(1, runner_head_map(1, 8), runner_head_map(1, 8));
  ASSERT_TRUE(plan.ok());
  std::map<int32_t, int> uses;
  for (const auto& piece : plan->pieces()) ++uses[piece.producer_rank];
  EXPECT_EQ(uses.size(), 8u);
}

TEST(TransferPlan, IrregularOverlappingHeadMapsAreCoveredExactly) {
  // Head maps no runner builds (uneven, overlapping ranges) from a peer are still
  // planned exactly, or refused.
  std::mt19937 rng(11);
  const KvBlockLayout layout{3, {4, 1}};
  for (int iter = 0; iter < 300; ++iter) {
    const int32_t heads = 1 + static_cast<int32_t>(rng() % 8);
    auto random_map = [&]() {
      std::vector<RankHeads> map;
      const int32_t ranks = 1 + static_cast<int32_t>(rng() % 8);
      for (int32_t r = 0; r < ranks; ++r) {
        const int32_t begin = static_cast<int32_t>(rng() % static_cast<uint32_t>(heads));
        const int32_t count = 1 + static_cast<int32_t>(rng() % static_cast<uint32_t>(heads - begin));
        map.push_back({begin, count});
      }
      return map;
    };
    const auto producer = random_map(), consumer = random_map();
    auto plan = plan_transfer(heads, producer, consumer);
    const bool valid = validate_head_map(heads, producer).ok() && validate_head_map(heads, consumer).ok();
    ASSERT_EQ(plan.ok(), valid);
    if (!valid) continue;
    const std::string what = fmt::format("iteration {}", iter);
    expect_plan_covers_each_consumer_head_once(*plan, producer, consumer, what);
    expect_ops_move_every_head(layout, 2, *plan, producer, consumer, iter % 2 == 0, what);
  }
}

TEST(TransferPlan, InvalidHeadMapsAreRefusedByName) {
  const std::vector<RankHeads> ok{{0, 2}};
  EXPECT_NE(validate_head_map(2, std::vector<RankHeads>{{0, 1}}).message().find("KV head 1 is held by no rank"),
            std::string::npos);
  EXPECT_NE(validate_head_map(2, std::vector<RankHeads>{{1, 2}}).message().find("rank 0 holds heads [1, 3)"),
            std::string::npos);
  EXPECT_FALSE(validate_head_map(2, std::vector<RankHeads>{{0, 0}, {0, 2}}).ok());
  EXPECT_FALSE(validate_head_map(2, std::vector<RankHeads>{{-1, 2}}).ok());
  EXPECT_FALSE(validate_head_map(2, std::vector<RankHeads>{}).ok());
  EXPECT_FALSE(validate_head_map(2, std::vector<RankHeads>(kMaxTpSize + 1, RankHeads{0, 2})).ok());
  EXPECT_FALSE(validate_head_map(0, ok).ok());
  EXPECT_FALSE(plan_transfer(2, std::vector<RankHeads>{{0, 1}}, ok).ok());
  EXPECT_FALSE(plan_transfer(2, ok, std::vector<RankHeads>{{0, 1}}).ok());
  EXPECT_TRUE(plan_transfer(2, ok, ok).ok());
}

}  // namespace
}  // namespace pd::connector
