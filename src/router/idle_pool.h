// A pool of idle keep-alive connections to one backend, for one io thread.
// Pure: no I/O, time injected, so the rules are unit-tested directly.
//
// An engine closes a connection that stays idle for its keep-alive timeout
// (pdserve --keep-alive-timeout-ms, 60 s by default). A pooled connection that
// idled that long is dead on the engine's side, and a request sent on it fails
// before any response byte. So an entry idle for max_idle (the router's
// --backend-idle-timeout-ms, below the engine's keep-alive) is never handed out:
// it is dropped (closing it) by take() and by prune(). take() hands out the
// most recently used entry, so under a steady load the same few connections
// are reused and the rest age out: the pool holds about what the load uses,
// and never more than max_size.
#pragma once

#include <chrono>
#include <cstddef>
#include <deque>
#include <utility>

namespace pd::router {

template <typename Connection>
class IdlePool {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;

  IdlePool(size_t max_size, std::chrono::milliseconds max_idle) : max_size_(max_size), max_idle_(max_idle) {}
  IdlePool(const IdlePool&) = delete;
  IdlePool& operator=(const IdlePool&) = delete;
  IdlePool(IdlePool&&) = default;
  IdlePool& operator=(IdlePool&&) = default;

  // The freshest entry idle for less than max_idle, or an empty Connection. Older ones are dropped.
  Connection take(TimePoint now) {
    prune(now);
    if (entries_.empty()) return Connection();
    Connection connection = std::move(entries_.back().connection);
    entries_.pop_back();
    return connection;
  }

  // Returns a connection that just finished a response. Beyond max_size the oldest entry is dropped.
  void put(Connection connection, TimePoint now) {
    if (max_size_ == 0) return;
    if (entries_.size() >= max_size_) entries_.pop_front();
    entries_.push_back(Entry{std::move(connection), now});
  }

  // Drops every entry idle for max_idle or longer (the oldest are at the front).
  size_t prune(TimePoint now) {
    size_t num_dropped = 0;
    while (!entries_.empty() && now - entries_.front().idle_since >= max_idle_) {
      entries_.pop_front();
      ++num_dropped;
    }
    return num_dropped;
  }

  void clear() { entries_.clear(); }
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    Connection connection;
    TimePoint idle_since;
  };
  size_t max_size_;
  std::chrono::milliseconds max_idle_;
  std::deque<Entry> entries_;  // oldest first
};

}  // namespace pd::router
