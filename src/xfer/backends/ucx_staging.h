// Staging for the ucx backend: moves bytes between regions that UCX cannot reach
// directly (GPU memory when the UCX build has no CUDA transports) through bounded
// host staging buffers and UCP active messages. Design, invariants and threads:
// src/xfer/README.md ("ucx staging").
//
// A batch is cut into chunks of at most `chunk_bytes` (staging_plan.h). Write: the
// initiator copies a chunk's pieces from its region into one of its staging slots
// (device -> host), sends it as one active message with the piece table; the target
// copies it into its region (host -> device, on its progress thread) and only then
// acknowledges. Read: the initiator sends the piece table; the target copies the
// pieces into one of its slots and sends them back; the initiator copies them into its
// region. A batch is done when every chunk is acknowledged / copied in, so a
// notification sent after wait() returns Ok is ordered after the data.
#pragma once

#include <ucp/api/ucp.h>

#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "xfer/backends/staging_copier.h"
#include "xfer/backends/staging_plan.h"
#include "xfer/backends/ucx_common.h"

namespace pd::xfer {

struct StagingConfig {
  uint64_t chunk_bytes = 4ull << 20;
  uint32_t max_pieces = 1024;        // pieces per chunk (bounds a chunk's piece table)
  uint32_t num_initiator_slots = 8;  // chunks of our batches in flight at once
  uint32_t num_target_slots = 8;     // peers' chunks being copied in / out at once
};

// Memory on one side of a staged transfer: where its bytes are and how to reach them
// (`device`: through the device copier, else a plain memcpy).
struct StagedMemory {
  uint8_t* ptr = nullptr;
  uint64_t bytes = 0;
  bool device = false;
  int device_ordinal = -1;
};

class UcxStaging {
 public:
  // `device_copier` may be null: then only host memory can be staged (as the target of
  // a peer's GPU batch). It is only ever called from the progress thread.
  UcxStaging(ucp_worker_h worker, std::unique_ptr<StagingCopier> device_copier, StagingConfig config);
  // Precondition: shutdown() has returned.
  ~UcxStaging();
  UcxStaging(const UcxStaging&) = delete;
  UcxStaging& operator=(const UcxStaging&) = delete;

  // Installs the active-message handler on the worker. Before any peer connects.
  Status install();
  bool has_device_copier() const { return device_copier_ != nullptr; }
  const StagingConfig& config() const { return config_; }

  // Regions of this engine that peers' staged batches may address (any thread).
  void add_region(RegionId id, const StagedMemory& memory);
  // Returns once no copy into or out of the region is running.
  void remove_region(RegionId id);

  // Any thread: queues a validated batch (sorted, merged ops); its chunks start on the
  // progress thread. The completion is set once nothing of the batch is in flight.
  std::shared_ptr<UcxCompletion> post(std::shared_ptr<UcxPeer> peer, Direction direction, const StagedMemory& local,
                                      RegionId remote_region, std::span<const Op> ops,
                                      SteadyClock::time_point deadline);

  // Progress thread, after ucp_worker_progress: handles what arrived and completed,
  // starts chunks while slots are free, fails batches past their deadline or whose peer
  // failed. True while anything is in flight or queued (the thread keeps spinning).
  bool progress();

  // After the progress thread stopped and the endpoints were closed: fails every batch,
  // drops queued work and progresses the worker until no UCX operation references
  // staging memory, or the deadline passes.
  void shutdown(Deadline deadline);

  // Counters (tests, metrics).
  uint64_t num_bad_messages() const { return num_bad_messages_.load(); }

