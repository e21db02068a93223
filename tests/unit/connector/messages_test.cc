#include "connector/messages.h"

#include <gtest/gtest.h>
#include <msgpack.hpp>

#include <random>

namespace pd::connector {
namespace {

const std::string kTransfer = "0123456789abcdef0123456789abcdef";

ControlMessage base(MessageType type) {
  ControlMessage m;
  m.type = type;
  m.instance_id = "prefill-0";
  m.boot_nonce = 0xfeedfacecafebeefULL;
  m.transfer_id = kTransfer;
  return m;
}

ControlMessage meta() {
  ControlMessage m = base(MessageType::kMeta);
  m.transfer_id.clear();
  m.engine_desc = {1, 2, 3};
  m.layer_descs = {{4, 5}, {6}};
  m.fingerprint = KvFingerprint{2, 4, 64, "float32", 16, 1, {}};
  m.num_blocks = 512;
  return m;
}

TEST(ControlMessages, EveryTypeRoundTrips) {
  std::vector<ControlMessage> messages = {meta()};
  auto meta_ok = meta();
  meta_ok.type = MessageType::kMetaOk;
  messages.push_back(meta_ok);
  auto blocks = base(MessageType::kBlocks);
  blocks.block_ids = {7, 3, 0, 2147483647};
  blocks.num_skip_blocks = 2;
  blocks.num_tokens = 99;
  blocks.kv_tokens = 98;
  messages.push_back(blocks);
  auto read = base(MessageType::kRead);
  read.block_ids = {1, 2};
  read.num_tokens = 20;
  read.kv_tokens = 20;
  messages.push_back(read);
  auto done = base(MessageType::kDone);
  done.ok = true;
  done.num_tokens = 99;
  done.text = "fine";
  messages.push_back(done);
  auto done_with_token = done;
  done_with_token.first_token = 151643;
  done_with_token.sampling_key = 0xfedcba9876543210ULL;
  messages.push_back(done_with_token);
  auto read_ok_with_token = base(MessageType::kReadOk);
  read_ok_with_token.first_token = 0;
  read_ok_with_token.sampling_key = 1;
  messages.push_back(read_ok_with_token);
  auto abort = base(MessageType::kAbort);
  abort.text = "why";
  messages.push_back(abort);
  messages.push_back(base(MessageType::kRelease));
  messages.push_back(base(MessageType::kReadOk));
  auto error = base(MessageType::kError);
  error.transfer_id.clear();
  error.text = "layout mismatch";
  messages.push_back(error);
  auto refusal = base(MessageType::kError);
  refusal.text = "block 3 does not belong";
  refusal.invalid_params = true;
  messages.push_back(refusal);
  for (const auto& m : messages) {
    auto decoded = decode_message(encode_message(m));
    ASSERT_TRUE(decoded.ok()) << message_type_name(m.type) << ": " << decoded.status().to_string();
    EXPECT_EQ(decoded->type, m.type);
    EXPECT_EQ(decoded->instance_id, m.instance_id);
    EXPECT_EQ(decoded->boot_nonce, m.boot_nonce);
    EXPECT_EQ(decoded->transfer_id, m.transfer_id);
    EXPECT_EQ(decoded->block_ids, m.block_ids);
    EXPECT_EQ(decoded->num_skip_blocks, m.num_skip_blocks);
    EXPECT_EQ(decoded->num_tokens, m.num_tokens);
    EXPECT_EQ(decoded->kv_tokens, m.kv_tokens);
    EXPECT_EQ(decoded->first_token, m.first_token);
    EXPECT_EQ(decoded->sampling_key, m.sampling_key);
    EXPECT_EQ(decoded->ok, m.ok);
    EXPECT_EQ(decoded->text, m.text);
    EXPECT_EQ(decoded->invalid_params, m.invalid_params);
    EXPECT_EQ(decoded->engine_desc, m.engine_desc);
    EXPECT_EQ(decoded->layer_descs, m.layer_descs);
    EXPECT_EQ(decoded->fingerprint, m.fingerprint);
    EXPECT_EQ(decoded->num_blocks, m.num_blocks);
  }
}

std::vector<uint8_t> pack_map(const std::map<std::string, msgpack::object>& fields, msgpack::zone& zone) {
  (void)zone;
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> pk(buffer);
  pk.pack(fields);
  return {reinterpret_cast<const uint8_t*>(buffer.data()),
          reinterpret_cast<const uint8_t*>(buffer.data()) + buffer.size()};
}

TEST(ControlMessages, RefusesMalformedFramesNamingTheProblem) {
  msgpack::zone zone;
  auto base_fields = [&] {
    std::map<std::string, msgpack::object> f;
    f["v"] = msgpack::object(kProtocolVersion, zone);
    f["type"] = msgpack::object(std::string("release"), zone);
    f["instance_id"] = msgpack::object(std::string("x"), zone);
    f["boot_nonce"] = msgpack::object(5u, zone);
    f["tp_rank"] = msgpack::object(0u, zone);
    f["transfer_id"] = msgpack::object(kTransfer, zone);
    return f;
  };
  ASSERT_TRUE(decode_message(pack_map(base_fields(), zone)).ok());

  struct Case {
    std::function<void(std::map<std::string, msgpack::object>&)> mutate;
    const char* fragment;
  };
  const Case cases[] = {
      {[&](auto& f) { f["v"] = msgpack::object(1u, zone); }, "protocol version 1"},
      {[&](auto& f) {
         f["type"] = msgpack::object(std::string("read_ok"), zone);
         f["first_token"] = msgpack::object(5u, zone);
       },
       "come together"},
      {[&](auto& f) {
         f["type"] = msgpack::object(std::string("read_ok"), zone);
         f["first_token"] = msgpack::object(uint64_t{1} << 40, zone);
         f["sampling_key"] = msgpack::object(5u, zone);
       },
       "first_token"},
      {[&](auto& f) {
         f["type"] = msgpack::object(std::string("read"), zone);
         f["block_ids"] = msgpack::object(std::vector<uint32_t>{1}, zone);
         f["num_tokens"] = msgpack::object(4u, zone);
         f["kv_tokens"] = msgpack::object(5u, zone);
       },
       "exceeds"},
      {[&](auto& f) { f["type"] = msgpack::object(std::string("steal"), zone); }, "unknown message type"},
      {[&](auto& f) { f.erase("instance_id"); }, "instance_id"},
      {[&](auto& f) { f["instance_id"] = msgpack::object(std::string(200, 'a'), zone); }, "instance_id"},
      {[&](auto& f) { f["boot_nonce"] = msgpack::object(-1, zone); }, "boot_nonce"},
      {[&](auto& f) { f["transfer_id"] = msgpack::object(std::string("not-hex"), zone); }, "transfer_id"},
      {[&](auto& f) { f["extra"] = msgpack::object(1u, zone); }, "unknown key 'extra'"},
      {[&](auto& f) { f["tp_rank"] = msgpack::object(5000u, zone); }, "tp_rank"},
  };
  for (const auto& c : cases) {
    auto fields = base_fields();
    c.mutate(fields);
    auto decoded = decode_message(pack_map(fields, zone));
    ASSERT_FALSE(decoded.ok()) << c.fragment;
    EXPECT_NE(decoded.status().message().find(c.fragment), std::string::npos) << decoded.status().message();
  }
}

TEST(ControlMessages, RefusesGarbageTruncationAndTrailingBytes) {
  EXPECT_FALSE(decode_message({}).ok());
  const std::vector<uint8_t> garbage = {0xc1, 0xff, 0x00};
  EXPECT_FALSE(decode_message(garbage).ok());
  auto frame = encode_message(meta());
  for (size_t cut = 0; cut < frame.size(); ++cut) {
    EXPECT_FALSE(decode_message(std::span<const uint8_t>(frame.data(), cut)).ok()) << cut;
  }
  frame.push_back(0x00);
  EXPECT_FALSE(decode_message(frame).ok());
}

TEST(ControlMessages, RefusesBlockIdsThatAreNotInt32) {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> pk(buffer);
  pk.pack_map(10);
  pk.pack(std::string("v"));
  pk.pack(kProtocolVersion);
  pk.pack(std::string("type"));
  pk.pack(std::string("blocks"));
  pk.pack(std::string("instance_id"));
  pk.pack(std::string("c"));
  pk.pack(std::string("boot_nonce"));
  pk.pack(1u);
  pk.pack(std::string("tp_rank"));
  pk.pack(0u);
  pk.pack(std::string("transfer_id"));
  pk.pack(kTransfer);
  pk.pack(std::string("block_ids"));
  pk.pack_array(2);
  pk.pack(1u);
  pk.pack(uint64_t{1} << 40);
  pk.pack(std::string("num_tokens"));
  pk.pack(10u);
  pk.pack(std::string("kv_tokens"));
  pk.pack(9u);
  pk.pack(std::string("num_skip_blocks"));
  pk.pack(0u);
  auto decoded = decode_message({reinterpret_cast<const uint8_t*>(buffer.data()), buffer.size()});
  ASSERT_FALSE(decoded.ok());
  EXPECT_NE(decoded.status().message().find("block_ids[1]"), std::string::npos);
}

TEST(ControlMessages, RefusesAKeyGivenTwice) {
  // {"ok": true, "ok": false} would read as true here and as false to another decoder.
  auto pack_done = [](bool twice) {
    msgpack::sbuffer buffer;
    msgpack::packer<msgpack::sbuffer> pk(buffer);
    pk.pack_map(twice ? 9 : 8);
    pk.pack(std::string("v")), pk.pack(kProtocolVersion);
    pk.pack(std::string("type")), pk.pack(std::string("done"));
    pk.pack(std::string("instance_id")), pk.pack(std::string("c"));
    pk.pack(std::string("boot_nonce")), pk.pack(1u);
    pk.pack(std::string("tp_rank")), pk.pack(0u);
    pk.pack(std::string("transfer_id")), pk.pack(kTransfer);
    pk.pack(std::string("ok")), pk.pack(true);
    if (twice) pk.pack(std::string("ok")), pk.pack(false);
    pk.pack(std::string("num_tokens")), pk.pack(10u);
    return std::vector<uint8_t>(reinterpret_cast<const uint8_t*>(buffer.data()),
                                reinterpret_cast<const uint8_t*>(buffer.data()) + buffer.size());
  };
  ASSERT_TRUE(decode_message(pack_done(false)).ok());
  auto decoded = decode_message(pack_done(true));
  ASSERT_FALSE(decoded.ok());
  EXPECT_NE(decoded.status().message().find("'ok' given twice"), std::string::npos) << decoded.status().message();
}

TEST(ControlMessages, MetaLayerCountMustMatchTheFingerprint) {
  auto m = meta();
  m.layer_descs.push_back({9});
  auto decoded = decode_message(encode_message(m));
  ASSERT_FALSE(decoded.ok());
  EXPECT_NE(decoded.status().message().find("num_layers"), std::string::npos);
}

TEST(ControlMessages, RandomMutationsNeverCrashTheDecoder) {
  std::mt19937 rng(1234);
  std::vector<std::vector<uint8_t>> seeds = {encode_message(meta()), encode_message(base(MessageType::kDone))};
  auto blocks = base(MessageType::kBlocks);
  blocks.block_ids = {1, 2, 3};
  seeds.push_back(encode_message(blocks));
  int num_refused = 0;
  for (int i = 0; i < 20000; ++i) {
    auto frame = seeds[i % seeds.size()];
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) frame[rng() % frame.size()] = static_cast<uint8_t>(rng());
    if (!decode_message(frame).ok()) ++num_refused;
  }
  EXPECT_GT(num_refused, 10000);
}

TEST(KvFingerprint, MismatchNamesEveryDifferingField) {
  KvFingerprint local{32, 8, 128, "bfloat16", 16, 1, {}};
  KvFingerprint remote = local;
  EXPECT_TRUE(check_layout_compatible(local, remote).ok());
  remote.head_dim = 64;
  remote.dtype = "float32";
  Status status = check_layout_compatible(local, remote);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), ErrorCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("head_dim 128 here vs 64 at the peer"), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("dtype bfloat16 here vs float32"), std::string::npos);
  EXPECT_EQ(status.message().find("num_layers"), std::string::npos);
}

