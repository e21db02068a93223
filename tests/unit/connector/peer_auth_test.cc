#include "connector/peer_auth.h"

#include <gtest/gtest.h>

namespace pd::connector {
namespace {

constexpr MessageType kAllTypes[] = {MessageType::kMeta,  MessageType::kMetaOk,  MessageType::kBlocks,
                                     MessageType::kRead,  MessageType::kReadOk,  MessageType::kDone,
                                     MessageType::kAbort, MessageType::kRelease, MessageType::kError};

ControlMessage message(MessageType type, std::string instance_id = "decode-0", uint64_t nonce = 7) {
  ControlMessage m;
  m.type = type;
  m.instance_id = std::move(instance_id);
  m.boot_nonce = nonce;
  m.transfer_id = "t1";
  return m;
}

const PeerKey kConsumerConnection = PeerKey::accepted("0a");
const PeerKey kProducerConnection = PeerKey::dialled("127.0.0.1:7001");
const HandshakeIdentity kDecode0{"decode-0", 7};

bool is_transfer_request(MessageType t) {
  return t == MessageType::kBlocks || t == MessageType::kRead || t == MessageType::kRelease || t == MessageType::kAbort;
}

TEST(PeerAuth, AHandshakenConsumerReachesTheProducerMachineWithTransferRequestsOnly) {
  for (MessageType t : kAllTypes) {
    const RouteDecision d = route_message(kConsumerConnection, message(t), /*is_producer=*/true, &kDecode0);
    EXPECT_FALSE(d.check_producer_identity) << message_type_name(t);
    MessageRoute expected = MessageRoute::kUnexpected;
    if (t == MessageType::kMeta) expected = MessageRoute::kProducerHandshake;
    if (is_transfer_request(t)) expected = MessageRoute::kProducerMachine;
    if (t == MessageType::kError) expected = MessageRoute::kConsumerComplaint;
    EXPECT_EQ(d.route, expected) << message_type_name(t) << " -> " << message_route_name(d.route);
  }
}

TEST(PeerAuth, TransferRequestsWithoutAMatchingHandshakeAreRefused) {
  const HandshakeIdentity restarted{"decode-0", 8};
  const HandshakeIdentity other{"decode-1", 7};
  for (MessageType t : kAllTypes) {
    if (!is_transfer_request(t)) continue;
    // No handshake on this connection.
    EXPECT_EQ(route_message(kConsumerConnection, message(t), true, nullptr).route, MessageRoute::kHandshakeRequired)
        << message_type_name(t);
    // The handshake named another incarnation or another instance than the message does.
    EXPECT_EQ(route_message(kConsumerConnection, message(t), true, &restarted).route, MessageRoute::kHandshakeRequired)
        << message_type_name(t);
    EXPECT_EQ(route_message(kConsumerConnection, message(t), true, &other).route, MessageRoute::kHandshakeRequired)
        << message_type_name(t);
    // A consumer-only instance takes no transfer requests, handshake or not.
    EXPECT_EQ(route_message(kConsumerConnection, message(t), false, &kDecode0).route, MessageRoute::kHandshakeRequired)
        << message_type_name(t);
  }
}

TEST(PeerAuth, TheProducerWeDialledReachesTheConsumerMachineAndIsCheckedForARestart) {
  for (MessageType t : kAllTypes) {
    const RouteDecision d = route_message(kProducerConnection, message(t, "prefill-0", 5), /*is_producer=*/false,
                                          /*handshake=*/nullptr);
    // Everything but the handshake answer names the producer's identity.
    EXPECT_EQ(d.check_producer_identity, t != MessageType::kMetaOk) << message_type_name(t);
    MessageRoute expected = MessageRoute::kUnexpected;
    if (t == MessageType::kMetaOk) expected = MessageRoute::kConsumerHandshake;
    if (t == MessageType::kDone || t == MessageType::kReadOk || t == MessageType::kError || t == MessageType::kAbort)
      expected = MessageRoute::kConsumerMachine;
    EXPECT_EQ(d.route, expected) << message_type_name(t) << " -> " << message_route_name(d.route);
  }
}

TEST(PeerAuth, AnswersAreNotTakenFromAcceptedConnectionsNorRequestsFromDialledOnes) {
  // A consumer that dialled us cannot complete a transfer (done, read_ok) or answer a handshake.
  for (MessageType t : {MessageType::kDone, MessageType::kReadOk, MessageType::kMetaOk}) {
    EXPECT_EQ(route_message(kConsumerConnection, message(t), true, &kDecode0).route, MessageRoute::kUnexpected)
        << message_type_name(t);
  }
  // The producer we dialled cannot start a handshake or ask for our blocks.
  for (MessageType t : {MessageType::kMeta, MessageType::kBlocks, MessageType::kRead, MessageType::kRelease}) {
    EXPECT_EQ(route_message(kProducerConnection, message(t), true, nullptr).route, MessageRoute::kUnexpected)
        << message_type_name(t);
  }
}

}  // namespace
}  // namespace pd::connector
