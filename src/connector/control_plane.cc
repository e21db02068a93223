#include "connector/control_plane.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "common/metrics.h"

namespace pd::connector {
namespace {

metrics::Counter& malformed_counter(const std::string& instance) {
  return metrics::Registry::global().counter("pd_connector_control_frames_malformed_total",
                                             "Control frames refused by validation and dropped",
                                             {{"instance", instance}});
}
metrics::Counter& dropped_counter(const std::string& instance) {
  return metrics::Registry::global().counter("pd_connector_control_send_dropped_total",
                                             "Control frames dropped on send (queue full or peer unknown)",
                                             {{"instance", instance}});
}

std::string hex(std::span<const uint8_t> bytes) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (uint8_t b : bytes) {
    out += kDigits[b >> 4];
    out += kDigits[b & 15];
  }
  return out;
}

bool unhex(std::string_view text, std::vector<uint8_t>* out) {
  if (text.size() % 2 != 0) return false;
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  out->clear();
  for (size_t i = 0; i < text.size(); i += 2) {
    int hi = nibble(text[i]), lo = nibble(text[i + 1]);
    if (hi < 0 || lo < 0) return false;
    out->push_back(static_cast<uint8_t>(hi * 16 + lo));
  }
  return true;
}

}  // namespace

PeerKey router_peer_key(std::span<const uint8_t> routing_id) {
  return PeerKey::accepted(hex(routing_id));
}

ControlPlane::ControlPlane(ControlPlaneConfig config, Handler handler)
    : config_(std::move(config)), handler_(std::move(handler)), context_(1) {}

Result<std::unique_ptr<ControlPlane>> ControlPlane::start(ControlPlaneConfig config, Handler handler) {
  std::unique_ptr<ControlPlane> plane(new ControlPlane(std::move(config), std::move(handler)));
  PD_RETURN_IF_ERROR(plane->bind());
  plane->thread_ = std::thread([p = plane.get()] { p->run(); });
  return plane;
}

Status ControlPlane::bind() {
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) return internal_error("eventfd failed: {}", strerror(errno));
  try {
    if (config_.curve) zap_ = std::make_unique<auth::ZapAuthenticator>(context_, *config_.curve);
    router_ = zmq::socket_t(context_, zmq::socket_type::router);
    router_.set(zmq::sockopt::linger, 0);
    router_.set(zmq::sockopt::router_mandatory, 1);
    router_.set(zmq::sockopt::sndhwm, config_.send_hwm);
    router_.set(zmq::sockopt::rcvhwm, config_.send_hwm);
    router_.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(kMaxFrameBytes));
    router_.set(zmq::sockopt::handshake_ivl, static_cast<int>(config_.handshake_timeout_ms));
    if (config_.curve) PD_RETURN_IF_ERROR(auth::make_curve_server(router_, *config_.curve));
    router_.bind(fmt::format("tcp://{}:{}", config_.bind_host, config_.port));
    const std::string endpoint = router_.get(zmq::sockopt::last_endpoint);  // tcp://host:port
    address_ = endpoint.substr(endpoint.find("//") + 2);
  } catch (const zmq::error_t& e) {
    return unavailable("control plane: cannot bind tcp://{}:{}: {}", config_.bind_host, config_.port, e.what());
  }
  return Status::Ok();
}

ControlPlane::~ControlPlane() {
  stop_.store(true);
  wake();
  if (thread_.joinable()) thread_.join();
  dealers_.clear();
  router_.close();
  zap_.reset();
  if (wake_fd_ >= 0) close(wake_fd_);
}

void ControlPlane::wake() {
  if (wake_fd_ < 0) return;
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t n = write(wake_fd_, &one, sizeof(one));
}

void ControlPlane::send(const PeerKey& to, const ControlMessage& message) {
  send_raw(to, encode_message(message));
}

void ControlPlane::send_raw(const PeerKey& to, std::vector<uint8_t> frame) {
  {
    std::lock_guard<std::mutex> lock(outbox_mutex_);
    if (outbox_.size() >= static_cast<size_t>(config_.send_hwm) * 16) {
      num_send_dropped_.fetch_add(1);
      dropped_counter(config_.instance_label).inc();
      return;
    }
    outbox_.push_back({to, std::move(frame), false});
  }
  wake();
}

