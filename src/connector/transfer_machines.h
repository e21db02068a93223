// The pure cores of the connector: producer-side and consumer-side transfer
// state machines. No sockets, threads, clocks or devices: time comes in as
// now_ms, effects go out as Actions that the adapter (pd_connector.cc)
// executes. Single-threaded by contract (the engine thread owns them).
//
// Producer, WRITE:   Prefilling --forward done--> KvReady --request_finished--> Held
//   blocks may arrive in any phase (even before the request: buffered up to
//   defer_timeout); each layer's writes (one per piece of the transfer plan with
//   that consumer, transfer_plan.h: one per pair of tensor-parallel ranks that
//   exchange heads) are posted as soon as both that layer's KV and the
//   destination ids exist; once all layers are posted and complete: done
//   (ok) to the consumer, hold released. Held without destination ids past
//   defer_timeout: released, counted. A failure (of any rank's write) or consumer
//   abort stops new writes; the hold is released only when no write of any rank is
//   in flight.
// Producer, READ:    Prefilling --> Held (transfer_timeout) --read(ids checked)--> Held
//   (deadline extended) --release from the same peer--> freed; timeout: freed, counted.
// Consumer:          Admitted --alloc--> AwaitingPeer (handshake_timeout) -->
//   WRITE: WaitingDone --done ok--> finished | done !ok / abort / error --> load error
//   READ:  AwaitingReadOk --read_ok--> Reading (per layer, one read per plan piece)
//            --all ok--> release + finished
//            |-- any rank's read failed --> (every read ended) release + load error
//   request finished while data may still move into its blocks: abort sent, blocks
//   held until the producer answers or transfer_timeout passes.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "connector/messages.h"
#include "connector/peer_key.h"

namespace pd::connector {

// Who sent a message: the connection it came through and the identity it claimed
// in its (validated) meta handshake.
struct PeerRef {
  PeerKey key;
  std::string instance_id;
  uint64_t boot_nonce = 0;
  bool operator==(const PeerRef&) const = default;
};

struct OutgoingMessage {
  PeerKey to;
  ControlMessage message;  // instance_id / boot_nonce filled by the adapter
};

// ----------------------------------------------------------------------------
struct ProducerTimeouts {
  int64_t defer_timeout_ms = 60'000;
  int64_t transfer_timeout_ms = 30'000;
};

struct ProducerActions {
  std::vector<OutgoingMessage> sends;
  struct PostWrite {
    std::string transfer_id;
    int32_t layer = 0;
    int32_t piece = 0;  // index into the plan's pieces with the destination peer
  };
  std::vector<PostWrite> writes;
  std::vector<std::string> released_request_ids;  // -> finished_sending
  // WRITE `done` messages that are settled but for writes still in flight: the
  // adapter sends one the moment the transfer's last write completes, from its
  // completion path, and then reports it with on_done_sent_early. Otherwise the
  // same done goes out in `sends` when the engine thread sees the completions.
  std::vector<OutgoingMessage> early_dones;
  // Transfers whose offered early done must not go out any more: they failed
  // (abort, release, timeout, a failed write) after the offer. The adapter drops
  // the offer if it still holds it.
  std::vector<std::string> withdrawn_early_dones;
  int32_t num_timeouts = 0;
  int32_t num_completed = 0;
  int32_t num_failed = 0;
  int32_t num_refused = 0;  // messages refused (forged, wrong peer, bad ids)

  bool empty() const {
    return sends.empty() && writes.empty() && released_request_ids.empty() && early_dones.empty() &&
           withdrawn_early_dones.empty() && num_timeouts == 0 && num_completed == 0 && num_failed == 0 &&
           num_refused == 0;
  }
};

class ProducerTransfers {
 public:
  ProducerTransfers(int32_t num_layers, int32_t block_size, ProducerTimeouts timeouts)
      : num_layers_(num_layers), block_size_(block_size), timeouts_(timeouts) {}

