#include "router/router_server.h"

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <random>
#include <unordered_map>

#include "common/clock.h"
#include "common/connection_limit.h"
#include "common/log.h"
#include "common/metrics.h"
#include "frontend/connection.h"
#include "frontend/wire.h"
#include "router/instance_metrics.h"
#include "router/policy.h"
#include "router/prompt_tokens.h"
#include "router/request_rewrite.h"
#include "router/request_validation.h"
#include "router/sse.h"

namespace pd::router {

namespace {

using TimePoint = std::chrono::steady_clock::time_point;

// ---------------------------------------------------------------- metrics

// Labeled metrics are looked up once per io thread and label set, then cached.
metrics::Counter& cached_counter(const std::string& name, const std::string& help, const metrics::Labels& labels) {
  thread_local std::unordered_map<std::string, metrics::Counter*> cache;
  std::string key = name + '{' + metrics::render_labels(labels) + '}';
  auto it = cache.find(key);
  if (it != cache.end()) return *it->second;
  metrics::Counter& counter = metrics::Registry::global().counter(name, help, labels);
  cache.emplace(std::move(key), &counter);
  return counter;
}

metrics::Histogram& cached_histogram(const std::string& name, const std::string& help, const metrics::Labels& labels,
                                     const std::vector<double>& bounds) {
  thread_local std::unordered_map<std::string, metrics::Histogram*> cache;
  std::string key = name + '{' + metrics::render_labels(labels) + '}';
  auto it = cache.find(key);
  if (it != cache.end()) return *it->second;
  metrics::Histogram& histogram = metrics::Registry::global().histogram(name, help, labels, bounds);
  cache.emplace(std::move(key), &histogram);
  return histogram;
}

const std::vector<double>& added_latency_buckets() {
  static const std::vector<double> buckets = {25e-6, 50e-6, 100e-6, 200e-6, 300e-6, 500e-6, 750e-6, 1e-3,
                                              2e-3,  5e-3,  10e-3,  25e-3,  50e-3,  100e-3, 1.0};
  return buckets;
}

void count_fallback(const char* reason) {
  cached_counter("pd_router_fallbacks_total", "Requests served collocated instead of P/D, by reason",
                 {{"reason", reason}})
      .inc();
}

// The flow chosen for a generation request (read, write, local, collocated, or the reason it fell back)
// and why (DecisionReason: the policy, or auto's reason).
void count_decision(const char* flow, DecisionReason reason) {
  cached_counter("pd_router_decisions_total", "Generation requests by the flow chosen for them and why",
                 {{"flow", flow}, {"reason", decision_reason_name(reason)}})
      .inc();
}

// A failed leg: in the per-leg total and in the failing instance's own count.
void count_leg_failure(const std::string& instance, const char* leg, const char* reason) {
  cached_counter("pd_router_leg_failures_total", "Backend legs that failed, by leg and reason",
                 {{"leg", leg}, {"reason", reason}})
      .inc();
  InstanceMetrics::global().count_leg_failure(instance, leg, reason);
}

// A leg that got its whole answer: from its request's first byte to its answer's last
// (for a relayed stream, the last event), per instance and leg (prefill, decode, collocated).
void observe_leg_latency(const std::string& instance, const char* leg, int64_t started_ns) {
  InstanceMetrics::global().observe_leg_latency(instance, leg, static_cast<double>(now_ns() - started_ns) * 1e-9);
}

const char* failure_reason(const LegResult& result) {
  if (result.transport.ok()) return "http_status";
  switch (result.transport.code()) {
    case ErrorCode::kDeadlineExceeded:
      return "deadline";
    case ErrorCode::kAborted:
      return "cancelled";
    case ErrorCode::kInvalidArgument:
      return "bad_response";
    default:
      return "transport";
  }
}

// ---------------------------------------------------------------- helpers

uint64_t thread_random() {
  thread_local std::mt19937_64 engine([] {
    std::random_device device;
    return (static_cast<uint64_t>(device()) << 32) ^ device();
  }());
  return engine();
}

std::string mint_transfer_id() {
  return format_transfer_id(thread_random(), thread_random());
}

// Serialises JSON the router answers with. Its text may come from outside (a request path, an
// instance's registration), and the strict dump() throws on invalid UTF-8, which would end the
// connection without an answer: invalid bytes become U+FFFD instead.
std::string dump_response_json(const nlohmann::json& value) {
  return value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string content_type_or_json(const LegResult& result) {
  return result.content_type.empty() ? std::string("application/json") : result.content_type;
}

server::ApiError transport_error(const Status& status, std::string message) {
  return upstream_error(std::move(message), status.code() == ErrorCode::kDeadlineExceeded);
}

// ---------------------------------------------------------------- per-request state

// The state of one client request. Lives on one io thread; legs are owned
// here (and by a concurrent producer task) and cancelled from here.
struct Exchange {
  Exchange(beast::tcp_stream& client_stream, size_t thread) : client(client_stream), thread_index(thread) {}

  beast::tcp_stream& client;
  size_t thread_index;
  unsigned http_version = 11;  // the client's: an HTTP/1.0 client gets no chunked encoding
  bool keep_alive = true;
  bool client_gone = false;
  bool finished = false;
  bool header_sent = false;
  int status = 0;
  std::string route;
  int64_t received_ns = 0;
  int64_t response_start_ns = 0;
  int64_t backend_wait_ns = 0;
  // The leg that answers the client: "decode" in P/D, "collocated" for a single-leg generation.
  const char* answering_leg = "decode";
  int64_t answering_leg_started_ns = 0;
  std::vector<std::shared_ptr<Leg>> legs;

  std::shared_ptr<Leg> new_leg(const std::shared_ptr<Backend>& backend) {
    legs.push_back(std::make_shared<Leg>(backend, thread_index));
    return legs.back();
  }
  void cancel_legs() {
    for (auto& leg : legs) leg->cancel();
  }
};

// Watches the client socket while the backends work: EOF or an error means
// the client went away, and every leg is closed so the engines abort.
void watch_client(const std::shared_ptr<Exchange>& exchange) {
  exchange->client.socket().async_wait(tcp::socket::wait_read, [exchange](const beast::error_code& ec) {
    if (exchange->finished || ec) return;
    char byte = 0;
    beast::error_code peek_ec;
    const size_t num_bytes =
        exchange->client.socket().receive(net::buffer(&byte, 1), tcp::socket::message_peek, peek_ec);
    if (peek_ec || num_bytes == 0) {
      exchange->client_gone = true;
      cached_counter("pd_router_client_disconnects_total", "Clients that went away before their answer was complete",
                     {})
          .inc();
      exchange->cancel_legs();
    }
    // Otherwise the client pipelined its next request: nothing to watch for until this one ends.
  });
}

// What POST /pd/release needs: the producer, the transfer and the deadline of the call.
struct ReleaseTarget {
  std::shared_ptr<Backend> producer;
  size_t thread_index = 0;
  std::string transfer_id;
  int64_t connect_timeout_ms = 0;
  int64_t timeout_ms = 0;
};

// Built outside the coroutine: g++ 12 rejects initializer lists in coroutine frames.
std::string release_body(const std::string& transfer_id) {
  nlohmann::json body = nlohmann::json::object();
  body["transfer_id"] = transfer_id;
  return dump_response_json(body);
}

bool answer_says_released(const std::string& text) {
  nlohmann::json answer = nlohmann::json::parse(text, nullptr, false);
  return answer.is_object() && answer.contains("released") && answer["released"].is_boolean() &&
         answer["released"].get<bool>();
}

// Tells a producer to let a transfer's KV go now (pdserve's POST /pd/release) rather than when its
// defer or transfer timeout passes. Sent when a P/D attempt ends without the consumer having taken the
// KV: the consumer refused the request or failed, the client went away, the prefill failed. Harmless
// when nothing is held (the producer answers released=false).
awaitable<void> release_transfer(ReleaseTarget target) {
  auto count = [](const char* outcome) {
    cached_counter("pd_router_transfer_releases_total",
                   "POST /pd/release calls to producers for transfers no consumer took, by outcome",
                   {{"outcome", outcome}})
        .inc();
  };
  Leg leg(target.producer, target.thread_index);
  const TimePoint deadline = SteadyClock::now() + std::chrono::milliseconds(target.timeout_ms);
  const std::string body = release_body(target.transfer_id);
  LegResult result = co_await leg.start("/pd/release", body, target.connect_timeout_ms, deadline);
  if (result.transport.ok()) {
    Status read = co_await leg.read_rest(result, deadline);
    if (!read.ok()) result.transport = read;
  }
  leg.release();
  if (!result.ok()) {
    count("failed");
    PD_LOG_WARN("pdrouter: releasing transfer {} on {} failed: {}", target.transfer_id,
                target.producer->info().instance_id,
                result.transport.ok() ? fmt::format("HTTP {}", result.http_status) : result.transport.message());
    co_return;
  }
  count(answer_says_released(result.body) ? "released" : "not_held");
}

// State shared between a WRITE request and its concurrent producer leg.
struct ProducerState {
  bool done = false;
  bool failed = false;              // failed before the consumer committed; the consumer leg was cancelled
  bool consumer_committed = false;  // the consumer produced its first event / answer: the KV arrived
  bool release_when_done = false;   // the attempt ended without the consumer taking the KV
  ReleaseTarget release;
  LegResult result;
  // Cancelled when the producer leg ends: a WRITE request that needs the producer's answer
  // (prompt_logprobs) waits on it after the consumer answered.
  std::optional<net::steady_timer> done_signal;
};

// Releases the attempt's transfer once the producer leg has ended (so the release follows whatever the
// producer registered for it), now when it already has.
void release_after_producer(ProducerState& state, const net::any_io_executor& executor) {
  if (state.release_when_done) return;
  state.release_when_done = true;
  if (state.done) net::co_spawn(executor, release_transfer(state.release), net::detached);
}

enum class FlowOutcome { kAnswered, kConnectFailed };

// prompt_logprobs in P/D: the consumer's complete answer gets the producer's (request_rewrite.h).
// False (counted against the producer) when the producer's answer has none to give.
bool add_prompt_logprobs(LegResult& consumer_answer, const std::string& producer_answer, bool chat,
                         const std::string& producer_id) {
  Result<std::string> merged = add_producer_prompt_logprobs(consumer_answer.body, producer_answer, chat);
  if (!merged.ok()) {
    PD_LOG_WARN("pdrouter: prompt_logprobs from producer {}: {}", producer_id, merged.status().message());
    count_leg_failure(producer_id, "prefill", "bad_prompt_logprobs");
    return false;
  }
  consumer_answer.body = std::move(merged).value();
  return true;
}

server::ApiError bad_prompt_logprobs_error(const std::string& producer_id) {
  return upstream_error(fmt::format("producer {} did not answer with the prompt's logprobs", producer_id), false);
}

// GET /v1/models and /version ask at most this many instances at once.
constexpr size_t kMaxFanOut = 64;

struct FanOutState {
  explicit FanOutState(const net::any_io_executor& executor, size_t n) : wake(executor), answers(n) {}
  net::steady_timer wake;  // cancelled when an answer arrives while the caller waits
  std::vector<std::optional<LegResult>> answers;
  size_t pending = 0;
  bool any_ok = false;
};

struct FanOut {
  std::vector<std::optional<LegResult>> answers;  // per backend asked; nullopt: no answer before the deadline
  std::vector<std::shared_ptr<Backend>> asked;
};

// One instance's part of fan_out_get: its answer goes into answers[index].
awaitable<void> ask_one(std::shared_ptr<FanOutState> state, size_t index, std::shared_ptr<Backend> backend,
                        std::string target, std::string authorization, int64_t timeout_ms) {
  LegResult reply =
      co_await http_get(backend->endpoint(), backend->info().http.to_string(), target, authorization, timeout_ms);
  state->any_ok |= reply.ok();
  state->answers[index] = std::move(reply);
  --state->pending;
  state->wake.cancel();
}

// GETs `target` from the backends (the first kMaxFanOut) at once, all under one deadline; returns when
// each answered, or when one answered 200 if `first_ok_is_enough`, or at the deadline. All run on the
// caller's io thread; an answer that comes after the return is dropped.
awaitable<FanOut> fan_out_get(const std::vector<std::shared_ptr<Backend>>& backends, std::string target,
                              std::string authorization, int64_t timeout_ms, bool first_ok_is_enough) {
  const net::any_io_executor executor = co_await net::this_coro::executor;
  FanOut out;
  out.asked.assign(backends.begin(),
                   backends.begin() + static_cast<std::ptrdiff_t>(std::min(kMaxFanOut, backends.size())));
  auto state = std::make_shared<FanOutState>(executor, out.asked.size());
  state->pending = out.asked.size();
  const TimePoint deadline = SteadyClock::now() + std::chrono::milliseconds(timeout_ms);
  for (size_t i = 0; i < out.asked.size(); ++i) {
    net::co_spawn(executor, ask_one(state, i, out.asked[i], target, authorization, timeout_ms), net::detached);
  }
  while (state->pending > 0 && !(first_ok_is_enough && state->any_ok) && SteadyClock::now() < deadline) {
    state->wake.expires_at(deadline);
    beast::error_code ec;
    co_await state->wake.async_wait(with_ec(ec));
  }
  out.answers = state->answers;
  co_return out;
}

// Instances left out of a /v1/models or /version answer (no answer in time, or a failed one): counted and logged.
void count_unanswered(const char* route, const FanOut& fan_out, bool stopped_early) {
  std::vector<std::string> left_out;
  for (size_t i = 0; i < fan_out.asked.size(); ++i) {
    const std::optional<LegResult>& answer = fan_out.answers[i];
    if ((answer && !answer->ok()) || (!answer && !stopped_early))
      left_out.push_back(fan_out.asked[i]->info().instance_id);
  }
  if (left_out.empty()) return;
  cached_counter("pd_router_fanout_unanswered_total",
                 "Instances left out of a GET /v1/models or /version answer: no answer in time, or a failed one",
                 {{"route", route}})
      .inc(static_cast<double>(left_out.size()));
  PD_LOG_WARN("pdrouter: GET {}: no answer from {}", route, fmt::join(left_out, ", "));
}

// The "flow" label of pd_router_decisions_total for a plan (README.md "Per-request decisions").
const char* flow_label(const FlowPlan& plan, bool batched, bool several_choices) {
  if (plan.kind == FlowKind::kNone) return "none";
  const char* flow = plan.kind == FlowKind::kPdRead ? "read" : "write";
  if (plan.fallback == FallbackReason::kNoProducer) flow = "no_producer";
  if (plan.fallback == FallbackReason::kNoConsumer) flow = "no_consumer";
  if (plan.kind == FlowKind::kCollocated && plan.fallback == FallbackReason::kNone) flow = "collocated";
  if (plan.local_by_policy) flow = "local";
  if (plan.kind != FlowKind::kCollocated && several_choices) flow = "several_choices";
  if (plan.kind != FlowKind::kCollocated && batched) flow = "batched_prompts";
  return flow;
}

// POST /pd/plan/...'s answer: what the request would be planned as now, and each instance's inputs to it.
std::string plan_json(const Snapshot& snapshot, const std::vector<Candidate>& candidates, const FlowPlan& plan,
                      const PlanRequest& request, const char* flow) {
  auto instance_id = [&](std::optional<size_t> index) {
    return index ? nlohmann::json(snapshot.backends[*index]->info().instance_id) : nlohmann::json(nullptr);
  };
  nlohmann::json instances = nlohmann::json::array();
  for (size_t i = 0; i < candidates.size(); ++i) {
    const Candidate& c = candidates[i];
    instances.push_back({{"instance_id", snapshot.backends[i]->info().instance_id},
                         {"role", role_name(c.role)},
                         {"cached_tokens", c.cached_tokens},
                         {"queued_prefill_tokens",
                          c.load ? nlohmann::json(c.load->num_queued_prefill_tokens) : nlohmann::json(nullptr)},
                         {"outstanding", c.outstanding},
                         {"cost_tokens", cost_tokens(c, request.num_prompt_tokens, request.thresholds)}});
  }
  return dump_response_json({{"prompt_tokens", request.num_prompt_tokens ? nlohmann::json(*request.num_prompt_tokens)
                                                                         : nlohmann::json(nullptr)},
                             {"flow", flow},
                             {"reason", decision_reason_name(plan.reason)},
                             {"decoder", instance_id(plan.consumer)},
                             {"producer", instance_id(plan.producer)},
                             {"instances", std::move(instances)}});
}

}  // namespace

// ---------------------------------------------------------------- Impl

struct RouterServer::Impl {
  Impl(const RouterConfig& config, Discovery& discovery)
      : config_(config), discovery_(discovery), listener_(listener_options(config), refused_connections_counter()) {}

