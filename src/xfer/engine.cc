#include "xfer/engine.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <random>

#include "common/log.h"
#include "xfer/backends/factory.h"
#include "xfer/ops.h"

namespace pd::xfer {

struct TransferEngine::Region {
  LocalRegion local;
  MemDesc desc;
  // Batches posted on the region that their backend has not retired yet.
  std::atomic<int64_t> num_inflight{0};
  std::atomic<bool> deregistered{false};
};

struct TransferEngine::Peer {
  EngineDesc desc;
  // Set when a newer boot of the same peer connected; sessions and pending batches go stale.
  std::atomic<bool> replaced{false};
};

struct SessionState {
  Backend* backend = nullptr;
  std::shared_ptr<Route> route;
  std::shared_ptr<TransferEngine::Region> local;
  std::shared_ptr<TransferEngine::Peer> peer;
  MemDesc remote;
  int64_t batch_timeout_ms = 0;
};

struct TransferEngine::Batch {
  XferId id = 0;
  std::unique_ptr<BackendBatch> backend;  // null for an empty batch
  std::shared_ptr<Region> local;
  std::shared_ptr<Peer> peer;
  SteadyClock::time_point deadline;

  std::mutex mutex;  // guards the fields below
  TransferState state;
  Status failure;        // the reason when state is failed
  bool retired = false;  // the backend no longer touches memory for this batch
  bool released = false;
};

namespace {

uint64_t random_nonce() {
  std::random_device device;
  uint64_t nonce = 0;
  while (nonce == 0) nonce = (uint64_t{device()} << 32) ^ device() ^ static_cast<uint64_t>(now_ns());
  return nonce;
}

std::string read_host_id() {
  char hostname[256] = {};
  gethostname(hostname, sizeof(hostname) - 1);
  std::string boot_id;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, boot_id);
  return std::string(hostname) + "/" + boot_id;
}

}  // namespace

// ---- Session ----

Result<XferId> Session::write(std::span<const Op> ops) {
  if (!state_) return failed_precondition("write on an empty session");
  return engine_->post(*state_, Direction::kWrite, ops, Deadline::after_ms(state_->batch_timeout_ms));
}
Result<XferId> Session::read(std::span<const Op> ops) {
  if (!state_) return failed_precondition("read on an empty session");
  return engine_->post(*state_, Direction::kRead, ops, Deadline::after_ms(state_->batch_timeout_ms));
}
Result<XferId> Session::write(std::span<const Op> ops, Deadline deadline) {
  if (!state_) return failed_precondition("write on an empty session");
  return engine_->post(*state_, Direction::kWrite, ops, deadline);
}
Result<XferId> Session::read(std::span<const Op> ops, Deadline deadline) {
  if (!state_) return failed_precondition("read on an empty session");
  return engine_->post(*state_, Direction::kRead, ops, deadline);
}
std::string_view Session::backend() const {
  return state_ ? state_->backend->name() : std::string_view();
}
std::string Session::transports() const {
  return state_ ? state_->backend->route_transports(*state_->route) : std::string();
}

// ---- TransferEngine ----

TransferEngine::TransferEngine(EngineConfig config)
    : config_(std::move(config)), boot_nonce_(random_nonce()), host_id_(read_host_id()) {}

TransferEngine::~TransferEngine() {
  // Batches and sessions' routes go before the backends that own their resources.
  std::lock_guard lock(mutex_);
  batches_.clear();
  lingering_.clear();
}