  struct Destination {
    PeerRef peer;
    std::vector<int32_t> block_ids;  // consumer blocks, in prompt order
    int32_t num_skip_blocks = 0;     // leading prompt blocks the consumer already has
    int32_t kv_tokens = 0;           // prompt tokens it takes; all of them = it wants the first token
    int32_t pieces_per_layer = 1;    // writes per layer: the transfer plan's pieces with this peer
  };

  // A do_remote_decode request was admitted.
  Status start(const std::string& transfer_id, const std::string& request_id, bool read_mode, int32_t num_prompt_tokens,
               int64_t now_ms);
  // The step that completes the prompt is about to run with these local blocks.
  void begin_final_step(const std::string& transfer_id, std::vector<int32_t> local_block_ids);
  // Inside the final step, after `layer`'s attention wrote its KV.
  void on_layer_saved(const std::string& transfer_id, int32_t layer);
  // The final step's forward pass returned; ok=false fails the transfer.
  void on_forward_done(const std::string& transfer_id, bool ok);
  // Returns delay_free: keep the blocks until released_request_ids names the request.
  // kv_complete: the whole prompt's KV was computed.
  bool request_finished(const std::string& transfer_id, const std::vector<int32_t>& block_ids, bool kv_complete,
                        int64_t now_ms);
  // One write (layer, piece) ended. A failed one fails the whole transfer; done
  // and the release wait until every other piece's write has ended too.
  void on_write_done(const std::string& transfer_id, int32_t layer, bool ok, int32_t piece = 0);
  // The request's first output token (first-token hand-over): sent with done /
  // read_ok to a consumer that took the whole prompt's KV. A WRITE done to such
  // a consumer waits for it (or for request_finished).
  void first_token_sampled(const std::string& transfer_id, int32_t token_id, uint64_t sampling_key);
  // The adapter sent this transfer's early_dones message (all its writes completed
  // ok): done counts as sent, nothing more goes to the consumer.
  void on_done_sent_early(const std::string& transfer_id);

  // Control messages (already decoded and validated for shape). peer_num_blocks:
  // the consumer's pool size from its meta (bounds for its block ids);
  // pieces_per_layer: the transfer plan's pieces with that consumer (>= 1).
  void on_blocks(const PeerRef& from, const ControlMessage& msg, int32_t peer_num_blocks, int64_t now_ms,
                 int32_t pieces_per_layer = 1);
  void on_read(const PeerRef& from, const ControlMessage& msg, int64_t now_ms);
  void on_release(const PeerRef& from, const ControlMessage& msg);
  void on_abort(const PeerRef& from, const ControlMessage& msg);
  // A consumer instance restarted (new nonce) or its connection is gone.
  void on_peer_gone(const std::string& instance_id, uint64_t boot_nonce);
  // An explicit release from the router (POST /pd/release): exactly what an
  // `abort` from the bound consumer does, without the peer check. In-flight
  // writes end before the blocks are freed; an id not seen yet is remembered
  // (bounded tombstones), so its leg holds nothing when it arrives. Returns
  // true when the transfer was active here (held, computing or buffered).
  bool release(const std::string& transfer_id);

  void tick(int64_t now_ms);
  ProducerActions take_actions();

  // Introspection for the adapter and tests.
  bool has(const std::string& transfer_id) const { return transfers_.count(transfer_id) > 0; }
  const Destination* destination(const std::string& transfer_id) const;
  const std::vector<int32_t>* local_blocks(const std::string& transfer_id) const;
  size_t num_active() const { return transfers_.size(); }
  size_t num_buffered_blocks() const { return early_blocks_.size(); }
  size_t num_buffered_block_ids() const { return early_block_ids_; }
  size_t num_blocks_held() const;
  std::optional<std::string> transfer_of_request(const std::string& request_id) const;

