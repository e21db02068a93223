// pdrouter: the PD-aware OpenAI router (DESIGN.md §3.5, docs/pd_contract.md).
#include <CLI/CLI.hpp>

#include <pthread.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <limits>
#include <thread>

#include "common/connection_limit.h"
#include "common/log.h"
#include "router/router_server.h"

namespace {

// Files pdrouter holds besides its client connections and their legs: the listener, epoll and
// event fds of each io thread and the control thread, the ZMQ context and registration socket,
// static-instance probes and a margin for idle pooled backend connections.
constexpr int64_t kReservedFds = 256;

}  // namespace

int main(int argc, char** argv) {
  // SIGINT/SIGTERM are blocked in every thread (threads inherit the mask) and taken by sigwait below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  pd::router::RouterConfig config;
  std::string producer_policy = "scored";
  std::string consumer_policy = "scored";
  std::string pd_policy = "auto";
  std::string mode = "auto";
  std::string log_level = "info";
  int port = 8000;
  config.num_io_threads = static_cast<int>(std::min(4u, std::max(1u, std::thread::hardware_concurrency())));

  CLI::App app{"pdrouter: PD-aware OpenAI router (READ, WRITE and collocated flows)"};
  app.add_option("--host", config.host, "HTTP listen address")->capture_default_str();
  app.add_option("--port", port, "HTTP port (0 picks a free one)")->capture_default_str()->check(CLI::Range(0, 65535));
  app.add_option("--registration-host", config.registration_host, "ZMQ registration listen address")
      ->capture_default_str();
  app.add_option("--registration-port", config.registration_port,
                 "ZMQ registration port (proxy_ping_port); 0 picks one, -1 disables")
      ->capture_default_str()
      ->check(CLI::Range(-1, 65535));
  app.add_option("--control-secret-file", config.control_secret_file,
                 "shared secret: CURVE-authenticate registrations (src/common/curve_auth.h)");
  app.add_option("--prefill", config.prefill_urls, "static producer URLs (http://host:port)");
  app.add_option("--decode", config.decode_urls, "static consumer URLs (http://host:port)");
  app.add_option("--collocated", config.collocated_urls, "static collocated URLs (http://host:port)");
  app.add_option("--prefill-policy", producer_policy, "round_robin|least_outstanding|power_of_two|scored")
      ->capture_default_str();
  app.add_option("--decode-policy", consumer_policy, "round_robin|least_outstanding|power_of_two|scored")
      ->capture_default_str();
  app.add_option("--pd-policy", pd_policy, "always|never|auto: where each prompt is prefilled (README.md)")
      ->capture_default_str();
  app.add_option("--pd-min-prefill-tokens", config.thresholds.min_remote_prefill_tokens,
                 "auto: remote prefill only for at least this many uncached prompt tokens")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  app.add_option("--pd-max-producer-queue-tokens", config.thresholds.max_producer_queue_tokens,
                 "auto: remote prefill only while the producer's queued prefill tokens are at most this")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  app.add_option("--outstanding-request-tokens", config.thresholds.outstanding_request_tokens,
                 "scored policy: prompt tokens of work one outstanding request counts as")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 30));
  app.add_option("--tokenize-timeout-ms", config.tokenize_timeout_ms,
                 "the longest wait for an engine's /tokenize of a text prompt (per-request decisions)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{600000}));
  app.add_option("--mode", mode, "auto (each consumer's registered mode)|read|write")->capture_default_str();
  app.add_option("--io-threads", config.num_io_threads, "HTTP io threads")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  app.add_option("--connect-timeout-ms", config.connect_timeout_ms)->capture_default_str();
  app.add_option("--prefill-timeout-ms", config.prefill_timeout_ms, "deadline of a producer leg")
      ->capture_default_str();
  app.add_option("--decode-timeout-ms", config.decode_timeout_ms, "deadline of a consumer/collocated leg")
      ->capture_default_str();
  app.add_option("--client-idle-timeout-ms", config.client_idle_timeout_ms,
                 "wait for a client's next request (keep-alive) or the rest of one; the connection closes after")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, std::numeric_limits<int64_t>::max() / 1'000'000));
  app.add_option("--backend-idle-timeout-ms", config.backend_idle_timeout_ms,
                 "close pooled engine connections idle this long; keep it below the engines' keep-alive "
                 "(pdserve --keep-alive-timeout-ms, default 60000)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, std::numeric_limits<int64_t>::max() / 1'000'000));
  app.add_option("--resolve-timeout-ms", config.resolve_timeout_ms,
                 "longest wait for the address of a host name an instance registers")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{600'000}));
  app.add_option("--info-timeout-ms", config.info_timeout_ms,
                 "deadline of GET /v1/models and /version (every instance asked at once; one that does not answer "
                 "in time is left out)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{600'000}));
  app.add_option("--max-prefill-retries", config.max_prefill_retries,
                 "other producers tried before the collocated fallback")
      ->capture_default_str()
      ->check(CLI::Range(0, 16));
  app.add_option("--instance-ttl-ms", config.instance_ttl_ms, "expiry of a silent instance")->capture_default_str();
  app.add_option("--probe-interval-ms", config.probe_interval_ms, "GET /pd/info period for static instances")
      ->capture_default_str();
  app.add_option("--max-body-bytes", config.max_body_bytes, "largest client request body accepted (413 beyond)")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1024}, std::numeric_limits<size_t>::max()));
  app.add_option("--api-key", config.api_key, "require 'Authorization: Bearer KEY' on /v1/*");
  app.add_option("--backend-api-key", config.backend_api_key,
                 "send 'Authorization: Bearer KEY' on every request to an engine (engines run with --api-key KEY)")
      ->envname("PDROUTER_BACKEND_API_KEY");
  app.add_option("--max-connections", config.max_connections,
                 "client connections served at once; more are answered 503 (checked against RLIMIT_NOFILE)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, pd::kMaxConnectionsCeiling));
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error|off")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  pd::log::init(log_level);
  config.port = static_cast<uint16_t>(port);
  auto parsed_producer = pd::router::parse_policy(producer_policy);
  auto parsed_consumer = pd::router::parse_policy(consumer_policy);
  if (!parsed_producer.ok() || !parsed_consumer.ok()) {
    std::fprintf(stderr, "pdrouter: %s\n",
                 (!parsed_producer.ok() ? parsed_producer.status() : parsed_consumer.status()).to_string().c_str());
    return 2;
  }
  config.producer_policy = *parsed_producer;
  config.consumer_policy = *parsed_consumer;
  auto parsed_pd_policy = pd::router::parse_pd_policy(pd_policy);
  if (!parsed_pd_policy.ok()) {
    std::fprintf(stderr, "pdrouter: --pd-policy: %s\n", parsed_pd_policy.status().to_string().c_str());
    return 2;
  }
  config.pd_policy = *parsed_pd_policy;
  if (mode != "auto") {
    auto parsed_mode = pd::router::parse_mode(mode);
    if (!parsed_mode.ok()) {
      std::fprintf(stderr, "pdrouter: --mode: %s\n", parsed_mode.status().to_string().c_str());
      return 2;
    }
    config.forced_mode = *parsed_mode;
  }
  // The key goes into a header line: a CR or LF would let it add headers of its own.
  if (std::any_of(config.backend_api_key.begin(), config.backend_api_key.end(),
                  [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; })) {
    std::fprintf(stderr, "pdrouter: --backend-api-key must not contain control characters\n");
    return 2;
  }
  if (config.prefill_urls.empty() && config.decode_urls.empty() && config.collocated_urls.empty() &&
      config.registration_port < 0) {
    std::fprintf(stderr, "pdrouter: no discovery: give --prefill/--decode/--collocated URLs or --registration-port\n");
    return 2;
  }

  const pd::ConnectionFdBudget budget{pd::router::RouterServer::kFdsPerClientConnection,
                                      kReservedFds + pd::router::RouterServer::kMaxRefusalsInFlight};
  auto max_connections = pd::fit_connection_limit_to_open_files("--max-connections", config.max_connections,
                                                                app.count("--max-connections") > 0, budget);
  if (!max_connections.ok()) {
    std::fprintf(stderr, "pdrouter: %s\n", max_connections.status().to_string().c_str());
    return 2;
  }
  config.max_connections = *max_connections;

  pd::router::RouterServer server(config);
  if (pd::Status started = server.start(); !started.ok()) {
    std::fprintf(stderr, "pdrouter: %s\n", started.to_string().c_str());
    return 1;
  }
  if (server.registration_port() >= 0) {
    std::printf("pdrouter registration on tcp://%s:%d\n", config.registration_host.c_str(), server.registration_port());
  }
  std::printf("pdrouter listening on http://%s:%u\n", config.host.c_str(), server.http_port());
  std::fflush(stdout);
  int signal_number = 0;
  sigwait(&stop_signals, &signal_number);
  PD_LOG_INFO("pdrouter: shutting down");
  server.stop();
  return 0;
}
