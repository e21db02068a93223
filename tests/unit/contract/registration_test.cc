#include "contract/registration.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <msgpack.hpp>

#include <map>
#include <string>
#include <variant>
#include <vector>

namespace pd::contract {
namespace {

RegistrationRecord producer_record() {
  RegistrationRecord record;
  record.role = Role::kProducer;
  record.http = HostPort{"127.0.0.1", 8100};
  record.control = HostPort{"127.0.0.1", 9100};
  record.instance_id = "p0";
  record.boot_nonce = 0xfedcba9876543210ull;
  record.tp_size = 2;
  record.dp_size = 1;
  record.mode = TransferMode::kRead;
  record.model = "Qwen/Qwen3-8B";
  return record;
}

using Value = std::variant<std::string, uint64_t, int64_t, double, bool>;
using Fields = std::vector<std::pair<std::string, Value>>;

// The map of a valid record, written field by field (as another implementation would).
Fields valid_fields() {
  return {{"v", uint64_t{1}},          {"type", "register"},          {"role", "consumer"},
          {"http", "127.0.0.1:8200"},  {"control", "127.0.0.1:9200"}, {"instance_id", "d0"},
          {"boot_nonce", uint64_t{7}}, {"tp_size", uint64_t{1}},      {"dp_size", uint64_t{1}},
          {"mode", "write"},           {"model", "builtin:tiny"}};
}

std::string pack(const Fields& fields) {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> packer(buffer);
  packer.pack_map(static_cast<uint32_t>(fields.size()));
  for (const auto& [key, value] : fields) {
    packer.pack(key);
    std::visit([&](const auto& v) { packer.pack(v); }, value);
  }
  return std::string(buffer.data(), buffer.size());
}

Result<RegistrationRecord> decode(const Fields& fields) {
  const std::string bytes = pack(fields);
  return decode_registration(bytes.data(), bytes.size());
}

Fields with(Fields fields, const std::string& key, Value value) {
  for (auto& [k, v] : fields) {
    if (k == key) {
      v = std::move(value);
      return fields;
    }
  }
  fields.emplace_back(key, std::move(value));
  return fields;
}

Fields without(Fields fields, const std::string& key) {
  std::erase_if(fields, [&](const auto& kv) { return kv.first == key; });
  return fields;
}

TEST(Registration, RoundTripsThroughMsgpack) {
  const RegistrationRecord record = producer_record();
  const std::vector<uint8_t> frame = encode_registration(record);
  auto decoded = decode_registration(frame.data(), frame.size());
  ASSERT_TRUE(decoded.ok()) << decoded.status().to_string();
  EXPECT_EQ(*decoded, record);
}

TEST(Registration, RoundTripsThroughJson) {
  RegistrationRecord record = producer_record();
  record.http = HostPort{"::1", 8100};
  auto decoded = registration_from_json(nlohmann::json::parse(registration_to_json(record).dump()));
  ASSERT_TRUE(decoded.ok()) << decoded.status().to_string();
  EXPECT_EQ(*decoded, record);
}

TEST(Registration, TheFrameIsTheVersionedMapInContractOrderWithUnsignedIntegers) {
  const std::vector<uint8_t> frame = encode_registration(producer_record());
  msgpack::object_handle handle = msgpack::unpack(reinterpret_cast<const char*>(frame.data()), frame.size());
  const msgpack::object& root = handle.get();
  ASSERT_EQ(root.type, msgpack::type::MAP);
  const std::vector<std::string> keys = {"v",          "type",    "role",    "http", "control", "instance_id",
                                         "boot_nonce", "tp_size", "dp_size", "mode", "model"};
  ASSERT_EQ(root.via.map.size, keys.size());
  for (uint32_t i = 0; i < root.via.map.size; ++i) {
    const auto& kv = root.via.map.ptr[i];
    ASSERT_EQ(kv.key.type, msgpack::type::STR);
    const std::string key(kv.key.via.str.ptr, kv.key.via.str.size);
    EXPECT_EQ(key, keys[i]);
    const bool is_integer = key == "v" || key == "boot_nonce" || key == "tp_size" || key == "dp_size";
    EXPECT_EQ(kv.val.type, is_integer ? msgpack::type::POSITIVE_INTEGER : msgpack::type::STR) << key;
  }
  EXPECT_EQ(root.via.map.ptr[0].val.via.u64, 1u);
  EXPECT_EQ(std::string(root.via.map.ptr[1].val.via.str.ptr, root.via.map.ptr[1].val.via.str.size), "register");
}

TEST(Registration, JsonHasTheSameFieldsWithoutVersionAndType) {
  const nlohmann::json json = registration_to_json(producer_record());
  EXPECT_EQ(json, (nlohmann::json{{"role", "producer"},
                                  {"http", "127.0.0.1:8100"},
                                  {"control", "127.0.0.1:9100"},
                                  {"instance_id", "p0"},
                                  {"boot_nonce", 0xfedcba9876543210ull},
                                  {"tp_size", 2},
                                  {"dp_size", 1},
                                  {"mode", "read"},
                                  {"model", "Qwen/Qwen3-8B"}}));
}

TEST(Registration, AcceptsARecordWrittenByAnotherEncoderAndIgnoresUnknownKeys) {
  auto decoded = decode(with(valid_fields(), "future_field", "x"));
  ASSERT_TRUE(decoded.ok()) << decoded.status().to_string();
  EXPECT_EQ(decoded->role, Role::kConsumer);
  EXPECT_EQ(decoded->http, (HostPort{"127.0.0.1", 8200}));
  EXPECT_EQ(decoded->control, (HostPort{"127.0.0.1", 9200}));
  EXPECT_EQ(decoded->mode, TransferMode::kWrite);
  EXPECT_EQ(decode(with(valid_fields(), "boot_nonce", UINT64_MAX))->boot_nonce, UINT64_MAX);
}

TEST(Registration, RefusesEachMissingFieldNamingIt) {
  for (const auto& [key, value] : valid_fields()) {
    auto decoded = decode(without(valid_fields(), key));
    ASSERT_FALSE(decoded.ok()) << "missing " << key << " was accepted";
    EXPECT_EQ(decoded.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(decoded.status().message().find("'" + key + "' is missing"), std::string::npos)
        << decoded.status().message();
  }
}

TEST(Registration, RefusesWrongTypesAndRangesNamingTheField) {
  const std::vector<std::tuple<std::string, Value, std::string>> bad = {
      {"v", uint64_t{2}, "version 2"},
      {"v", "1", "'v'"},
      {"type", "hello", "type must be 'register'"},
      {"role", "P", "role must be"},
      {"role", uint64_t{1}, "'role'"},
      {"http", "localhost", "has no :port"},
      {"http", "", "'http' is empty"},
      {"control", "", "'control' is empty"},  // a consumer needs one
      {"control", "127.0.0.1:0", "invalid port"},
      {"instance_id", "", "'instance_id' is empty"},
      {"instance_id", "p 0", "printable ASCII"},
      {"instance_id", std::string(129, 'p'), "'instance_id' is 129 bytes"},
      {"boot_nonce", int64_t{-1}, "'boot_nonce' must be a non-negative integer"},
      {"boot_nonce", 1.5, "'boot_nonce'"},
      {"tp_size", uint64_t{0}, "'tp_size' = 0 is outside [1, 4096]"},
      {"dp_size", uint64_t{4097}, "'dp_size' = 4097"},
      {"dp_size", true, "'dp_size'"},
      {"mode", "push", "mode must be"},
      {"model", "", "'model' is empty"},
      {"model", std::string(257, 'm'), "'model' is 257 bytes"},
      {"model", "\xc0\xaf", "'model' is not valid UTF-8"},
  };
  for (const auto& [key, value, needle] : bad) {
    auto decoded = decode(with(valid_fields(), key, value));
    ASSERT_FALSE(decoded.ok()) << key << " " << needle;
    EXPECT_EQ(decoded.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(decoded.status().message().find(needle), std::string::npos) << decoded.status().message();
  }
}

TEST(Registration, OnlyACollocatedInstanceMayHaveNoControlAddress) {
  auto both = decode(with(with(valid_fields(), "role", "both"), "control", ""));
  ASSERT_TRUE(both.ok()) << both.status().to_string();
  EXPECT_FALSE(both->control.has_value());
  EXPECT_FALSE(decode(with(with(valid_fields(), "role", "producer"), "control", "")).ok());
  RegistrationRecord record = *both;
  const std::vector<uint8_t> frame = encode_registration(record);
  auto again = decode_registration(frame.data(), frame.size());
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_EQ(*again, record);
}

TEST(Registration, AnHttpAddressNotKnownYetIsWrittenEmptyAndRefused) {
  RegistrationRecord record = producer_record();
  record.http = HostPort{};
  EXPECT_EQ(registration_to_json(record)["http"], "");
  const std::vector<uint8_t> frame = encode_registration(record);
  auto decoded = decode_registration(frame.data(), frame.size());
  ASSERT_FALSE(decoded.ok());
  EXPECT_NE(decoded.status().message().find("'http' is empty"), std::string::npos);
}

TEST(Registration, RefusesMalformedFrames) {
  EXPECT_FALSE(decode_registration("", 0).ok());
  const std::string valid = pack(valid_fields());
  const std::string trailing = valid + "x";
  auto refused = decode_registration(trailing.data(), trailing.size());
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("1 trailing bytes"), std::string::npos);
  EXPECT_FALSE(decode_registration(valid.data(), valid.size() - 1).ok());  // truncated
  const std::string huge = pack(with(valid_fields(), "padding", std::string(kMaxRegistrationBytes, 'x')));
  refused = decode_registration(huge.data(), huge.size());
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("max 16384"), std::string::npos);
  Fields repeated = valid_fields();
  repeated.emplace_back("role", "producer");
  refused = decode(repeated);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("repeats a key"), std::string::npos);

  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> packer(buffer);
  packer.pack_array(1);
  packer.pack(1);
  EXPECT_FALSE(decode_registration(buffer.data(), buffer.size()).ok());
  buffer.clear();
  packer.pack_map(1);
  packer.pack(1);
  packer.pack(1);
  refused = decode_registration(buffer.data(), buffer.size());
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("non-string key"), std::string::npos);
}

