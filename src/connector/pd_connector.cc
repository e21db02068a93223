#include "connector/pd_connector.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "common/clock.h"
#include "common/curve_auth.h"
#include "common/log.h"
#include "connector/peer_auth.h"
#include "engine/engine_request.h"
#include "engine/sampling_params.h"

namespace pd::connector {
namespace {

int64_t now_ms() {
  return now_ns() / 1'000'000;
}

std::string default_instance_id(KvRole role) {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return fmt::format("{}-{}-{}", kv_role_short_name(role), host, getpid());
}

// Test hook (DESIGN §3.1 fault backend): PD_CONNECTOR_XFER_FAULT=fail|drop|delay:<ms>[:<num_batches>]
// arms xfer's fault injector at start-up, so integration tests can make real
// transfers fail or stall in a real process.
std::optional<xfer::FaultSpec> fault_from_env() {
  const char* text = std::getenv("PD_CONNECTOR_XFER_FAULT");
  if (text == nullptr || *text == '\0') return std::nullopt;
  std::string spec(text);
  xfer::FaultSpec fault;
  auto take = [&spec]() {
    auto colon = spec.find(':');
    std::string head = spec.substr(0, colon);
    spec = colon == std::string::npos ? "" : spec.substr(colon + 1);
    return head;
  };
  const std::string mode = take();
  if (mode == "fail")
    fault.mode = xfer::FaultMode::kFail;
  else if (mode == "drop")
    fault.mode = xfer::FaultMode::kDrop;
  else if (mode == "delay") {
    fault.mode = xfer::FaultMode::kDelay;
    fault.delay_ms = std::atoll(take().c_str());
  } else {
    return std::nullopt;
  }
  if (!spec.empty()) fault.num_batches = std::atoll(take().c_str());
  return fault;
}

}  // namespace

// Worker-side hooks for one step: posts each layer's writes for the transfers
// whose prompt completes in this step, right after that layer's attention.
class PdConnector::StepHooks final : public engine::LayerKvHooks {
 public:
  explicit StepHooks(PdConnector* owner) : owner_(owner) {}
  void wait_for_layer_load(int32_t) override {}  // loads complete before a request is scheduled
  void save_layer(int32_t layer) override {
    for (const auto& id : owner_->final_step_transfers_) owner_->producer_->on_layer_saved(id, layer);
    owner_->run_actions();
  }

