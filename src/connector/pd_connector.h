// PdConnector: the engine's KvConnector (engine/kv_connector.h) for P/D
// disaggregation, and the worker-side LayerKvHooks handed to the runner.
//
// Owners and threads (README.md has the full picture):
//   * engine thread: every KvConnector call, both transfer state machines
//     (transfer_machines.h), the peer tables, posting of xfer batches;
//   * control-plane thread (control_plane.h): sockets; decoded messages go to an
//     inbox, then the engine is woken;
//   * completion thread: waits on posted xfer batches (each has a deadline),
//     puts completions in the same inbox, wakes the engine (and streams a READ
//     consumer's handed-over first token when its last read completes);
//   * registration thread (heartbeat.h), when a router address is configured;
//   * xfer's own progress thread (UCX).
// Nothing but the inbox (mutex) and immutable identity is shared.
#pragma once

#include <nlohmann/json.hpp>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <variant>
#include <vector>

#include "common/log_throttle.h"
#include "common/metrics.h"
#include "common/status.h"
#include "connector/config.h"
#include "connector/control_plane.h"
#include "connector/heartbeat.h"
#include "connector/messages.h"
#include "connector/transfer_machines.h"
#include "connector/transfer_params.h"
#include "connector/transfer_plan.h"
#include "engine/kv_connector.h"
#include "engine/model_runner.h"
#include "xfer/engine.h"

namespace pd::connector {

struct PdConnectorOptions {
  KvTransferConfig config;
  // Identity among peers and at the router; empty = "<role>-<hostname>-<pid>".
  std::string instance_id;
  std::string served_model_name;
  // This instance's HTTP address as the router should reach it ("host:port").
  std::string http_address;
  // Registration interval (the contract says 3 s; tests may shorten it).
  int64_t registration_interval_ms = 3'000;
};

class PdConnector final : public engine::KvConnector {
 public:
  // runner must outlive the connector (the engine destroys the connector first).
  static Result<std::unique_ptr<PdConnector>> create(PdConnectorOptions options, engine::ModelRunner* runner);
  ~PdConnector() override;

  // ---- thread-safe, for the server -----------------------------------------
  // GET /pd/info: the registration record without "v"/"type".
  nlohmann::json info_json() const;
  // A request's kv_transfer_params, parsed and validated against this instance once its
  // prompt is known (HTTP 400 on error, naming the field): the server's edge calls it on an
  // HTTP thread, so it touches only config_ and spec_. The engine and this connector then
  // carry the typed params.
  Result<TransferParams> parse_request_params(const nlohmann::json& params, int32_t num_prompt_tokens) const;
  // Starts the registration heartbeat (when proxy_ip/proxy_ping_port are set)
  // once the HTTP address is known (--port 0 picks it at listen time).
  Status start_registration(const std::string& http_address);
  const std::string& instance_id() const { return record_.instance_id; }
  uint64_t boot_nonce() const { return record_.boot_nonce; }
  const std::string& control_address() const { return record_.control; }
  const KvTransferConfig& config() const { return config_; }
  // POST /pd/release: ends a producer transfer as if its consumer had sent
  // `abort` (ProducerTransfers::release). Runs on the engine thread at its next
  // poll; `done` is called there with whether the transfer was active, after the
  // blocks-held gauge is updated. It must not block.
  void release_transfer(std::string transfer_id, std::function<void(bool released)> done);

  // ---- engine::KvConnector (engine thread) ---------------------------------
  void bind_engine_wakeup(std::function<void()> wakeup) override;
  void bind_first_token_sink(engine::FirstTokenSink sink) override;
  Result<engine::ExternalMatch> get_num_new_matched_tokens(const engine::Request& request,
                                                           int32_t num_local_computed_tokens) override;
  void update_state_after_alloc(const engine::Request& request, std::span<const int32_t> block_ids,
                                int32_t num_external_tokens) override;
  engine::LayerKvHooks* build_step_hooks(const engine::StepInput& input, const engine::StepPlan& plan) override;
  void after_step(const engine::StepPlan& plan, const Status& status) override;
  engine::ConnectorEvents poll() override;
  bool request_preempted(const engine::Request& request, std::span<const int32_t> block_ids) override;
  void first_token_sampled(const engine::Request& request, int32_t token_id) override;
  engine::FinishDecision request_finished(const engine::Request& request, std::span<const int32_t> block_ids) override;
  engine::RemoteKvTimeoutAction on_remote_kv_timeout(const engine::Request& request) override;
  // With a router to register with: load and prefix-cache events go with the heartbeat.
  bool wants_load_reports() const override { return load_feed_ != nullptr; }
  void report_load(const engine::EngineLoad& load, std::vector<engine::KvCacheEvent> events) override;

