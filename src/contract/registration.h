// The registration record: what every instance tells the router about itself,
// sent as a msgpack map over ZMQ every kRegistrationIntervalMs and served as
// JSON at GET /pd/info (docs/pd_contract.md "Registration").
//
//   {"v": 1, "type": "register", "role", "http", "control", "instance_id",
//    "boot_nonce", "tp_size", "dp_size", "mode", "model"}      (JSON: no "v"/"type")
//
// Decoders validate every field and refuse with a reason naming it; unknown
// keys are ignored (forward compatible).
//
// A heartbeat is the same frame with two optional maps more (encode_heartbeat):
//   "load": {"running", "waiting", "kv_blocks_free", "kv_blocks_total", "queued_prefill_tokens"}
//   "kv":   {"seq", "reset", "block_size", "stored", "removed"}   (KV cache events)
// A plain registration decoder ignores them; decode_heartbeat validates them.
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
// Instances with load reports send a frame with their load and cache events this often.
inline constexpr int64_t kLoadReportIntervalMs = 200;
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

// An instance's load as its engine thread last saw it.
struct LoadReport {
  uint32_t num_running = 0;         // requests in the running set
  uint32_t num_waiting = 0;         // waiting for a step or for remote KV
  uint32_t num_kv_blocks_free = 0;  // free blocks, cached-but-unreferenced ones included
  uint32_t num_kv_blocks_total = 0;
  uint64_t num_queued_prefill_tokens = 0;  // prompt tokens admitted or waiting, not computed yet

  bool operator==(const LoadReport&) const = default;
};

// Bounds of a load report (each field refused above its bound).
inline constexpr uint64_t kMaxReportedRequests = 1u << 24;
inline constexpr uint64_t kMaxReportedBlocks = 1u << 30;
inline constexpr uint64_t kMaxReportedQueuedTokens = uint64_t{1} << 40;

// Block hashes (the engine's prefix-cache keys, engine::hash_block_tokens) stored in
// and removed from one instance's prefix cache since the previous batch.
//
// Sequence: an instance numbers the frames that carry events 1, 2, 3, ... (per boot);
// a frame without events repeats the last number. A receiver that holds the view up
// to `last` applies a frame with events only when seq == last + 1, takes an empty one
// when seq == last, and otherwise has missed a frame (a gap): it drops its view and
// asks for a snapshot (encode_kv_resync). A frame with `reset` replaces the whole view
// (clear, then apply) whatever its seq; an instance starts with one and answers every
// resync with one, and a snapshot too large for one frame continues in the next ones.
struct KvEventBatch {
  uint64_t seq = 0;
  bool reset = false;
  uint32_t block_size = 16;       // tokens per hashed block, 1..kMaxKvBlockSize
  std::vector<uint64_t> stored;   // at most kMaxKvEventHashes
  std::vector<uint64_t> removed;  // at most kMaxKvEventHashes; applied after `stored`

  bool has_events() const { return reset || !stored.empty() || !removed.empty(); }
  bool operator==(const KvEventBatch&) const = default;
};

inline constexpr size_t kMaxKvEventHashes = 4096;  // per list and frame
inline constexpr uint32_t kMaxKvBlockSize = 4096;
// A heartbeat frame: the record (under kMaxRegistrationBytes) plus two hash lists of
// 8 bytes per hash. The router sets ZMQ_MAXMSGSIZE to this.
inline constexpr size_t kMaxHeartbeatBytes = kMaxRegistrationBytes + 2 * 8 * kMaxKvEventHashes + 1024;

struct Heartbeat {
  RegistrationRecord record;
  std::optional<LoadReport> load;
  std::optional<KvEventBatch> kv;
};

// One ZMQ frame: the msgpack map above, in that key order; integers unsigned.
std::vector<uint8_t> encode_registration(const RegistrationRecord& record);
// Refuses: empty or > kMaxRegistrationBytes, bad msgpack (unpacker limits bound what it
// allocates), trailing bytes, not a map, non-string or repeated keys, "v" != 1,
// "type" != "register", and every field check of RegistrationRecord.
Result<RegistrationRecord> decode_registration(const void* data, size_t size);

// The registration map with "load" and "kv" appended when set. Hashes travel as one
// msgpack bin per list, 8 bytes per hash, little-endian. Precondition: each list holds at
// most kMaxKvEventHashes.
std::vector<uint8_t> encode_heartbeat(const Heartbeat& heartbeat);
// Everything decode_registration refuses (frames up to kMaxHeartbeatBytes), plus: "load"
// or "kv" not a map, a missing, repeated or mistyped field in them, a value over its bound,
// kv_blocks_free > kv_blocks_total, a hash list whose length is not a multiple of 8 or holds
// more than kMaxKvEventHashes, block_size outside 1..kMaxKvBlockSize. Unknown keys inside
// them are ignored.
Result<Heartbeat> decode_heartbeat(const void* data, size_t size);

// Router -> instance, on the registration socket: "send me your whole prefix cache".
// {"v": 1, "type": "kv_resync"}.
std::vector<uint8_t> encode_kv_resync();
bool is_kv_resync(const void* data, size_t size);

// GET /pd/info: the same fields without "v"/"type".
nlohmann::json registration_to_json(const RegistrationRecord& record);
Result<RegistrationRecord> registration_from_json(const nlohmann::json& object);

}  // namespace pd::contract
