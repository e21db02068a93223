#include "connector/heartbeat.h"

#include "common/log.h"
#include "common/metrics.h"

#include <algorithm>

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

void LoadFeed::post(const engine::EngineLoad& load, std::vector<engine::KvCacheEvent> events) {
  std::lock_guard<std::mutex> lock(mutex_);
  load_ = load;
  if (events_.empty()) {
    events_ = std::move(events);
  } else {
    events_.insert(events_.end(), events.begin(), events.end());
  }
}

LoadFeed::Taken LoadFeed::take() {
  std::lock_guard<std::mutex> lock(mutex_);
  Taken taken;
  taken.load = load_;
  taken.events.swap(events_);
  return taken;
}

Result<std::unique_ptr<RegistrationHeartbeat>> RegistrationHeartbeat::start(
    RegistrationRecord record, std::string router_address, int64_t interval_ms, std::optional<auth::CurveKeys> curve,
    std::shared_ptr<LoadFeed> feed, int64_t load_interval_ms) {
  PD_ASSIGN_OR_RETURN(contract::RegistrationRecord contract_record, to_contract_record(record));
  std::unique_ptr<RegistrationHeartbeat> hb(new RegistrationHeartbeat());
  hb->frame_ = contract::encode_registration(contract_record);
  hb->record_ = contract_record;
  hb->interval_ms_ = interval_ms;
  hb->feed_ = std::move(feed);
  hb->load_interval_ms_ = std::max<int64_t>(1, load_interval_ms);
  try {
    hb->socket_ = zmq::socket_t(hb->context_, zmq::socket_type::dealer);
    hb->socket_.set(zmq::sockopt::linger, 0);
    // Stale registrations are worthless; keep at most two. Cache events are worth a little more
    // queue (a snapshot spans several frames); a frame lost to a full queue is a gap the router repairs.
    hb->socket_.set(zmq::sockopt::sndhwm, hb->feed_ ? 64 : 2);
    hb->socket_.set(zmq::sockopt::rcvhwm, 16);
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

bool RegistrationHeartbeat::send_frame(const std::vector<uint8_t>& frame) {
  static auto& sent_counter = metrics::Registry::global().counter("pd_connector_registrations_sent_total",
                                                                  "Registration heartbeats sent to the router");
  try {
    if (socket_.send(zmq::buffer(frame), zmq::send_flags::dontwait)) {
      num_sent_.fetch_add(1);
      sent_counter.inc();
      return true;
    }
  } catch (const zmq::error_t& e) {
    PD_LOG_WARN("registration: send failed: {}", e.what());
  }
  num_dropped_.fetch_add(1);
  return false;
}

bool RegistrationHeartbeat::receive_resync() {
  bool asked = false;
  // At most a bounded number of messages per call: the router sends few.
  for (int i = 0; i < 64; ++i) {
    zmq::message_t message;
    try {
      if (!socket_.recv(message, zmq::recv_flags::dontwait)) break;
    } catch (const zmq::error_t&) {
      break;
    }
    if (contract::is_kv_resync(message.data(), message.size())) {
      asked = true;
    } else {
      PD_LOG_WARN("registration: ignored a {}-byte message from the router that is not a resync", message.size());
    }
  }
  return asked;
}

bool RegistrationHeartbeat::send_load_frame(bool registration_due) {
  LoadFeed::Taken taken = feed_->take();
  publisher_.apply(taken.events);
  if (taken.load) last_load_ = taken.load;
  if (receive_resync()) {
    num_resyncs_.fetch_add(1);
    publisher_.request_reset();
  }
  contract::Heartbeat heartbeat;
  heartbeat.record = record_;
  const uint32_t block_size = last_load_ ? static_cast<uint32_t>(std::max(1, last_load_->block_size)) : 16u;
  heartbeat.kv = publisher_.next_batch(block_size);
  if (last_load_) {
    const engine::EngineLoad& l = *last_load_;
    auto clamp = [](int64_t value, uint64_t max_value) {
      return static_cast<uint64_t>(std::clamp<int64_t>(value, 0, static_cast<int64_t>(max_value)));
    };
    contract::LoadReport report;
    report.num_running = static_cast<uint32_t>(clamp(l.num_running, contract::kMaxReportedRequests));
    report.num_waiting = static_cast<uint32_t>(clamp(l.num_waiting, contract::kMaxReportedRequests));
    report.num_kv_blocks_total = static_cast<uint32_t>(clamp(l.num_kv_blocks_total, contract::kMaxReportedBlocks));
    report.num_kv_blocks_free = static_cast<uint32_t>(clamp(l.num_kv_blocks_free, report.num_kv_blocks_total));
    report.num_queued_prefill_tokens = clamp(l.num_queued_prefill_tokens, contract::kMaxReportedQueuedTokens);
    heartbeat.load = report;
  }
  if (heartbeat.kv->has_events() || heartbeat.load != last_sent_load_ || registration_due) {
    if (!send_frame(contract::encode_heartbeat(heartbeat))) {
      // The router never saw this batch: start over with a snapshot, after the
      // usual pause (a full queue is not pushed harder).
      if (heartbeat.kv->has_events()) publisher_.request_reset();
      return false;
    }
    last_sent_load_ = heartbeat.load;
  }
  return publisher_.has_pending();
}

void RegistrationHeartbeat::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  auto next_registration = std::chrono::steady_clock::now();
  while (!stop_) {
    const auto now = std::chrono::steady_clock::now();
    const bool registration_due = now >= next_registration;
    if (registration_due) next_registration = now + std::chrono::milliseconds(interval_ms_);
    bool more = false;
    if (feed_) {
      lock.unlock();
      more = send_load_frame(registration_due);
      lock.lock();
    } else if (registration_due) {
      send_frame(frame_);
    }
    if (more) continue;  // the rest of a snapshot or of a large batch, at once
    const int64_t wait_ms = feed_ ? load_interval_ms_ : interval_ms_;
    cv_.wait_for(lock, std::chrono::milliseconds(wait_ms), [this] { return stop_; });
  }
}

}  // namespace pd::connector
