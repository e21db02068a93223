#include "common/curve_auth.h"

#include <gtest/gtest.h>

namespace pd::auth {
namespace {

constexpr const char* kSecret = "a-shared-secret-of-enough-length";

// Sends one message from a client built by `configure_client` to a CURVE
// server; returns whether it arrived within the deadline.
bool message_arrives(const CurveKeys& server_keys, const std::function<void(zmq::socket_t&)>& configure_client) {
  zmq::context_t context;
  ZapAuthenticator zap(context, server_keys);
  zmq::socket_t server(context, zmq::socket_type::router);
  server.set(zmq::sockopt::linger, 0);
  EXPECT_TRUE(make_curve_server(server, server_keys).ok());
  server.bind("tcp://127.0.0.1:*");
  std::string endpoint = server.get(zmq::sockopt::last_endpoint);

  zmq::socket_t client(context, zmq::socket_type::dealer);
  client.set(zmq::sockopt::linger, 0);
  configure_client(client);
  client.connect(endpoint);
  client.send(zmq::str_buffer("hello"), zmq::send_flags::none);

  zmq::pollitem_t item{server.handle(), 0, ZMQ_POLLIN, 0};
  if (zmq::poll(&item, 1, std::chrono::milliseconds(2000)) <= 0) return false;
  zmq::message_t identity, payload;
  EXPECT_TRUE(server.recv(identity));
  EXPECT_TRUE(server.recv(payload));
  return payload.to_string() == "hello";
}

TEST(CurveAuth, DerivationIsDeterministicAndSecretDependent) {
  auto a = derive_curve_keys(kSecret);
  auto b = derive_curve_keys(kSecret);
  auto c = derive_curve_keys("another-shared-secret-here");
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->server.public_z85, b->server.public_z85);
  EXPECT_EQ(a->client.secret_z85, b->client.secret_z85);
  EXPECT_NE(a->server.public_z85, c->server.public_z85);
  EXPECT_NE(a->server.public_z85, a->client.public_z85);
  EXPECT_EQ(a->server.public_z85.size(), 40u);
}

TEST(CurveAuth, ShortSecretIsRefused) {
  auto keys = derive_curve_keys("short");
  ASSERT_FALSE(keys.ok());
  EXPECT_EQ(keys.status().code(), ErrorCode::kInvalidArgument);
}

TEST(CurveAuth, PeerWithTheSecretGetsThrough) {
  auto keys = derive_curve_keys(kSecret).value();
  EXPECT_TRUE(message_arrives(keys, [&](zmq::socket_t& s) { ASSERT_TRUE(make_curve_client(s, keys).ok()); }));
}

TEST(CurveAuth, PeerWithAnotherSecretIsRefused) {
  auto keys = derive_curve_keys(kSecret).value();
  auto wrong = derive_curve_keys("the-wrong-secret-entirely").value();
  // The impostor knows the server's public key but not the client key pair.
  CurveKeys impostor{keys.server, wrong.client};
  EXPECT_FALSE(message_arrives(keys, [&](zmq::socket_t& s) { ASSERT_TRUE(make_curve_client(s, impostor).ok()); }));
}

TEST(CurveAuth, PlaintextPeerIsRefused) {
  auto keys = derive_curve_keys(kSecret).value();
  EXPECT_FALSE(message_arrives(keys, [](zmq::socket_t&) {}));
}

}  // namespace
}  // namespace pd::auth
