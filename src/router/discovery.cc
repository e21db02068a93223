#include "router/discovery.h"

#include <zmq.hpp>

#include <nlohmann/json.hpp>

#include "common/curve_auth.h"
#include "common/log.h"
#include "common/metrics.h"
#include "router/instance_metrics.h"

namespace pd::router {

namespace {

metrics::Counter& resync_counter() {
  static metrics::Counter& counter = metrics::Registry::global().counter(
      "pd_router_kv_resyncs_total", "Snapshots of a prefix cache asked of an instance after a gap in its KV events");
  return counter;
}

metrics::Counter& malformed_counter() {
  static metrics::Counter& counter = metrics::Registry::global().counter(
      "pd_router_registrations_malformed_total", "Registration messages dropped because they failed validation");
  return counter;
}

metrics::Counter& registrations_counter(UpsertOutcome outcome) {
  const char* name = outcome == UpsertOutcome::kAdded      ? "added"
                     : outcome == UpsertOutcome::kReplaced ? "replaced"
                                                           : "refreshed";
  return metrics::Registry::global().counter("pd_router_registrations_total",
                                             "Valid registrations and probe answers by outcome", {{"outcome", name}});
}

Result<tcp::endpoint> resolve(net::io_context& context, const HostPort& address) {
  tcp::resolver resolver(context);
  beast::error_code ec;
  auto results = resolver.resolve(address.host, std::to_string(address.port), ec);
  if (ec || results.empty()) return unavailable("cannot resolve {}: {}", address.to_string(), ec.message());
  for (const auto& entry : results) {
    if (entry.endpoint().address().is_v4()) return entry.endpoint();
  }
  return results.begin()->endpoint();
}

// An IP literal needs no lookup.
std::optional<tcp::endpoint> literal_endpoint(const HostPort& address) {
  beast::error_code ec;
  const net::ip::address ip = net::ip::make_address(address.host, ec);
  if (ec) return std::nullopt;
  return tcp::endpoint(ip, address.port);
}

// Looks a host name up on Asio's resolver thread (never the caller's) and waits at most
// `timeout_ms`. A lookup that outlives the wait finishes on its own; its answer is dropped.
awaitable<Result<tcp::endpoint>> resolve_bounded(net::io_context& context, const HostPort& address,
                                                 int64_t timeout_ms) {
  struct State {
    explicit State(net::io_context& io) : resolver(io), timer(io) {}
    tcp::resolver resolver;
    net::steady_timer timer;
    std::optional<Result<tcp::endpoint>> result;
  };
  auto state = std::make_shared<State>(context);
  state->timer.expires_after(std::chrono::milliseconds(timeout_ms));
  state->resolver.async_resolve(
      address.host, std::to_string(address.port),
      [state, address](const beast::error_code& ec, const tcp::resolver::results_type& results) {
        if (ec || results.empty()) {
          state->result = unavailable("cannot resolve {}: {}", address.to_string(), ec.message());
        } else {
          state->result = results.begin()->endpoint();
          for (const auto& entry : results) {
            if (entry.endpoint().address().is_v4()) {
              state->result = entry.endpoint();
              break;
            }
          }
        }
        state->timer.cancel();
      });
  beast::error_code ec;
  co_await state->timer.async_wait(with_ec(ec));
  if (!state->result) {
    state->resolver.cancel();
    co_return deadline_exceeded("cannot resolve {}: no answer within {} ms (--resolve-timeout-ms)", address.to_string(),
                                timeout_ms);
  }
  co_return std::move(*state->result);
}

}  // namespace

struct Discovery::ZmqState {
  zmq::context_t context{1};
  std::unique_ptr<auth::ZapAuthenticator> authenticator;
  zmq::socket_t socket{context, zmq::socket_type::router};
};

Discovery::Discovery(const RouterConfig& config, size_t num_io_threads)
    : config_(config),
      backend_authorization_(bearer_authorization(config.backend_api_key)),
      num_io_threads_(num_io_threads),
      registry_(std::chrono::milliseconds(config.instance_ttl_ms)),
      snapshot_(std::make_shared<const Snapshot>()) {}

Discovery::~Discovery() {
  stop();
}

Status Discovery::start() {
  auto add_static = [&](const std::vector<std::string>& urls, InstanceRole role) -> Status {
    for (const std::string& url : urls) {
      PD_ASSIGN_OR_RETURN(HostPort address, parse_http_url(url));
      PD_ASSIGN_OR_RETURN(tcp::endpoint endpoint, resolve(control_, address));
      static_targets_.push_back(StaticTarget{role, address, endpoint});
    }
    return Status::Ok();
  };
  PD_RETURN_IF_ERROR(add_static(config_.prefill_urls, InstanceRole::kProducer));
  PD_RETURN_IF_ERROR(add_static(config_.decode_urls, InstanceRole::kConsumer));
  PD_RETURN_IF_ERROR(add_static(config_.collocated_urls, InstanceRole::kBoth));

  if (config_.registration_port >= 0) {
    zmq_ = std::make_unique<ZmqState>();
    try {
      if (!config_.control_secret_file.empty()) {
        PD_ASSIGN_OR_RETURN(std::string secret, auth::read_secret_file(config_.control_secret_file));
        PD_ASSIGN_OR_RETURN(auth::CurveKeys keys, auth::derive_curve_keys(secret));
        zmq_->authenticator = std::make_unique<auth::ZapAuthenticator>(zmq_->context, keys);
        PD_RETURN_IF_ERROR(auth::make_curve_server(zmq_->socket, keys));
      }
      zmq_->socket.set(zmq::sockopt::linger, 0);
      // A peer sending more than this is disconnected by libzmq before we see it.
      zmq_->socket.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(contract::kMaxHeartbeatBytes));
      zmq_->socket.set(zmq::sockopt::rcvhwm, 10000);
      const std::string port = config_.registration_port == 0 ? "*" : std::to_string(config_.registration_port);
      zmq_->socket.bind(fmt::format("tcp://{}:{}", config_.registration_host, port));
      registration_endpoint_ = zmq_->socket.get(zmq::sockopt::last_endpoint);
      registration_port_ = std::stoi(registration_endpoint_.substr(registration_endpoint_.rfind(':') + 1));
    } catch (const zmq::error_t& error) {
      return unavailable("cannot bind the registration socket on {}:{}: {}", config_.registration_host,
                         config_.registration_port, error.what());
    }
  }

