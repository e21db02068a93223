// Peer authorisation: which peer may send which control message, and which side
// of this instance takes it. Pure (no sockets, no state): the adapter
// (pd_connector.cc) asks route_message for every decoded frame and executes the
// answer; the state machines then check that the sender is the peer bound to the
// named transfer (transfer_machines.h).
//
//   connection   message                         route
//   accepted     meta                            producer handshake (the adapter refuses it when not a producer)
//   accepted     blocks / read / release / abort producer machine, only from a peer whose handshake on this
//                                                connection named the same instance id and boot nonce, and only
//                                                on a producer; else refused, answered with `error`
//   accepted     error                           a consumer's complaint: logged, nothing else
//   dialled      meta_ok                         consumer handshake answer
//   dialled      done / read_ok / error / abort  consumer machine
//   anything else                                refused (counted, dropped)
// Every message on a dialled connection except meta_ok also names the producer's
// identity: only the process listening at the address we dialled speaks there, so
// a new identity means that producer restarted (check_producer_identity).
#pragma once

#include <cstdint>
#include <string>

#include "connector/messages.h"
#include "connector/peer_key.h"

namespace pd::connector {

enum class MessageRoute : uint8_t {
  kProducerHandshake,  // meta: check the consumer's layout, answer meta_ok
  kConsumerHandshake,  // meta_ok: the producer we dialled answered
  kProducerMachine,    // the producer's transfer state machine takes it
  kConsumerMachine,    // the consumer's transfer state machine takes it
  kConsumerComplaint,  // an `error` from a consumer: log only
  kHandshakeRequired,  // refused: no (matching) handshake on this connection; answer `error`
  kUnexpected,         // refused: not a message this connection may carry
};

// The identity a consumer proved in its handshake on an accepted connection.
struct HandshakeIdentity {
  std::string instance_id;
  uint64_t boot_nonce = 0;
};

struct RouteDecision {
  MessageRoute route = MessageRoute::kUnexpected;
  // Before routing: the message names the identity of the producer at a dialled address.
  bool check_producer_identity = false;
};

// `handshake`: the identity proved on `from` (accepted connections only), or null.
RouteDecision route_message(const PeerKey& from, const ControlMessage& msg, bool is_producer,
                            const HandshakeIdentity* handshake);

const char* message_route_name(MessageRoute route);

}  // namespace pd::connector
