// State shared by the ucx backend (ucx_backend.cc) and its staging protocol
// (ucx_staging.cc). Internal to pd_xfer.
#pragma once

#include <ucp/api/ucp.h>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>

#include "common/clock.h"
#include "xfer/backend.h"

namespace pd::xfer {

// Completion of one batch: set once (flush callback, or the staging protocol when the
// batch's last chunk is retired), read by any thread.
struct UcxCompletion {
  std::mutex mutex;
  std::condition_variable cv;
  std::atomic<int> status{0};  // 0 pending, 1 done, 2 failed
  std::string message;

  void finish(ucs_status_t ucs) {
    {
      std::lock_guard lock(mutex);
      if (ucs != UCS_OK) message = "UCX flush failed: " + std::string(ucs_status_string(ucs));
      status.store(ucs == UCS_OK ? 1 : 2, std::memory_order_release);
    }
    cv.notify_all();
  }
  void fail(std::string why) {
    {
      std::lock_guard lock(mutex);
      message = std::move(why);
      status.store(2, std::memory_order_release);
    }
    cv.notify_all();
  }
};

// An endpoint to one boot of one peer. Failed when UCX reports the peer gone.
struct UcxPeer {
  std::string name;
  uint64_t boot_nonce = 0;
  ucp_ep_h ep = nullptr;
  std::atomic<bool> failed{false};
};

class UcxBatch : public BackendBatch {
 public:
  UcxBatch(std::shared_ptr<UcxCompletion> completion, std::shared_ptr<Route> route)
      : completion_(std::move(completion)), route_(std::move(route)) {}
  TransferState test() override {
    int s = completion_->status.load(std::memory_order_acquire);
    if (s == 0) return {};
    if (s == 1) return {TransferStatus::kDone, {}};
    std::lock_guard lock(completion_->mutex);
    return {TransferStatus::kFailed, completion_->message};
  }
  void wait_until(SteadyClock::time_point until) override {
    std::unique_lock lock(completion_->mutex);
    completion_->cv.wait_until(lock, until, [&] { return completion_->status.load() != 0; });
  }

 private:
  std::shared_ptr<UcxCompletion> completion_;
  std::shared_ptr<Route> route_;  // keeps the rkey / endpoint alive while the batch is in flight
};

}  // namespace pd::xfer
