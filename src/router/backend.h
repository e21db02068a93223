// A discovered instance as the request path uses it (Backend), the immutable
// set of them the control thread publishes (Snapshot), and one HTTP exchange
// with a backend (Leg) over a per-io-thread pool of keep-alive connections.
//
// Threads: a Backend is created by the control thread and then shared
// read-only, except `outstanding` (atomic) and `idle_[t]`, which only io
// thread t touches. A Leg lives on one io thread.
//
// The outstanding count is shared by every Backend made for one instance_id
// (Discovery hands the same counter to a replacement), so an instance that
// re-registers keeps counting the streams its previous record still runs.
#pragma once

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/metrics.h"
#include "common/status.h"
#include "router/asio.h"
#include "router/idle_pool.h"
#include "router/instance_info.h"

namespace pd::router {

class Backend {
 public:
  using Counter = std::atomic<int64_t>;
  // `authorization`: the Authorization header value every leg to this backend carries; empty for none.
  // `max_idle`: a pooled connection idle this long is closed, never reused (below the engine's keep-alive).
  // `outstanding`: the instance's count, shared with earlier Backends of the same instance_id.
  Backend(InstanceInfo info, tcp::endpoint endpoint, size_t num_io_threads, size_t max_idle_per_thread,
          std::chrono::milliseconds max_idle, std::string authorization, std::shared_ptr<Counter> outstanding);
  ~Backend();

  const InstanceInfo& info() const { return info_; }
  const tcp::endpoint& endpoint() const { return endpoint_; }
  const std::string& host_header() const { return host_header_; }
  const std::string& authorization() const { return authorization_; }
  int64_t outstanding() const { return outstanding_->load(std::memory_order_relaxed); }
  const std::shared_ptr<Counter>& outstanding_counter() const { return outstanding_; }
  void add_outstanding(int64_t delta);

  // Pool of idle keep-alive connections of io thread `thread_index`; only that thread calls these.
  // take_idle never returns a connection idle for max_idle or longer.
  std::unique_ptr<beast::tcp_stream> take_idle(size_t thread_index);
  void put_idle(size_t thread_index, std::unique_ptr<beast::tcp_stream> stream);
  // Closes the pooled connections of io thread `thread_index` idle for max_idle or longer.
  void prune_idle(size_t thread_index);
  // At shutdown, after the io threads stopped: pooled sockets must die before their io_contexts.
  void clear_idle();

 private:
  InstanceInfo info_;
  tcp::endpoint endpoint_;
  std::string host_header_;
  std::string authorization_;
  std::shared_ptr<Counter> outstanding_;
  std::vector<IdlePool<std::unique_ptr<beast::tcp_stream>>> idle_;
};

struct Snapshot {
  std::vector<std::shared_ptr<Backend>> backends;  // sorted by instance_id
};

// The outcome of one leg as far as it has been read.
struct LegResult {
  Status transport;     // connect/write/read failure or deadline; ok when an HTTP response arrived
  int http_status = 0;  // valid when transport is ok
  std::string content_type;
  std::string body;  // the whole body (full legs) or what was read so far (streams)
  bool complete = false;

  bool ok() const { return transport.ok() && http_status == 200; }
  // A 4xx that another instance would answer the same way (not 408 / 429).
  bool is_client_error() const {
    return transport.ok() && http_status >= 400 && http_status < 500 && http_status != 408 && http_status != 429;
  }
};

// One request to one backend. Counts as outstanding on the backend from
// construction to destruction, so a stream counts for its whole life.
class Leg {
 public:
  Leg(std::shared_ptr<Backend> backend, size_t thread_index);
  ~Leg();
  Leg(const Leg&) = delete;
  Leg& operator=(const Leg&) = delete;

  Backend& backend() { return *backend_; }
  const std::shared_ptr<Backend>& backend_ptr() const { return backend_; }

  // Takes a pooled connection (unless `fresh`) or connects (bounded by connect_timeout_ms).
  awaitable<Status> connect(int64_t connect_timeout_ms, bool fresh = false);
  // Sends POST `target` and reads the response header, all before `deadline` (a connection made
  // here waits at most connect_timeout_ms, and never past the deadline).
  // A pooled connection the server closed meanwhile (a failure before any
  // response byte) is replaced once by a NEW connection, never another pooled one.
  awaitable<LegResult> start(const std::string& target, const std::string& body, int64_t connect_timeout_ms,
                             std::chrono::steady_clock::time_point deadline);
  // Appends the next piece of the body to `out`; sets `result.complete` at the end.
  awaitable<Status> read_some(LegResult& result, std::string& out, std::chrono::steady_clock::time_point deadline);
  // The most a whole answer read by read_rest may hold, unless the caller bounds it tighter.
  static constexpr uint64_t kMaxFullBodyBytes = 256ull * 1024 * 1024;
  // Reads the rest of the body into result.body; an answer longer than max_bytes fails (kResourceExhausted).
  awaitable<Status> read_rest(LegResult& result, std::chrono::steady_clock::time_point deadline,
                              uint64_t max_bytes = kMaxFullBodyBytes);

  // Closes the connection: the engine sees the disconnect and aborts the request.
  void cancel();
  bool cancelled() const { return cancelled_; }
  // Ends the leg: a connection that finished a keep-alive response goes back
  // to the pool, any other is closed; the backend's outstanding count drops.
  // Idempotent; the destructor calls it.
  void release();
  bool released() const { return released_; }

 private:
  awaitable<LegResult> send_and_read_header(const std::string& target, const std::string& body,
                                            std::chrono::steady_clock::time_point deadline);

  std::shared_ptr<Backend> backend_;
  size_t thread_index_;
  std::unique_ptr<beast::tcp_stream> stream_;
  bool reused_ = false;
  bool cancelled_ = false;
  bool complete_ = false;
  bool released_ = false;
  beast::flat_buffer buffer_;
  std::optional<http::response_parser<http::buffer_body>> parser_;
  std::vector<char> piece_;
};

// A plain GET with a deadline, for discovery probes (no pooling). `authorization`: the
// Authorization header value to send; empty for none.
awaitable<LegResult> http_get(const tcp::endpoint& endpoint, const std::string& host_header, const std::string& target,
                              const std::string& authorization, int64_t timeout_ms);

// The Authorization header value for an engine API key ("Bearer <key>"); empty for an empty key.
std::string bearer_authorization(const std::string& api_key);

// Maps an Asio/Beast error to a Status (deadline -> kDeadlineExceeded, else kUnavailable).
Status status_from_error(const beast::error_code& ec, std::string_view what);

}  // namespace pd::router
