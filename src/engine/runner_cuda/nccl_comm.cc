#include "engine/runner_cuda/nccl_comm.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string_view>

#include "common/log.h"

#if !defined(NCCL_VERSION_CODE) || NCCL_VERSION_CODE < 21000
#error "nccl.h 2.10 or newer is needed (ncclBfloat16, collectives inside CUDA graphs)"
#endif

namespace pd::engine {

// The symbols the runner uses, typed from nccl.h's declarations (ncclGetLastError, 2.13+,
// by hand: it is optional at run time and may be missing from an older header).
struct NcclApi {
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclGetErrorString) get_error_string = nullptr;
  const char* (*get_last_error)(ncclComm_t) = nullptr;  // optional (2.13+)
  decltype(&ncclCommInitAll) comm_init_all = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclCommAbort) comm_abort = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
};

namespace {

constexpr int kMinNcclVersion = 21000;  // 2.10: collectives inside CUDA graphs, ncclCommAbort

struct LoadedNccl {
  NcclApi api;
  Status status = Status::Ok();
  std::string version;
};

template <typename Fn>
bool resolve(void* handle, const char* name, Fn* out) {
  *out = reinterpret_cast<Fn>(dlsym(handle, name));
  return *out != nullptr;
}

LoadedNccl load_nccl() {
  LoadedNccl loaded;
  const char* override_path = std::getenv("PDSERVE_NCCL_LIBRARY");
  const std::string path =
      override_path != nullptr && !std::string_view(override_path).empty() ? override_path : "libnccl.so.2";
  // Never closed: communicators may live until process exit.
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    loaded.status = failed_precondition(
        "tensor parallelism on cuda needs NCCL: dlopen('{}') failed: {}. Put the directory holding libnccl.so.2 "
        "(the CUDA toolkit's lib64, or PyTorch's site-packages/nvidia/nccl/lib) on LD_LIBRARY_PATH, or name the "
        "file in PDSERVE_NCCL_LIBRARY",
        path, why != nullptr ? why : "unknown error");
    return loaded;
  }
  NcclApi& a = loaded.api;
  const char* missing = nullptr;
  if (!resolve(handle, "ncclGetVersion", &a.get_version)) missing = "ncclGetVersion";
  if (!missing && !resolve(handle, "ncclGetErrorString", &a.get_error_string)) missing = "ncclGetErrorString";
  if (!missing && !resolve(handle, "ncclCommInitAll", &a.comm_init_all)) missing = "ncclCommInitAll";
  if (!missing && !resolve(handle, "ncclCommDestroy", &a.comm_destroy)) missing = "ncclCommDestroy";
  if (!missing && !resolve(handle, "ncclCommAbort", &a.comm_abort)) missing = "ncclCommAbort";
  if (!missing && !resolve(handle, "ncclAllReduce", &a.all_reduce)) missing = "ncclAllReduce";
  if (!missing && !resolve(handle, "ncclAllGather", &a.all_gather)) missing = "ncclAllGather";
  if (missing != nullptr) {
    loaded.status = failed_precondition("{} has no symbol {}: not a usable NCCL library", path, missing);
    return loaded;
  }
  resolve(handle, "ncclGetLastError", &a.get_last_error);
  int version = 0;
  if (a.get_version(&version) != ncclSuccess) {
    loaded.status = failed_precondition("{}: ncclGetVersion failed", path);
    return loaded;
  }
  // Codes since 2.9: major * 10000 + minor * 100 + patch.
  loaded.version =
      std::to_string(version / 10000) + "." + std::to_string(version / 100 % 100) + "." + std::to_string(version % 100);
  if (version < kMinNcclVersion) {
    loaded.status =
        failed_precondition("{} is NCCL {}; tensor parallelism on cuda needs 2.10 or newer", path, loaded.version);
  }
  return loaded;
}

const LoadedNccl& nccl() {
  static const LoadedNccl loaded = load_nccl();
  return loaded;
}

}  // namespace

Result<std::unique_ptr<NcclGroup>> NcclGroup::create(const std::vector<int32_t>& devices) {
  if (devices.empty()) return invalid_argument("nccl: a group needs at least one device");
  const LoadedNccl& lib = nccl();
  PD_RETURN_IF_ERROR(lib.status);
  std::unique_ptr<NcclGroup> group(new NcclGroup());
  group->api_ = &lib.api;
  group->version_ = lib.version;
  group->comms_.assign(devices.size(), nullptr);
  const std::vector<int> devlist(devices.begin(), devices.end());
  const ncclResult_t r = lib.api.comm_init_all(group->comms_.data(), static_cast<int>(devlist.size()), devlist.data());
  if (r != ncclSuccess) {
    group->comms_.clear();  // nothing to destroy
    const char* detail = lib.api.get_last_error != nullptr ? lib.api.get_last_error(nullptr) : nullptr;
    return internal_error("nccl: ncclCommInitAll over {} devices failed: {}{}{}", devlist.size(),
                          lib.api.get_error_string(r), detail != nullptr && detail[0] != '\0' ? ": " : "",
                          detail != nullptr ? detail : "");
  }
  PD_LOG_INFO("nccl {}: {} ranks", lib.version, devlist.size());
  return group;
}

NcclGroup::~NcclGroup() {
  if (aborted_) return;
  for (ncclComm_t c : comms_)
    if (c != nullptr) api_->comm_destroy(c);
}

Status NcclGroup::check(ncclResult_t result, int32_t rank, const char* what) const {
  if (result == ncclSuccess) return Status::Ok();
  const char* detail = api_->get_last_error != nullptr ? api_->get_last_error(comms_[static_cast<size_t>(rank)]) : "";
  return internal_error("nccl {} on rank {}: {}{}{}", what, rank, api_->get_error_string(result),
                        detail != nullptr && detail[0] != '\0' ? ": " : "", detail != nullptr ? detail : "");
}

Status NcclGroup::all_reduce_bf16(int32_t rank, void* data, size_t count, cudaStream_t stream) {
  if (rank < 0 || rank >= size() || aborted_)
    return failed_precondition("nccl all_reduce: rank {} of {}", rank, size());
  return check(api_->all_reduce(data, data, count, ncclBfloat16, ncclSum, comms_[static_cast<size_t>(rank)], stream),
               rank, "all_reduce");
}

Status NcclGroup::all_gather(int32_t rank, const void* send, void* recv, size_t count, ncclDataType_t type,
                             cudaStream_t stream) {
  if (rank < 0 || rank >= size() || aborted_)
    return failed_precondition("nccl all_gather: rank {} of {}", rank, size());
  return check(api_->all_gather(send, recv, count, type, comms_[static_cast<size_t>(rank)], stream), rank,
               "all_gather");
}

void NcclGroup::abort() {
  if (aborted_) return;
  aborted_ = true;
  for (ncclComm_t c : comms_)
    if (c != nullptr) api_->comm_abort(c);
}

}  // namespace pd::engine
