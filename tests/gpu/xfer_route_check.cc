// pd_gpu_xfer_route_check: the cuda xfer backend's route checks (open_route in
// src/xfer/backends/cuda_backend.cc) against forged peer descriptors on a real GPU.
// A peer's MemDesc is its word only: for a peer in another process the offset + bytes its
// cuda key claims must lie inside the allocation the IPC handle maps; for a peer claiming
// this process (same-process shortcut) base + bytes must lie inside a span some cuda
// backend of this process registered. Forged copies of real descriptors go straight to
// TransferEngine::session (no decode: the decoder's own limits are not what is tested here).
//
// A forked target process owns a 64 MiB allocation with a 16 MiB region registered at
// 4 MiB and canary bytes everywhere else; an in-process target engine owns an 8 MiB
// allocation with 4 MiB registered at 2 MiB; an unregistered "stray" buffer sits beside.
// After every case all three are compared byte for byte with what they must hold, so a
// forged route that was refused but still wrote something fails too. A forged route that
// is wrongly opened gets one probe write aimed at canary bytes (where possible), so the
// bug shows as changed bytes rather than only as a status.
//
// Usage: pd_gpu_xfer_route_check [target_device]   (default 0; the initiator uses device 0)
// Prints one line per case and "route check: N passed, M failed"; exit 1 if any failed,
// 2 if setup failed.
#include <cuda_runtime.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "common/clock.h"
#include "xfer/engine.h"

