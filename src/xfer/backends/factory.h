// Constructors of the concrete backends; the engine is their only caller.
#pragma once

#include <memory>

#include "common/status.h"
#include "xfer/backend.h"

namespace pd::xfer {

// host_id: this engine's host id; same-host peers may use shared memory (see ucx_backend.cc).
Result<std::unique_ptr<Backend>> make_ucx_backend(const EngineConfig& config, const std::string& host_id);
// Unavailable (kUnavailable) when built without CUDA or when no GPU is visible.
Result<std::unique_ptr<Backend>> make_cuda_backend(const EngineConfig& config);

// One controller shared by every fault-wrapped backend of an engine.
class FaultController;
std::shared_ptr<FaultController> make_fault_controller();
FaultInjector* as_injector(FaultController& controller);
std::unique_ptr<Backend> make_fault_backend(std::unique_ptr<Backend> inner, std::shared_ptr<FaultController> control);

}  // namespace pd::xfer