  const RouterConfig& config_;
  Discovery& discovery_;
  std::vector<net::io_context*> contexts_;
  std::atomic<uint64_t> producer_ticket_{0};
  std::atomic<uint64_t> consumer_ticket_{0};
  std::atomic<size_t> next_context_{0};
  // The listening socket and the slots of --max-connections. Sessions destroyed with their
  // io_context release theirs here: RouterServer::stop() clears the io_contexts before Impl dies.
  frontend::Listener listener_;

  static frontend::ListenerOptions listener_options(const RouterConfig& config) {
    frontend::ListenerOptions options;
    options.host = config.host;
    options.port = config.port;
    options.max_connections = config.max_connections;
    options.write_timeout_ms = config.client_write_timeout_ms;
    options.log_name = "pdrouter";
    return options;
  }
  static metrics::Counter& refused_connections_counter() {
    return metrics::Registry::global().counter(
        "pd_router_connections_refused_total",
        "Client connections answered 503 (or closed) because --max-connections were open");
  }

  // The next client connection's io thread, round robin.
  frontend::Placement place_connection() {
    const size_t index = next_context_.fetch_add(1, std::memory_order_relaxed) % contexts_.size();
    return frontend::Placement{contexts_[index]->get_executor(), index};
  }
  awaitable<void> prune_loop(size_t thread_index);
  awaitable<void> session(tcp::socket socket, size_t thread_index, ConnectionSlot slot);
  awaitable<void> handle(std::shared_ptr<Exchange> exchange, http::request<http::string_body>& request);