 private:
  PdConnector* owner_;
};

PdConnector::PdConnector(PdConnectorOptions options, engine::ModelRunner* runner)
    : options_(std::move(options)), config_(options_.config), runner_(runner), spec_(runner->kv_cache_spec()) {}

Result<std::unique_ptr<PdConnector>> PdConnector::create(PdConnectorOptions options, engine::ModelRunner* runner) {
  if (runner == nullptr) return invalid_argument("PdConnector needs a model runner");
  std::unique_ptr<PdConnector> connector(new PdConnector(std::move(options), runner));
  PD_RETURN_IF_ERROR(connector->init());
  return connector;
}

PdConnector::Metrics PdConnector::Metrics::create() {
  Metrics m;
  auto& reg = metrics::Registry::global();
  m.started_producer =
      &reg.counter("pd_connector_transfers_started_total", "KV transfers started", {{"side", "producer"}});
  m.started_consumer =
      &reg.counter("pd_connector_transfers_started_total", "KV transfers started", {{"side", "consumer"}});
  m.done_producer = &reg.counter("pd_connector_transfers_done_total", "KV transfers completed", {{"side", "producer"}});
  m.done_consumer = &reg.counter("pd_connector_transfers_done_total", "KV transfers completed", {{"side", "consumer"}});
  m.failed_producer =
      &reg.counter("pd_connector_transfers_failed_total", "KV transfers failed", {{"side", "producer"}});
  m.failed_consumer =
      &reg.counter("pd_connector_transfers_failed_total", "KV transfers failed", {{"side", "consumer"}});
  m.bytes_written =
      &reg.counter("pd_connector_bytes_total", "KV bytes moved by this instance", {{"direction", "write"}});
  m.bytes_read = &reg.counter("pd_connector_bytes_total", "KV bytes moved by this instance", {{"direction", "read"}});
  m.transfer_seconds =
      &reg.histogram("pd_connector_transfer_seconds", "Consumer-side time from admission to KV arrival");
  m.blocks_held = &reg.gauge("pd_connector_blocks_held", "Producer blocks held for transfers");
  m.load_errors = &reg.counter("pd_connector_load_errors_total", "Remote KV loads that failed");
  m.recomputes = &reg.counter("pd_connector_recomputes_total",
                              "Requests that recompute KV locally after a failed or timed-out load");
  m.timeouts = &reg.counter("pd_connector_timeouts_total", "Connector timeouts (defer, transfer, handshake, recv)");
  m.refused = &reg.counter("pd_connector_control_messages_refused_total",
                           "Well-formed control messages refused (forged, unknown transfer, wrong peer, bad ids)");
  m.handshakes_refused =
      &reg.counter("pd_connector_handshakes_refused_total", "Handshakes refused (layout mismatch, bad descriptors)");
  m.first_tokens_accepted =
      &reg.counter("pd_connector_first_tokens_total", "Consumer: first output tokens handed over by the producer",
                   {{"result", "accepted"}});
  m.first_tokens_refused =
      &reg.counter("pd_connector_first_tokens_total", "Consumer: first output tokens handed over by the producer",
                   {{"result", "refused_sampling_key"}});

  m.first_tokens_streamed =
      &reg.counter("pd_connector_first_tokens_streamed_total",
                   "Consumer: handed-over first tokens streamed to the client as their done arrived");
  m.dones_on_completion =
      &reg.counter("pd_connector_dones_on_completion_total",
                   "Producer: WRITE dones sent as the last write completed, ahead of the engine thread");
  return m;
}

Status PdConnector::create_transfer_engine() {
  xfer::EngineConfig xcfg;
  xcfg.name = record_.instance_id;
  xcfg.listen_host = config_.kv_ip;
  xcfg.batch_timeout_ms = config_.transfer_timeout_ms;
  // xfer keys its shared-memory policy off the transports it is given, so the
  // standard UCX variable is passed through explicitly rather than left to UCX.
  if (const char* tls = std::getenv("UCX_TLS"); tls != nullptr) xcfg.ucx_transports = tls;
  switch (config_.backend) {
    case TransferBackend::kUcx:
      xcfg.backends = {"ucx"};
      break;
    case TransferBackend::kCuda:
      xcfg.backends = {"cuda"};
      break;
    case TransferBackend::kAuto:
      xcfg.backends =
          runner_->kv_on_device() ? std::vector<std::string>{"cuda", "ucx"} : std::vector<std::string>{"ucx"};
      break;
  }
  const auto fault = fault_from_env();
  xcfg.enable_fault_injection = fault.has_value();
  PD_ASSIGN_OR_RETURN(xfer_, xfer::TransferEngine::create(xcfg));
  if (fault && xfer_->fault_injector() != nullptr) {
    xfer_->fault_injector()->set_fault(*fault);
    PD_LOG_WARN("connector: xfer fault injection armed from PD_CONNECTOR_XFER_FAULT");
  }
  record_.boot_nonce = xfer_->boot_nonce();
  return Status::Ok();
}

Status PdConnector::register_kv_regions() {
  const xfer::MemKind kind = runner_->kv_on_device() ? xfer::MemKind::kCuda : xfer::MemKind::kHost;
  // Every tensor-parallel rank's KV shard: its heads, and its region of every layer.
  const int32_t num_ranks = runner_->kv_num_ranks();
  if (num_ranks < 1 || num_ranks > kMaxTpSize) return failed_precondition("runner has {} KV ranks", num_ranks);
  engine::KvCacheSpec rank_spec = spec_;
  rank_spec.num_kv_heads = runner_->kv_heads_per_rank();
  const uint64_t element_bytes = engine::kv_dtype_bytes(spec_.dtype);
  const uint64_t row_bytes = static_cast<uint64_t>(spec_.head_dim) * element_bytes;
  block_layout_.block_size = spec_.block_size;
  block_layout_.section_row_bytes = {row_bytes, row_bytes};
  if (spec_.dtype == engine::KvDtype::kFp8E4m3) block_layout_.section_row_bytes = {row_bytes, row_bytes, 4, 4};
  if (block_layout_.block_bytes(rank_spec.num_kv_heads) != rank_spec.bytes_per_block()) {
    return internal_error("KV block of {} bytes per rank, the transfer layout says {}", rank_spec.bytes_per_block(),
                          block_layout_.block_bytes(rank_spec.num_kv_heads));
  }
  for (int32_t rank = 0; rank < num_ranks; ++rank) {
    local_heads_.push_back(RankHeads{runner_->kv_rank_head_begin(rank), rank_spec.num_kv_heads});
    for (int32_t layer = 0; layer < spec_.num_layers; ++layer) {
      void* base = runner_->kv_rank_layer_base(rank, layer);
      if (base == nullptr) return failed_precondition("runner has no KV region for rank {} layer {}", rank, layer);
      PD_ASSIGN_OR_RETURN(xfer::MemDesc desc,
                          xfer_->register_memory(base, rank_spec.bytes_per_layer(), kind, runner_->kv_device_index()));
      local_regions_.push_back(std::move(desc));
    }
  }
  PD_RETURN_IF_ERROR(validate_head_map(fingerprint().num_kv_heads, local_heads_).with_context("runner"));
  engine_desc_bytes_ = xfer::encode(xfer_->describe());
  return Status::Ok();
}

Status PdConnector::start_control_plane() {
  std::optional<auth::CurveKeys> curve;
  if (!config_.control_secret_file.empty()) {
    PD_ASSIGN_OR_RETURN(std::string secret, auth::read_secret_file(config_.control_secret_file));
    PD_ASSIGN_OR_RETURN(auth::CurveKeys keys, auth::derive_curve_keys(secret));
    curve = keys;
  }
  ControlPlaneConfig ccfg;
  ccfg.bind_host = config_.kv_ip;
  ccfg.port = config_.handshake_port;
  ccfg.handshake_timeout_ms = config_.handshake_timeout_ms;
  ccfg.curve = curve;
  ccfg.instance_label = record_.instance_id;
  PD_ASSIGN_OR_RETURN(control_,
                      ControlPlane::start(ccfg, [this](InboundMessage m) { on_control_message(std::move(m)); }));
  curve_ = curve;
  return Status::Ok();
}

// Start-up, in dependency order: metrics, identity, the transfer engine (its boot
// nonce is ours), our KV regions registered with it, the state machines, the
// control plane (its address goes into the record), the completion thread.
Status PdConnector::init() {
  metrics_ = Metrics::create();
  record_.instance_id = options_.instance_id.empty() ? default_instance_id(config_.role) : options_.instance_id;
  if (record_.instance_id.size() > kMaxInstanceIdBytes) {
    return invalid_argument("instance id longer than {} bytes", kMaxInstanceIdBytes);
  }
  PD_RETURN_IF_ERROR(create_transfer_engine());
  PD_RETURN_IF_ERROR(register_kv_regions());
  producer_ = std::make_unique<ProducerTransfers>(
      spec_.num_layers, spec_.block_size, ProducerTimeouts{config_.defer_timeout_ms, config_.transfer_timeout_ms});
  consumer_ = std::make_unique<ConsumerTransfers>(
      spec_.num_layers, spec_.block_size, ConsumerTimeouts{config_.handshake_timeout_ms, config_.transfer_timeout_ms});
  hooks_ = std::make_unique<StepHooks>(this);
  PD_RETURN_IF_ERROR(start_control_plane());
  record_.role = kv_role_short_name(config_.role);
  record_.http = options_.http_address;
  record_.control = control_->address();
  record_.mode =
      contract::mode_name(config_.read_mode ? contract::TransferMode::kRead : contract::TransferMode::kWrite);
  record_.model = options_.served_model_name;
  record_.tp_size = static_cast<int32_t>(local_heads_.size());
  record_.dp_size = 1;
  // /pd/info and the registration hold only what the contract accepts (a control address
  // it cannot parse, e.g. an IPv6 kv_ip without brackets, would be refused by the router).
  if (auto checked = to_contract_record(record_); !checked.ok()) return checked.status();
  if (config_.registers_with_router()) load_feed_ = std::make_shared<LoadFeed>();
  completion_thread_ = std::thread([this] { completion_loop(); });
  PD_LOG_INFO("connector: {} {} mode, instance {} nonce {}, control {}", record_.role, record_.mode,
              record_.instance_id, record_.boot_nonce, record_.control);
  return Status::Ok();
}

PdConnector::~PdConnector() {
  heartbeat_.reset();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  pending_cv_.notify_all();
  if (completion_thread_.joinable()) completion_thread_.join();
  control_.reset();
  // Batches still in flight finish (or fail) by their own deadlines inside xfer.
  for (auto& [key, peer] : producer_side_peers_) peer.sessions.clear();
  for (auto& [key, peer] : consumer_side_peers_) peer.sessions.clear();
  if (xfer_) {
    for (const auto& desc : local_regions_) {
      Status s = xfer_->deregister(desc.region_id);
      if (!s.ok()) PD_LOG_WARN("connector: {}", s.to_string());
    }
  }
  xfer_.reset();
}

Status PdConnector::start_registration(const std::string& http_address) {
  RegistrationRecord record;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!http_address.empty()) {
      RegistrationRecord with_http = record_;
      with_http.http = http_address;
      if (auto checked = to_contract_record(with_http); checked.ok()) {
        record_.http = http_address;
      } else if (config_.registers_with_router()) {
        return checked.status();
      } else {
        // Without a router the address only shows in /pd/info, as not known ("").
        PD_LOG_WARN("connector: {}; /pd/info leaves http empty", checked.status().message());
      }
    }
    record = record_;
  }
  if (!config_.registers_with_router() || heartbeat_) return Status::Ok();
  PD_ASSIGN_OR_RETURN(
      heartbeat_, RegistrationHeartbeat::start(record, fmt::format("{}:{}", config_.proxy_ip, config_.proxy_ping_port),
                                               options_.registration_interval_ms, curve_, load_feed_));
  return Status::Ok();
}