void ControlPlane::drop_dealer(const std::string& host_port) {
  {
    std::lock_guard<std::mutex> lock(outbox_mutex_);
    outbox_.push_back({PeerKey::dialled(host_port), {}, true});
  }
  wake();
}

zmq::socket_t& ControlPlane::dealer(const std::string& host_port) {
  auto it = dealers_.find(host_port);
  if (it != dealers_.end()) return it->second;
  zmq::socket_t socket(context_, zmq::socket_type::dealer);
  socket.set(zmq::sockopt::linger, 0);
  socket.set(zmq::sockopt::sndhwm, config_.send_hwm);
  socket.set(zmq::sockopt::rcvhwm, config_.send_hwm);
  socket.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(kMaxFrameBytes));
  socket.set(zmq::sockopt::connect_timeout, static_cast<int>(config_.handshake_timeout_ms));
  socket.set(zmq::sockopt::handshake_ivl, static_cast<int>(config_.handshake_timeout_ms));
  socket.set(zmq::sockopt::reconnect_ivl, 100);
  socket.set(zmq::sockopt::reconnect_ivl_max, 2'000);
  if (config_.curve) {
    Status status = auth::make_curve_client(socket, *config_.curve);
    if (!status.ok()) PD_LOG_ERROR("control plane: CURVE client setup failed: {}", status.to_string());
  }
  socket.connect("tcp://" + host_port);
  return dealers_.emplace(host_port, std::move(socket)).first->second;
}