namespace pd::route_check {
namespace {

using xfer::MemDesc;
using xfer::MemKind;
using xfer::Op;

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t k64K = 64ull << 10;
// The target's allocation is larger than its region, so a check against the region's
// size could not pass for one against the allocation (and the reverse).
constexpr uint64_t kAllocBytes = 64 * kMiB;
constexpr uint64_t kRegionOffset = 4 * kMiB;
constexpr uint64_t kRegionBytes = 16 * kMiB;
constexpr uint64_t kInprocAllocBytes = 8 * kMiB;
constexpr uint64_t kInprocRegionOffset = 2 * kMiB;
constexpr uint64_t kInprocRegionBytes = 4 * kMiB;
constexpr uint64_t kSourceBytes = 16 * kMiB;
constexpr uint64_t kStrayBytes = 4 * kMiB;
constexpr uint64_t kSourceSeed = 0x5eed, kCanarySeed = 0xc0ffee, kInprocSeed = 0x1abe1, kStraySeed = 0x57a7;
constexpr int64_t kIoTimeoutMs = 60'000;          // one reply, or the child's descriptors
constexpr int64_t kChildIdleTimeoutMs = 300'000;  // the child waits this long for a command
constexpr int64_t kBatchTimeoutMs = 30'000;
// The cuda key as the backend writes it (register_memory): IPC handle, offset of the
// region in its allocation, owner pid. Backend layout, checked against the real key.
constexpr size_t kKeyOffsetAt = sizeof(cudaIpcMemHandle_t);
constexpr size_t kKeyPidAt = kKeyOffsetAt + sizeof(uint64_t);
constexpr size_t kKeyBytes = kKeyPidAt + sizeof(uint64_t);

uint8_t pattern(uint64_t seed, uint64_t i) {
  uint64_t x = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  return static_cast<uint8_t>(x >> 40);
}
std::vector<uint8_t> patterned(uint64_t seed, uint64_t bytes) {
  std::vector<uint8_t> v(bytes);
  for (uint64_t i = 0; i < bytes; ++i) v[i] = pattern(seed, i);
  return v;
}

// Moves exactly `bytes` over the control socket; every wait is a poll() bounded by the deadline.
bool io_all(int fd, void* data, size_t bytes, bool send, int64_t timeout_ms) {
  auto* p = static_cast<uint8_t*>(data);
  const Deadline deadline = Deadline::after_ms(timeout_ms);
  while (bytes > 0) {
    pollfd pfd{fd, static_cast<short>(send ? POLLOUT : POLLIN), 0};
    const int ready = ::poll(&pfd, 1, static_cast<int>(deadline.remaining_ms()));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) return false;
    const ssize_t n = send ? ::send(fd, p, bytes, MSG_NOSIGNAL | MSG_DONTWAIT) : ::recv(fd, p, bytes, MSG_DONTWAIT);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}
bool send_blob(int fd, std::vector<uint8_t> blob) {
  uint64_t n = blob.size();
  return io_all(fd, &n, sizeof(n), true, kIoTimeoutMs) && io_all(fd, blob.data(), n, true, kIoTimeoutMs);
}
std::vector<uint8_t> recv_blob(int fd) {
  uint64_t n = 0;
  if (!io_all(fd, &n, sizeof(n), false, kIoTimeoutMs) || n > k64K) return {};
  std::vector<uint8_t> blob(n);
  if (!io_all(fd, blob.data(), n, false, kIoTimeoutMs)) return {};
  return blob;
}

// 'V': the initiator wrote source[source_offset, +bytes) at region_offset (bytes 0: wrote
// nothing); the target compares its whole allocation and replies the number of bytes that
// differ from what they must hold (UINT64_MAX when it could not read them). 'Q': quit.
struct Command {
  uint64_t op = 0;
  uint64_t region_offset = 0;
  uint64_t source_offset = 0;
  uint64_t bytes = 0;
};

xfer::EngineConfig engine_config(const char* name) {
  xfer::EngineConfig config;
  config.name = name;
  config.backends = {"cuda"};
  config.batch_timeout_ms = kBatchTimeoutMs;
  return config;
}

// Bytes of the device buffer `dev` that differ from `expected`; UINT64_MAX if unreadable.
uint64_t mismatches(const void* dev, const std::vector<uint8_t>& expected) {
  std::vector<uint8_t> actual(expected.size());
  if (cudaMemcpy(actual.data(), dev, actual.size(), cudaMemcpyDeviceToHost) != cudaSuccess) return UINT64_MAX;
  uint64_t bad = 0;
  for (size_t i = 0; i < actual.size(); ++i) bad += actual[i] != expected[i];
  return bad;
}

// ---- target process ----

int run_target(int fd, int device, pid_t parent) {
  // Dies with the initiator (a timeout killing it must not leave a GPU process behind).
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || getppid() != parent) return 1;
  auto engine = xfer::TransferEngine::create(engine_config("route-check-target"));
  if (!engine.ok()) {
    std::fprintf(stderr, "target: %s\n", engine.status().to_string().c_str());
    return 2;
  }
  void* alloc = nullptr;
  // Canary everywhere, the region included: the expected image starts as the canary.
  std::vector<uint8_t> expected = patterned(kCanarySeed, kAllocBytes);
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaMalloc(&alloc, kAllocBytes);
  if (e == cudaSuccess) e = cudaMemcpy(alloc, expected.data(), kAllocBytes, cudaMemcpyHostToDevice);
  if (e != cudaSuccess) {
    std::fprintf(stderr, "target: device %d: %s\n", device, cudaGetErrorString(e));
    return 3;
  }
  auto mem =
      (*engine)->register_memory(static_cast<char*>(alloc) + kRegionOffset, kRegionBytes, MemKind::kCuda, device);
  if (!mem.ok()) {
    std::fprintf(stderr, "target: %s\n", mem.status().to_string().c_str());
    return 4;
  }
  if (!send_blob(fd, xfer::encode((*engine)->describe())) || !send_blob(fd, xfer::encode(*mem))) return 5;
  Command cmd;
  while (io_all(fd, &cmd, sizeof(cmd), false, kChildIdleTimeoutMs) && cmd.op == 'V') {
    uint64_t bad = UINT64_MAX;
    if (cmd.region_offset <= kRegionBytes && cmd.bytes <= kRegionBytes - cmd.region_offset &&
        cmd.source_offset <= kSourceBytes && cmd.bytes <= kSourceBytes - cmd.source_offset) {
      for (uint64_t i = 0; i < cmd.bytes; ++i) {
        expected[kRegionOffset + cmd.region_offset + i] = pattern(kSourceSeed, cmd.source_offset + i);
      }
      bad = mismatches(alloc, expected);
    }
    if (!io_all(fd, &bad, sizeof(bad), true, kIoTimeoutMs)) break;
  }
  (void)(*engine)->deregister(mem->region_id);
  engine->reset();
  cudaFree(alloc);
  return 0;
}

// ---- initiator ----

struct Case {
  const char* name;
  bool accept;
  bool on_child;                        // forged from the child's descriptor (else the in-process target's)
  std::function<void(MemDesc&)> forge;  // edits a copy of that descriptor
  Op op;                                // posted when the session opens; bytes 0: open the session only
};

class Initiator {
 public:
  explicit Initiator(int fd) : fd_(fd) {}
  ~Initiator() {
    // Engines (and their routes) go before the memory they reach.
    engine_.reset();
    inproc_.reset();
    for (void* p : {source_, stray_, inproc_alloc_}) cudaFree(p);
  }