 private:
  class StepHooks;
  struct Completion {
    bool is_write = false;
    std::string transfer_id;
    int32_t layer = 0;
    int32_t piece = 0;
    bool ok = false;
    uint64_t bytes = 0;
    std::string message;
  };
  struct ReleaseCall {
    std::string transfer_id;
    std::function<void(bool)> done;
  };
  // The completion thread sent this transfer's early `done` (ProducerActions::early_dones).
  struct EarlyDoneSent {
    std::string transfer_id;
  };
  using InboxItem = std::variant<InboundMessage, Completion, ReleaseCall, EarlyDoneSent>;
  // Producer WRITE: the write batches of one transfer not completed yet, as the
  // completion thread counts them, and the `done` it sends when the last one
  // completes ok (set by the engine thread from early_dones).
  struct WriteBatches {
    int32_t num_pending = 0;
    bool failed = false;
    std::optional<OutgoingMessage> done;
  };
  // Consumer with first-token hand-over: what the producer's answer must carry for the
  // state machine to accept it with its token, checked on the control-plane thread so
  // the token is streamed without waiting for the engine thread (bind_first_token_sink).
  // Armed just before `blocks` (WRITE) or `read` (READ) for the whole prompt goes out
  // (the answer may come at once). WRITE streams when `done` arrives; READ takes the
  // token from `read_ok` and the completion thread streams it when the last read
  // completes ok.
  struct HandOverExpected {
    PeerKey from;
    std::string instance_id;
    uint64_t boot_nonce = 0;
    int32_t num_prompt_tokens = 0;
    uint64_t sampling_key = 0;
    int64_t deadline_ns = 0;  // the engine's remote-KV deadline for the request, or earlier
    bool armed = false;       // `blocks` / `read` for the whole prompt is going out: answers count
    bool read_mode = false;
    std::optional<int32_t> read_token;  // READ: from a read_ok that passed the checks
    int32_t num_reads_left = -1;        // READ: set by the engine thread before it posts them
  };
  // A consumer load in flight (admitted with external tokens), by transfer id, from its
  // admission until its transfer closes or its request leaves (finish, preemption,
  // timeout). Shared with the control-plane thread, which finds the request of an
  // arriving `done` / `read_ok` here, and the completion thread, which counts a READ
  // hand-over's reads here; so it cannot live on the engine's request.
  struct ConsumerLoad {
    std::string request_id;
    int64_t admitted_ns = 0;
    std::optional<HandOverExpected> hand_over;
  };
  // What the connector keeps about one request, on the request itself
  // (engine::Request::connector_state): set at its admission, read in every later
  // call about it, gone with the request after request_finished.
  struct RequestState final : engine::RequestSlot {
    bool producer = false;
    std::string transfer_id;
    bool read_mode = false;
    // Consumer: the admission's local prefix (the external tokens follow it), and
    // whether a load of external tokens is under way (it has a ConsumerLoad).
    int32_t num_local_computed_tokens = 0;
    bool loading = false;
  };
  static RequestState* state_of(const engine::Request& request);
  struct PendingBatch {
    xfer::XferId id = 0;
    Completion completion;
  };
  // A peer we exchanged meta with: its identity, pool size, KV shards (head map,
  // one region per rank per layer) and the transfer plan between its ranks and ours.
  struct PeerInfo {
    std::string instance_id;
    uint64_t boot_nonce = 0;
    int32_t num_blocks = 0;
    std::vector<RankHeads> heads;        // per rank
    std::vector<xfer::MemDesc> regions;  // rank r, layer l at r * num_layers + l
    std::vector<PlanPiece> pieces;       // the plan's pieces: what a write / read action's `piece` indexes
    // (local rank, remote rank, layer) -> session, opened on first use.
    std::map<std::tuple<int32_t, int32_t, int32_t>, xfer::Session> sessions;
  };

  PdConnector(PdConnectorOptions options, engine::ModelRunner* runner);
  Status init();
  Status create_transfer_engine();
  // Every tensor-parallel rank's KV region of every layer, registered with xfer.
  Status register_kv_regions();
  Status start_control_plane();
  KvFingerprint fingerprint() const;
  ControlMessage meta_message(MessageType type) const;
  void wake();
  void push_inbox(InboxItem item);
  // The control-plane handler: queues the message; a `done` that completes a
  // hand-over as expected also streams its token now, a `read_ok` records it.
  void on_control_message(InboundMessage in);
  // The completion thread: queues a finished batch; the last read of a READ
  // hand-over whose reads all completed ok also streams its token now.
  void push_completion(Completion completion);
  void completion_loop();
  // Engine thread: registers or drops early paths after the state machines acted.
  void offer_early_done(OutgoingMessage done);
  void expect_hand_over(const std::string& transfer_id);
  // The request leaves its load (finish, preemption, timeout): its ConsumerLoad goes.
  void forget_load(const engine::Request& request);
  void drop_finished_write_batches();