TEST(Registration, ANestedBombIsRefusedByTheUnpackerLimits) {
  std::string bomb;
  for (int i = 0; i < 64; ++i) bomb.push_back(static_cast<char>(0x91));  // array of 1, nested 64 deep
  bomb.push_back(0x01);
  auto refused = decode_registration(bomb.data(), bomb.size());
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("not valid msgpack"), std::string::npos) << refused.status().message();
}

TEST(Registration, JsonTakesNonNegativeSignedIntegersAndRefusesOthers) {
  nlohmann::json json = registration_to_json(producer_record());
  json["tp_size"] = nlohmann::json::number_integer_t{2};
  EXPECT_TRUE(registration_from_json(json).ok());
  json["tp_size"] = -2;
  auto refused = registration_from_json(json);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("'tp_size' must be a non-negative integer"), std::string::npos);
  EXPECT_FALSE(registration_from_json(nlohmann::json::array()).ok());
  EXPECT_FALSE(registration_from_json(nlohmann::json{{"v", 1}}).ok());
}

TEST(Registration, AProducersLocationIsWhatAConsumerLegNames) {
  const ProducerLocation location = producer_location(producer_record());
  EXPECT_EQ(location, (ProducerLocation{"p0", "127.0.0.1:9100", 0xfedcba9876543210ull}));
}