Result<std::unique_ptr<TransferEngine>> TransferEngine::create(EngineConfig config) {
  if (config.name.empty()) return invalid_argument("EngineConfig.name is empty");
  if (config.batch_timeout_ms <= 0) {
    return invalid_argument("EngineConfig.batch_timeout_ms must be > 0, got {}", config.batch_timeout_ms);
  }
  std::unique_ptr<TransferEngine> engine(new TransferEngine(config));
  std::shared_ptr<FaultController> faults;
  if (config.enable_fault_injection) {
    faults = make_fault_controller();
    engine->fault_injector_ = as_injector(*faults);
  }
  for (const std::string& name : config.backends) {
    if (engine->find_backend(name) != nullptr) return invalid_argument("backend '{}' listed twice", name);
    Result<std::unique_ptr<Backend>> backend = unavailable("unset");
    if (name == "ucx") {
      backend = make_ucx_backend(config, engine->host_id_);
    } else if (name == "cuda") {
      backend = make_cuda_backend(config);
      if (!backend.ok() && backend.status().code() == ErrorCode::kUnavailable) {
        // The default list names cuda; a machine without a GPU simply runs without it.
        PD_LOG_INFO("xfer engine '{}': cuda backend not enabled: {}", config.name, backend.status().message());
        continue;
      }
    } else {
      return invalid_argument("unknown backend '{}' (known: ucx, cuda)", name);
    }
    if (!backend.ok()) return backend.status().with_context(fmt::format("creating backend '{}'", name));
    std::unique_ptr<Backend> made = std::move(backend).value();
    if (faults) made = make_fault_backend(std::move(made), faults);
    engine->backends_.push_back(std::move(made));
  }
  if (engine->backends_.empty()) return failed_precondition("engine '{}' has no usable backend", config.name);
  return engine;
}

Backend* TransferEngine::find_backend(std::string_view name) const {
  for (const auto& backend : backends_) {
    if (backend->name() == name) return backend.get();
  }
  return nullptr;
}

std::vector<std::string> TransferEngine::backend_names() const {
  std::vector<std::string> names;
  for (const auto& backend : backends_) names.emplace_back(backend->name());
  return names;
}

EngineDesc TransferEngine::describe() const {
  EngineDesc desc;
  desc.name = config_.name;
  desc.boot_nonce = boot_nonce_;
  desc.host_id = host_id_;
  for (const auto& backend : backends_) backend->describe(desc);
  return desc;
}

Result<MemDesc> TransferEngine::register_memory(void* ptr, size_t bytes, MemKind kind, int device) {
  if (ptr == nullptr || bytes == 0) return invalid_argument("register_memory: null pointer or zero bytes");
  if (kind == MemKind::kHost && device != -1) return invalid_argument("host memory with device {}", device);
  if (kind == MemKind::kCuda && device < 0) return invalid_argument("cuda memory needs a device ordinal");
  auto region = std::make_shared<Region>();
  {
    std::lock_guard lock(mutex_);
    region->local.id = next_region_id_++;
  }
  region->local.ptr = ptr;
  region->local.bytes = bytes;
  region->local.kind = kind;
  region->local.device = device;
  MemDesc& desc = region->desc;
  desc.engine_name = config_.name;
  desc.boot_nonce = boot_nonce_;
  desc.region_id = region->local.id;
  desc.base = reinterpret_cast<uint64_t>(ptr);
  desc.bytes = bytes;
  desc.kind = kind;
  desc.device = device;
  std::vector<Backend*> done;
  for (const auto& backend : backends_) {
    if (!backend->can_register(kind)) continue;
    Result<std::vector<uint8_t>> key = backend->register_memory(region->local);
    if (!key.ok()) {
      for (Backend* b : done) b->deregister(region->local.id);
      return key.status().with_context(
          fmt::format("registering {} bytes of {} memory with {}", bytes, mem_kind_name(kind), backend->name()));
    }
    desc.keys.emplace(std::string(backend->name()), std::move(key).value());
    done.push_back(backend.get());
  }
  if (done.empty()) return failed_precondition("no enabled backend handles {} memory", mem_kind_name(kind));
  std::lock_guard lock(mutex_);
  regions_.emplace(region->local.id, region);
  return desc;
}