  // Client responses.
  // Callers pass named values: g++ 12 mishandles some temporaries inside co_await expressions.
  awaitable<void> respond(Exchange& ex, int status, std::string content_type, std::string body);
  awaitable<void> respond_error(Exchange& ex, const server::ApiError& error) {
    const int status = error.http_status;
    std::string body = error.to_text();
    co_await respond(ex, status, "application/json", std::move(body));
  }
  awaitable<void> relay_stream(Exchange& ex, Leg& leg, LegResult& head, std::string first_bytes, TimePoint deadline);

  // Generation flows.
  // `generation` false: a /tokenize or /detokenize body, sent whole to one instance (no validation, no P/D).
  // The prompt's token ids as the engine sees them (prompt_tokens.h): from the body, or from an
  // engine's /tokenize within --tokenize-timeout-ms; nullopt when neither works.
  awaitable<std::optional<std::vector<int32_t>>> prompt_token_ids(std::shared_ptr<Exchange> ex,
                                                                  PromptTokensPlan tokens_plan,
                                                                  const ClientRequest& request,
                                                                  const Snapshot& snapshot);
  // `dry_run`: POST /pd/plan/...: answers with the plan and its inputs (plan_json) instead of serving.
  awaitable<void> handle_generation(std::shared_ptr<Exchange> ex, const std::string& target, const std::string& body,
                                    bool generation = true, bool dry_run = false);
  awaitable<FlowOutcome> run_single(std::shared_ptr<Exchange> ex, std::shared_ptr<Leg> leg, const std::string& target,
                                    const std::string& body, bool stream);
  // `plan_request`: what `plan` was made from; a retry after a failed producer is planned from it too.
  awaitable<FlowOutcome> run_pd(std::shared_ptr<Exchange> ex, const std::string& target, const ClientRequest& request,
                                const Snapshot& snapshot, std::vector<Candidate>& candidates, const FlowPlan& plan,
                                const PlanRequest& plan_request);
  awaitable<LegResult> start_consumer(Exchange& ex, Leg& leg, const std::string& target, const std::string& body,
                                      bool stream, TimePoint deadline, std::string& head_bytes);
  awaitable<void> answer_from_consumer(Exchange& ex, Leg& leg, LegResult& result, std::string head_bytes,
                                       TimePoint deadline);
  awaitable<LegResult> run_full_leg(Exchange* ex, Leg& leg, const std::string& target, const std::string& body,
                                    TimePoint deadline, uint64_t max_answer_bytes = Leg::kMaxFullBodyBytes);
  ReleaseTarget release_target(const std::shared_ptr<Backend>& producer, const Exchange& ex,
                               const std::string& transfer_id) const {
    return ReleaseTarget{producer, ex.thread_index, transfer_id, config_.connect_timeout_ms,
                         config_.connect_timeout_ms + 5000};
  }
  static awaitable<void> producer_task(std::shared_ptr<Leg> producer, std::shared_ptr<Leg> consumer,
                                       std::shared_ptr<ProducerState> state, std::string target, std::string body,
                                       int64_t connect_timeout_ms, TimePoint deadline);

