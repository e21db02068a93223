// cuda backend: same host, GPU <-> GPU, through CUDA IPC.
//
// Regions are exported as cudaIpcMemHandle_t (+ the region's offset inside its
// allocation); the importer maps the peer's allocation once per (peer boot, region).
// A batch is posted on the streams of its local device (cuda_num_streams of them, taken
// in turn by batches and by the launches of a large batch) in one of four modes:
//   kernel      — launches of a gather/scatter kernel that copies every op with 16-byte
//                 vector loads/stores over NVLink, op tables of <= 1,000 ops passed in
//                 the launch parameters (the default: one launch instead of one copy per
//                 64 KiB block);
//   copy_engine — one cudaMemcpyAsync per merged op;
//   copy_batch  — one cudaMemcpyBatchAsync per group of ops (CUDA 12.8+);
//   staging     — no peer access between the two GPUs: each op goes through a pinned
//                 host buffer (D2H then H2D, on the device's first stream so the buffer
//                 is reusable in stream order).
// With cuda_post_pipeline the engine hands over the caller's validated ops unsorted and
// the first launch leaves before the tables of the rest are built (copy_plan.h).
// An event recorded after the batch's work on each stream it used is its completion;
// test() queries them: a done batch's data is complete in the peer's memory.
#include <cuda.h>
#include <cuda_runtime.h>

#include "xfer/backends/copy_kernel.h"
#include "xfer/backends/copy_plan.h"
#include "xfer/ops.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "xfer/backends/factory.h"
#include "xfer/backends/route_checks.h"

namespace pd::xfer {
namespace {

constexpr uint64_t kStagingBytes = 8ull << 20;
constexpr uint32_t kMaxStreamsPerDevice = 16;

#if CUDART_VERSION >= 12080
constexpr bool kHaveMemcpyBatch = true;
#else
constexpr bool kHaveMemcpyBatch = false;
#endif

// One cudaMemcpyBatchAsync of `count` copies, sources read in stream order.
cudaError_t memcpy_batch(void** dsts, void** srcs, size_t* sizes, size_t count, cudaStream_t stream) {
#if CUDART_VERSION >= 12080
  cudaMemcpyAttributes attributes = {};
  attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t first_copy_of_attributes = 0;
#if CUDART_VERSION >= 13000
  return cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attributes, &first_copy_of_attributes, 1, stream);
#else
  size_t failed_copy = 0;
  return cudaMemcpyBatchAsync(dsts, srcs, sizes, count, &attributes, &first_copy_of_attributes, 1, &failed_copy,
                              stream);
#endif
#else
  return cudaErrorNotSupported;
#endif
}

// Sets the calling thread's current device for a scope and restores the caller's
// choice after: the connector's threads keep whatever device they had.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) status_ = cudaSetDevice(device);  // each runtime call costs µs here
  }
  ~DeviceGuard() {
    int now = previous_;
    cudaGetDevice(&now);
    if (now != previous_) cudaSetDevice(previous_);
  }
  cudaError_t status() const { return status_; }

 private:
  int previous_ = 0;
  cudaError_t status_ = cudaSuccess;
};

enum class CopyMode { kKernel, kCopyEngine, kCopyBatch, kStaging };

Status cuda_status(cudaError_t e, std::string_view what) {
  if (e == cudaSuccess) return Status::Ok();
  return unavailable("{}: {}", what, cudaGetErrorString(e));
}

// The op table of one batch: pinned host copy and device copy. Busy until the batch's event.
struct Slot {
  int device = -1;
  size_t capacity = 0;  // in CopyOps
  CopyOp* host = nullptr;
  CopyOp* dev = nullptr;
};

// A peer allocation mapped into this process. Closed when the last route drops it.
struct Imported {
  int device = -1;  // our ordinal of the GPU holding it
  char* base = nullptr;
  uint64_t bytes = 0;  // of the whole mapped allocation: what a route into it may span
  ~Imported() {
    if (base != nullptr) {
      DeviceGuard guard(device);
      cudaIpcCloseMemHandle(base);
    }
  }
};

