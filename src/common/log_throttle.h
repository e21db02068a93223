// Keeps an event that can repeat many times a second (a refused connection, a failing
// accept()) from flooding the log: at most one line per interval, and that line can say
// how many events it stands for.
//
// One owner, no locks: each server uses it from its accept loop only.
#pragma once

#include <cstdint>

namespace pd {

class LogThrottle {
 public:
  explicit LogThrottle(int64_t interval_ns) : interval_ns_(interval_ns) {}

  // Records one event at now_ns. True when it may be logged now; num_held_back() then
  // says how many events since the previous logged one were not.
  bool admit(int64_t now_ns) {
    if (has_logged_ && now_ns - last_logged_ns_ < interval_ns_) {
      ++num_pending_;
      return false;
    }
    has_logged_ = true;
    last_logged_ns_ = now_ns;
    num_held_back_ = num_pending_;
    num_pending_ = 0;
    return true;
  }

  int64_t num_held_back() const { return num_held_back_; }

 private:
  int64_t interval_ns_;
  bool has_logged_ = false;
  int64_t last_logged_ns_ = 0;
  int64_t num_pending_ = 0;    // held back since the last logged event
  int64_t num_held_back_ = 0;  // held back before the last logged event
};

}  // namespace pd