  std::string health_json(const Snapshot& snapshot, bool& healthy) const;
  // /v1/models as the engines answer it (every field they report), one GET per served model; a model
  // whose instance does not answer is listed with a minimal entry (id, object, created, owned_by).
  awaitable<std::string> forwarded_models_json(const Snapshot& snapshot);
};

// Closes this io thread's pooled engine connections once they idled --backend-idle-timeout-ms, so the
// pools shrink back to what the load uses and never hold a connection the engine already closed.
awaitable<void> RouterServer::Impl::prune_loop(size_t thread_index) {
  net::steady_timer timer(co_await net::this_coro::executor);
  const auto period = std::chrono::milliseconds(std::clamp<int64_t>(config_.backend_idle_timeout_ms / 4, 50, 5000));
  for (;;) {
    timer.expires_after(period);
    beast::error_code ec;
    co_await timer.async_wait(with_ec(ec));
    if (ec) co_return;
    for (const auto& backend : discovery_.snapshot()->backends) backend->prune_idle(thread_index);
  }
}

// The slot lives in the coroutine frame: released when the session ends.
awaitable<void> RouterServer::Impl::session(tcp::socket socket, size_t thread_index,
                                            [[maybe_unused]] ConnectionSlot slot) {
  beast::tcp_stream stream(std::move(socket));
  beast::flat_buffer buffer;
  frontend::RequestLimits limits;
  limits.max_header_bytes = 64 * 1024;
  limits.max_body_bytes = config_.max_body_bytes;
  limits.idle_timeout_ms = config_.client_idle_timeout_ms;
  limits.write_timeout_ms = config_.client_write_timeout_ms;
  try {
    for (;;) {
      http::request<http::string_body> request;
      const frontend::ReadResult read = co_await frontend::read_request(stream, buffer, limits, request);
      if (read.outcome == frontend::ReadOutcome::kAnswered) {
        cached_counter("pd_router_requests_total", "Requests by route and status",
                       {{"route", "invalid"}, {"status", std::to_string(read.status)}})
            .inc();
      }
      if (read.outcome != frontend::ReadOutcome::kRequest) break;
      auto exchange = std::make_shared<Exchange>(stream, thread_index);
      exchange->received_ns = now_ns();
      exchange->keep_alive = request.keep_alive();
      exchange->http_version = request.version() >= 11 ? 11 : 10;
      co_await handle(exchange, request);
      exchange->finished = true;
      if (!exchange->keep_alive || exchange->client_gone) break;
    }
  } catch (const std::exception& error) {
    PD_LOG_ERROR("pdrouter: session ended by an unexpected error: {}", error.what());
  }
  beast::error_code ec;
  stream.socket().shutdown(tcp::socket::shutdown_send, ec);
  stream.socket().close(ec);
}

awaitable<void> RouterServer::Impl::respond(Exchange& ex, int status, std::string content_type, std::string body) {
  ex.status = status;
  if (ex.client_gone) co_return;
  if (ex.response_start_ns == 0) ex.response_start_ns = now_ns();
  http::response<http::string_body> response{static_cast<http::status>(status), ex.http_version};
  response.set(http::field::content_type, content_type);
  response.keep_alive(ex.keep_alive);
  response.body() = std::move(body);
  response.prepare_payload();
  ex.client.expires_after(std::chrono::milliseconds(config_.client_write_timeout_ms));
  beast::error_code ec;
  co_await http::async_write(ex.client, response, with_ec(ec));
  ex.client.expires_never();
  ex.header_sent = true;
  if (ec) {
    ex.client_gone = true;
    ex.keep_alive = false;
  }
}

awaitable<void> RouterServer::Impl::relay_stream(Exchange& ex, Leg& leg, LegResult& head, std::string first_bytes,
                                                 TimePoint deadline) {
  ex.status = 200;
  if (ex.response_start_ns == 0) ex.response_start_ns = now_ns();
  // HTTP/1.0 has no chunked encoding: such a client gets the bytes as they come and the end of the
  // stream is the end of the connection.
  const bool chunked = ex.http_version >= 11;
  if (!chunked) ex.keep_alive = false;
  http::response<http::empty_body> response{http::status::ok, ex.http_version};
  response.set(http::field::content_type, head.content_type.empty() ? "text/event-stream" : head.content_type);
  response.set(http::field::cache_control, "no-cache");
  response.keep_alive(ex.keep_alive);
  if (!chunked) response.set(http::field::connection, "close");
  response.chunked(chunked);
  http::response_serializer<http::empty_body> serializer{response};
  beast::error_code ec;
  ex.client.expires_after(std::chrono::milliseconds(config_.client_write_timeout_ms));
  co_await http::async_write_header(ex.client, serializer, with_ec(ec));
  ex.header_sent = true;
  std::string piece = std::move(first_bytes);
  bool backend_failed = false;
  while (!ec) {
    if (!piece.empty()) {
      ex.client.expires_after(std::chrono::milliseconds(config_.client_write_timeout_ms));
      if (chunked) {
        co_await net::async_write(ex.client, http::make_chunk(net::buffer(piece)), with_ec(ec));
      } else {
        co_await net::async_write(ex.client, net::buffer(piece), with_ec(ec));
      }
      if (ec) break;
    }
    if (head.complete) {
      if (chunked) co_await net::async_write(ex.client, http::make_chunk_last(), with_ec(ec));
      break;
    }
    piece.clear();
    Status read = co_await leg.read_some(head, piece, deadline);
    if (!read.ok()) {
      if (!ex.client_gone) {
        PD_LOG_WARN("pdrouter: stream from {} broke: {}", leg.backend().info().instance_id, read.message());
        count_leg_failure(leg.backend().info().instance_id, ex.answering_leg,
                          read.code() == ErrorCode::kDeadlineExceeded ? "deadline" : "transport");
      }
      backend_failed = true;
      break;
    }
  }
  ex.client.expires_never();
  if (ec || ex.client_gone) {
    ex.client_gone = true;
    ex.keep_alive = false;
    ex.cancel_legs();
    co_return;
  }
  if (backend_failed) {
    // Ending the chunked body without its last chunk tells the client the stream is incomplete.
    ex.keep_alive = false;
    ex.status = 502;
    leg.cancel();
    co_return;
  }
  observe_leg_latency(leg.backend().info().instance_id, ex.answering_leg, ex.answering_leg_started_ns);
  leg.release();
}

awaitable<LegResult> RouterServer::Impl::start_consumer(Exchange& ex, Leg& leg, const std::string& target,
                                                        const std::string& body, bool stream, TimePoint deadline,
                                                        std::string& head_bytes) {
  const int64_t started_ns = now_ns();
  ex.answering_leg_started_ns = started_ns;
  LegResult result = co_await leg.start(target, body, config_.connect_timeout_ms, deadline);
  const bool is_event_stream = result.content_type.find("text/event-stream") != std::string::npos;
  if (result.transport.ok() && (!stream || result.http_status != 200 || !is_event_stream)) {
    Status read = co_await leg.read_rest(result, deadline);
    if (!read.ok()) result.transport = read;
  } else if (result.transport.ok()) {
    // Decode status before the client's 200: wait for the first complete event.
    std::optional<size_t> event_end;
    while (!(event_end = find_event_end(head_bytes)) && !result.complete) {
      Status read = co_await leg.read_some(result, head_bytes, deadline);
      if (!read.ok()) {
        result.transport = read;
        break;
      }
    }
    if (result.transport.ok() && event_end) {
      if (std::optional<int> status = error_event_status(head_bytes.substr(0, *event_end))) {
        // The engine failed the request inside a 200 stream: answer with a real error status instead.
        std::string_view event = std::string_view(head_bytes).substr(0, *event_end);
        size_t start = event.find("data:") + 5;
        size_t end = event.find('\n', start);
        result.http_status = *status;
        result.content_type = "application/json";
        result.body = std::string(event.substr(start, end - start));
        head_bytes.clear();
      }
    }
  }
  ex.backend_wait_ns += now_ns() - started_ns;
  co_return result;
}

awaitable<void> RouterServer::Impl::answer_from_consumer(Exchange& ex, Leg& leg, LegResult& result,
                                                         std::string head_bytes, TimePoint deadline) {
  if (ex.client_gone) {
    ex.cancel_legs();
    co_return;
  }
  if (!result.transport.ok()) {
    count_leg_failure(leg.backend().info().instance_id, ex.answering_leg, failure_reason(result));
    leg.cancel();
    const server::ApiError error = transport_error(
        result.transport,
        fmt::format("decode instance {} failed: {}", leg.backend().info().instance_id, result.transport.message()));
    co_await respond_error(ex, error);
    co_return;
  }
  if (result.http_status == 200 && !head_bytes.empty()) {
    co_await relay_stream(ex, leg, result, std::move(head_bytes), deadline);
    co_return;
  }
  if (result.http_status != 200) count_leg_failure(leg.backend().info().instance_id, ex.answering_leg, "http_status");
  if (result.http_status == 200 && result.complete) {
    observe_leg_latency(leg.backend().info().instance_id, ex.answering_leg, ex.answering_leg_started_ns);
  }
  if (result.complete) {
    leg.release();
  } else {
    leg.cancel();
  }
  std::string content_type = content_type_or_json(result);
  co_await respond(ex, result.http_status, content_type, std::move(result.body));
}

awaitable<LegResult> RouterServer::Impl::run_full_leg(Exchange* ex, Leg& leg, const std::string& target,
                                                      const std::string& body, TimePoint deadline,
                                                      uint64_t max_answer_bytes) {
  const int64_t started_ns = now_ns();
  LegResult result = co_await leg.start(target, body, config_.connect_timeout_ms, deadline);
  if (result.transport.ok()) {
    Status read = co_await leg.read_rest(result, deadline, max_answer_bytes);
    if (!read.ok()) result.transport = read;
  }
  if (ex != nullptr) ex->backend_wait_ns += now_ns() - started_ns;
  leg.release();
  co_return result;
}

awaitable<void> RouterServer::Impl::producer_task(std::shared_ptr<Leg> producer, std::shared_ptr<Leg> consumer,
                                                  std::shared_ptr<ProducerState> state, std::string target,
                                                  std::string body, int64_t connect_timeout_ms, TimePoint deadline) {
  const int64_t started_ns = now_ns();
  LegResult result = co_await producer->start(target, body, connect_timeout_ms, deadline);
  if (result.transport.ok()) {
    Status read = co_await producer->read_rest(result, deadline);
    if (!read.ok()) result.transport = read;
  }
  if (result.ok()) observe_leg_latency(producer->backend().info().instance_id, "prefill", started_ns);
  const bool cancelled_by_us = producer->cancelled();
  producer->release();
  state->done = true;
  state->result = std::move(result);
  if (state->done_signal) state->done_signal->cancel();
  if (state->release_when_done) {
    net::co_spawn(co_await net::this_coro::executor, release_transfer(state->release), net::detached);
  }
  if (!state->result.ok() && !state->consumer_committed && !cancelled_by_us) {
    // One leg failing cancels the other: the consumer would wait for KV that never comes.
    state->failed = true;
    consumer->cancel();
  }
}

awaitable<FlowOutcome> RouterServer::Impl::run_single(std::shared_ptr<Exchange> ex, std::shared_ptr<Leg> leg,
                                                      const std::string& target, const std::string& body, bool stream) {
  if (Status connected = co_await leg->connect(config_.connect_timeout_ms); !connected.ok()) {
    if (ex->client_gone) co_return FlowOutcome::kAnswered;
    PD_LOG_WARN("pdrouter: {}", connected.message());
    count_leg_failure(leg->backend().info().instance_id, ex->answering_leg, "connect");
    co_return FlowOutcome::kConnectFailed;
  }
  const TimePoint deadline = SteadyClock::now() + std::chrono::milliseconds(config_.decode_timeout_ms);
  std::string head_bytes;
  LegResult result = co_await start_consumer(*ex, *leg, target, body, stream, deadline, head_bytes);
  co_await answer_from_consumer(*ex, *leg, result, std::move(head_bytes), deadline);
  co_return FlowOutcome::kAnswered;
}

awaitable<FlowOutcome> RouterServer::Impl::run_pd(std::shared_ptr<Exchange> ex, const std::string& target,
                                                  const ClientRequest& request, const Snapshot& snapshot,
                                                  std::vector<Candidate>& candidates, const FlowPlan& plan,
                                                  const PlanRequest& plan_request) {
  const std::shared_ptr<Backend>& consumer = snapshot.backends[*plan.consumer];
  const TransferMode mode = plan.kind == FlowKind::kPdRead ? TransferMode::kRead : TransferMode::kWrite;
  // The consumer's connection first: an unreachable consumer is re-planned before any prefill work.
  std::shared_ptr<Leg> consumer_leg = ex->new_leg(consumer);
  if (Status connected = co_await consumer_leg->connect(config_.connect_timeout_ms); !connected.ok()) {
    if (ex->client_gone) co_return FlowOutcome::kAnswered;
    PD_LOG_WARN("pdrouter: {}", connected.message());
    count_leg_failure(consumer->info().instance_id, "decode", "connect");
    co_return FlowOutcome::kConnectFailed;
  }
  // A retry goes through the same scored policy as the first pick (loads and outstanding as they are now,
  // cached prefixes, kv_both instances under auto), never to a producer already tried.
  auto next_producer = [&]() {
    for (size_t i = 0; i < candidates.size(); ++i) candidates[i].outstanding = snapshot.backends[i]->outstanding();
    return pick_retry_producer(candidates, plan_request, plan, producer_ticket_.fetch_add(1), thread_random());
  };
  std::optional<size_t> producer_index = plan.producer;
  const bool prompt_logprobs = wants_prompt_logprobs(request.body) && !request.stream;
  const bool chat = target == "/v1/chat/completions";
  const TimePoint decode_deadline = SteadyClock::now() + std::chrono::milliseconds(config_.decode_timeout_ms);

  for (int attempt = 0; producer_index; ++attempt) {
    const std::shared_ptr<Backend>& producer = snapshot.backends[*producer_index];
    const std::string transfer_id = mint_transfer_id();
    const TimePoint prefill_deadline = SteadyClock::now() + std::chrono::milliseconds(config_.prefill_timeout_ms);
    std::shared_ptr<Leg> producer_leg = ex->new_leg(producer);
    const std::string producer_body = make_producer_body(request.body, transfer_id, mode).dump();
    LegResult producer_result;
    bool producer_failed = false;

    // Connect first: an unreachable producer is skipped before the consumer is asked to wait for it.
    if (Status connected = co_await producer_leg->connect(config_.connect_timeout_ms); !connected.ok()) {
      producer_leg->release();
      if (ex->client_gone) {
        ex->cancel_legs();
        co_return FlowOutcome::kAnswered;
      }
      producer_result.transport = connected;
      producer_failed = true;
    } else if (mode == TransferMode::kRead) {
      const int64_t prefill_started_ns = now_ns();
      producer_result = co_await run_full_leg(ex.get(), *producer_leg, target, producer_body, prefill_deadline);
      if (producer_result.ok()) observe_leg_latency(producer->info().instance_id, "prefill", prefill_started_ns);
      // From here on every way out without a consumer that took the KV releases the transfer; a READ
      // producer would otherwise hold it until its transfer timeout.
      const net::any_io_executor executor = co_await net::this_coro::executor;
      auto release = [&] {
        net::co_spawn(executor, release_transfer(release_target(producer, *ex, transfer_id)), net::detached);
      };
      if (ex->client_gone) {
        ex->cancel_legs();
        release();
        co_return FlowOutcome::kAnswered;
      }
      if (producer_result.ok()) {
        Result<nlohmann::ordered_json> consumer_body =
            make_read_consumer_body(request.body, transfer_id, producer_result.body, producer->info().instance_id);
        if (!consumer_body.ok()) {
          // The contract: a producer answer that does not carry our transfer fails the request.
          count_leg_failure(producer->info().instance_id, "prefill", "bad_kv_transfer_params");
          consumer_leg->cancel();
          release();
          const server::ApiError error =
              upstream_error(fmt::format("producer {} returned unusable kv_transfer_params: {}",
                                         producer->info().instance_id, consumer_body.status().message()),
                             false);
          co_await respond_error(*ex, error);
          co_return FlowOutcome::kAnswered;
        }
        std::string head_bytes;
        const std::string consumer_text = consumer_body->dump();
        LegResult result = co_await start_consumer(*ex, *consumer_leg, target, consumer_text, request.stream,
                                                   decode_deadline, head_bytes);
        const bool consumer_took_kv = !ex->client_gone && result.transport.ok() && result.http_status == 200;
        if (!consumer_took_kv) release();
        if (consumer_took_kv && prompt_logprobs &&
            !add_prompt_logprobs(result, producer_result.body, chat, producer->info().instance_id)) {
          consumer_leg->cancel();
          co_await respond_error(*ex, bad_prompt_logprobs_error(producer->info().instance_id));
          co_return FlowOutcome::kAnswered;
        }
        co_await answer_from_consumer(*ex, *consumer_leg, result, std::move(head_bytes), decode_deadline);
        co_return FlowOutcome::kAnswered;
      }
      // A producer that failed (a deadline above all) may still finish the prefill and hold its KV.
      release();
      producer_failed = true;
    } else {
      auto state = std::make_shared<ProducerState>();
      state->release = release_target(producer, *ex, transfer_id);
      const net::any_io_executor executor = co_await net::this_coro::executor;
      state->done_signal.emplace(executor);
      const std::string consumer_body = make_write_consumer_body(request.body, transfer_id, producer->info()).dump();
      net::co_spawn(co_await net::this_coro::executor,
                    producer_task(producer_leg, consumer_leg, state, target, producer_body, config_.connect_timeout_ms,
                                  prefill_deadline),
                    net::detached);
      std::string head_bytes;
      LegResult result = co_await start_consumer(*ex, *consumer_leg, target, consumer_body, request.stream,
                                                 decode_deadline, head_bytes);
      if (ex->client_gone) {
        ex->cancel_legs();
        release_after_producer(*state, executor);
        co_return FlowOutcome::kAnswered;
      }
      if (!state->failed) {
        state->consumer_committed = true;
        const bool consumer_ok = result.transport.ok() && result.http_status == 200;
        if (!consumer_ok) {
          // The consumer refused or failed: it will never take the KV. The producer leg is closed (an
          // engine aborts a request whose client left) and the transfer released once that leg ended.
          if (!state->done) producer_leg->cancel();
          release_after_producer(*state, executor);
        }
        if (consumer_ok && prompt_logprobs) {
          // The answer needs the producer's: wait for its leg (bounded by its deadline; a client that
          // leaves cancels it), then take its prompt logprobs.
          while (!state->done) {
            state->done_signal->expires_at(prefill_deadline);
            beast::error_code ec;
            co_await state->done_signal->async_wait(with_ec(ec));
            if (!ec) break;
          }
          if (ex->client_gone) {
            ex->cancel_legs();
            co_return FlowOutcome::kAnswered;
          }
          if (!state->done) {
            producer_leg->cancel();
            count_leg_failure(producer->info().instance_id, "prefill", "deadline");
          } else if (!state->result.ok()) {
            count_leg_failure(producer->info().instance_id, "prefill", failure_reason(state->result));
          }
          if (!state->done || !state->result.ok() ||
              !add_prompt_logprobs(result, state->result.body, chat, producer->info().instance_id)) {
            consumer_leg->cancel();
            co_await respond_error(*ex, bad_prompt_logprobs_error(producer->info().instance_id));
            co_return FlowOutcome::kAnswered;
          }
        }
        // A producer still answering finishes on its own (bounded by its deadline) so its
        // keep-alive connection goes back to the pool; a client disconnect still cancels it.
        co_await answer_from_consumer(*ex, *consumer_leg, result, std::move(head_bytes), decode_deadline);
        co_return FlowOutcome::kAnswered;
      }
      producer_failed = true;
      producer_result = state->result;
      release_after_producer(*state, executor);
    }

    // The prefill failed. A client error would fail anywhere: pass it on.
    if (producer_result.is_client_error()) {
      consumer_leg->cancel();
      std::string content_type = content_type_or_json(producer_result);
      co_await respond(*ex, producer_result.http_status, content_type, producer_result.body);
      co_return FlowOutcome::kAnswered;
    }
    if (producer_failed) {
      count_leg_failure(producer->info().instance_id, "prefill", failure_reason(producer_result));
      PD_LOG_WARN("pdrouter: prefill on {} failed (transfer {}): {}", producer->info().instance_id, transfer_id,
                  producer_result.transport.ok() ? fmt::format("HTTP {}", producer_result.http_status)
                                                 : producer_result.transport.message());
    }
    candidates[*producer_index].excluded = true;
    producer_index = attempt < config_.max_prefill_retries ? next_producer() : std::nullopt;
    if (producer_index) {
      cached_counter("pd_router_retries_total", "Prefill legs retried on another producer", {}).inc();
    }
    if (consumer_leg->cancelled() || consumer_leg->released()) {
      consumer_leg = ex->new_leg(consumer);
      if (Status connected = co_await consumer_leg->connect(config_.connect_timeout_ms); !connected.ok()) {
        count_leg_failure(consumer->info().instance_id, "decode", "connect");
        const server::ApiError error =
            transport_error(connected, fmt::format("decode instance unreachable: {}", connected.message()));
        co_await respond_error(*ex, error);
        co_return FlowOutcome::kAnswered;
      }
    }
  }

  // No producer left: the consumer computes the prompt itself, without transfer params. Counted, never silent.
  count_fallback("prefill_failed");
  PD_LOG_WARN("pdrouter: falling back to collocated decode on {}", consumer->info().instance_id);
  std::string head_bytes;
  const std::string fallback_body = request.body.dump();
  LegResult result =
      co_await start_consumer(*ex, *consumer_leg, target, fallback_body, request.stream, decode_deadline, head_bytes);
  co_await answer_from_consumer(*ex, *consumer_leg, result, std::move(head_bytes), decode_deadline);
  co_return FlowOutcome::kAnswered;
}

awaitable<std::optional<std::vector<int32_t>>> RouterServer::Impl::prompt_token_ids(std::shared_ptr<Exchange> ex,
                                                                                    PromptTokensPlan tokens_plan,
                                                                                    const ClientRequest& request,
                                                                                    const Snapshot& snapshot) {
  std::optional<std::vector<int32_t>> ids = std::move(tokens_plan.token_ids);
  if (!ids && tokens_plan.tokenize_body) {
    // Any instance of the model tokenizes the same way; the least busy one that decodes is asked (one of
    // them serves the request whatever the decision), else the least busy one.
    std::shared_ptr<Backend> tokenizer;
    auto preferred = [](const Backend& b) { return b.info().role != InstanceRole::kProducer; };
    for (const auto& backend : snapshot.backends) {
      const std::string& model = backend->info().model;
      if (!request.model.empty() && !model.empty() && model != request.model) continue;
      if (!tokenizer || (preferred(*backend) && !preferred(*tokenizer)) ||
          (preferred(*backend) == preferred(*tokenizer) && backend->outstanding() < tokenizer->outstanding())) {
        tokenizer = backend;
      }
    }
    if (tokenizer) {
      std::shared_ptr<Leg> leg = ex->new_leg(tokenizer);
      const TimePoint deadline = SteadyClock::now() + std::chrono::milliseconds(config_.tokenize_timeout_ms);
      // Connect, send and answer within the one deadline (Leg::start), the answer bounded.
      LegResult result = co_await run_full_leg(ex.get(), *leg, "/tokenize", *tokens_plan.tokenize_body, deadline,
                                               kMaxTokenizeAnswerBytes);
      Result<std::vector<int32_t>> parsed =
          result.ok()
              ? parse_tokenize_answer(result.body)
              : Result<std::vector<int32_t>>(unavailable("status {}: {}", result.http_status,
                                                         result.transport.ok() ? "" : result.transport.message()));
      if (parsed.ok()) {
        ids = std::move(parsed).value();
      } else if (!ex->client_gone) {
        cached_counter("pd_router_tokenize_failures_total",
                       "Prompts whose token ids the router could not get for its decision", {})
            .inc();
        PD_LOG_WARN("pdrouter: /tokenize on {} failed ({}); deciding without the prompt's tokens",
                    tokenizer->info().instance_id, parsed.status().message());
      }
    }
  }
  if (ids) truncate_prompt(*ids, tokens_plan.keep_last);
  co_return ids;
}

awaitable<void> RouterServer::Impl::handle_generation(std::shared_ptr<Exchange> ex, const std::string& target,
                                                      const std::string& body, bool generation, bool dry_run) {
  Result<ClientRequest> parsed = parse_client_request(body);
  const GenerationRoute route =
      target == "/v1/chat/completions" ? GenerationRoute::kChat : GenerationRoute::kCompletions;
  if (!parsed.ok()) {
    const server::ApiError error = generation ? unreadable_request_error(route, body, parsed.status().message())
                                              : server::bad_request(parsed.status().message());
    co_await respond_error(*ex, error);
    co_return;
  }
  const ClientRequest& request = *parsed;
  // The engine's validation, once, before any leg: a request the consumer would refuse must not reach a
  // producer (its leg asks for one token and would pass), where it would hold the prompt's KV for nothing.
  ValidatedRequest validated;
  std::optional<server::ApiError> invalid;
  if (generation) invalid = validate_generation_request(route, request.body, validated);
  if (invalid) {
    cached_counter("pd_router_requests_invalid_total", "Client requests refused by the router's validation", {}).inc();
    co_await respond(*ex, invalid->http_status, "application/json", invalid->to_text());
    co_return;
  }
  if (request.dropped_kv_transfer_params) {
    cached_counter("pd_router_client_kv_transfer_params_dropped_total",
                   "Client requests whose own kv_transfer_params were removed", {})
        .inc();
  }
  std::shared_ptr<const Snapshot> snapshot = discovery_.snapshot();
  std::vector<Candidate> candidates;
  candidates.reserve(snapshot->backends.size());
  for (const auto& backend : snapshot->backends) {
    candidates.push_back(
        Candidate{backend->info().role, backend->info().mode, backend->info().model, backend->outstanding()});
    candidates.back().has_connector = backend->info().control.has_value();
  }
  watch_client(ex);
  // Per-request decisions: the prompt's tokens, then each instance's load and cached prefix of them.
  std::optional<std::vector<int32_t>> prompt_ids;
  PlanRequest decision_inputs;
  decision_inputs.pd_policy = config_.pd_policy;
  decision_inputs.consumer_policy = config_.consumer_policy;
  decision_inputs.producer_policy = config_.producer_policy;
  {
    const std::shared_ptr<const CacheIndex> index = discovery_.cache_index();
    const bool any_cache_known =
        std::any_of(index->begin(), index->end(), [](const auto& entry) { return entry.second->hashes != nullptr; });
    if (generation && validated.num_prompts == 1 && validated.n == 1 &&
        prompt_tokens_matter(candidates, decision_inputs, any_cache_known)) {
      prompt_ids = co_await prompt_token_ids(ex, std::move(validated.prompt), request, *snapshot);
      if (ex->client_gone) co_return;
    }
  }
  // The views as they are now, after the /tokenize call: the freshest the heartbeats allow.
  const std::shared_ptr<const CacheIndex> cache_index = discovery_.cache_index();
  {
    std::vector<const InstanceInfo*> infos;
    for (const auto& backend : snapshot->backends) infos.push_back(&backend->info());
    annotate_candidates(candidates, infos, *cache_index, prompt_ids ? &*prompt_ids : nullptr);
  }
  for (size_t attempt = 0; attempt <= candidates.size(); ++attempt) {
    for (size_t i = 0; i < candidates.size(); ++i) candidates[i].outstanding = snapshot->backends[i]->outstanding();
    PlanRequest plan_request;
    plan_request.model = request.model;
    plan_request.producer_policy = config_.producer_policy;
    plan_request.consumer_policy = config_.consumer_policy;
    plan_request.producer_ticket = producer_ticket_.fetch_add(1, std::memory_order_relaxed);
    plan_request.consumer_ticket = consumer_ticket_.fetch_add(1, std::memory_order_relaxed);
    plan_request.random = thread_random();
    plan_request.forced_mode = config_.forced_mode;
    plan_request.pd_policy = config_.pd_policy;
    if (prompt_ids) plan_request.num_prompt_tokens = static_cast<int64_t>(prompt_ids->size());
    plan_request.thresholds = config_.thresholds;
    const FlowPlan plan = plan_flow(candidates, plan_request);
    if (dry_run) {
      std::string answer = plan_json(*snapshot, candidates, plan, plan_request,
                                     flow_label(plan, validated.num_prompts > 1, validated.n > 1));
      co_await respond(*ex, 200, "application/json", std::move(answer));
      co_return;
    }
    if (plan.kind == FlowKind::kNone) {
      if (plan.model_unknown) {
        const server::ApiError error = server::model_not_found(request.model);
        co_await respond_error(*ex, error);
      } else {
        std::string message = "no reachable instance";
        if (candidates.empty()) message = "no instances discovered";
        const server::ApiError error = no_instance_available(std::move(message));
        co_await respond_error(*ex, error);
      }
      co_return;
    }
    FlowOutcome outcome;
    // A batched prompt (several prompts in one completion) or several choices (n > 1) go whole to the
    // chosen consumer, which prefills itself: a P/D transfer carries one sequence's KV, and pdserve
    // refuses kv_transfer_params on a batch or with n > 1. The consumer answers it exactly as a
    // collocated pdserve does (choice indices, usage).
    const bool batched = validated.num_prompts > 1;
    const bool several_choices = validated.n > 1;
    if (generation) count_decision(flow_label(plan, batched, several_choices), plan.reason);
    ex->answering_leg =
        plan.kind == FlowKind::kCollocated || batched || several_choices || !generation ? "collocated" : "decode";
    if (!generation) {
      std::shared_ptr<Leg> leg = ex->new_leg(snapshot->backends[*plan.consumer]);
      outcome = co_await run_single(ex, leg, target, request.body.dump(), false);
    } else if (plan.kind == FlowKind::kCollocated || batched || several_choices) {
      if (plan.fallback == FallbackReason::kNoProducer) count_fallback("no_producer");
      if (plan.fallback == FallbackReason::kNoConsumer) count_fallback("no_consumer");
      if (plan.kind != FlowKind::kCollocated) count_fallback(batched ? "batched_prompts" : "several_choices");
      // Pass-through keeps the client's bytes unless something had to be removed.
      std::string leg_body;
      if (request.dropped_kv_transfer_params) {
        leg_body = request.body.dump();
      } else {
        leg_body = body;
      }
      std::shared_ptr<Leg> leg = ex->new_leg(snapshot->backends[*plan.consumer]);
      outcome = co_await run_single(ex, leg, target, leg_body, request.stream);
    } else {
      outcome = co_await run_pd(ex, target, request, *snapshot, candidates, plan, plan_request);
    }
    if (outcome == FlowOutcome::kAnswered) co_return;
    candidates[*plan.consumer].excluded = true;  // unreachable: try the next one
  }
  const server::ApiError error = no_instance_available("no reachable instance");
  co_await respond_error(*ex, error);
}

std::string RouterServer::Impl::health_json(const Snapshot& snapshot, bool& healthy) const {
  const std::shared_ptr<const CacheIndex> cache_index = discovery_.cache_index();
  nlohmann::json instances = nlohmann::json::array();
  for (const auto& backend : snapshot.backends) {
    const InstanceInfo& info = backend->info();
    instances.push_back({{"instance_id", info.instance_id},
                         {"role", role_name(info.role)},
                         {"mode", mode_name(info.mode)},
                         {"http", info.http.to_string()},
                         {"control", info.control ? info.control->to_string() : ""},
                         {"boot_nonce", info.boot_nonce},
                         {"model", info.model},
                         {"outstanding", backend->outstanding()}});
    // What its heartbeats report (README.md "Per-request decisions"), when they do.
    auto cached = cache_index->find(info.instance_id);
    if (cached != cache_index->end() && cached->second->boot_nonce == info.boot_nonce) {
      const InstanceCacheState& state = *cached->second;
      if (state.load) {
        instances.back()["load"] = {{"running", state.load->num_running},
                                    {"waiting", state.load->num_waiting},
                                    {"kv_blocks_free", state.load->num_kv_blocks_free},
                                    {"kv_blocks_total", state.load->num_kv_blocks_total},
                                    {"queued_prefill_tokens", state.load->num_queued_prefill_tokens}};
      }
      instances.back()["kv_cached_blocks"] =
          state.hashes ? nlohmann::json(state.hashes->size()) : nlohmann::json(nullptr);
    }
  }
  healthy = !snapshot.backends.empty();
  return dump_response_json({{"status", healthy ? "ok" : "no_instances"}, {"instances", instances}});
}

awaitable<std::string> RouterServer::Impl::forwarded_models_json(const Snapshot& snapshot) {
  std::vector<std::shared_ptr<Backend>> with_model;
  for (const auto& backend : snapshot.backends) {
    if (!backend->info().model.empty()) with_model.push_back(backend);
  }
  FanOut fan_out = co_await fan_out_get(with_model, "/v1/models", bearer_authorization(config_.backend_api_key),
                                        config_.info_timeout_ms, false);
  count_unanswered("/v1/models", fan_out, false);
  nlohmann::ordered_json data = nlohmann::ordered_json::array();
  std::vector<std::string> listed;
  auto is_listed = [&](const std::string& id) { return std::find(listed.begin(), listed.end(), id) != listed.end(); };
  // Each model's entry as the first instance (in instance_id order) that answered gives it.
  for (std::optional<LegResult>& reply : fan_out.answers) {
    if (!reply || !reply->ok()) continue;
    Result<nlohmann::ordered_json> answer = parse_json_bounded(reply->body);
    if (!answer.ok() || !answer->is_object() || !answer->contains("data") || !(*answer)["data"].is_array()) continue;
    for (auto& entry : (*answer)["data"]) {
      if (!entry.is_object() || !entry.contains("id") || !entry["id"].is_string()) continue;
      std::string id = entry["id"].get<std::string>();
      if (is_listed(id)) continue;
      listed.push_back(std::move(id));
      data.push_back(std::move(entry));
    }
  }
  // A served model no instance answered for: the router's own minimal entry.
  for (const auto& backend : snapshot.backends) {
    const std::string& model = backend->info().model;
    if (model.empty() || is_listed(model)) continue;
    listed.push_back(model);
    data.push_back({{"id", model}, {"object", "model"}, {"created", unix_seconds()}, {"owned_by", "pdserve"}});
  }
  nlohmann::ordered_json body = {{"object", "list"}, {"data", std::move(data)}};
  co_return body.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

awaitable<void> RouterServer::Impl::handle(std::shared_ptr<Exchange> ex, http::request<http::string_body>& request) {
  const std::string target(frontend::path_of(std::string_view(request.target().data(), request.target().size())));
  const bool is_post = request.method() == http::verb::post;
  const bool is_get = request.method() == http::verb::get;
  const bool is_generation = target == "/v1/completions" || target == "/v1/chat/completions";
  const bool is_tokenize = target == "/tokenize" || target == "/detokenize";
  // A dry run of a generation request: /pd/plan followed by the route it would take.
  const bool is_plan = target == "/pd/plan/v1/completions" || target == "/pd/plan/v1/chat/completions";
  ex->route = is_generation || is_tokenize || is_plan || target == "/v1/models" || target == "/health" ||
                      target == "/ping" || target == "/metrics"
                  ? target
                  : "other";

  // The routes pdserve guards with --api-key: /v1/* and the tokenizer's.
  if (!config_.api_key.empty() && (target.rfind("/v1/", 0) == 0 || is_tokenize || is_plan)) {
    const auto authorization = request[http::field::authorization];
    if (!frontend::bearer_authorized(std::string_view(authorization.data(), authorization.size()), config_.api_key)) {
      const server::ApiError error = server::unauthorized();
      co_await respond_error(*ex, error);
    }
  }
  if (ex->status == 0) {
    if (is_generation && is_post) {
      co_await handle_generation(ex, target, request.body());
    } else if (is_tokenize && is_post) {
      co_await handle_generation(ex, target, request.body(), false);
    } else if (is_plan && is_post) {
      const std::string planned_route = target.substr(std::string_view("/pd/plan").size());
      co_await handle_generation(ex, planned_route, request.body(), true, true);
    } else if (target == "/v1/models" && is_get) {
      std::shared_ptr<const Snapshot> snapshot = discovery_.snapshot();
      std::string models = co_await forwarded_models_json(*snapshot);
      co_await respond(*ex, 200, "application/json", std::move(models));
    } else if (target == "/version" && is_get) {
      // The engines' version, as the first instance that answers reports it (all are asked at once).
      std::shared_ptr<const Snapshot> snapshot = discovery_.snapshot();
      FanOut fan_out = co_await fan_out_get(
          snapshot->backends, "/version", bearer_authorization(config_.backend_api_key), config_.info_timeout_ms, true);
      std::optional<std::string> version;
      for (std::optional<LegResult>& reply : fan_out.answers) {
        if (reply && reply->ok()) {
          version = std::move(reply->body);
          break;
        }
      }
      count_unanswered("/version", fan_out, version.has_value());
      if (version) {
        co_await respond(*ex, 200, "application/json", std::move(*version));
      } else {
        const server::ApiError error = no_instance_available("no instance answered /version");
        co_await respond_error(*ex, error);
      }
    } else if ((target == "/health" || target == "/ping") && is_get) {
      bool healthy = false;
      std::string body = health_json(*discovery_.snapshot(), healthy);
      co_await respond(*ex, healthy ? 200 : 503, "application/json", std::move(body));
    } else if (target == "/metrics" && is_get) {
      // The process's series, then the per-instance ones of the instances discovered now.
      std::string text =
          metrics::Registry::global().render_prometheus() + InstanceMetrics::global().render_prometheus();
      co_await respond(*ex, 200, "text/plain; version=0.0.4", std::move(text));
    } else if (is_generation || is_tokenize || is_plan || target == "/v1/models" || target == "/health" ||
               target == "/ping" || target == "/version" || target == "/metrics") {
      const server::ApiError error = server::method_not_allowed(std::string(request.method_string()), target);
      co_await respond_error(*ex, error);
    } else {
      const server::ApiError error = server::route_not_found(target);
      co_await respond_error(*ex, error);
    }
  }
  ex->finished = true;
  beast::error_code ec;
  ex->client.socket().cancel(ec);  // ends the disconnect watch
  if (ex->client_gone) ex->cancel_legs();

  const int64_t done_ns = now_ns();
  const std::string status = ex->client_gone && !ex->header_sent ? "499" : std::to_string(ex->status);
  cached_counter("pd_router_requests_total", "Requests by route and status", {{"route", ex->route}, {"status", status}})
      .inc();
  if (is_generation) {
    cached_histogram("pd_router_request_duration_seconds", "End-to-end request time at the router",
                     {{"route", ex->route}}, metrics::latency_buckets_seconds())
        .observe(static_cast<double>(done_ns - ex->received_ns) * 1e-9);
    if (ex->response_start_ns != 0) {
      const int64_t added_ns = ex->response_start_ns - ex->received_ns - ex->backend_wait_ns;
      cached_histogram("pd_router_added_latency_seconds",
                       "Router time before the first response byte, excluding time waiting on backends",
                       {{"route", ex->route}}, added_latency_buckets())
          .observe(static_cast<double>(std::max<int64_t>(0, added_ns)) * 1e-9);
    }
  }
}

// ---------------------------------------------------------------- RouterServer

RouterServer::RouterServer(RouterConfig config)
    : config_(std::move(config)), discovery_(config_, static_cast<size_t>(std::max(1, config_.num_io_threads))) {}

RouterServer::~RouterServer() {
  stop();
}

Status RouterServer::start() {
  const int num_threads = std::max(1, config_.num_io_threads);
  for (int i = 0; i < num_threads; ++i) io_contexts_.push_back(std::make_unique<net::io_context>(1));
  impl_ = std::make_unique<Impl>(config_, discovery_);
  for (auto& context : io_contexts_) {
    impl_->contexts_.push_back(context.get());
    // Asio creates an io_context's reactor (an epoll, an eventfd and a timerfd) with its first
    // socket or timer. The first socket of an io thread is made inside the initiation of the
    // accept that targets it, which must not throw: a reactor that cannot be created there
    // because the process is out of descriptors (EMFILE) terminates the process. Create it now.
    tcp::socket creates_the_reactor(*context);
  }

  PD_RETURN_IF_ERROR(impl_->listener_.bind(io_contexts_[0]->get_executor()));
  http_port_ = impl_->listener_.port();

  PD_RETURN_IF_ERROR(discovery_.start());
  impl_->listener_.start([impl = impl_.get()] { return impl->place_connection(); },
                         [impl = impl_.get()](tcp::socket socket, size_t thread_index, ConnectionSlot slot) {
                           return impl->session(std::move(socket), thread_index, std::move(slot));
                         });
  for (size_t i = 0; i < io_contexts_.size(); ++i) {
    net::co_spawn(*io_contexts_[i], impl_->prune_loop(i), net::detached);
  }
  for (auto& context : io_contexts_) {
    io_threads_.emplace_back([&context] {
      auto work = net::make_work_guard(*context);
      context->run();
    });
  }
  return Status::Ok();
}

void RouterServer::stop() {
  if (stopped_ || !impl_) return;
  stopped_ = true;
  for (auto& context : io_contexts_) context->stop();
  for (auto& thread : io_threads_) thread.join();
  discovery_.stop();
  discovery_.clear_idle_connections();
  impl_->listener_.close();
  // Pending sessions (and the legs they own) are destroyed with their io_context.
  io_contexts_.clear();
}

}  // namespace pd::router
