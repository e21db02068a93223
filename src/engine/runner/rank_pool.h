// The tensor-parallel ranks of the CPU runner: a persistent pool of
// num_ranks - 1 threads plus the calling thread (rank 0). run(fn) executes
// fn(rank) on every rank and returns when all have finished (fork-join); no
// thread is created per step. The functions run compute only (no I/O, no
// waits of their own), so every run() finishes; the CUDA runner's ranks also
// wait for each other's collectives, each wait bounded (cuda_tp_runner.h). An exception thrown on any
// rank is rethrown by run() after every rank has finished (the first one
// caught), so fn is never used after run() returns.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace pd::engine {

class RankPool {
 public:
  explicit RankPool(int32_t num_ranks);
  ~RankPool();
  RankPool(const RankPool&) = delete;
  RankPool& operator=(const RankPool&) = delete;

  int32_t num_ranks() const { return num_ranks_; }
  // fn(0) on the calling thread, fn(1..num_ranks-1) on the pool's threads.
  // One caller at a time (the engine thread).
  void run(const std::function<void(int32_t)>& fn);

 private:
  void worker(int32_t rank);

  const int32_t num_ranks_;
  std::mutex mu_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  const std::function<void(int32_t)>* job_ = nullptr;  // guarded by mu_
  uint64_t generation_ = 0;                            // guarded by mu_; bumped per run()
  int32_t pending_ = 0;                                // guarded by mu_; workers still running this generation
  bool stop_ = false;                                  // guarded by mu_
  std::exception_ptr error_;                           // guarded by mu_; the first rank's exception this run
  std::vector<std::thread> threads_;
};

}  // namespace pd::engine
