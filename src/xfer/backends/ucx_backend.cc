// UCX backend: UCP RMA (put/get + endpoint flush) on host memory.
//
// Threads: the worker runs in UCS_THREAD_MODE_MULTI so that posting threads call
// ucp_put_nbx/ucp_get_nbx directly; one progress thread owned by this backend
// drives ucp_worker_progress (spinning while batches are in flight, sleeping in
// epoll on the worker's wakeup fd otherwise, so that a TCP target keeps serving
// incoming RMA). Completion callbacks run on the progress thread.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/epoll.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "common/log.h"
#include "common/metrics.h"
#include "xfer/backends/factory.h"
#include "xfer/backends/ucx_common.h"
#include "xfer/backends/ucx_staging.h"
#include "xfer/backends/ucx_wire_check.h"

namespace pd::xfer {
namespace {

constexpr int64_t kCloseTimeoutMs = 2000;

// The interface that carries `host` (for UCX_NET_DEVICES) and whether it is
// operationally up; an empty name if no interface has that address.
struct Interface {
  std::string name;
  bool running = false;
};

Interface interface_for(const std::string& host) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return {};
  Interface found;
  for (ifaddrs* a = list; a != nullptr && found.name.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, text, sizeof(text));
    if (host == text) found = {a->ifa_name, (a->ifa_flags & IFF_UP) != 0 && (a->ifa_flags & IFF_RUNNING) != 0};
  }
  freeifaddrs(list);
  return found;
}