Heartbeat loaded_heartbeat() {
  Heartbeat heartbeat;
  heartbeat.record = producer_record();
  heartbeat.load = LoadReport{3, 7, 100, 512, 12345};
  KvEventBatch kv;
  kv.seq = 42;
  kv.reset = true;
  kv.block_size = 16;
  kv.stored = {1, 0xfedcba9876543210ull, UINT64_MAX};
  kv.removed = {0x0102030405060708ull};
  heartbeat.kv = kv;
  return heartbeat;
}

// A heartbeat map written field by field, with `load` and `kv` maps built by `write_extra`.
template <typename WriteExtra>
std::string pack_heartbeat(uint32_t num_extra, WriteExtra write_extra) {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> packer(buffer);
  const Fields fields = valid_fields();
  packer.pack_map(static_cast<uint32_t>(fields.size()) + num_extra);
  for (const auto& [key, value] : fields) {
    packer.pack(key);
    std::visit([&](const auto& v) { packer.pack(v); }, value);
  }
  write_extra(packer);
  return std::string(buffer.data(), buffer.size());
}

void pack_load(msgpack::packer<msgpack::sbuffer>& packer, uint64_t free_blocks, uint64_t total_blocks) {
  packer.pack("load");
  packer.pack_map(5);
  packer.pack("running");
  packer.pack(1);
  packer.pack("waiting");
  packer.pack(2);
  packer.pack("kv_blocks_free");
  packer.pack(free_blocks);
  packer.pack("kv_blocks_total");
  packer.pack(total_blocks);
  packer.pack("queued_prefill_tokens");
  packer.pack(3);
}

