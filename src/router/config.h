// pdrouter configuration (filled from the command line in main.cc).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "router/instance_info.h"
#include "router/policy.h"

namespace pd::router {

struct RouterConfig {
  std::string host = "127.0.0.1";
  uint16_t port = 8000;
  // ZMQ registration listener (proxy_ip:proxy_ping_port of the instances); port -1 disables it, 0 picks one.
  std::string registration_host = "127.0.0.1";
  int registration_port = -1;
  std::string control_secret_file;  // CURVE on the registration socket when set

  std::vector<std::string> prefill_urls;
  std::vector<std::string> decode_urls;
  std::vector<std::string> collocated_urls;

  PolicyKind producer_policy = PolicyKind::kScored;
  PolicyKind consumer_policy = PolicyKind::kScored;
  PdPolicy pd_policy = PdPolicy::kAuto;     // --pd-policy
  DecisionThresholds thresholds;            // --pd-min-prefill-tokens, --pd-max-producer-queue-tokens, ...
  int64_t tokenize_timeout_ms = 1000;       // --tokenize-timeout-ms
  std::optional<TransferMode> forced_mode;  // nullopt: each consumer's registered mode

  int num_io_threads = 2;
  int64_t connect_timeout_ms = 2000;
  int64_t prefill_timeout_ms = 60000;       // whole producer leg
  int64_t decode_timeout_ms = 600000;       // whole consumer / collocated leg, stream included
  int64_t client_idle_timeout_ms = 120000;  // --client-idle-timeout-ms: wait for (the rest of) a client request
  int64_t client_write_timeout_ms = 60000;
  int max_prefill_retries = 1;  // other producers tried before falling back to collocated decode
  int64_t instance_ttl_ms = 5000;
  int64_t probe_interval_ms = 1000;                // static instances: GET /pd/info period
  size_t max_body_bytes = 8u << 20;                // --max-body-bytes: larger client bodies get 413 (pdserve's default)
  size_t max_idle_connections_per_backend = 1024;  // per io thread
  // --backend-idle-timeout-ms: a pooled engine connection idle this long is closed, never reused. Must be
  // below the engines' keep-alive (pdserve --keep-alive-timeout-ms, 60 s by default), after which they close
  // it themselves; half of pdserve's default leaves room for a loaded engine's late close.
  int64_t backend_idle_timeout_ms = 30000;
  int64_t resolve_timeout_ms = 5000;  // --resolve-timeout-ms: a registered host name's lookup
  // --info-timeout-ms: the one deadline of GET /v1/models and /version, which ask the instances at once.
  int64_t info_timeout_ms = 2000;
  // --max-connections: client connections served at once; one more is answered 503 at once and
  // closed. Without a cap, clients holding sockets open exhaust RLIMIT_NOFILE and accept() fails
  // for everyone, health checks included. 4096: about the requests one pdserve with its defaults
  // holds (256 running + 4096 queued, one leg each), and at 3 descriptors per client connection
  // (RouterServer::kFdsPerClientConnection) well within common hard limits (systemd 524288,
  // Docker 1048576). Checked against RLIMIT_NOFILE at start-up (main.cc).
  int64_t max_connections = 4096;
  std::string api_key;  // clients must send "Authorization: Bearer <key>" on /v1/*
  // Sent as "Authorization: Bearer <key>" on every request to an engine (legs and probes), for
  // engines started with --api-key. Empty: no Authorization header.
  std::string backend_api_key;
};

}  // namespace pd::router
