// The engine's model-load options from pdserve's flags. One function, so that a flag that
// must reach the runner (the CUDA runner sizes its KV pool, graphs and step buffers from
// them) cannot be dropped on the way without a test noticing.
#pragma once

#include "engine/runner/load_model.h"
#include "server/server_config.h"

namespace pd::server {

engine::ModelLoadOptions model_load_options(const ServerConfig& config);

}  // namespace pd::server