 private:
  enum class Phase : uint8_t { kPrefilling, kKvReady };
  struct Transfer {
    std::string request_id;
    bool read_mode = false;
    int32_t num_prompt_tokens = 0;
    Phase phase = Phase::kPrefilling;
    std::vector<int32_t> local_block_ids;
    std::optional<Destination> dest;
    std::vector<bool> layer_ready;
    std::vector<bool> layer_posted;
    int32_t num_in_flight = 0;
    bool failed = false;
    std::string failure;
    bool peer_gone = false;  // the consumer incarnation is dead: nothing to tell it
    bool done_sent = false;
    bool done_offered_early = false;  // in early_dones once
    bool holding = false;             // request finished, blocks kept for us
    bool finished = false;            // request_finished seen
    int64_t deadline_ms = 0;
    std::optional<PeerRef> reader;  // READ: the peer whose `read` was accepted
    std::optional<int32_t> first_token;
    uint64_t sampling_key = 0;
  };
  struct EarlyBlocks {
    PeerRef from;
    ControlMessage msg;
    int32_t peer_num_blocks = 0;
    int64_t deadline_ms = 0;
    size_t num_ids = 0;  // msg.block_ids.size() when buffered: what erase_early gives back, moved or not
    int32_t pieces_per_layer = 1;
  };

  Status attach_destination(Transfer& t, const std::string& transfer_id, const PeerRef& from, const ControlMessage& msg,
                            int32_t peer_num_blocks, int32_t pieces_per_layer);
  void post_ready_layers(const std::string& transfer_id, Transfer& t);
  void fail(const std::string& transfer_id, Transfer& t, const std::string& reason);
  void maybe_finish(const std::string& transfer_id);
  // The WRITE `done` (ok) once KV, destination, every posted layer and (when the
  // consumer wants it) the first token are settled; nullopt before.
  std::optional<OutgoingMessage> settled_done(const std::string& transfer_id, const Transfer& t) const;
  void remember_closed(const std::string& transfer_id);
  // Ends a transfer its consumer (or the router) gave up on; see on_abort.
  void abort_transfer(const std::string& transfer_id, const std::string& reason);
  void send(const PeerRef& to, MessageType type, const std::string& transfer_id, std::string text = {}, bool ok = false,
            int32_t num_tokens = 0);
  // Drops a buffered list, keeping early_block_ids_ in step; returns the next entry.
  using EarlyBlocksMap = std::map<std::string, EarlyBlocks>;
  EarlyBlocksMap::iterator erase_early(EarlyBlocksMap::iterator it);

  int32_t num_layers_;
  int32_t block_size_;
  ProducerTimeouts timeouts_;
  std::map<std::string, Transfer> transfers_;
  std::map<std::string, EarlyBlocks> early_blocks_;
  size_t early_block_ids_ = 0;  // block ids held in early_blocks_, bounded by kMaxEarlyBlockIds
  // Recently ended transfers, so late messages for them get an answer, not a buffer slot.
  std::set<std::string> closed_set_;
  std::deque<std::string> closed_order_;
  ProducerActions actions_;
};

inline constexpr size_t kMaxEarlyBlocks = 4096;
// Bytes, not just lists: 4096 lists of up to 2^20 ids each (what a frame may carry) would be
// 16 GiB held for defer_timeout on a peer's word. 2^20 ids (4 MiB) cover 64 concurrent
// 256k-token prompts in 16-token blocks.
inline constexpr size_t kMaxEarlyBlockIds = size_t{1} << 20;

// ----------------------------------------------------------------------------
struct ConsumerTimeouts {
  int64_t handshake_timeout_ms = 5'000;
  int64_t transfer_timeout_ms = 30'000;
};

struct LoadFailure {
  std::string request_id;
  std::vector<int32_t> block_ids;
  std::string reason;
  // The producer refused the request's own transfer parameters: fail the
  // request as invalid (HTTP 400), whatever the failure policy.
  bool invalid_params = false;
};

struct ConsumerActions {
  std::vector<OutgoingMessage> sends;
  // Open (or re-open) a handshake: send meta to this control address.
  std::vector<std::string> handshakes;
  std::vector<std::string> dropped_dealers;  // close the DEALER (failed or restarted peer)
  struct PostRead {
    std::string transfer_id;
    int32_t layer = 0;
    int32_t piece = 0;  // index into the plan's pieces with the producer
  };
  std::vector<PostRead> reads;
  std::vector<std::string> finished_recving;
  // (request id, token): a subset of finished_recving, the load succeeded.
  std::vector<std::pair<std::string, int32_t>> first_tokens;
  int32_t num_first_tokens_refused = 0;  // came with another sampling key
  std::vector<LoadFailure> load_failures;
  // Transfers that ended with their load reported (finished_recving, load_failures) or their
  // hold released: nothing more arrives for them, so the adapter drops what it keeps by their id.
  std::vector<std::string> closed_transfer_ids;
  int32_t num_completed = 0;
  int32_t num_timeouts = 0;
  int32_t num_refused = 0;

