#include "router/instance_info.h"

#include <gtest/gtest.h>
#include <msgpack.hpp>

#include <map>
#include <string>
#include <variant>

namespace pd::router {
namespace {

using Value = std::variant<std::string, uint64_t, int64_t, double>;

std::string pack(const std::map<std::string, Value>& fields) {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> packer(buffer);
  packer.pack_map(static_cast<uint32_t>(fields.size()));
  for (const auto& [key, value] : fields) {
    packer.pack(key);
    std::visit([&](const auto& v) { packer.pack(v); }, value);
  }
  return std::string(buffer.data(), buffer.size());
}

std::map<std::string, Value> valid_fields() {
  return {{"v", uint64_t{1}},
          {"type", "register"},
          {"role", "producer"},
          {"http", "127.0.0.1:8100"},
          {"control", "127.0.0.1:9100"},
          {"instance_id", "p0"},
          {"boot_nonce", uint64_t{42}},
          {"tp_size", uint64_t{1}},
          {"dp_size", uint64_t{1}},
          {"mode", "write"},
          {"model", "builtin:tiny"}};
}

Result<InstanceInfo> parse(const std::map<std::string, Value>& fields) {
  std::string bytes = pack(fields);
  return parse_registration(bytes.data(), bytes.size());
}

TEST(RegistrationParse, AcceptsTheContractRecord) {
  auto info = parse(valid_fields());
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->role, InstanceRole::kProducer);
  EXPECT_EQ(info->http, (HostPort{"127.0.0.1", 8100}));
  ASSERT_TRUE(info->control.has_value());
  EXPECT_EQ(info->control->to_string(), "127.0.0.1:9100");
  EXPECT_EQ(info->instance_id, "p0");
  EXPECT_EQ(info->boot_nonce, 42u);
  EXPECT_EQ(info->mode, TransferMode::kWrite);
  EXPECT_EQ(info->model, "builtin:tiny");
}

TEST(RegistrationParse, AcceptsFullRangeBootNonceAndIgnoresUnknownKeys) {
  auto fields = valid_fields();
  fields["boot_nonce"] = UINT64_MAX;
  fields["future_field"] = "x";
  auto info = parse(fields);
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->boot_nonce, UINT64_MAX);
}

TEST(RegistrationParse, RejectsEachMissingField) {
  for (const auto& [key, value] : valid_fields()) {
    auto fields = valid_fields();
    fields.erase(key);
    EXPECT_FALSE(parse(fields).ok()) << "missing " << key << " was accepted";
  }
}

TEST(RegistrationParse, RejectsWrongTypesAndRanges) {
  const std::vector<std::pair<std::string, Value>> bad = {
      {"v", uint64_t{2}},
      {"v", "1"},
      {"type", "hello"},
      {"role", "P"},
      {"role", uint64_t{1}},
      {"http", "127.0.0.1"},
      {"http", "127.0.0.1:0"},
      {"http", "127.0.0.1:70000"},
      {"http", ":80"},
      {"control", "nohostport"},
      {"instance_id", ""},
      {"instance_id", std::string(129, 'a')},
      {"instance_id", "has space"},
      {"boot_nonce", int64_t{-1}},
      {"boot_nonce", 1.5},
      {"tp_size", uint64_t{0}},
      {"dp_size", uint64_t{5000}},
      {"mode", "push"},
      {"model", ""},
      {"model", std::string(300, 'm')},
  };
  for (const auto& [key, value] : bad) {
    auto fields = valid_fields();
    fields[key] = value;
    EXPECT_FALSE(parse(fields).ok()) << "bad " << key << " was accepted";
  }
}

TEST(RegistrationParse, RejectsStringsThatAreNotUtf8) {
  const std::vector<std::string> not_utf8 = {
      "model-\xff",              // never valid
      "model-\xc3",              // truncated sequence
      "model-\xc0\xaf",          // overlong '/'
      "model-\xed\xa0\x80",      // UTF-16 surrogate
      "model-\xf4\x90\x80\x80",  // above U+10FFFF
  };
  for (const std::string& model : not_utf8) {
    auto fields = valid_fields();
    fields["model"] = model;
    auto info = parse(fields);
    EXPECT_FALSE(info.ok()) << "model of " << model.size() << " bytes was accepted";
  }
  auto fields = valid_fields();
  fields["role"] = "producer\xff";
  EXPECT_FALSE(parse(fields).ok());
}

