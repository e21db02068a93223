#include "common/curve_auth.h"

#include <sodium.h>

#include <array>
#include <fstream>
#include <sstream>
#include <vector>

#include "common/log.h"
#include "common/metrics.h"

namespace pd::auth {
namespace {

constexpr size_t kMinSecretBytes = 16;
constexpr int kZapPollMs = 100;

std::string z85(const uint8_t* key32) {
  std::array<char, 41> out{};
  zmq_z85_encode(out.data(), key32, 32);
  return std::string(out.data(), 40);
}

// X25519 key pair from 32 seed bytes derived from the secret and a role label.
CurveKeyPair derive_pair(const std::array<uint8_t, 32>& secret_digest, std::string_view label) {
  std::array<uint8_t, 32> secret_key{};
  crypto_generichash(secret_key.data(), secret_key.size(), reinterpret_cast<const uint8_t*>(label.data()),
                     label.size(), secret_digest.data(), secret_digest.size());
  std::array<uint8_t, 32> public_key{};
  crypto_scalarmult_base(public_key.data(), secret_key.data());
  CurveKeyPair pair{z85(public_key.data()), z85(secret_key.data())};
  sodium_memzero(secret_key.data(), secret_key.size());
  return pair;
}

std::string trim_trailing_whitespace(std::string text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r' || text.back() == ' ' || text.back() == '\t'))
    text.pop_back();
  return text;
}

}  // namespace

Result<CurveKeys> derive_curve_keys(std::string_view shared_secret) {
  if (sodium_init() < 0) return internal_error("libsodium failed to initialise");
  if (shared_secret.size() < kMinSecretBytes)
    return invalid_argument("control-plane secret is {} bytes; at least {} are required", shared_secret.size(),
                            kMinSecretBytes);
  std::array<uint8_t, 32> digest{};
  crypto_generichash(digest.data(), digest.size(), reinterpret_cast<const uint8_t*>(shared_secret.data()),
                     shared_secret.size(), nullptr, 0);
  CurveKeys keys{derive_pair(digest, "pdserve-curve-server-v1"), derive_pair(digest, "pdserve-curve-client-v1")};
  sodium_memzero(digest.data(), digest.size());
  return keys;
}

Result<std::string> read_secret_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return not_found("cannot read control-plane secret file '{}'", path.string());
  std::stringstream buffer;
  buffer << in.rdbuf();
  std::string secret = trim_trailing_whitespace(buffer.str());
  if (secret.size() < kMinSecretBytes)
    return invalid_argument("control-plane secret file '{}' holds {} bytes; at least {} are required", path.string(),
                            secret.size(), kMinSecretBytes);
  return secret;
}

Status make_curve_server(zmq::socket_t& socket, const CurveKeys& keys) {
  try {
    socket.set(zmq::sockopt::curve_server, 1);
    socket.set(zmq::sockopt::curve_secretkey, keys.server.secret_z85);
    socket.set(zmq::sockopt::zap_domain, std::string("pdserve"));
  } catch (const zmq::error_t& e) {
    return internal_error("cannot enable CURVE on a server socket: {}", e.what());
  }
  return Status::Ok();
}

Status make_curve_client(zmq::socket_t& socket, const CurveKeys& keys) {
  try {
    socket.set(zmq::sockopt::curve_serverkey, keys.server.public_z85);
    socket.set(zmq::sockopt::curve_publickey, keys.client.public_z85);
    socket.set(zmq::sockopt::curve_secretkey, keys.client.secret_z85);
  } catch (const zmq::error_t& e) {
    return internal_error("cannot enable CURVE on a client socket: {}", e.what());
  }
  return Status::Ok();
}

ZapAuthenticator::ZapAuthenticator(zmq::context_t& context, const CurveKeys& keys)
    : socket_(context, zmq::socket_type::rep) {
  allowed_client_key_.resize(32);
  zmq_z85_decode(reinterpret_cast<uint8_t*>(allowed_client_key_.data()), keys.client.public_z85.c_str());
  socket_.set(zmq::sockopt::linger, 0);
  socket_.bind("inproc://zeromq.zap.01");
  thread_ = std::thread([this] { run(); });
}

ZapAuthenticator::~ZapAuthenticator() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

// ZAP (RFC 27): request frames are version, request id, domain, address,
// identity, mechanism, then mechanism credentials (CURVE: the client's 32-byte
// public key). Reply: version, request id, status code, status text, user id, metadata.
void ZapAuthenticator::run() {
  auto& rejected_metric =
      metrics::Registry::global().counter("pd_control_auth_rejected_total", "Control-plane handshakes refused by ZAP");
  while (!stop_.load()) {
    zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, std::chrono::milliseconds(kZapPollMs)) <= 0) continue;
    std::vector<zmq::message_t> frames;
    while (true) {
      zmq::message_t frame;
      if (!socket_.recv(frame, zmq::recv_flags::dontwait)) break;
      bool more = frame.more();
      frames.push_back(std::move(frame));
      if (!more) break;
    }
    if (frames.size() < 2) continue;  // a REP socket must answer something; malformed ZAP requests are dropped
    bool accepted = frames.size() >= 7 && frames[5].to_string() == "CURVE" && frames[6].size() == 32 &&
                    frames[6].to_string() == allowed_client_key_;
    if (accepted) {
      num_accepted_.fetch_add(1);
    } else {
      num_rejected_.fetch_add(1);
      rejected_metric.inc();
      PD_LOG_WARN("control plane: refused a handshake from {} (wrong or missing key)",
                  frames.size() >= 4 ? frames[3].to_string() : std::string("?"));
    }
    std::array<std::string, 6> reply{"1.0", frames[1].to_string(), accepted ? "200" : "400",
                                     accepted ? "OK" : "key not allowed", accepted ? "pdserve-peer" : "", ""};
    for (size_t i = 0; i < reply.size(); ++i)
      socket_.send(zmq::buffer(reply[i]), i + 1 < reply.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
  }
}

}  // namespace pd::auth
