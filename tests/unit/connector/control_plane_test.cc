#include "connector/control_plane.h"

#include <gtest/gtest.h>
#include <msgpack.hpp>

#include <algorithm>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include "common/clock.h"
#include "connector/heartbeat.h"
#include "contract/registration.h"

namespace pd::connector {
namespace {

const std::string kT = "0123456789abcdef0123456789abcdef";

// Collects inbound messages; waits on a condition with a deadline.
class Inbox {
 public:
  void push(InboundMessage m) {
    std::lock_guard<std::mutex> lock(mutex_);
    messages_.push_back(std::move(m));
    cv_.notify_all();
  }
  bool wait_for(size_t count, int64_t timeout_ms = 5000) {
    std::unique_lock<std::mutex> lock(mutex_);
    return cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return messages_.size() >= count; });
  }
  std::vector<InboundMessage> messages() {
    std::lock_guard<std::mutex> lock(mutex_);
    return messages_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<InboundMessage> messages_;
};

ControlMessage release_msg(const std::string& from) {
  ControlMessage m;
  m.type = MessageType::kRelease;
  m.instance_id = from;
  m.boot_nonce = 1;
  m.transfer_id = kT;
  return m;
}

TEST(ControlPlane, RequestAndReplyTravelOverRouterAndDealer) {
  Inbox server_inbox, client_inbox;
  auto server = ControlPlane::start({}, [&](InboundMessage m) { server_inbox.push(std::move(m)); });
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  auto client = ControlPlane::start({}, [&](InboundMessage m) { client_inbox.push(std::move(m)); });
  ASSERT_TRUE(client.ok());
  (*client)->send(PeerKey::dialled((*server)->address()), release_msg("consumer"));
  ASSERT_TRUE(server_inbox.wait_for(1));
  auto got = server_inbox.messages()[0];
  EXPECT_EQ(got.message.instance_id, "consumer");
  EXPECT_EQ(got.from.kind(), PeerKey::Kind::kAccepted);
  (*server)->send(got.from, release_msg("producer"));
  ASSERT_TRUE(client_inbox.wait_for(1));
  EXPECT_EQ(client_inbox.messages()[0].from, PeerKey::dialled((*server)->address()));
  EXPECT_EQ(client_inbox.messages()[0].message.instance_id, "producer");
}

TEST(ControlPlane, MalformedFramesAreCountedAnsweredAndTheListenerKeepsServing) {
  Inbox server_inbox, client_inbox;
  auto server = ControlPlane::start({}, [&](InboundMessage m) { server_inbox.push(std::move(m)); });
  ASSERT_TRUE(server.ok());
  auto client = ControlPlane::start({}, [&](InboundMessage m) { client_inbox.push(std::move(m)); });
  ASSERT_TRUE(client.ok());
  const PeerKey to = PeerKey::dialled((*server)->address());
  (*client)->send_raw(to, {0xc1, 0xc1});                     // not msgpack
  (*client)->send_raw(to, std::vector<uint8_t>(100, 0x91));  // deep nesting
  (*client)->send_raw(to, {0x81, 0xa1, 'v', 0x02});          // wrong version
  auto forged = release_msg("x");
  forged.transfer_id = "not-a-transfer";
  (*client)->send(to, forged);
  (*client)->send(to, release_msg("still-alive"));
  ASSERT_TRUE(server_inbox.wait_for(1));
  EXPECT_EQ(server_inbox.messages()[0].message.instance_id, "still-alive");
  EXPECT_EQ((*server)->num_malformed(), 4u);
  // Every malformed frame that came through the ROUTER is answered with an error.
  ASSERT_TRUE(client_inbox.wait_for(4));
  for (const auto& m : client_inbox.messages()) EXPECT_EQ(m.message.type, MessageType::kError);
}

TEST(ControlPlane, MultipartFramesAreMalformedToo) {
  Inbox server_inbox;
  auto server = ControlPlane::start({}, [&](InboundMessage m) { server_inbox.push(std::move(m)); });
  ASSERT_TRUE(server.ok());
  zmq::context_t ctx(1);
  zmq::socket_t raw(ctx, zmq::socket_type::dealer);
  raw.set(zmq::sockopt::linger, 0);
  raw.connect("tcp://" + (*server)->address());
  const auto good = encode_message(release_msg("after"));
  raw.send(zmq::buffer(good), zmq::send_flags::sndmore);
  raw.send(zmq::buffer(good), zmq::send_flags::none);
  raw.send(zmq::buffer(good), zmq::send_flags::none);
  ASSERT_TRUE(server_inbox.wait_for(1));
  EXPECT_EQ(server_inbox.messages().size(), 1u);
  EXPECT_EQ((*server)->num_malformed(), 1u);
}

TEST(ControlPlane, AHandlerThatThrowsDoesNotEndTheThread) {
  Inbox inbox;
  int calls = 0;
  auto server = ControlPlane::start({}, [&](InboundMessage m) {
    if (++calls == 1) throw std::runtime_error("boom");
    inbox.push(std::move(m));
  });
  ASSERT_TRUE(server.ok());
  auto client = ControlPlane::start({}, [](InboundMessage) {});
  (*client)->send(PeerKey::dialled((*server)->address()), release_msg("a"));
  (*client)->send(PeerKey::dialled((*server)->address()), release_msg("b"));
  ASSERT_TRUE(inbox.wait_for(1));
  EXPECT_EQ(inbox.messages()[0].message.instance_id, "b");
  EXPECT_EQ((*server)->num_handler_errors(), 1u);
}

TEST(ControlPlane, SendsToUnknownRoutingIdsAreDroppedAndCounted) {
  auto server = ControlPlane::start({}, [](InboundMessage) {});
  ASSERT_TRUE(server.ok());
  (*server)->send(PeerKey::accepted("00ff"), release_msg("p"));
  (*server)->send(PeerKey::accepted("not hex"), release_msg("p"));  // an id that cannot be a routing id
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while ((*server)->num_send_dropped() < 2 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();
  }
  EXPECT_EQ((*server)->num_send_dropped(), 2u);
}

TEST(ControlPlane, WithCurveOnlyPeersHoldingTheSecretGetThrough) {
  auto keys = auth::derive_curve_keys("a shared secret of enough length");
  ASSERT_TRUE(keys.ok());
  auto wrong = auth::derive_curve_keys("another secret, also long enough");
  ASSERT_TRUE(wrong.ok());
  Inbox inbox;
  ControlPlaneConfig server_config;
  server_config.curve = *keys;
  server_config.handshake_timeout_ms = 500;
  auto server = ControlPlane::start(server_config, [&](InboundMessage m) { inbox.push(std::move(m)); });
  ASSERT_TRUE(server.ok()) << server.status().to_string();

  ControlPlaneConfig plain;
  plain.handshake_timeout_ms = 500;
  auto no_auth = ControlPlane::start(plain, [](InboundMessage) {});
  ControlPlaneConfig bad = plain;
  bad.curve = *wrong;
  auto wrong_key = ControlPlane::start(bad, [](InboundMessage) {});
  ControlPlaneConfig good = plain;
  good.curve = *keys;
  auto right_key = ControlPlane::start(good, [](InboundMessage) {});
  const PeerKey to = PeerKey::dialled((*server)->address());
  (*no_auth)->send(to, release_msg("plain"));
  (*wrong_key)->send(to, release_msg("wrong"));
  (*right_key)->send(to, release_msg("right"));
  ASSERT_TRUE(inbox.wait_for(1));
  EXPECT_FALSE(inbox.wait_for(2, 1000)) << "only the peer with the secret is heard";
  EXPECT_EQ(inbox.messages()[0].message.instance_id, "right");
}

TEST(RegistrationHeartbeat, SendsTheContractRecordRepeatedly) {
  zmq::context_t ctx(1);
  zmq::socket_t router(ctx, zmq::socket_type::router);
  router.set(zmq::sockopt::linger, 0);
  router.set(zmq::sockopt::rcvtimeo, 5000);
  router.bind("tcp://127.0.0.1:0");
  std::string endpoint = router.get(zmq::sockopt::last_endpoint);
  RegistrationRecord record{"producer", "127.0.0.1:8000", "127.0.0.1:7000", "p0", 99, 1, 1, "write", "tiny"};
  auto hb = RegistrationHeartbeat::start(record, endpoint.substr(6), /*interval_ms=*/50, std::nullopt);
  ASSERT_TRUE(hb.ok()) << hb.status().to_string();
  for (int i = 0; i < 2; ++i) {
    zmq::message_t identity, payload;
    ASSERT_TRUE(router.recv(identity));
    ASSERT_TRUE(router.recv(payload));
    auto handle = msgpack::unpack(static_cast<const char*>(payload.data()), payload.size());
    std::map<std::string, msgpack::object> fields;
    handle.get().convert(fields);
    EXPECT_EQ(fields.at("v").as<int>(), 1);
    EXPECT_EQ(fields.at("type").as<std::string>(), "register");
    EXPECT_EQ(fields.at("role").as<std::string>(), "producer");
    EXPECT_EQ(fields.at("http").as<std::string>(), "127.0.0.1:8000");
    EXPECT_EQ(fields.at("control").as<std::string>(), "127.0.0.1:7000");
    EXPECT_EQ(fields.at("instance_id").as<std::string>(), "p0");
    EXPECT_EQ(fields.at("boot_nonce").as<uint64_t>(), 99u);
    EXPECT_EQ(fields.at("tp_size").as<int>(), 1);
    EXPECT_EQ(fields.at("dp_size").as<int>(), 1);
    EXPECT_EQ(fields.at("mode").as<std::string>(), "write");
    EXPECT_EQ(fields.at("model").as<std::string>(), "tiny");
    EXPECT_EQ(fields.size(), 11u);
  }
}

TEST(RegistrationHeartbeat, ADeadRouterNeverBlocksShutdown) {
  RegistrationRecord record{"consumer", "127.0.0.1:1", "127.0.0.1:2", "c0", 1, 1, 1, "read", "m"};
  auto start = std::chrono::steady_clock::now();
  {
    auto hb = RegistrationHeartbeat::start(record, "127.0.0.1:1", 10, std::nullopt);
    ASSERT_TRUE(hb.ok());
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
}

TEST(RegistrationHeartbeat, ARecordTheContractRefusesIsNeverSent) {
  const RegistrationRecord valid{"consumer", "127.0.0.1:1", "127.0.0.1:2", "c0", 1, 1, 1, "read", "m"};
  std::vector<std::pair<RegistrationRecord, std::string>> refused;
  refused.emplace_back(valid, "role");
  refused.back().first.role = "decode";
  refused.emplace_back(valid, "'http'");
  refused.back().first.http = ":::8000";  // an IPv6 host without brackets
  refused.emplace_back(valid, "'control'");
  refused.back().first.control = "127.0.0.1";
  refused.emplace_back(valid, "mode");
  refused.back().first.mode = "push";
  refused.emplace_back(valid, "tp_size");
  refused.back().first.tp_size = 0;
  for (const auto& [record, field] : refused) {
    auto hb = RegistrationHeartbeat::start(record, "127.0.0.1:1", 10, std::nullopt);
    ASSERT_FALSE(hb.ok()) << field;
    EXPECT_EQ(hb.status().code(), ErrorCode::kInvalidArgument) << field;
    EXPECT_NE(hb.status().message().find(field), std::string::npos) << hb.status().message();
  }
  auto converted = to_contract_record(valid);
  ASSERT_TRUE(converted.ok()) << converted.status().to_string();
  EXPECT_EQ(converted->role, contract::Role::kConsumer);
  EXPECT_EQ(converted->mode, contract::TransferMode::kRead);
  EXPECT_EQ(converted->control->to_string(), "127.0.0.1:2");
}

// A KV-event frame the socket refuses (no router yet, queue full) is not lost: the
// next batch is a whole snapshot, which the router gets once it is back.
TEST(RegistrationHeartbeat, AnEventFrameTheSocketRefusedIsFollowedByAFullSnapshot) {
  // A port nobody listens on until the router starts below.
  std::string port;
  {
    zmq::context_t probe_ctx(1);
    zmq::socket_t probe(probe_ctx, zmq::socket_type::router);
    probe.set(zmq::sockopt::linger, 0);
    probe.bind("tcp://127.0.0.1:0");
    const std::string endpoint = probe.get(zmq::sockopt::last_endpoint);
    port = endpoint.substr(endpoint.rfind(':') + 1);
  }
  auto feed = std::make_shared<LoadFeed>();
  engine::EngineLoad load;
  load.num_kv_blocks_total = 8;
  load.num_kv_blocks_free = 8;
  load.block_size = 4;
  feed->post(load, {engine::KvCacheEvent{101, true}});
  RegistrationRecord record{"consumer", "127.0.0.1:8000", "127.0.0.1:7000", "c0", 7, 1, 1, "write", "m"};
  auto hb = RegistrationHeartbeat::start(record, "127.0.0.1:" + port, /*interval_ms=*/2, std::nullopt, feed,
                                         /*load_interval_ms=*/1);
  ASSERT_TRUE(hb.ok()) << hb.status().to_string();
  // Frames queue for the absent router until the send queue is full; then sends are refused.
  const Deadline full = Deadline::after_ms(10'000);
  while ((*hb)->num_dropped() == 0 && !full.expired()) std::this_thread::yield();
  ASSERT_GT((*hb)->num_dropped(), 0u) << "the send queue never filled";
  // A new cached block: its batch is refused too (three refusals after the post: one
  // send may have started before it, the next ones took it from the feed).
  const uint64_t dropped = (*hb)->num_dropped();
  feed->post(load, {engine::KvCacheEvent{202, true}});
  const Deadline refused = Deadline::after_ms(10'000);
  while ((*hb)->num_dropped() < dropped + 3 && !refused.expired()) std::this_thread::yield();
  ASSERT_GE((*hb)->num_dropped(), dropped + 3);

  zmq::context_t ctx(1);
  zmq::socket_t router(ctx, zmq::socket_type::router);
  router.set(zmq::sockopt::linger, 0);
  router.set(zmq::sockopt::rcvtimeo, 200);
  router.bind("tcp://127.0.0.1:" + port);
  // The queued frames arrive first (a reset with the first block, then frames without
  // events); then a snapshot that holds both blocks, 202 included.
  bool snapshot_with_both = false;
  const Deadline deadline = Deadline::after_ms(10'000);
  while (!snapshot_with_both && !deadline.expired()) {
    zmq::message_t identity, payload;
    if (!router.recv(identity) || !router.recv(payload)) continue;
    auto heartbeat = contract::decode_heartbeat(payload.data(), payload.size());
    ASSERT_TRUE(heartbeat.ok()) << heartbeat.status().to_string();
    if (!heartbeat->kv || !heartbeat->kv->reset) continue;
    const auto& stored = heartbeat->kv->stored;
    snapshot_with_both = std::find(stored.begin(), stored.end(), 101u) != stored.end() &&
                         std::find(stored.begin(), stored.end(), 202u) != stored.end();
  }
  EXPECT_TRUE(snapshot_with_both) << "the refused batch's block never reached the router";
}

}  // namespace
}  // namespace pd::connector
