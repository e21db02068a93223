// PeerKey: which control-plane connection a message came through or goes back on.
// Pure (no sockets): the transfer state machines and peer authorisation use it, the
// control plane (control_plane.h) maps it to a ZMQ socket.
//
// Two kinds, and what each proves:
//   * accepted — a connection our ROUTER accepted (a consumer dialled us), named by
//     its ZMQ routing id (hex). Anyone who reached our port may be on it; what it
//     may send is decided by the handshake (peer_auth.h).
//   * dialled  — the DEALER we opened to a producer's control address ("host:port").
//     Only the process listening at that address speaks on it.
#pragma once

#include <compare>
#include <cstdint>
#include <string>
#include <utility>

namespace pd::connector {

class PeerKey {
 public:
  enum class Kind : uint8_t { kAccepted, kDialled };

  PeerKey() = default;
  static PeerKey accepted(std::string routing_id_hex) { return PeerKey(Kind::kAccepted, std::move(routing_id_hex)); }
  static PeerKey dialled(std::string control_address) { return PeerKey(Kind::kDialled, std::move(control_address)); }

  Kind kind() const { return kind_; }
  bool is_dialled() const { return kind_ == Kind::kDialled; }
  // dialled: the producer's control address ("host:port"); accepted: the routing id in hex.
  const std::string& name() const { return name_; }
  // For logs: "d:<host:port>" / "r:<hex>".
  std::string to_string() const { return (is_dialled() ? "d:" : "r:") + name_; }

  auto operator<=>(const PeerKey&) const = default;
  bool operator==(const PeerKey&) const = default;

 private:
  PeerKey(Kind kind, std::string name) : kind_(kind), name_(std::move(name)) {}

  Kind kind_ = Kind::kAccepted;
  std::string name_;
};

}  // namespace pd::connector