struct DeviceState {
  std::vector<cudaStream_t> streams;  // cuda_num_streams, non-blocking
  size_t next_stream = 0;             // the stream the next launch takes
  void* staging = nullptr;            // pinned, kStagingBytes
};

// Hands out a device's streams in turn to the launches of one post and remembers which
// it used (each needs the batch's completion event). Staging posts keep to the first
// stream: they share the device's staging buffer.
class StreamTurns {
 public:
  StreamTurns(DeviceState& state, bool first_stream_only)
      : state_(state),
        count_(first_stream_only ? 1 : state.streams.size()),
        first_(first_stream_only ? 0 : state.next_stream) {}
  ~StreamTurns() {
    if (count_ == state_.streams.size()) state_.next_stream = (first_ + taken_) % count_;
  }
  cudaStream_t next() {
    cudaStream_t stream = state_.streams[(first_ + taken_) % count_];
    if (taken_ < count_) used_[taken_] = stream;
    ++taken_;
    return stream;
  }
  std::span<const cudaStream_t> used() const { return {used_.data(), std::min(taken_, count_)}; }

 private:
  DeviceState& state_;
  size_t count_;
  size_t first_;
  size_t taken_ = 0;
  std::array<cudaStream_t, kMaxStreamsPerDevice> used_{};
};

struct Pool;

class CudaRoute : public Route {
 public:
  std::shared_ptr<Imported> imported;
  char* local = nullptr;
  char* remote = nullptr;
  int device = -1;
  CopyMode mode = CopyMode::kKernel;
};

// Resources shared by the backend and its batches: slots and events come back here.
struct Pool {
  std::mutex mutex;
  std::vector<Slot*> free_slots;
  std::vector<std::unique_ptr<Slot>> all_slots;
  std::vector<cudaEvent_t> free_events;
  std::vector<cudaEvent_t> all_events;

  void give_back(Slot* slot, std::span<const cudaEvent_t> events) {
    std::lock_guard lock(mutex);
    if (slot != nullptr) free_slots.push_back(slot);
    free_events.insert(free_events.end(), events.begin(), events.end());
  }
};

// A posted batch: one event per stream it used, each recorded after its work there.
class CudaBatch : public BackendBatch {
 public:
  CudaBatch(std::shared_ptr<Pool> pool, Slot* slot, std::vector<cudaEvent_t> events, std::shared_ptr<Route> route)
      : pool_(std::move(pool)), slot_(slot), events_(std::move(events)), route_(std::move(route)) {}
  ~CudaBatch() override {
    // Slot and events may only be reused once the GPU is past them.
    if (!returned_.load()) {
      for (cudaEvent_t event : events_) cudaEventSynchronize(event);
      retire();
    }
  }
  TransferState test() override {
    if (returned_.load(std::memory_order_acquire)) return final_state();
    // Events before first_pending_ are known complete: each is queried until it is once.
    size_t i = first_pending_.load(std::memory_order_acquire);
    cudaError_t error = cudaSuccess;
    for (; i < events_.size(); ++i) {
      const cudaError_t e = cudaEventQuery(events_[i]);
      if (e == cudaErrorNotReady) {
        size_t known = first_pending_.load(std::memory_order_relaxed);
        while (known < i && !first_pending_.compare_exchange_weak(known, i, std::memory_order_release)) {
        }
        return {};
      }
      if (e != cudaSuccess) {
        error = e;
        break;
      }
    }
    {
      std::lock_guard lock(mutex_);
      if (!returned_.load()) {
        if (error != cudaSuccess) message_ = fmt::format("CUDA batch failed: {}", cudaGetErrorString(error));
        retire();
      }
    }
    return final_state();
  }
  void wait_until(SteadyClock::time_point until) override {
    while (SteadyClock::now() < until) {
      bool pending = false;
      for (size_t i = first_pending_.load(std::memory_order_acquire); i < events_.size() && !pending; ++i) {
        pending = cudaEventQuery(events_[i]) == cudaErrorNotReady;
      }
      if (!pending) return;
      std::this_thread::yield();
    }
  }

