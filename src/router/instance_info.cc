#include "router/instance_info.h"

namespace pd::router {

Result<HostPort> parse_http_url(std::string_view url) {
  constexpr std::string_view kScheme = "http://";
  if (url.substr(0, kScheme.size()) != kScheme) {
    return invalid_argument("url '{}' must start with http://", url.substr(0, 64));
  }
  std::string_view rest = url.substr(kScheme.size());
  if (!rest.empty() && rest.back() == '/') rest.remove_suffix(1);
  return parse_host_port(rest);
}

}  // namespace pd::router
