#include "engine/runner_cuda/cuda_tp_runner.h"

#include <algorithm>

#include "common/log.h"
#include "kernels/cuda/kernels.h"

namespace pd::engine {

Result<std::unique_ptr<CudaTpRunner>> CudaTpRunner::create(model::ModelConfig config,
                                                           const model::ModelWeights* host_weights,
                                                           CudaRunnerOptions options, int32_t tensor_parallel_size) {
  PD_RETURN_IF_ERROR(config.validate());
  PD_ASSIGN_OR_RETURN(const model::TpSplit split, model::plan_tensor_parallel(config, tensor_parallel_size));
  const int32_t tp = split.tp_size;
  int visible = 0;
  PD_RETURN_IF_ERROR(kernels::cuda::cuda_status(cudaGetDeviceCount(&visible), "cudaGetDeviceCount"));
  if (options.device < 0 || options.device + tp > visible) {
    return failed_precondition(
        "tensor_parallel_size {} from cuda device {} needs devices {}..{}, but {} GPU(s) are visible", tp,
        options.device, options.device, options.device + tp - 1, visible);
  }
  std::unique_ptr<CudaTpRunner> r(new CudaTpRunner());
  std::vector<int32_t> devices;
  for (int32_t i = 0; i < tp; ++i) devices.push_back(options.device + i);
  if (tp > 1) {
    PD_ASSIGN_OR_RETURN(r->comms_, NcclGroup::create(devices));
  }
  r->pool_ = std::make_unique<RankPool>(tp);
  r->ranks_.resize(static_cast<size_t>(tp));
  // Each rank builds its weights and buffers on its own thread and device.
  PD_RETURN_IF_ERROR(r->run_ranks([&](int32_t rank) -> Status {
    CudaRunnerOptions rank_options = options;
    rank_options.device = devices[static_cast<size_t>(rank)];
    CudaTpRank tp_rank;
    tp_rank.rank = rank;
    tp_rank.tp_size = tp;
    tp_rank.comms = r->comms_.get();
    tp_rank.group_failed = &r->group_failed_;
    PD_ASSIGN_OR_RETURN(r->ranks_[static_cast<size_t>(rank)],
                        CudaModelRunner::create_unprepared(config, host_weights, rank_options, tp_rank));
    return Status::Ok();
  }));
  // One block id names the same block on every rank: every pool takes the smallest rank's count.
  // Each rank fits on its own thread (its device current: fitting allocates on it).
  std::vector<int64_t> fitted(r->ranks_.size(), 0);
  PD_RETURN_IF_ERROR(r->run_ranks([&](int32_t rank) -> Status {
    PD_ASSIGN_OR_RETURN(fitted[static_cast<size_t>(rank)], r->ranks_[static_cast<size_t>(rank)]->fit_kv_blocks());
    return Status::Ok();
  }));
  const int64_t blocks = *std::min_element(fitted.begin(), fitted.end());
  // Together: preparing the decode buckets runs forward passes, whose collectives need every rank.
  PD_RETURN_IF_ERROR(
      r->run_ranks([&](int32_t rank) { return r->ranks_[static_cast<size_t>(rank)]->finish_init(blocks); }));
  r->spec_ = r->ranks_[0]->kv_cache_spec();
  r->spec_.num_kv_heads = split.kv_heads_per_rank * tp;
  if (tp > 1) {
    PD_LOG_INFO("cuda runner: tensor_parallel_size {} on devices {}..{} (nccl {}), {} KV blocks per rank", tp,
                devices.front(), devices.back(), r->comms_->version(), blocks);
  }
  return r;
}

CudaTpRunner::~CudaTpRunner() {
  // Each rank releases its device memory, graphs and streams on its own thread (its device current).
  if (pool_ != nullptr) {
    pool_->run([&](int32_t rank) {
      if (static_cast<size_t>(rank) < ranks_.size() && ranks_[static_cast<size_t>(rank)] != nullptr) {
        cudaSetDevice(ranks_[static_cast<size_t>(rank)]->kv_device_index());
        ranks_[static_cast<size_t>(rank)].reset();
      }
    });
  }
  comms_.reset();
}

Status CudaTpRunner::run_ranks(const std::function<Status(int32_t)>& fn) {
  std::vector<Status> status(ranks_.size(), Status::Ok());
  pool_->run([&](int32_t rank) {
    status[static_cast<size_t>(rank)] = fn(rank);
    if (!status[static_cast<size_t>(rank)].ok()) group_failed_.store(true, std::memory_order_release);
  });
  const Status* root = nullptr;
  const Status* any = nullptr;
  for (size_t i = 0; i < status.size(); ++i) {
    if (status[i].ok()) continue;
    if (any == nullptr) any = &status[i];
    const ErrorCode code = status[i].code();
    if (root == nullptr && code != ErrorCode::kAborted && code != ErrorCode::kDeadlineExceeded) root = &status[i];
  }
  if (any == nullptr) return Status::Ok();
  const Status& first = root != nullptr ? *root : *any;
  if (comms_ != nullptr) {
    // The peers of a failed rank may have collectives in flight that can never be matched.
    comms_->abort();
    broken_ = first;
  }
  return first;
}

Result<StepOutput> CudaTpRunner::execute(const StepInput& input) {
  if (!broken_.ok()) {
    return failed_precondition("cuda runner: the tensor-parallel group stopped after a rank failed: {}",
                               broken_.message());
  }
  if (ranks_.size() == 1) return ranks_[0]->execute(input);
  // Bad input fails here, before any rank starts a collective.
  if (input.layer_hooks != nullptr) {
    return failed_precondition("cuda runner: P/D layer hooks with tensor_parallel_size {} (sharded KV transfer)",
                               ranks_.size());
  }
  PD_RETURN_IF_ERROR(ranks_[0]->validate(input));
  StepOutput out;
  PD_RETURN_IF_ERROR(run_ranks([&](int32_t rank) -> Status {
    PD_ASSIGN_OR_RETURN(StepOutput rank_out, ranks_[static_cast<size_t>(rank)]->execute(input));
    if (rank == 0) out = std::move(rank_out);
    return Status::Ok();
  }));
  return out;
}

void* CudaTpRunner::kv_layer_base(int32_t layer) {
  if (ranks_.size() != 1) return nullptr;
  return ranks_[0]->kv_layer_base(layer);
}

}  // namespace pd::engine
