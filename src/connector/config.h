// --kv-transfer-config as vLLM spells it, parsed into a checked struct.
//
//   {"kv_connector": "PdConnector", "kv_role": "kv_producer"|"kv_consumer"|"kv_both",
//    "kv_connector_extra_config": {"read_mode": false, "backend": "auto"|"cuda"|"ucx",
//       "handshake_port": 0, "proxy_ip": "", "proxy_ping_port": 0, "http_port": 0,
//       "transfer_timeout": 30, "defer_timeout": 60, "recv_abort_timeout": 120,
//       "handshake_timeout": 5, "on_failure": "recompute"|"fail",
//       "control_secret_file": "", "allowed_peers": ["127.0.0.1", "10.0.0.0/8", "host:port"],
//       "first_token_handover": true, "allow_unauthenticated_control": false}}
//
// Timeouts are seconds (numbers, fractions allowed) as in vLLM; stored as ms.
// Unknown keys inside kv_connector_extra_config are refused (a typo in a
// timeout must not silently become the default); the vLLM top-level keys we
// do not use (kv_buffer_device, kv_rank, ...) are accepted and ignored.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "contract/roles.h"

namespace pd::connector {

// The contract's role (src/contract/roles.h); kv_role spells it "kv_producer" etc.
using KvRole = contract::Role;
// "producer" | "consumer" | "both" (the spelling of the registration record).
inline const char* kv_role_short_name(KvRole role) {
  return contract::role_name(role);
}

enum class TransferBackend : uint8_t { kAuto, kCuda, kUcx };
const char* transfer_backend_name(TransferBackend backend);

enum class FailurePolicy : uint8_t { kRecompute, kFail };
const char* failure_policy_name(FailurePolicy policy);

struct KvTransferConfig {
  KvRole role = KvRole::kBoth;
  bool read_mode = false;  // false = WRITE mode (producer pushes)
  // Consumer: take the whole prompt's KV and the producer's first output token
  // instead of computing the last prompt token again (saves one forward step
  // of TTFT). Off: the consumer computes it, as vLLM's connectors do.
  bool first_token_handover = true;
  TransferBackend backend = TransferBackend::kAuto;
  int32_t handshake_port = 0;  // control ROUTER port; 0 = pick a free one
  std::string proxy_ip;        // router registration address; empty = no registration
  int32_t proxy_ping_port = 0;
  int32_t http_port = 0;  // advertised HTTP port (0 = take the server's)
  int64_t transfer_timeout_ms = 30'000;
  int64_t defer_timeout_ms = 60'000;
  int64_t recv_abort_timeout_ms = 120'000;
  int64_t handshake_timeout_ms = 5'000;
  FailurePolicy on_failure = FailurePolicy::kRecompute;
  std::string control_secret_file;  // non-empty: CURVE on every control socket
  // A kv_ip beyond loopback needs control_secret_file, or this set to say the network is
  // trusted (parse_kv_transfer_config refuses the combination otherwise).
  bool allow_unauthenticated_control = false;
  // Peer policy for remote_control addresses taken from kv_transfer_params:
  // entries are "host", "host:port" or "a.b.c.d/len". Empty = loopback only.
  std::vector<std::string> allowed_peers;
  // Host advertised in the control address and used by xfer ("kv_ip" in vLLM).
  std::string kv_ip = "127.0.0.1";

  bool is_producer() const { return role != KvRole::kConsumer; }
  bool is_consumer() const { return role != KvRole::kProducer; }
  bool registers_with_router() const { return !proxy_ip.empty() && proxy_ping_port > 0; }
};

// Parses the JSON text of --kv-transfer-config. Every error names the key,
// what was expected and what was given.
Result<KvTransferConfig> parse_kv_transfer_config(std::string_view json_text);

// The server's two flags combined: --kv-transfer-config text (may be empty) and
// --kv-role (may be empty; "kv_producer" or the short "producer" spelling). A
// role flag alone means {"kv_connector":"PdConnector","kv_role":...} with defaults.
Result<KvTransferConfig> kv_transfer_config_from_flags(std::string_view config_json, std::string_view kv_role_flag);

// Peer policy: is "host:port" (a remote_control from a request) allowed by
// allowed_peers? Host must be a literal IPv4 address (names are refused, so a
// request can never make us resolve a name it chose).
bool peer_allowed(const std::vector<std::string>& allowed_peers, std::string_view host_port);

// Splits "host:port"; refuses empty host, non-numeric or out-of-range port.
Result<std::pair<std::string, int32_t>> split_host_port(std::string_view host_port);

}  // namespace pd::connector
