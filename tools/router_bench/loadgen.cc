// Closed-loop HTTP load generator for the router benchmark: C keep-alive
// connections, each sending the same POST back to back for D seconds (after a
// warm-up), recording per-request latency (send to last body byte).
//
//   loadgen --host 127.0.0.1 --port P --path /v1/completions --body JSON --connections C --duration-s D
// Prints one JSON line: requests, errors, rps, p50_us, p90_us, p99_us, max_us.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "http_lite.h"

namespace {

using Clock = std::chrono::steady_clock;

int connect_to(const std::string& host, int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, host.c_str(), &address.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    close(fd);
    return -1;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

}  // namespace

int main(int argc, char** argv) {
  std::string host = "127.0.0.1", path = "/v1/completions", body = "{}";
  int port = 0, connections = 1;
  double duration_s = 5, warmup_s = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--host") host = argv[i + 1];
    if (flag == "--port") port = std::atoi(argv[i + 1]);
    if (flag == "--path") path = argv[i + 1];
    if (flag == "--body") body = argv[i + 1];
    if (flag == "--connections") connections = std::atoi(argv[i + 1]);
    if (flag == "--duration-s") duration_s = std::atof(argv[i + 1]);
    if (flag == "--warmup-s") warmup_s = std::atof(argv[i + 1]);
  }
  const std::string request = "POST " + path + " HTTP/1.1\r\nHost: " + host + "\r\nContent-Type: application/json\r\n" +
                              "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
  const auto start = Clock::now();
  const auto measure_from = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(warmup_s));
  const auto stop_at = measure_from + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(duration_s));
  std::mutex mutex;
  std::vector<int64_t> all_latencies_ns;
  std::atomic<int64_t> errors{0};
  std::vector<std::thread> threads;
  for (int c = 0; c < connections; ++c) {
    threads.emplace_back([&] {
      std::vector<int64_t> latencies;
      std::unique_ptr<router_bench::Conn> conn;
      while (Clock::now() < stop_at) {
        if (!conn) {
          int fd = connect_to(host, port);
          if (fd < 0) {
            errors++;
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
            continue;
          }
          conn = std::make_unique<router_bench::Conn>(fd);
        }
        const auto sent = Clock::now();
        std::string head, response_body;
        if (!conn->write_all(request) || !conn->read_head(head) || !conn->read_body(head, response_body)) {
          errors++;
          conn.reset();
          continue;
        }
        const auto done = Clock::now();
        if (head.compare(9, 3, "200") != 0) errors++;
        if (sent >= measure_from && done <= stop_at) latencies.push_back((done - sent).count());
        if (router_bench::Conn::header_has(head, "connection", "close")) conn.reset();
      }
      std::lock_guard<std::mutex> lock(mutex);
      all_latencies_ns.insert(all_latencies_ns.end(), latencies.begin(), latencies.end());
    });
  }
  for (auto& thread : threads) thread.join();
  std::sort(all_latencies_ns.begin(), all_latencies_ns.end());
  auto percentile_us = [&](double q) {
    if (all_latencies_ns.empty()) return 0.0;
    size_t index = std::min(all_latencies_ns.size() - 1, static_cast<size_t>(q * all_latencies_ns.size()));
    return all_latencies_ns[index] / 1e3;
  };
  std::printf(
      "{\"requests\": %zu, \"errors\": %lld, \"rps\": %.1f, \"p50_us\": %.1f, \"p90_us\": %.1f, \"p99_us\": %.1f, "
      "\"max_us\": %.1f}\n",
      all_latencies_ns.size(), static_cast<long long>(errors.load()), all_latencies_ns.size() / duration_s,
      percentile_us(0.5), percentile_us(0.9), percentile_us(0.99),
      all_latencies_ns.empty() ? 0.0 : all_latencies_ns.back() / 1e3);
  return 0;
}