// UCX lists a network device only if it is up *and running* when the context is
// created, and silently drops a UCX_NET_DEVICES entry that is not (it then advertises
// only what is left, e.g. loopback, which a peer in another network namespace or on
// another host cannot reach: its ucp_ep_create fails with "Destination is
// unreachable"). A veth end brought up a moment ago reports no carrier until the
// kernel's link watcher runs (up to a second, longer under load), so wait for it,
// bounded, and refuse to start on an interface that stays down.
Result<std::string> wait_for_interface(const std::string& host, int64_t timeout_ms) {
  Deadline deadline = Deadline::after_ms(timeout_ms);
  while (true) {
    Interface found = interface_for(host);
    if (found.name.empty()) return std::string();  // not a local address: let UCX choose
    if (found.running) return found.name;
    if (deadline.expired()) {
      return unavailable("interface {} (address {}) is not running after {} ms: UCX would not use it", found.name, host,
                         timeout_ms);
    }
    // Link state changes arrive on no fd we could wait on portably; poll the real
    // condition at a short interval until the deadline.
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// "tl/device" of every lane of an endpoint, from UCX's own description of it
// (ucp_ep_print_info; UCX 1.13 has no query for an endpoint's transports).
std::string endpoint_transports(ucp_ep_h ep) {
  char* text = nullptr;
  size_t text_bytes = 0;
  FILE* stream = open_memstream(&text, &text_bytes);
  if (stream == nullptr) return {};
  ucp_ep_print_info(ep, stream);
  std::fclose(stream);
  std::string info(text, text_bytes);
  std::free(text);
  std::vector<std::string> found;
  // Lines look like "#   lane[0]:  0:tcp/eth0.0 md[0] -> md[0]/tcp/sysdev[255] am ...".
  for (size_t at = info.find("lane["); at != std::string::npos; at = info.find("lane[", at + 1)) {
    size_t colon = info.find(':', info.find("]:", at) + 2);
    if (colon == std::string::npos) break;
    size_t end = info.find_first_of(" \n", colon);
    std::string lane = info.substr(colon + 1, end - colon - 1);
    if (size_t dot = lane.rfind('.'); dot != std::string::npos && lane.find('/') < dot) lane.resize(dot);
    if (std::find(found.begin(), found.end(), lane) == found.end()) found.push_back(lane);
  }
  std::string joined;
  for (const std::string& lane : found) joined += (joined.empty() ? "" : ",") + lane;
  return joined;
}

// The index of the md named `name` in UCX's own description of the context
// (ucp_context_print_info; UCX 1.13 has no query for it): lines look like
// "#            md 3  :  component 3  posix". -1 when there is none.
int md_index_of(ucp_context_h context, const std::string& name) {
  char* text = nullptr;
  size_t text_bytes = 0;
  FILE* stream = open_memstream(&text, &text_bytes);
  if (stream == nullptr) return -1;
  ucp_context_print_info(context, stream);
  std::fclose(stream);
  std::string info(text, text_bytes);
  std::free(text);
  size_t line_start = 0;
  while (line_start < info.size()) {
    size_t line_end = info.find('\n', line_start);
    if (line_end == std::string::npos) line_end = info.size();
    const std::string line = info.substr(line_start, line_end - line_start);
    line_start = line_end + 1;
    int md = -1;
    int component = -1;
    char md_name[64] = {};
    if (std::sscanf(line.c_str(), "# md %d : component %d %63s", &md, &component, md_name) == 3 && name == md_name) {
      return md;
    }
  }
  return -1;
}

// The device copier of ucx staging (EngineConfig::ucx_staging); null when GPU memory
// cannot be staged here.
Result<std::unique_ptr<StagingCopier>> make_staging_copier(const EngineConfig& config) {
  if (config.ucx_staging_chunk_bytes < 4096 || config.ucx_staging_slots == 0) {
    return invalid_argument(
        "EngineConfig: ucx_staging_chunk_bytes must be >= 4096 and ucx_staging_slots >= 1, got {} and {}",
        config.ucx_staging_chunk_bytes, config.ucx_staging_slots);
  }
  if (config.ucx_staging == "off") return std::unique_ptr<StagingCopier>();
  if (config.ucx_staging == "memcpy") return make_memcpy_copier();
  if (config.ucx_staging != "auto") {
    return invalid_argument("EngineConfig.ucx_staging must be auto, off or memcpy, got '{}'", config.ucx_staging);
  }
  Result<std::unique_ptr<StagingCopier>> cuda = make_cuda_copier();
  if (!cuda.ok()) return std::unique_ptr<StagingCopier>();  // no GPU: host memory only
  return cuda;
}

// Peer blobs refused before UCX saw them (ucx_wire_check.h).
metrics::Counter& refused_blobs(const char* kind) {
  return metrics::Registry::global().counter("pd_xfer_peer_blobs_refused_total",
                                             "Peer UCX addresses and keys refused before UCX parsed them",
                                             {{"kind", kind}});
}

// UCX reads a peer's blob without its length: it gets a copy with zeros after it.
std::vector<uint8_t> padded_copy(const std::vector<uint8_t>& blob) {
  std::vector<uint8_t> copy(blob.size() + kUcxBlobPadding, 0);
  std::copy(blob.begin(), blob.end(), copy.begin());
  return copy;
}

class UcxBackend;

// user_data of one flush request; deleted by its callback.
struct FlushContext {
  std::shared_ptr<UcxCompletion> completion;
  UcxBackend* backend;
};

// The key of a GPU region staged by this backend: the region is reached through the
// staging protocol (by region id), not by RMA, so there is no rkey to pack.
constexpr uint8_t kStagedKey[] = {'p', 'd', 's', 't', 'a', 'g', 'e', '1'};

// A route to a peer's region: RMA with an unpacked rkey (host <-> host, or GPU memory
// when UCX handles it), or staged (either side GPU memory UCX cannot reach).
class UcxRoute : public Route {
 public:
  UcxRoute(std::shared_ptr<UcxPeer> peer, ucp_rkey_h rkey, uint8_t* local, uint64_t remote_base)
      : peer_(std::move(peer)), rkey_(rkey), local_(local), remote_base_(remote_base) {}
  UcxRoute(std::shared_ptr<UcxPeer> peer, const StagedMemory& staged_local, RegionId remote_region)
      : peer_(std::move(peer)), staged_(true), staged_local_(staged_local), remote_region_(remote_region) {}
  ~UcxRoute() override {
    if (rkey_ != nullptr) ucp_rkey_destroy(rkey_);
  }
  std::shared_ptr<UcxPeer> peer_;
  ucp_rkey_h rkey_ = nullptr;
  uint8_t* local_ = nullptr;
  uint64_t remote_base_ = 0;
  bool staged_ = false;
  StagedMemory staged_local_;
  RegionId remote_region_ = 0;
};

class UcxBackend : public Backend {
 public:
  explicit UcxBackend(std::string host_id) : host_id_(std::move(host_id)) {}
  ~UcxBackend() override { shutdown(); }

  Status init(const EngineConfig& config) {
    // UCX 1.13 has no peer-failure handling on its shared-memory transports: asking for
    // it silently moves same-host RMA onto TCP (measured: 0.1 GB/s instead of ~10). So
    // endpoints to a peer on this host use no error handling while shared memory is
    // allowed — a dead peer's segment stays mapped, writes into it complete, and the
    // peer's death is the control plane's to notice (the batch deadline still holds);
    // every other endpoint asks UCX to report peer failure.
    busy_poll_ = config.ucx_busy_poll;
    const std::string& tls = config.ucx_transports;
    shm_allowed_ = tls.empty() || tls.find("posix") != std::string::npos || tls.find("sysv") != std::string::npos ||
                   tls.find("sm") != std::string::npos || tls.find("all") != std::string::npos;
    ucp_config_t* ucp_config = nullptr;
    if (ucs_status_t s = ucp_config_read(nullptr, nullptr, &ucp_config); s != UCS_OK) {
      return internal_error("ucp_config_read: {}", ucs_status_string(s));
    }
    if (!config.ucx_transports.empty()) ucp_config_modify(ucp_config, "TLS", config.ucx_transports.c_str());
    Result<std::string> device = wait_for_interface(config.listen_host, config.interface_up_timeout_ms);
    if (!device.ok()) {
      ucp_config_release(ucp_config);
      return device.status();
    }
    if (!device->empty()) ucp_config_modify(ucp_config, "NET_DEVICES", device->c_str());
    ucp_params_t params = {};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 1;
    ucs_status_t s = ucp_init(&params, ucp_config, &context_);
    ucp_config_release(ucp_config);
    if (s != UCS_OK) return unavailable("ucp_init: {}", ucs_status_string(s));
    posix_md_index_ = md_index_of(context_, "posix");
    ucp_context_attr_t attr = {};
    attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
    if (ucp_context_query(context_, &attr) == UCS_OK) {
      ucx_handles_cuda_ = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
    }
    PD_ASSIGN_OR_RETURN(std::unique_ptr<StagingCopier> copier, make_staging_copier(config));

    ucp_worker_params_t wparams = {};
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wparams.thread_mode = UCS_THREAD_MODE_MULTI;
    if (s = ucp_worker_create(context_, &wparams, &worker_); s != UCS_OK) {
      return unavailable("ucp_worker_create: {}", ucs_status_string(s));
    }
    ucp_address_t* address = nullptr;
    size_t address_bytes = 0;
    if (s = ucp_worker_get_address(worker_, &address, &address_bytes); s != UCS_OK) {
      return internal_error("ucp_worker_get_address: {}", ucs_status_string(s));
    }
    const auto* a = reinterpret_cast<const uint8_t*>(address);
    address_.assign(a, a + address_bytes);
    ucp_worker_release_address(worker_, address);
    // Peers' addresses are checked against the format of our own (ucx_wire_check.h). A
    // worker whose address the walker cannot follow (another UCX release, unified mode)
    // falls back to the header check and says so.
    if (Result<UcxAddressLayout> own = parse_ucx_worker_address(address_); own.ok()) {
      address_profile_ = ucx_address_profile(*own);
    } else {
      address_version_ = address_.empty() ? 0 : static_cast<uint8_t>(address_[0] & 0x0f);
      PD_LOG_WARN(
          "xfer ucx: this worker's own address does not follow UCX 1.13's packed layout ({}); peer "
          "addresses get only a size and version check",
          own.status().message());
    }

    // Installed even without a device copier: this engine's host regions may be the
    // target of a peer's staged GPU batch.
    StagingConfig staging;
    staging.chunk_bytes = config.ucx_staging_chunk_bytes;
    staging.num_initiator_slots = config.ucx_staging_slots;
    staging.num_target_slots = config.ucx_staging_slots;
    staging_ = std::make_unique<UcxStaging>(worker_, std::move(copier), staging);
    PD_RETURN_IF_ERROR(staging_->install());

    int efd = -1;
    if (s = ucp_worker_get_efd(worker_, &efd); s != UCS_OK) {
      return internal_error("ucp_worker_get_efd: {}", ucs_status_string(s));
    }
    epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
    epoll_event ev = {};
    ev.events = EPOLLIN;
    if (epoll_fd_ < 0 || epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, efd, &ev) != 0) {
      return internal_error("epoll setup for the UCX worker failed: {}", std::strerror(errno));
    }
    progress_thread_ = std::thread([this] { progress_loop(); });
    return Status::Ok();
  }

  std::string_view name() const override { return "ucx"; }
  void describe(EngineDesc& desc) const override { desc.endpoints["ucx"] = address_; }
  bool can_register(MemKind kind) const override {
    return kind == MemKind::kHost || ucx_handles_cuda_ || staging_->has_device_copier();
  }
  // A peer's GPU region is always reachable: by RMA when both UCX builds handle CUDA
  // memory, else through the peer's staging (its key says which).
  bool supports(MemKind local, MemKind remote, bool) const override {
    return local == MemKind::kHost || can_register(local);
  }

  Result<std::vector<uint8_t>> register_memory(const LocalRegion& region) override {
    const bool staged = region.kind == MemKind::kCuda && !ucx_handles_cuda_;
    if (staged) {
      if (!staging_->has_device_copier()) return failed_precondition("ucx: no device copier for GPU memory");
      staging_->add_region(region.id, {static_cast<uint8_t*>(region.ptr), region.bytes, true, region.device});
      return std::vector<uint8_t>(std::begin(kStagedKey), std::end(kStagedKey));
    }
    ucp_mem_map_params_t params = {};
    params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    params.address = region.ptr;
    params.length = region.bytes;
    if (region.kind == MemKind::kCuda) {
      params.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
      params.memory_type = UCS_MEMORY_TYPE_CUDA;
    }
    ucp_mem_h memh = nullptr;
    if (ucs_status_t s = ucp_mem_map(context_, &params, &memh); s != UCS_OK) {
      return unavailable("ucp_mem_map of {} bytes: {}", region.bytes, ucs_status_string(s));
    }
    void* packed = nullptr;
    size_t packed_bytes = 0;
    if (ucs_status_t s = ucp_rkey_pack(context_, memh, &packed, &packed_bytes); s != UCS_OK) {
      ucp_mem_unmap(context_, memh);
      return internal_error("ucp_rkey_pack: {}", ucs_status_string(s));
    }
    const auto* p = static_cast<const uint8_t*>(packed);
    std::vector<uint8_t> key(p, p + packed_bytes);
    ucp_rkey_buffer_release(packed);
    staging_->add_region(region.id, {static_cast<uint8_t*>(region.ptr), region.bytes, false, -1});
    std::lock_guard lock(mutex_);
    memhs_[region.id] = memh;
    return key;
  }

  Result<std::pair<void*, std::vector<uint8_t>>> allocate_host(RegionId id, size_t bytes) override {
    ucp_mem_map_params_t params = {};
    params.field_mask =
        UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    params.address = nullptr;
    params.length = bytes;
    params.flags = UCP_MEM_MAP_ALLOCATE;
    ucp_mem_h memh = nullptr;
    if (ucs_status_t s = ucp_mem_map(context_, &params, &memh); s != UCS_OK) {
      return resource_exhausted("ucp_mem_map(ALLOCATE) of {} bytes: {}", bytes, ucs_status_string(s));
    }
    ucp_mem_attr_t attr = {};
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    void* packed = nullptr;
    size_t packed_bytes = 0;
    if (ucp_mem_query(memh, &attr) != UCS_OK || attr.length < bytes ||
        ucp_rkey_pack(context_, memh, &packed, &packed_bytes) != UCS_OK) {
      ucp_mem_unmap(context_, memh);
      return internal_error("querying or packing a UCX allocation of {} bytes failed", bytes);
    }
    const auto* p = static_cast<const uint8_t*>(packed);
    std::vector<uint8_t> key(p, p + packed_bytes);
    ucp_rkey_buffer_release(packed);
    staging_->add_region(id, {static_cast<uint8_t*>(attr.address), bytes, false, -1});
    std::lock_guard lock(mutex_);
    memhs_[id] = memh;
    return std::make_pair(attr.address, std::move(key));
  }

  void deregister(RegionId id) override {
    staging_->remove_region(id);  // returns once no peer's chunk is being copied into it
    std::lock_guard lock(mutex_);
    auto it = memhs_.find(id);
    if (it == memhs_.end()) return;
    ucp_mem_unmap(context_, it->second);
    memhs_.erase(it);
  }

  Status connect(const EngineDesc& peer) override {
    auto endpoint = peer.endpoints.find("ucx");
    if (endpoint == peer.endpoints.end()) return Status::Ok();  // peer without ucx: no sessions over it
    if (Status checked = check_peer_address(endpoint->second); !checked.ok()) {
      refused_blobs("ucx_address").inc();
      return checked.with_context(fmt::format("ucx endpoint of '{}'", peer.name));
    }
    const std::vector<uint8_t> address = padded_copy(endpoint->second);
    auto record = std::make_shared<UcxPeer>();
    record->name = peer.name;
    record->boot_nonce = peer.boot_nonce;
    ucp_ep_params_t params = {};
    params.field_mask =
        UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address = reinterpret_cast<const ucp_address_t*>(address.data());
    const bool same_host_shm = shm_allowed_ && peer.host_id == host_id_;
    params.err_mode = same_host_shm ? UCP_ERR_HANDLING_MODE_NONE : UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = &UcxBackend::on_ep_error;
    params.err_handler.arg = record.get();
    if (ucs_status_t s = ucp_ep_create(worker_, &params, &record->ep); s != UCS_OK) {
      return unavailable("ucp_ep_create to '{}': {}", peer.name, ucs_status_string(s));
    }
    std::shared_ptr<UcxPeer> old;
    {
      std::lock_guard lock(mutex_);
      auto [it, inserted] = peers_.try_emplace(peer.name, record);
      if (!inserted) {
        old = it->second;
        it->second = record;
      }
      all_peers_.push_back(record);
    }
    if (old) old->failed.store(true);  // routes to the old boot see it as gone
    return Status::Ok();
  }

  std::string route_transports(const Route& route) const override {
    return endpoint_transports(static_cast<const UcxRoute&>(route).peer_->ep);
  }

  Result<std::shared_ptr<Route>> open_route(const LocalRegion& local, const MemDesc& remote) override {
    std::shared_ptr<UcxPeer> peer;
    {
      std::lock_guard lock(mutex_);
      auto it = peers_.find(remote.engine_name);
      if (it == peers_.end() || it->second->boot_nonce != remote.boot_nonce) {
        return failed_precondition("no UCX endpoint to '{}' boot {}", remote.engine_name, remote.boot_nonce);
      }
      peer = it->second;
    }
    auto key = remote.keys.find("ucx");
    if (key == remote.keys.end()) return failed_precondition("remote region {} has no ucx key", remote.region_id);
    const bool remote_staged =
        remote.kind == MemKind::kCuda &&
        std::equal(key->second.begin(), key->second.end(), std::begin(kStagedKey), std::end(kStagedKey));
    const bool local_staged = local.kind == MemKind::kCuda && !ucx_handles_cuda_;
    if (remote_staged || local_staged) {
      // On a staged route our GPU memory is always copied by the device copier, even
      // when our UCX could map it (the peer's cannot).
      const bool local_device = local.kind == MemKind::kCuda;
      if (local_device && !staging_->has_device_copier()) {
        return failed_precondition("ucx: local GPU region {} on a staged route but no device copier", local.id);
      }
      StagedMemory mine{static_cast<uint8_t*>(local.ptr), local.bytes, local_device, local.device};
      return std::shared_ptr<Route>(std::make_shared<UcxRoute>(peer, mine, remote.region_id));
    }
    if (Status checked = check_ucx_rkey(key->second, posix_md_index_); !checked.ok()) {
      refused_blobs("ucx_rkey").inc();
      return checked.with_context(fmt::format("remote region {} of '{}'", remote.region_id, remote.engine_name));
    }
    const std::vector<uint8_t> packed_key = padded_copy(key->second);
    ucp_rkey_h rkey = nullptr;
    if (ucs_status_t s = ucp_ep_rkey_unpack(peer->ep, packed_key.data(), &rkey); s != UCS_OK) {
      return invalid_argument("remote region {} of '{}': bad ucx key: {}", remote.region_id, remote.engine_name,
                              ucs_status_string(s));
    }
    return std::shared_ptr<Route>(
        std::make_shared<UcxRoute>(peer, rkey, static_cast<uint8_t*>(local.ptr), remote.base));
  }

  Result<std::unique_ptr<BackendBatch>> post(const std::shared_ptr<Route>& route_base, Direction direction,
                                             std::span<const Op> ops, SteadyClock::time_point deadline) override {
    auto& route = static_cast<UcxRoute&>(*route_base);
    if (route.peer_->failed.load()) {
      return unavailable("UCX endpoint to '{}' has failed", route.peer_->name);
    }
    if (route.staged_) {
      std::shared_ptr<UcxCompletion> completion =
          staging_->post(route.peer_, direction, route.staged_local_, route.remote_region_, ops, deadline);
      return std::unique_ptr<BackendBatch>(std::make_unique<UcxBatch>(completion, route_base));
    }
    ucp_request_param_t op_param = {};  // no callback: completion is observed by the flush below
    ucs_status_t first_error = UCS_OK;
    for (const Op& op : ops) {
      ucs_status_ptr_t r;
      if (direction == Direction::kWrite) {
        r = ucp_put_nbx(route.peer_->ep, route.local_ + op.local_offset, op.bytes,
                        route.remote_base_ + op.remote_offset, route.rkey_, &op_param);
      } else {
        r = ucp_get_nbx(route.peer_->ep, route.local_ + op.local_offset, op.bytes,
                        route.remote_base_ + op.remote_offset, route.rkey_, &op_param);
      }
      if (UCS_PTR_IS_ERR(r)) {
        first_error = UCS_PTR_STATUS(r);
        break;
      }
      if (r != nullptr) ucp_request_free(r);  // completes on its own; the flush tracks it
    }
    // Always flush, even after an error, so that nothing this batch posted is in flight
    // once the batch reports a final status.
    auto completion = std::make_shared<UcxCompletion>();
    auto* holder = new FlushContext{completion, this};
    ucp_request_param_t flush_param = {};
    flush_param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    flush_param.cb.send = &UcxBackend::on_flush;
    flush_param.user_data = holder;
    num_inflight_.fetch_add(1);
    ucs_status_ptr_t f = ucp_ep_flush_nbx(route.peer_->ep, &flush_param);
    if (!UCS_PTR_IS_PTR(f)) {
      // Completed (or failed) immediately; the callback will not run.
      num_inflight_.fetch_sub(1);
      delete holder;
      ucs_status_t s = UCS_PTR_STATUS(f);
      completion->finish(first_error != UCS_OK ? first_error : s);
    } else {
      if (first_error != UCS_OK) {
        std::lock_guard lock(completion->mutex);
        completion->message = fmt::format("UCX post failed: {}", ucs_status_string(first_error));
      }
      ucp_worker_signal(worker_);  // the progress thread may be asleep in epoll
    }
    return std::unique_ptr<BackendBatch>(std::make_unique<UcxBatch>(completion, route_base));
  }

 private:
  Status check_peer_address(const std::vector<uint8_t>& blob) const {
    if (address_profile_) return check_ucx_worker_address(blob, *address_profile_);
    return check_ucx_worker_address_header(blob, address_version_);
  }

  static void on_flush(void* request, ucs_status_t status, void* user_data) {
    auto* holder = static_cast<FlushContext*>(user_data);
    std::shared_ptr<UcxCompletion> completion = std::move(holder->completion);
    UcxBackend* backend = holder->backend;
    delete holder;
    bool had_post_error;
    {
      std::lock_guard lock(completion->mutex);
      had_post_error = !completion->message.empty();
    }
    if (had_post_error) {
      completion->status.store(2, std::memory_order_release);
      completion->cv.notify_all();
    } else {
      completion->finish(status);
    }
    ucp_request_free(request);
    backend->num_inflight_.fetch_sub(1);
  }

  static void on_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* peer = static_cast<UcxPeer*>(arg);
    PD_LOG_WARN("xfer ucx: endpoint to '{}' failed: {}", peer->name, ucs_status_string(status));
    peer->failed.store(true);
  }

  void progress_loop() {
    while (!stop_.load(std::memory_order_acquire)) {
      const bool progressed = ucp_worker_progress(worker_) != 0;
      const bool staging_busy = staging_->progress();
      if (progressed) continue;
      if (busy_poll_ || staging_busy || num_inflight_.load(std::memory_order_acquire) > 0) continue;  // spin
      ucs_status_t s = ucp_worker_arm(worker_);
      if (s == UCS_ERR_BUSY) continue;
      epoll_event ev;
      // Bounded so that stop_ is seen even if no event ever arrives.
      epoll_wait(epoll_fd_, &ev, 1, 100);
    }
  }

  void close_endpoint(UcxPeer& peer) {
    if (peer.ep == nullptr) return;
    ucp_request_param_t param = {};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(peer.ep, &param);
    if (UCS_PTR_IS_PTR(r)) {
      Deadline deadline = Deadline::after_ms(kCloseTimeoutMs);
      while (ucp_request_check_status(r) == UCS_INPROGRESS && !deadline.expired()) ucp_worker_progress(worker_);
      ucp_request_free(r);
    }
    peer.ep = nullptr;
  }

  void shutdown() {
    if (progress_thread_.joinable()) {
      stop_.store(true, std::memory_order_release);
      ucp_worker_signal(worker_);
      progress_thread_.join();
    }
    // Force-closing cancels whatever is in flight; the flush and staging callbacks run here.
    for (auto& peer : all_peers_) close_endpoint(*peer);
    Deadline deadline = Deadline::after_ms(kCloseTimeoutMs);
    if (staging_) staging_->shutdown(deadline);
    while (num_inflight_.load() > 0 && !deadline.expired() && worker_ != nullptr) ucp_worker_progress(worker_);
    for (auto& [id, memh] : memhs_) ucp_mem_unmap(context_, memh);
    memhs_.clear();
    if (epoll_fd_ >= 0) close(epoll_fd_);
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    staging_.reset();  // its buffers, after the worker that could still reference them
    if (context_ != nullptr) ucp_cleanup(context_);
    worker_ = nullptr;
    context_ = nullptr;
  }

  std::string host_id_;
  bool shm_allowed_ = true;
  bool ucx_handles_cuda_ = false;  // the UCX build has CUDA transports: GPU regions by RMA
  std::unique_ptr<UcxStaging> staging_;
  bool busy_poll_ = false;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  std::vector<uint8_t> address_;
  int posix_md_index_ = -1;                           // this context's posix md (ucx_wire_check.h, check_ucx_rkey)
  std::optional<UcxAddressProfile> address_profile_;  // our own address's format, when the walker follows it
  uint8_t address_version_ = 0;                       // else: its version
  int epoll_fd_ = -1;
  std::thread progress_thread_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> num_inflight_{0};

  std::mutex mutex_;  // guards the maps below
  std::map<RegionId, ucp_mem_h> memhs_;
  std::map<std::string, std::shared_ptr<UcxPeer>> peers_;
  // Every endpoint ever created (old boots too); closed at shutdown.
  std::vector<std::shared_ptr<UcxPeer>> all_peers_;
};

}  // namespace

Result<std::unique_ptr<Backend>> make_ucx_backend(const EngineConfig& config, const std::string& host_id) {
  auto backend = std::make_unique<UcxBackend>(host_id);
  PD_RETURN_IF_ERROR(backend->init(config));
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace pd::xfer