  bool setup() {
    auto engine = xfer::TransferEngine::create(engine_config("route-check-initiator"));
    auto inproc = xfer::TransferEngine::create(engine_config("route-check-inproc"));
    if (!engine.ok() || !inproc.ok()) return fail("engine: " + (engine.ok() ? inproc : engine).status().to_string());
    engine_ = std::move(engine).value();
    inproc_ = std::move(inproc).value();
    if (cudaSetDevice(0) != cudaSuccess || !upload(&source_, patterned(kSourceSeed, kSourceBytes)) ||
        !upload(&stray_, stray_expected_) || !upload(&inproc_alloc_, inproc_expected_)) {
      return fail("cudaMalloc / upload on device 0");
    }
    auto local = engine_->register_memory(source_, kSourceBytes, MemKind::kCuda, 0);
    auto inproc_mem = inproc_->register_memory(static_cast<char*>(inproc_alloc_) + kInprocRegionOffset,
                                               kInprocRegionBytes, MemKind::kCuda, 0);
    if (!local.ok() || !inproc_mem.ok()) {
      return fail("register: " + (local.ok() ? inproc_mem : local).status().to_string());
    }
    local_ = *local;
    inproc_mem_ = *inproc_mem;
    auto child_engine = xfer::decode_engine_desc(recv_blob(fd_));
    auto child_mem = xfer::decode_mem_desc(recv_blob(fd_));
    if (!child_engine.ok() || !child_mem.ok()) return fail("the target's descriptors did not arrive");
    child_mem_ = *child_mem;
    for (const xfer::EngineDesc& peer : {*child_engine, inproc_->describe()}) {
      if (Status s = engine_->connect(peer); !s.ok()) return fail("connect: " + s.to_string());
    }
    for (const MemDesc* d : {&child_mem_, &inproc_mem_}) {
      auto key = d->keys.find("cuda");
      if (key == d->keys.end() || key->second.size() != kKeyBytes) return fail("cuda key layout changed");
    }
    return true;
  }