TEST(RegistrationParse, AcceptsNonAsciiUtf8ModelNames) {
  auto fields = valid_fields();
  fields["model"] = "caf\xc3\xa9-\xe6\xa8\xa1\xe5\x9e\x8b-\xf0\x9f\x98\x80";  // café-模型-😀
  auto info = parse(fields);
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->model, "caf\xc3\xa9-\xe6\xa8\xa1\xe5\x9e\x8b-\xf0\x9f\x98\x80");
}

TEST(RegistrationParse, CollocatedInstanceMayOmitControlAddressValue) {
  auto fields = valid_fields();
  fields["role"] = "both";
  fields["control"] = "";
  auto info = parse(fields);
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_FALSE(info->control.has_value());
  fields["role"] = "consumer";
  EXPECT_FALSE(parse(fields).ok());
}

TEST(RegistrationParse, RejectsGarbageWithoutThrowing) {
  const std::vector<std::string> garbage = {
      std::string("\xc1", 1),              // never-used msgpack byte
      std::string("\x93\x01\x02\x03", 4),  // an array, not a map
      std::string("\x81\xa1", 2),          // truncated map
      std::string(20000, '\xdc'),          // oversized
      std::string(64, '\x91') + "\x01",    // nesting deeper than the limit
      "plain text",
  };
  for (const std::string& bytes : garbage) {
    EXPECT_FALSE(parse_registration(bytes.data(), bytes.size()).ok());
  }
  EXPECT_FALSE(parse_registration(nullptr, 0).ok());
}

TEST(RegistrationParse, RejectsTrailingBytesAndRepeatedKeys) {
  std::string bytes = pack(valid_fields()) + "x";
  EXPECT_FALSE(parse_registration(bytes.data(), bytes.size()).ok());

  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> packer(buffer);
  packer.pack_map(12);
  for (const auto& [key, value] : valid_fields()) {
    packer.pack(key);
    std::visit([&](const auto& v) { packer.pack(v); }, value);
  }
  packer.pack(std::string("role"));
  packer.pack(std::string("consumer"));
  EXPECT_FALSE(parse_registration(buffer.data(), buffer.size()).ok());
}

TEST(InstanceInfoJson, ParsesPdInfoWithoutHeaderFields) {
  nlohmann::json info = {{"role", "consumer"},  {"http", "127.0.0.1:8200"}, {"control", "127.0.0.1:9200"},
                         {"instance_id", "d0"}, {"boot_nonce", 7},          {"tp_size", 1},
                         {"dp_size", 1},        {"mode", "read"},           {"model", "m"}};
  auto parsed = parse_instance_info_json(info);
  ASSERT_TRUE(parsed.ok()) << parsed.status().to_string();
  EXPECT_EQ(parsed->role, InstanceRole::kConsumer);
  EXPECT_EQ(parsed->mode, TransferMode::kRead);
  info["boot_nonce"] = -3;
  EXPECT_FALSE(parse_instance_info_json(info).ok());
  EXPECT_FALSE(parse_instance_info_json(nlohmann::json::array()).ok());
}

TEST(HostPortParse, HandlesUrlsAndIpv6) {
  auto url = parse_http_url("http://127.0.0.1:8000/");
  ASSERT_TRUE(url.ok());
  EXPECT_EQ(url->to_string(), "127.0.0.1:8000");
  EXPECT_FALSE(parse_http_url("https://127.0.0.1:8000").ok());
  EXPECT_FALSE(parse_http_url("http://127.0.0.1:8000/v1").ok());
  auto v6 = parse_host_port("[::1]:9000");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->host, "::1");
  EXPECT_EQ(v6->to_string(), "[::1]:9000");
  EXPECT_FALSE(parse_host_port("::1:9000").ok());
}

// Found by fuzz_router_input: "[[1]:9" parsed (host "[1") and printed back as "[1:9", which
// does not parse. Whatever parses must print back to the same address.
TEST(HostPortParse, WhatParsesPrintsBackToTheSameAddress) {
  EXPECT_FALSE(parse_host_port("[[1]:9").ok());
  EXPECT_FALSE(parse_host_port("[host]:9").ok()) << "brackets are for IPv6 only";
  EXPECT_FALSE(parse_host_port("ho[st:9").ok());
  EXPECT_FALSE(parse_host_port("host]:9").ok());
  for (const char* text : {"127.0.0.1:1", "[::1]:65535", "[fe80::1%eth0]:80", "decode-0.local:8000"}) {
    auto parsed = parse_host_port(text);
    ASSERT_TRUE(parsed.ok()) << text;
    auto again = parse_host_port(parsed->to_string());
    ASSERT_TRUE(again.ok()) << text;
    EXPECT_EQ(*again, *parsed) << text;
  }
}

}  // namespace
}  // namespace pd::router
