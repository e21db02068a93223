// The control-plane I/O adapter: one ZMQ ROUTER per instance (peers connect to
// it) plus one DEALER per remote control address this instance connects to
// (consumers only). One thread owns every socket; other threads hand frames to
// it through a mutex-guarded outbox and an eventfd wakeup.
//
// Inbound frames are decoded and validated on that thread; a malformed frame is
// counted (pd_connector_control_frames_malformed_total), answered with an
// `error` when it came through the ROUTER, and dropped. Nothing a peer sends can
// end the thread: every receive path catches and counts.
//
// Peers are named by a PeerKey (peer_key.h): accepted (a connection our ROUTER
// accepted, by routing id) or dialled (a DEALER we opened, by control address).
// Replies go back the way the request came, so a producer never connects to an
// address from a request.
#pragma once

#include <zmq.hpp>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/curve_auth.h"
#include "common/log_throttle.h"
#include "common/status.h"
#include "connector/messages.h"
#include "connector/peer_key.h"

namespace pd::connector {

struct ControlPlaneConfig {
  std::string bind_host = "127.0.0.1";
  int32_t port = 0;  // 0 = an ephemeral port, read back with address()
  // Bounds a peer connection: ZMQ connect and (CURVE) handshake intervals.
  int64_t handshake_timeout_ms = 5'000;
  int32_t send_hwm = 1'000;              // per socket; a full queue drops (counted), never blocks
  std::optional<auth::CurveKeys> curve;  // set: CURVE server on the ROUTER, client on DEALERs
  std::string instance_label;            // metrics label
};

struct InboundMessage {
  PeerKey from;
  ControlMessage message;
};

class ControlPlane {
 public:
  using Handler = std::function<void(InboundMessage)>;

  // Binds the ROUTER and starts the I/O thread. `handler` runs on the I/O
  // thread: it must be quick (post elsewhere) and must not call back into send
  // synchronously in a way that blocks.
  static Result<std::unique_ptr<ControlPlane>> start(ControlPlaneConfig config, Handler handler);
  ~ControlPlane();
  ControlPlane(const ControlPlane&) = delete;
  ControlPlane& operator=(const ControlPlane&) = delete;

  // "host:port" actually bound.
  const std::string& address() const { return address_; }

  // Thread-safe, non-blocking. "d:host:port" opens a DEALER on first use.
  void send(const PeerKey& to, const ControlMessage& message);
  // Raw frame (tests: forged or malformed input).
  void send_raw(const PeerKey& to, std::vector<uint8_t> frame);
  // Closes the DEALER to host:port (a peer that restarted or failed its handshake);
  // the next send opens a fresh one.
  void drop_dealer(const std::string& host_port);

  uint64_t num_received() const { return num_received_.load(); }
  uint64_t num_malformed() const { return num_malformed_.load(); }
  uint64_t num_send_dropped() const { return num_send_dropped_.load(); }
  uint64_t num_handler_errors() const { return num_handler_errors_.load(); }

 private:
  ControlPlane(ControlPlaneConfig config, Handler handler);
  Status bind();
  void run();
  void drain_outbox();
  void receive_router();
  void receive_dealer(const std::string& host_port, zmq::socket_t& socket);
  void deliver(const PeerKey& from, std::span<const uint8_t> frame, zmq::socket_t* reply_router,
               const zmq::message_t* routing_id);
  zmq::socket_t& dealer(const std::string& host_port);
  void wake();
  void note_malformed(const std::string& what);

  struct Outgoing {
    PeerKey to;
    std::vector<uint8_t> frame;
    bool drop_dealer = false;
  };

  ControlPlaneConfig config_;
  Handler handler_;
  zmq::context_t context_;
  std::unique_ptr<auth::ZapAuthenticator> zap_;
  zmq::socket_t router_;
  std::map<std::string, zmq::socket_t> dealers_;  // I/O thread only
  std::string address_;
  int wake_fd_ = -1;

  std::mutex outbox_mutex_;
  std::deque<Outgoing> outbox_;

  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> num_received_{0};
  std::atomic<uint64_t> num_malformed_{0};
  std::atomic<uint64_t> num_send_dropped_{0};
  std::atomic<uint64_t> num_handler_errors_{0};
  LogThrottle malformed_log_{1'000'000'000};  // I/O thread only
  std::thread thread_;
};

// Encodes a routing id as the accepted PeerKey the handler sees (hex).
PeerKey router_peer_key(std::span<const uint8_t> routing_id);

}  // namespace pd::connector
