#include "connector/config.h"

#include <arpa/inet.h>

#include <nlohmann/json.hpp>

#include <charconv>
#include <cmath>
#include <set>

namespace pd::connector {
namespace {

using nlohmann::json;

const char* json_type_name(const json& value) {
  return value.type_name();
}

Status read_bool(const json& obj, const char* key, bool* out) {
  auto it = obj.find(key);
  if (it == obj.end()) return Status::Ok();
  if (!it->is_boolean()) {
    return invalid_argument("kv_connector_extra_config.{}: expected a boolean, got {}", key, json_type_name(*it));
  }
  *out = it->get<bool>();
  return Status::Ok();
}

Status read_string(const json& obj, const char* key, std::string* out, size_t max_len = 4096) {
  auto it = obj.find(key);
  if (it == obj.end()) return Status::Ok();
  if (!it->is_string()) {
    return invalid_argument("kv_connector_extra_config.{}: expected a string, got {}", key, json_type_name(*it));
  }
  const auto& text = it->get_ref<const std::string&>();
  if (text.size() > max_len) {
    return invalid_argument("kv_connector_extra_config.{}: longer than {} bytes", key, max_len);
  }
  *out = text;
  return Status::Ok();
}

Status read_port(const json& obj, const char* key, int32_t* out) {
  auto it = obj.find(key);
  if (it == obj.end()) return Status::Ok();
  if (!it->is_number_integer()) {
    return invalid_argument("kv_connector_extra_config.{}: expected an integer port, got {}", key, json_type_name(*it));
  }
  const int64_t port = it->get<int64_t>();
  if (port < 0 || port > 65535) {
    return invalid_argument("kv_connector_extra_config.{}: port must be in [0, 65535], got {}", key, port);
  }
  *out = static_cast<int32_t>(port);
  return Status::Ok();
}

// Seconds (integer or fraction) -> ms; must be > 0 and at most one day.
Status read_timeout(const json& obj, const char* key, int64_t* out_ms) {
  auto it = obj.find(key);
  if (it == obj.end()) return Status::Ok();
  if (!it->is_number()) {
    return invalid_argument("kv_connector_extra_config.{}: expected a number of seconds, got {}", key,
                            json_type_name(*it));
  }
  const double seconds = it->get<double>();
  if (!std::isfinite(seconds) || seconds <= 0.0 || seconds > 86400.0) {
    return invalid_argument("kv_connector_extra_config.{}: seconds must be in (0, 86400], got {}", key, seconds);
  }
  *out_ms = std::max<int64_t>(1, static_cast<int64_t>(std::llround(seconds * 1000.0)));
  return Status::Ok();
}

bool parse_ipv4(std::string_view text, uint32_t* out) {
  if (text.empty() || text.size() > 15) return false;
  std::string copy(text);
  in_addr addr{};
  if (inet_pton(AF_INET, copy.c_str(), &addr) != 1) return false;
  *out = ntohl(addr.s_addr);
  return true;
}

Status validate_peer_entry(const std::string& entry) {
  const auto slash = entry.find('/');
  if (slash != std::string::npos) {
    uint32_t ip = 0;
    int prefix = -1;
    const std::string_view bits = std::string_view(entry).substr(slash + 1);
    auto [ptr, ec] = std::from_chars(bits.data(), bits.data() + bits.size(), prefix);
    if (!parse_ipv4(std::string_view(entry).substr(0, slash), &ip) || ec != std::errc() ||
        ptr != bits.data() + bits.size() || prefix < 0 || prefix > 32) {
      return invalid_argument("kv_connector_extra_config.allowed_peers: '{}' is not a.b.c.d/len", entry);
    }
    return Status::Ok();
  }
  std::string_view host = entry;
  if (entry.find(':') != std::string::npos) {
    auto split = split_host_port(entry);
    if (!split.ok()) {
      return invalid_argument("kv_connector_extra_config.allowed_peers: '{}': {}", entry, split.status().message());
    }
    host = std::string_view(entry).substr(0, entry.rfind(':'));
  }
  uint32_t ip = 0;
  if (!parse_ipv4(host, &ip)) {
    return invalid_argument("kv_connector_extra_config.allowed_peers: '{}' is not an IPv4 address", entry);
  }
  return Status::Ok();
}

}  // namespace

const char* transfer_backend_name(TransferBackend backend) {
  switch (backend) {
    case TransferBackend::kAuto:
      return "auto";
    case TransferBackend::kCuda:
      return "cuda";
    case TransferBackend::kUcx:
      return "ucx";
  }
  return "?";
}

const char* failure_policy_name(FailurePolicy policy) {
  return policy == FailurePolicy::kRecompute ? "recompute" : "fail";
}

Result<std::pair<std::string, int32_t>> split_host_port(std::string_view host_port) {
  const auto colon = host_port.rfind(':');
  if (colon == std::string_view::npos || colon == 0) {
    return invalid_argument("'{}' is not host:port", host_port);
  }
  const std::string_view port_text = host_port.substr(colon + 1);
  int32_t port = -1;
  auto [ptr, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (port_text.empty() || ec != std::errc() || ptr != port_text.data() + port_text.size() || port <= 0 ||
      port > 65535) {
    return invalid_argument("'{}': port must be in [1, 65535]", host_port);
  }
  return std::pair<std::string, int32_t>(std::string(host_port.substr(0, colon)), port);
}

bool peer_allowed(const std::vector<std::string>& allowed_peers, std::string_view host_port) {
  auto split = split_host_port(host_port);
  if (!split.ok()) return false;
  uint32_t ip = 0;
  if (!parse_ipv4(split->first, &ip)) return false;
  if (allowed_peers.empty()) return (ip >> 24) == 127;  // loopback only by default
  for (const auto& entry : allowed_peers) {
    const auto slash = entry.find('/');
    if (slash != std::string::npos) {
      uint32_t net = 0;
      if (!parse_ipv4(std::string_view(entry).substr(0, slash), &net)) continue;
      const int prefix = std::stoi(entry.substr(slash + 1));
      const uint32_t mask = prefix == 0 ? 0u : ~uint32_t{0} << (32 - prefix);
      if ((ip & mask) == (net & mask)) return true;
    } else if (entry.find(':') != std::string::npos) {
      if (entry == host_port) return true;
    } else {
      uint32_t host = 0;
      if (parse_ipv4(entry, &host) && host == ip) return true;
    }
  }
  return false;
}

Result<KvTransferConfig> kv_transfer_config_from_flags(std::string_view config_json, std::string_view kv_role_flag) {
  std::string role(kv_role_flag);
  if (role == "producer" || role == "consumer" || role == "both") role = "kv_" + role;
  json root = json::object();
  if (!config_json.empty()) {
    try {
      root = json::parse(config_json);
    } catch (const json::exception& e) {
      return invalid_argument("--kv-transfer-config is not valid JSON: {}", e.what());
    }
    if (!root.is_object()) return invalid_argument("--kv-transfer-config: expected a JSON object");
  }
  if (!root.contains("kv_connector")) root["kv_connector"] = "PdConnector";
  if (!role.empty()) {
    if (root.contains("kv_role") && root["kv_role"] != role) {
      return invalid_argument("--kv-role {} contradicts kv_role {} in --kv-transfer-config", role,
                              root["kv_role"].dump());
    }
    root["kv_role"] = role;
  }
  return parse_kv_transfer_config(root.dump());
}

namespace {
Result<KvTransferConfig> parse_kv_transfer_config_fields(std::string_view json_text);
}  // namespace

// DESIGN.md §6.9: an unauthenticated control plane on the network is a failure mode of the
// reference systems. Loopback stays usable without a secret (one host, the demo, the tests);
// beyond it the deployment says which it wants, CURVE or explicitly none.
Result<KvTransferConfig> parse_kv_transfer_config(std::string_view json_text) {
  PD_ASSIGN_OR_RETURN(KvTransferConfig config, parse_kv_transfer_config_fields(json_text));
  uint32_t ip = 0;
  const bool loopback = parse_ipv4(config.kv_ip, &ip) && (ip >> 24) == 127;
  if (!loopback && config.control_secret_file.empty() && !config.allow_unauthenticated_control) {
    return invalid_argument(
        "--kv-transfer-config: kv_ip {} puts the KV control plane on the network without authentication; set "
        "kv_connector_extra_config.control_secret_file (CURVE on every control socket) or, on a network you "
        "trust, allow_unauthenticated_control: true",
        config.kv_ip);
  }
  return config;
}

namespace {
Result<KvTransferConfig> parse_kv_transfer_config_fields(std::string_view json_text) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    return invalid_argument("--kv-transfer-config is not valid JSON: {}", e.what());
  }
  if (!root.is_object()) {
    return invalid_argument("--kv-transfer-config: expected a JSON object, got {}", json_type_name(root));
  }
  static const std::set<std::string> kTopKeys = {
      "kv_connector", "kv_role", "kv_connector_extra_config", "engine_id", "kv_ip", "kv_port",
      // vLLM keys that have no meaning here; accepted so vLLM commands carry over.
      "kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_connector_module_path",
      "kv_load_failure_policy"};
  for (const auto& [key, value] : root.items()) {
    if (!kTopKeys.count(key)) return invalid_argument("--kv-transfer-config: unknown key '{}'", key);
  }
  KvTransferConfig config;
  auto connector = root.find("kv_connector");
  if (connector == root.end() || !connector->is_string() || connector->get<std::string>() != "PdConnector") {
    return invalid_argument("--kv-transfer-config: kv_connector must be \"PdConnector\", got {}",
                            connector == root.end() ? std::string("nothing") : connector->dump());
  }
  auto role = root.find("kv_role");
  if (role == root.end() || !role->is_string()) {
    return invalid_argument("--kv-transfer-config: kv_role must be one of kv_producer, kv_consumer, kv_both");
  }
  const auto& role_text = role->get_ref<const std::string&>();
  if (role_text == "kv_producer")
    config.role = KvRole::kProducer;
  else if (role_text == "kv_consumer")
    config.role = KvRole::kConsumer;
  else if (role_text == "kv_both")
    config.role = KvRole::kBoth;
  else
    return invalid_argument("--kv-transfer-config: kv_role '{}' is not kv_producer, kv_consumer or kv_both", role_text);

  if (auto ip = root.find("kv_ip"); ip != root.end()) {
    uint32_t parsed = 0;
    if (!ip->is_string() || !parse_ipv4(ip->get<std::string>(), &parsed)) {
      return invalid_argument("--kv-transfer-config: kv_ip must be an IPv4 address, got {}", ip->dump());
    }
    config.kv_ip = ip->get<std::string>();
  }

  auto extra_it = root.find("kv_connector_extra_config");
  if (extra_it == root.end()) return config;
  const json& extra = *extra_it;
  if (!extra.is_object()) {
    return invalid_argument("kv_connector_extra_config: expected an object, got {}", json_type_name(extra));
  }
  static const std::set<std::string> kExtraKeys = {"read_mode",
                                                   "backend",
                                                   "handshake_port",
                                                   "proxy_ip",
                                                   "proxy_ping_port",
                                                   "http_port",
                                                   "transfer_timeout",
                                                   "defer_timeout",
                                                   "recv_abort_timeout",
                                                   "handshake_timeout",
                                                   "on_failure",
                                                   "control_secret_file",
                                                   "allowed_peers",
                                                   "first_token_handover",
                                                   "allow_unauthenticated_control"};
  for (const auto& [key, value] : extra.items()) {
    if (!kExtraKeys.count(key)) {
      return invalid_argument(
          "kv_connector_extra_config: unknown key '{}' (known: read_mode, backend, "
          "handshake_port, proxy_ip, proxy_ping_port, http_port, transfer_timeout, "
          "defer_timeout, recv_abort_timeout, handshake_timeout, on_failure, "
          "control_secret_file, allowed_peers, first_token_handover, allow_unauthenticated_control)",
          key);
    }
  }
  PD_RETURN_IF_ERROR(read_bool(extra, "read_mode", &config.read_mode));
  PD_RETURN_IF_ERROR(read_bool(extra, "first_token_handover", &config.first_token_handover));
  PD_RETURN_IF_ERROR(read_bool(extra, "allow_unauthenticated_control", &config.allow_unauthenticated_control));
  std::string backend = "auto";
  PD_RETURN_IF_ERROR(read_string(extra, "backend", &backend));
  if (backend == "auto")
    config.backend = TransferBackend::kAuto;
  else if (backend == "cuda")
    config.backend = TransferBackend::kCuda;
  else if (backend == "ucx")
    config.backend = TransferBackend::kUcx;
  else
    return invalid_argument("kv_connector_extra_config.backend: expected auto, cuda or ucx, got '{}'", backend);
  PD_RETURN_IF_ERROR(read_port(extra, "handshake_port", &config.handshake_port));
  PD_RETURN_IF_ERROR(read_string(extra, "proxy_ip", &config.proxy_ip, 255));
  PD_RETURN_IF_ERROR(read_port(extra, "proxy_ping_port", &config.proxy_ping_port));
  PD_RETURN_IF_ERROR(read_port(extra, "http_port", &config.http_port));
  PD_RETURN_IF_ERROR(read_timeout(extra, "transfer_timeout", &config.transfer_timeout_ms));
  PD_RETURN_IF_ERROR(read_timeout(extra, "defer_timeout", &config.defer_timeout_ms));
  PD_RETURN_IF_ERROR(read_timeout(extra, "recv_abort_timeout", &config.recv_abort_timeout_ms));
  PD_RETURN_IF_ERROR(read_timeout(extra, "handshake_timeout", &config.handshake_timeout_ms));
  std::string policy = "recompute";
  PD_RETURN_IF_ERROR(read_string(extra, "on_failure", &policy));
  if (policy == "recompute")
    config.on_failure = FailurePolicy::kRecompute;
  else if (policy == "fail")
    config.on_failure = FailurePolicy::kFail;
  else
    return invalid_argument("kv_connector_extra_config.on_failure: expected recompute or fail, got '{}'", policy);
  PD_RETURN_IF_ERROR(read_string(extra, "control_secret_file", &config.control_secret_file));
  if (auto peers = extra.find("allowed_peers"); peers != extra.end()) {
    if (!peers->is_array()) {
      return invalid_argument("kv_connector_extra_config.allowed_peers: expected an array of strings, got {}",
                              json_type_name(*peers));
    }
    for (const auto& entry : *peers) {
      if (!entry.is_string()) {
        return invalid_argument("kv_connector_extra_config.allowed_peers: expected strings, got {}",
                                json_type_name(entry));
      }
      PD_RETURN_IF_ERROR(validate_peer_entry(entry.get<std::string>()));
      config.allowed_peers.push_back(entry.get<std::string>());
    }
  }
  if (!config.proxy_ip.empty()) {
    uint32_t parsed = 0;
    if (!parse_ipv4(config.proxy_ip, &parsed)) {
      return invalid_argument("kv_connector_extra_config.proxy_ip: expected an IPv4 address, got '{}'",
                              config.proxy_ip);
    }
    if (config.proxy_ping_port == 0) {
      return invalid_argument("kv_connector_extra_config: proxy_ip is set but proxy_ping_port is missing");
    }
  }
  return config;
}
}  // namespace

}  // namespace pd::connector
