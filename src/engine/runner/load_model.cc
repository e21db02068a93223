#include "engine/runner/load_model.h"

#ifdef PDSERVE_HAVE_CUDA_RUNNER
#include "engine/runner_cuda/load_cuda_runner.h"
#endif

#include <fmt/format.h>

#include <cstdlib>
#include <system_error>

#include "common/log.h"
#include "engine/runner/cpu_model_runner.h"
#include "model/config.h"
#include "model/safetensors.h"
#include "model/tp_shard.h"
#include "model/weights.h"

namespace pd::engine {
namespace {

constexpr char kBuiltinTiny[] = "builtin:tiny";
// HF's 0.02 leaves a 64-wide model dominated by the current token's embedding
// (greedy then repeats one token forever); 0.3 lets attention and MLP move the
// hidden state, so the demo's greedy stream changes from step to step.
constexpr float kBuiltinTinyWeightStd = 0.3f;

bool is_dir(const std::filesystem::path& p) {
  std::error_code ec;
  return !p.empty() && std::filesystem::is_directory(p, ec);
}

bool has_tokenizer_files(const std::filesystem::path& dir) {
  std::error_code ec;
  return std::filesystem::exists(dir / "tokenizer.json", ec) || std::filesystem::exists(dir / "vocab.json", ec);
}

}  // namespace

std::filesystem::path find_assets_dir() {
  if (const char* env = std::getenv("PDSERVE_ASSETS_DIR"); env != nullptr && *env != '\0') {
    if (is_dir(env)) return std::filesystem::path(env);
    PD_LOG_WARN("PDSERVE_ASSETS_DIR={} is not a directory; trying the other locations", env);
  }
  std::error_code ec;
  const std::filesystem::path exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    // Binaries live in <build>/bin or <build>/tests: two levels below the repository.
    const std::filesystem::path candidate = exe.parent_path() / ".." / ".." / "assets";
    if (is_dir(candidate)) return std::filesystem::weakly_canonical(candidate, ec);
  }
#ifdef PDSERVE_SOURCE_DIR
  const std::filesystem::path source_assets = std::filesystem::path(PDSERVE_SOURCE_DIR) / "assets";
  if (is_dir(source_assets)) return source_assets;
#endif
  return {};
}

