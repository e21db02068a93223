// What the router knows about one engine instance, and the validation of the
// two ways it learns it: a ZMQ registration (msgpack map) and GET /pd/info
// (JSON). Both carry the same fields (pd_contract.md); everything from the
// network is validated field by field and rejected with a reason.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "common/status.h"

namespace pd::router {

enum class InstanceRole { kProducer, kConsumer, kBoth };
enum class TransferMode { kRead, kWrite };

const char* role_name(InstanceRole role);
const char* mode_name(TransferMode mode);
Result<InstanceRole> parse_role(std::string_view text);
Result<TransferMode> parse_mode(std::string_view text);

struct HostPort {
  std::string host;
  uint16_t port = 0;

  std::string to_string() const;
  bool operator==(const HostPort&) const = default;
};

// "host:port" or "[v6]:port"; host non-empty (<= 253 bytes), port 1..65535.
Result<HostPort> parse_host_port(std::string_view text);
// "http://host:port" with an optional trailing "/"; nothing else (no path, no https).
Result<HostPort> parse_http_url(std::string_view url);

inline constexpr size_t kMaxInstanceIdBytes = 128;
inline constexpr size_t kMaxModelNameBytes = 256;
inline constexpr uint32_t kMaxParallelSize = 4096;
// Registrations larger than this are malformed (also enforced by ZMQ_MAXMSGSIZE).
inline constexpr size_t kMaxRegistrationBytes = 16 * 1024;

struct InstanceInfo {
  InstanceRole role = InstanceRole::kBoth;
  HostPort http;
  std::optional<HostPort> control;  // absent only for collocated instances without a connector
  std::string instance_id;
  uint64_t boot_nonce = 0;
  uint32_t tp_size = 1;
  uint32_t dp_size = 1;
  TransferMode mode = TransferMode::kWrite;
  std::string model;  // empty when unknown (static instance without /pd/info)

  bool operator==(const InstanceInfo&) const = default;
};

// A registration message: the msgpack map of pd_contract.md with "v" == 1 and
// "type" == "register". Unknown extra keys are ignored (forward compatible).
Result<InstanceInfo> parse_registration(const void* data, size_t size);

// The JSON object served at GET /pd/info (same fields, no "v"/"type").
Result<InstanceInfo> parse_instance_info_json(const nlohmann::json& object);

}  // namespace pd::router
