// Helpers shared by the xfer tests: byte patterns and framed messages over a
// socket (the tests' stand-in for the connector's control plane).
#pragma once

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <vector>

#include "common/clock.h"

namespace pd::xfer::testing {

// Byte i of pattern `seed`: distinct per seed and position, never 0.
inline uint8_t pattern_byte(uint64_t seed, uint64_t i) {
  uint64_t x = (seed + 1) * 0x9e3779b97f4a7c15ULL ^ (i >> 3) * 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 31;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 29;
  return static_cast<uint8_t>(((x >> ((i & 7) * 8)) & 0xff) | 1);
}

inline void fill_pattern(std::span<uint8_t> bytes, uint64_t seed) {
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = pattern_byte(seed, i);
}

// Waits until fd is ready for `events` or the deadline passes.
inline bool wait_fd(int fd, short events, const Deadline& deadline) {
  while (true) {
    pollfd p = {fd, events, 0};
    int n = ::poll(&p, 1, static_cast<int>(deadline.remaining_ms()));
    if (n > 0) return true;
    if (n == 0 || errno != EINTR) return false;
  }
}

inline bool write_all(int fd, const void* data, size_t bytes, const Deadline& deadline) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (bytes > 0) {
    if (!wait_fd(fd, POLLOUT, deadline)) return false;
    ssize_t n = ::send(fd, p, bytes, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

inline bool read_all(int fd, void* data, size_t bytes, const Deadline& deadline) {
  auto* p = static_cast<uint8_t*>(data);
  while (bytes > 0) {
    if (!wait_fd(fd, POLLIN, deadline)) return false;
    ssize_t n = ::recv(fd, p, bytes, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

inline bool send_frame(int fd, std::span<const uint8_t> payload, const Deadline& deadline) {
  uint64_t n = payload.size();
  return write_all(fd, &n, sizeof(n), deadline) && write_all(fd, payload.data(), payload.size(), deadline);
}

inline std::optional<std::vector<uint8_t>> recv_frame(int fd, const Deadline& deadline,
                                                      uint64_t max_bytes = 1ULL << 32) {
  uint64_t n = 0;
  if (!read_all(fd, &n, sizeof(n), deadline) || n > max_bytes) return std::nullopt;
  std::vector<uint8_t> payload(n);
  if (!read_all(fd, payload.data(), n, deadline)) return std::nullopt;
  return payload;
}

}  // namespace pd::xfer::testing
