#include "engine/runner_cuda/load_cuda_runner.h"

#include "model/weights.h"

namespace pd::engine {

Result<std::unique_ptr<ModelRunner>> load_cuda_runner(const CudaLoadRequest& request) {
  if (request.load_format != "auto" && request.load_format != "safetensors" && request.load_format != "dummy") {
    return invalid_argument("load_format must be auto, safetensors or dummy, got '{}'", request.load_format);
  }
  if (request.load_format == "dummy") {
    PD_ASSIGN_OR_RETURN(auto runner, CudaModelRunner::create(request.config, nullptr, request.options));
    return std::unique_ptr<ModelRunner>(std::move(runner));
  }
  PD_ASSIGN_OR_RETURN(auto weights, model::load_safetensors_weights(request.config, request.model_dir));
  PD_ASSIGN_OR_RETURN(auto runner, CudaModelRunner::create(request.config, &weights, request.options));
  return std::unique_ptr<ModelRunner>(std::move(runner));
}

}  // namespace pd::engine