void PdConnector::report_load(const engine::EngineLoad& load, std::vector<engine::KvCacheEvent> events) {
  if (load_feed_) load_feed_->post(load, std::move(events));
}

nlohmann::json PdConnector::info_json() const {
  std::lock_guard<std::mutex> lock(mutex_);
  // record_ passed to_contract_record in init and whenever its http changed.
  Result<contract::RegistrationRecord> record = to_contract_record(record_);
  return record.ok() ? contract::registration_to_json(*record) : nlohmann::json::object();
}

Result<TransferParams> PdConnector::parse_request_params(const nlohmann::json& params,
                                                         int32_t num_prompt_tokens) const {
  PD_ASSIGN_OR_RETURN(TransferParams parsed,
                      parse_transfer_params(params, config_, num_prompt_tokens, spec_.block_size));
  if (parsed.side == TransferSide::kProducer && num_prompt_tokens == 0) {
    return invalid_argument("kv_transfer_params: empty prompt");
  }
  return parsed;
}

KvFingerprint PdConnector::fingerprint() const {
  // The model's KV heads: the ranks' ranges together (spec_.num_kv_heads counts replicas).
  int32_t num_kv_heads = 0;
  for (const RankHeads& h : local_heads_) num_kv_heads = std::max(num_kv_heads, h.begin + h.count);
  KvFingerprint f{spec_.num_layers,
                  num_kv_heads,
                  spec_.head_dim,
                  engine::kv_dtype_name(spec_.dtype),
                  spec_.block_size,
                  static_cast<int32_t>(local_heads_.size()),
                  {}};
  if (local_heads_.size() > 1) f.head_map = local_heads_;
  return f;
}

ControlMessage PdConnector::meta_message(MessageType type) const {
  ControlMessage m;
  m.type = type;
  m.instance_id = record_.instance_id;
  m.boot_nonce = record_.boot_nonce;
  m.engine_desc = engine_desc_bytes_;
  for (const auto& desc : local_regions_) m.layer_descs.push_back(xfer::encode(desc));
  m.fingerprint = fingerprint();
  m.num_blocks = spec_.num_blocks;
  return m;
}

void PdConnector::release_transfer(std::string transfer_id, std::function<void(bool)> done) {
  push_inbox(ReleaseCall{std::move(transfer_id), std::move(done)});
}

void PdConnector::bind_engine_wakeup(std::function<void()> wakeup) {
  std::lock_guard<std::mutex> lock(mutex_);
  wakeup_ = std::move(wakeup);
}

void PdConnector::bind_first_token_sink(engine::FirstTokenSink sink) {
  std::lock_guard<std::mutex> lock(mutex_);
  first_token_sink_ = std::move(sink);
}

void PdConnector::wake() {
  std::function<void()> wakeup;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    wakeup = wakeup_;
  }
  if (wakeup) wakeup();
}

void PdConnector::push_inbox(InboxItem item) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    inbox_.push_back(std::move(item));
  }
  wake();
}

void PdConnector::on_control_message(InboundMessage in) {
  // A `done` that completes a hand-over as expected: the state machine will take it
  // with its token at the next poll (same transfer, same producer incarnation, same
  // prompt length and sampling key, sent while WaitingDone), so the token goes to
  // the client now instead of after the engine's step in flight. Checked and queued
  // under one lock with the deadline: a poll that misses this message read its
  // clock before it, so the engine cannot have expired the request (engine.cc).
  // A `read_ok` passing the same checks only records its token: the KV is not read
  // yet (push_completion streams it). An `abort` or `error` about the transfer, queued
  // ahead of what completes it, may fail it: nothing is streamed for it any more.
  std::optional<std::pair<std::string, int32_t>> stream;
  engine::FirstTokenSink sink;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const ControlMessage& m = in.message;
    auto it = consumer_loads_.find(m.transfer_id);
    if (it != consumer_loads_.end() && it->second.hand_over && it->second.hand_over->armed) {
      HandOverExpected& e = *it->second.hand_over;
      const bool from_producer = in.from == e.from && m.instance_id == e.instance_id && m.boot_nonce == e.boot_nonce &&
                                 m.sampling_key == e.sampling_key;
      if (m.type == MessageType::kDone && !e.read_mode && m.ok && m.first_token && from_producer &&
          m.num_tokens == e.num_prompt_tokens && now_ns() < e.deadline_ns) {
        stream.emplace(it->second.request_id, *m.first_token);
        sink = first_token_sink_;
        it->second.hand_over.reset();  // streamed once
      } else if (m.type == MessageType::kReadOk && e.read_mode && m.first_token && from_producer && !e.read_token &&
                 e.num_reads_left < 0) {
        e.read_token = m.first_token;
      } else if (m.type == MessageType::kAbort || m.type == MessageType::kError) {
        it->second.hand_over.reset();
      }
    }
    inbox_.push_back(std::move(in));
  }
  if (stream && sink) {
    metrics_.first_tokens_streamed->inc();
    sink(stream->first, stream->second);
  }
  wake();
}

void PdConnector::push_completion(Completion completion) {
  // The last read of a READ hand-over, every read ok: the state machine finishes the
  // transfer with the token when it takes this completion (nothing queued ahead of it
  // can fail the transfer: on_control_message dropped the expectation for those), so
  // the token goes to the client now, not after the engine's step in flight. Queued
  // under the lock of the check, as for `done`.
  std::optional<std::pair<std::string, int32_t>> stream;
  engine::FirstTokenSink sink;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = completion.is_write ? consumer_loads_.end() : consumer_loads_.find(completion.transfer_id);
    if (it != consumer_loads_.end() && it->second.hand_over && it->second.hand_over->read_mode &&
        it->second.hand_over->num_reads_left > 0) {
      HandOverExpected& e = *it->second.hand_over;
      if (!completion.ok) {
        it->second.hand_over.reset();
      } else if (--e.num_reads_left == 0) {
        if (e.read_token && now_ns() < e.deadline_ns) {
          stream.emplace(it->second.request_id, *e.read_token);
          sink = first_token_sink_;
        }
        it->second.hand_over.reset();  // streamed once
      }
    }
    inbox_.push_back(std::move(completion));
  }
  if (stream && sink) {
    metrics_.first_tokens_streamed->inc();
    sink(stream->first, stream->second);
  }
  wake();
}