Result<MemDesc> TransferEngine::allocate_host_memory(size_t bytes, void** ptr) {
  if (bytes == 0 || ptr == nullptr) return invalid_argument("allocate_host_memory: zero bytes or no out pointer");
  Backend* ucx = find_backend("ucx");
  if (ucx == nullptr) return failed_precondition("allocate_host_memory needs the ucx backend");
  auto region = std::make_shared<Region>();
  {
    std::lock_guard lock(mutex_);
    region->local.id = next_region_id_++;
  }
  PD_ASSIGN_OR_RETURN(auto allocation, ucx->allocate_host(region->local.id, bytes));
  region->local.ptr = allocation.first;
  region->local.bytes = bytes;
  region->local.kind = MemKind::kHost;
  MemDesc& desc = region->desc;
  desc.engine_name = config_.name;
  desc.boot_nonce = boot_nonce_;
  desc.region_id = region->local.id;
  desc.base = reinterpret_cast<uint64_t>(allocation.first);
  desc.bytes = bytes;
  desc.kind = MemKind::kHost;
  desc.keys.emplace("ucx", std::move(allocation.second));
  *ptr = allocation.first;
  std::lock_guard lock(mutex_);
  regions_.emplace(region->local.id, region);
  return desc;
}

Status TransferEngine::deregister(RegionId region_id) {
  std::shared_ptr<Region> region;
  std::vector<std::shared_ptr<Batch>> batches;
  {
    std::lock_guard lock(mutex_);
    auto it = regions_.find(region_id);
    if (it == regions_.end()) return not_found("region {} is not registered", region_id);
    region = it->second;
    for (const auto& [id, batch] : batches_) {
      if (batch->local == region) batches.push_back(batch);
    }
    for (const auto& batch : lingering_) {
      if (batch->local == region) batches.push_back(batch);
    }
  }
  for (const auto& batch : batches) refresh(*batch);  // retires what the backend finished
  std::lock_guard lock(mutex_);
  if (int64_t n = region->num_inflight.load(); n > 0) {
    return failed_precondition("region {} has {} batches in flight", region_id, n);
  }
  if (region->deregistered.exchange(true)) return not_found("region {} is not registered", region_id);
  regions_.erase(region_id);
  for (const auto& backend : backends_) {
    if (region->desc.keys.contains(std::string(backend->name()))) backend->deregister(region_id);
  }
  return Status::Ok();
}

Status TransferEngine::connect(const EngineDesc& peer) {
  if (peer.name.empty() || peer.boot_nonce == 0) return invalid_argument("peer descriptor without name or nonce");
  if (peer.name == config_.name) return invalid_argument("peer '{}' has this engine's own name", peer.name);
  std::lock_guard lock(mutex_);
  auto it = peers_.find(peer.name);
  if (it != peers_.end() && it->second->desc.boot_nonce == peer.boot_nonce) return Status::Ok();
  for (const auto& backend : backends_) {
    PD_RETURN_IF_ERROR(backend->connect(peer).with_context(fmt::format("connecting to peer '{}'", peer.name)));
  }
  auto record = std::make_shared<Peer>();
  record->desc = peer;
  if (it != peers_.end()) {
    PD_LOG_INFO("xfer engine '{}': peer '{}' restarted (boot {} -> {})", config_.name, peer.name,
                it->second->desc.boot_nonce, peer.boot_nonce);
    it->second->replaced.store(true);
    it->second = record;
  } else {
    peers_.emplace(peer.name, record);
  }
  return Status::Ok();
}

