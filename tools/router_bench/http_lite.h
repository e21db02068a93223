// Minimal blocking HTTP/1.1 framing shared by the router benchmark's backend
// and load generator: enough for keep-alive requests/responses with
// Content-Length or chunked bodies. Benchmark-only; not used by pdserve.
#pragma once

#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <strings.h>

namespace router_bench {

// A buffered reader over one socket.
class Conn {
 public:
  explicit Conn(int fd) : fd_(fd) {}
  ~Conn() {
    if (fd_ >= 0) ::close(fd_);
  }
  int fd() const { return fd_; }

  bool write_all(const std::string& data) {
    size_t sent = 0;
    while (sent < data.size()) {
      ssize_t n = ::send(fd_, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return false;
      sent += static_cast<size_t>(n);
    }
    return true;
  }

  // Reads up to and including "\r\n\r\n"; false on EOF/error.
  bool read_head(std::string& head) {
    for (;;) {
      size_t end = buffer_.find("\r\n\r\n", scanned_);
      if (end != std::string::npos) {
        head = buffer_.substr(0, end + 4);
        buffer_.erase(0, end + 4);
        scanned_ = 0;
        return true;
      }
      scanned_ = buffer_.size() > 3 ? buffer_.size() - 3 : 0;
      if (!fill()) return false;
    }
  }

  bool read_exact(size_t num_bytes, std::string& out) {
    while (buffer_.size() < num_bytes) {
      if (!fill()) return false;
    }
    out.append(buffer_, 0, num_bytes);
    buffer_.erase(0, num_bytes);
    return true;
  }

  bool read_line(std::string& line) {
    for (;;) {
      size_t end = buffer_.find("\r\n");
      if (end != std::string::npos) {
        line = buffer_.substr(0, end);
        buffer_.erase(0, end + 2);
        return true;
      }
      if (!fill()) return false;
    }
  }

  // Reads a body framed by the headers in `head` (Content-Length or chunked).
  bool read_body(const std::string& head, std::string& body) {
    if (header_has(head, "transfer-encoding", "chunked")) {
      for (;;) {
        std::string line;
        if (!read_line(line)) return false;
        size_t size = std::strtoul(line.c_str(), nullptr, 16);
        if (size == 0) {
          std::string trailer;
          do {
            if (!read_line(trailer)) return false;
          } while (!trailer.empty());
          return true;
        }
        if (!read_exact(size, body)) return false;
        std::string crlf;
        if (!read_exact(2, crlf)) return false;
      }
    }
    return read_exact(content_length(head), body);
  }

  static size_t content_length(const std::string& head) {
    std::string value = header_value(head, "content-length");
    return value.empty() ? 0 : std::strtoul(value.c_str(), nullptr, 10);
  }

  static std::string header_value(const std::string& head, const char* name) {
    size_t pos = 0;
    const size_t name_len = std::strlen(name);
    while ((pos = head.find("\r\n", pos)) != std::string::npos) {
      pos += 2;
      if (head.size() > pos + name_len && strncasecmp(head.c_str() + pos, name, name_len) == 0 &&
          head[pos + name_len] == ':') {
        size_t start = head.find_first_not_of(' ', pos + name_len + 1);
        size_t end = head.find("\r\n", start);
        return head.substr(start, end - start);
      }
    }
    return {};
  }

  static bool header_has(const std::string& head, const char* name, const char* value) {
    std::string got = header_value(head, name);
    return strcasestr(got.c_str(), value) != nullptr;
  }

 private:
  bool fill() {
    char chunk[16384];
    ssize_t n = ::recv(fd_, chunk, sizeof chunk, 0);
    if (n <= 0) return false;
    buffer_.append(chunk, static_cast<size_t>(n));
    return true;
  }

  int fd_;
  std::string buffer_;
  size_t scanned_ = 0;
};

}  // namespace router_bench