TEST(KvFingerprint, DifferentTpSizesAreCompatibleAndTheModelShapeMustStillMatch) {
  const KvFingerprint tp1{2, 2, 32, "float32", 16, 1, {}};
  const KvFingerprint tp4{2, 2, 32, "float32", 16, 4, {{0, 1}, {0, 1}, {1, 1}, {1, 1}}};
  EXPECT_TRUE(check_layout_compatible(tp1, tp4).ok());
  EXPECT_TRUE(check_layout_compatible(tp4, tp1).ok());
  EXPECT_EQ(tp1.ranks(), (std::vector<RankHeads>{{0, 2}}));
  KvFingerprint other_model = tp4;
  other_model.num_kv_heads = 4;
  other_model.head_map = {{0, 1}, {1, 1}, {2, 1}, {3, 1}};
  other_model.block_size = 32;
  Status status = check_layout_compatible(tp1, other_model);
  EXPECT_EQ(status.code(), ErrorCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("num_kv_heads 2 here vs 4 at the peer"), std::string::npos) << status.message();
  EXPECT_NE(status.message().find("block_size 16 here vs 32"), std::string::npos) << status.message();
  // A head map that leaves a head out, or does not have tp_size ranks, is refused.
  KvFingerprint hole = tp4;
  hole.head_map = {{0, 1}, {0, 1}, {0, 1}, {0, 1}};
  status = check_layout_compatible(tp1, hole);
  EXPECT_EQ(status.code(), ErrorCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("KV head 1 is held by no rank"), std::string::npos) << status.message();
  KvFingerprint short_map = tp4;
  short_map.head_map.pop_back();
  EXPECT_FALSE(check_layout_compatible(tp1, short_map).ok());
}