Result<Session> TransferEngine::session(const MemDesc& local, const MemDesc& remote, std::string_view backend_name) {
  auto state = std::make_shared<SessionState>();
  state->batch_timeout_ms = config_.batch_timeout_ms;
  state->remote = remote;
  {
    std::lock_guard lock(mutex_);
    if (local.engine_name != config_.name || local.boot_nonce != boot_nonce_) {
      return invalid_argument("local descriptor belongs to engine '{}' boot {}, not to this engine '{}' boot {}",
                              local.engine_name, local.boot_nonce, config_.name, boot_nonce_);
    }
    auto region = regions_.find(local.region_id);
    if (region == regions_.end() || region->second->desc.bytes != local.bytes) {
      return not_found("local region {} is not registered (or its size changed)", local.region_id);
    }
    state->local = region->second;
    auto peer = peers_.find(remote.engine_name);
    if (peer == peers_.end()) return not_found("peer '{}' is not connected", remote.engine_name);
    if (peer->second->desc.boot_nonce != remote.boot_nonce) {
      return failed_precondition("memory descriptor of '{}' is from boot {}, the connected peer is boot {}",
                                 remote.engine_name, remote.boot_nonce, peer->second->desc.boot_nonce);
    }
    state->peer = peer->second;
  }
  const bool same_host = state->peer->desc.host_id == host_id_;
  if (backend_name == "auto") {
    // Preference: cuda for GPU<->GPU on one host, then anything that supports the pair.
    std::vector<std::string_view> order = {"cuda", "ucx"};
    for (std::string_view candidate : order) {
      Backend* b = find_backend(candidate);
      if (b != nullptr && b->supports(local.kind, remote.kind, same_host) &&
          remote.keys.contains(std::string(candidate)) && local.keys.contains(std::string(candidate))) {
        state->backend = b;
        break;
      }
    }
    if (state->backend == nullptr) {
      return failed_precondition("no enabled backend can move {} -> {} memory between '{}' and '{}'{}",
                                 mem_kind_name(local.kind), mem_kind_name(remote.kind), config_.name,
                                 remote.engine_name, same_host ? " (same host)" : " (different hosts)");
    }
  } else {
    state->backend = find_backend(backend_name);
    if (state->backend == nullptr) return not_found("backend '{}' is not enabled in '{}'", backend_name, config_.name);
    if (!state->backend->supports(local.kind, remote.kind, same_host)) {
      return failed_precondition("backend '{}' cannot move {} -> {} memory{}", backend_name, mem_kind_name(local.kind),
                                 mem_kind_name(remote.kind), same_host ? "" : " across hosts");
    }
    if (!remote.keys.contains(std::string(backend_name)) || !local.keys.contains(std::string(backend_name))) {
      return failed_precondition("region has no '{}' key (remote region {} of '{}')", backend_name, remote.region_id,
                                 remote.engine_name);
    }
  }
  PD_ASSIGN_OR_RETURN(state->route, state->backend->open_route(state->local->local, remote));
  return Session(this, std::move(state));
}

Result<XferId> TransferEngine::post(SessionState& session, Direction direction, std::span<const Op> ops,
                                    Deadline deadline) {
  if (session.local->deregistered.load()) {
    num_batches_rejected_.fetch_add(1);
    return failed_precondition("local region {} was deregistered", session.local->local.id);
  }
  if (session.peer->replaced.load()) {
    num_batches_rejected_.fetch_add(1);
    return failed_precondition("peer '{}' boot {} was replaced by a newer boot; open a new session",
                               session.remote.engine_name, session.remote.boot_nonce);
  }
  // The whole batch is checked before anything is posted. A backend that takes the
  // caller's order gets the caller's span as is: no sort, no copy.
  std::span<const Op> to_post = ops;
  Status valid;
  if (session.backend->op_form(*session.route) == OpForm::kCallerOrder) {
    valid = validate_ops(ops, direction, session.local->local.bytes, session.remote.bytes);
  } else {
    // Per-thread scratch: a batch of thousands of ops allocates nothing after the first.
    thread_local std::vector<Op> normalized_ops;
    valid = normalize_ops_into(ops, direction, session.local->local.bytes, session.remote.bytes, normalized_ops);
    to_post = normalized_ops;
  }
  if (!valid.ok()) {
    num_batches_rejected_.fetch_add(1);
    return valid;
  }
  auto batch = std::make_shared<Batch>();
  batch->local = session.local;
  batch->peer = session.peer;
  batch->deadline = deadline.when();
  if (to_post.empty()) {
    batch->retired = true;
    batch->state.status = TransferStatus::kDone;
  } else {
    session.local->num_inflight.fetch_add(1);
    Result<std::unique_ptr<BackendBatch>> posted =
        session.backend->post(session.route, direction, to_post, deadline.when());
    if (!posted.ok()) {
      session.local->num_inflight.fetch_sub(1);
      num_batches_rejected_.fetch_add(1);
      return posted.status();
    }
    batch->backend = std::move(posted).value();
  }
  num_batches_posted_.fetch_add(1);
  std::lock_guard lock(mutex_);
  batch->id = next_xfer_id_++;
  batches_.emplace(batch->id, batch);
  return batch->id;
}