 private:
  enum class OpKind : uint8_t { kInitiatorSend, kInitiatorRecv, kTargetRecv, kTargetSend };
  struct OpContext {
    UcxStaging* self;
    OpKind kind;
    uint64_t id;
  };
  struct OpDone {
    OpKind kind;
    uint64_t id;
    ucs_status_t status;
  };
  struct Arrival {
    StagingHeader header;
    void* desc = nullptr;            // UCX's descriptor: recv_data (rndv) or release; null when `owned`
    const uint8_t* bytes = nullptr;  // the data when not rndv
    uint64_t length = 0;
    bool rndv = false;
    std::vector<uint8_t> owned;  // the data, copied, when UCX could not keep it
    ucp_ep_h reply_ep = nullptr;
  };
  struct Batch {
    std::shared_ptr<UcxCompletion> completion;
    std::shared_ptr<UcxPeer> peer;
    Direction direction = Direction::kWrite;
    StagedMemory local;
    RegionId remote_region = 0;
    std::vector<StagingChunk> chunks;
    size_t next_chunk = 0;    // chunks [next_chunk, end) have not started
    size_t num_finished = 0;  // chunks retired (done, or abandoned after a failure)
    size_t num_live = 0;      // chunks started and not retired
    SteadyClock::time_point deadline;
    std::string failure;  // set once: the batch failed (why)
  };
  // A chunk of one of our batches, from start to retirement. Holds an initiator slot.
  struct Chunk {
    std::shared_ptr<Batch> batch;
    size_t index = 0;
    uint8_t* slot = nullptr;
    StagingHeader header;          // sent; alive while the send is in flight
    std::vector<WirePiece> table;  // read requests: the table sent
    bool send_in_flight = false;
    bool recv_in_flight = false;
    bool reply_pending = true;  // the ack (write) or the data (read) has not arrived
  };
  // A peer's chunk on this side, from arrival until our reply is sent.
  struct TargetJob {
    Arrival arrival;
    uint8_t* slot = nullptr;
    StagingHeader reply;            // sent; alive while the send is in flight
    std::vector<WirePiece> pieces;  // read requests: the checked table
  };

  static ucs_status_t on_message(void* arg, const void* header, size_t header_bytes, void* data, size_t length,
                                 const ucp_am_recv_param_t* param);
  static void on_send_done(void* request, ucs_status_t status, void* user_data);
  static void on_recv_done(void* request, ucs_status_t status, size_t length, void* user_data);

  Status ensure_slots();
  StagingCopier& copier_for(const StagedMemory& memory);
  void take_posted();
  void handle_arrival(Arrival arrival);
  void handle_done(const OpDone& done);
  void start_chunk(const std::shared_ptr<Batch>& batch);
  void start_target_job(uint64_t job_id);
  // Copies a write chunk (table + bytes at `payload`) into its region; the ack status.
  StagingStatus apply_write(const StagingHeader& header, const uint8_t* payload, uint64_t length);
  void send_reply(uint64_t job_id, StagingMessage type, StagingStatus status, const void* data, uint64_t bytes);
  void send(ucp_ep_h ep, const StagingHeader* header, const void* data, uint64_t bytes, uint32_t flags, OpKind kind,
            uint64_t id);
  void receive(void* desc, uint8_t* buffer, uint64_t bytes, OpKind kind, uint64_t id);
  void release_arrival(Arrival& arrival);
  void fail_batch(Batch& batch, const std::string& why);
  void try_retire_chunk(uint64_t token);
  void finish_batches();

  ucp_worker_h worker_;
  std::unique_ptr<StagingCopier> device_copier_;
  std::unique_ptr<StagingCopier> host_copier_;
  StagingConfig config_;
  uint64_t slot_bytes_ = 0;

  std::mutex regions_mutex_;  // guards regions_; held by the progress thread while it copies
  std::map<RegionId, StagedMemory> regions_;

  std::mutex posted_mutex_;  // guards posted_ (any thread -> progress thread)
  std::vector<std::shared_ptr<Batch>> posted_;

  std::mutex events_mutex_;  // guards arrivals_ and done_ops_ (UCX callbacks)
  std::vector<Arrival> arrivals_;
  std::vector<OpDone> done_ops_;

  // Owned by the progress thread (and by shutdown() after it stopped).
  std::vector<uint8_t*> all_slots_;
  std::vector<uint8_t*> free_initiator_slots_;
  std::vector<uint8_t*> free_target_slots_;
  std::deque<std::shared_ptr<Batch>> runnable_;  // batches with chunks not started, in post order
  std::vector<std::shared_ptr<Batch>> active_;   // batches not finished
  std::unordered_map<uint64_t, Chunk> chunks_;   // by token
  // Replies (kAck, kReadData) are matched by token alone, and any UCX endpoint that has our
  // worker address can send one: tokens are a keyed bijection of a counter (distinct, not
  // guessable), so a forged reply cannot mark a chunk done without its data.
  uint64_t next_chunk_ = 0;
  uint64_t token_key_ = 0;  // random, per staging instance
  uint64_t next_token();
  std::unordered_map<uint64_t, TargetJob> target_jobs_;
  std::deque<uint64_t> jobs_waiting_for_slot_;
  uint64_t next_job_ = 1;
  uint64_t num_ops_in_flight_ = 0;  // UCX sends/receives whose callback has not run

  std::atomic<uint64_t> num_bad_messages_{0};
};

}  // namespace pd::xfer