 private:
  TransferState final_state() {
    std::lock_guard lock(mutex_);
    if (message_.empty()) return {TransferStatus::kDone, {}};
    return {TransferStatus::kFailed, message_};
  }
  void retire() {
    pool_->give_back(slot_, events_);
    returned_.store(true, std::memory_order_release);
  }

  std::shared_ptr<Pool> pool_;
  Slot* slot_;
  const std::vector<cudaEvent_t> events_;
  std::shared_ptr<Route> route_;
  std::atomic<size_t> first_pending_{0};
  std::mutex mutex_;
  std::string message_;
  std::atomic<bool> returned_{false};
};

class CudaBackend : public Backend {
 public:
  explicit CudaBackend(const EngineConfig& config) : config_(config), pool_(std::make_shared<Pool>()) {}
  ~CudaBackend() override {
    ProcessRegions::instance().remove_owner(this);
    std::lock_guard lock(mutex_);
    for (auto& [device, state] : devices_) {
      DeviceGuard guard(device);
      for (cudaStream_t stream : state.streams) {
        cudaStreamSynchronize(stream);
        cudaStreamDestroy(stream);
      }
      cudaFreeHost(state.staging);
    }
    for (auto& slot : pool_->all_slots) {
      cudaFreeHost(slot->host);
      DeviceGuard guard(slot->device);
      cudaFree(slot->dev);
    }
    for (cudaEvent_t e : pool_->all_events) cudaEventDestroy(e);
  }