  control_work_.emplace(control_.get_executor());
  net::co_spawn(control_, expiry_loop(), net::detached);
  for (const StaticTarget& target : static_targets_) net::co_spawn(control_, probe_loop(target), net::detached);
  control_thread_ = std::thread([this] { control_.run(); });
  if (zmq_) registration_thread_ = std::thread([this] { registration_loop(); });
  return Status::Ok();
}

void Discovery::stop() {
  if (stopping_.exchange(true)) return;
  control_work_.reset();
  control_.stop();
  if (control_thread_.joinable()) control_thread_.join();
  if (registration_thread_.joinable()) registration_thread_.join();
  zmq_.reset();
}

void Discovery::registration_loop() {
  zmq::socket_t& socket = zmq_->socket;
  std::vector<zmq::message_t> frames;
  // Registration thread only. Views exist for admitted instances only (those in the published
  // snapshot), each bounded by its reported pool; they follow the snapshot: an instance that leaves
  // loses its view.
  CacheViews views(std::chrono::milliseconds(config_.instance_ttl_ms), std::chrono::milliseconds(kResyncIntervalMs));
  std::shared_ptr<const Snapshot> seen;                   // the snapshot `admitted` was built from
  std::map<std::string, uint64_t, std::less<>> admitted;  // instance_id -> boot_nonce
  auto is_admitted = [&](std::string_view id, uint64_t boot_nonce) {
    auto it = admitted.find(id);
    return it != admitted.end() && it->second == boot_nonce;
  };
  const std::vector<uint8_t> resync = contract::encode_kv_resync();
  // Sends the resync request along an instance's envelope (its identity, and the empty frame if any).
  auto send_resync = [&](const ReplyTo& to) {
    socket.send(zmq::buffer(to.identity), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
    if (to.delimited) socket.send(zmq::message_t(), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
    socket.send(zmq::buffer(resync), zmq::send_flags::dontwait);
    resync_counter().inc();
  };
  // Follows the discovered set: drops the views of instances that left, starts those admitted since.
  auto follow_snapshot = [&] {
    std::shared_ptr<const Snapshot> now_seen = snapshot();
    if (now_seen == seen) return;
    seen = now_seen;
    admitted.clear();
    for (const auto& backend : seen->backends) admitted[backend->info().instance_id] = backend->info().boot_nonce;
    bool changed = views.retain(is_admitted);
    for (const ReplyTo& to : views.take_admitted(is_admitted, SteadyClock::now())) {
      changed = true;
      send_resync(to);
    }
    if (changed) cache_index_.store(views.publish(), std::memory_order_release);
  };
  while (!stopping_.load()) {
    try {
      follow_snapshot();
    } catch (const zmq::error_t& error) {
      if (error.num() == ETERM) return;
    }
    zmq::pollitem_t item{socket.handle(), 0, ZMQ_POLLIN, 0};
    try {
      zmq::poll(&item, 1, std::chrono::milliseconds(100));
    } catch (const zmq::error_t& error) {
      if (error.num() == ETERM) return;
      continue;  // EINTR
    }
    if (!(item.revents & ZMQ_POLLIN)) continue;
    // Drain what is queued; each multipart message is [identity, (empty,) payload].
    for (;;) {
      frames.clear();
      try {
        zmq::message_t frame;
        if (!socket.recv(frame, zmq::recv_flags::dontwait)) break;
        frames.push_back(std::move(frame));
        while (frames.back().more() && frames.size() < 8) {
          zmq::message_t next;
          (void)socket.recv(next, zmq::recv_flags::none);
          frames.push_back(std::move(next));
        }
        while (frames.back().more()) {  // more than 8 frames: discard the rest of the message
          zmq::message_t rest;
          (void)socket.recv(rest, zmq::recv_flags::none);
        }
      } catch (const zmq::error_t& error) {
        if (error.num() == ETERM) return;
        break;
      }
      const bool shape_ok = frames.size() == 2 || (frames.size() == 3 && frames[1].size() == 0);
      Result<contract::Heartbeat> heartbeat =
          shape_ok ? contract::decode_heartbeat(frames.back().data(), frames.back().size())
                   : Result<contract::Heartbeat>(invalid_argument("registration has {} frames", frames.size()));
      if (!heartbeat.ok()) {
        malformed_counter().inc();
        PD_LOG_WARN("pdrouter: dropped malformed registration: {}", heartbeat.status().message());
        continue;
      }
      const ReplyTo reply_to{std::string(static_cast<const char*>(frames[0].data()), frames[0].size()),
                             frames.size() == 3};
      const bool known = is_admitted(heartbeat->record.instance_id, heartbeat->record.boot_nonce);
      const CacheViews::Applied applied = views.apply(*heartbeat, known, SteadyClock::now(), reply_to);
      if (applied.send_resync) {
        try {
          send_resync(reply_to);
        } catch (const zmq::error_t& error) {
          if (error.num() == ETERM) return;
        }
      }
      if (applied.changed) cache_index_.store(views.publish(), std::memory_order_release);
      net::post(control_, [this, record = std::move(heartbeat->record)]() mutable { admit(std::move(record), false); });
    }
  }
}

void Discovery::admit(InstanceInfo info, bool from_probe) {
  const auto now = SteadyClock::now();
  const UpsertOutcome outcome = registry_.upsert(info, now);
  registrations_counter(outcome).inc();
  if (outcome == UpsertOutcome::kRefreshed && backends_.count(info.instance_id) > 0) return;
  if (std::optional<tcp::endpoint> endpoint = literal_endpoint(info.http)) {
    add_backend(info, *endpoint, outcome, from_probe);
    return;
  }
  // A host name: looked up off this thread. A lookup already running for this instance picks up the latest record.
  if (auto it = resolving_.find(info.instance_id); it != resolving_.end()) {
    it->second = std::move(info);
    return;
  }
  if (resolving_.size() >= kMaxPendingResolves) {
    PD_LOG_WARN("pdrouter: instance {} dropped: {} host names are being looked up already", info.instance_id,
                kMaxPendingResolves);
    (void)registry_.erase(info.instance_id);
    return;
  }
  const std::string instance_id = info.instance_id;
  resolving_.emplace(instance_id, std::move(info));
  net::co_spawn(control_, resolve_then_add(instance_id, outcome, from_probe), net::detached);
}

awaitable<void> Discovery::resolve_then_add(std::string instance_id, UpsertOutcome outcome, bool from_probe) {
  for (;;) {
    const HostPort address = resolving_.at(instance_id).http;
    Result<tcp::endpoint> endpoint = co_await resolve_bounded(control_, address, config_.resolve_timeout_ms);
    if (stopping_.load()) co_return;
    auto it = resolving_.find(instance_id);
    InstanceInfo info = std::move(it->second);
    if (info.http != address) {  // re-registered with another address meanwhile: look that one up
      it->second = std::move(info);
      continue;
    }
    resolving_.erase(it);
    // Expired (or replaced by a record with an IP address) while the name was looked up.
    auto entry = registry_.entries().find(instance_id);
    if (entry == registry_.entries().end() || entry->second.info != info) co_return;
    if (!endpoint.ok()) {
      PD_LOG_WARN("pdrouter: instance {} dropped: {}", instance_id, endpoint.status().message());
      (void)registry_.erase(instance_id);
      backends_.erase(instance_id);
      InstanceMetrics::global().remove(instance_id);
      publish();
      co_return;
    }
    add_backend(info, *endpoint, outcome, from_probe);
    co_return;
  }
}

void Discovery::add_backend(const InstanceInfo& info, const tcp::endpoint& endpoint, UpsertOutcome outcome,
                            bool from_probe) {
  PD_LOG_INFO("pdrouter: instance {} {} ({} {} http={} control={} nonce={} model={}{})", info.instance_id,
              outcome == UpsertOutcome::kAdded ? "added" : "replaced", role_name(info.role), mode_name(info.mode),
              info.http.to_string(), info.control ? info.control->to_string() : "-", info.boot_nonce, info.model,
              from_probe ? ", static" : "");
  // An earlier Backend of this instance may still run legs (streams outlive a re-registration or an
  // expiry): the new one keeps counting them.
  std::shared_ptr<Backend::Counter> outstanding;
  for (const auto& weak : every_backend_) {
    auto earlier = weak.lock();
    if (earlier && earlier->info().instance_id == info.instance_id) outstanding = earlier->outstanding_counter();
  }
  auto backend = std::make_shared<Backend>(info, endpoint, num_io_threads_, config_.max_idle_connections_per_backend,
                                           std::chrono::milliseconds(config_.backend_idle_timeout_ms),
                                           backend_authorization_, std::move(outstanding));
  every_backend_.push_back(backend);
  // Its per-instance series (kept across a re-registration: the outstanding count continues).
  InstanceMetrics::global().admit(info.instance_id, role_name(info.role));
  InstanceMetrics::global().set_outstanding(info.instance_id, backend->outstanding());
  backends_[info.instance_id] = std::move(backend);
  publish();
}

void Discovery::clear_idle_connections() {
  for (auto& weak : every_backend_) {
    if (auto backend = weak.lock()) backend->clear_idle();
  }
}

void Discovery::publish() {
  std::erase_if(every_backend_, [](const std::weak_ptr<Backend>& weak) { return weak.expired(); });
  auto snapshot = std::make_shared<Snapshot>();
  snapshot->backends.reserve(backends_.size());
  for (const auto& [id, backend] : backends_) snapshot->backends.push_back(backend);
  static metrics::Registry& registry = metrics::Registry::global();
  for (InstanceRole role : {InstanceRole::kProducer, InstanceRole::kConsumer, InstanceRole::kBoth}) {
    size_t count = 0;
    for (const auto& backend : snapshot->backends) count += backend->info().role == role;
    registry.gauge("pd_router_instances", "Live instances by role", {{"role", role_name(role)}})
        .set(static_cast<double>(count));
  }
  snapshot_.store(std::move(snapshot), std::memory_order_release);
}

awaitable<void> Discovery::expiry_loop() {
  static metrics::Counter& expiries = metrics::Registry::global().counter(
      "pd_router_instance_expiries_total", "Instances removed after a silent time-to-live");
  net::steady_timer timer(control_);
  // Scan often relative to the TTL so an instance is gone within ttl + one period.
  const auto period = std::chrono::milliseconds(std::max<int64_t>(50, config_.instance_ttl_ms / 20));
  for (;;) {
    timer.expires_after(period);
    beast::error_code ec;
    co_await timer.async_wait(with_ec(ec));
    if (ec) co_return;
    std::vector<InstanceInfo> expired = registry_.expire(SteadyClock::now());
    if (expired.empty()) continue;
    for (const InstanceInfo& info : expired) {
      PD_LOG_WARN("pdrouter: instance {} ({} at {}) expired: silent for {} ms", info.instance_id, role_name(info.role),
                  info.http.to_string(), config_.instance_ttl_ms);
      expiries.inc();
      if (auto it = backends_.find(info.instance_id); it != backends_.end()) backends_.erase(it);
      InstanceMetrics::global().remove(info.instance_id);
    }
    publish();
  }
}

awaitable<Result<InstanceInfo>> Discovery::probe_once(const StaticTarget& target) {
  const std::string host = target.http.to_string();
  const int64_t timeout_ms = std::max<int64_t>(200, config_.probe_interval_ms);
  LegResult info_reply = co_await http_get(target.endpoint, host, "/pd/info", backend_authorization_, timeout_ms);
  if (!info_reply.transport.ok()) co_return info_reply.transport;
  if (info_reply.http_status == 200) {
    nlohmann::json parsed = nlohmann::json::parse(info_reply.body, nullptr, false);
    Result<InstanceInfo> info = parse_instance_info_json(parsed);
    if (!info.ok()) co_return info.status().with_context(fmt::format("/pd/info of {}", host));
    // The operator's flags name the role and address this router uses.
    info->role = target.role;
    info->http = target.http;
    co_return info;
  }
  // No /pd/info (an engine without a connector): admit it with what /v1/models says.
  LegResult models_reply = co_await http_get(target.endpoint, host, "/v1/models", backend_authorization_, timeout_ms);
  if (!models_reply.transport.ok()) co_return models_reply.transport;
  if (models_reply.http_status != 200)
    co_return unavailable("{} answered /v1/models with {}", host, models_reply.http_status);
  InstanceInfo info;
  info.role = target.role;
  info.http = target.http;
  info.instance_id = fmt::format("static-{}", host);
  info.mode = config_.forced_mode.value_or(TransferMode::kWrite);
  nlohmann::json models = nlohmann::json::parse(models_reply.body, nullptr, false);
  if (models.is_object() && models.contains("data") && models["data"].is_array() && !models["data"].empty() &&
      models["data"][0].is_object() && models["data"][0].contains("id") && models["data"][0]["id"].is_string()) {
    info.model = models["data"][0]["id"].get<std::string>();
  }
  co_return info;
}

awaitable<void> Discovery::probe_loop(StaticTarget target) {
  net::steady_timer timer(control_);
  for (;;) {
    Result<InstanceInfo> info = co_await probe_once(target);
    if (info.ok()) {
      admit(std::move(info).value(), true);
    } else {
      PD_LOG_DEBUG("pdrouter: probe of {} failed: {}", target.http.to_string(), info.status().message());
    }
    timer.expires_after(std::chrono::milliseconds(config_.probe_interval_ms));
    beast::error_code ec;
    co_await timer.async_wait(with_ec(ec));
    if (ec) co_return;
  }
}

}  // namespace pd::router
