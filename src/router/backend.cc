#include "router/backend.h"

#include <algorithm>
#include <limits>

#include "common/clock.h"
#include "common/log.h"
#include "router/instance_metrics.h"

namespace pd::router {

namespace {
constexpr size_t kPieceBytes = 16 * 1024;
LegResult failed_leg(Status status) {
  LegResult result;
  result.transport = std::move(status);
  return result;
}

}  // namespace

Status status_from_error(const beast::error_code& ec, std::string_view what) {
  if (ec == beast::error::timeout) return deadline_exceeded("{}: deadline passed", what);
  if (ec == net::error::operation_aborted) return aborted("{}: cancelled", what);
  return unavailable("{}: {}", what, ec.message());
}

Backend::Backend(InstanceInfo info, tcp::endpoint endpoint, size_t num_io_threads, size_t max_idle_per_thread,
                 std::chrono::milliseconds max_idle, std::string authorization, std::shared_ptr<Counter> outstanding)
    : info_(std::move(info)),
      endpoint_(std::move(endpoint)),
      host_header_(info_.http.to_string()),
      authorization_(std::move(authorization)),
      outstanding_(outstanding ? std::move(outstanding) : std::make_shared<Counter>(0)) {
  idle_.reserve(num_io_threads);
  for (size_t i = 0; i < num_io_threads; ++i) idle_.emplace_back(max_idle_per_thread, max_idle);
}

Backend::~Backend() = default;

void Backend::add_outstanding(int64_t delta) {
  const int64_t now = outstanding_->fetch_add(delta, std::memory_order_relaxed) + delta;
  InstanceMetrics::global().set_outstanding(info_.instance_id, now);
}

std::unique_ptr<beast::tcp_stream> Backend::take_idle(size_t thread_index) {
  return idle_[thread_index].take(SteadyClock::now());  // dropping an expired entry closes it
}

void Backend::put_idle(size_t thread_index, std::unique_ptr<beast::tcp_stream> stream) {
  idle_[thread_index].put(std::move(stream), SteadyClock::now());
}

void Backend::prune_idle(size_t thread_index) {
  idle_[thread_index].prune(SteadyClock::now());
}

void Backend::clear_idle() {
  for (auto& idle : idle_) idle.clear();
}

Leg::Leg(std::shared_ptr<Backend> backend, size_t thread_index)
    : backend_(std::move(backend)), thread_index_(thread_index) {
  backend_->add_outstanding(1);
}

Leg::~Leg() {
  release();
}

awaitable<Status> Leg::connect(int64_t connect_timeout_ms, bool fresh) {
  if (cancelled_ || released_) co_return aborted("leg to {} cancelled", backend_->info().instance_id);
  if (!fresh) stream_ = backend_->take_idle(thread_index_);
  if (stream_) {
    reused_ = true;
    co_return Status::Ok();
  }
  reused_ = false;
  auto executor = co_await net::this_coro::executor;
  stream_ = std::make_unique<beast::tcp_stream>(executor);
  stream_->expires_after(std::chrono::milliseconds(connect_timeout_ms));
  beast::error_code ec;
  co_await stream_->async_connect(backend_->endpoint(), with_ec(ec));
  if (ec) {
    stream_.reset();
    co_return status_from_error(
        ec, fmt::format("connect to {} ({})", backend_->info().instance_id, backend_->info().http.to_string()));
  }
  beast::error_code option_ec;
  stream_->socket().set_option(tcp::no_delay(true), option_ec);
  co_return Status::Ok();
}

awaitable<LegResult> Leg::send_and_read_header(const std::string& target, const std::string& body,
                                               std::chrono::steady_clock::time_point deadline) {
  LegResult result;
  http::request<http::string_body> request{http::verb::post, target, 11};
  request.set(http::field::host, backend_->host_header());
  request.set(http::field::content_type, "application/json");
  if (!backend_->authorization().empty()) request.set(http::field::authorization, backend_->authorization());
  request.keep_alive(true);
  request.body() = body;
  request.prepare_payload();

  beast::error_code ec;
  stream_->expires_at(deadline);
  co_await http::async_write(*stream_, request, with_ec(ec));
  if (!ec) {
    parser_.emplace();
    parser_->body_limit(std::numeric_limits<uint64_t>::max());
    buffer_.clear();
    co_await http::async_read_header(*stream_, buffer_, *parser_, with_ec(ec));
  }
  if (ec) {
    result.transport = status_from_error(ec, fmt::format("{} {}", backend_->info().instance_id, target));
    co_return result;
  }
  const auto& header = parser_->get();
  result.http_status = static_cast<int>(header.result_int());
  result.content_type = std::string(header[http::field::content_type]);
  complete_ = parser_->is_done();
  result.complete = complete_;
  co_return result;
}

awaitable<LegResult> Leg::start(const std::string& target, const std::string& body, int64_t connect_timeout_ms,
                                std::chrono::steady_clock::time_point deadline) {
  // One deadline for the whole leg: connecting takes no longer than what is left of it.
  const int64_t left_ms =
      std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
  connect_timeout_ms = std::max<int64_t>(1, std::min(connect_timeout_ms, left_ms));
  if (!stream_) {
    Status connected = co_await connect(connect_timeout_ms);
    if (!connected.ok()) co_return failed_leg(connected);
  }
  LegResult result = co_await send_and_read_header(target, body, deadline);
  // A pooled connection may have been closed by the server while idle; that
  // shows as a failure before any response byte. Nothing reached the engine,
  // so one retry is safe, on a NEW connection: another pooled one may have
  // idled just as long.
  if (!result.transport.ok() && reused_ && !cancelled_ && buffer_.size() == 0 &&
      result.transport.code() == ErrorCode::kUnavailable) {
    static metrics::Counter& stale_retries = metrics::Registry::global().counter(
        "pd_router_stale_connection_retries_total",
        "Requests resent on a new connection because a pooled one was closed by the engine");
    stale_retries.inc();
    stream_.reset();
    Status connected = co_await connect(connect_timeout_ms, /*fresh=*/true);
    if (!connected.ok()) co_return failed_leg(connected);
    result = co_await send_and_read_header(target, body, deadline);
  }
  co_return result;
}

awaitable<Status> Leg::read_some(LegResult& result, std::string& out, std::chrono::steady_clock::time_point deadline) {
  if (complete_) {
    result.complete = true;
    co_return Status::Ok();
  }
  if (piece_.empty()) piece_.resize(kPieceBytes);
  stream_->expires_at(deadline);
  for (;;) {
    auto& body = parser_->get().body();
    body.data = piece_.data();
    body.size = piece_.size();
    beast::error_code ec;
    co_await http::async_read_some(*stream_, buffer_, *parser_, with_ec(ec));
    if (ec == http::error::need_buffer) ec = {};
    if (ec) {
      co_return status_from_error(ec, fmt::format("reading from {}", backend_->info().instance_id));
    }
    const size_t num_bytes = piece_.size() - parser_->get().body().size;
    out.append(piece_.data(), num_bytes);
    complete_ = parser_->is_done();
    result.complete = complete_;
    if (num_bytes > 0 || complete_) co_return Status::Ok();
  }
}

awaitable<Status> Leg::read_rest(LegResult& result, std::chrono::steady_clock::time_point deadline,
                                 uint64_t max_bytes) {
  while (!result.complete) {
    Status status = co_await read_some(result, result.body, deadline);
    if (!status.ok()) co_return status;
    if (result.body.size() > max_bytes) {
      co_return resource_exhausted("response of {} exceeds {} bytes", backend_->info().instance_id, max_bytes);
    }
  }
  co_return Status::Ok();
}

void Leg::cancel() {
  cancelled_ = true;
  if (stream_) {
    beast::error_code ec;
    stream_->socket().shutdown(tcp::socket::shutdown_both, ec);
    stream_->close();
  }
}

void Leg::release() {
  if (released_) return;
  released_ = true;
  backend_->add_outstanding(-1);
  if (!stream_) return;
  if (!cancelled_ && complete_ && parser_ && parser_->get().keep_alive()) {
    stream_->expires_never();
    backend_->put_idle(thread_index_, std::move(stream_));
    return;
  }
  beast::error_code ec;
  stream_->socket().close(ec);
}

std::string bearer_authorization(const std::string& api_key) {
  return api_key.empty() ? std::string() : "Bearer " + api_key;
}

awaitable<LegResult> http_get(const tcp::endpoint& endpoint, const std::string& host_header, const std::string& target,
                              const std::string& authorization, int64_t timeout_ms) {
  LegResult result;
  auto executor = co_await net::this_coro::executor;
  beast::tcp_stream stream(executor);
  stream.expires_after(std::chrono::milliseconds(timeout_ms));
  beast::error_code ec;
  co_await stream.async_connect(endpoint, with_ec(ec));
  http::request<http::empty_body> request{http::verb::get, target, 11};
  request.set(http::field::host, host_header);
  if (!authorization.empty()) request.set(http::field::authorization, authorization);
  request.keep_alive(false);
  if (!ec) co_await http::async_write(stream, request, with_ec(ec));
  beast::flat_buffer buffer;
  http::response_parser<http::string_body> parser;
  parser.body_limit(1024 * 1024);
  if (!ec) co_await http::async_read(stream, buffer, parser, with_ec(ec));
  if (ec) {
    result.transport = status_from_error(ec, fmt::format("GET {} from {}", target, host_header));
    co_return result;
  }
  result.http_status = static_cast<int>(parser.get().result_int());
  result.content_type = std::string(parser.get()[http::field::content_type]);
  result.body = std::move(parser.get().body());
  result.complete = true;
  beast::error_code close_ec;
  stream.socket().shutdown(tcp::socket::shutdown_both, close_ec);
  co_return result;
}

}  // namespace pd::router
