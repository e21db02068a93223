#include "contract/address.h"

#include <charconv>

namespace pd::contract {

std::string HostPort::to_string() const {
  if (host.find(':') != std::string::npos) return fmt::format("[{}]:{}", host, port);
  return fmt::format("{}:{}", host, port);
}

bool is_printable_ascii(std::string_view text) {
  for (char c : text) {
    if (c < 0x21 || c > 0x7e) return false;
  }
  return true;
}

bool is_valid_utf8(std::string_view text) {
  size_t i = 0;
  while (i < text.size()) {
    const auto lead = static_cast<unsigned char>(text[i]);
    size_t num_continuation = 0;
    unsigned char second_min = 0x80;
    unsigned char second_max = 0xbf;
    if (lead < 0x80) {
      ++i;
      continue;
    }
    if (lead >= 0xc2 && lead <= 0xdf) {
      num_continuation = 1;
    } else if (lead >= 0xe0 && lead <= 0xef) {
      num_continuation = 2;
      if (lead == 0xe0) second_min = 0xa0;  // overlong
      if (lead == 0xed) second_max = 0x9f;  // surrogates
    } else if (lead >= 0xf0 && lead <= 0xf4) {
      num_continuation = 3;
      if (lead == 0xf0) second_min = 0x90;  // overlong
      if (lead == 0xf4) second_max = 0x8f;  // above U+10FFFF
    } else {
      return false;
    }
    if (text.size() - i <= num_continuation) return false;
    for (size_t k = 1; k <= num_continuation; ++k) {
      const auto byte = static_cast<unsigned char>(text[i + k]);
      const unsigned char min = k == 1 ? second_min : 0x80;
      const unsigned char max = k == 1 ? second_max : 0xbf;
      if (byte < min || byte > max) return false;
    }
    i += num_continuation + 1;
  }
  return true;
}

Result<HostPort> parse_host_port(std::string_view text) {
  std::string_view host;
  std::string_view port_text;
  if (!text.empty() && text.front() == '[') {
    size_t close = text.find(']');
    if (close == std::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return invalid_argument("address '{}' is not [v6]:port", text.substr(0, 64));
    }
    host = text.substr(1, close - 1);
    port_text = text.substr(close + 2);
    // Brackets hold an IPv6 address only: "[name]:port" would print back as "name:port", and
    // "[[1]:9" as "[1:9", which no longer parses.
    if (host.find(':') == std::string_view::npos) {
      return invalid_argument("address '{}': brackets are for IPv6 hosts only", text.substr(0, 64));
    }
  } else {
    size_t colon = text.rfind(':');
    if (colon == std::string_view::npos) return invalid_argument("address '{}' has no :port", text.substr(0, 64));
    host = text.substr(0, colon);
    port_text = text.substr(colon + 1);
    if (host.find(':') != std::string_view::npos) {
      return invalid_argument("address '{}': IPv6 hosts need brackets", text.substr(0, 64));
    }
  }
  if (host.empty() || host.size() > 253 || !is_printable_ascii(host) ||
      host.find_first_of("/[]") != std::string_view::npos) {
    return invalid_argument("address '{}' has an invalid host", text.substr(0, 64));
  }
  unsigned port = 0;
  auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), port);
  if (ec != std::errc() || end != port_text.data() + port_text.size() || port == 0 || port > 65535) {
    return invalid_argument("address '{}' has an invalid port (1..65535)", text.substr(0, 64));
  }
  return HostPort{std::string(host), static_cast<uint16_t>(port)};
}

}  // namespace pd::contract