TEST(ControlMessages, MetaCarriesTheHeadMapAndOneRegionPerRankPerLayer) {
  auto m = meta();
  m.fingerprint = KvFingerprint{2, 2, 64, "float32", 16, 2, {{0, 1}, {1, 1}}};
  m.layer_descs = {{1}, {2}, {3}, {4}};
  auto decoded = decode_message(encode_message(m));
  ASSERT_TRUE(decoded.ok()) << decoded.status().to_string();
  EXPECT_EQ(decoded->fingerprint, m.fingerprint);
  EXPECT_EQ(decoded->layer_descs, m.layer_descs);
  // Regions for one rank only.
  auto too_few = m;
  too_few.layer_descs.resize(2);
  decoded = decode_message(encode_message(too_few));
  ASSERT_FALSE(decoded.ok());
  EXPECT_NE(decoded.status().message().find("num_layers x tp_size"), std::string::npos);
  // tp_size > 1 without a head map.
  auto no_map = m;
  no_map.fingerprint.head_map.clear();
  decoded = decode_message(encode_message(no_map));
  ASSERT_FALSE(decoded.ok());
  EXPECT_NE(decoded.status().message().find("'head_map' is required"), std::string::npos);
  // A head map naming heads the model does not have.
  auto outside = m;
  outside.fingerprint.head_map = {{0, 1}, {1, 2}};
  decoded = decode_message(encode_message(outside));
  ASSERT_FALSE(decoded.ok());
  EXPECT_NE(decoded.status().message().find("rank 1 holds heads [1, 3)"), std::string::npos)
      << decoded.status().message();
  // A TP-1 fingerprint leaves the head map out, as frames of builds without it.
  auto tp1 = meta();
  const auto frame = encode_message(tp1);
  const std::string bytes(frame.begin(), frame.end());
  EXPECT_EQ(bytes.find("head_map"), std::string::npos);
  auto too_many = m;
  too_many.fingerprint.tp_size = kMaxTpSize + 1;
  too_many.fingerprint.head_map.assign(kMaxTpSize + 1, RankHeads{0, 2});
  too_many.layer_descs.assign(2 * (kMaxTpSize + 1), {1});
  EXPECT_FALSE(decode_message(encode_message(too_many)).ok());
}

TEST(TransferIds, AreExactly32HexDigits) {
  EXPECT_TRUE(is_valid_transfer_id(kTransfer));
  EXPECT_TRUE(is_valid_transfer_id("ABCDEF0123456789ABCDEF0123456789"));
  EXPECT_FALSE(is_valid_transfer_id(kTransfer.substr(1)));
  EXPECT_FALSE(is_valid_transfer_id("0123456789abcdef0123456789abcdeg"));
  EXPECT_FALSE(is_valid_transfer_id(""));
}

}  // namespace
}  // namespace pd::connector
