// The CUDA ModelRunner of an instance: tensor_parallel_size ranks on as many
// GPUs of one host (devices options.device .. options.device + N - 1), one
// CudaModelRunner per rank, one thread per rank (a RankPool: rank 0 on the
// engine thread), collectives through an NcclGroup. Every rank runs the same
// step plan; each holds its slices of the weights and of every KV block
// (model::plan_tensor_parallel), and rank 0 computes the logits and samples.
// At tensor_parallel_size 1 there is one rank, no NCCL and no extra thread: the
// step is the single-GPU runner's step.
//
// Failure: a rank that fails a step marks the group failed; its peers stop
// waiting for the step (CudaTpRank::group_failed), the communicators are
// aborted, and every later step fails with FAILED_PRECONDITION naming the first
// error (the ranks' collectives can no longer be matched). Steps refused by
// validation fail before any rank starts and leave the group usable.
#pragma once

#include <atomic>
#include <memory>
#include <vector>

#include "engine/model_runner.h"
#include "engine/runner/rank_pool.h"
#include "engine/runner_cuda/cuda_model_runner.h"
#include "engine/runner_cuda/nccl_comm.h"

namespace pd::engine {

class CudaTpRunner final : public ModelRunner {
 public:
  // Refuses a split the model cannot take (plan_tensor_parallel), fewer visible GPUs
  // than options.device + tensor_parallel_size, and (N > 1) a missing NCCL library.
  static Result<std::unique_ptr<CudaTpRunner>> create(model::ModelConfig config,
                                                      const model::ModelWeights* host_weights,
                                                      CudaRunnerOptions options, int32_t tensor_parallel_size);
  ~CudaTpRunner() override;

  // The instance's pool: every rank holds kv_heads_per_rank heads of each block
  // (num_kv_heads counts the ranks' shards, replicas included).
  const KvCacheSpec& kv_cache_spec() const override { return spec_; }
  int32_t vocab_size() const override { return ranks_[0]->vocab_size(); }
  Result<StepOutput> execute(const StepInput& input) override;
  // Rank 0's region at tensor_parallel_size 1; null with more ranks (P/D transfer of
  // sharded KV is not supported on cuda).
  void* kv_layer_base(int32_t layer) override;
  bool kv_on_device() const override { return true; }
  int32_t kv_device_index() const override { return ranks_[0]->kv_device_index(); }

  int32_t tensor_parallel_size() const { return static_cast<int32_t>(ranks_.size()); }
  CudaModelRunner& rank(int32_t r) { return *ranks_[static_cast<size_t>(r)]; }

 private:
  CudaTpRunner() = default;
  // Runs fn(rank) on every rank's thread; the first failing rank's status (a peer's
  // ABORTED / DEADLINE_EXCEEDED only when no rank has a root cause).
  Status run_ranks(const std::function<Status(int32_t)>& fn);

  std::unique_ptr<NcclGroup> comms_;  // null at tensor_parallel_size 1
  std::unique_ptr<RankPool> pool_;
  std::vector<std::unique_ptr<CudaModelRunner>> ranks_;
  std::atomic<bool> group_failed_{false};
  Status broken_ = Status::Ok();  // set once a rank failed mid-step (tensor_parallel_size > 1)
  KvCacheSpec spec_;
};

}  // namespace pd::engine