void pack_kv(msgpack::packer<msgpack::sbuffer>& packer, size_t stored_bytes, uint64_t block_size) {
  packer.pack("kv");
  packer.pack_map(5);
  packer.pack("seq");
  packer.pack(1);
  packer.pack("reset");
  packer.pack(false);
  packer.pack("block_size");
  packer.pack(block_size);
  const std::string bytes(stored_bytes, '\x01');
  packer.pack("stored");
  packer.pack_bin(static_cast<uint32_t>(bytes.size()));
  packer.pack_bin_body(bytes.data(), static_cast<uint32_t>(bytes.size()));
  packer.pack("removed");
  packer.pack_bin(0);
}

Result<Heartbeat> decode_packed(const std::string& bytes) {
  return decode_heartbeat(bytes.data(), bytes.size());
}

TEST(Heartbeat, RoundTripsLoadAndKvEvents) {
  const Heartbeat heartbeat = loaded_heartbeat();
  const std::vector<uint8_t> frame = encode_heartbeat(heartbeat);
  auto decoded = decode_heartbeat(frame.data(), frame.size());
  ASSERT_TRUE(decoded.ok()) << decoded.status().to_string();
  EXPECT_EQ(decoded->record, heartbeat.record);
  EXPECT_EQ(decoded->load, heartbeat.load);
  EXPECT_EQ(decoded->kv, heartbeat.kv);
}

TEST(Heartbeat, HashesAreEightBytesLittleEndianInOneBin) {
  Heartbeat heartbeat;
  heartbeat.record = producer_record();
  heartbeat.kv =
      KvEventBatch{.seq = 1, .reset = false, .block_size = 16, .stored = {0x0102030405060708ull}, .removed = {}};
  const std::vector<uint8_t> frame = encode_heartbeat(heartbeat);
  msgpack::object_handle handle = msgpack::unpack(reinterpret_cast<const char*>(frame.data()), frame.size());
  const msgpack::object& root = handle.get();
  ASSERT_EQ(root.via.map.size, 12u);
  const msgpack::object& kv = root.via.map.ptr[11].val;
  ASSERT_EQ(kv.type, msgpack::type::MAP);
  const msgpack::object& stored = kv.via.map.ptr[3].val;
  ASSERT_EQ(stored.type, msgpack::type::BIN);
  ASSERT_EQ(stored.via.bin.size, 8u);
  EXPECT_EQ(std::string(stored.via.bin.ptr, 8), std::string("\x08\x07\x06\x05\x04\x03\x02\x01", 8));
}

TEST(Heartbeat, ARegistrationDecoderIgnoresLoadAndKv) {
  const std::vector<uint8_t> frame = encode_heartbeat(loaded_heartbeat());
  auto decoded = decode_registration(frame.data(), frame.size());
  ASSERT_TRUE(decoded.ok()) << decoded.status().to_string();
  EXPECT_EQ(*decoded, producer_record());
}

