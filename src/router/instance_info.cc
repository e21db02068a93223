#include "router/instance_info.h"

#include <msgpack.hpp>

#include <charconv>
#include <map>
#include <variant>

namespace pd::router {

const char* role_name(InstanceRole role) {
  switch (role) {
    case InstanceRole::kProducer:
      return "producer";
    case InstanceRole::kConsumer:
      return "consumer";
    case InstanceRole::kBoth:
      return "both";
  }
  return "?";
}

const char* mode_name(TransferMode mode) {
  return mode == TransferMode::kRead ? "read" : "write";
}

Result<InstanceRole> parse_role(std::string_view text) {
  if (text == "producer") return InstanceRole::kProducer;
  if (text == "consumer") return InstanceRole::kConsumer;
  if (text == "both") return InstanceRole::kBoth;
  return invalid_argument("role must be producer|consumer|both, got '{}'", text.substr(0, 32));
}

Result<TransferMode> parse_mode(std::string_view text) {
  if (text == "read") return TransferMode::kRead;
  if (text == "write") return TransferMode::kWrite;
  return invalid_argument("mode must be read|write, got '{}'", text.substr(0, 32));
}

std::string HostPort::to_string() const {
  if (host.find(':') != std::string::npos) return fmt::format("[{}]:{}", host, port);
  return fmt::format("{}:{}", host, port);
}

namespace {

bool is_printable_ascii(std::string_view text) {
  for (char c : text) {
    if (c < 0x21 || c > 0x7e) return false;
  }
  return true;
}

// Well-formed UTF-8 (RFC 3629): no overlong forms, no surrogates, nothing above U+10FFFF.
bool is_valid_utf8(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto lead = static_cast<unsigned char>(text[i]);
    size_t num_continuation = 0;
    unsigned char second_min = 0x80;
    unsigned char second_max = 0xbf;
    if (lead < 0x80) {
      ++i;
      continue;
    }
    if (lead >= 0xc2 && lead <= 0xdf) {
      num_continuation = 1;
    } else if (lead >= 0xe0 && lead <= 0xef) {
      num_continuation = 2;
      if (lead == 0xe0) second_min = 0xa0;  // overlong
      if (lead == 0xed) second_max = 0x9f;  // surrogates
    } else if (lead >= 0xf0 && lead <= 0xf4) {
      num_continuation = 3;
      if (lead == 0xf0) second_min = 0x90;  // overlong
      if (lead == 0xf4) second_max = 0x8f;  // above U+10FFFF
    } else {
      return false;
    }
    if (text.size() - i <= num_continuation) return false;
    for (size_t k = 1; k <= num_continuation; ++k) {
      const auto byte = static_cast<unsigned char>(text[i + k]);
      const unsigned char min = k == 1 ? second_min : 0x80;
      const unsigned char max = k == 1 ? second_max : 0xbf;
      if (byte < min || byte > max) return false;
    }
    i += num_continuation + 1;
  }
  return true;
}

}  // namespace

Result<HostPort> parse_host_port(std::string_view text) {
  std::string_view host;
  std::string_view port_text;
  if (!text.empty() && text.front() == '[') {
    size_t close = text.find(']');
    if (close == std::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return invalid_argument("address '{}' is not [v6]:port", text.substr(0, 64));
    }
    host = text.substr(1, close - 1);
    port_text = text.substr(close + 2);
    // Brackets hold an IPv6 address only: "[name]:port" would print back as "name:port", and
    // "[[1]:9" as "[1:9", which no longer parses.
    if (host.find(':') == std::string_view::npos) {
      return invalid_argument("address '{}': brackets are for IPv6 hosts only", text.substr(0, 64));
    }
  } else {
    size_t colon = text.rfind(':');
    if (colon == std::string_view::npos) return invalid_argument("address '{}' has no :port", text.substr(0, 64));
    host = text.substr(0, colon);
    port_text = text.substr(colon + 1);
    if (host.find(':') != std::string_view::npos) {
      return invalid_argument("address '{}': IPv6 hosts need brackets", text.substr(0, 64));
    }
  }
  if (host.empty() || host.size() > 253 || !is_printable_ascii(host) ||
      host.find_first_of("/[]") != std::string_view::npos) {
    return invalid_argument("address '{}' has an invalid host", text.substr(0, 64));
  }
  unsigned port = 0;
  auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (ec != std::errc() || end != port_text.data() + port_text.size() || port == 0 || port > 65535) {
    return invalid_argument("address '{}' has an invalid port (1..65535)", text.substr(0, 64));
  }
  return HostPort{std::string(host), static_cast<uint16_t>(port)};
}