  bool empty() const {
    return sends.empty() && handshakes.empty() && dropped_dealers.empty() && reads.empty() &&
           finished_recving.empty() && first_tokens.empty() && num_first_tokens_refused == 0 && load_failures.empty() &&
           num_completed == 0 && num_timeouts == 0 && num_refused == 0;
  }
};

class ConsumerTransfers {
 public:
  ConsumerTransfers(int32_t num_layers, int32_t block_size, ConsumerTimeouts timeouts)
      : num_layers_(num_layers), block_size_(block_size), timeouts_(timeouts) {}

  struct Params {
    std::string transfer_id;
    bool read_mode = false;
    std::string remote_instance_id;
    std::string remote_control;
    uint64_t remote_boot_nonce = 0;
    std::vector<int32_t> remote_block_ids;  // READ
    // First-token hand-over: take the KV of every prompt token and the
    // producer's first output token, if its sampling key equals this one.
    bool want_first_token = false;
    uint64_t sampling_key = 0;
  };

  // Admission: returns the number of external tokens (prompt minus the local
  // prefix minus the last token, which is computed here unless
  // want_first_token). 0 means nothing to move: the producer is told to let go
  // of its blocks.
  int32_t admit(const std::string& request_id, Params params, int32_t num_local_computed_tokens,
                int32_t num_prompt_tokens, int64_t now_ms);
  // Blocks were allocated: block_table is the whole table; the external tokens
  // are [num_local_computed_tokens, + num_external_tokens).
  void allocated(const std::string& request_id, const std::vector<int32_t>& block_table,
                 int32_t num_local_computed_tokens, int32_t num_external_tokens, int64_t now_ms);

  // Handshake results (the adapter checked the layout fingerprint).
  // pieces_per_layer: the transfer plan's pieces with that producer (>= 1), the
  // reads per layer of a READ transfer.
  void on_peer_ready(const std::string& control, const std::string& instance_id, uint64_t boot_nonce,
                     int32_t peer_num_blocks, int32_t pieces_per_layer = 1);
  void on_peer_failed(const std::string& control, const std::string& reason);
  // Any other message on the connection to `control` names its sender's identity: a
  // new one there (the producer restarted) fails the transfers waiting on the old
  // incarnation at once, and the next request handshakes again.
  void on_producer_identity(const std::string& control, const std::string& instance_id, uint64_t boot_nonce);

  void on_done(const PeerRef& from, const ControlMessage& msg);
  void on_read_ok(const PeerRef& from, const ControlMessage& msg);
  void on_abort_or_error(const PeerRef& from, const ControlMessage& msg);
  // One read (layer, piece) ended. A failed one fails the load; release and the
  // load error wait until every piece's read has ended.
  void on_read_done(const std::string& transfer_id, int32_t layer, bool ok, int32_t piece = 0);

