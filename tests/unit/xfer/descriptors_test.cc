#include <gtest/gtest.h>
#include <msgpack.hpp>

#include <random>

#include "xfer/types.h"

namespace pd::xfer {
namespace {

EngineDesc sample_engine() {
  EngineDesc desc;
  desc.name = "prefill-0";
  desc.boot_nonce = 0x1234567890abcdefULL;
  desc.host_id = "host/boot";
  desc.endpoints["ucx"] = {1, 2, 3, 4, 5};
  desc.gpu_uuids = {"GPU-a", "GPU-b"};
  return desc;
}

MemDesc sample_mem() {
  MemDesc desc;
  desc.engine_name = "prefill-0";
  desc.boot_nonce = 42;
  desc.region_id = 7;
  desc.base = 0x7f0000000000ULL;
  desc.bytes = 1 << 30;
  desc.kind = MemKind::kCuda;
  desc.device = 1;
  desc.keys["ucx"] = {9, 9, 9};
  desc.keys["cuda"] = std::vector<uint8_t>(72, 0xab);
  return desc;
}

TEST(Descriptors, EngineDescRoundTrips) {
  EngineDesc in = sample_engine();
  auto out = decode_engine_desc(encode(in));
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  EXPECT_EQ(out->name, in.name);
  EXPECT_EQ(out->boot_nonce, in.boot_nonce);
  EXPECT_EQ(out->host_id, in.host_id);
  EXPECT_EQ(out->endpoints, in.endpoints);
  EXPECT_EQ(out->gpu_uuids, in.gpu_uuids);
}

TEST(Descriptors, MemDescRoundTrips) {
  MemDesc in = sample_mem();
  auto out = decode_mem_desc(encode(in));
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  EXPECT_EQ(out->engine_name, in.engine_name);
  EXPECT_EQ(out->boot_nonce, in.boot_nonce);
  EXPECT_EQ(out->region_id, in.region_id);
  EXPECT_EQ(out->base, in.base);
  EXPECT_EQ(out->bytes, in.bytes);
  EXPECT_EQ(out->kind, in.kind);
  EXPECT_EQ(out->device, in.device);
  EXPECT_EQ(out->keys, in.keys);
}

TEST(Descriptors, OneKindIsNotAcceptedAsTheOther) {
  EXPECT_FALSE(decode_mem_desc(encode(sample_engine())).ok());
  EXPECT_FALSE(decode_engine_desc(encode(sample_mem())).ok());
}

TEST(Descriptors, RejectsEmptyAndGarbageBytes) {
  EXPECT_EQ(decode_engine_desc({}).status().code(), ErrorCode::kInvalidArgument);
  std::vector<uint8_t> garbage = {0xc1, 0xff, 0x00, 0x13};
  EXPECT_EQ(decode_mem_desc(garbage).status().code(), ErrorCode::kInvalidArgument);
  std::vector<uint8_t> not_a_map = {0x93, 0x01, 0x02, 0x03};  // [1, 2, 3]
  EXPECT_EQ(decode_mem_desc(not_a_map).status().code(), ErrorCode::kInvalidArgument);
}

TEST(Descriptors, RejectsEveryTruncation) {
  std::vector<uint8_t> bytes = encode(sample_mem());
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto r = decode_mem_desc(std::span<const uint8_t>(bytes.data(), n));
    EXPECT_FALSE(r.ok()) << "accepted a prefix of " << n << " bytes";
  }
}

TEST(Descriptors, RejectsTrailingBytes) {
  std::vector<uint8_t> bytes = encode(sample_engine());
  bytes.push_back(0x00);
  EXPECT_FALSE(decode_engine_desc(bytes).ok());
}

TEST(Descriptors, RejectsAnotherVersion) {
  std::vector<uint8_t> bytes = encode(sample_mem());
  // The map starts with "v" (0xa1 0x76) then the version as a positive fixint.
  ASSERT_EQ(bytes[1], 0xa1);
  ASSERT_EQ(bytes[2], 'v');
  ASSERT_EQ(bytes[3], kDescriptorVersion);
  bytes[3] = kDescriptorVersion + 1;
  auto r = decode_mem_desc(bytes);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("version"), std::string::npos);
}

