// Fault backend: wraps another backend and, on command, delays, drops or fails
// whole batches. For tests of deadlines and failure paths; never enabled unless
// EngineConfig::enable_fault_injection is set.
#include <mutex>
#include <thread>

#include "xfer/backends/factory.h"

namespace pd::xfer {

class FaultController : public FaultInjector {
 public:
  void set_fault(const FaultSpec& spec) override {
    std::lock_guard lock(mutex_);
    spec_ = spec;
  }
  // The fault for the next batch (consumes one from a counted spec).
  FaultSpec take() {
    std::lock_guard lock(mutex_);
    FaultSpec now = spec_;
    if (spec_.mode != FaultMode::kNone && spec_.num_batches > 0 && --spec_.num_batches == 0) spec_ = FaultSpec{};
    return now;
  }

 private:
  std::mutex mutex_;
  FaultSpec spec_;
};

namespace {

// A batch whose outcome was decided by the fault (dropped: pending forever; failed).
class DecidedBatch : public BackendBatch {
 public:
  explicit DecidedBatch(TransferState state) : state_(std::move(state)) {}
  TransferState test() override { return state_; }
  void wait_until(SteadyClock::time_point until) override {
    // A dropped batch never changes on its own: the engine's deadline check ends the wait.
    if (state_.pending()) std::this_thread::sleep_until(until);
  }

 private:
  TransferState state_;
};

// A real batch whose completion is reported no earlier than `release`.
class DelayedBatch : public BackendBatch {
 public:
  DelayedBatch(std::unique_ptr<BackendBatch> inner, SteadyClock::time_point release)
      : inner_(std::move(inner)), release_(release) {}
  TransferState test() override {
    TransferState state = inner_->test();
    if (!state.pending() && SteadyClock::now() < release_) return {};
    return state;
  }
  void wait_until(SteadyClock::time_point until) override {
    inner_->wait_until(until);
    // The injected delay itself is the behaviour under test, not a synchronisation.
    if (!inner_->test().pending()) std::this_thread::sleep_until(std::min(until, release_));
  }

 private:
  std::unique_ptr<BackendBatch> inner_;
  SteadyClock::time_point release_;
};

class FaultBackend : public Backend {
 public:
  FaultBackend(std::unique_ptr<Backend> inner, std::shared_ptr<FaultController> control)
      : inner_(std::move(inner)), control_(std::move(control)) {}
  std::string_view name() const override { return inner_->name(); }
  void describe(EngineDesc& desc) const override { inner_->describe(desc); }
  bool can_register(MemKind kind) const override { return inner_->can_register(kind); }
  Result<std::vector<uint8_t>> register_memory(const LocalRegion& region) override {
    return inner_->register_memory(region);
  }
  Result<std::pair<void*, std::vector<uint8_t>>> allocate_host(RegionId id, size_t bytes) override {
    return inner_->allocate_host(id, bytes);
  }
  void deregister(RegionId id) override { inner_->deregister(id); }
  bool supports(MemKind local, MemKind remote, bool same_host) const override {
    return inner_->supports(local, remote, same_host);
  }
  Status connect(const EngineDesc& peer) override { return inner_->connect(peer); }
  Result<std::shared_ptr<Route>> open_route(const LocalRegion& local, const MemDesc& remote) override {
    return inner_->open_route(local, remote);
  }
  OpForm op_form(const Route& route) const override { return inner_->op_form(route); }
  std::string route_transports(const Route& route) const override { return inner_->route_transports(route); }
  Result<std::unique_ptr<BackendBatch>> post(const std::shared_ptr<Route>& route, Direction direction,
                                             std::span<const Op> ops, SteadyClock::time_point deadline) override {
    FaultSpec fault = control_->take();
    switch (fault.mode) {
      case FaultMode::kNone:
        return inner_->post(route, direction, ops, deadline);
      case FaultMode::kDrop:
        return std::unique_ptr<BackendBatch>(std::make_unique<DecidedBatch>(TransferState{}));
      case FaultMode::kFail:
        return std::unique_ptr<BackendBatch>(
            std::make_unique<DecidedBatch>(TransferState{TransferStatus::kFailed, "injected failure"}));
      case FaultMode::kDelay: {
        PD_ASSIGN_OR_RETURN(std::unique_ptr<BackendBatch> inner, inner_->post(route, direction, ops, deadline));
        auto release = SteadyClock::now() + std::chrono::milliseconds(fault.delay_ms);
        return std::unique_ptr<BackendBatch>(std::make_unique<DelayedBatch>(std::move(inner), release));
      }
    }
    return internal_error("unknown fault mode");
  }

 private:
  std::unique_ptr<Backend> inner_;
  std::shared_ptr<FaultController> control_;
};

}  // namespace

std::shared_ptr<FaultController> make_fault_controller() {
  return std::make_shared<FaultController>();
}
FaultInjector* as_injector(FaultController& controller) {
  return &controller;
}
std::unique_ptr<Backend> make_fault_backend(std::unique_ptr<Backend> inner, std::shared_ptr<FaultController> control) {
  return std::make_unique<FaultBackend>(std::move(inner), std::move(control));
}

}  // namespace pd::xfer