void ControlPlane::drain_outbox() {
  std::deque<Outgoing> batch;
  {
    std::lock_guard<std::mutex> lock(outbox_mutex_);
    batch.swap(outbox_);
  }
  for (auto& out : batch) {
    try {
      if (out.to.is_dialled()) {
        const std::string& host_port = out.to.name();
        if (out.drop_dealer) {
          dealers_.erase(host_port);
          continue;
        }
        auto sent = dealer(host_port).send(zmq::buffer(out.frame), zmq::send_flags::dontwait);
        if (!sent) throw zmq::error_t();
      } else {
        std::vector<uint8_t> routing_id;
        if (!unhex(out.to.name(), &routing_id)) {
          throw zmq::error_t();
        }
        auto sent = router_.send(zmq::buffer(routing_id), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
        if (!sent) throw zmq::error_t();
        router_.send(zmq::buffer(out.frame), zmq::send_flags::dontwait);
      }
    } catch (const zmq::error_t&) {
      // Full queue or a peer that has gone away: the protocol's timeouts cover the loss.
      num_send_dropped_.fetch_add(1);
      dropped_counter(config_.instance_label).inc();
    }
  }
}

void ControlPlane::note_malformed(const std::string& what) {
  // Counted always (above); logged at most once a second, saying how many it stands for.
  if (!malformed_log_.admit(now_ns())) return;
  if (malformed_log_.num_held_back() > 0) {
    PD_LOG_WARN("control plane: dropped {} (and {} more malformed frames since the last such line)", what,
                malformed_log_.num_held_back());
  } else {
    PD_LOG_WARN("control plane: dropped {}", what);
  }
}

void ControlPlane::deliver(const PeerKey& from, std::span<const uint8_t> frame, zmq::socket_t* reply_router,
                           const zmq::message_t* routing_id) {
  num_received_.fetch_add(1);
  auto decoded = decode_message(frame);
  if (!decoded.ok()) {
    num_malformed_.fetch_add(1);
    malformed_counter(config_.instance_label).inc();
    note_malformed(fmt::format("a malformed frame from {}: {}", from.to_string(), decoded.status().message()));
    if (reply_router != nullptr && routing_id != nullptr) {
      ControlMessage error;
      error.type = MessageType::kError;
      error.instance_id = config_.instance_label.empty() ? "unknown" : config_.instance_label;
      error.text = "malformed frame: " + decoded.status().message();
      const auto bytes = encode_message(error);
      try {
        if (reply_router->send(zmq::buffer(routing_id->data(), routing_id->size()),
                               zmq::send_flags::sndmore | zmq::send_flags::dontwait)) {
          reply_router->send(zmq::buffer(bytes), zmq::send_flags::dontwait);
        }
      } catch (const zmq::error_t&) {
        num_send_dropped_.fetch_add(1);
      }
    }
    return;
  }
  try {
    handler_(InboundMessage{from, std::move(decoded).value()});
  } catch (const std::exception& e) {
    num_handler_errors_.fetch_add(1);
    PD_LOG_ERROR("control plane: handler threw on a message from {}: {}", from.to_string(), e.what());
  }
}

void ControlPlane::receive_router() {
  // One DEALER message arrives as [routing id, payload]; anything else is malformed.
  for (int i = 0; i < 64; ++i) {
    std::vector<zmq::message_t> parts;
    try {
      zmq::message_t part;
      if (!router_.recv(part, zmq::recv_flags::dontwait)) return;
      parts.push_back(std::move(part));
      while (parts.back().more()) {
        zmq::message_t next;
        if (!router_.recv(next, zmq::recv_flags::dontwait)) break;
        if (parts.size() < 8)
          parts.push_back(std::move(next));
        else if (!next.more())
          break;  // drain oversize multipart without keeping it
      }
    } catch (const zmq::error_t& e) {
      num_malformed_.fetch_add(1);
      malformed_counter(config_.instance_label).inc();
      return;
    }
    const PeerKey from = router_peer_key({static_cast<const uint8_t*>(parts[0].data()), parts[0].size()});
    if (parts.size() != 2) {
      num_received_.fetch_add(1);
      num_malformed_.fetch_add(1);
      malformed_counter(config_.instance_label).inc();
      note_malformed(fmt::format("a {}-part message from {}", parts.size(), from.to_string()));
      continue;
    }
    deliver(from, {static_cast<const uint8_t*>(parts[1].data()), parts[1].size()}, &router_, &parts[0]);
  }
}

void ControlPlane::receive_dealer(const std::string& host_port, zmq::socket_t& socket) {
  for (int i = 0; i < 64; ++i) {
    std::vector<zmq::message_t> parts;
    try {
      zmq::message_t part;
      if (!socket.recv(part, zmq::recv_flags::dontwait)) return;
      parts.push_back(std::move(part));
      while (parts.back().more()) {
        zmq::message_t next;
        if (!socket.recv(next, zmq::recv_flags::dontwait)) break;
        if (parts.size() < 8)
          parts.push_back(std::move(next));
        else if (!next.more())
          break;
      }
    } catch (const zmq::error_t&) {
      num_malformed_.fetch_add(1);
      malformed_counter(config_.instance_label).inc();
      return;
    }
    if (parts.size() != 1) {
      num_received_.fetch_add(1);
      num_malformed_.fetch_add(1);
      malformed_counter(config_.instance_label).inc();
      continue;
    }
    deliver(PeerKey::dialled(host_port), {static_cast<const uint8_t*>(parts[0].data()), parts[0].size()}, nullptr,
            nullptr);
  }
}

void ControlPlane::run() {
  std::vector<zmq::pollitem_t> items;
  std::vector<std::string> dealer_names;
  while (!stop_.load()) {
    items.clear();
    dealer_names.clear();
    items.push_back({router_.handle(), 0, ZMQ_POLLIN, 0});
    items.push_back({nullptr, wake_fd_, ZMQ_POLLIN, 0});
    for (auto& [name, socket] : dealers_) {
      items.push_back({socket.handle(), 0, ZMQ_POLLIN, 0});
      dealer_names.push_back(name);
    }
    try {
      zmq::poll(items.data(), items.size(), std::chrono::milliseconds(200));
    } catch (const zmq::error_t& e) {
      if (e.num() == ETERM) return;
      continue;  // EINTR
    }
    if (items[1].revents & ZMQ_POLLIN) {
      uint64_t count = 0;
      [[maybe_unused]] ssize_t n = read(wake_fd_, &count, sizeof(count));
    }
    if (stop_.load()) return;
    if (items[0].revents & ZMQ_POLLIN) receive_router();
    for (size_t i = 0; i < dealer_names.size(); ++i) {
      if (items[i + 2].revents & ZMQ_POLLIN) {
        auto it = dealers_.find(dealer_names[i]);
        if (it != dealers_.end()) receive_dealer(it->first, it->second);
      }
    }
    drain_outbox();
  }
}

}  // namespace pd::connector
