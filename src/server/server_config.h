// pdserve's command line: flags follow `vllm serve` where the meaning is the
// same (DESIGN.md §3.4). Parsed and validated here so main() stays thin and
// the rules are unit-testable.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace pd::server {

// --kv-transfer-config and --kv-role, kept for the connector: the
// server only checks the text is a JSON object and carries it.
struct KvTransferSettings {
  std::string config_json;  // as given; empty when absent
  nlohmann::json config;    // parsed; null when absent
  std::string kv_role;      // --kv-role or config["kv_role"]; empty when neither
};

// Token budget per step (--max-num-batched-tokens) when the flag is not given.
inline constexpr int32_t kDefaultMaxNumBatchedTokens = 2048;
// The same for a P/D producer (--kv-role kv_producer). A producer's steps are
// prefills only, and every prompt in a step gets its first token when the whole
// step ends; so its budget should stop where batching more prompts adds no
// prefill throughput (tokens per second flat against the budget), which
// `pd_gpu_engine_bench --pd-sweep 1` measures (tests/gpu/device_pd_engine_measure.sh,
// docs/perf/engine.md "P/D engine sweep"). On the H200 (Qwen3-32B, 2,048- and
// 8,192-token prompts) 2,048 is the smallest budget within 2 % of the best prefill
// throughput; larger budgets add at most 1-2 % and double first-token waits.
inline constexpr int32_t kProducerMaxNumBatchedTokens = 2048;

struct ServerConfig {
  std::string model = "builtin:tiny";
  std::string host = "127.0.0.1";
  int32_t port = 8000;                   // 0 = pick a free port (the real one is printed)
  std::optional<int32_t> max_model_len;  // absent = the model's own limit
  int32_t max_num_seqs = 256;
  int32_t max_num_batched_tokens = kDefaultMaxNumBatchedTokens;
  bool max_num_batched_tokens_given = false;  // else the role's default (validate_server_config)
  int32_t block_size = 16;
  double gpu_memory_utilization = 0.9;
  int32_t tensor_parallel_size = 1;
  bool enable_expert_parallel = false;  // MoE experts sharded whole over the tensor-parallel ranks
  std::string load_format = "auto";
  uint64_t seed = 0;
  std::vector<std::string> served_model_names;  // first is the name responses carry
  std::string api_key;                          // empty = no auth
  std::string device = "cpu";
  int32_t cuda_device = 0;    // CUDA device ordinal (all GPUs stay visible so CUDA IPC can reach peers)
  int64_t num_kv_blocks = 0;  // 0 = derive from --kv-cache-bytes / device memory
  int64_t kv_cache_bytes = 0;
  std::string kv_cache_dtype = "auto";  // auto (cpu: float32, cuda: bfloat16) | fp8 (e4m3 + per-token scales)
  size_t max_body_bytes = 8u << 20;
  std::string log_level = "info";
  int64_t max_waiting_requests = 4096;  // queued beyond the running set; more is answered 503
  // P/D consumer admission reserve (engine::SchedulerConfig::remote_output_reserve).
  double remote_output_reserve = 1.0;
  double kv_watermark = 0.01;
  int32_t num_io_threads = 2;
  int64_t request_timeout_ms = 600'000;  // bound on one request's whole life
  int64_t keep_alive_timeout_ms = 60'000;
  // --max-connections: open connections served at once (503 beyond). Absent: see
  // max_connections_or_default(). Checked against RLIMIT_NOFILE at start-up (main.cc).
  std::optional<int64_t> max_connections;
  KvTransferSettings kv_transfer;

  // The name a request's "model" must match (first served name, else --model).
  const std::string& primary_model_name() const {
    return served_model_names.empty() ? model : served_model_names.front();
  }
  bool serves_model(const std::string& name) const;

  // Without --max-connections: one connection for every request the engine can hold
  // (--max-num-seqs running + --max-waiting-requests queued), else the cap would answer 503
  // before the queue is full, plus kIdleConnectionAllowance for idle keep-alive clients,
  // routers' pooled connections, health checks and /metrics. 5376 with the defaults.
  static constexpr int64_t kIdleConnectionAllowance = 1024;
  int64_t max_connections_or_default() const {
    return max_connections.value_or(int64_t{max_num_seqs} + max_waiting_requests + kIdleConnectionAllowance);
  }
};

// Outcome of parsing argv: a config, or a request to exit (e.g. --help) with
// the text to print and the exit code.
struct CliOutcome {
  std::optional<ServerConfig> config;
  int exit_code = 0;
  std::string message;
};

CliOutcome parse_server_cli(int argc, const char* const* argv);

// Range and consistency checks (tensor parallel 1 only, JSON kv config, ...).
Status validate_server_config(ServerConfig& config);

}  // namespace pd::server