std::shared_ptr<TransferEngine::Batch> TransferEngine::find_batch(XferId id) {
  std::lock_guard lock(mutex_);
  auto it = batches_.find(id);
  return it == batches_.end() ? nullptr : it->second;
}

TransferState TransferEngine::refresh(Batch& batch) {
  std::lock_guard lock(batch.mutex);
  if (!batch.retired) {
    TransferState backend_state = batch.backend->test();
    if (!backend_state.pending()) {
      batch.retired = true;
      batch.local->num_inflight.fetch_sub(1);
      if (batch.state.pending()) {
        batch.state = backend_state;
        if (backend_state.failed()) batch.failure = unavailable("{}", backend_state.message);
      }
    }
  }
  if (batch.state.pending()) {
    if (batch.peer->replaced.load()) {
      batch.state = {TransferStatus::kFailed, "peer restarted (new boot nonce) while the batch was pending"};
      batch.failure = unavailable("batch {}: {}", batch.id, batch.state.message);
    } else if (SteadyClock::now() >= batch.deadline) {
      batch.state = {TransferStatus::kFailed, "batch deadline passed before completion"};
      batch.failure = deadline_exceeded("batch {}: {}", batch.id, batch.state.message);
    }
  }
  return batch.state;
}

TransferState TransferEngine::poll(XferId id) {
  std::shared_ptr<Batch> batch = find_batch(id);
  if (!batch) return {TransferStatus::kFailed, fmt::format("unknown or released transfer id {}", id)};
  return refresh(*batch);
}

Status TransferEngine::wait(XferId id, Deadline deadline) {
  std::shared_ptr<Batch> batch = find_batch(id);
  if (!batch) return not_found("unknown or released transfer id {}", id);
  while (true) {
    TransferState state = refresh(*batch);
    if (state.done()) return Status::Ok();
    if (state.failed()) {
      std::lock_guard lock(batch->mutex);
      return batch->failure.ok() ? unavailable("batch {}: {}", id, state.message) : batch->failure;
    }
    if (deadline.expired()) return deadline_exceeded("batch {} still pending at the wait deadline", id);
    batch->backend->wait_until(std::min(deadline.when(), batch->deadline));
  }
}

void TransferEngine::release(XferId id) {
  std::vector<std::shared_ptr<Batch>> lingering;
  {
    std::lock_guard lock(mutex_);
    auto it = batches_.find(id);
    if (it == batches_.end()) return;
    it->second->released = true;
    lingering_.push_back(it->second);
    batches_.erase(it);
    lingering = lingering_;
  }
  // A released batch the backend has not finished stays counted against its region
  // until it is; the lingering list holds exactly those (normally empty or tiny).
  for (const auto& batch : lingering) refresh(*batch);
  std::lock_guard lock(mutex_);
  std::erase_if(lingering_, [](const std::shared_ptr<Batch>& batch) {
    std::lock_guard batch_lock(batch->mutex);
    return batch->retired;
  });
}

}  // namespace pd::xfer