Result<LoadedModel> load_model(const ModelLoadOptions& options) {
  if (options.device != "cpu" && options.device != "cuda")
    return invalid_argument("device must be cpu or cuda, got '{}'", options.device);
  if (options.tensor_parallel_size < 1)
    return invalid_argument("tensor_parallel_size must be >= 1, got {}", options.tensor_parallel_size);
  if (options.enable_expert_parallel && options.device != "cpu")
    return unimplemented(
        "enable_expert_parallel on device '{}': expert parallelism runs on the cpu device only in "
        "this build",
        options.device);
#ifndef PDSERVE_HAVE_CUDA_RUNNER
  if (options.device == "cuda")
    return unimplemented("device 'cuda': this build has no CUDA runner (it was built without nvcc)");
#endif
  if (options.load_format != "auto" && options.load_format != "safetensors" && options.load_format != "dummy")
    return invalid_argument("load_format must be auto, safetensors or dummy, got '{}'", options.load_format);
  if (options.block_size <= 0 || options.block_size > 1024)
    return invalid_argument("block_size must be in [1, 1024], got {}", options.block_size);
  if (options.kv_cache_dtype != "auto" && options.kv_cache_dtype != "fp8")
    return invalid_argument("kv_cache_dtype must be auto or fp8, got '{}'", options.kv_cache_dtype);
  const KvDtype cpu_kv_dtype = options.kv_cache_dtype == "fp8" ? KvDtype::kFp8E4m3 : KvDtype::kFloat32;
  if (options.num_kv_blocks < 0) return invalid_argument("num_kv_blocks must be >= 0, got {}", options.num_kv_blocks);
  if (options.kv_cache_bytes < 0)
    return invalid_argument("kv_cache_bytes must be >= 0, got {}", options.kv_cache_bytes);
  if (options.max_model_len < 0) return invalid_argument("max_model_len must be >= 0, got {}", options.max_model_len);

  LoadedModel loaded;
  model::ModelConfig config;
  model::ModelWeights weights;
  if (options.model == kBuiltinTiny) {
    if (options.load_format == "safetensors")
      return invalid_argument("model '{}' has no safetensors; use load_format auto or dummy", options.model);
    config = model::builtin_tiny_config();
    const std::filesystem::path assets = find_assets_dir();
    const std::filesystem::path tok = assets.empty() ? std::filesystem::path() : assets / "tokenizers" / "qwen3";
    if (!tok.empty() && has_tokenizer_files(tok)) {
      loaded.tokenizer_dir = tok;
    } else {
      PD_LOG_WARN(
          "builtin:tiny: no tokenizer found under assets/tokenizers/qwen3 (set PDSERVE_ASSETS_DIR); "
          "only token-id prompts will work");
    }
  } else {
    const std::filesystem::path dir(options.model);
    if (!is_dir(dir)) return not_found("model '{}' is neither '{}' nor a directory", options.model, kBuiltinTiny);
    PD_ASSIGN_OR_RETURN(config, model::load_model_config(dir));
    if (options.load_format != "dummy" && !model::SafetensorsCheckpoint::dir_has_weights(dir))
      return not_found("{}: no *.safetensors weights (use load_format dummy for random weights)", dir.string());
    if (has_tokenizer_files(dir)) loaded.tokenizer_dir = dir;
  }

  int32_t max_model_len = options.max_model_len;
  if (max_model_len == 0) max_model_len = std::min(config.max_position_embeddings, kDefaultMaxModelLen);
  if (max_model_len > config.max_position_embeddings)
    return invalid_argument("max_model_len {} exceeds the model's max_position_embeddings {}", max_model_len,
                            config.max_position_embeddings);
  PD_ASSIGN_OR_RETURN(const model::TpSplit split, model::plan_tensor_parallel(config, options.tensor_parallel_size,
                                                                              options.enable_expert_parallel));

#ifdef PDSERVE_HAVE_CUDA_RUNNER
  if (options.device == "cuda") {
    CudaLoadRequest request;
    request.options.kv_fp8 = options.kv_cache_dtype == "fp8";  // auto: bfloat16
    request.config = config;
    request.model_dir = options.model == kBuiltinTiny ? std::filesystem::path() : std::filesystem::path(options.model);
    request.load_format =
        (options.model == kBuiltinTiny || options.load_format == "dummy") ? "dummy" : options.load_format;
    request.options.block_size = options.block_size;
    request.options.max_model_len = max_model_len;
    request.options.num_kv_blocks = options.num_kv_blocks;
    request.options.gpu_memory_utilization = options.gpu_memory_utilization;
    request.options.max_num_seqs = options.max_num_seqs;
    request.options.max_num_batched_tokens = options.max_num_batched_tokens;
    request.options.dummy_seed = options.seed;
    request.options.device = options.cuda_device;
    request.tensor_parallel_size = split.tp_size;
    loaded.architecture = config.architecture;
    loaded.eos_token_ids = config.eos_token_ids;
    loaded.max_model_len = max_model_len;
    PD_ASSIGN_OR_RETURN(loaded.runner, load_cuda_runner(request));
    PD_LOG_INFO("loaded {} ({}) on cuda, max_model_len {}, tensor_parallel_size {}", options.model, loaded.architecture,
                max_model_len, split.tp_size);
    return loaded;
  }
#endif

  int32_t num_blocks = options.num_kv_blocks;
  if (num_blocks == 0) {
    const int64_t bytes = options.kv_cache_bytes > 0 ? options.kv_cache_bytes : kDefaultCpuKvCacheBytes;
    KvCacheSpec probe;
    probe.num_layers = config.num_layers;
    probe.num_kv_heads = split.kv_heads_per_rank * split.tp_size;  // the ranks' shards, replicas included
    probe.head_dim = config.head_dim;
    probe.block_size = options.block_size;
    probe.dtype = cpu_kv_dtype;
    const int64_t per_block_all_layers = static_cast<int64_t>(probe.bytes_per_block()) * config.num_layers;
    const int64_t blocks = bytes / per_block_all_layers;
    if (blocks < 1)
      return invalid_argument("kv_cache_bytes {} is smaller than one block across all layers ({} bytes)", bytes,
                              per_block_all_layers);
    num_blocks = static_cast<int32_t>(std::min<int64_t>(blocks, INT32_MAX));
  }

  // Weights last: every cheap check above fails before the expensive part.
  if (options.model == kBuiltinTiny) {
    weights = model::dummy_weights(config, options.seed, kBuiltinTinyWeightStd);
  } else if (options.load_format == "dummy") {
    weights = model::dummy_weights(config, options.seed);
  } else {
    PD_ASSIGN_OR_RETURN(weights, model::load_safetensors_weights(config, std::filesystem::path(options.model)));
  }

  loaded.architecture = config.architecture;
  loaded.eos_token_ids = config.eos_token_ids;
  loaded.max_model_len = max_model_len;
  PD_ASSIGN_OR_RETURN(auto runner,
                      CpuModelRunner::create(std::move(config), std::move(weights), options.block_size, num_blocks,
                                             max_model_len, cpu_kv_dtype, split.tp_size, split.expert_parallel));
  PD_LOG_INFO("loaded {} ({}) on cpu: {} {} KV blocks of {} tokens, max_model_len {}, tensor_parallel_size {}{}",
              options.model, loaded.architecture, num_blocks, kv_dtype_name(cpu_kv_dtype), options.block_size,
              max_model_len, split.tp_size,
              split.expert_parallel ? fmt::format(", expert parallel ({} experts per rank)", split.experts_per_rank)
                                    : std::string());
  loaded.runner = std::move(runner);
  return loaded;
}

}  // namespace pd::engine
