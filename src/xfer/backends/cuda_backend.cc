// cuda backend: same host, GPU <-> GPU, through CUDA IPC.
//
// Regions are exported as cudaIpcMemHandle_t (+ the region's offset inside its
// allocation); the importer maps the peer's allocation once per (peer boot, region).
// A batch is posted on one dedicated stream per local device, in one of three modes:
//   kernel      — the op table is uploaded once (pinned slot -> device slot), then ONE
//                 launch of a gather/scatter kernel copies every op with 16-byte vector
//                 loads/stores over NVLink (the default: one launch instead of one
//                 copy per 64 KiB block);
//   copy_engine — one cudaMemcpyAsync per merged op (the alternative);
//   staging     — no peer access between the two GPUs: each op goes through a pinned
//                 host buffer (D2H then H2D, stream-ordered so the buffer is reusable).
// An event recorded after the batch is its completion; test() queries it.
#include <cuda.h>
#include <cuda_runtime.h>

#include "xfer/backends/copy_kernel.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "xfer/backends/factory.h"

namespace pd::xfer {
namespace {

constexpr uint64_t kStagingBytes = 8ull << 20;

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

enum class CopyMode { kKernel, kCopyEngine, kStaging };

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
  ~Imported() {
    if (base != nullptr) {
      DeviceGuard guard(device);
      cudaIpcCloseMemHandle(base);
    }
  }
};

struct DeviceState {
  cudaStream_t stream = nullptr;
  void* staging = nullptr;  // pinned, kStagingBytes
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