  // Runs every case; returns the number that failed.
  int run() {
    const uint64_t pid = static_cast<uint64_t>(getpid());
    const uint64_t stray = reinterpret_cast<uint64_t>(stray_);
    const uint64_t inproc_base = inproc_mem_.base, region_end = inproc_base + inproc_mem_.bytes;
    const uint64_t fresh_region = child_mem_.region_id + 1000;
    auto key = [](uint64_t offset, uint64_t bytes) {
      return [=](MemDesc& d) {
        put(d, kKeyOffsetAt, offset);
        d.bytes = bytes;
      };
    };
    // Claims this process for the child's region: region id changed so that no cached IPC
    // mapping of the real region (keyed by engine, boot, region, device) bypasses the shortcut.
    auto ours = [=](uint64_t base, uint64_t bytes) {
      return [=](MemDesc& d) {
        put(d, kKeyPidAt, pid);
        d.region_id = fresh_region;
        d.base = base;
        d.bytes = bytes;
      };
    };
    auto span_at = [](uint64_t base, uint64_t bytes) {
      return [=](MemDesc& d) {
        d.base = base;
        d.bytes = bytes;
      };
    };
    auto none = [](MemDesc&) {};
    // One case a line.
    // clang-format off
    const std::vector<Case> cases = {
        {"ipc_real_region", true, true, none, {0, 0, kRegionBytes}},
        // Ends exactly at the allocation's end: the limit is the allocation, not the region.
        {"ipc_ends_at_allocation_end", true, true, key(kAllocBytes - kRegionBytes, kRegionBytes), {0, 0, 0}},
        {"ipc_one_byte_past_allocation", false, true, key(kAllocBytes - kRegionBytes, kRegionBytes + 1), {0, 0, k64K}},
        {"ipc_bytes_eq_allocation", false, true, key(kRegionOffset, kAllocBytes), {0, kRegionBytes, kMiB}},
        {"ipc_offset_near_end", false, true, key(kAllocBytes - kMiB, kRegionBytes), {0, 0, k64K}},
        {"ipc_offset_2^63", false, true, key(1ull << 63, kRegionBytes), {0, 0, k64K}},
        // offset + bytes wraps to 64 KiB: a naive `offset + bytes <= size` would pass.
        {"ipc_offset_plus_bytes_wraps", false, true, key(kRegionOffset, k64K - kRegionOffset), {0, kRegionBytes, k64K}},
        {"ipc_offset_wraps_high", false, true, key(UINT64_MAX - 4095, 8192), {0, 0, 4096}},
        {"same_pid_inprocess_real", true, false, none, {2 * kMiB, 0, kInprocRegionBytes}},
        {"same_pid_unregistered_buffer", false, true, ours(stray, kStrayBytes), {0, 0, kMiB}},
        {"same_pid_random_address", false, true, ours(0x5a5a5a5a0000ull, kMiB), {0, 0, k64K}},
        {"same_pid_straddles_region_end", false, false, span_at(region_end - k64K, kMiB), {0, k64K, k64K}},
        {"same_pid_region_grown", false, false, span_at(inproc_base, kInprocRegionBytes + kMiB), {0, 4 * kMiB, k64K}},
        // After the refusals the route and the context still work.
        {"ipc_real_region_again", true, true, none, {3 * kMiB, kMiB, 8 * kMiB}},
    };
    // clang-format on
    int failed = 0;
    for (const Case& c : cases) failed += run_case(c) ? 0 : 1;
    std::printf("route check: %d passed, %d failed\n", static_cast<int>(cases.size()) - failed, failed);
    return failed;
  }

  const std::string& error() const { return error_; }

 private:
  static void put(MemDesc& d, size_t at, uint64_t value) { std::memcpy(d.keys.at("cuda").data() + at, &value, 8); }

  bool upload(void** dev, const std::vector<uint8_t>& bytes) {
    return cudaMalloc(dev, bytes.size()) == cudaSuccess &&
           cudaMemcpy(*dev, bytes.data(), bytes.size(), cudaMemcpyHostToDevice) == cudaSuccess;
  }
  bool fail(std::string what) {
    error_ = std::move(what);
    return false;
  }

  bool run_case(const Case& c) {
    MemDesc remote = c.on_child ? child_mem_ : inproc_mem_;
    c.forge(remote);
    std::string got;
    bool posted = false, written = false;
    {
      auto session = engine_->session(local_, remote, "cuda");
      if (!session.ok()) {
        got = "refused at session (" + session.status().to_string() + ")";
      } else if (c.op.bytes == 0) {
        posted = written = true;  // nothing to post: an opened session is the acceptance
        got = "session opened";
      } else if (auto id = session->write(std::span<const Op>(&c.op, 1)); !id.ok()) {
        got = "refused at post (" + id.status().to_string() + ")";
      } else {
        posted = true;
        const Status s = engine_->wait(*id, Deadline::after_ms(kBatchTimeoutMs));
        engine_->release(*id);
        written = s.ok();
        got = written ? "accepted, written" : "accepted, batch failed (" + s.to_string() + ")";
      }
    }  // the session (and its route) goes before the next case
    // Only an accepted real write changes what the targets must hold.
    const bool wrote_child = c.accept && written && c.on_child && c.op.bytes > 0;
    if (c.accept && written && !c.on_child) {
      for (uint64_t i = 0; i < c.op.bytes; ++i) {
        inproc_expected_[kInprocRegionOffset + c.op.remote_offset + i] = pattern(kSourceSeed, c.op.local_offset + i);
      }
    }
    const uint64_t child_bad =
        verify_child(wrote_child ? Command{'V', c.op.remote_offset, c.op.local_offset, c.op.bytes} : Command{'V'});
    const uint64_t inproc_bad = mismatches(inproc_alloc_, inproc_expected_);
    const uint64_t stray_bad = mismatches(stray_, stray_expected_);
    const bool pass = (c.accept ? written : !posted) && child_bad == 0 && inproc_bad == 0 && stray_bad == 0;
    std::string changed;
    auto note = [&changed](const char* where, uint64_t bad) {
      if (bad == UINT64_MAX) changed += fmt::format("; {} unreadable", where);
      if (bad != 0 && bad != UINT64_MAX) changed += fmt::format("; {} bytes wrong in the {}", bad, where);
    };
    note("target allocation", child_bad);
    note("in-process allocation", inproc_bad);
    note("stray buffer", stray_bad);
    std::printf("case %s: expected %s, got %s%s -> %s\n", c.name, c.accept ? "accept" : "refuse", got.c_str(),
                changed.c_str(), pass ? "PASS" : "FAIL");
    std::fflush(stdout);
    return pass;
  }

