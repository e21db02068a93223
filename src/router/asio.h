// One place for the Asio/Beast includes and aliases used by pdrouter's I/O adapters.
#pragma once

// g++ 12 with Boost 1.74: <utility> must precede the Boost headers for the coroutine support.
#include <utility>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

namespace pd::router {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using net::awaitable;

// Completion token that reports errors in `ec` instead of throwing.
inline auto with_ec(beast::error_code& ec) { return net::redirect_error(net::use_awaitable, ec); }

}  // namespace pd::router
