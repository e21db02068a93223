// Clocks and deadlines. Every wait in pdserve takes a Deadline (STYLE.md §5).
#pragma once

#include <chrono>
#include <cstdint>

namespace pd {

using SteadyClock = std::chrono::steady_clock;

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(SteadyClock::now().time_since_epoch()).count();
}
inline double now_seconds() { return static_cast<double>(now_ns()) * 1e-9; }

// Wall-clock seconds since the epoch (for OpenAI "created" fields).
inline int64_t unix_seconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

class Deadline {
 public:
  static Deadline after_ms(int64_t timeout_ms) { return Deadline(SteadyClock::now() + std::chrono::milliseconds(timeout_ms)); }
  static Deadline at(SteadyClock::time_point when) { return Deadline(when); }
  bool expired() const { return SteadyClock::now() >= when_; }
  SteadyClock::time_point when() const { return when_; }
  int64_t remaining_ms() const {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(when_ - SteadyClock::now()).count();
    return left > 0 ? left : 0;
  }

 private:
  explicit Deadline(SteadyClock::time_point when) : when_(when) {}
  SteadyClock::time_point when_;
};

}  // namespace pd