void PdConnector::completion_loop() {
  while (true) {
    PendingBatch batch;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      pending_cv_.wait(lock, [this] { return stopping_ || !pending_batches_.empty(); });
      if (stopping_) return;
      batch = std::move(pending_batches_.front());
      pending_batches_.pop_front();
    }
    // Bounded wait: xfer fails every batch at its own deadline, so this loop
    // always makes progress; the short slice keeps shutdown prompt. A batch that
    // failed at its own deadline also answers kDeadlineExceeded: only one that
    // is still pending goes back in the queue, else it would circle forever and
    // its transfer would hold its blocks forever.
    Status status = xfer_->wait(batch.id, Deadline::after_ms(100));
    if (status.code() == ErrorCode::kDeadlineExceeded && xfer_->poll(batch.id).pending()) {
      std::lock_guard<std::mutex> lock(mutex_);
      pending_batches_.push_back(std::move(batch));
      continue;
    }
    xfer_->release(batch.id);
    batch.completion.ok = status.ok();
    batch.completion.message = status.ok() ? "" : status.message();
    // The last write of a transfer whose done is settled: send it from here, not
    // after the engine thread's step in flight.
    std::optional<OutgoingMessage> early_done;
    if (batch.completion.is_write) {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = write_batches_.find(batch.completion.transfer_id);
      if (it != write_batches_.end()) {
        WriteBatches& w = it->second;
        if (w.num_pending > 0) --w.num_pending;
        if (!batch.completion.ok) {
          w.failed = true;  // kept until the transfer ends, so a later offer is refused
          w.done.reset();
        } else if (w.num_pending == 0 && !w.failed) {
          early_done = std::move(w.done);
          write_batches_.erase(it);
        }
      }
    }
    if (early_done) {
      std::string transfer_id = early_done->message.transfer_id;
      send(std::move(*early_done));
      metrics_.dones_on_completion->inc();
      push_inbox(
          EarlyDoneSent{std::move(transfer_id)});  // before the completion: the state machine sends no second done
    }
    push_completion(std::move(batch.completion));
  }
}

// ---------------------------------------------------------------------------
// Scheduler side

Result<engine::ExternalMatch> PdConnector::get_num_new_matched_tokens(const engine::Request& request,
                                                                      int32_t num_local_computed_tokens) {
  engine::ExternalMatch match;
  if (!request.kv_transfer_params()) return match;
  const TransferParams& params = *request.kv_transfer_params();
  const int64_t now = now_ms();
  if (params.side == TransferSide::kProducer) {
    PD_RETURN_IF_ERROR(
        producer_->start(params.transfer_id, request.request_id(), params.read_mode, request.num_prompt_tokens(), now));
    auto state = std::make_unique<RequestState>();
    state->producer = true;
    state->transfer_id = params.transfer_id;
    state->read_mode = params.read_mode;
    request.connector_state = std::move(state);
    metrics_.started_producer->inc();
    run_actions();
    return match;
  }
  const int64_t timeout_ms =
      std::min(config_.recv_abort_timeout_ms, config_.handshake_timeout_ms + config_.transfer_timeout_ms);
  ConsumerTransfers::Params cp;
  cp.transfer_id = params.transfer_id;
  cp.read_mode = params.read_mode;
  cp.remote_instance_id = params.remote_instance_id;
  cp.remote_control = params.remote_control;
  cp.remote_boot_nonce = params.remote_boot_nonce;
  cp.remote_block_ids = params.remote_block_ids;
  // The producer's first token stands for ours only without logprobs (it sends
  // no logprobs) and when both legs sample alike (checked by sampling key).
  cp.want_first_token = config_.first_token_handover && request.sampling().logprobs < 0;
  cp.sampling_key = engine::first_token_sampling_key(request.sampling());
  const bool want_first_token = cp.want_first_token;
  const int32_t num_external = consumer_->admit(request.request_id(), std::move(cp), num_local_computed_tokens,
                                                request.num_prompt_tokens(), now);
  if (num_external < 0) {
    return failed_precondition("transfer {} or request {} is already active on this consumer", params.transfer_id,
                               request.request_id());
  }
  PD_LOG_DEBUG("connector: admit {} transfer {} local {} external {}", request.request_id(), params.transfer_id,
               num_local_computed_tokens, num_external);
  run_actions();
  if (num_external == 0) return match;
  metrics_.started_consumer->inc();
  auto state = std::make_unique<RequestState>();
  state->transfer_id = params.transfer_id;
  state->read_mode = params.read_mode;
  state->num_local_computed_tokens = num_local_computed_tokens;
  state->loading = true;
  request.connector_state = std::move(state);
  ConsumerLoad load{request.request_id(), now_ns(), std::nullopt};
  if (want_first_token) {
    // The engine sets its deadline after this call, from the same timeout: this one is not later.
    load.hand_over = HandOverExpected{};
    HandOverExpected& e = *load.hand_over;
    e.from = PeerKey::dialled(params.remote_control);
    e.instance_id = params.remote_instance_id;
    e.boot_nonce = params.remote_boot_nonce;
    e.num_prompt_tokens = request.num_prompt_tokens();
    e.sampling_key = engine::first_token_sampling_key(request.sampling());
    e.deadline_ns = load.admitted_ns + timeout_ms * 1'000'000;
    e.read_mode = params.read_mode;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    consumer_loads_.insert_or_assign(params.transfer_id, std::move(load));
  }
  match.num_external_tokens = num_external;
  match.includes_last_prompt_token = want_first_token;
  match.load_async = true;
  // Every consumer state is bounded by transfer_timeout (after the handshake's own bound):
  // a producer that stopped answering costs that, not recv_abort_timeout.
  match.timeout_ms = timeout_ms;
  return match;
}

void PdConnector::update_state_after_alloc(const engine::Request& request, std::span<const int32_t> block_ids,
                                           int32_t num_external_tokens) {
  const RequestState* state = state_of(request);
  if (state == nullptr || !state->loading) return;
  PD_LOG_DEBUG("connector: allocated {} ({} blocks, {} external tokens)", request.request_id(), block_ids.size(),
               num_external_tokens);
  consumer_->allocated(request.request_id(), std::vector<int32_t>(block_ids.begin(), block_ids.end()),
                       state->num_local_computed_tokens, num_external_tokens, now_ms());
  run_actions();
}