  uint64_t verify_child(Command cmd) {
    uint64_t bad = UINT64_MAX;
    if (child_alive_) {
      child_alive_ =
          io_all(fd_, &cmd, sizeof(cmd), true, kIoTimeoutMs) && io_all(fd_, &bad, sizeof(bad), false, kIoTimeoutMs);
    }
    return child_alive_ ? bad : UINT64_MAX;
  }

  int fd_;
  bool child_alive_ = true;  // a target that stopped answering is not waited for again
  std::string error_;
  std::unique_ptr<xfer::TransferEngine> engine_, inproc_;
  void* source_ = nullptr;
  void* stray_ = nullptr;
  void* inproc_alloc_ = nullptr;
  std::vector<uint8_t> stray_expected_ = patterned(kStraySeed, kStrayBytes);
  std::vector<uint8_t> inproc_expected_ = patterned(kInprocSeed, kInprocAllocBytes);
  MemDesc local_, child_mem_, inproc_mem_;
};

// Ends the target: 'Q', then its socket closing (at its exit) bounds the wait for it.
int finish_target(int fd, pid_t child) {
  Command quit{'Q'};
  (void)io_all(fd, &quit, sizeof(quit), true, kIoTimeoutMs);
  uint8_t byte = 0;
  if (io_all(fd, &byte, 1, false, kIoTimeoutMs)) kill(child, SIGKILL);  // talks instead of quitting
  pollfd pfd{fd, POLLIN, 0};
  if (::poll(&pfd, 1, 0) == 0) kill(child, SIGKILL);  // still open after the timeout: hung
  int status = 0;
  while (waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
}

}  // namespace
}  // namespace pd::route_check

int main(int argc, char** argv) {
  using namespace pd::route_check;
  const int target_device = argc > 1 ? std::atoi(argv[1]) : 0;
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) return 2;
  // Fork before either process touches CUDA: a CUDA context does not survive fork().
  std::fflush(stdout);
  const pid_t parent = getpid();
  const pid_t child = fork();
  if (child < 0) return 2;
  if (child == 0) {
    close(fds[0]);
    _exit(run_target(fds[1], target_device, parent));
  }
  close(fds[1]);
  int failed = 0;
  {
    Initiator initiator(fds[0]);
    if (!initiator.setup()) {
      std::printf("route check: setup failed: %s\n", initiator.error().c_str());
      int status = 0;
      if (waitpid(child, &status, WNOHANG) == child) {  // the target's own failure (its stderr says why)
        std::printf("route check: target exited with status %d\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
      } else {
        kill(child, SIGKILL);
        waitpid(child, nullptr, 0);
      }
      return 2;
    }
    failed = initiator.run();
  }
  const int target_status = finish_target(fds[0], child);
  if (target_status != 0) std::printf("route check: target exited with status %d\n", target_status);
  return failed > 0 || target_status != 0 ? 1 : 0;
}
