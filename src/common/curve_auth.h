// Shared-secret authentication for ZMQ control sockets (CURVE).
//
// Every instance of one deployment reads the same secret file. From it both
// sides derive, deterministically, a server key pair and a client key pair
// (BLAKE2b via libsodium, then X25519 public keys). A CURVE server socket only
// completes handshakes with peers that prove the derived client key, which
// the ZapAuthenticator checks; without the secret no frame ever reaches the
// application. Traffic is also encrypted.
#pragma once

#include <zmq.hpp>

#include <atomic>
#include <filesystem>
#include <string>
#include <string_view>
#include <thread>

#include "common/status.h"

namespace pd::auth {

struct CurveKeyPair {
  std::string public_z85;  // 40 chars
  std::string secret_z85;  // 40 chars
};

struct CurveKeys {
  CurveKeyPair server;
  CurveKeyPair client;
};

// The secret must be at least 16 bytes (after trimming trailing whitespace).
Result<CurveKeys> derive_curve_keys(std::string_view shared_secret);
// Reads a secret file; rejects missing, empty or too short files with a clear error.
Result<std::string> read_secret_file(const std::filesystem::path& path);

// Call before bind(): makes the socket a CURVE server.
Status make_curve_server(zmq::socket_t& socket, const CurveKeys& keys);
// Call before connect(): makes the socket a CURVE client of a server with these keys.
Status make_curve_client(zmq::socket_t& socket, const CurveKeys& keys);

// ZAP handler for one zmq context: accepts CURVE clients whose public key is
// the derived client key, refuses everything else (counted in
// pd_control_auth_rejected_total). Start it before binding CURVE servers in
// that context. One per context; stops and joins in the destructor.
class ZapAuthenticator {
 public:
  ZapAuthenticator(zmq::context_t& context, const CurveKeys& keys);
  ~ZapAuthenticator();
  ZapAuthenticator(const ZapAuthenticator&) = delete;
  ZapAuthenticator& operator=(const ZapAuthenticator&) = delete;

  uint64_t num_accepted() const { return num_accepted_.load(); }
  uint64_t num_rejected() const { return num_rejected_.load(); }

 private:
  void run();

  zmq::socket_t socket_;
  std::string allowed_client_key_;  // 32 raw bytes
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> num_accepted_{0};
  std::atomic<uint64_t> num_rejected_{0};
  std::thread thread_;
};

}  // namespace pd::auth