TEST(Descriptors, RejectsInconsistentMemDesc) {
  MemDesc zero_bytes = sample_mem();
  zero_bytes.bytes = 0;
  EXPECT_FALSE(decode_mem_desc(encode(zero_bytes)).ok());
  MemDesc wraps = sample_mem();
  wraps.base = UINT64_MAX - 10;
  EXPECT_FALSE(decode_mem_desc(encode(wraps)).ok());
  MemDesc host_with_device = sample_mem();
  host_with_device.kind = MemKind::kHost;
  EXPECT_FALSE(decode_mem_desc(encode(host_with_device)).ok());
  MemDesc no_nonce = sample_mem();
  no_nonce.boot_nonce = 0;
  EXPECT_FALSE(decode_mem_desc(encode(no_nonce)).ok());
}

TEST(Descriptors, RejectsEmptyBackendBlobs) {
  // UCX parses endpoint addresses and remote keys without a length: an empty blob would
  // reach it as a null pointer.
  EngineDesc empty_endpoint = sample_engine();
  empty_endpoint.endpoints["ucx"] = {};
  EXPECT_FALSE(decode_engine_desc(encode(empty_endpoint)).ok());
  MemDesc empty_key = sample_mem();
  empty_key.keys["ucx"] = {};
  EXPECT_FALSE(decode_mem_desc(encode(empty_key)).ok());
}

std::vector<uint8_t> engine_desc_bytes(bool nonce_twice, bool endpoint_twice) {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> pk(buffer);
  pk.pack_map(nonce_twice ? 8 : 7);
  pk.pack("v"), pk.pack(kDescriptorVersion);
  pk.pack("t"), pk.pack("engine");
  pk.pack("name"), pk.pack("prefill-0");
  pk.pack("nonce"), pk.pack(5u);
  if (nonce_twice) pk.pack("nonce"), pk.pack(6u);
  pk.pack("host"), pk.pack("h");
  pk.pack("ep");
  pk.pack_map(endpoint_twice ? 2 : 1);
  for (int i = 0; i < (endpoint_twice ? 2 : 1); ++i) {
    pk.pack("ucx");
    pk.pack_bin(1);
    pk.pack_bin_body("x", 1);
  }
  pk.pack("gpus"), pk.pack(std::vector<std::string>{});
  const auto* data = reinterpret_cast<const uint8_t*>(buffer.data());
  return {data, data + buffer.size()};
}

TEST(Descriptors, RejectsAKeyOrABackendGivenTwice) {
  ASSERT_TRUE(decode_engine_desc(engine_desc_bytes(false, false)).ok());
  auto nonce_twice = decode_engine_desc(engine_desc_bytes(true, false));
  ASSERT_FALSE(nonce_twice.ok());
  EXPECT_NE(nonce_twice.status().message().find("'nonce' twice"), std::string::npos);
  EXPECT_FALSE(decode_engine_desc(engine_desc_bytes(false, true)).ok());
}

TEST(Descriptors, SurvivesRandomBitFlips) {
  std::vector<uint8_t> good = encode(sample_mem());
  std::mt19937 rng(3);
  for (int i = 0; i < 2000; ++i) {
    std::vector<uint8_t> bytes = good;
    bytes[rng() % bytes.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));
    auto r = decode_mem_desc(bytes);  // must not crash; either rejected or a valid descriptor
    if (r.ok()) {
      EXPECT_GT(r->bytes, 0u);
      EXPECT_FALSE(r->engine_name.empty());
    }
  }
}

}  // namespace
}  // namespace pd::xfer
