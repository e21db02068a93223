// Two-process tests: the peer engine runs in a forked child that owns its memory;
// descriptors travel over a socketpair (the stand-in for the connector's control
// plane). UCX runs over TCP here so that a killed peer is a real broken connection.
#include <signal.h>
#include <sys/wait.h>

#include <gtest/gtest.h>

#include <random>
#include <thread>

#include "test_util.h"
#include "xfer/engine.h"

namespace pd::xfer {
namespace {

using namespace pd::xfer::testing;

constexpr int64_t kIoTimeoutMs = 30'000;
constexpr int kChildFd = 3;

struct ChildSpec {
  std::string name;
  std::string listen_host = "127.0.0.1";
  std::string netns;  // joined before the engine starts, when set
  size_t bytes = 1 << 20;
  // The region is registered as GPU memory and reached through ucx staging (host memory
  // standing in for the device: EngineConfig::ucx_staging = "memcpy").
  bool staged = false;
};

// A peer engine in a child process. Commands over the socket: 'D' dump the region,
// 'Q' quit. The child exits when the socket closes.
class ChildPeer {
 public:
  // fork + exec of this test binary (see ChildEntry below): a fresh process image, so
  // that no UCX state of the parent leaks into the child.
  static std::unique_ptr<ChildPeer> spawn(const ChildSpec& spec) {
    int fds[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) return nullptr;
    const std::string bytes = std::to_string(spec.bytes);
    char self[4096] = {};
    if (readlink("/proc/self/exe", self, sizeof(self) - 1) <= 0) return nullptr;
    pid_t pid = fork();
    if (pid < 0) return nullptr;
    if (pid == 0) {
      dup2(fds[1], kChildFd);  // dup2 clears close-on-exec on the copy
      setenv("PD_XFER_CHILD_NAME", spec.name.c_str(), 1);
      setenv("PD_XFER_CHILD_HOST", spec.listen_host.c_str(), 1);
      setenv("PD_XFER_CHILD_BYTES", bytes.c_str(), 1);
      setenv("PD_XFER_CHILD_STAGED", spec.staged ? "1" : "0", 1);
      if (spec.netns.empty()) {
        execl(self, "xfer_peer_child", static_cast<char*>(nullptr));
      } else {
        // `ip netns exec` also remounts /sys for the namespace, where UCX lists its devices.
        execlp("ip", "ip", "netns", "exec", spec.netns.c_str(), self, static_cast<char*>(nullptr));
      }
      _exit(127);
    }
    close(fds[1]);
    auto peer = std::unique_ptr<ChildPeer>(new ChildPeer(pid, fds[0]));
    Deadline deadline = Deadline::after_ms(kIoTimeoutMs);
    auto engine = recv_frame(fds[0], deadline);
    auto mem = recv_frame(fds[0], deadline);
    if (!engine || !mem) return nullptr;
    auto e = decode_engine_desc(*engine);
    auto m = decode_mem_desc(*mem);
    if (!e.ok() || !m.ok()) return nullptr;
    peer->engine_ = *e;
    peer->mem_ = *m;
    return peer;
  }
  ~ChildPeer() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    close(fd_);
  }
  std::optional<std::vector<uint8_t>> dump() {
    const uint8_t cmd = 'D';
    Deadline deadline = Deadline::after_ms(kIoTimeoutMs);
    if (!write_all(fd_, &cmd, 1, deadline)) return std::nullopt;
    return recv_frame(fd_, deadline);
  }
  // SIGSTOP, then wait until the kernel reports the child stopped: kill() returns before the
  // child has stopped, and a child still running for that moment can answer the batch the test
  // means to send to a frozen peer (CI saw a 1 MB staged write land in 1 ms that way).
  bool stop() {
    if (kill(pid_, SIGSTOP) != 0) return false;
    int status = 0;
    return waitpid(pid_, &status, WUNTRACED) == pid_ && WIFSTOPPED(status);
  }
  bool resume() {
    if (kill(pid_, SIGCONT) != 0) return false;
    int status = 0;
    return waitpid(pid_, &status, WCONTINUED) == pid_ && WIFCONTINUED(status);
  }
  void kill_now() {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  const EngineDesc& engine() const { return engine_; }
  const MemDesc& mem() const { return mem_; }

 private:
  ChildPeer(pid_t pid, int fd) : pid_(pid), fd_(fd) {}

  friend struct ChildEntry;
  static int child_main(const ChildSpec& spec, int fd) {
    EngineConfig config;
    config.name = spec.name;
    config.listen_host = spec.listen_host;
    config.backends = {"ucx"};
    config.ucx_transports = "tcp";
    config.ucx_staging = "memcpy";
    auto engine = TransferEngine::create(config);
    if (!engine.ok()) return 4;
    std::vector<uint8_t> region(spec.bytes, 0);
    auto mem = spec.staged ? (*engine)->register_memory(region.data(), region.size(), MemKind::kCuda, 0)
                           : (*engine)->register_memory(region.data(), region.size(), MemKind::kHost);
    if (!mem.ok()) return 5;
    Deadline deadline = Deadline::after_ms(kIoTimeoutMs);
    if (!send_frame(fd, encode((*engine)->describe()), deadline) || !send_frame(fd, encode(*mem), deadline)) return 6;
    while (true) {
      uint8_t cmd = 0;
      // The parent drives every step within its own deadlines; a silent parent means it died.
      if (!read_all(fd, &cmd, 1, Deadline::after_ms(5 * kIoTimeoutMs))) return 0;
      if (cmd == 'Q') return 0;
      if (cmd == 'D' && !send_frame(fd, region, Deadline::after_ms(kIoTimeoutMs))) return 7;
    }
  }

  pid_t pid_;
  int fd_;
  EngineDesc engine_;
  MemDesc mem_;
};

ChildSpec named(const std::string& name) {
  ChildSpec spec;
  spec.name = name;
  return spec;
}

// Runs before gtest's main when this binary was exec'd as a peer child.
struct ChildEntry {
  ChildEntry() {
    const char* name = std::getenv("PD_XFER_CHILD_NAME");
    if (name == nullptr) return;
    ChildSpec spec;
    spec.name = name;
    spec.listen_host = std::getenv("PD_XFER_CHILD_HOST");
    spec.bytes = std::stoull(std::getenv("PD_XFER_CHILD_BYTES"));
    spec.staged = std::string(std::getenv("PD_XFER_CHILD_STAGED")) == "1";
    std::exit(ChildPeer::child_main(spec, kChildFd));
  }
};
const ChildEntry kChildEntry;

std::unique_ptr<TransferEngine> parent_engine(const std::string& listen_host = "127.0.0.1") {
  EngineConfig config;
  config.name = "parent";
  config.listen_host = listen_host;
  config.backends = {"ucx"};
  config.ucx_transports = "tcp";
  config.ucx_staging = "memcpy";
  config.ucx_staging_chunk_bytes = 64 << 10;  // a 1 MiB region is many chunks
  config.ucx_staging_slots = 2;
  auto engine = TransferEngine::create(config);
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  return engine.ok() ? std::move(engine).value() : nullptr;
}

std::vector<Op> random_ops(std::mt19937_64& rng, uint64_t num_blocks, uint64_t block, size_t n) {
  std::vector<uint64_t> src(num_blocks), dst(num_blocks);
  for (uint64_t i = 0; i < num_blocks; ++i) src[i] = dst[i] = i;
  std::shuffle(src.begin(), src.end(), rng);
  std::shuffle(dst.begin(), dst.end(), rng);
  std::vector<Op> ops;
  for (size_t i = 0; i < n; ++i) ops.push_back({src[i] * block, dst[i] * block, block});
  return ops;
}

// Writes random batches, then reads them back into a second region, checking the
// peer's bytes after each write and ours after each read. The sessions must travel over
// exactly `expected_transports` (as UCX names its lanes: "tcp/<interface>").
void exchange_and_verify(TransferEngine& engine, ChildPeer& child, size_t bytes, uint64_t seed,
                         const std::string& expected_transports, MemKind kind = MemKind::kHost) {
  std::vector<uint8_t> source(bytes), sink(bytes, 0);
  fill_pattern(source, seed);
  const int device = kind == MemKind::kCuda ? 0 : -1;
  auto src = engine.register_memory(source.data(), bytes, kind, device);
  auto dst = engine.register_memory(sink.data(), bytes, kind, device);
  ASSERT_TRUE(src.ok() && dst.ok());
  ASSERT_TRUE(engine.connect(child.engine()).ok());
  auto out = engine.session(*src, child.mem());
  auto in = engine.session(*dst, child.mem());
  ASSERT_TRUE(out.ok()) << out.status().to_string();
  ASSERT_TRUE(in.ok());
  EXPECT_EQ(out->transports(), expected_transports);
  EXPECT_EQ(in->transports(), expected_transports);
  std::mt19937_64 rng(seed);
  constexpr uint64_t kBlock = 8192;
  std::vector<uint8_t> expected(bytes, 0);
  for (int round = 0; round < 3; ++round) {
    std::vector<Op> ops = random_ops(rng, bytes / kBlock, kBlock, 64);
    auto id = out->write(ops);
    ASSERT_TRUE(id.ok()) << id.status().to_string();
    Status s = engine.wait(*id, Deadline::after_ms(kIoTimeoutMs));
    ASSERT_TRUE(s.ok()) << s.to_string();
    for (const Op& op : ops) std::memcpy(&expected[op.remote_offset], &source[op.local_offset], op.bytes);
    auto remote = child.dump();
    ASSERT_TRUE(remote.has_value());
    ASSERT_EQ(*remote, expected) << "round " << round;

    std::vector<Op> back;
    for (const Op& op : ops) back.push_back({op.remote_offset, op.remote_offset, op.bytes});
    auto rid = in->read(back);
    ASSERT_TRUE(rid.ok());
    ASSERT_TRUE(engine.wait(*rid, Deadline::after_ms(kIoTimeoutMs)).ok());
    for (const Op& op : back) {
      ASSERT_EQ(std::memcmp(&sink[op.local_offset], &expected[op.remote_offset], op.bytes), 0);
    }
    engine.release(*id);
    engine.release(*rid);
  }
}

TEST(TwoProcess, RandomWritesAndReadsOverTcpLoopbackAreByteExact) {
  auto engine = parent_engine();
  ASSERT_TRUE(engine);
  auto child = ChildPeer::spawn(named("child"));
  ASSERT_TRUE(child);
  exchange_and_verify(*engine, *child, 1 << 20, 21, "tcp/lo");
}

TEST(TwoProcess, StagedGpuRegionsOverTcpLoopbackAreByteExact) {
  auto engine = parent_engine();
  ASSERT_TRUE(engine);
  ChildSpec spec = named("gpu-child");
  spec.staged = true;
  auto child = ChildPeer::spawn(spec);
  ASSERT_TRUE(child);
  exchange_and_verify(*engine, *child, 1 << 20, 22, "tcp/lo", MemKind::kCuda);
}

TEST(TwoProcess, KilledPeerFailsAStagedBatchWithinItsDeadline) {
  auto engine = parent_engine();
  ASSERT_TRUE(engine);
  ChildSpec spec = named("doomed-gpu");
  spec.staged = true;
  auto doomed = ChildPeer::spawn(spec);
  ASSERT_TRUE(doomed);
  std::vector<uint8_t> source(1 << 20);
  fill_pattern(source, 8);
  auto src = engine->register_memory(source.data(), source.size(), MemKind::kCuda, 0);
  ASSERT_TRUE(src.ok());
  ASSERT_TRUE(engine->connect(doomed->engine()).ok());
  auto session = engine->session(*src, doomed->mem());
  ASSERT_TRUE(session.ok());
  std::vector<Op> whole = {{0, 0, source.size()}};
  auto warm = session->write(whole);
  ASSERT_TRUE(warm.ok());
  ASSERT_TRUE(engine->wait(*warm, Deadline::after_ms(kIoTimeoutMs)).ok());

  doomed->kill_now();
  const int64_t start = now_ns();
  constexpr int64_t kBatchDeadlineMs = 3'000;
  auto id = session->write(whole, Deadline::after_ms(kBatchDeadlineMs));
  bool failed = !id.ok();
  if (id.ok()) failed = !engine->wait(*id, Deadline::after_ms(2 * kBatchDeadlineMs)).ok();
  const double elapsed_ms = (now_ns() - start) / 1e6;
  EXPECT_TRUE(failed) << "a staged write to a killed peer succeeded";
  EXPECT_LT(elapsed_ms, kBatchDeadlineMs + 1'000);
  // The staged batch reports its failure only once every chunk is retired, so the
  // region is free as soon as the wait returns.
  Status freed = engine->deregister(src->region_id);
  EXPECT_TRUE(freed.ok()) << freed.to_string();
}

TEST(TwoProcess, StoppedPeerFailsAStagedBatchAtItsDeadlineAndLaterBatchesStillLand) {
  auto engine = parent_engine();
  ASSERT_TRUE(engine);
  ChildSpec spec = named("sleepy-gpu");
  spec.staged = true;
  auto child = ChildPeer::spawn(spec);
  ASSERT_TRUE(child);
  std::vector<uint8_t> source(1 << 20);
  fill_pattern(source, 9);
  auto src = engine->register_memory(source.data(), source.size(), MemKind::kCuda, 0);
  ASSERT_TRUE(src.ok());
  ASSERT_TRUE(engine->connect(child->engine()).ok());
  auto session = engine->session(*src, child->mem());
  ASSERT_TRUE(session.ok());
  std::vector<Op> whole = {{0, 0, source.size()}};
  auto warm = session->write(whole);
  ASSERT_TRUE(warm.ok());
  ASSERT_TRUE(engine->wait(*warm, Deadline::after_ms(kIoTimeoutMs)).ok());

  ASSERT_TRUE(child->stop());  // alive, connected, never answers
  constexpr int64_t kBatchDeadlineMs = 500;
  const int64_t start = now_ns();
  auto id = session->write(whole, Deadline::after_ms(kBatchDeadlineMs));
  ASSERT_TRUE(id.ok());
  Status s = engine->wait(*id, Deadline::after_ms(kIoTimeoutMs));
  const double elapsed_ms = (now_ns() - start) / 1e6;
  EXPECT_EQ(s.code(), ErrorCode::kDeadlineExceeded) << s.to_string();
  EXPECT_GE(elapsed_ms, kBatchDeadlineMs - 5);
  EXPECT_LT(elapsed_ms, kBatchDeadlineMs + 1'000);
  ASSERT_TRUE(child->resume());

  // The dropped chunks' buffers come back (late replies are ignored) and a new batch
  // lands byte-exact.
  std::reverse(source.begin(), source.end());
  auto again = session->write(whole);
  ASSERT_TRUE(again.ok());
  Status ok = engine->wait(*again, Deadline::after_ms(kIoTimeoutMs));
  ASSERT_TRUE(ok.ok()) << ok.to_string();
  auto remote = child->dump();
  ASSERT_TRUE(remote.has_value());
  EXPECT_EQ(*remote, source);
}

TEST(TwoProcess, KilledPeerFailsTheBatchWithinItsDeadlineAndOtherPeersKeepWorking) {
  auto engine = parent_engine();
  ASSERT_TRUE(engine);
  auto doomed = ChildPeer::spawn(named("doomed"));
  auto healthy = ChildPeer::spawn(named("healthy"));
  ASSERT_TRUE(doomed && healthy);
  std::vector<uint8_t> source(1 << 20);
  fill_pattern(source, 5);
  auto src = engine->register_memory(source.data(), source.size(), MemKind::kHost);
  ASSERT_TRUE(src.ok());
  ASSERT_TRUE(engine->connect(doomed->engine()).ok());
  ASSERT_TRUE(engine->connect(healthy->engine()).ok());
  auto to_doomed = engine->session(*src, doomed->mem());
  auto to_healthy = engine->session(*src, healthy->mem());
  ASSERT_TRUE(to_doomed.ok() && to_healthy.ok());
  std::vector<Op> whole = {{0, 0, source.size()}};
  auto warm = to_doomed->write(whole);  // the connection is up before the kill
  ASSERT_TRUE(warm.ok());
  ASSERT_TRUE(engine->wait(*warm, Deadline::after_ms(kIoTimeoutMs)).ok());

  doomed->kill_now();
  const int64_t start = now_ns();
  constexpr int64_t kBatchDeadlineMs = 3'000;
  bool failed = false;
  // The first batches after the kill may still be accepted by the socket; keep posting
  // until one fails, each bounded by its own deadline.
  for (int i = 0; i < 20 && !failed; ++i) {
    auto id = to_doomed->write(whole, Deadline::after_ms(kBatchDeadlineMs));
    if (!id.ok()) {
      failed = true;
      break;
    }
    Status s = engine->wait(*id, Deadline::after_ms(2 * kBatchDeadlineMs));
    failed = !s.ok();
  }
  const double elapsed_ms = (now_ns() - start) / 1e6;
  EXPECT_TRUE(failed) << "writes to a killed peer kept succeeding";
  EXPECT_LT(elapsed_ms, 2 * kBatchDeadlineMs + 1'000);

  auto id = to_healthy->write(whole);
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(engine->wait(*id, Deadline::after_ms(kIoTimeoutMs)).ok());
  auto remote = healthy->dump();
  ASSERT_TRUE(remote.has_value());
  EXPECT_EQ(*remote, source);
}

TEST(TwoProcess, RestartedPeerWithNewBootNonceReplacesTheOldOne) {
  auto engine = parent_engine();
  ASSERT_TRUE(engine);
  auto first = ChildPeer::spawn(named("decoder"));
  ASSERT_TRUE(first);
  std::vector<uint8_t> source(1 << 16);
  fill_pattern(source, 6);
  auto src = engine->register_memory(source.data(), source.size(), MemKind::kHost);
  ASSERT_TRUE(src.ok());
  ASSERT_TRUE(engine->connect(first->engine()).ok());
  auto old_session = engine->session(*src, first->mem());
  ASSERT_TRUE(old_session.ok());
  const MemDesc old_mem = first->mem();
  first->kill_now();

  auto second = ChildPeer::spawn(named("decoder"));
  ASSERT_TRUE(second);
  ASSERT_NE(second->engine().boot_nonce, old_mem.boot_nonce);
  ASSERT_TRUE(engine->connect(second->engine()).ok());
  std::vector<Op> whole = {{0, 0, source.size()}};
  EXPECT_EQ(old_session->write(whole).status().code(), ErrorCode::kFailedPrecondition);
  EXPECT_EQ(engine->session(*src, old_mem).status().code(), ErrorCode::kFailedPrecondition);
  auto fresh = engine->session(*src, second->mem());
  ASSERT_TRUE(fresh.ok());
  auto id = fresh->write(whole);
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(engine->wait(*id, Deadline::after_ms(kIoTimeoutMs)).ok());
  auto remote = second->dump();
  ASSERT_TRUE(remote.has_value());
  EXPECT_TRUE(std::equal(source.begin(), source.end(), remote->begin()));
}

// A network namespace joined to this one by a veth pair; removed on destruction.
class VethNamespace {
 public:
  static std::unique_ptr<VethNamespace> create(std::string* why) {
    const int pid = static_cast<int>(getpid());
    auto ns = std::unique_ptr<VethNamespace>(new VethNamespace());
    ns->name_ = fmt::format("pdxfer{}", pid);
    ns->veth_ = fmt::format("pdxv{}", pid % 1000000);
    ns->peer_veth_ = fmt::format("pdxp{}", pid % 1000000);
    const int subnet = pid % 250;
    ns->host_ip_ = fmt::format("10.231.{}.1", subnet);
    ns->ns_ip_ = fmt::format("10.231.{}.2", subnet);
    const std::vector<std::string> steps = {
        fmt::format("ip netns add {}", ns->name_),
        fmt::format("ip link add {} type veth peer name {}", ns->veth_, ns->peer_veth_),
        fmt::format("ip link set {} netns {}", ns->peer_veth_, ns->name_),
        fmt::format("ip addr add {}/24 dev {}", ns->host_ip_, ns->veth_),
        fmt::format("ip link set {} up", ns->veth_),
        fmt::format("ip -n {} addr add {}/24 dev {}", ns->name_, ns->ns_ip_, ns->peer_veth_),
        fmt::format("ip -n {} link set {} up", ns->name_, ns->peer_veth_),
        fmt::format("ip -n {} link set lo up", ns->name_),
    };
    for (const auto& step : steps) {
      if (std::system((step + " 2>/dev/null").c_str()) != 0) {
        *why = "'" + step + "' failed";
        return nullptr;  // the destructor removes what was made
      }
    }
    return ns;
  }
  ~VethNamespace() {
    std::system(fmt::format("ip link del {} 2>/dev/null", veth_).c_str());
    std::system(fmt::format("ip netns del {} 2>/dev/null", name_).c_str());
  }
  std::string name_, veth_, peer_veth_, host_ip_, ns_ip_;
};

TEST(TwoProcess, RandomWritesAndReadsAcrossTwoNetworkNamespacesOverVeth) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to create a network namespace and a veth pair";
  std::string why;
  auto ns = VethNamespace::create(&why);
  if (!ns) GTEST_SKIP() << "cannot build a network namespace here: " << why;
  // The parent's engine starts while its veth end has no carrier (the far end is down)
  // and the far end comes up meanwhile: the engine must wait for its interface to run.
  // Without that wait UCX drops the veth from UCX_NET_DEVICES and advertises loopback
  // only, which the other namespace cannot reach ("Destination is unreachable").
  ASSERT_EQ(std::system(fmt::format("ip -n {} link set {} down", ns->name_, ns->peer_veth_).c_str()), 0);
  std::unique_ptr<TransferEngine> engine;
  std::thread starter([&] { engine = parent_engine(ns->host_ip_); });
  const int up = std::system(fmt::format("ip -n {} link set {} up", ns->name_, ns->peer_veth_).c_str());
  starter.join();
  ASSERT_EQ(up, 0);
  ASSERT_TRUE(engine);
  ChildSpec spec = named("remote");
  spec.listen_host = ns->ns_ip_;
  spec.netns = ns->name_;
  auto child = ChildPeer::spawn(spec);
  ASSERT_TRUE(child);
  // TCP over the veth, nothing else: shared memory would cross the namespaces unseen.
  exchange_and_verify(*engine, *child, 1 << 20, 31, "tcp/" + ns->veth_);
  // The same with GPU regions on both sides, through ucx staging.
  spec = named("remote-gpu");
  spec.listen_host = ns->ns_ip_;
  spec.netns = ns->name_;
  spec.staged = true;
  auto gpu_child = ChildPeer::spawn(spec);
  ASSERT_TRUE(gpu_child);
  exchange_and_verify(*engine, *gpu_child, 1 << 20, 32, "tcp/" + ns->veth_, MemKind::kCuda);
}

TEST(TwoProcess, EngineRefusesAnInterfaceThatStaysDownInsteadOfFallingBackToLoopback) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to create a network namespace and a veth pair";
  std::string why;
  auto ns = VethNamespace::create(&why);
  if (!ns) GTEST_SKIP() << "cannot build a network namespace here: " << why;
  // With the far end down the near end never gets a carrier.
  ASSERT_EQ(std::system(fmt::format("ip -n {} link set {} down", ns->name_, ns->peer_veth_).c_str()), 0);
  EngineConfig config;
  config.name = "parent";
  config.listen_host = ns->host_ip_;
  config.backends = {"ucx"};
  config.ucx_transports = "tcp";
  config.interface_up_timeout_ms = 300;
  auto engine = TransferEngine::create(config);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), ErrorCode::kUnavailable);
  EXPECT_NE(engine.status().message().find(ns->veth_), std::string::npos) << engine.status().to_string();
}

}  // namespace
}  // namespace pd::xfer
