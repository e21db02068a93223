#include "connector/heartbeat.h"

#include <msgpack.hpp>

#include "common/log.h"
#include "common/metrics.h"

namespace pd::connector {
namespace {

void pack_kv(msgpack::packer<msgpack::sbuffer>& pk, const char* key, const std::string& value) {
  pk.pack(std::string_view(key));
  pk.pack(value);
}

}  // namespace

std::vector<uint8_t> encode_registration(const RegistrationRecord& r) {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> pk(buffer);
  pk.pack_map(11);
  pk.pack(std::string_view("v"));
  pk.pack(1u);
  pack_kv(pk, "type", "register");
  pack_kv(pk, "role", r.role);
  pack_kv(pk, "http", r.http);
  pack_kv(pk, "control", r.control);
  pack_kv(pk, "instance_id", r.instance_id);
  pk.pack(std::string_view("boot_nonce"));
  pk.pack(r.boot_nonce);
  pk.pack(std::string_view("tp_size"));
  pk.pack(static_cast<uint32_t>(r.tp_size));
  pk.pack(std::string_view("dp_size"));
  pk.pack(static_cast<uint32_t>(r.dp_size));
  pack_kv(pk, "mode", r.mode);
  pack_kv(pk, "model", r.model);
  const auto* begin = reinterpret_cast<const uint8_t*>(buffer.data());
  return {begin, begin + buffer.size()};
}

Result<std::unique_ptr<RegistrationHeartbeat>> RegistrationHeartbeat::start(RegistrationRecord record,
                                                                            std::string router_address,
                                                                            int64_t interval_ms,
                                                                            std::optional<auth::CurveKeys> curve) {
  std::unique_ptr<RegistrationHeartbeat> hb(new RegistrationHeartbeat());
  hb->frame_ = encode_registration(record);
  hb->interval_ms_ = interval_ms;
  try {
    hb->socket_ = zmq::socket_t(hb->context_, zmq::socket_type::dealer);
    hb->socket_.set(zmq::sockopt::linger, 0);
    hb->socket_.set(zmq::sockopt::sndhwm, 2);  // stale registrations are worthless; keep at most two
    hb->socket_.set(zmq::sockopt::reconnect_ivl, 200);
    hb->socket_.set(zmq::sockopt::reconnect_ivl_max, 2'000);
    if (curve) PD_RETURN_IF_ERROR(auth::make_curve_client(hb->socket_, *curve));
    hb->socket_.connect("tcp://" + router_address);
  } catch (const zmq::error_t& e) {
    return invalid_argument("registration: cannot connect to router at {}: {}", router_address, e.what());
  }
  hb->thread_ = std::thread([p = hb.get()] { p->run(); });
  return hb;
}

RegistrationHeartbeat::~RegistrationHeartbeat() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  socket_.close();
}

void RegistrationHeartbeat::run() {
  auto& sent_counter = metrics::Registry::global().counter("pd_connector_registrations_sent_total",
                                                           "Registration heartbeats sent to the router");
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_) {
    try {
      if (socket_.send(zmq::buffer(frame_), zmq::send_flags::dontwait)) {
        num_sent_.fetch_add(1);
        sent_counter.inc();
      } else {
        num_dropped_.fetch_add(1);
      }
    } catch (const zmq::error_t& e) {
      num_dropped_.fetch_add(1);
      PD_LOG_WARN("registration: send failed: {}", e.what());
    }
    cv_.wait_for(lock, std::chrono::milliseconds(interval_ms_), [this] { return stop_; });
  }
}

}  // namespace pd::connector