  Status init() {
    if (config_.cuda_copy_mode == "kernel") {
      mode_ = CopyMode::kKernel;
    } else if (config_.cuda_copy_mode == "copy_engine") {
      mode_ = CopyMode::kCopyEngine;
    } else if (config_.cuda_copy_mode == "copy_batch") {
      if (!kHaveMemcpyBatch) {
        return invalid_argument("cuda_copy_mode 'copy_batch' needs cudaMemcpyBatchAsync (CUDA 12.8+); built with {}",
                                CUDART_VERSION);
      }
      mode_ = CopyMode::kCopyBatch;
    } else {
      return invalid_argument("cuda_copy_mode '{}' (expected kernel, copy_engine or copy_batch)",
                              config_.cuda_copy_mode);
    }
    if (config_.cuda_num_streams == 0 || config_.cuda_num_streams > kMaxStreamsPerDevice) {
      return invalid_argument("cuda_num_streams {} (expected 1..{})", config_.cuda_num_streams, kMaxStreamsPerDevice);
    }
    if (config_.cuda_chunk_bytes == 0 || config_.cuda_chunk_bytes % 16 != 0 || config_.cuda_ctas_per_sm == 0 ||
        config_.cuda_threads_per_cta == 0 || config_.cuda_threads_per_cta % 32 != 0 ||
        config_.cuda_threads_per_cta > 1024) {
      return invalid_argument("copy kernel shape: chunk {} bytes (multiple of 16), {} CTAs/SM, {} threads/CTA",
                              config_.cuda_chunk_bytes, config_.cuda_ctas_per_sm, config_.cuda_threads_per_cta);
    }
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
      cudaGetLastError();
      return unavailable("no CUDA device visible");
    }
    for (int d = 0; d < count; ++d) {
      cudaDeviceProp prop;
      PD_RETURN_IF_ERROR(cuda_status(cudaGetDeviceProperties(&prop, d), "cudaGetDeviceProperties"));
      std::string uuid = "GPU-";
      for (int i = 0; i < 16; ++i) uuid += fmt::format("{:02x}", static_cast<uint8_t>(prop.uuid.bytes[i]));
      gpu_uuids_.push_back(uuid);
      num_sms_.push_back(prop.multiProcessorCount);
    }
    return Status::Ok();
  }

  std::string_view name() const override { return "cuda"; }
  void describe(EngineDesc& desc) const override { desc.gpu_uuids = gpu_uuids_; }
  bool can_register(MemKind kind) const override { return kind == MemKind::kCuda; }
  bool supports(MemKind local, MemKind remote, bool same_host) const override {
    return local == MemKind::kCuda && remote == MemKind::kCuda && same_host;
  }

  // The allocation holding `ptr` (base, bytes), in the current device's context. The driver
  // API is reached through the runtime so that binaries do not link libcuda (CPU machines
  // run them without a driver).
  static Result<std::pair<uint64_t, uint64_t>> allocation_of(const void* ptr) {
    using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess || fn == nullptr) {
      return unavailable("cuMemGetAddressRange is not available from the driver");
    }
    CUdeviceptr base = 0;
    size_t size = 0;
    if (CUresult r = reinterpret_cast<GetAddressRange>(fn)(&base, &size, reinterpret_cast<CUdeviceptr>(ptr));
        r != CUDA_SUCCESS) {
      return invalid_argument("pointer {} is not CUDA device memory (cuMemGetAddressRange error {})", ptr,
                              static_cast<int>(r));
    }
    return std::pair<uint64_t, uint64_t>{static_cast<uint64_t>(base), static_cast<uint64_t>(size)};
  }

  Result<std::vector<uint8_t>> register_memory(const LocalRegion& region) override {
    DeviceGuard guard(region.device);
    PD_RETURN_IF_ERROR(cuda_status(guard.status(), "cudaSetDevice"));
    cudaFree(nullptr);  // makes the primary context current for the driver call below
    PD_ASSIGN_OR_RETURN(auto allocation, allocation_of(region.ptr));
    const uint64_t base = allocation.first;
    const uint64_t size = allocation.second;
    const uint64_t offset = reinterpret_cast<uint64_t>(region.ptr) - base;
    if (!span_within(offset, region.bytes, size)) {
      return out_of_range("region of {} bytes at offset {} exceeds its allocation of {} bytes", region.bytes, offset,
                          size);
    }
    cudaIpcMemHandle_t handle;
    PD_RETURN_IF_ERROR(cuda_status(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base)), "cudaIpcGetMemHandle"));
    // The owner's pid lets an engine of the same process skip IPC (CUDA cannot open its
    // own process's handles): tensor-parallel ranks are threads of one process.
    const uint64_t pid = static_cast<uint64_t>(getpid());
    std::vector<uint8_t> key(sizeof(handle) + sizeof(offset) + sizeof(pid));
    std::memcpy(key.data(), &handle, sizeof(handle));
    std::memcpy(key.data() + sizeof(handle), &offset, sizeof(offset));
    std::memcpy(key.data() + sizeof(handle) + sizeof(offset), &pid, sizeof(pid));
    ProcessRegions::instance().add(this, region.id, reinterpret_cast<uintptr_t>(region.ptr), region.bytes);
    return key;
  }
  void deregister(RegionId id) override { ProcessRegions::instance().remove(this, id); }
  Status connect(const EngineDesc&) override { return Status::Ok(); }

  Result<std::shared_ptr<Route>> open_route(const LocalRegion& local, const MemDesc& remote) override {
    auto key = remote.keys.find("cuda");
    if (key == remote.keys.end() || key->second.size() != sizeof(cudaIpcMemHandle_t) + 2 * sizeof(uint64_t)) {
      return invalid_argument("remote region {} of '{}' has no valid cuda key", remote.region_id, remote.engine_name);
    }
    cudaIpcMemHandle_t handle;
    uint64_t offset = 0;
    std::memcpy(&handle, key->second.data(), sizeof(handle));
    std::memcpy(&offset, key->second.data() + sizeof(handle), sizeof(offset));
    uint64_t owner_pid = 0;
    std::memcpy(&owner_pid, key->second.data() + sizeof(handle) + sizeof(offset), sizeof(owner_pid));

    std::lock_guard lock(mutex_);
    DeviceGuard guard(local.device);
    PD_RETURN_IF_ERROR(cuda_status(guard.status(), "cudaSetDevice"));
    // One mapping per (peer boot, region, importing device): CUDA maps a handle once per context.
    const std::string cache_key =
        fmt::format("{}/{}/{}/{}", remote.engine_name, remote.boot_nonce, remote.region_id, local.device);
    std::shared_ptr<Imported> imported = imports_[cache_key].lock();
    if (!imported && owner_pid == static_cast<uint64_t>(getpid())) {
      // Same process (the backend only serves same-host pairs): the address is ours already,
      // but only as far as a cuda backend of this process registered it.
      if (!ProcessRegions::instance().contains(static_cast<uintptr_t>(remote.base), remote.bytes)) {
        return invalid_argument("remote region {} of '{}' claims this process but is not memory registered here",
                                remote.region_id, remote.engine_name);
      }
      imported = std::make_shared<Imported>();
      imported->device = remote.device;
      char* remote_ptr = reinterpret_cast<char*>(remote.base);
      auto route = std::make_shared<CudaRoute>();
      route->imported = imported;
      route->local = static_cast<char*>(local.ptr);
      route->remote = remote_ptr;
      route->device = local.device;
      route->mode = mode_;
      if (remote.device != local.device) {
        int can = 0;
        cudaDeviceCanAccessPeer(&can, local.device, remote.device);
        if (can) {
          if (cudaDeviceEnablePeerAccess(remote.device, 0) != cudaSuccess) cudaGetLastError();
        } else {
          route->mode = CopyMode::kStaging;
        }
      }
      imported->base = nullptr;  // nothing to close
      return std::shared_ptr<Route>(route);
    }
    if (!imported) {
      imported = std::make_shared<Imported>();
      void* base = nullptr;
      PD_RETURN_IF_ERROR(
          cuda_status(cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess),
                      fmt::format("cudaIpcOpenMemHandle for region {} of '{}'", remote.region_id, remote.engine_name)));
      imported->base = static_cast<char*>(base);
      cudaPointerAttributes attributes;
      PD_RETURN_IF_ERROR(cuda_status(cudaPointerGetAttributes(&attributes, base), "cudaPointerGetAttributes"));
      imported->device = attributes.device;
      PD_ASSIGN_OR_RETURN(auto allocation, allocation_of(base));
      imported->bytes = allocation.second;
      imports_[cache_key] = imported;
    }
    // The handle maps the peer's whole allocation; the offset and size it claims must stay in it.
    if (!span_within(offset, remote.bytes, imported->bytes)) {
      return out_of_range("remote region {} of '{}': {} bytes at offset {} exceed the {}-byte allocation it maps",
                          remote.region_id, remote.engine_name, remote.bytes, offset, imported->bytes);
    }
    auto route = std::make_shared<CudaRoute>();
    route->imported = imported;
    route->local = static_cast<char*>(local.ptr);
    route->remote = imported->base + offset;
    route->device = local.device;
    route->mode = mode_;
    if (imported->device != local.device) {
      int can = 0;
      cudaDeviceCanAccessPeer(&can, local.device, imported->device);
      if (can) {
        if (cudaDeviceEnablePeerAccess(imported->device, 0) != cudaSuccess) cudaGetLastError();
      } else {
        route->mode = CopyMode::kStaging;
      }
    }
    return std::shared_ptr<Route>(route);
  }

  OpForm op_form(const Route&) const override {
    return config_.cuda_post_pipeline ? OpForm::kCallerOrder : OpForm::kSortedMerged;
  }

  Result<std::unique_ptr<BackendBatch>> post(const std::shared_ptr<Route>& route_base, Direction direction,
                                             std::span<const Op> ops, SteadyClock::time_point) override {
    auto& route = static_cast<CudaRoute&>(*route_base);
    std::lock_guard lock(mutex_);
    DeviceGuard guard(route.device);
    PD_RETURN_IF_ERROR(cuda_status(guard.status(), "cudaSetDevice"));
    PD_ASSIGN_OR_RETURN(DeviceState * state, device_state(route.device));
    Slot* slot = nullptr;
    Status status;
    std::vector<cudaEvent_t> events;
    {
      StreamTurns turns(*state, route.mode == CopyMode::kStaging);
      switch (route.mode) {
        case CopyMode::kKernel:
          status = post_kernel(route, direction, ops, turns, &slot);
          break;
        case CopyMode::kCopyEngine:
          status = post_copies(route, direction, ops, turns.next());
          break;
        case CopyMode::kCopyBatch:
          status = post_copy_batches(route, direction, ops, turns);
          break;
        case CopyMode::kStaging:
          status = post_staged(route, direction, ops, *state, turns.next());
          break;
      }
      // Events are recorded even after an error so that whatever was enqueued is waited
      // for before the slot and events return to the pool.
      for (cudaStream_t stream : turns.used()) {
        Result<cudaEvent_t> event = take_event();
        cudaError_t recorded = event.ok() ? cudaEventRecord(*event, stream) : cudaErrorUnknown;
        if (event.ok()) events.push_back(*event);
        if (recorded != cudaSuccess) {
          // Nothing may stay in flight behind an error: wait for what was enqueued.
          for (cudaStream_t s : turns.used()) cudaStreamSynchronize(s);
          pool_->give_back(slot, events);
          return event.ok() ? cuda_status(recorded, "cudaEventRecord") : event.status();
        }
      }
    }
    auto batch = std::make_unique<CudaBatch>(pool_, slot, std::move(events), route_base);
    if (!status.ok()) return status;  // the batch's destructor waits for its events
    return std::unique_ptr<BackendBatch>(std::move(batch));
  }

 private:
  // Copy-kernel launches. Batches of <= kMaxInlineOps (merged) ops: one launch with its
  // table in the launch parameters. Larger ones: launches of <= kMaxInlineOps ops on the
  // streams in turn (the first only kFirstLaunchOps when pipelined), or with
  // cuda_split_large_batches = false one launch after uploading the whole table.
  Status post_kernel(const CudaRoute& route, Direction direction, std::span<const Op> ops, StreamTurns& turns,
                     Slot** slot) {
    const uint64_t max_ctas = uint64_t(num_sms_[route.device]) * config_.cuda_ctas_per_sm;
    const auto local_base = reinterpret_cast<uint64_t>(route.local);
    const auto remote_base = reinterpret_cast<uint64_t>(route.remote);
    const bool pipelined = config_.cuda_post_pipeline;
    if (ops.size() > kMaxInlineOps && !config_.cuda_split_large_batches) {
      ConsecutiveMerger merger(ops);
      thread_local std::vector<Op> merged;
      thread_local std::vector<CopyOp> table;
      merged.resize(ops.size());
      merged.resize(merger.next(merged));
      table.resize(merged.size());
      const LaunchShape shape = build_copy_table(merged, direction, local_base, remote_base, max_ctas, 1,
                                                 config_.cuda_chunk_bytes, table.data());
      PD_ASSIGN_OR_RETURN(*slot, take_slot(route.device, table.size()));
      // The table is built in ordinary memory and copied into the pinned slot in one
      // memcpy: pinned pages may be mapped uncached, where 8-byte stores are slow.
      std::memcpy((*slot)->host, table.data(), table.size() * sizeof(CopyOp));
      cudaStream_t stream = turns.next();
      PD_RETURN_IF_ERROR(cuda_status(
          cudaMemcpyAsync((*slot)->dev, (*slot)->host, table.size() * sizeof(CopyOp), cudaMemcpyHostToDevice, stream),
          "uploading the op table"));
      return cuda_status(launch_gather_scatter((*slot)->dev, shape.num_ops, shape.num_chunks, shape.chunk_bytes,
                                               shape.grid, config_.cuda_threads_per_cta, stream),
                         "launching the copy kernel");
    }
    thread_local LaunchScratch scratch;
    KernelLaunchPlanner planner(ops, direction, local_base, remote_base, max_ctas, config_.cuda_chunk_bytes, pipelined,
                                scratch);
    while (!planner.done()) {
      const KernelLaunchPlanner::Launch launch = planner.next();
      PD_RETURN_IF_ERROR(
          cuda_status(launch_gather_scatter_inline(launch.table, launch.shape.num_ops, launch.shape.num_chunks,
                                                   launch.shape.chunk_bytes, launch.shape.grid,
                                                   config_.cuda_threads_per_cta, turns.next()),
                      "launching the copy kernel"));
    }
    return Status::Ok();
  }

  // Calls copy(addresses, bytes) for each op after merging neighbours contiguous on both
  // sides, in the caller's order; stops at the first error.
  template <typename CopyFn>
  static Status for_each_merged_copy(const CudaRoute& route, Direction direction, std::span<const Op> ops,
                                     CopyFn&& copy) {
    const auto local_base = reinterpret_cast<uint64_t>(route.local);
    const auto remote_base = reinterpret_cast<uint64_t>(route.remote);
    ConsecutiveMerger merger(ops);
    std::array<Op, 256> merged;
    while (!merger.done()) {
      const size_t n = merger.next(merged);
      for (size_t i = 0; i < n; ++i) {
        PD_RETURN_IF_ERROR(copy(copy_addresses(merged[i], direction, local_base, remote_base), merged[i].bytes));
      }
    }
    return Status::Ok();
  }

  // One cudaMemcpyAsync per merged op, all on one stream.
  Status post_copies(const CudaRoute& route, Direction direction, std::span<const Op> ops, cudaStream_t stream) {
    return for_each_merged_copy(route, direction, ops, [&](const CopyAddresses& at, uint64_t bytes) {
      return cuda_status(cudaMemcpyAsync(reinterpret_cast<void*>(at.dst), reinterpret_cast<const void*>(at.src), bytes,
                                         cudaMemcpyDefault, stream),
                         "cudaMemcpyAsync");
    });
  }

  // cudaMemcpyBatchAsync: pipelined, one call per launch group (the streams in turn);
  // otherwise one call for the whole (sorted, merged) batch.
  Status post_copy_batches(const CudaRoute& route, Direction direction, std::span<const Op> ops, StreamTurns& turns) {
    const auto local_base = reinterpret_cast<uint64_t>(route.local);
    const auto remote_base = reinterpret_cast<uint64_t>(route.remote);
    const bool pipelined = config_.cuda_post_pipeline;
    thread_local std::vector<Op> merged;
    thread_local std::vector<void*> dsts, srcs;
    thread_local std::vector<size_t> sizes;
    ConsecutiveMerger merger(ops);
    for (size_t group = 0; !merger.done(); ++group) {
      merged.resize(pipelined ? launch_capacity(group, ops.size(), true) : ops.size());
      const size_t n = merger.next(merged);
      dsts.resize(n);
      srcs.resize(n);
      sizes.resize(n);
      for (size_t i = 0; i < n; ++i) {
        const CopyAddresses at = copy_addresses(merged[i], direction, local_base, remote_base);
        dsts[i] = reinterpret_cast<void*>(at.dst);
        srcs[i] = reinterpret_cast<void*>(at.src);
        sizes[i] = merged[i].bytes;
      }
      PD_RETURN_IF_ERROR(
          cuda_status(memcpy_batch(dsts.data(), srcs.data(), sizes.data(), n, turns.next()), "cudaMemcpyBatchAsync"));
    }
    return Status::Ok();
  }

  // Through the device's pinned staging buffer, in pieces of kStagingBytes.
  Status post_staged(const CudaRoute& route, Direction direction, std::span<const Op> ops, DeviceState& state,
                     cudaStream_t stream) {
    return for_each_merged_copy(route, direction, ops, [&](const CopyAddresses& at, uint64_t bytes) -> Status {
      for (uint64_t done = 0; done < bytes; done += kStagingBytes) {
        const uint64_t piece = std::min(kStagingBytes, bytes - done);
        PD_RETURN_IF_ERROR(cuda_status(cudaMemcpyAsync(state.staging, reinterpret_cast<const void*>(at.src + done),
                                                       piece, cudaMemcpyDefault, stream),
                                       "staging copy out"));
        PD_RETURN_IF_ERROR(cuda_status(
            cudaMemcpyAsync(reinterpret_cast<void*>(at.dst + done), state.staging, piece, cudaMemcpyDefault, stream),
            "staging copy in"));
      }
      return Status::Ok();
    });
  }

  Result<DeviceState*> device_state(int device) {
    auto it = devices_.find(device);
    if (it != devices_.end()) return &it->second;
    DeviceState state;
    Status status;
    for (uint32_t i = 0; i < config_.cuda_num_streams && status.ok(); ++i) {
      cudaStream_t stream = nullptr;
      status = cuda_status(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
      if (status.ok()) state.streams.push_back(stream);
    }
    if (status.ok()) status = cuda_status(cudaMallocHost(&state.staging, kStagingBytes), "cudaMallocHost (staging)");
    if (!status.ok()) {
      for (cudaStream_t stream : state.streams) cudaStreamDestroy(stream);
      return status;
    }
    return &devices_.emplace(device, std::move(state)).first->second;
  }

  Result<cudaEvent_t> take_event() {
    std::lock_guard lock(pool_->mutex);
    if (!pool_->free_events.empty()) {
      cudaEvent_t e = pool_->free_events.back();
      pool_->free_events.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    PD_RETURN_IF_ERROR(cuda_status(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate"));
    pool_->all_events.push_back(e);
    return e;
  }

  Result<Slot*> take_slot(int device, size_t num_ops) {
    std::lock_guard lock(pool_->mutex);
    for (size_t i = 0; i < pool_->free_slots.size(); ++i) {
      Slot* s = pool_->free_slots[i];
      if (s->device == device && s->capacity >= num_ops) {
        pool_->free_slots.erase(pool_->free_slots.begin() + static_cast<ptrdiff_t>(i));
        return s;
      }
    }
    auto slot = std::make_unique<Slot>();
    slot->device = device;
    slot->capacity = std::max<size_t>(num_ops, 1024);
    PD_RETURN_IF_ERROR(cuda_status(cudaMallocHost(&slot->host, slot->capacity * sizeof(CopyOp)), "cudaMallocHost"));
    if (Status s = cuda_status(cudaMalloc(&slot->dev, slot->capacity * sizeof(CopyOp)), "cudaMalloc"); !s.ok()) {
      cudaFreeHost(slot->host);
      return s;
    }
    pool_->all_slots.push_back(std::move(slot));
    return pool_->all_slots.back().get();
  }

  EngineConfig config_;
  CopyMode mode_ = CopyMode::kKernel;
  std::vector<std::string> gpu_uuids_;
  std::vector<int> num_sms_;
  std::shared_ptr<Pool> pool_;
  std::mutex mutex_;  // guards devices_, imports_ and the stream order of posts
  std::map<int, DeviceState> devices_;
  std::map<std::string, std::weak_ptr<Imported>> imports_;
};

}  // namespace

Result<std::unique_ptr<Backend>> make_cuda_backend(const EngineConfig& config) {
  auto backend = std::make_unique<CudaBackend>(config);
  PD_RETURN_IF_ERROR(backend->init());
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace pd::xfer