  void handle_message(const InboundMessage& in, int64_t now_ms);
  void handle_meta(const InboundMessage& in);
  void handle_meta_ok(const InboundMessage& in);
  // local_is_producer: the plan maps our ranks (producer) to the peer's, or the
  // peer's (producer) to ours.
  Result<PeerInfo> peer_from_meta(const ControlMessage& msg, bool local_is_producer);
  void reply_error(const PeerKey& to, const std::string& transfer_id, const std::string& text);
  // Takes both state machines' actions and executes them until neither has any.
  void run_actions();
  void execute(TransferActions& actions);
  void post_write(const ProducerActions::PostWrite& write);
  void post_read(const ConsumerActions::PostRead& read);
  // Completed loads, first tokens and failures become the next poll's events.
  void report_events(ProducerActions& pa, ConsumerActions& ca);
  void send(OutgoingMessage out);
  // One xfer batch: `layer` of the plan piece `piece` of `peer` (a pair of ranks).
  Status post_batch(PeerInfo& peer, bool is_write, const std::string& transfer_id, int32_t layer, int32_t piece,
                    std::vector<xfer::Op> ops);
  void note_refused(int32_t count);
  void warn_peer(const std::string& what);

  PdConnectorOptions options_;
  const KvTransferConfig config_;
  engine::ModelRunner* runner_;
  engine::KvCacheSpec spec_;
  RegistrationRecord record_;

  std::unique_ptr<xfer::TransferEngine> xfer_;
  // Our KV shards: per tensor-parallel rank its heads, and its region of every
  // layer (rank r, layer l at r * num_layers + l).
  std::vector<RankHeads> local_heads_;
  std::vector<xfer::MemDesc> local_regions_;
  KvBlockLayout block_layout_;
  std::vector<uint8_t> engine_desc_bytes_;
  std::unique_ptr<ControlPlane> control_;
  std::unique_ptr<RegistrationHeartbeat> heartbeat_;
  // Set in init when registering with a router, never changed after: the engine thread
  // posts to it, the heartbeat thread takes from it (it locks inside).
  std::shared_ptr<LoadFeed> load_feed_;
  std::optional<auth::CurveKeys> curve_;

  // Shared between threads.
  mutable std::mutex mutex_;  // guards record_.http and everything below
  std::function<void()> wakeup_;
  std::deque<InboxItem> inbox_;
  std::deque<PendingBatch> pending_batches_;
  std::unordered_map<std::string, WriteBatches> write_batches_;   // by transfer id
  std::unordered_map<std::string, ConsumerLoad> consumer_loads_;  // by transfer id
  engine::FirstTokenSink first_token_sink_;
  std::condition_variable pending_cv_;
  bool stopping_ = false;
  std::thread completion_thread_;

  // Engine thread only.
  std::unique_ptr<ProducerTransfers> producer_;
  std::unique_ptr<ConsumerTransfers> consumer_;
  std::map<PeerKey, PeerInfo> producer_side_peers_;      // consumers that handshook with us, by ROUTER key
  std::map<std::string, PeerInfo> consumer_side_peers_;  // producers we dialled, by control address
  std::vector<std::string> final_step_transfers_;
  std::unique_ptr<StepHooks> hooks_;
  engine::ConnectorEvents events_;
  LogThrottle peer_log_{1'000'000'000};

  struct Metrics {
    metrics::Counter* started_producer;
    metrics::Counter* started_consumer;
    metrics::Counter* done_producer;
    metrics::Counter* done_consumer;
    metrics::Counter* failed_producer;
    metrics::Counter* failed_consumer;
    metrics::Counter* bytes_written;
    metrics::Counter* bytes_read;
    metrics::Histogram* transfer_seconds;
    metrics::Gauge* blocks_held;
    metrics::Counter* load_errors;
    metrics::Counter* recomputes;
    metrics::Counter* timeouts;
    metrics::Counter* refused;
    metrics::Counter* handshakes_refused;
    metrics::Counter* first_tokens_accepted;
    metrics::Counter* first_tokens_refused;
    metrics::Counter* first_tokens_streamed;  // consumer: streamed as `done` arrived (any thread)
    metrics::Counter* dones_on_completion;    // producer: done sent ahead of the engine thread's poll

    static Metrics create();
  } metrics_{};
};

}  // namespace pd::connector
