#include "frontend/listener.h"

#include <boost/asio/co_spawn.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/this_coro.hpp>
#include <boost/asio/use_awaitable.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/field.hpp>

#include "common/clock.h"
#include "common/log.h"
#include "frontend/api_error.h"
#include "frontend/connection.h"
#include "frontend/wire.h"

namespace pd::frontend {

using boost::system::error_code;
using net::use_awaitable;

namespace {

void log_failure(std::exception_ptr error) {
  if (!error) return;
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    PD_LOG_WARN("connection ended with: {}", e.what());
  }
}

}  // namespace

Listener::Listener(ListenerOptions options, metrics::Counter& refused)
    : options_(std::move(options)), refused_(refused), gate_(options_.max_connections) {}

Status Listener::bind(const net::any_io_executor& executor) {
  error_code ec;
  const net::ip::address address = net::ip::make_address(options_.host, ec);
  if (ec) return invalid_argument("--host '{}' is not an IP address: {}", options_.host, ec.message());
  tcp::acceptor& acceptor = acceptor_.emplace(executor);
  const tcp::endpoint endpoint(address, options_.port);
  acceptor.open(endpoint.protocol(), ec);
  if (!ec) acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) acceptor.bind(endpoint, ec);
  if (!ec) acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) return unavailable("cannot listen on {}:{}: {}", options_.host, options_.port, ec.message());
  bound_port_ = acceptor.local_endpoint().port();
  return Status::Ok();
}

void Listener::start(PlaceFn place, ServeFn serve) {
  place_ = std::move(place);
  serve_ = std::move(serve);
  net::co_spawn(acceptor_->get_executor(), accept_loop(), [name = options_.log_name](std::exception_ptr error) {
    if (!error) return;
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      PD_LOG_ERROR("{}: accept loop ended: {}", name, e.what());
    }
  });
}

void Listener::stop_accepting() {
  net::post(acceptor_->get_executor(), [this] {
    error_code ec;
    acceptor_->close(ec);
  });
}

void Listener::close() {
  if (!acceptor_) return;
  error_code ec;
  acceptor_->close(ec);
  acceptor_.reset();
}

net::awaitable<void> Listener::accept_loop() {
  net::steady_timer backoff(co_await net::this_coro::executor);
  while (acceptor_->is_open()) {
    const Placement placement = place_();
    tcp::socket socket(placement.executor);
    error_code ec;
    co_await acceptor_->async_accept(socket, net::redirect_error(use_awaitable, ec));
    if (ec == net::error::operation_aborted || !acceptor_->is_open()) break;
    if (ec) {
      if (accept_error_log_.admit(now_ns())) {
        PD_LOG_WARN("{}: accept failed: {} (retrying every {} ms; {} more failures since the last report)",
                    options_.log_name, ec.message(), kAcceptRetryDelay.count(), accept_error_log_.num_held_back());
      }
      backoff.expires_after(kAcceptRetryDelay);
      co_await backoff.async_wait(net::redirect_error(use_awaitable, ec));
      continue;
    }
    ConnectionGate::Admission admission = gate_.admit(now_ns());
    if (admission.verdict != ConnectionGate::Verdict::kServe) {
      refused_.inc();
      if (admission.log_now) {
        PD_LOG_WARN(
            "{}: {} connections open, the limit (--max-connections): answering new ones 503 ({} more refused "
            "since the last report)",
            options_.log_name, options_.max_connections, admission.num_held_back);
      }
      if (admission.verdict == ConnectionGate::Verdict::kDrop) {
        socket.close(ec);
        continue;
      }
      net::co_spawn(placement.executor, refuse(std::move(socket), std::move(*admission.slot)), log_failure);
      continue;
    }
    socket.set_option(tcp::no_delay(true), ec);
    net::co_spawn(placement.executor, serve_(std::move(socket), placement.index, std::move(*admission.slot)),
                  log_failure);
  }
}

// refusal_slot lives in the coroutine frame: released when the answer is written and drained.
net::awaitable<void> Listener::refuse(tcp::socket socket, [[maybe_unused]] ConnectionSlot refusal_slot) {
  boost::beast::tcp_stream stream(std::move(socket));
  Response response = error_response(too_many_connections(options_.max_connections), 11, false, options_.server_header);
  response.set(http::field::retry_after, "1");
  // Answered before the request is read (its route does not matter: /health is refused too). The
  // request the client sends meanwhile is discarded, bounded well below a body limit: a refused
  // connection must stay cheap. A client sending more than this may see a reset.
  if (co_await write_response(stream, response, options_.write_timeout_ms)) {
    co_await drain_before_close(stream, 64 * 1024, std::chrono::seconds(1));
  }
  error_code ec;
  stream.socket().close(ec);
}

}  // namespace pd::frontend
