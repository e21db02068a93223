// A fast stand-in engine for measuring the router itself: answers every POST
// at once with a fixed OpenAI-shaped completion (SSE when the body asks for
// "stream": true), serves GET /pd/info and /v1/models. READ-mode producer legs
// get kv_transfer_params back with the transfer_id they carried, so the
// router's READ flow runs end to end. Thread per connection, keep-alive.
//
//   fast_backend --port 0 --role producer|consumer|both --mode write|read --id NAME
// Prints "fast_backend listening on http://127.0.0.1:PORT".
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <cstdio>
#include <string>
#include <thread>

#include "http_lite.h"

namespace {

std::string g_role = "both", g_mode = "write", g_id = "fast0";
int g_port = 0;

std::string extract_transfer_id(const std::string& body) {
  size_t pos = body.find("\"transfer_id\"");
  if (pos == std::string::npos) return {};
  pos = body.find('"', body.find(':', pos) + 1);
  return body.substr(pos + 1, 32);
}

std::string response(int status, const char* content_type, const std::string& body) {
  return "HTTP/1.1 " + std::to_string(status) + " OK\r\nContent-Type: " + content_type +
         "\r\nContent-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

void serve(int fd) {
  router_bench::Conn conn(fd);
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  const std::string choice =
      R"({"id":"cmpl-fast","object":"text_completion","created":1,"model":"builtin:tiny","choices":[{"index":0,"text":"ok","finish_reason":"length","logprobs":null}])";
  const std::string usage = R"("usage":{"prompt_tokens":8,"completion_tokens":1,"total_tokens":9})";
  for (;;) {
    std::string head, body;
    if (!conn.read_head(head) || !conn.read_body(head, body)) return;
    std::string out;
    if (head.rfind("GET /pd/info", 0) == 0) {
      out = response(200, "application/json",
                     "{\"role\":\"" + g_role + "\",\"http\":\"127.0.0.1:" + std::to_string(g_port) +
                         "\",\"control\":\"127.0.0.1:9\",\"instance_id\":\"" + g_id +
                         "\",\"boot_nonce\":1,\"tp_size\":1,\"dp_size\":1,\"mode\":\"" + g_mode +
                         "\",\"model\":\"builtin:tiny\"}");
    } else if (head.rfind("GET ", 0) == 0) {
      out = response(200, "application/json", R"({"object":"list","data":[{"id":"builtin:tiny","object":"model"}]})");
    } else if (body.find("\"stream\":true") != std::string::npos || body.find("\"stream\": true") != std::string::npos) {
      std::string events = "data: " + choice + "}\n\ndata: " + choice + "," + usage + "}\n\ndata: [DONE]\n\n";
      char size[32];
      std::snprintf(size, sizeof size, "%zx\r\n", events.size());
      out = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" +
            std::string(size) + events + "\r\n0\r\n\r\n";
    } else {
      std::string extra;
      if (body.find("\"do_remote_decode\":true") != std::string::npos && g_mode == "read") {
        extra = ",\"kv_transfer_params\":{\"transfer_id\":\"" + extract_transfer_id(body) +
                "\",\"remote_instance_id\":\"" + g_id +
                "\",\"remote_control\":\"127.0.0.1:9\",\"remote_boot_nonce\":1,\"block_ids\":[0],\"num_tokens\":8}";
      }
      out = response(200, "application/json", choice + "," + usage + extra + "}");
    }
    if (!conn.write_all(out)) return;
  }
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i];
    if (flag == "--port") g_port = std::atoi(argv[i + 1]);
    if (flag == "--role") g_role = argv[i + 1];
    if (flag == "--mode") g_mode = argv[i + 1];
    if (flag == "--id") g_id = argv[i + 1];
  }
  int listener = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(static_cast<uint16_t>(g_port));
  if (bind(listener, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 || listen(listener, 4096) != 0) {
    std::perror("fast_backend: bind/listen");
    return 1;
  }
  socklen_t length = sizeof address;
  getsockname(listener, reinterpret_cast<sockaddr*>(&address), &length);
  g_port = ntohs(address.sin_port);
  std::printf("fast_backend listening on http://127.0.0.1:%d\n", g_port);
  std::fflush(stdout);
  for (;;) {
    int fd = accept(listener, nullptr, nullptr);
    if (fd < 0) continue;
    std::thread(serve, fd).detach();
  }
}
