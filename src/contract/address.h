// Addresses and text as the contract carries them: "host:port" endpoints and
// the string checks every record field passes before it is believed.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace pd::contract {

struct HostPort {
  std::string host;
  uint16_t port = 0;  // 0: not known yet (never on the wire as such; see registration.h)

  // "host:port", or "[v6]:port" when the host holds a ':'.
  std::string to_string() const;
  bool operator==(const HostPort&) const = default;
};

// "host:port" or "[v6]:port": host non-empty, at most 253 bytes of printable ASCII
// without '/', '[' or ']'; brackets exactly when the host is IPv6 (holds a ':');
// port 1..65535 in decimal. to_string() of the result gives the text back.
Result<HostPort> parse_host_port(std::string_view text);

// Bytes 0x21..0x7e only (no spaces, no controls).
bool is_printable_ascii(std::string_view text);
// Well-formed UTF-8 (RFC 3629): no overlong forms, no surrogates, nothing above U+10FFFF.
bool is_valid_utf8(std::string_view text);

}  // namespace pd::contract
