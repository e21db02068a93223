// pd::xfer::TransferEngine — one-sided, batched, asynchronous transfers between
// registered regions of this process and of peer engines (DESIGN.md §3.1).
//
// Thread-safety: every TransferEngine and Session method may be called from any thread
// concurrently (the connector calls from its engine thread and one progress
// thread). The TransferEngine must outlive its Sessions.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "xfer/backend.h"
#include "xfer/types.h"

namespace pd::xfer {

class TransferEngine;
struct SessionState;

// A route between one local and one remote region, bound to one backend and to the
// peer's boot nonce at creation. Cheap to copy. Posting on a session whose peer has
// restarted, or whose local region was deregistered, fails with kFailedPrecondition.
class Session {
 public:
  Session() = default;
  // The batch fails if not complete `batch_timeout_ms` (EngineConfig) after posting.
  Result<XferId> write(std::span<const Op> ops);
  Result<XferId> read(std::span<const Op> ops);
  // Same with an explicit batch deadline.
  Result<XferId> write(std::span<const Op> ops, Deadline deadline);
  Result<XferId> read(std::span<const Op> ops, Deadline deadline);
  std::string_view backend() const;
  // What the batches travel over, as the backend's transport library names it: e.g.
  // "tcp/eth0" or "posix/memory,sysv/memory" for ucx, "cuda" for cuda.
  std::string transports() const;
  bool valid() const { return state_ != nullptr; }

 private:
  friend class TransferEngine;
  Session(TransferEngine* engine, std::shared_ptr<SessionState> state) : engine_(engine), state_(std::move(state)) {}
  TransferEngine* engine_ = nullptr;
  std::shared_ptr<SessionState> state_;
};

class TransferEngine {
 public:
  static Result<std::unique_ptr<TransferEngine>> create(EngineConfig config);
  ~TransferEngine();
  TransferEngine(const TransferEngine&) = delete;
  TransferEngine& operator=(const TransferEngine&) = delete;

  EngineDesc describe() const;
  const std::string& name() const { return config_.name; }
  uint64_t boot_nonce() const { return boot_nonce_; }
  std::vector<std::string> backend_names() const;

  // Registers [ptr, ptr+bytes) with every enabled backend that handles `kind`. The
  // caller keeps ownership of the memory and must keep it alive until deregister().
  Result<MemDesc> register_memory(void* ptr, size_t bytes, MemKind kind, int device = -1);
  // Allocates `bytes` of host memory through the ucx backend and registers it: on one
  // host this is shared memory that peers write with direct RMA (a plain memcpy), where
  // registered malloc memory goes through UCX's emulated RMA (much slower). The contents
  // start unspecified. The memory lives until deregister(desc.region_id).
  Result<MemDesc> allocate_host_memory(size_t bytes, void** ptr);
  // Fails with kFailedPrecondition while a batch on the region is in flight. Frees memory
  // that allocate_host_memory() allocated.
  Status deregister(RegionId region_id);

  // Idempotent for the same (name, boot nonce); a new nonce for a known name replaces
  // the old peer (its sessions go stale, its pending batches fail).
  Status connect(const EngineDesc& peer);

  // backend: "auto" (cuda when both regions are GPU memory on one host and cuda is
  // enabled, else ucx), or a backend name.
  Result<Session> session(const MemDesc& local, const MemDesc& remote, std::string_view backend = "auto");

  // Non-blocking. Unknown or released ids report kFailed with a message saying so.
  TransferState poll(XferId id);
  // Ok when the batch is done; the failure (with its reason) when it failed;
  // kDeadlineExceeded when it is still pending at `deadline` (it stays pending until its
  // own batch deadline). A batch that failed at its own deadline fails with
  // kDeadlineExceeded too: poll() tells the two apart (pending or failed).
  Status wait(XferId id, Deadline deadline);
  // Forgets a batch. A pending batch is forgotten once it finishes.
  void release(XferId id);

  // The fault backend's control, when EngineConfig::enable_fault_injection is set.
  FaultInjector* fault_injector() const { return fault_injector_; }

  // Counters for tests and metrics.
  uint64_t num_batches_posted() const { return num_batches_posted_.load(); }
  uint64_t num_batches_rejected() const { return num_batches_rejected_.load(); }

 private:
  friend class Session;
  friend struct SessionState;
  struct Region;
  struct Peer;
  struct Batch;

  explicit TransferEngine(EngineConfig config);
  Backend* find_backend(std::string_view name) const;
  Result<XferId> post(SessionState& session, Direction direction, std::span<const Op> ops, Deadline deadline);
  std::shared_ptr<Batch> find_batch(XferId id);
  TransferState refresh(Batch& batch);

  EngineConfig config_;
  uint64_t boot_nonce_ = 0;
  std::string host_id_;
  std::vector<std::unique_ptr<Backend>> backends_;
  FaultInjector* fault_injector_ = nullptr;

  mutable std::mutex mutex_;  // guards the maps below
  RegionId next_region_id_ = 1;
  std::map<RegionId, std::shared_ptr<Region>> regions_;
  std::map<std::string, std::shared_ptr<Peer>> peers_;
  XferId next_xfer_id_ = 1;
  std::unordered_map<XferId, std::shared_ptr<Batch>> batches_;
  // Released batches whose backend has not retired them yet.
  std::vector<std::shared_ptr<Batch>> lingering_;

  std::atomic<uint64_t> num_batches_posted_{0};
  std::atomic<uint64_t> num_batches_rejected_{0};
};

}  // namespace pd::xfer
