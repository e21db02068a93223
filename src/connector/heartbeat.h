// Registration with pdrouter (docs/pd_contract.md "Registration"): a dedicated
// thread sends the instance record over a ZMQ DEALER every interval. Model work
// never runs on this thread, so a busy engine cannot starve it; a dead router
// cannot block it (non-blocking sends into a small bounded queue, linger 0).
#pragma once

#include <zmq.hpp>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/curve_auth.h"
#include "common/status.h"
#include "contract/registration.h"

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

class RegistrationHeartbeat {
 public:
  // router_address: "host:port" of the router's ROUTER socket. A record the
  // contract refuses (to_contract_record) is refused here, before any send.
  static Result<std::unique_ptr<RegistrationHeartbeat>> start(RegistrationRecord record, std::string router_address,
                                                              int64_t interval_ms,
                                                              std::optional<auth::CurveKeys> curve);
  ~RegistrationHeartbeat();
  RegistrationHeartbeat(const RegistrationHeartbeat&) = delete;
  RegistrationHeartbeat& operator=(const RegistrationHeartbeat&) = delete;

  uint64_t num_sent() const { return num_sent_.load(); }
  uint64_t num_dropped() const { return num_dropped_.load(); }

 private:
  RegistrationHeartbeat() = default;
  void run();

  std::vector<uint8_t> frame_;
  int64_t interval_ms_ = 3'000;
  zmq::context_t context_{1};
  zmq::socket_t socket_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::atomic<uint64_t> num_sent_{0};
  std::atomic<uint64_t> num_dropped_{0};
  std::thread thread_;
};

}  // namespace pd::connector
