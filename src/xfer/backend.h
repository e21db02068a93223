// The interface every transport implements. Internal to pd_xfer: callers use
// TransferEngine/Session; backends never see unvalidated ops.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/clock.h"
#include "common/status.h"
#include "xfer/types.h"

namespace pd::xfer {

// A region registered with this engine, as the engine passes it to backends.
struct LocalRegion {
  RegionId id = 0;
  void* ptr = nullptr;
  uint64_t bytes = 0;
  MemKind kind = MemKind::kHost;
  int device = -1;
};

// One posted batch inside a backend. test() and wait_until() may be called from
// any thread, concurrently. A batch is "retired" once test() no longer returns
// pending: from then on the backend touches neither region for it.
class BackendBatch {
 public:
  virtual ~BackendBatch() = default;
  virtual TransferState test() = 0;
  // Returns when the state may have changed, or at `until` at the latest.
  virtual void wait_until(SteadyClock::time_point until) = 0;
};

// A backend's imported view of one (local region, remote region) pair: endpoint,
// unpacked remote key or mapped IPC pointer. Lives as long as any batch posted on it.
class Route {
 public:
  virtual ~Route() = default;
};

// The form of the ops a backend's post() receives. Both are validated completely first
// (bounds, disjoint destinations): a rejected batch never reaches post().
enum class OpForm : uint8_t {
  kSortedMerged,  // sorted by destination, every run contiguous on both sides merged
  kCallerOrder,   // the caller's ops as given; the backend merges consecutive runs itself
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;
  // Adds this backend's endpoint blob (if any) to `desc`.
  virtual void describe(EngineDesc& desc) const = 0;
  virtual bool can_register(MemKind kind) const = 0;
  // Produces the key a peer needs to reach `region` through this backend.
  virtual Result<std::vector<uint8_t>> register_memory(const LocalRegion& region) = 0;
  // Allocates host memory this backend reaches fastest (ucx: shared memory that peers on
  // the host map directly) and registers it as region `id`; deregister() frees it.
  virtual Result<std::pair<void*, std::vector<uint8_t>>> allocate_host(RegionId id, size_t bytes) {
    return unimplemented("backend '{}' does not allocate memory", name());
  }
  // Precondition: no batch on the region is in flight (the engine checks).
  virtual void deregister(RegionId id) = 0;
  // Whether a session between these kinds can use this backend.
  virtual bool supports(MemKind local, MemKind remote, bool same_host) const = 0;
  // Connects to (or replaces, for a new boot nonce) the peer.
  virtual Status connect(const EngineDesc& peer) = 0;
  virtual Result<std::shared_ptr<Route>> open_route(const LocalRegion& local, const MemDesc& remote) = 0;
  // What post() receives on `route`.
  virtual OpForm op_form(const Route& route) const { return OpForm::kSortedMerged; }
  // Posts validated ops in op_form() (DESIGN.md §3.1). An error means nothing is in flight.
  // `deadline` is the batch's: the engine fails the batch past it whatever the backend
  // does; a backend with work of its own queued for the batch (ucx staging) drops that
  // work then too.
  virtual Result<std::unique_ptr<BackendBatch>> post(const std::shared_ptr<Route>& route, Direction direction,
                                                     std::span<const Op> ops, SteadyClock::time_point deadline) = 0;
  // The transports a route's batches travel over, e.g. "tcp/eth0" or "posix/memory,sysv/memory"
  // (comma-separated, as the transport library names them), for logs and tests.
  virtual std::string route_transports(const Route& route) const { return std::string(name()); }
};

// Test control of the fault backend (backends/fault_backend.h).
enum class FaultMode : uint8_t {
  kNone,
  kDelay,  // post through the inner backend, report completion no earlier than delay_ms later
  kDrop,   // post nothing; the batch stays pending until its deadline fails it
  kFail,   // post nothing; the batch fails at once with an injected error
};

struct FaultSpec {
  FaultMode mode = FaultMode::kNone;
  int64_t delay_ms = 0;
  // The next `num_batches` batches get the fault; -1 means every batch until changed.
  int64_t num_batches = -1;
};

class FaultInjector {
 public:
  virtual ~FaultInjector() = default;
  virtual void set_fault(const FaultSpec& spec) = 0;
};

}  // namespace pd::xfer
