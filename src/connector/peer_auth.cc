#include "connector/peer_auth.h"

namespace pd::connector {

RouteDecision route_message(const PeerKey& from, const ControlMessage& msg, bool is_producer,
                            const HandshakeIdentity* handshake) {
  RouteDecision d;
  if (from.is_dialled()) {
    d.check_producer_identity = msg.type != MessageType::kMetaOk;
    switch (msg.type) {
      case MessageType::kMetaOk:
        d.route = MessageRoute::kConsumerHandshake;
        break;
      case MessageType::kDone:
      case MessageType::kReadOk:
      case MessageType::kError:
      case MessageType::kAbort:
        d.route = MessageRoute::kConsumerMachine;
        break;
      default:
        d.route = MessageRoute::kUnexpected;
        break;
    }
    return d;
  }
  switch (msg.type) {
    case MessageType::kMeta:
      d.route = MessageRoute::kProducerHandshake;
      break;
    case MessageType::kBlocks:
    case MessageType::kRead:
    case MessageType::kRelease:
    case MessageType::kAbort: {
      const bool proven =
          handshake != nullptr && handshake->instance_id == msg.instance_id && handshake->boot_nonce == msg.boot_nonce;
      d.route = proven && is_producer ? MessageRoute::kProducerMachine : MessageRoute::kHandshakeRequired;
      break;
    }
    case MessageType::kError:
      d.route = MessageRoute::kConsumerComplaint;
      break;
    default:
      d.route = MessageRoute::kUnexpected;
      break;
  }
  return d;
}

const char* message_route_name(MessageRoute route) {
  switch (route) {
    case MessageRoute::kProducerHandshake:
      return "producer_handshake";
    case MessageRoute::kConsumerHandshake:
      return "consumer_handshake";
    case MessageRoute::kProducerMachine:
      return "producer_machine";
    case MessageRoute::kConsumerMachine:
      return "consumer_machine";
    case MessageRoute::kConsumerComplaint:
      return "consumer_complaint";
    case MessageRoute::kHandshakeRequired:
      return "handshake_required";
    case MessageRoute::kUnexpected:
      return "unexpected";
  }
  return "?";
}

}  // namespace pd::connector