  // Returns delay_free.
  bool request_finished(const std::string& request_id, int64_t now_ms);
  // The engine's recv_abort_timeout passed for a waiting request.
  void on_remote_kv_timeout(const std::string& request_id);
  // The engine preempted a request whose transfer finished: nothing to do; if a
  // transfer is still moving data into its blocks, hold them (returns true).
  bool request_preempted(const std::string& request_id, int64_t now_ms);

  void tick(int64_t now_ms);
  ConsumerActions take_actions();

  // Introspection for the adapter and tests.
  struct TransferView {
    std::string request_id;
    bool read_mode = false;
    std::string remote_control;
    std::vector<int32_t> local_block_ids;   // destination blocks (external range)
    std::vector<int32_t> remote_block_ids;  // READ: source blocks, same length
  };
  std::optional<TransferView> view(const std::string& transfer_id) const;
  size_t num_active() const { return transfers_.size(); }
  bool peer_ready(const std::string& control) const;
  std::optional<std::string> transfer_of_request(const std::string& request_id) const;

 private:
  enum class Phase : uint8_t {
    kAdmitted,
    kNotifyOnly,
    kAwaitingPeer,
    kWaitingDone,
    kAwaitingReadOk,
    kReading,
    kClosed
  };
  struct Transfer {
    std::string request_id;
    Params params;
    Phase phase = Phase::kAdmitted;
    int32_t num_prompt_tokens = 0;
    int32_t num_skip_blocks = 0;
    int32_t kv_tokens = 0;  // prompt tokens whose KV comes from the producer (n - 1 or n)
    std::vector<int32_t> local_block_ids;
    std::vector<int32_t> read_remote_ids;
    std::optional<int32_t> first_token;  // accepted from done / read_ok
    int32_t num_in_flight = 0;
    bool failed = false;
    std::string failure;
    bool request_live = true;
    bool holding = false;
    bool silent = false;  // engine already handled it (timeout): report nothing but a hold release
    int64_t hold_deadline_ms = 0;
    bool data_may_move = false;  // blocks were sent / reads posted
  };
  enum class PeerPhase : uint8_t { kHandshaking, kReady, kFailed };
  struct Peer {
    PeerPhase phase = PeerPhase::kHandshaking;
    int64_t deadline_ms = 0;
    std::string instance_id;
    uint64_t boot_nonce = 0;
    int32_t num_blocks = 0;
    int32_t pieces_per_layer = 1;
  };

  void ensure_peer(const std::string& transfer_id, Transfer& t, int64_t now_ms);
  // Fails the transfers at `control` waiting on (instance_id, boot_nonce), which no longer answers there.
  void fail_orphans(const std::string& control, const std::string& instance_id, uint64_t boot_nonce,
                    const std::string& reason);
  void proceed(const std::string& transfer_id, Transfer& t, const Peer& peer);
  void finish(const std::string& transfer_id, Transfer& t, bool ok, const std::string& reason,
              bool invalid_params = false);
  bool from_producer(const Transfer& t, const PeerRef& from) const;
  void take_first_token(Transfer& t, const ControlMessage& msg);
  void send(const std::string& control, MessageType type, const std::string& transfer_id, std::string text = {});

  int32_t num_layers_;
  int32_t block_size_;
  ConsumerTimeouts timeouts_;
  std::map<std::string, Transfer> transfers_;      // by transfer id
  std::map<std::string, std::string> by_request_;  // request id -> transfer id
  std::map<std::string, Peer> peers_;              // by control address
  ConsumerActions actions_;
};

// ----------------------------------------------------------------------------
// What both state machines asked for since their actions were last taken: the one
// struct the adapter executes (PdConnector::run_actions).
struct TransferActions {
  ProducerActions producer;
  ConsumerActions consumer;
  bool empty() const { return producer.empty() && consumer.empty(); }
};

inline TransferActions take_actions(ProducerTransfers& producer, ConsumerTransfers& consumer) {
  return TransferActions{producer.take_actions(), consumer.take_actions()};
}

}  // namespace pd::connector
