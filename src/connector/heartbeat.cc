#include "connector/heartbeat.h"

#include "common/log.h"
#include "common/metrics.h"

namespace pd::connector {

Result<contract::RegistrationRecord> to_contract_record(const RegistrationRecord& text) {
  contract::RegistrationRecord record;
  PD_ASSIGN_OR_RETURN(record.role, contract::parse_role(text.role));
  if (!text.http.empty()) {
    auto http = contract::parse_host_port(text.http);
    if (!http.ok()) return invalid_argument("registration field 'http': {}", http.status().message());
    record.http = *http;
  }
  if (!text.control.empty()) {
    auto control = contract::parse_host_port(text.control);
    if (!control.ok()) return invalid_argument("registration field 'control': {}", control.status().message());
    record.control = *control;
  }
  record.instance_id = text.instance_id;
  record.boot_nonce = text.boot_nonce;
  if (text.tp_size < 1 || text.dp_size < 1) {
    return invalid_argument("registration fields 'tp_size' {} and 'dp_size' {} must be at least 1", text.tp_size,
                            text.dp_size);
  }
  record.tp_size = static_cast<uint32_t>(text.tp_size);
  record.dp_size = static_cast<uint32_t>(text.dp_size);
  PD_ASSIGN_OR_RETURN(record.mode, contract::parse_mode(text.mode));
  record.model = text.model;
  return record;
}

Result<std::unique_ptr<RegistrationHeartbeat>> RegistrationHeartbeat::start(RegistrationRecord record,
                                                                            std::string router_address,
                                                                            int64_t interval_ms,
                                                                            std::optional<auth::CurveKeys> curve) {
  PD_ASSIGN_OR_RETURN(contract::RegistrationRecord contract_record, to_contract_record(record));
  std::unique_ptr<RegistrationHeartbeat> hb(new RegistrationHeartbeat());
  hb->frame_ = contract::encode_registration(contract_record);
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
