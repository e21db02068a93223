#include "engine/runner_cuda/load_cuda_runner.h"

#include <cstdlib>
#include <string_view>

#include "common/log.h"
#include "engine/runner_cuda/cuda_tp_runner.h"
#include "model/weights.h"

namespace pd::engine {

namespace {

// PDSERVE_CUDA_ATTENTION=legacy selects the previous attention kernels (per-head
// prefill, single-buffered decode): an escape hatch while a new kernel is young,
// and the way to compare the two inside one deployment.
Result<CudaRunnerOptions> with_attention_override(CudaRunnerOptions options) {
  const char* choice = std::getenv("PDSERVE_CUDA_ATTENTION");
  if (choice == nullptr || std::string_view(choice).empty() || std::string_view(choice) == "default") return options;
  if (std::string_view(choice) != "legacy")
    return invalid_argument("PDSERVE_CUDA_ATTENTION must be 'default' or 'legacy', got '{}'", choice);
  options.prefill_kernel = kernels::cuda::PrefillKernel::kPerHead;
  options.decode_kernel = kernels::cuda::DecodeKernel::kTensorCoreSingleBuffer;
  PD_LOG_WARN("cuda runner: legacy attention kernels (PDSERVE_CUDA_ATTENTION=legacy)");
  return options;
}

void log_prepared(CudaTpRunner& tp_runner) {
  const CudaModelRunner& runner = tp_runner.rank(0);
  PD_LOG_INFO("cuda runner: {} decode buckets (up to {} seqs) tuned{} at load in {:.2f} s; GEMM tuning now off",
              runner.decode_buckets().size(), runner.decode_buckets().empty() ? 0 : runner.decode_buckets().back(),
              runner.num_graphs_captured() > 0 ? " and captured" : "", runner.bucket_preparation_seconds());
}

}  // namespace

Result<std::unique_ptr<ModelRunner>> load_cuda_runner(const CudaLoadRequest& original) {
  CudaLoadRequest request = original;
  PD_ASSIGN_OR_RETURN(request.options, with_attention_override(request.options));
  if (request.load_format != "auto" && request.load_format != "safetensors" && request.load_format != "dummy") {
    return invalid_argument("load_format must be auto, safetensors or dummy, got '{}'", request.load_format);
  }
  if (request.load_format == "dummy") {
    PD_ASSIGN_OR_RETURN(auto runner,
                        CudaTpRunner::create(request.config, nullptr, request.options, request.tensor_parallel_size));
    log_prepared(*runner);
    return std::unique_ptr<ModelRunner>(std::move(runner));
  }
  PD_ASSIGN_OR_RETURN(auto weights, model::load_safetensors_weights(request.config, request.model_dir));
  PD_ASSIGN_OR_RETURN(auto runner,
                      CudaTpRunner::create(request.config, &weights, request.options, request.tensor_parallel_size));
  log_prepared(*runner);
  return std::unique_ptr<ModelRunner>(std::move(runner));
}

}  // namespace pd::engine