  void give_back(Slot* slot, cudaEvent_t event) {
    std::lock_guard lock(mutex);
    if (slot != nullptr) free_slots.push_back(slot);
    free_events.push_back(event);
  }
};

class CudaBatch : public BackendBatch {
 public:
  CudaBatch(std::shared_ptr<Pool> pool, Slot* slot, cudaEvent_t event, std::shared_ptr<Route> route, int device)
      : pool_(std::move(pool)), slot_(slot), event_(event), route_(std::move(route)), device_(device) {}
  ~CudaBatch() override {
    // Slot and event may only be reused once the GPU is past them.
    if (!returned_.load()) {
      cudaEventSynchronize(event_);
      retire();
    }
  }
  TransferState test() override {
    if (returned_.load(std::memory_order_acquire)) return final_state();
    cudaError_t e = cudaEventQuery(event_);
    if (e == cudaErrorNotReady) return {};
    {
      std::lock_guard lock(mutex_);
      if (!returned_.load()) {
        if (e != cudaSuccess) message_ = fmt::format("CUDA batch failed: {}", cudaGetErrorString(e));
        retire();
      }
    }
    return final_state();
  }
  void wait_until(SteadyClock::time_point until) override {
    while (SteadyClock::now() < until) {
      if (cudaEventQuery(event_) != cudaErrorNotReady) return;
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
    pool_->give_back(slot_, event_);
    returned_.store(true, std::memory_order_release);
  }

  std::shared_ptr<Pool> pool_;
  Slot* slot_;
  cudaEvent_t event_;
  std::shared_ptr<Route> route_;
  int device_;
  std::mutex mutex_;
  std::string message_;
  std::atomic<bool> returned_{false};
};

class CudaBackend : public Backend {
 public:
  explicit CudaBackend(const EngineConfig& config) : config_(config), pool_(std::make_shared<Pool>()) {}
  ~CudaBackend() override {
    std::lock_guard lock(mutex_);
    for (auto& [device, state] : devices_) {
      DeviceGuard guard(device);
      cudaStreamSynchronize(state.stream);
      cudaStreamDestroy(state.stream);
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
    } else {
      return invalid_argument("cuda_copy_mode '{}' (expected kernel or copy_engine)", config_.cuda_copy_mode);
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

  Result<std::vector<uint8_t>> register_memory(const LocalRegion& region) override {
    DeviceGuard guard(region.device);
    PD_RETURN_IF_ERROR(cuda_status(guard.status(), "cudaSetDevice"));
    cudaFree(nullptr);  // makes the primary context current for the driver call below
    // The driver API is reached through the runtime so that binaries do not link
    // libcuda (CPU machines run them without a driver).
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
    if (CUresult r = reinterpret_cast<GetAddressRange>(fn)(&base, &size, reinterpret_cast<CUdeviceptr>(region.ptr));
        r != CUDA_SUCCESS) {
      return invalid_argument("pointer {} is not CUDA device memory (cuMemGetAddressRange error {})", region.ptr,
                              static_cast<int>(r));
    }
    const uint64_t offset = reinterpret_cast<uint64_t>(region.ptr) - base;
    if (offset + region.bytes > size) {
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
    return key;
  }
  void deregister(RegionId) override {}
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
      // Same process (the backend only serves same-host pairs): the address is ours already.
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
      imports_[cache_key] = imported;
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

  Result<std::unique_ptr<BackendBatch>> post(const std::shared_ptr<Route>& route_base, Direction direction,
                                             std::span<const Op> ops) override {
    auto& route = static_cast<CudaRoute&>(*route_base);
    std::lock_guard lock(mutex_);
    DeviceGuard guard(route.device);
    PD_RETURN_IF_ERROR(cuda_status(guard.status(), "cudaSetDevice"));
    PD_ASSIGN_OR_RETURN(DeviceState * state, device_state(route.device));
    cudaEvent_t event = nullptr;
    PD_ASSIGN_OR_RETURN(event, take_event());
    Slot* slot = nullptr;
    const bool write = direction == Direction::kWrite;
    auto src_of = [&](const Op& op) { return write ? route.local + op.local_offset : route.remote + op.remote_offset; };
    auto dst_of = [&](const Op& op) { return write ? route.remote + op.remote_offset : route.local + op.local_offset; };
    Status status;
    if (route.mode == CopyMode::kKernel) {
      // Work items: at most cuda_chunk_bytes, but small enough that a small batch (one
      // layer of KV) still spreads over every CTA the launch can hold.
      uint64_t total_bytes = 0;
      for (const Op& op : ops) total_bytes += op.bytes;
      const uint64_t max_ctas = uint64_t(num_sms_[route.device]) * config_.cuda_ctas_per_sm;
      const uint64_t even_share = (total_bytes / max_ctas + 4095) / 4096 * 4096;
      const uint64_t chunk_bytes = std::clamp<uint64_t>(even_share, 4096, config_.cuda_chunk_bytes);
      // The table is built in ordinary memory and copied into the pinned slot in one
      // memcpy: pinned pages may be mapped uncached, where 8-byte stores are slow.
      thread_local std::vector<CopyOp> host_table;
      host_table.resize(ops.size());
      CopyOp* table = host_table.data();
      const bool inline_ops = ops.size() <= kMaxInlineOps;
      if (!inline_ops && config_.cuda_split_large_batches) {
        // Launch-parameter sub-launches of <= kMaxInlineOps ops each: no table upload, and
        // the GPU starts on the first group while the host builds the next. Work items are
        // sized for about four waves per group so that group boundaries cost little.
        for (size_t begin = 0; begin < ops.size() && status.ok(); begin += kMaxInlineOps) {
          const size_t n = std::min<size_t>(kMaxInlineOps, ops.size() - begin);
          uint64_t group_bytes = 0;
          for (size_t i = begin; i < begin + n; ++i) group_bytes += ops[i].bytes;
          const uint64_t share = (group_bytes / (4 * max_ctas) + 4095) / 4096 * 4096;
          const uint64_t group_chunk = std::clamp<uint64_t>(share, 4096, config_.cuda_chunk_bytes);
          uint64_t group_chunks = 0;
          for (size_t i = 0; i < n; ++i) {
            const Op& op = ops[begin + i];
            table[i] = {reinterpret_cast<uint64_t>(src_of(op)), reinterpret_cast<uint64_t>(dst_of(op)), op.bytes,
                        group_chunks};
            group_chunks += (op.bytes + group_chunk - 1) / group_chunk;
          }
          const unsigned group_grid = static_cast<unsigned>(std::min<uint64_t>(group_chunks, max_ctas));
          status = cuda_status(launch_gather_scatter_inline(table, static_cast<uint32_t>(n), group_chunks,
                                                            static_cast<uint32_t>(group_chunk), group_grid,
                                                            config_.cuda_threads_per_cta, state->stream),
                               "launching the copy kernel");
        }
      } else if (!inline_ops) {
        auto taken = take_slot(route.device, ops.size());
        if (!taken.ok()) {
          pool_->give_back(nullptr, event);
          return taken.status();
        }
        slot = *taken;
      }
      const bool single_launch = inline_ops || !config_.cuda_split_large_batches;
      uint64_t num_chunks = 0;
      for (size_t i = 0; single_launch && i < ops.size(); ++i) {
        table[i] = {reinterpret_cast<uint64_t>(src_of(ops[i])), reinterpret_cast<uint64_t>(dst_of(ops[i])),
                    ops[i].bytes, num_chunks};
        num_chunks += (ops[i].bytes + chunk_bytes - 1) / chunk_bytes;
      }
      const unsigned grid = static_cast<unsigned>(std::min<uint64_t>(num_chunks, max_ctas));
      if (!single_launch) {
        // posted above, group by group
      } else if (inline_ops) {
        status = cuda_status(launch_gather_scatter_inline(table, static_cast<uint32_t>(ops.size()), num_chunks,
                                                          static_cast<uint32_t>(chunk_bytes), grid,
                                                          config_.cuda_threads_per_cta, state->stream),
                             "launching the copy kernel");
      } else {
        std::memcpy(slot->host, table, ops.size() * sizeof(CopyOp));
        status = cuda_status(
            cudaMemcpyAsync(slot->dev, slot->host, ops.size() * sizeof(CopyOp), cudaMemcpyHostToDevice, state->stream),
            "uploading the op table");
        if (status.ok()) {
          status = cuda_status(launch_gather_scatter(slot->dev, static_cast<uint32_t>(ops.size()), num_chunks,
                                                     static_cast<uint32_t>(chunk_bytes), grid,
                                                     config_.cuda_threads_per_cta, state->stream),
                               "launching the copy kernel");
        }
      }
    } else if (route.mode == CopyMode::kCopyEngine) {
      for (const Op& op : ops) {
        status = cuda_status(cudaMemcpyAsync(dst_of(op), src_of(op), op.bytes, cudaMemcpyDefault, state->stream),
                             "cudaMemcpyAsync");
        if (!status.ok()) break;
      }
    } else {
      for (const Op& op : ops) {
        for (uint64_t done = 0; done < op.bytes && status.ok(); done += kStagingBytes) {
          const uint64_t n = std::min(kStagingBytes, op.bytes - done);
          status = cuda_status(cudaMemcpyAsync(state->staging, src_of(op) + done, n, cudaMemcpyDefault, state->stream),
                               "staging copy out");
          if (status.ok()) {
            status =
                cuda_status(cudaMemcpyAsync(dst_of(op) + done, state->staging, n, cudaMemcpyDefault, state->stream),
                            "staging copy in");
          }
        }
        if (!status.ok()) break;
      }
    }
    // The event is recorded even after an error so that whatever was enqueued is
    // waited for before the slot returns to the pool.
    cudaError_t recorded = cudaEventRecord(event, state->stream);
    auto batch = std::make_unique<CudaBatch>(pool_, slot, event, route_base, route.device);
    if (recorded != cudaSuccess) {
      cudaStreamSynchronize(state->stream);
      return cuda_status(recorded, "cudaEventRecord");
    }
    if (!status.ok()) return status;  // the batch's destructor waits for the event
    return std::unique_ptr<BackendBatch>(std::move(batch));
  }

 private:
  Result<DeviceState*> device_state(int device) {
    auto it = devices_.find(device);
    if (it != devices_.end()) return &it->second;
    DeviceState state;
    PD_RETURN_IF_ERROR(
        cuda_status(cudaStreamCreateWithFlags(&state.stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags"));
    PD_RETURN_IF_ERROR(cuda_status(cudaMallocHost(&state.staging, kStagingBytes), "cudaMallocHost (staging)"));
    return &devices_.emplace(device, state).first->second;
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