Result<HostPort> parse_http_url(std::string_view url) {
  constexpr std::string_view kScheme = "http://";
  if (url.substr(0, kScheme.size()) != kScheme) {
    return invalid_argument("url '{}' must start with http://", url.substr(0, 64));
  }
  std::string_view rest = url.substr(kScheme.size());
  if (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);
  return parse_host_port(rest);
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

Result<InstanceInfo> validate_fields(const RawFields& fields, bool registration) {
  if (registration) {
    PD_ASSIGN_OR_RETURN(uint64_t version, get_uint(fields, "v", 0, UINT64_MAX));
    if (version != 1) return invalid_argument("unsupported registration version {} (expected 1)", version);
    PD_ASSIGN_OR_RETURN(std::string type, get_string(fields, "type", 32, false));
    if (type != "register") return invalid_argument("type must be 'register', got '{}'", type);
  }
  InstanceInfo info;
  PD_ASSIGN_OR_RETURN(std::string role, get_string(fields, "role", 16, false));
  PD_ASSIGN_OR_RETURN(info.role, parse_role(role));
  PD_ASSIGN_OR_RETURN(std::string http, get_string(fields, "http", 300, false));
  PD_ASSIGN_OR_RETURN(info.http, parse_host_port(http));
  // A collocated instance may run without a connector; every P/D participant needs a control address.
  PD_ASSIGN_OR_RETURN(std::string control, get_string(fields, "control", 300, info.role == InstanceRole::kBoth));
  if (!control.empty()) {
    PD_ASSIGN_OR_RETURN(HostPort control_address, parse_host_port(control));
    info.control = control_address;
  }
  PD_ASSIGN_OR_RETURN(info.instance_id, get_string(fields, "instance_id", kMaxInstanceIdBytes, false));
  if (!is_printable_ascii(info.instance_id)) return invalid_argument("instance_id must be printable ASCII");
  PD_ASSIGN_OR_RETURN(info.boot_nonce, get_uint(fields, "boot_nonce", 0, UINT64_MAX));
  PD_ASSIGN_OR_RETURN(uint64_t tp_size, get_uint(fields, "tp_size", 1, kMaxParallelSize));
  PD_ASSIGN_OR_RETURN(uint64_t dp_size, get_uint(fields, "dp_size", 1, kMaxParallelSize));
  info.tp_size = static_cast<uint32_t>(tp_size);
  info.dp_size = static_cast<uint32_t>(dp_size);
  PD_ASSIGN_OR_RETURN(std::string mode, get_string(fields, "mode", 16, false));
  PD_ASSIGN_OR_RETURN(info.mode, parse_mode(mode));
  PD_ASSIGN_OR_RETURN(info.model, get_string(fields, "model", kMaxModelNameBytes, false));
  return info;
}

}  // namespace

Result<InstanceInfo> parse_registration(const void* data, size_t size) {
  if (size == 0) return invalid_argument("empty registration");
  if (size > kMaxRegistrationBytes)
    return invalid_argument("registration is {} bytes, max {}", size, kMaxRegistrationBytes);
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

Result<InstanceInfo> parse_instance_info_json(const nlohmann::json& object) {
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

}  // namespace pd::router