engine::LayerKvHooks* PdConnector::build_step_hooks(const engine::StepInput& input, const engine::StepPlan& plan) {
  final_step_transfers_.clear();
  for (const engine::ScheduledSeq& s : plan.seqs) {
    if (s.request == nullptr) continue;
    const RequestState* state = state_of(*s.request);
    if (state == nullptr || !state->producer) continue;
    if (s.num_computed_tokens + s.num_new_tokens < s.request->num_prompt_tokens()) continue;
    if (s.num_computed_tokens >= s.request->num_prompt_tokens()) continue;  // decoding past the prompt
    producer_->begin_final_step(state->transfer_id, s.request->block_ids);
    final_step_transfers_.push_back(state->transfer_id);
  }
  return final_step_transfers_.empty() ? nullptr : hooks_.get();
}

void PdConnector::after_step(const engine::StepPlan& plan, const Status& status) {
  for (const auto& id : final_step_transfers_) producer_->on_forward_done(id, status.ok());
  final_step_transfers_.clear();
  run_actions();
}

void PdConnector::first_token_sampled(const engine::Request& request, int32_t token_id) {
  const RequestState* state = state_of(request);
  if (state == nullptr || !state->producer) return;
  producer_->first_token_sampled(state->transfer_id, token_id, engine::first_token_sampling_key(request.sampling()));
  run_actions();
}

bool PdConnector::request_preempted(const engine::Request& request, std::span<const int32_t> block_ids) {
  // A producer's writes only start in the step that completes its prompt, and
  // that step also finishes it, so a preempted producer request holds nothing.
  const bool hold = consumer_->request_preempted(request.request_id(), now_ms());
  PD_LOG_DEBUG("connector: preempted {} hold {}", request.request_id(), hold);
  forget_load(request);
  run_actions();
  return hold;
}

engine::FinishDecision PdConnector::request_finished(const engine::Request& request,
                                                     std::span<const int32_t> block_ids) {
  engine::FinishDecision decision;
  const std::string& id = request.request_id();
  if (const RequestState* state = state_of(request); state != nullptr && state->producer) {
    const std::string& transfer_id = state->transfer_id;
    const bool read_mode = state->read_mode;
    const bool kv_complete = request.num_computed_tokens >= request.num_prompt_tokens();
    std::vector<int32_t> blocks(block_ids.begin(), block_ids.end());
    decision.delay_free_blocks = producer_->request_finished(transfer_id, blocks, kv_complete, now_ms());
    if (kv_complete) {
      contract::ProducerAnswer answer;
      answer.transfer_id = transfer_id;
      answer.producer = contract::ProducerLocation{record_.instance_id, record_.control, record_.boot_nonce};
      answer.mode = read_mode ? contract::TransferMode::kRead : contract::TransferMode::kWrite;
      answer.num_tokens = request.num_prompt_tokens();
      if (decision.delay_free_blocks) {
        const size_t n = static_cast<size_t>(blocks_for_tokens(request.num_prompt_tokens(), spec_.block_size));
        answer.block_ids = std::vector<int32_t>(blocks.begin(), blocks.begin() + std::min(n, blocks.size()));
      }
      decision.kv_transfer_params = std::move(answer);
    }
    run_actions();
    return decision;
  }
  forget_load(request);
  decision.delay_free_blocks = consumer_->request_finished(id, now_ms());
  PD_LOG_DEBUG("connector: finished {} delay_free {}", id, decision.delay_free_blocks);
  run_actions();
  return decision;
}

engine::RemoteKvTimeoutAction PdConnector::on_remote_kv_timeout(const engine::Request& request) {
  const auto transfer = consumer_->transfer_of_request(request.request_id());
  const bool fail = config_.on_failure == FailurePolicy::kFail;
  PD_LOG_WARN("connector: request {} (transfer {}) got no KV within {} ms; {}", request.request_id(),
              transfer.value_or("?"),
              std::min(config_.recv_abort_timeout_ms, config_.handshake_timeout_ms + config_.transfer_timeout_ms),
              fail ? "failing it" : "recomputing");
  consumer_->on_remote_kv_timeout(request.request_id());
  forget_load(request);
  if (transfer) metrics_.failed_consumer->inc();
  run_actions();
  if (fail) return engine::RemoteKvTimeoutAction::kFail;
  metrics_.recomputes->inc();
  return engine::RemoteKvTimeoutAction::kRecomputeLocally;
}

// ---------------------------------------------------------------------------
// Poll: inbox -> state machines -> actions -> events

engine::ConnectorEvents PdConnector::poll() {
  std::deque<InboxItem> items;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    items.swap(inbox_);
  }
  const int64_t now = now_ms();
  std::vector<std::pair<std::function<void(bool)>, bool>> release_answers;
  for (auto& item : items) {
    if (auto* in = std::get_if<InboundMessage>(&item)) {
      handle_message(*in, now);
    } else if (auto* early = std::get_if<EarlyDoneSent>(&item)) {
      producer_->on_done_sent_early(early->transfer_id);
      run_actions();
    } else if (auto* call = std::get_if<ReleaseCall>(&item)) {
      const bool released = config_.is_producer() && producer_->release(call->transfer_id);
      PD_LOG_INFO("connector: transfer {} released on request ({})", call->transfer_id,
                  released ? "was active" : "not active here");
      release_answers.emplace_back(std::move(call->done), released);
    } else {
      const auto& c = std::get<Completion>(item);
      if (c.ok)
        (c.is_write ? metrics_.bytes_written : metrics_.bytes_read)->inc(static_cast<double>(c.bytes));
      else
        PD_LOG_WARN("connector: {} of layer {} (plan piece {}) for transfer {} failed: {}",
                    c.is_write ? "write" : "read", c.layer, c.piece, c.transfer_id, c.message);
      if (c.is_write)
        producer_->on_write_done(c.transfer_id, c.layer, c.ok, c.piece);
      else
        consumer_->on_read_done(c.transfer_id, c.layer, c.ok, c.piece);
    }
    run_actions();
  }
  producer_->tick(now);
  consumer_->tick(now);
  run_actions();
  drop_finished_write_batches();
  metrics_.blocks_held->set(static_cast<double>(producer_->num_blocks_held()));
  for (auto& [done, released] : release_answers) {
    if (done) done(released);
  }
  engine::ConnectorEvents out = std::move(events_);
  events_ = engine::ConnectorEvents{};
  return out;
}

