// Registration with pdrouter (docs/pd_contract.md "Registration"): a dedicated
// thread sends the instance record over a ZMQ DEALER every interval. Model work
// never runs on this thread, so a busy engine cannot starve it; a dead router
// cannot block it (non-blocking sends into a small bounded queue, linger 0).
//
// With a LoadFeed, every frame also carries the engine's load and its prefix-
// cache events ("Load and KV cache events"): the engine thread posts them to the
// feed (one short lock), this thread takes them every kLoadReportIntervalMs,
// owns the KvEventPublisher, and answers the router's resync requests (read from
// the same DEALER) with a snapshot.
#pragma once

#include <zmq.hpp>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/curve_auth.h"
#include "common/status.h"
#include "connector/kv_event_publisher.h"
#include "contract/registration.h"
#include "engine/kv_connector.h"

namespace pd::connector {

// The record as this instance states it, in the contract's spellings; its
// schema, checks and encodings are contract::RegistrationRecord's.
struct RegistrationRecord {
  std::string role;     // "producer" | "consumer" | "both"
  std::string http;     // "host:port"; empty until the HTTP server listens
  std::string control;  // empty only without a connector
  std::string instance_id;
  uint64_t boot_nonce = 0;
  int32_t tp_size = 1;
  int32_t dp_size = 1;
  std::string mode;  // "read" | "write"
  std::string model;
};

// Parses the text into the contract's record (an empty http or control is "not
// known" / "none", written as "" again); kInvalidArgument names the field.
Result<contract::RegistrationRecord> to_contract_record(const RegistrationRecord& record);

// The engine thread's hand-over to the heartbeat thread: the latest load and
// the cache events since the last take, in order. Thread-safe; each call holds
// the lock for a swap or an append only.
class LoadFeed {
 public:
  void post(const engine::EngineLoad& load, std::vector<engine::KvCacheEvent> events);
  struct Taken {
    std::optional<engine::EngineLoad> load;  // the latest posted, if any since start
    std::vector<engine::KvCacheEvent> events;
  };
  Taken take();

 private:
  std::mutex mutex_;
  std::optional<engine::EngineLoad> load_;
  std::vector<engine::KvCacheEvent> events_;
};

class RegistrationHeartbeat {
 public:
  // router_address: "host:port" of the router's ROUTER socket. A record the
  // contract refuses (to_contract_record) is refused here, before any send.
  // feed: when set, load reports and KV cache events go with the record, every
  // load_interval_ms (and at once while a snapshot is being sent).
  static Result<std::unique_ptr<RegistrationHeartbeat>> start(
      RegistrationRecord record, std::string router_address, int64_t interval_ms, std::optional<auth::CurveKeys> curve,
      std::shared_ptr<LoadFeed> feed = nullptr, int64_t load_interval_ms = contract::kLoadReportIntervalMs);
  ~RegistrationHeartbeat();
  RegistrationHeartbeat(const RegistrationHeartbeat&) = delete;
  RegistrationHeartbeat& operator=(const RegistrationHeartbeat&) = delete;

  uint64_t num_sent() const { return num_sent_.load(); }
  uint64_t num_dropped() const { return num_dropped_.load(); }
  uint64_t num_resyncs() const { return num_resyncs_.load(); }

 private:
  RegistrationHeartbeat() = default;
  void run();
  bool send_frame(const std::vector<uint8_t>& frame);
  // Reads what the router sent on the DEALER (resync requests); true when asked for a snapshot.
  bool receive_resync();
  // One load/cache frame; true when the publisher still has differences to send.
  bool send_load_frame(bool registration_due);

  std::vector<uint8_t> frame_;
  contract::RegistrationRecord record_;
  int64_t interval_ms_ = 3'000;
  int64_t load_interval_ms_ = contract::kLoadReportIntervalMs;
  std::shared_ptr<LoadFeed> feed_;
  // Heartbeat thread only.
  KvEventPublisher publisher_;
  std::optional<engine::EngineLoad> last_load_;
  std::optional<contract::LoadReport> last_sent_load_;
  zmq::context_t context_{1};
  zmq::socket_t socket_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::atomic<uint64_t> num_sent_{0};
  std::atomic<uint64_t> num_dropped_{0};
  std::atomic<uint64_t> num_resyncs_{0};
  std::thread thread_;
};

}  // namespace pd::connector
