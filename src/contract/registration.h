// The registration record: what every instance tells the router about itself,
// sent as a msgpack map over ZMQ every kRegistrationIntervalMs and served as
// JSON at GET /pd/info (docs/pd_contract.md "Registration").
//
//   {"v": 1, "type": "register", "role", "http", "control", "instance_id",
//    "boot_nonce", "tp_size", "dp_size", "mode", "model"}      (JSON: no "v"/"type")
//
// Decoders validate every field and refuse with a reason naming it; unknown
// keys are ignored (forward compatible).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"
#include "contract/address.h"
#include "contract/roles.h"
#include "contract/transfer_params.h"

namespace pd::contract {

inline constexpr uint32_t kRegistrationVersion = 1;
// Instances send their record this often, from a thread model work cannot starve.
inline constexpr int64_t kRegistrationIntervalMs = 3'000;
// The router forgets an instance that sent nothing for this long (pdrouter --instance-ttl-ms).
inline constexpr int64_t kInstanceTtlMs = 5'000;

inline constexpr size_t kMaxModelNameBytes = 256;
inline constexpr size_t kMaxAddressBytes = 300;  // "http", "control" as text
inline constexpr uint32_t kMaxParallelSize = 4096;
// Registrations larger than this are malformed (the router also sets ZMQ_MAXMSGSIZE to it).
inline constexpr size_t kMaxRegistrationBytes = 16 * 1024;

struct RegistrationRecord {
  Role role = Role::kBoth;
  // OpenAI HTTP API. Port 0 = not known yet (an instance before it listens): written as
  // "", which every decoder refuses.
  HostPort http;
  // Control ROUTER of the connector; absent only for a collocated instance without one
  // (written as "").
  std::optional<HostPort> control;
  std::string instance_id;  // 1..kMaxInstanceIdBytes bytes of printable ASCII
  uint64_t boot_nonce = 0;  // new at every start of the instance
  uint32_t tp_size = 1;     // 1..kMaxParallelSize
  uint32_t dp_size = 1;     // 1..kMaxParallelSize
  TransferMode mode = TransferMode::kWrite;
  // Served model name, 1..kMaxModelNameBytes bytes of UTF-8 in everything decoded; empty
  // only where the router describes a static instance it knows from /v1/models alone.
  std::string model;

  bool operator==(const RegistrationRecord&) const = default;
};

// The remote_* fields a consumer needs to reach this instance as a producer.
// Precondition: record.control is set (every P/D producer has one).
ProducerLocation producer_location(const RegistrationRecord& record);

// One ZMQ frame: the msgpack map above, in that key order; integers unsigned.
std::vector<uint8_t> encode_registration(const RegistrationRecord& record);
// Refuses: empty or > kMaxRegistrationBytes, bad msgpack (unpacker limits bound what it
// allocates), trailing bytes, not a map, non-string or repeated keys, "v" != 1,
// "type" != "register", and every field check of RegistrationRecord.
Result<RegistrationRecord> decode_registration(const void* data, size_t size);

// GET /pd/info: the same fields without "v"/"type".
nlohmann::json registration_to_json(const RegistrationRecord& record);
Result<RegistrationRecord> registration_from_json(const nlohmann::json& object);

}  // namespace pd::contract
