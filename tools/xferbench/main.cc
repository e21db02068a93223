// xferbench: measures the transfer engine between two processes on one backend,
// each figure beside its reference from the same run (cudaMemcpyPeer for cuda,
// ucx_perftest for ucx), with byte-exact verification of every timed transfer.
//
// The initiator (this process) forks the target before touching CUDA or UCX; the
// two exchange descriptors and verification commands over a socketpair. Before each
// iteration the target poisons its region; after it, the target checks every byte
// the batch wrote against the pattern of the initiator's source bytes.
#include <fcntl.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "bench_device.h"
#include "common/clock.h"
#include "common/log.h"
#include "xfer/engine.h"

namespace pd::xferbench {
namespace {

using xfer::MemKind;
using xfer::Op;

constexpr int64_t kIoTimeoutMs = 120'000;

struct Options {
  std::string backend = "cuda";
  std::string scenarios = "contiguous,kv,kv_layers,small,mixed";
  int iters = 10;
  int warmup = 2;
  bool json = false;
  std::string ucx_tls;
  std::string cuda_mode = "kernel";
  uint32_t cuda_chunk_bytes = 64 * 1024;
  uint32_t cuda_ctas_per_sm = 4;
  uint32_t cuda_threads = 512;
  int local_device = 0;
  int remote_device = 1;
  // KV shape (Qwen3-8B): per layer [num_blocks][K,V][block_tokens][kv_heads][head_dim] bf16.
  int layers = 36;
  int kv_heads = 8;
  int head_dim = 128;
  int dtype_bytes = 2;
  int block_tokens = 16;
  int prompt_tokens = 2000;
  int pool_blocks = 0;  // blocks per layer in each region; 0 = twice the prompt's
  int small_ops = 16384;
  uint64_t seed = 12345;
  std::string perftest = "ucx_perftest";
  bool b2b = true;
  bool ucx_busy_poll = false;
  bool host_malloc = false;
  bool cuda_upload_table = false;
  bool cuda_post_pipeline = true;
  uint32_t cuda_streams = 4;
  int gpu_warmup_ms = 300;
  // Target engine on a thread of this process instead of a forked process (cuda:
  // pointers instead of IPC, for machines where CUDA IPC is not available).
  bool same_process = false;
  // Memory of both regions: "auto" (gpu for cuda, host for ucx), "host", "gpu" (ucx:
  // through staging unless UCX handles CUDA memory) or "staged-host" (ucx: host memory
  // registered as GPU memory and moved by the staging protocol with memcpy as the
  // device copy: the protocol's cost on a machine without a GPU).
  std::string memory = "auto";
  // Network placement (ucx): the target runs in this network namespace (made with `ip
  // netns add`, joined by e.g. a veth) and each engine uses the interface of its host
  // address; ucx_perftest runs the same way. Empty: both on loopback.
  std::string target_netns;
  std::string target_host = "127.0.0.1";
  std::string initiator_host = "127.0.0.1";
  // TransferEngine settings to compare in one run: "name:key=value,..." (keys: mode, pipeline,
  // streams, chunk, ctas, threads, upload_table). Empty: one variant from the flags.
  std::vector<std::string> variants;
  bool compare = false;
};

// A named set of engine settings; every scenario runs once per variant.
struct Variant {
  std::string name;
  Options options;
  std::string settings() const {
    const Options& o = options;
    if (o.backend != "cuda") return o.ucx_tls.empty() ? "ucx" : "ucx tls=" + o.ucx_tls;
    return fmt::format("mode={} pipeline={} streams={} chunk={} ctas/sm={} threads={}{}", o.cuda_mode,
                       o.cuda_post_pipeline ? 1 : 0, o.cuda_streams, o.cuda_chunk_bytes, o.cuda_ctas_per_sm,
                       o.cuda_threads, o.cuda_upload_table ? " upload_table" : "");
  }
};

// The comparison the cuda figures in docs/perf/xfer.md come from: the previous post
// (sort first, one stream), each change alone, both, and the copy-engine modes.
const char* const kCompareVariants[] = {
    "old:pipeline=0,streams=1",
    "pipeline:pipeline=1,streams=1",
    "streams4:pipeline=0,streams=4",
    "new:pipeline=1,streams=4",
    "ce_per_op:mode=copy_engine,pipeline=0,streams=1",
    "ce_batch:mode=copy_batch,pipeline=1,streams=4",
};

// Parses "name:key=value,key=value" on top of `base`.
std::optional<Variant> parse_variant(const std::string& spec, const Options& base, std::string* error) {
  Variant v{spec.substr(0, spec.find(':')), base};
  if (v.name.empty()) {
    *error = "variant '" + spec + "' has no name";
    return std::nullopt;
  }
  std::string rest = spec.find(':') == std::string::npos ? "" : spec.substr(spec.find(':') + 1);
  std::istringstream fields(rest);
  std::string field;
  while (std::getline(fields, field, ',')) {
    const auto eq = field.find('=');
    const std::string key = field.substr(0, eq);
    const std::string value = eq == std::string::npos ? "" : field.substr(eq + 1);
    try {
      if (key == "mode" && (value == "kernel" || value == "copy_engine" || value == "copy_batch")) {
        v.options.cuda_mode = value;
      } else if (key == "pipeline" && (value == "0" || value == "1")) {
        v.options.cuda_post_pipeline = value == "1";
      } else if (key == "streams") {
        v.options.cuda_streams = static_cast<uint32_t>(std::stoul(value));
      } else if (key == "chunk") {
        v.options.cuda_chunk_bytes = static_cast<uint32_t>(std::stoul(value));
      } else if (key == "ctas") {
        v.options.cuda_ctas_per_sm = static_cast<uint32_t>(std::stoul(value));
      } else if (key == "threads") {
        v.options.cuda_threads = static_cast<uint32_t>(std::stoul(value));
      } else if (key == "upload_table" && (value == "0" || value == "1")) {
        v.options.cuda_upload_table = value == "1";
      } else {
        *error = "variant '" + spec + "': unknown setting '" + field + "'";
        return std::nullopt;
      }
    } catch (const std::exception&) {
      *error = "variant '" + spec + "': bad number in '" + field + "'";
      return std::nullopt;
    }
  }
  return v;
}

// ---- control channel ----

bool io_all(int fd, void* data, size_t bytes, bool write) {
  auto* p = static_cast<uint8_t*>(data);
  Deadline deadline = Deadline::after_ms(kIoTimeoutMs);
  while (bytes > 0) {
    if (deadline.expired()) return false;
    ssize_t n = write ? ::send(fd, p, bytes, MSG_NOSIGNAL) : ::recv(fd, p, bytes, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}
bool send_blob(int fd, const std::vector<uint8_t>& blob) {
  uint64_t n = blob.size();
  return io_all(fd, &n, sizeof(n), true) && io_all(fd, const_cast<uint8_t*>(blob.data()), n, true);
}
std::vector<uint8_t> recv_blob(int fd) {
  uint64_t n = 0;
  if (!io_all(fd, &n, sizeof(n), false) || n > (1ull << 32)) return {};
  std::vector<uint8_t> blob(n);
  if (!io_all(fd, blob.data(), n, false)) return {};
  return blob;
}

// What the regions are made of: kind for the engine, and whether the bytes live on a GPU.
struct MemoryChoice {
  MemKind kind = MemKind::kHost;
  bool on_gpu = false;
};
MemoryChoice memory_choice(const Options& o) {
  if (o.memory == "gpu" || (o.memory == "auto" && o.backend == "cuda")) return {MemKind::kCuda, true};
  if (o.memory == "staged-host") return {MemKind::kCuda, false};
  return {MemKind::kHost, false};
}

xfer::EngineConfig engine_config(const Options& o, const std::string& name, const std::string& listen_host) {
  xfer::EngineConfig c;
  c.name = name;
  c.listen_host = listen_host;
  if (o.memory == "staged-host") c.ucx_staging = "memcpy";
  // "auto": both backends, and the engine's own choice for the session (reported).
  c.backends = o.backend == "auto" ? std::vector<std::string>{"ucx", "cuda"} : std::vector<std::string>{o.backend};
  c.ucx_transports = o.ucx_tls;
  c.ucx_busy_poll = o.ucx_busy_poll;
  c.cuda_copy_mode = o.cuda_mode;
  c.cuda_chunk_bytes = o.cuda_chunk_bytes;
  c.cuda_ctas_per_sm = o.cuda_ctas_per_sm;
  c.cuda_threads_per_cta = o.cuda_threads;
  c.cuda_split_large_batches = !o.cuda_upload_table;
  c.cuda_post_pipeline = o.cuda_post_pipeline;
  c.cuda_num_streams = o.cuda_streams;
  c.batch_timeout_ms = 60'000;
  return c;
}

// A region of host or GPU memory owned by this process.
struct Buffer {
  bool gpu = false;
  int device = -1;
  void* ptr = nullptr;
  size_t bytes = 0;
  static Buffer make(bool gpu, int device, size_t bytes) {
    Buffer b{gpu, device, nullptr, bytes};
    if (gpu) {
#ifdef XFERBENCH_HAVE_CUDA
      b.ptr = gpu_alloc(device, bytes);
#endif
    } else if (posix_memalign(&b.ptr, 4096, bytes) != 0) {
      b.ptr = nullptr;
    }
    return b;
  }
  bool engine_owned = false;  // from TransferEngine::allocate_host_memory; the engine frees it
  void release() {
    if (ptr == nullptr || engine_owned) return;
#ifdef XFERBENCH_HAVE_CUDA
    if (gpu) gpu_free(device, ptr);
#endif
    if (!gpu) free(ptr);
    ptr = nullptr;
  }
  bool fill(uint64_t seed) {
#ifdef XFERBENCH_HAVE_CUDA
    if (gpu) return gpu_fill_pattern(device, ptr, bytes, seed);
#endif
    auto* p = static_cast<uint8_t*>(ptr);
    for (size_t i = 0; i < bytes; ++i) p[i] = pattern_byte(seed, i);
    return true;
  }
  bool poison() {
#ifdef XFERBENCH_HAVE_CUDA
    if (gpu) return gpu_poison(device, ptr, bytes);
#endif
    std::memset(ptr, 0xa5, bytes);
    return true;
  }
  uint64_t mismatches(const std::vector<CheckOp>& ops, uint64_t seed) const {
#ifdef XFERBENCH_HAVE_CUDA
    if (gpu) return gpu_count_mismatches(device, ptr, ops, seed);
#endif
    const auto* p = static_cast<const uint8_t*>(ptr);
    uint64_t bad = 0;
    for (const CheckOp& op : ops) {
      for (uint64_t i = 0; i < op.bytes; ++i) bad += p[op.dst_offset + i] != pattern_byte(seed, op.src_offset + i);
    }
    return bad;
  }
};

// GPU memory (cudaMalloc), host memory (engine-allocated shared memory, or malloc with
// --host-malloc) or, for --memory staged-host, malloc memory registered as GPU memory.
Result<xfer::MemDesc> allocate_and_register(const Options& o, xfer::TransferEngine& engine, int device, size_t bytes,
                                            Buffer& buffer) {
  const MemoryChoice memory = memory_choice(o);
  if (memory.kind == MemKind::kHost && !o.host_malloc) {
    buffer = Buffer{false, -1, nullptr, bytes};
    buffer.engine_owned = true;
    return engine.allocate_host_memory(bytes, &buffer.ptr);
  }
  buffer = Buffer::make(memory.on_gpu, device, bytes);
  if (buffer.ptr == nullptr) return resource_exhausted("allocating {} bytes failed", bytes);
  return engine.register_memory(buffer.ptr, bytes, memory.kind, memory.kind == MemKind::kCuda ? device : -1);
}

// Joins network namespace `name` the way `ip netns exec` does: the namespace, then a
// private mount namespace with a /sys of it (UCX lists network devices from
// /sys/class/net). Before any thread or UCX context exists in this process.
bool enter_netns(const std::string& name) {
  const int fd = open(("/run/netns/" + name).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool joined = setns(fd, CLONE_NEWNET) == 0;
  close(fd);
  if (!joined || unshare(CLONE_NEWNS) != 0) return false;
  if (mount("", "/", nullptr, MS_SLAVE | MS_REC, nullptr) != 0) return false;
  umount2("/sys", MNT_DETACH);
  return mount(name.c_str(), "/sys", "sysfs", 0, nullptr) == 0;
}

// The interface with IPv4 address `host`, as `ip -o -4 addr` in `netns` (or here) lists it.
std::string interface_named_for(const std::string& host, const std::string& netns) {
  const std::string cmd = netns.empty() ? "ip -o -4 addr show" : "ip -n " + netns + " -o -4 addr show";
  std::string found;
  if (FILE* p = popen(cmd.c_str(), "r")) {
    char line[512];
    while (std::fgets(line, sizeof(line), p) != nullptr) {
      std::istringstream fields(line);
      std::string index, name, family, address;
      fields >> index >> name >> family >> address;
      if (address.substr(0, address.find('/')) == host) found = name;
    }
    pclose(p);
  }
  return found;
}

// ---- target process ----

int run_target(const Options& o, int fd, size_t bytes) {
  if (!o.target_netns.empty() && !enter_netns(o.target_netns)) {
    std::fprintf(stderr, "target: cannot enter network namespace %s: %s\n", o.target_netns.c_str(),
                 std::strerror(errno));
    return 2;
  }
  auto engine = xfer::TransferEngine::create(engine_config(o, "xferbench-target", o.target_host));
  if (!engine.ok()) {
    std::fprintf(stderr, "target: %s\n", engine.status().to_string().c_str());
    return 2;
  }
  Buffer region;
  auto mem = allocate_and_register(o, **engine, o.remote_device, bytes, region);
  if (!mem.ok()) {
    std::fprintf(stderr, "target: %s\n", mem.status().to_string().c_str());
    return 4;
  }
  if (!send_blob(fd, xfer::encode((*engine)->describe())) || !send_blob(fd, xfer::encode(*mem))) return 5;
  while (true) {
    uint8_t cmd = 0;
    if (!io_all(fd, &cmd, 1, false) || cmd == 'Q') break;
    uint64_t reply = 0;
    if (cmd == 'P') {
      reply = region.poison() ? 0 : 1;
    } else if (cmd == 'V') {
      std::vector<uint8_t> blob = recv_blob(fd);
      std::vector<CheckOp> ops(blob.size() / sizeof(CheckOp));
      std::memcpy(ops.data(), blob.data(), ops.size() * sizeof(CheckOp));
      reply = region.mismatches(ops, o.seed);
    }
    if (!io_all(fd, &reply, sizeof(reply), true)) break;
  }
  (void)(*engine)->deregister(mem->region_id);
  engine->reset();
  region.release();
  return 0;
}

// ---- initiator ----

struct Scenario {
  std::string name;
  std::vector<std::vector<Op>> batches;  // posted back to back, then all waited for
  uint64_t op_bytes = 0;                 // size of one op (for the reference)
};

struct Measured {
  std::string variant;
  std::string settings;
  std::string name;
  uint64_t bytes = 0;
  uint64_t num_ops = 0;
  size_t num_batches = 0;
  double seconds = 0;  // median per iteration
  double gbps = 0;
  double ops_per_s = 0;
  std::string reference_name;
  double reference_gbps = 0;
  double reference_ops_per_s = 0;
  double post_us = 0;      // median time for the write() calls alone (host-side cost)
  double b2b_gbps = 0;     // back-to-back iterations (no verification gaps), final state verified
  double kernel_gbps = 0;  // the copy kernel alone, same ops, no engine (cuda kernel mode)
  std::vector<CheckOp> check;
  int verified = 0;
  uint64_t mismatches = 0;
  std::string error;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Distinct random block ids in [0, pool).
std::vector<uint64_t> random_ids(std::mt19937_64& rng, uint64_t pool, uint64_t n) {
  std::vector<uint64_t> ids(pool);
  for (uint64_t i = 0; i < pool; ++i) ids[i] = i;
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(n);
  return ids;
}

class Initiator {
 public:
  Initiator(const Options& o, int fd, size_t bytes) : o_(o), fd_(fd), bytes_(bytes) {}

  // Receives the target's descriptors (once per run).
  bool receive_target() {
    auto peer = xfer::decode_engine_desc(recv_blob(fd_));
    auto remote = xfer::decode_mem_desc(recv_blob(fd_));
    if (!peer.ok() || !remote.ok()) return fail("target descriptors did not arrive");
    peer_desc_ = *peer;
    remote_desc_ = *remote;
    return true;
  }

  // A fresh engine with `variant`'s settings, its own source region (filled with the
  // pattern) and a session to the target. end_variant() takes them down again.
  bool begin_variant(const Variant& variant) {
    error_.clear();
    auto engine =
        xfer::TransferEngine::create(engine_config(variant.options, "xferbench-initiator", o_.initiator_host));
    if (!engine.ok()) return fail(engine.status().to_string());
    engine_ = std::move(engine).value();
    auto mem = allocate_and_register(o_, *engine_, o_.local_device, bytes_, local_);
    if (!mem.ok()) return fail(mem.status().to_string());
    local_desc_ = *mem;
    registered_ = true;
    if (!local_.fill(o_.seed)) return fail("filling the source region");
    if (Status s = engine_->connect(peer_desc_); !s.ok()) return fail(s.to_string());
    auto session = engine_->session(local_desc_, remote_desc_, o_.backend);
    if (!session.ok()) return fail(session.status().to_string());
    session_ = *session;
    transports_ = session_.transports();
    session_backend_ = std::string(session_.backend());
    return true;
  }

  void end_variant() {
    session_ = xfer::Session();  // sessions go before their engine
    if (engine_ && registered_) (void)engine_->deregister(local_desc_.region_id);
    registered_ = false;
    engine_.reset();
    local_.release();
  }

  Measured run(const Scenario& sc) {
    Measured m;
    m.name = sc.name;
    m.num_batches = sc.batches.size();
    std::vector<CheckOp> check;
    for (const auto& batch : sc.batches) {
      for (const Op& op : batch) {
        m.bytes += op.bytes;
        check.push_back({op.local_offset, op.remote_offset, op.bytes});
      }
      m.num_ops += batch.size();
    }
#ifdef XFERBENCH_HAVE_CUDA
    // GPUs idle at a low clock; every figure (ours and the reference) is taken warm.
    if (o_.backend == "cuda" && o_.gpu_warmup_ms > 0) gpu_spin({o_.local_device, o_.remote_device}, o_.gpu_warmup_ms);
#endif
    std::vector<uint8_t> check_blob(check.size() * sizeof(CheckOp));
    std::memcpy(check_blob.data(), check.data(), check_blob.size());
    std::vector<double> seconds, post_seconds;
    std::vector<xfer::XferId> ids(sc.batches.size());
    for (int it = 0; it < o_.warmup + o_.iters; ++it) {
      if (command('P') != 0) {
        m.error = "target could not poison its region";
        return m;
      }
      const int64_t t0 = now_ns();
      for (size_t b = 0; b < sc.batches.size(); ++b) {
        auto id = session_.write(sc.batches[b]);
        if (!id.ok()) {
          m.error = id.status().to_string();
          return m;
        }
        ids[b] = *id;
      }
      post_seconds.push_back((now_ns() - t0) * 1e-9);
      for (xfer::XferId id : ids) {
        if (Status s = engine_->wait(id, Deadline::after_ms(60'000)); !s.ok()) {
          m.error = s.to_string();
          return m;
        }
      }
      const int64_t t1 = now_ns();
      for (xfer::XferId id : ids) engine_->release(id);
      uint8_t cmd = 'V';
      uint64_t bad = UINT64_MAX;
      if (!io_all(fd_, &cmd, 1, true) || !send_blob(fd_, check_blob) || !io_all(fd_, &bad, sizeof(bad), false)) {
        m.error = "verification channel broke";
        return m;
      }
      m.mismatches += bad;
      ++m.verified;
      if (it >= o_.warmup) seconds.push_back((t1 - t0) * 1e-9);
    }
    m.seconds = median(seconds);
    m.post_us = median(post_seconds) * 1e6;
    m.gbps = m.bytes / m.seconds * 1e-9;
    m.ops_per_s = m.num_ops / m.seconds;
    if (o_.b2b) {
      // Back to back, as the reference loop runs: no poison/verify gap between
      // iterations; every iteration writes the same bytes and the final state is checked.
      std::vector<double> b2b;
      if (command('P') != 0) return m;
      for (int it = 0; it < o_.iters; ++it) {
        const int64_t t0 = now_ns();
        for (size_t b = 0; b < sc.batches.size(); ++b) ids[b] = *session_.write(sc.batches[b]);
        for (xfer::XferId id : ids) (void)engine_->wait(id, Deadline::after_ms(60'000));
        b2b.push_back((now_ns() - t0) * 1e-9);
        for (xfer::XferId id : ids) engine_->release(id);
      }
      uint8_t cmd = 'V';
      uint64_t bad = UINT64_MAX;
      if (io_all(fd_, &cmd, 1, true) && send_blob(fd_, check_blob) && io_all(fd_, &bad, sizeof(bad), false)) {
        m.mismatches += bad;
        m.b2b_gbps = m.bytes / median(b2b) * 1e-9;
      }
    }
    m.check = std::move(check);
    return m;
  }

  uint64_t command(uint8_t cmd) {
    uint64_t reply = UINT64_MAX;
    if (!io_all(fd_, &cmd, 1, true) || !io_all(fd_, &reply, sizeof(reply), false)) return UINT64_MAX;
    return reply;
  }

  void finish() {
    end_variant();
    uint8_t cmd = 'Q';
    io_all(fd_, &cmd, 1, true);
  }

  const std::string& error() const {
    return error_;
  }
  const std::string& transports() const {
    return transports_;
  }
  const std::string& session_backend() const {
    return session_backend_;
  }

 private:
  bool fail(std::string why) {
    error_ = std::move(why);
    return false;
  }
  const Options& o_;
  int fd_;
  size_t bytes_;
  std::unique_ptr<xfer::TransferEngine> engine_;
  Buffer local_;
  xfer::MemDesc local_desc_;
  bool registered_ = false;
  xfer::EngineDesc peer_desc_;
  xfer::MemDesc remote_desc_;
  xfer::Session session_;
  std::string transports_;
  std::string session_backend_;
  std::string error_;
};

// ---- ucx_perftest reference ----

int free_tcp_port() {
  int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  int port = 0;
  if (bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      getsockname(s, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  close(s);
  return port;
}

// Whether `port` is listening in the network namespace of process `pid`.
bool port_listening(pid_t pid, int port) {
  for (const char* file : {"tcp", "tcp6"}) {
    std::ifstream in(fmt::format("/proc/{}/net/{}", pid, file));
    std::string line;
    std::getline(in, line);
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state;
      fields >> slot >> local >> remote >> state;
      auto colon = local.rfind(':');
      if (colon != std::string::npos && std::stoi(local.substr(colon + 1), nullptr, 16) == port && state == "0A") {
        return true;
      }
    }
  }
  return false;
}

// Runs one ucx_perftest put-bandwidth test (server + client on loopback). Returns
// {MB/s as 2^20 bytes per second (perftest's unit), messages/s}, or {0,0}.
// Runs one ucx_perftest put-bandwidth test: the server where the target runs (its
// namespace and interface), the client where the initiator runs. Returns {MB/s as 2^20
// bytes per second (perftest's unit), messages/s}, or {0,0}.
std::pair<double, double> perftest_put_bw(const Options& o, uint64_t bytes, int iters, std::string* log) {
  const int port = free_tcp_port();
  const std::string server_device = interface_named_for(o.target_host, o.target_netns);
  const std::string client_device = interface_named_for(o.initiator_host, "");
  std::string env = o.ucx_tls.empty() ? "" : "UCX_TLS=" + o.ucx_tls + " UCX_NET_DEVICES=" + client_device + " ";
  pid_t server = fork();
  if (server == 0) {
    if (!o.ucx_tls.empty()) {
      setenv("UCX_TLS", o.ucx_tls.c_str(), 1);
      setenv("UCX_NET_DEVICES", server_device.c_str(), 1);
    }
    freopen("/dev/null", "w", stdout);
    const std::string port_text = std::to_string(port);
    if (o.target_netns.empty()) {
      execlp(o.perftest.c_str(), o.perftest.c_str(), "-p", port_text.c_str(), static_cast<char*>(nullptr));
    } else {
      execlp("ip", "ip", "netns", "exec", o.target_netns.c_str(), o.perftest.c_str(), "-p", port_text.c_str(),
             static_cast<char*>(nullptr));
    }
    _exit(127);
  }
  // Waits on the real condition (the server's listening socket, seen in its own network
  // namespace) with a deadline.
  Deadline ready = Deadline::after_ms(10'000);
  bool server_exited = false;
  while (!port_listening(server, port) && !ready.expired()) {
    if (waitpid(server, nullptr, WNOHANG) == server) {  // e.g. no perftest binary: no reference
      server_exited = true;
      break;
    }
    usleep(2000);
  }
  std::string cmd = fmt::format("{}{} {} -p {} -t ucp_put_bw -s {} -n {} -w {} 2>&1", env, o.perftest, o.target_host,
                                port, bytes, iters, std::max(1, iters / 10));
  *log = cmd;
  std::pair<double, double> result{0, 0};
  if (server_exited) return result;
  if (FILE* p = popen(cmd.c_str(), "r")) {
    char line[1024];
    while (std::fgets(line, sizeof(line), p) != nullptr) {
      std::istringstream fields(line);
      std::string first;
      fields >> first;
      if (first == "Final:") {
        double it = 0, p50 = 0, avg = 0, overall = 0, bw_avg = 0, bw_overall = 0, rate_avg = 0, rate_overall = 0;
        fields >> it >> p50 >> avg >> overall >> bw_avg >> bw_overall >> rate_avg >> rate_overall;
        if (fields && std::isfinite(bw_overall) && bw_overall > 0) result = {bw_overall, rate_overall};
      }
    }
    pclose(p);
  }
  Deadline gone = Deadline::after_ms(5'000);
  while (waitpid(server, nullptr, WNOHANG) == 0) {
    if (gone.expired()) {
      kill(server, SIGKILL);
      waitpid(server, nullptr, 0);
      break;
    }
    usleep(2000);
  }
  return result;
}

// ---- main ----

int run(const Options& o) {
  const uint64_t block_bytes = uint64_t{2} * o.block_tokens * o.kv_heads * o.head_dim * o.dtype_bytes;
  const uint64_t prompt_blocks = (o.prompt_tokens + o.block_tokens - 1) / o.block_tokens;
  const uint64_t pool_blocks = o.pool_blocks > 0 ? o.pool_blocks : 2 * prompt_blocks;
  if (pool_blocks < prompt_blocks) {
    std::fprintf(stderr, "--pool-blocks %llu is smaller than the prompt's %llu blocks\n",
                 static_cast<unsigned long long>(pool_blocks), static_cast<unsigned long long>(prompt_blocks));
    return 2;
  }
  const uint64_t layer_bytes = pool_blocks * block_bytes;
  const uint64_t region_bytes = layer_bytes * o.layers;
  const uint64_t kv_bytes = prompt_blocks * block_bytes * o.layers;

  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) return 2;
  // Fork before either process touches CUDA or UCX.
  pid_t child = -1;
  std::thread target_thread;
  int target_status = 0;
  if (o.same_process) {
    target_thread = std::thread([&] { target_status = run_target(o, fds[1], region_bytes); });
  } else {
    child = fork();
    if (child == 0) {
      close(fds[0]);
      _exit(run_target(o, fds[1], region_bytes));
    }
    close(fds[1]);
  }
  Initiator initiator(o, fds[0], region_bytes);
  std::vector<Variant> variants;
  {
    std::vector<std::string> specs = o.variants;
    if (o.compare) specs.insert(specs.end(), std::begin(kCompareVariants), std::end(kCompareVariants));
    if (specs.empty()) specs.push_back(o.backend == "cuda" ? "cli" : o.backend);
    for (const std::string& spec : specs) {
      std::string error;
      std::optional<Variant> v = parse_variant(spec, o, &error);
      if (!v) {
        std::fprintf(stderr, "xferbench: %s\n", error.c_str());
        return 2;
      }
      variants.push_back(*v);
    }
  }
  if (!initiator.receive_target() || !initiator.begin_variant(variants[0])) {
    std::fprintf(stderr, "xferbench: setup failed: %s\n", initiator.error().c_str());
    initiator.end_variant();
    if (child > 0) {
      kill(child, SIGKILL);
      waitpid(child, nullptr, 0);
    } else {
      shutdown(fds[0], SHUT_RDWR);
      target_thread.join();
    }
    return 1;
  }

  // Scenarios.
  std::mt19937_64 rng(o.seed);
  std::vector<Scenario> scenarios;
  auto wanted = [&](const std::string& s) {
    return ("," + o.scenarios + ",").find("," + s + ",") != std::string::npos;
  };
  if (wanted("contiguous")) scenarios.push_back({"contiguous", {{{0, 0, kv_bytes}}}, kv_bytes});
  std::vector<std::vector<Op>> per_layer(o.layers);
  {
    const std::vector<uint64_t> src_ids = random_ids(rng, pool_blocks, prompt_blocks);
    const std::vector<uint64_t> dst_ids = random_ids(rng, pool_blocks, prompt_blocks);
    for (int l = 0; l < o.layers; ++l) {
      for (uint64_t b = 0; b < prompt_blocks; ++b) {
        per_layer[l].push_back(
            {l * layer_bytes + src_ids[b] * block_bytes, l * layer_bytes + dst_ids[b] * block_bytes, block_bytes});
      }
    }
  }
  if (wanted("kv")) {
    std::vector<Op> all;
    for (const auto& layer : per_layer) all.insert(all.end(), layer.begin(), layer.end());
    scenarios.push_back({"kv", {all}, block_bytes});
  }
  if (wanted("kv_layers")) scenarios.push_back({"kv_layers", per_layer, block_bytes});
  if (wanted("small")) {
    constexpr uint64_t kSmall = 4096;
    const uint64_t slots = region_bytes / kSmall;
    const uint64_t n = std::min<uint64_t>(o.small_ops, slots);
    const std::vector<uint64_t> src = random_ids(rng, slots, n);
    const std::vector<uint64_t> dst = random_ids(rng, slots, n);
    std::vector<Op> ops;
    for (uint64_t i = 0; i < n; ++i) ops.push_back({src[i] * kSmall, dst[i] * kSmall, kSmall});
    scenarios.push_back({"small_4k", {ops}, kSmall});
  }
  if (wanted("mixed")) {
    // Odd sizes (1 B .. 300 KiB) at unaligned offsets, one op per 512 KiB slot on each
    // side, every fifth op continuing the one before on both sides (merged by the engine):
    // checks the byte paths and the merging, not a bandwidth target.
    constexpr uint64_t kSlot = 512 * 1024;
    const uint64_t slots = region_bytes / kSlot;
    const uint64_t n = std::min<uint64_t>(1200, slots);
    const std::vector<uint64_t> src = random_ids(rng, slots, n);
    const std::vector<uint64_t> dst = random_ids(rng, slots, n);
    std::vector<Op> ops;
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t start = rng() % 65536;
      const uint64_t bytes = 1 + rng() % (300 * 1024);
      ops.push_back({src[i] * kSlot + start, dst[i] * kSlot + start / 3, bytes});
      if (i % 5 == 4) {
        const Op& last = ops.back();
        const uint64_t more = 1 + rng() % (kSlot - 65536 - 300 * 1024);  // still inside both slots
        ops.push_back({last.local_offset + last.bytes, last.remote_offset + last.bytes, more});
      }
    }
    scenarios.push_back({"mixed", {ops}, 0});
  }

  std::vector<Measured> results;
  for (size_t v = 0; v < variants.size(); ++v) {
    if (v > 0) {
      initiator.end_variant();
      if (!initiator.begin_variant(variants[v])) {
        Measured failed;
        failed.error = "variant setup failed: " + initiator.error();
        for (const Scenario& sc : scenarios) {
          failed.name = sc.name;
          failed.variant = variants[v].name;
          failed.settings = variants[v].settings();
          results.push_back(failed);
        }
        continue;
      }
    }
    for (const Scenario& sc : scenarios) {
      results.push_back(initiator.run(sc));
      results.back().variant = variants[v].name;
      results.back().settings = variants[v].settings();
    }
  }
  const std::string transports = initiator.transports();
  const std::string session_backend = initiator.session_backend();
  initiator.finish();
  int status = 0;
  if (child > 0) {
    waitpid(child, &status, 0);
  } else {
    target_thread.join();
    status = target_status << 8;  // as if exited with target_status
  }

  // References, after the engines are gone (the GPUs and cores are free again), once per
  // scenario: every variant's row of a scenario moves the same bytes.
  std::vector<std::string> reference_commands;
  std::map<std::string, const Measured*> referenced;
  for (Measured& m : results) {
    if (!m.error.empty()) continue;
    if (auto done = referenced.find(m.name); done != referenced.end()) {
      m.reference_name = done->second->reference_name;
      m.reference_gbps = done->second->reference_gbps;
      m.reference_ops_per_s = done->second->reference_ops_per_s;
      m.kernel_gbps = done->second->kernel_gbps;
      continue;
    }
    referenced[m.name] = &m;
    if (o.backend == "cuda") {
#ifdef XFERBENCH_HAVE_CUDA
      if (o.gpu_warmup_ms > 0) gpu_spin({o.local_device, o.remote_device}, o.gpu_warmup_ms);
      std::vector<double> s = gpu_memcpy_peer_seconds(o.remote_device, o.local_device, m.bytes, o.warmup, o.iters);
      m.reference_name = "cudaMemcpyPeer (contiguous, same bytes)";
      if (!s.empty()) {
        m.reference_gbps = m.bytes / median(s) * 1e-9;
        m.reference_ops_per_s = m.num_ops / median(s);
      }
      std::vector<double> k =
          gpu_kernel_copy_seconds(o.remote_device, o.local_device, region_bytes, m.check, o.cuda_chunk_bytes,
                                  o.cuda_ctas_per_sm, o.cuda_threads, o.warmup, o.iters);
      if (!k.empty()) m.kernel_gbps = m.bytes / median(k) * 1e-9;
#endif
    } else {
      const uint64_t op_bytes = m.name == "contiguous" ? m.bytes : (m.name == "small_4k" ? 4096 : block_bytes);
      // As many messages as our timed iterations move, at least 5 (huge messages) and at
      // most 200,000 (small ones).
      const int iters = static_cast<int>(std::clamp<uint64_t>(m.bytes * o.iters / op_bytes, 5, 200'000));
      std::string cmd;
      auto [mbps, rate] = perftest_put_bw(o, op_bytes, iters, &cmd);
      reference_commands.push_back(cmd);
      m.reference_name = fmt::format("ucx_perftest ucp_put_bw -s {}", op_bytes);
      m.reference_gbps = mbps * 1048576.0 * 1e-9;
      m.reference_ops_per_s = rate;
    }
  }

  bool all_exact = true;
  for (const Measured& m : results) all_exact = all_exact && m.error.empty() && m.mismatches == 0 && m.verified > 0;
  if (o.json) {
    nlohmann::json j;
    j["backend"] = o.backend;
    j["session_backend"] = session_backend;
    for (const Variant& v : variants) j["variants"].push_back({{"name", v.name}, {"settings", v.settings()}});
    j["ucx_tls"] = o.ucx_tls;
    j["memory"] = o.memory;
    j["transports"] = transports;
    j["target_netns"] = o.target_netns;
    j["iters"] = o.iters;
    j["block_bytes"] = block_bytes;
    j["all_verified_byte_exact"] = all_exact;
    j["reference_commands"] = reference_commands;
    for (const Measured& m : results) {
      j["scenarios"].push_back({{"variant", m.variant},
                                {"settings", m.settings},
                                {"name", m.name},
                                {"bytes", m.bytes},
                                {"ops", m.num_ops},
                                {"batches", m.num_batches},
                                {"median_seconds", m.seconds},
                                {"gbps", m.gbps},
                                {"ops_per_s", m.ops_per_s},
                                {"reference", m.reference_name},
                                {"reference_gbps", m.reference_gbps},
                                {"reference_ops_per_s", m.reference_ops_per_s},
                                {"ratio", m.reference_gbps > 0 ? m.gbps / m.reference_gbps : 0},
                                {"b2b_gbps", m.b2b_gbps},
                                {"post_us", m.post_us},
                                {"b2b_ratio", m.reference_gbps > 0 ? m.b2b_gbps / m.reference_gbps : 0},
                                {"kernel_only_gbps", m.kernel_gbps},
                                {"verified_iterations", m.verified},
                                {"mismatched_bytes", m.mismatches},
                                {"error", m.error}});
    }
    std::printf("%s\n", j.dump(2).c_str());
  }
  std::printf(
      "\nxferbench backend=%s memory=%s transports=%s%s  (GB/s = 1e9 B/s; median of %d iterations; every iteration "
      "verified)\n",
      o.backend.c_str(), o.memory.c_str(), transports.c_str(),
      o.target_netns.empty() ? "" : (" target netns=" + o.target_netns).c_str(), o.iters);
  for (const Variant& v : variants) std::printf("  variant %-10s %s\n", v.name.c_str(), v.settings().c_str());
  std::printf("%-10s %-11s %8s %6s %4s %8s %10s %8s %10s %6s %8s %6s %8s %7s %8s  %s\n", "variant", "scenario", "MiB",
              "ops", "btch", "GB/s", "ops/s", "ref GB/s", "ref ops/s", "ratio", "b2b GB/s", "b2b x", "kern GB/s",
              "post us", "verified", "reference");
  for (const Measured& m : results) {
    if (!m.error.empty()) {
      std::printf("%-10s %-11s ERROR %s\n", m.variant.c_str(), m.name.c_str(), m.error.c_str());
      continue;
    }
    const double ref = m.reference_gbps > 0 ? m.reference_gbps : 1e300;
    std::printf("%-10s %-11s %8.1f %6llu %4zu %8.2f %10.0f %8.2f %10.0f %6.3f %8.2f %6.3f %8.2f %7.1f %8s  %s\n",
                m.variant.c_str(), m.name.c_str(), m.bytes / 1048576.0, static_cast<unsigned long long>(m.num_ops),
                m.num_batches, m.gbps, m.ops_per_s, m.reference_gbps, m.reference_ops_per_s, m.gbps / ref, m.b2b_gbps,
                m.b2b_gbps / ref, m.kernel_gbps, m.post_us, m.mismatches == 0 ? "exact" : "MISMATCH",
                m.reference_name.c_str());
  }
  if (variants.size() > 1) {
    // One line per scenario: each variant's ratio to the reference (b2b ratio after '/').
    std::printf("\nratio to the reference (per-iteration / back-to-back), by variant\n%-11s", "scenario");
    for (const Variant& v : variants) std::printf(" %13s", v.name.c_str());
    std::printf("\n");
    for (const Scenario& sc : scenarios) {
      std::printf("%-11s", sc.name.c_str());
      for (const Variant& v : variants) {
        auto m = std::find_if(results.begin(), results.end(),
                              [&](const Measured& r) { return r.name == sc.name && r.variant == v.name; });
        if (m == results.end() || !m->error.empty() || m->reference_gbps <= 0) {
          std::printf(" %13s", "error");
        } else {
          std::printf("   %5.3f/%5.3f", m->gbps / m->reference_gbps, m->b2b_gbps / m->reference_gbps);
        }
      }
      std::printf("\n");
    }
  }
  return all_exact && WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}

}  // namespace
}  // namespace pd::xferbench

int main(int argc, char** argv) {
  pd::xferbench::Options o;
  CLI::App app{"xferbench: transfer-engine benchmark (two processes, one backend)"};
  app.add_option("--backend", o.backend, "cuda, ucx or auto (the engine picks; JSON says which)")
      ->check(CLI::IsMember({"cuda", "ucx", "auto"}));
  app.add_option("--scenarios", o.scenarios, "comma list of contiguous,kv,kv_layers,small,mixed");
  app.add_option("--iters", o.iters, "timed iterations per scenario")->check(CLI::Range(1, 100000));
  app.add_option("--warmup", o.warmup, "untimed (but verified) iterations first")->check(CLI::Range(0, 1000));
  app.add_flag("--json", o.json, "print JSON before the table");
  app.add_option("--ucx-tls", o.ucx_tls, "UCX_TLS for the engine and ucx_perftest (e.g. posix,self or tcp)");
  app.add_option("--cuda-mode", o.cuda_mode, "kernel, copy_engine or copy_batch (cudaMemcpyBatchAsync)")
      ->check(CLI::IsMember({"kernel", "copy_engine", "copy_batch"}));
  app.add_option("--cuda-post-pipeline", o.cuda_post_pipeline,
                 "cuda: 1 = validate in place and launch as tables are built (default), 0 = sort and merge first");
  app.add_option("--cuda-streams", o.cuda_streams, "cuda: streams per device taken in turn (default 4)")
      ->check(CLI::Range(1, 16));
  app.add_option("--variant", o.variants,
                 "run every scenario once per variant NAME:key=value,... (keys: mode, pipeline, streams, chunk, "
                 "ctas, threads, upload_table); repeatable");
  app.add_flag("--compare", o.compare,
               "cuda: run the standard comparison variants (old, pipeline, streams4, new, ce_per_op, ce_batch)");
  app.add_option("--cuda-chunk-bytes", o.cuda_chunk_bytes, "copy-kernel bytes per work item");
  app.add_option("--cuda-ctas-per-sm", o.cuda_ctas_per_sm, "copy-kernel CTAs per SM");
  app.add_option("--cuda-threads", o.cuda_threads, "copy-kernel threads per CTA");
  app.add_option("--local-device", o.local_device, "initiator GPU");
  app.add_option("--remote-device", o.remote_device, "target GPU");
  app.add_option("--layers", o.layers);
  app.add_option("--kv-heads", o.kv_heads);
  app.add_option("--head-dim", o.head_dim);
  app.add_option("--block-tokens", o.block_tokens);
  app.add_option("--prompt-tokens", o.prompt_tokens);
  app.add_option("--pool-blocks", o.pool_blocks, "blocks per layer in each region (default: twice the prompt's)");
  app.add_option("--small-ops", o.small_ops, "4 KiB ops in the small-op batch");
  app.add_option("--seed", o.seed);
  app.add_option("--perftest", o.perftest, "ucx_perftest binary");
  app.add_option("--gpu-warmup-ms", o.gpu_warmup_ms, "busy both GPUs this long before each measurement");
  app.add_flag("--ucx-busy-poll", o.ucx_busy_poll, "UCX progress threads spin instead of sleeping");
  app.add_flag("--host-malloc", o.host_malloc,
               "ucx: register malloc'd host memory instead of TransferEngine::allocate_host_memory");
  app.add_flag("--cuda-upload-table", o.cuda_upload_table,
               "cuda: one launch per large batch after uploading its op table (instead of sub-launches)");
  app.add_flag("!--no-b2b", o.b2b, "skip the back-to-back timing rows");
  app.add_flag("--same-process", o.same_process, "run the target engine on a thread instead of a second process");
  app.add_option("--memory", o.memory, "auto, host, gpu or staged-host (ucx: host memory through the staging protocol)")
      ->check(CLI::IsMember({"auto", "host", "gpu", "staged-host"}));
  app.add_option("--target-netns", o.target_netns, "ucx: run the target (and perftest's server) in this netns");
  app.add_option("--target-host", o.target_host, "ucx: the target's address (its interface is the one UCX uses)");
  app.add_option("--initiator-host", o.initiator_host, "ucx: the initiator's address");
  CLI11_PARSE(app, argc, argv);
  pd::log::init("warn");
  return pd::xferbench::run(o);
}
