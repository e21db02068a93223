// A connection cap (--max-connections) that the process's open-file limit can honour.
//
// Every connection holds file descriptors. Once a process reaches RLIMIT_NOFILE, accept()
// fails with EMFILE for every client, health checks included, so a server caps its
// connections below that limit and answers the ones beyond the cap itself. At start-up
// the cap is checked against the limit: the soft limit is raised (up to the hard limit)
// when it is short, and a cap that still does not fit is refused when the operator asked
// for it, or lowered (with a warning) when it is the default.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "common/log_throttle.h"
#include "common/status.h"

namespace pd {

// RLIMIT_NOFILE. kUnlimited stands for RLIM_INFINITY.
struct OpenFileLimits {
  static constexpr uint64_t kUnlimited = UINT64_MAX;
  uint64_t soft = 0;
  uint64_t hard = 0;
};

// What one connection costs, and what the process needs besides its connections.
struct ConnectionFdBudget {
  int64_t fds_per_connection = 1;
  int64_t reserved_fds = 0;  // listeners, epoll, logs, model files, device handles, answers to refused clients
};

struct ConnectionLimitPlan {
  int64_t max_connections = 0;
  uint64_t soft_limit = 0;   // the RLIMIT_NOFILE soft value to run with; raised when it was short
  std::string lowered_note;  // set when a default cap was lowered to fit: say so in the log
};

// Far above any RLIMIT_NOFILE (Linux's fs.nr_open defaults to 1 << 20); bounds the arithmetic.
inline constexpr int64_t kMaxConnectionsCeiling = int64_t{1} << 24;

// Pure: decides the cap and the soft limit; touches nothing. `flag` names the cap in messages.
Result<ConnectionLimitPlan> plan_connection_limit(std::string_view flag, int64_t requested, bool requested_explicitly,
                                                  const ConnectionFdBudget& budget, const OpenFileLimits& limits);

// Reads RLIMIT_NOFILE, plans, raises the soft limit when the plan says so and logs what it
// changed. Returns the cap to enforce.
Result<int64_t> fit_connection_limit_to_open_files(std::string_view flag, int64_t requested, bool requested_explicitly,
                                                   const ConnectionFdBudget& budget);

// One of the capped connection slots, held for the life of a connection (or of the answer
// to a refused one). Moves with the coroutine that serves the connection, so the slot is
// released exactly once, however the coroutine ends (even destroyed unstarted at shutdown).
// The counter must outlive every slot.
class ConnectionSlot {
 public:
  explicit ConnectionSlot(std::atomic<int64_t>& num_held) : num_held_(&num_held) {
    num_held_->fetch_add(1, std::memory_order_relaxed);
  }
  ConnectionSlot(ConnectionSlot&& other) noexcept : num_held_(std::exchange(other.num_held_, nullptr)) {}
  ConnectionSlot& operator=(ConnectionSlot&&) = delete;
  ConnectionSlot(const ConnectionSlot&) = delete;
  ConnectionSlot& operator=(const ConnectionSlot&) = delete;
  ~ConnectionSlot() {
    if (num_held_ != nullptr) num_held_->fetch_sub(1, std::memory_order_relaxed);
  }

 private:
  std::atomic<int64_t>* num_held_;
};

// The accept loop's decision for each new connection under --max-connections, shared by
// pdserve and pdrouter: serve it (a connection slot), answer it 503 (a refusal slot: the
// answer costs a descriptor for a moment), or, when kMaxRefusalsInFlight answers are already
// being written, close it at once (a flood must not cost the descriptors the cap saves).
// admit() is called by the accept loop only, so the count cannot pass the cap between check
// and add; slots are released on any thread. The gate must outlive every slot it handed out.
class ConnectionGate {
 public:
  static constexpr int64_t kMaxRefusalsInFlight = 64;
  enum class Verdict : uint8_t { kServe, kRefuse, kDrop };
  struct Admission {
    Verdict verdict = Verdict::kDrop;
    std::optional<ConnectionSlot> slot;  // kServe: a connection slot; kRefuse: a refusal slot
    bool log_now = false;                // kRefuse / kDrop: the one refusal per second worth a log line
    int64_t num_held_back = 0;           // with log_now: refusals not logged since the last line
  };

  explicit ConnectionGate(int64_t max_connections) : max_connections_(max_connections) {}

  Admission admit(int64_t now_ns) {
    Admission admission;
    if (num_connections_.load(std::memory_order_relaxed) < max_connections_) {
      admission.verdict = Verdict::kServe;
      admission.slot.emplace(num_connections_);
      return admission;
    }
    admission.log_now = refusal_log_.admit(now_ns);
    admission.num_held_back = refusal_log_.num_held_back();
    if (num_refusals_in_flight_.load(std::memory_order_relaxed) >= kMaxRefusalsInFlight) return admission;
    admission.verdict = Verdict::kRefuse;
    admission.slot.emplace(num_refusals_in_flight_);
    return admission;
  }

  int64_t max_connections() const { return max_connections_; }
  int64_t num_connections() const { return num_connections_.load(std::memory_order_relaxed); }

 private:
  const int64_t max_connections_;
  std::atomic<int64_t> num_connections_{0};
  std::atomic<int64_t> num_refusals_in_flight_{0};
  LogThrottle refusal_log_{1'000'000'000};
};

}  // namespace pd