TEST(Heartbeat, APlainRegistrationIsAHeartbeatWithoutLoadOrKv) {
  const std::vector<uint8_t> frame = encode_registration(producer_record());
  auto decoded = decode_heartbeat(frame.data(), frame.size());
  ASSERT_TRUE(decoded.ok()) << decoded.status().to_string();
  EXPECT_FALSE(decoded->load.has_value());
  EXPECT_FALSE(decoded->kv.has_value());
}

TEST(Heartbeat, AcceptsTheLargestHashListsAndRefusesOneMore) {
  auto at_limit = decode_packed(pack_heartbeat(1, [](auto& p) { pack_kv(p, 8 * kMaxKvEventHashes, 16); }));
  ASSERT_TRUE(at_limit.ok()) << at_limit.status().to_string();
  EXPECT_EQ(at_limit->kv->stored.size(), kMaxKvEventHashes);
  auto over = decode_packed(pack_heartbeat(1, [](auto& p) { pack_kv(p, 8 * kMaxKvEventHashes + 8, 16); }));
  EXPECT_FALSE(over.ok());  // by the unpacker's bin limit, before any allocation for it
}

TEST(Heartbeat, RefusesMalformedLoadAndKvNamingTheField) {
  auto expect_refused = [](const std::string& bytes, const std::string& field) {
    auto refused = decode_packed(bytes);
    ASSERT_FALSE(refused.ok()) << field;
    EXPECT_NE(refused.status().message().find(field), std::string::npos) << refused.status().message();
  };
  expect_refused(pack_heartbeat(1, [](auto& p) { pack_load(p, 11, 10); }), "load.kv_blocks_free");
  expect_refused(pack_heartbeat(1, [](auto& p) { pack_load(p, 1, kMaxReportedBlocks + 1); }), "load.kv_blocks_total");
  expect_refused(pack_heartbeat(1, [](auto& p) { pack_kv(p, 12, 16); }), "kv.stored");
  expect_refused(pack_heartbeat(1, [](auto& p) { pack_kv(p, 8, 0); }), "kv.block_size");
  expect_refused(pack_heartbeat(1, [](auto& p) { pack_kv(p, 8, kMaxKvBlockSize + 1); }), "kv.block_size");
  expect_refused(pack_heartbeat(1,
                                [](auto& p) {
                                  p.pack("load");
                                  p.pack(7);
                                }),
                 "'load' must be a map");
  expect_refused(pack_heartbeat(1,
                                [](auto& p) {
                                  p.pack("kv");
                                  p.pack_map(1);
                                  p.pack("seq");
                                  p.pack(1);
                                }),
                 "kv.reset");
  expect_refused(pack_heartbeat(1,
                                [](auto& p) {
                                  p.pack("load");
                                  p.pack_map(1);
                                  p.pack("running");
                                  p.pack(-1);
                                }),
                 "load.running");
  const std::string huge(kMaxHeartbeatBytes + 1, '\x01');
  const auto too_big = decode_heartbeat(huge.data(), huge.size());
  ASSERT_FALSE(too_big.ok());
  // Refused for its size, before the unpacker reads it (not for the bytes after its first value).
  EXPECT_NE(too_big.status().message().find(fmt::format("max {}", kMaxHeartbeatBytes)), std::string::npos)
      << too_big.status().to_string();
}

TEST(Heartbeat, AResyncRequestIsRecognisedExactly) {
  const std::vector<uint8_t> resync = encode_kv_resync();
  EXPECT_TRUE(is_kv_resync(resync.data(), resync.size()));
  const std::vector<uint8_t> registration = encode_registration(producer_record());
  EXPECT_FALSE(is_kv_resync(registration.data(), registration.size()));
  EXPECT_FALSE(is_kv_resync(resync.data(), resync.size() - 1));
}

}  // namespace
}  // namespace pd::contract