void PdConnector::reply_error(const PeerKey& to, const std::string& transfer_id, const std::string& text) {
  ControlMessage m;
  m.type = MessageType::kError;
  m.transfer_id = transfer_id;
  m.text = text;
  send(OutgoingMessage{to, std::move(m)});
}

void PdConnector::warn_peer(const std::string& what) {
  // What peers can trigger at their own rate is counted by its metric and logged at most
  // once a second, with how many lines it stands for.
  if (!peer_log_.admit(now_ns())) return;
  if (peer_log_.num_held_back() > 0) {
    PD_LOG_WARN("connector: {} (and {} more such lines held back)", what, peer_log_.num_held_back());
  } else {
    PD_LOG_WARN("connector: {}", what);
  }
}

void PdConnector::note_refused(int32_t count) {
  if (count > 0) metrics_.refused->inc(count);
}

void PdConnector::handle_message(const InboundMessage& in, int64_t now) {
  const ControlMessage& msg = in.message;
  PD_LOG_DEBUG("connector: recv {} {} from {}", message_type_name(msg.type), msg.transfer_id, in.from.to_string());
  auto peer = producer_side_peers_.end();
  std::optional<HandshakeIdentity> handshake;
  if (!in.from.is_dialled()) {
    peer = producer_side_peers_.find(in.from);
    if (peer != producer_side_peers_.end())
      handshake = HandshakeIdentity{peer->second.instance_id, peer->second.boot_nonce};
  }
  const RouteDecision route = route_message(in.from, msg, config_.is_producer(), handshake ? &*handshake : nullptr);
  if (route.check_producer_identity) {
    consumer_->on_producer_identity(in.from.name(), msg.instance_id, msg.boot_nonce);
    run_actions();
  }
  switch (route.route) {
    case MessageRoute::kProducerHandshake:
      handle_meta(in);
      return;
    case MessageRoute::kConsumerHandshake:
      handle_meta_ok(in);
      return;
    case MessageRoute::kProducerMachine: {
      const PeerRef ref{in.from, peer->second.instance_id, peer->second.boot_nonce};
      if (msg.type == MessageType::kBlocks)
        producer_->on_blocks(ref, msg, peer->second.num_blocks, now, static_cast<int32_t>(peer->second.pieces.size()));
      else if (msg.type == MessageType::kRead)
        producer_->on_read(ref, msg, now);
      else if (msg.type == MessageType::kRelease)
        producer_->on_release(ref, msg);
      else
        producer_->on_abort(ref, msg);
      return;
    }
    case MessageRoute::kConsumerMachine: {
      const PeerRef ref{in.from, msg.instance_id, msg.boot_nonce};
      if (msg.type == MessageType::kDone)
        consumer_->on_done(ref, msg);
      else if (msg.type == MessageType::kReadOk)
        consumer_->on_read_ok(ref, msg);
      else
        consumer_->on_abort_or_error(ref, msg);
      return;
    }
    case MessageRoute::kConsumerComplaint:
      warn_peer(fmt::format("error from consumer {}: {}", msg.instance_id, msg.text));
      return;
    case MessageRoute::kHandshakeRequired:
      note_refused(1);
      reply_error(in.from, msg.transfer_id, "handshake (meta) required before transfer messages");
      return;
    case MessageRoute::kUnexpected:
      break;
  }
  note_refused(1);
  warn_peer(fmt::format("'{}' from {} is not expected on this side; dropped", message_type_name(msg.type),
                        in.from.to_string()));
}

Result<PdConnector::PeerInfo> PdConnector::peer_from_meta(const ControlMessage& msg, bool local_is_producer) {
  const KvFingerprint local = fingerprint();
  PD_RETURN_IF_ERROR(check_layout_compatible(local, msg.fingerprint));
  PD_ASSIGN_OR_RETURN(xfer::EngineDesc desc, xfer::decode_engine_desc(msg.engine_desc));
  if (desc.name != msg.instance_id || desc.boot_nonce != msg.boot_nonce) {
    return invalid_argument("engine descriptor names {} (nonce {}), the message says {} (nonce {})", desc.name,
                            desc.boot_nonce, msg.instance_id, msg.boot_nonce);
  }
  PeerInfo peer;
  peer.instance_id = msg.instance_id;
  peer.boot_nonce = msg.boot_nonce;
  peer.num_blocks = msg.num_blocks;
  peer.heads = msg.fingerprint.ranks();
  PD_ASSIGN_OR_RETURN(TransferPlan plan, local_is_producer
                                             ? plan_transfer(local.num_kv_heads, local_heads_, peer.heads)
                                             : plan_transfer(local.num_kv_heads, peer.heads, local_heads_));
  peer.pieces = plan.pieces();
  // Rank r's regions must hold num_blocks blocks of r's heads: every op of the plan
  // then lies inside them (xfer checks each batch against the regions again).
  for (size_t i = 0; i < msg.layer_descs.size(); ++i) {
    const RankHeads& heads = peer.heads[i / static_cast<size_t>(msg.fingerprint.num_layers)];
    const uint64_t layer_bytes = block_layout_.block_bytes(heads.count) * static_cast<uint64_t>(msg.num_blocks);
    PD_ASSIGN_OR_RETURN(xfer::MemDesc mem, xfer::decode_mem_desc(msg.layer_descs[i]));
    if (mem.engine_name != desc.name || mem.boot_nonce != desc.boot_nonce || mem.bytes < layer_bytes) {
      return invalid_argument("layer region of {} bytes from {} does not cover {} blocks of {} KV heads", mem.bytes,
                              mem.engine_name, msg.num_blocks, heads.count);
    }
    peer.regions.push_back(std::move(mem));
  }
  PD_RETURN_IF_ERROR(xfer_->connect(desc));
  return peer;
}

void PdConnector::handle_meta(const InboundMessage& in) {
  if (!config_.is_producer()) {
    reply_error(in.from, "", "this instance is not a producer");
    return;
  }
  auto peer = peer_from_meta(in.message, /*local_is_producer=*/true);
  if (!peer.ok()) {
    metrics_.handshakes_refused->inc();
    warn_peer(fmt::format("refused handshake from {}: {}", in.message.instance_id, peer.status().message()));
    reply_error(in.from, "", peer.status().message());
    return;
  }
  // A new incarnation (or connection) of a known consumer replaces the old one;
  // transfers bound to a dead incarnation fail instead of writing into it.
  for (auto it = producer_side_peers_.begin(); it != producer_side_peers_.end();) {
    if (it->second.instance_id == peer->instance_id && it->first != in.from) {
      if (it->second.boot_nonce != peer->boot_nonce)
        producer_->on_peer_gone(it->second.instance_id, it->second.boot_nonce);
      it = producer_side_peers_.erase(it);
    } else {
      ++it;
    }
  }
  producer_side_peers_[in.from] = std::move(peer).value();
  send(OutgoingMessage{in.from, meta_message(MessageType::kMetaOk)});
}

