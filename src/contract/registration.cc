#include "contract/registration.h"

#include <msgpack.hpp>

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

Result<RegistrationRecord> decode_registration(const void* data, size_t size) {
  if (size == 0) return invalid_argument("empty registration");
  if (size > kMaxRegistrationBytes) {
    return invalid_argument("registration is {} bytes, max {}", size, kMaxRegistrationBytes);
  }
  RawFields fields;
  try {
    // Limits bound what a hostile message can make the unpacker allocate;
    // the unpacker is iterative, so depth is bounded by the limit, not the stack.
    const msgpack::unpack_limit limit(/*array=*/64, /*map=*/64, /*str=*/4096, /*bin=*/4096, /*ext=*/64, /*depth=*/8);
    size_t offset = 0;
    msgpack::object_handle handle =
        msgpack::unpack(static_cast<const char*>(data), size, offset, nullptr, nullptr, limit);
    if (offset != size) return invalid_argument("registration has {} trailing bytes", size - offset);
    const msgpack::object& root = handle.get();
    if (root.type != msgpack::type::MAP) return invalid_argument("registration is not a msgpack map");
    for (uint32_t i = 0; i < root.via.map.size; ++i) {
      const msgpack::object_kv& kv = root.via.map.ptr[i];
      if (kv.key.type != msgpack::type::STR) return invalid_argument("registration has a non-string key");
      std::string key(kv.key.via.str.ptr, kv.key.via.str.size);
      RawValue value = OtherType{};
      if (kv.val.type == msgpack::type::STR) {
        value = std::string(kv.val.via.str.ptr, kv.val.via.str.size);
      } else if (kv.val.type == msgpack::type::POSITIVE_INTEGER) {
        value = kv.val.via.u64;
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
