// Value types of the transfer engine: configuration, descriptors, ops, batch
// status. Descriptors cross process boundaries (msgpack, versioned, validated
// on decode); everything else stays in-process.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"

namespace pd::xfer {

// Wire version of EngineDesc / MemDesc. A decoder refuses any other version.
inline constexpr uint32_t kDescriptorVersion = 1;

struct EngineConfig {
  // TransferEngine id among peers; a restarted process reuses its name with a new boot nonce.
  std::string name;
  // Address whose network interface UCX may use (UCX_NET_DEVICES is derived from it).
  std::string listen_host = "127.0.0.1";
  // How long engine creation waits for that interface to be running (carrier up: a veth
  // end just brought up reports none for a while); past it creation fails.
  int64_t interface_up_timeout_ms = 5'000;
  // Backends to enable, in preference order for "auto" among the usable ones.
  std::vector<std::string> backends = {"ucx", "cuda"};
  // A batch not complete this long after posting fails (the DESIGN's transfer_timeout).
  int64_t batch_timeout_ms = 30'000;
  // UCX_TLS for this engine's UCX context; empty keeps UCX's own choice.
  std::string ucx_transports;
  // Progress thread never sleeps (lowest latency, one busy core per engine). Otherwise it
  // sleeps in epoll on the worker's wakeup fd whenever nothing is in flight.
  bool ucx_busy_poll = false;
  // GPU memory over ucx when the UCX build has no CUDA transports: "auto" stages it
  // through pinned host buffers when a GPU is visible; "off" refuses GPU regions;
  // "memcpy" (tests) treats kCuda regions as host memory standing in for a device and
  // stages them through the same protocol with memcpy as the device copy.
  std::string ucx_staging = "auto";
  // Staging chunk (one message and one staging buffer) and buffers per role (chunks of
  // our batches in flight / peers' chunks copied at once): 2 x slots x chunk bytes of
  // host memory, allocated on first use.
  uint64_t ucx_staging_chunk_bytes = 4ull << 20;
  uint32_t ucx_staging_slots = 8;
  // cuda backend: "kernel" (gather/scatter kernel launches), "copy_engine" (one
  // cudaMemcpyAsync per merged op) or "copy_batch" (cudaMemcpyBatchAsync per launch
  // group; needs CUDA 12.8+, refused otherwise).
  std::string cuda_copy_mode = "kernel";
  // cuda backend: post a batch as it is validated, in the caller's order (consecutive
  // contiguous ops merged, no sort; a batch of > 1,000 ops starts with a launch of 128 so
  // the GPU starts at once). false: sort and merge the whole batch first, then post.
  bool cuda_post_pipeline = true;
  // cuda backend: streams per local device; batches (and the launches of a large batch)
  // take them in turn, so one launch's tail overlaps the next one's start. 1..16.
  uint32_t cuda_num_streams = 4;
  // Copy-kernel shape: bytes per work item, CTAs per SM, threads per CTA.
  uint32_t cuda_chunk_bytes = 64 * 1024;
  uint32_t cuda_ctas_per_sm = 4;
  uint32_t cuda_threads_per_cta = 512;
  // Batches of more ops than fit in launch parameters (1,000): several launch-parameter
  // launches (true) or one launch after uploading the table (false).
  bool cuda_split_large_batches = true;
  // Wrap every enabled backend in the fault backend (tests only).
  bool enable_fault_injection = false;
};

enum class MemKind : uint8_t { kHost = 0, kCuda = 1 };
const char* mem_kind_name(MemKind kind);

// What a peer needs to reach this engine. Serializable.
struct EngineDesc {
  std::string name;
  uint64_t boot_nonce = 0;
  // Hostname + kernel boot id: equal ids mean one host (same-host paths such as CUDA IPC).
  std::string host_id;
  // Backend name -> endpoint blob (ucx: the worker address).
  std::map<std::string, std::vector<uint8_t>> endpoints;
  std::vector<std::string> gpu_uuids;
};

using RegionId = uint64_t;

// A registered region as a peer sees it. Serializable.
struct MemDesc {
  std::string engine_name;
  uint64_t boot_nonce = 0;
  RegionId region_id = 0;
  uint64_t base = 0;  // address in the owner's address space (informational for peers)
  uint64_t bytes = 0;
  MemKind kind = MemKind::kHost;
  int32_t device = -1;  // CUDA ordinal in the owner's process, -1 for host memory
  // Backend name -> remote key (ucx: packed rkey; cuda: IPC handle + offset in the allocation).
  std::map<std::string, std::vector<uint8_t>> keys;
};

std::vector<uint8_t> encode(const EngineDesc& desc);
std::vector<uint8_t> encode(const MemDesc& desc);
// Garbage, truncated, oversized or wrong-version input is rejected with kInvalidArgument.
Result<EngineDesc> decode_engine_desc(std::span<const uint8_t> bytes);
Result<MemDesc> decode_mem_desc(std::span<const uint8_t> bytes);

// One contiguous copy between the session's local and remote regions.
struct Op {
  uint64_t local_offset = 0;
  uint64_t remote_offset = 0;
  uint64_t bytes = 0;
  bool operator==(const Op&) const = default;
};

enum class Direction : uint8_t { kWrite, kRead };  // write: local -> remote; read: remote -> local

using XferId = uint64_t;

enum class TransferStatus : uint8_t { kPending, kDone, kFailed };
const char* transfer_status_name(TransferStatus status);

// Snapshot of one batch: its status and, when failed, why.
struct TransferState {
  TransferStatus status = TransferStatus::kPending;
  std::string message;
  bool pending() const { return status == TransferStatus::kPending; }
  bool done() const { return status == TransferStatus::kDone; }
  bool failed() const { return status == TransferStatus::kFailed; }
};

}  // namespace pd::xfer
