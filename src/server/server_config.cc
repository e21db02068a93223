#include "server/server_config.h"

#include <CLI/CLI.hpp>

#include <algorithm>

#include "common/connection_limit.h"

namespace pd::server {

bool ServerConfig::serves_model(const std::string& name) const {
  if (served_model_names.empty()) return name == model;
  return std::find(served_model_names.begin(), served_model_names.end(), name) != served_model_names.end();
}

CliOutcome parse_server_cli(int argc, const char* const* argv) {
  ServerConfig config;
  int32_t max_model_len = 0;
  int64_t max_connections = 0;
  CLI::App app{"pdserve: OpenAI-compatible LLM server (one engine instance)", "pdserve"};
  app.add_option("--model", config.model, "HF model directory or builtin:tiny")->capture_default_str();
  app.add_option("--host", config.host, "address to listen on")->capture_default_str();
  app.add_option("--port", config.port, "port to listen on; 0 picks a free one")->capture_default_str();
  app.add_option("--max-model-len", max_model_len, "prompt + output token limit (default: the model's)");
  app.add_option("--max-num-seqs", config.max_num_seqs, "requests running at once")->capture_default_str();
  app.add_option("--max-num-batched-tokens", config.max_num_batched_tokens, "token budget per engine step")
      ->capture_default_str();
  app.add_option("--block-size", config.block_size, "KV cache block size in tokens")->capture_default_str();
  app.add_option("--gpu-memory-utilization", config.gpu_memory_utilization, "fraction of device memory to use")
      ->capture_default_str();
  app.add_option("--tensor-parallel-size", config.tensor_parallel_size,
                 "tensor-parallel ranks (cpu: threads of this process)")
      ->capture_default_str();
  app.add_flag("--enable-expert-parallel", config.enable_expert_parallel,
               "MoE: shard whole experts over the tensor-parallel ranks (attention stays tensor-parallel)");
  app.add_option("--load-format", config.load_format, "auto|safetensors|dummy")->capture_default_str();
  app.add_option("--kv-cache-dtype", config.kv_cache_dtype,
                 "auto (cpu: float32, cuda: bfloat16) | fp8 (e4m3 with one fp32 scale per token and kv head)")
      ->capture_default_str();
  app.add_option("--seed", config.seed, "base seed for requests without their own")->capture_default_str();
  app.add_option("--served-model-name", config.served_model_names, "name(s) clients use for the model");
  app.add_option("--api-key", config.api_key, "require 'Authorization: Bearer <key>' on /v1/*");
  app.add_option("--device", config.device, "cpu|cuda")->capture_default_str();
  app.add_option("--cuda-device", config.cuda_device,
                 "CUDA device ordinal for --device cuda (keep every GPU visible: P/D copies need peer access)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--num-kv-blocks", config.num_kv_blocks, "KV blocks to allocate (overrides --kv-cache-bytes)");
  app.add_option("--kv-cache-bytes", config.kv_cache_bytes, "bytes of KV cache to allocate");
  app.add_option("--max-body-bytes", config.max_body_bytes, "largest request body accepted (413 beyond)")
      ->capture_default_str();
  app.add_option("--log-level", config.log_level, "trace|debug|info|warn|error|off")->capture_default_str();
  app.add_option("--max-waiting-requests", config.max_waiting_requests,
                 "requests queued beyond the running set before new ones get 503")
      ->capture_default_str();
  app.add_option("--remote-output-reserve", config.remote_output_reserve,
                 "P/D consumer: admit a request that loads remote KV only when the free KV blocks also cover "
                 "this fraction of the maximum output of it and of every admitted request (<= 1; negative: "
                 "no reserve)")
      ->capture_default_str();
  app.add_option("--kv-watermark", config.kv_watermark,
                 "fraction of KV blocks a remote-KV admission leaves free on top of the reserve, in [0, 1)")
      ->capture_default_str();
  app.add_option("--io-threads", config.num_io_threads, "HTTP I/O threads")->capture_default_str();
  app.add_option("--request-timeout-ms", config.request_timeout_ms, "longest a request may live")
      ->capture_default_str();
  app.add_option("--keep-alive-timeout-ms", config.keep_alive_timeout_ms, "idle connection lifetime")
      ->capture_default_str();
  app.add_option("--max-connections", max_connections,
                 "open connections served at once; more are answered 503 (default: --max-num-seqs + "
                 "--max-waiting-requests + 1024)");
  app.add_option("--kv-role", config.kv_transfer.kv_role, "P/D role: kv_producer|kv_consumer|kv_both");
  app.add_option("--kv-transfer-config", config.kv_transfer.config_json, "P/D connector config (JSON object)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    CliOutcome outcome;
    outcome.exit_code = error.get_exit_code();
    outcome.message = outcome.exit_code == 0 ? app.help() : std::string(error.what());
    return outcome;
  }
  if (max_model_len != 0) config.max_model_len = max_model_len;
  if (app.count("--max-connections") > 0) config.max_connections = max_connections;
  config.max_num_batched_tokens_given = app.count("--max-num-batched-tokens") > 0;
  return CliOutcome{std::move(config), 0, {}};
}

Status validate_server_config(ServerConfig& config) {
  if (config.tensor_parallel_size < 1)
    return invalid_argument("--tensor-parallel-size must be >= 1, got {}", config.tensor_parallel_size);
  if (config.enable_expert_parallel && config.device != "cpu")
    return unimplemented(
        "--enable-expert-parallel with --device {}: expert parallelism runs on --device cpu only in "
        "this build",
        config.device);
  if (config.port < 0 || config.port > 65535) return invalid_argument("--port must be 0..65535, got {}", config.port);
  if (config.max_model_len && *config.max_model_len < 2)
    return invalid_argument("--max-model-len must be at least 2, got {}", *config.max_model_len);
  if (config.max_num_seqs < 1) return invalid_argument("--max-num-seqs must be >= 1, got {}", config.max_num_seqs);
  if (config.max_num_batched_tokens < 1)
    return invalid_argument("--max-num-batched-tokens must be >= 1, got {}", config.max_num_batched_tokens);
  if (config.block_size < 1 || config.block_size > 1024)
    return invalid_argument("--block-size must be 1..1024, got {}", config.block_size);
  if (!(config.gpu_memory_utilization > 0.0 && config.gpu_memory_utilization <= 1.0))
    return invalid_argument("--gpu-memory-utilization must be in (0, 1], got {}", config.gpu_memory_utilization);
  if (config.load_format != "auto" && config.load_format != "safetensors" && config.load_format != "dummy")
    return invalid_argument("--load-format must be auto, safetensors or dummy, got '{}'", config.load_format);
  if (config.kv_cache_dtype != "auto" && config.kv_cache_dtype != "fp8")
    return invalid_argument("--kv-cache-dtype must be auto or fp8, got '{}'", config.kv_cache_dtype);
  if (config.device != "cpu" && config.device != "cuda")
    return invalid_argument("--device must be cpu or cuda, got '{}'", config.device);
  if (config.num_kv_blocks < 0) return invalid_argument("--num-kv-blocks must be >= 0, got {}", config.num_kv_blocks);
  if (config.kv_cache_bytes < 0)
    return invalid_argument("--kv-cache-bytes must be >= 0, got {}", config.kv_cache_bytes);
  if (config.max_body_bytes < 1024)
    return invalid_argument("--max-body-bytes must be >= 1024, got {}", config.max_body_bytes);
  if (config.max_waiting_requests < 1)
    return invalid_argument("--max-waiting-requests must be >= 1, got {}", config.max_waiting_requests);
  if (!(config.remote_output_reserve <= 1.0))
    return invalid_argument("--remote-output-reserve must be <= 1 (negative: no reserve), got {}",
                            config.remote_output_reserve);
  if (!(config.kv_watermark >= 0.0 && config.kv_watermark < 1.0))
    return invalid_argument("--kv-watermark must be in [0, 1), got {}", config.kv_watermark);
  if (config.num_io_threads < 1 || config.num_io_threads > 256)
    return invalid_argument("--io-threads must be 1..256, got {}", config.num_io_threads);
  if (config.request_timeout_ms < 1) return invalid_argument("--request-timeout-ms must be >= 1");
  if (config.keep_alive_timeout_ms < 1) return invalid_argument("--keep-alive-timeout-ms must be >= 1");
  if (config.max_connections && (*config.max_connections < 1 || *config.max_connections > kMaxConnectionsCeiling))
    return invalid_argument("--max-connections must be 1..{}, got {}", kMaxConnectionsCeiling, *config.max_connections);
  for (const auto& name : config.served_model_names)
    if (name.empty()) return invalid_argument("--served-model-name must not be empty");

  auto& kv = config.kv_transfer;
  if (!kv.config_json.empty()) {
    kv.config = nlohmann::json::parse(kv.config_json, nullptr, /*allow_exceptions=*/false);
    if (kv.config.is_discarded() || !kv.config.is_object())
      return invalid_argument("--kv-transfer-config must be a JSON object, got '{}'", kv.config_json);
    if (auto role = kv.config.find("kv_role"); role != kv.config.end()) {
      if (!role->is_string()) return invalid_argument("--kv-transfer-config: 'kv_role' must be a string");
      if (kv.kv_role.empty())
        kv.kv_role = role->get<std::string>();
      else if (kv.kv_role != role->get<std::string>())
        return invalid_argument("--kv-role '{}' contradicts --kv-transfer-config kv_role '{}'", kv.kv_role,
                                role->get<std::string>());
    }
  }
  if (!kv.kv_role.empty() && kv.kv_role != "kv_producer" && kv.kv_role != "kv_consumer" && kv.kv_role != "kv_both" &&
      kv.kv_role != "producer" && kv.kv_role != "consumer" && kv.kv_role != "both")
    return invalid_argument("--kv-role must be kv_producer, kv_consumer or kv_both, got '{}'", kv.kv_role);
  if (!config.max_num_batched_tokens_given && (kv.kv_role == "kv_producer" || kv.kv_role == "producer"))
    config.max_num_batched_tokens = kProducerMaxNumBatchedTokens;
  // Each rank holds its own shard of every KV block; the connector moves every
  // rank's shards (any producer TP to any consumer TP) from the CPU runner's
  // per-rank regions. The CUDA runner exposes one region (its ranks' shards live on several GPUs).
  if (config.tensor_parallel_size > 1 && config.device == "cuda" && (!kv.config_json.empty() || !kv.kv_role.empty()))
    return unimplemented(
        "--tensor-parallel-size {} with --device cuda and --kv-transfer-config / --kv-role: P/D transfer of "
        "tensor-parallel KV shards on GPUs is not supported; use --tensor-parallel-size 1 on cuda P/D instances",
        config.tensor_parallel_size);
  return Status::Ok();
}

}  // namespace pd::server