void PdConnector::handle_meta_ok(const InboundMessage& in) {
  const std::string& control = in.from.name();
  auto peer = peer_from_meta(in.message, /*local_is_producer=*/false);
  if (!peer.ok()) {
    metrics_.handshakes_refused->inc();
    warn_peer(fmt::format("producer {} at {} refused: {}", in.message.instance_id, control, peer.status().message()));
    consumer_->on_peer_failed(control, peer.status().message());
    return;
  }
  const std::string instance = peer->instance_id;
  const uint64_t nonce = peer->boot_nonce;
  const int32_t num_blocks = peer->num_blocks;
  const auto num_pieces = static_cast<int32_t>(peer->pieces.size());
  consumer_side_peers_[control] = std::move(peer).value();
  consumer_->on_peer_ready(control, instance, nonce, num_blocks, num_pieces);
}

void PdConnector::send(OutgoingMessage out) {
  PD_LOG_DEBUG("connector: send {} {} to {}", message_type_name(out.message.type), out.message.transfer_id,
               out.to.to_string());
  out.message.instance_id = record_.instance_id;
  out.message.boot_nonce = record_.boot_nonce;
  control_->send(out.to, out.message);
}

Status PdConnector::post_batch(PeerInfo& peer, bool is_write, const std::string& transfer_id, int32_t layer,
                               int32_t piece, std::vector<xfer::Op> ops) {
  if (layer < 0 || layer >= spec_.num_layers || piece < 0 || static_cast<size_t>(piece) >= peer.pieces.size()) {
    return internal_error("layer {} piece {} outside the {} layers and {} plan pieces", layer, piece, spec_.num_layers,
                          peer.pieces.size());
  }
  // WRITE: the producer (we) posts from its rank; READ: the consumer (we) pulls into its rank.
  const PlanPiece& p = peer.pieces[static_cast<size_t>(piece)];
  const int32_t local_rank = is_write ? p.producer_rank : p.consumer_rank;
  const int32_t remote_rank = is_write ? p.consumer_rank : p.producer_rank;
  const auto local_index =
      static_cast<size_t>(local_rank) * static_cast<size_t>(spec_.num_layers) + static_cast<size_t>(layer);
  const auto remote_index =
      static_cast<size_t>(remote_rank) * static_cast<size_t>(spec_.num_layers) + static_cast<size_t>(layer);
  if (local_index >= local_regions_.size() || remote_index >= peer.regions.size()) {
    return internal_error("plan piece {} names rank {} here / {} at the peer, outside the registered regions", piece,
                          local_rank, remote_rank);
  }
  xfer::Session& session = peer.sessions[{local_rank, remote_rank, layer}];
  if (!session.valid()) {
    const char* backend = config_.backend == TransferBackend::kAuto ? "auto" : transfer_backend_name(config_.backend);
    PD_ASSIGN_OR_RETURN(session, xfer_->session(local_regions_[local_index], peer.regions[remote_index], backend));
  }
  uint64_t bytes = 0;
  for (const auto& op : ops) bytes += op.bytes;
  Result<xfer::XferId> id = is_write ? session.write(ops) : session.read(ops);
  if (!id.ok()) {
    // A stale session (peer restarted) is reopened on the next attempt.
    session = xfer::Session();
    return id.status();
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_batches_.push_back(PendingBatch{*id, Completion{is_write, transfer_id, layer, piece, false, bytes, {}}});
    if (is_write) ++write_batches_[transfer_id].num_pending;
  }
  pending_cv_.notify_one();
  return Status::Ok();
}

void PdConnector::offer_early_done(OutgoingMessage done) {
  const std::string transfer_id = done.message.transfer_id;
  bool send_now = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = write_batches_.find(transfer_id);
    if (it == write_batches_.end()) {
      send_now = true;  // every posted write completed ok (a failed one keeps its entry); the inbox has them
    } else if (!it->second.failed) {
      it->second.done = std::move(done);  // the completion thread sends it with the last write
    }
  }
  if (!send_now) return;
  send(std::move(done));
  metrics_.dones_on_completion->inc();
  producer_->on_done_sent_early(transfer_id);
}

PdConnector::RequestState* PdConnector::state_of(const engine::Request& request) {
  // Only this connector sets a request's slot (ExternalMatch::connector_state).
  return static_cast<RequestState*>(request.connector_state.get());
}

void PdConnector::expect_hand_over(const std::string& transfer_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = consumer_loads_.find(transfer_id);
  if (it != consumer_loads_.end() && it->second.hand_over) it->second.hand_over->armed = true;
}

void PdConnector::forget_load(const engine::Request& request) {
  RequestState* state = state_of(request);
  if (state == nullptr || state->producer || !state->loading) return;
  state->loading = false;
  std::lock_guard<std::mutex> lock(mutex_);
  // Its transfer may have closed already, and its id been taken by a newer request.
  auto it = consumer_loads_.find(state->transfer_id);
  if (it != consumer_loads_.end() && it->second.request_id == request.request_id()) consumer_loads_.erase(it);
}

void PdConnector::drop_finished_write_batches() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::erase_if(write_batches_,
                [&](const auto& entry) { return entry.second.num_pending == 0 && !producer_->has(entry.first); });
}

void PdConnector::run_actions() {
  // Executing actions feeds back into the state machines only through a batch that
  // cannot be posted (its write / read fails at once, which fails the transfer: it
  // posts nothing more) and an early done sent at once (the transfer ends). So a
  // round posts nothing that the round before did not, the second round posts
  // nothing, and the loop ends after a few rounds without any cap.
  for (TransferActions a = take_actions(*producer_, *consumer_); !a.empty(); a = take_actions(*producer_, *consumer_)) {
    execute(a);
  }
}

