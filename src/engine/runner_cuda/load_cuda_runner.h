// Entry point for load_model(--device cuda): builds the CUDA runner from a
// parsed config and either the checkpoint's safetensors (read as fp32 on the
// host by model::load_safetensors_weights, uploaded as bf16) or dummy weights
// generated on the GPU (load_format "dummy": no host copy, so a 32B-shaped
// model starts in seconds). The runner is a CudaTpRunner of
// tensor_parallel_size ranks (one at the default of 1).
#pragma once

#include <filesystem>
#include <memory>
#include <string>

#include "common/status.h"
#include "engine/model_runner.h"
#include "engine/runner_cuda/cuda_model_runner.h"
#include "model/config.h"

namespace pd::engine {

struct CudaLoadRequest {
  model::ModelConfig config;
  std::filesystem::path model_dir;   // holds *.safetensors unless load_format is "dummy"
  std::string load_format = "auto";  // auto | safetensors | dummy
  CudaRunnerOptions options;         // options.dummy_seed seeds dummy weights
  int32_t tensor_parallel_size = 1;  // ranks on devices options.device, options.device + 1, ...
};

Result<std::unique_ptr<ModelRunner>> load_cuda_runner(const CudaLoadRequest& request);

}  // namespace pd::engine
