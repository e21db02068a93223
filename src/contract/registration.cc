#include "contract/registration.h"

#include <msgpack.hpp>

#include <cstring>
#include <map>
#include <variant>

namespace pd::contract {

ProducerLocation producer_location(const RegistrationRecord& record) {
  return ProducerLocation{record.instance_id, record.control ? record.control->to_string() : std::string(),
                          record.boot_nonce};
}

namespace {

std::string address_text(const HostPort& address) {
  return address.port == 0 ? std::string() : address.to_string();
}

std::string control_text(const RegistrationRecord& record) {
  return record.control ? address_text(*record.control) : std::string();
}

void pack_str(msgpack::packer<msgpack::sbuffer>& pk, std::string_view key, std::string_view value) {
  pk.pack(key);
  pk.pack(value);
}

}  // namespace

std::vector<uint8_t> encode_registration(const RegistrationRecord& r) {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> pk(buffer);
  pk.pack_map(11);
  pk.pack(std::string_view("v"));
  pk.pack(kRegistrationVersion);
  pack_str(pk, "type", "register");
  pack_str(pk, "role", role_name(r.role));
  pack_str(pk, "http", address_text(r.http));
  pack_str(pk, "control", control_text(r));
  pack_str(pk, "instance_id", r.instance_id);
  pk.pack(std::string_view("boot_nonce"));
  pk.pack(r.boot_nonce);
  pk.pack(std::string_view("tp_size"));
  pk.pack(r.tp_size);
  pk.pack(std::string_view("dp_size"));
  pk.pack(r.dp_size);
  pack_str(pk, "mode", mode_name(r.mode));
  pack_str(pk, "model", r.model);
  const auto* begin = reinterpret_cast<const uint8_t*>(buffer.data());
  return {begin, begin + buffer.size()};
}

nlohmann::json registration_to_json(const RegistrationRecord& r) {
  return nlohmann::json{{"role", role_name(r.role)},    {"http", address_text(r.http)}, {"control", control_text(r)},
                        {"instance_id", r.instance_id}, {"boot_nonce", r.boot_nonce},   {"tp_size", r.tp_size},
                        {"dp_size", r.dp_size},         {"mode", mode_name(r.mode)},    {"model", r.model}};
}

namespace {

// The fields of one record, decoded from msgpack or JSON into one shape so
// that a single validator serves both sources.
struct OtherType {};
using RawValue = std::variant<std::string, uint64_t, OtherType>;
using RawFields = std::map<std::string, RawValue, std::less<>>;

Result<std::string> get_string(const RawFields& fields, std::string_view key, size_t max_bytes, bool allow_empty) {
  auto it = fields.find(key);
  if (it == fields.end()) return invalid_argument("field '{}' is missing", key);
  const auto* text = std::get_if<std::string>(&it->second);
  if (text == nullptr) return invalid_argument("field '{}' must be a string", key);
  if (text->size() > max_bytes) return invalid_argument("field '{}' is {} bytes, max {}", key, text->size(), max_bytes);
  if (!allow_empty && text->empty()) return invalid_argument("field '{}' is empty", key);
  // Every field may end up in JSON the router serves (/health, /v1/models), which must be UTF-8.
  if (!is_valid_utf8(*text)) return invalid_argument("field '{}' is not valid UTF-8", key);
  return *text;
}

Result<uint64_t> get_uint(const RawFields& fields, std::string_view key, uint64_t min_value, uint64_t max_value) {
  auto it = fields.find(key);
  if (it == fields.end()) return invalid_argument("field '{}' is missing", key);
  const auto* value = std::get_if<uint64_t>(&it->second);
  if (value == nullptr) return invalid_argument("field '{}' must be a non-negative integer", key);
  if (*value < min_value || *value > max_value) {
    return invalid_argument("field '{}' = {} is outside [{}, {}]", key, *value, min_value, max_value);
  }
  return *value;
}

Result<RegistrationRecord> validate_fields(const RawFields& fields, bool registration) {
  if (registration) {
    PD_ASSIGN_OR_RETURN(uint64_t version, get_uint(fields, "v", 0, UINT64_MAX));
    if (version != kRegistrationVersion) {
      return invalid_argument("unsupported registration version {} (expected {})", version, kRegistrationVersion);
    }
    PD_ASSIGN_OR_RETURN(std::string type, get_string(fields, "type", 32, false));
    if (type != "register") return invalid_argument("type must be 'register', got '{}'", type);
  }
  RegistrationRecord record;
  PD_ASSIGN_OR_RETURN(std::string role, get_string(fields, "role", 16, false));
  PD_ASSIGN_OR_RETURN(record.role, parse_role(role));
  PD_ASSIGN_OR_RETURN(std::string http, get_string(fields, "http", kMaxAddressBytes, false));
  PD_ASSIGN_OR_RETURN(record.http, parse_host_port(http));
  // A collocated instance may run without a connector; every P/D participant needs a control address.
  PD_ASSIGN_OR_RETURN(std::string control, get_string(fields, "control", kMaxAddressBytes, record.role == Role::kBoth));
  if (!control.empty()) {
    PD_ASSIGN_OR_RETURN(HostPort control_address, parse_host_port(control));
    record.control = control_address;
  }
  PD_ASSIGN_OR_RETURN(record.instance_id, get_string(fields, "instance_id", kMaxInstanceIdBytes, false));
  if (!is_printable_ascii(record.instance_id)) return invalid_argument("instance_id must be printable ASCII");
  PD_ASSIGN_OR_RETURN(record.boot_nonce, get_uint(fields, "boot_nonce", 0, UINT64_MAX));
  PD_ASSIGN_OR_RETURN(uint64_t tp_size, get_uint(fields, "tp_size", 1, kMaxParallelSize));
  PD_ASSIGN_OR_RETURN(uint64_t dp_size, get_uint(fields, "dp_size", 1, kMaxParallelSize));
  record.tp_size = static_cast<uint32_t>(tp_size);
  record.dp_size = static_cast<uint32_t>(dp_size);
  PD_ASSIGN_OR_RETURN(std::string mode, get_string(fields, "mode", 16, false));
  PD_ASSIGN_OR_RETURN(record.mode, parse_mode(mode));
  PD_ASSIGN_OR_RETURN(record.model, get_string(fields, "model", kMaxModelNameBytes, false));
  return record;
}

}  // namespace

namespace {

std::string_view object_str(const msgpack::object& o) {
  return {o.via.str.ptr, o.via.str.size};
}

// The fields of a nested map ("load", "kv"): each key once, a string.
Result<std::map<std::string, const msgpack::object*, std::less<>>> nested_fields(const msgpack::object& object,
                                                                                 std::string_view name) {
  if (object.type != msgpack::type::MAP) return invalid_argument("field '{}' must be a map", name);
  std::map<std::string, const msgpack::object*, std::less<>> fields;
  for (uint32_t i = 0; i < object.via.map.size; ++i) {
    const msgpack::object_kv& kv = object.via.map.ptr[i];
    if (kv.key.type != msgpack::type::STR) return invalid_argument("field '{}' has a non-string key", name);
    if (!fields.emplace(std::string(object_str(kv.key)), &kv.val).second) {
      return invalid_argument("field '{}' repeats a key", name);
    }
  }
  return fields;
}

Result<uint64_t> nested_uint(const std::map<std::string, const msgpack::object*, std::less<>>& fields,
                             std::string_view name, std::string_view key, uint64_t min_value, uint64_t max_value) {
  auto it = fields.find(key);
  if (it == fields.end()) return invalid_argument("field '{}.{}' is missing", name, key);
  if (it->second->type != msgpack::type::POSITIVE_INTEGER) {
    return invalid_argument("field '{}.{}' must be a non-negative integer", name, key);
  }
  const uint64_t value = it->second->via.u64;
  if (value < min_value || value > max_value) {
    return invalid_argument("field '{}.{}' = {} is outside [{}, {}]", name, key, value, min_value, max_value);
  }
  return value;
}

Result<LoadReport> decode_load(const msgpack::object& object) {
  PD_ASSIGN_OR_RETURN(auto fields, nested_fields(object, "load"));
  LoadReport load;
  PD_ASSIGN_OR_RETURN(uint64_t running, nested_uint(fields, "load", "running", 0, kMaxReportedRequests));
  PD_ASSIGN_OR_RETURN(uint64_t waiting, nested_uint(fields, "load", "waiting", 0, kMaxReportedRequests));
  PD_ASSIGN_OR_RETURN(uint64_t total, nested_uint(fields, "load", "kv_blocks_total", 0, kMaxReportedBlocks));
  PD_ASSIGN_OR_RETURN(uint64_t free, nested_uint(fields, "load", "kv_blocks_free", 0, total));
  PD_ASSIGN_OR_RETURN(load.num_queued_prefill_tokens,
                      nested_uint(fields, "load", "queued_prefill_tokens", 0, kMaxReportedQueuedTokens));
  load.num_running = static_cast<uint32_t>(running);
  load.num_waiting = static_cast<uint32_t>(waiting);
  load.num_kv_blocks_total = static_cast<uint32_t>(total);
  load.num_kv_blocks_free = static_cast<uint32_t>(free);
  return load;
}

Result<std::vector<uint64_t>> decode_hashes(const std::map<std::string, const msgpack::object*, std::less<>>& fields,
                                            std::string_view key) {
  auto it = fields.find(key);
  if (it == fields.end()) return invalid_argument("field 'kv.{}' is missing", key);
  const msgpack::object& o = *it->second;
  if (o.type != msgpack::type::BIN) return invalid_argument("field 'kv.{}' must be bin", key);
  if (o.via.bin.size % 8 != 0) {
    return invalid_argument("field 'kv.{}' is {} bytes, not a multiple of 8", key, o.via.bin.size);
  }
  const size_t count = o.via.bin.size / 8;
  if (count > kMaxKvEventHashes) {
    return invalid_argument("field 'kv.{}' holds {} hashes, max {}", key, count, kMaxKvEventHashes);
  }
  std::vector<uint64_t> hashes(count);
  const auto* bytes = reinterpret_cast<const uint8_t*>(o.via.bin.ptr);
  for (size_t i = 0; i < count; ++i) {
    uint64_t h = 0;
    for (int b = 7; b >= 0; --b) h = (h << 8) | bytes[i * 8 + static_cast<size_t>(b)];
    hashes[i] = h;
  }
  return hashes;
}

Result<KvEventBatch> decode_kv(const msgpack::object& object) {
  PD_ASSIGN_OR_RETURN(auto fields, nested_fields(object, "kv"));
  KvEventBatch kv;
  PD_ASSIGN_OR_RETURN(kv.seq, nested_uint(fields, "kv", "seq", 0, UINT64_MAX));
  auto reset = fields.find("reset");
  if (reset == fields.end()) return invalid_argument("field 'kv.reset' is missing");
  if (reset->second->type != msgpack::type::BOOLEAN) return invalid_argument("field 'kv.reset' must be a bool");
  kv.reset = reset->second->via.boolean;
  PD_ASSIGN_OR_RETURN(uint64_t block_size, nested_uint(fields, "kv", "block_size", 1, kMaxKvBlockSize));
  kv.block_size = static_cast<uint32_t>(block_size);
  PD_ASSIGN_OR_RETURN(kv.stored, decode_hashes(fields, "stored"));
  PD_ASSIGN_OR_RETURN(kv.removed, decode_hashes(fields, "removed"));
  return kv;
}

void pack_hashes(msgpack::packer<msgpack::sbuffer>& pk, std::string_view key, const std::vector<uint64_t>& hashes) {
  pk.pack(key);
  std::vector<char> bytes(hashes.size() * 8);
  for (size_t i = 0; i < hashes.size(); ++i) {
    for (size_t b = 0; b < 8; ++b) bytes[i * 8 + b] = static_cast<char>((hashes[i] >> (8 * b)) & 0xff);
  }
  pk.pack_bin(static_cast<uint32_t>(bytes.size()));
  pk.pack_bin_body(bytes.data(), static_cast<uint32_t>(bytes.size()));
}

// Unpacks one frame's top-level map into `fields`; with `heartbeat`, also decodes
// its "load" and "kv" maps.
Result<RegistrationRecord> decode_frame(const void* data, size_t size, size_t max_bytes, Heartbeat* heartbeat) {
  if (size == 0) return invalid_argument("empty registration");
  if (size > max_bytes) return invalid_argument("registration is {} bytes, max {}", size, max_bytes);
  RawFields fields;
  try {
    // Limits bound what a hostile message can make the unpacker allocate;
    // the unpacker is iterative, so depth is bounded by the limit, not the stack.
    const msgpack::unpack_limit limit(/*array=*/64, /*map=*/64, /*str=*/4096, /*bin=*/8 * kMaxKvEventHashes,
                                      /*ext=*/64, /*depth=*/8);
    size_t offset = 0;
    msgpack::object_handle handle =
        msgpack::unpack(static_cast<const char*>(data), size, offset, nullptr, nullptr, limit);
    if (offset != size) return invalid_argument("registration has {} trailing bytes", size - offset);
    const msgpack::object& root = handle.get();
    if (root.type != msgpack::type::MAP) return invalid_argument("registration is not a msgpack map");
    for (uint32_t i = 0; i < root.via.map.size; ++i) {
      const msgpack::object_kv& kv = root.via.map.ptr[i];
      if (kv.key.type != msgpack::type::STR) return invalid_argument("registration has a non-string key");
      std::string key(object_str(kv.key));
      RawValue value = OtherType{};
      if (kv.val.type == msgpack::type::STR) {
        value = std::string(object_str(kv.val));
      } else if (kv.val.type == msgpack::type::POSITIVE_INTEGER) {
        value = kv.val.via.u64;
      }
      if (heartbeat != nullptr && key == "load") {
        PD_ASSIGN_OR_RETURN(heartbeat->load, decode_load(kv.val));
      } else if (heartbeat != nullptr && key == "kv") {
        PD_ASSIGN_OR_RETURN(heartbeat->kv, decode_kv(kv.val));
      }
      if (!fields.emplace(std::move(key), std::move(value)).second) {
        return invalid_argument("registration repeats a key");
      }
    }
  } catch (const std::exception& error) {
    return invalid_argument("registration is not valid msgpack: {}", error.what());
  }
  return validate_fields(fields, /*registration=*/true);
}

}  // namespace

Result<RegistrationRecord> decode_registration(const void* data, size_t size) {
  return decode_frame(data, size, kMaxRegistrationBytes, nullptr);
}

Result<Heartbeat> decode_heartbeat(const void* data, size_t size) {
  Heartbeat heartbeat;
  PD_ASSIGN_OR_RETURN(heartbeat.record, decode_frame(data, size, kMaxHeartbeatBytes, &heartbeat));
  return heartbeat;
}

std::vector<uint8_t> encode_heartbeat(const Heartbeat& heartbeat) {
  std::vector<uint8_t> frame = encode_registration(heartbeat.record);
  if (!heartbeat.load && !heartbeat.kv) return frame;
  // The record's map header is fixmap 11 (0x8b); the extra keys extend it.
  const uint8_t num_keys = 11 + (heartbeat.load ? 1 : 0) + (heartbeat.kv ? 1 : 0);
  frame[0] = static_cast<uint8_t>(0x80 | num_keys);
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> pk(buffer);
  if (heartbeat.load) {
    const LoadReport& l = *heartbeat.load;
    pk.pack(std::string_view("load"));
    pk.pack_map(5);
    pk.pack(std::string_view("running"));
    pk.pack(l.num_running);
    pk.pack(std::string_view("waiting"));
    pk.pack(l.num_waiting);
    pk.pack(std::string_view("kv_blocks_free"));
    pk.pack(l.num_kv_blocks_free);
    pk.pack(std::string_view("kv_blocks_total"));
    pk.pack(l.num_kv_blocks_total);
    pk.pack(std::string_view("queued_prefill_tokens"));
    pk.pack(l.num_queued_prefill_tokens);
  }
  if (heartbeat.kv) {
    const KvEventBatch& kv = *heartbeat.kv;
    pk.pack(std::string_view("kv"));
    pk.pack_map(5);
    pk.pack(std::string_view("seq"));
    pk.pack(kv.seq);
    pk.pack(std::string_view("reset"));
    pk.pack(kv.reset);
    pk.pack(std::string_view("block_size"));
    pk.pack(kv.block_size);
    pack_hashes(pk, "stored", kv.stored);
    pack_hashes(pk, "removed", kv.removed);
  }
  const auto* begin = reinterpret_cast<const uint8_t*>(buffer.data());
  frame.insert(frame.end(), begin, begin + buffer.size());
  return frame;
}

std::vector<uint8_t> encode_kv_resync() {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> pk(buffer);
  pk.pack_map(2);
  pk.pack(std::string_view("v"));
  pk.pack(kRegistrationVersion);
  pack_str(pk, "type", "kv_resync");
  const auto* begin = reinterpret_cast<const uint8_t*>(buffer.data());
  return {begin, begin + buffer.size()};
}

bool is_kv_resync(const void* data, size_t size) {
  const std::vector<uint8_t> expected = encode_kv_resync();
  return size == expected.size() && std::memcmp(data, expected.data(), size) == 0;
}

Result<RegistrationRecord> registration_from_json(const nlohmann::json& object) {
  if (!object.is_object()) return invalid_argument("instance info is not a JSON object");
  RawFields fields;
  for (const auto& [key, item] : object.items()) {
    RawValue value = OtherType{};
    if (item.is_string()) {
      value = item.get<std::string>();
    } else if (item.is_number_unsigned()) {
      value = item.get<uint64_t>();
    } else if (item.is_number_integer() && item.get<int64_t>() >= 0) {
      value = static_cast<uint64_t>(item.get<int64_t>());
    }
    fields.emplace(key, std::move(value));
  }
  return validate_fields(fields, /*registration=*/false);
}

}  // namespace pd::contract