void PdConnector::execute(TransferActions& a) {
  ProducerActions& pa = a.producer;
  ConsumerActions& ca = a.consumer;
  note_refused(pa.num_refused + ca.num_refused);
  if (pa.num_timeouts + ca.num_timeouts > 0) metrics_.timeouts->inc(pa.num_timeouts + ca.num_timeouts);
  if (pa.num_completed > 0) metrics_.done_producer->inc(pa.num_completed);
  if (pa.num_failed > 0) metrics_.failed_producer->inc(pa.num_failed);
  if (ca.num_completed > 0) metrics_.done_consumer->inc(ca.num_completed);

  for (auto& out : pa.sends) send(std::move(out));
  for (auto& out : ca.sends) {
    // `blocks` / `read` for the whole prompt: the transfer now waits for a done /
    // read_ok with the token. Expected before it is sent: the answer may come at once.
    const bool expects_token = (out.message.type == MessageType::kBlocks || out.message.type == MessageType::kRead) &&
                               !out.message.block_ids.empty() && out.message.kv_tokens == out.message.num_tokens;
    if (expects_token) expect_hand_over(out.message.transfer_id);
    send(std::move(out));
  }
  for (const auto& control : ca.dropped_dealers) {
    consumer_side_peers_.erase(control);
    control_->drop_dealer(control);
  }
  for (const auto& control : ca.handshakes) {
    send(OutgoingMessage{PeerKey::dialled(control), meta_message(MessageType::kMeta)});
  }
  for (const auto& w : pa.writes) post_write(w);
  // After the writes of this round are posted (and counted): a done settled in the same
  // round as its last writes (destination ids that arrived after the forward) waits for them.
  for (auto& done : pa.early_dones) offer_early_done(std::move(done));
  if (!pa.withdrawn_early_dones.empty()) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& transfer_id : pa.withdrawn_early_dones) {
      auto it = write_batches_.find(transfer_id);
      if (it == write_batches_.end()) continue;  // sent already, or no write left in flight
      it->second.failed = true;
      it->second.done.reset();
    }
  }
  if (!ca.reads.empty()) {
    // READ hand-over: the completion thread streams the token after this many reads,
    // counted before any is posted (a read may complete before the next is posted).
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& r : ca.reads) {
      auto it = consumer_loads_.find(r.transfer_id);
      if (it == consumer_loads_.end() || !it->second.hand_over) continue;
      HandOverExpected& e = *it->second.hand_over;
      if (!e.armed || !e.read_mode) continue;
      if (!e.read_token) {
        it->second.hand_over.reset();  // read_ok brought no token we may take
        continue;
      }
      e.num_reads_left = std::max(e.num_reads_left, 0) + 1;
    }
  }
  for (const auto& r : ca.reads) post_read(r);
  report_events(pa, ca);
}

void PdConnector::post_write(const ProducerActions::PostWrite& w) {
  const auto* dest = producer_->destination(w.transfer_id);
  const auto* local = producer_->local_blocks(w.transfer_id);
  auto peer = dest == nullptr ? producer_side_peers_.end() : producer_side_peers_.find(dest->peer.key);
  Status status = Status::Ok();
  if (dest == nullptr || local == nullptr || peer == producer_side_peers_.end()) {
    status = unavailable("transfer {}: destination peer gone", w.transfer_id);
  } else {
    // This producer rank's share of the consumer rank's heads, block by block.
    Result<std::vector<xfer::Op>> ops =
        write_piece_ops(block_layout_, peer->second.pieces, w.piece, local_heads_, peer->second.heads, *local,
                        dest->num_skip_blocks, dest->block_ids);
    status = ops.ok() ? post_batch(peer->second, true, w.transfer_id, w.layer, w.piece, std::move(ops).value())
                      : ops.status().with_context("transfer " + w.transfer_id);
  }
  if (status.ok()) return;
  PD_LOG_WARN("connector: cannot post write: {}", status.to_string());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    write_batches_[w.transfer_id].failed = true;  // an early done must not go out for it
  }
  producer_->on_write_done(w.transfer_id, w.layer, false, w.piece);
}

void PdConnector::post_read(const ConsumerActions::PostRead& r) {
  auto view = consumer_->view(r.transfer_id);
  auto peer = view ? consumer_side_peers_.find(view->remote_control) : consumer_side_peers_.end();
  Status status = Status::Ok();
  if (!view || peer == consumer_side_peers_.end()) {
    status = unavailable("transfer {}: producer peer gone", r.transfer_id);
  } else {
    // This consumer rank pulls the heads it owns from the producer rank the plan picked.
    Result<std::vector<xfer::Op>> ops = read_piece_ops(block_layout_, peer->second.pieces, r.piece, peer->second.heads,
                                                       local_heads_, view->remote_block_ids, view->local_block_ids);
    status = ops.ok() ? post_batch(peer->second, false, r.transfer_id, r.layer, r.piece, std::move(ops).value())
                      : ops.status().with_context("transfer " + r.transfer_id);
  }
  if (status.ok()) return;
  PD_LOG_WARN("connector: cannot post read: {}", status.to_string());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = consumer_loads_.find(r.transfer_id);
    if (it != consumer_loads_.end()) it->second.hand_over.reset();  // the load fails: nothing to stream
  }
  consumer_->on_read_done(r.transfer_id, r.layer, false, r.piece);
}

void PdConnector::report_events(ProducerActions& pa, ConsumerActions& ca) {
  for (auto& id : pa.released_request_ids) events_.finished_sending.push_back(std::move(id));
  for (const auto& transfer_id : ca.closed_transfer_ids) {
    std::optional<int64_t> admitted_ns;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = consumer_loads_.find(transfer_id);
      if (it == consumer_loads_.end()) continue;  // its request left first
      admitted_ns = it->second.admitted_ns;
      consumer_loads_.erase(it);
    }
    metrics_.transfer_seconds->observe(static_cast<double>(now_ns() - *admitted_ns) * 1e-9);
  }
  for (auto& id : ca.finished_recving) events_.finished_recving.push_back(std::move(id));
  if (ca.num_first_tokens_refused > 0) metrics_.first_tokens_refused->inc(ca.num_first_tokens_refused);
  for (auto& [request_id, token] : ca.first_tokens) {
    metrics_.first_tokens_accepted->inc();
    events_.first_tokens.push_back(engine::HandedOverToken{std::move(request_id), token});
  }
  for (auto& failure : ca.load_failures) {
    metrics_.load_errors->inc();
    metrics_.failed_consumer->inc();
    if (failure.invalid_params) {
      // Recomputing would serve a request whose parameters were forged or wrong.
      PD_LOG_WARN("connector: request {} failed: {}", failure.request_id, failure.reason);
      events_.failed_requests.push_back({failure.request_id, failure.reason, /*invalid_request=*/true});
      continue;
    }
    if (config_.on_failure == FailurePolicy::kFail) {
      PD_LOG_WARN("connector: KV load for request {} failed ({}); failing it", failure.request_id, failure.reason);
      events_.failed_requests.push_back({failure.request_id, "remote KV transfer failed: " + failure.reason});
      continue;
    }
    PD_LOG_WARN("connector: KV load for request {} failed ({}); recomputing {} blocks", failure.request_id,
                failure.reason, failure.block_ids.size());
    metrics_.recomputes->inc();
    events_.load_errors.push_back(engine::LoadError{failure.request_id, std::move(failure.block_ids)});
  }
}

}  // namespace pd::connector
