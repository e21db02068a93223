#include "xfer/backends/ucx_staging.h"

#include <algorithm>
#include <cstring>
#include <random>

#include "common/log.h"

namespace pd::xfer {

UcxStaging::UcxStaging(ucp_worker_h worker, std::unique_ptr<StagingCopier> device_copier, StagingConfig config)
    : worker_(worker),
      device_copier_(std::move(device_copier)),
      host_copier_(make_memcpy_copier()),
      config_(config),
      slot_bytes_(config.chunk_bytes + uint64_t{config.max_pieces} * sizeof(WirePiece)) {
  std::random_device entropy;
  token_key_ = (uint64_t{entropy()} << 32) ^ entropy();
}

uint64_t UcxStaging::next_token() {
  return staging_token(next_chunk_++, token_key_);
}

UcxStaging::~UcxStaging() {
  StagingCopier& allocator = device_copier_ ? *device_copier_ : *host_copier_;
  for (uint8_t* slot : all_slots_) allocator.free_host(slot);
}

Status UcxStaging::install() {
  ucp_am_handler_param_t param = {};
  param.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS | UCP_AM_HANDLER_PARAM_FIELD_CB |
                     UCP_AM_HANDLER_PARAM_FIELD_ARG;
  param.id = kStagingAmId;
  // Whole messages only; eager data may be kept past the handler (it runs on the
  // progress thread, which copies after ucp_worker_progress returns, never inside it).
  param.flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA;
  param.cb = &UcxStaging::on_message;
  param.arg = this;
  if (ucs_status_t s = ucp_worker_set_am_recv_handler(worker_, &param); s != UCS_OK) {
    return internal_error("ucp_worker_set_am_recv_handler (staging): {}", ucs_status_string(s));
  }
  return Status::Ok();
}

Status UcxStaging::ensure_slots() {
  if (!all_slots_.empty()) return Status::Ok();
  // Pinned when a device copier exists (full-speed, asynchronous device copies).
  StagingCopier& allocator = device_copier_ ? *device_copier_ : *host_copier_;
  const uint32_t total = config_.num_initiator_slots + config_.num_target_slots;
  for (uint32_t i = 0; i < total; ++i) {
    Result<uint8_t*> slot = allocator.allocate_host(slot_bytes_);
    if (!slot.ok()) {
      for (uint8_t* s : all_slots_) allocator.free_host(s);
      all_slots_.clear();
      free_initiator_slots_.clear();
      free_target_slots_.clear();
      return slot.status();
    }
    all_slots_.push_back(*slot);
    (i < config_.num_initiator_slots ? free_initiator_slots_ : free_target_slots_).push_back(*slot);
  }
  return Status::Ok();
}

StagingCopier& UcxStaging::copier_for(const StagedMemory& memory) {
  return memory.device ? *device_copier_ : *host_copier_;
}

void UcxStaging::add_region(RegionId id, const StagedMemory& memory) {
  std::lock_guard lock(regions_mutex_);
  regions_[id] = memory;
}

void UcxStaging::remove_region(RegionId id) {
  std::lock_guard lock(regions_mutex_);
  regions_.erase(id);
}

std::shared_ptr<UcxCompletion> UcxStaging::post(std::shared_ptr<UcxPeer> peer, Direction direction,
                                                const StagedMemory& local, RegionId remote_region,
                                                std::span<const Op> ops, SteadyClock::time_point deadline) {
  auto batch = std::make_shared<Batch>();
  batch->completion = std::make_shared<UcxCompletion>();
  batch->peer = std::move(peer);
  batch->direction = direction;
  batch->local = local;
  batch->remote_region = remote_region;
  batch->chunks = plan_staging_chunks(ops, config_.chunk_bytes, config_.max_pieces);
  batch->deadline = deadline;
  std::shared_ptr<UcxCompletion> completion = batch->completion;
  {
    std::lock_guard lock(posted_mutex_);
    posted_.push_back(std::move(batch));
  }
  ucp_worker_signal(worker_);  // the progress thread may be asleep in epoll
  return completion;
}

// ---- UCX callbacks: record the event; progress() acts on it ----

ucs_status_t UcxStaging::on_message(void* arg, const void* header, size_t header_bytes, void* data, size_t length,
                                    const ucp_am_recv_param_t* param) {
  auto* self = static_cast<UcxStaging*>(arg);
  std::optional<StagingHeader> decoded = decode_staging_header(header, header_bytes);
  if (!decoded) {
    self->num_bad_messages_.fetch_add(1);
    return UCS_OK;  // dropped (a rendezvous sender completes)
  }
  Arrival arrival;
  arrival.header = *decoded;
  arrival.length = length;
  arrival.rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) arrival.reply_ep = param->reply_ep;
  ucs_status_t keep = UCS_OK;
  if (arrival.rndv || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA)) {
    arrival.desc = data;
    if (!arrival.rndv) arrival.bytes = static_cast<const uint8_t*>(data);
    keep = UCS_INPROGRESS;  // released by release_arrival() or consumed by ucp_am_recv_data_nbx
  } else {
    const auto* p = static_cast<const uint8_t*>(data);
    arrival.owned.assign(p, p + length);
    arrival.bytes = arrival.owned.data();
  }
  std::lock_guard lock(self->events_mutex_);
  self->arrivals_.push_back(std::move(arrival));
  return keep;
}

void UcxStaging::on_send_done(void* request, ucs_status_t status, void* user_data) {
  auto* context = static_cast<OpContext*>(user_data);
  {
    std::lock_guard lock(context->self->events_mutex_);
    context->self->done_ops_.push_back({context->kind, context->id, status});
  }
  delete context;
  ucp_request_free(request);
}

void UcxStaging::on_recv_done(void* request, ucs_status_t status, size_t, void* user_data) {
  on_send_done(request, status, user_data);
}

void UcxStaging::send(ucp_ep_h ep, const StagingHeader* header, const void* data, uint64_t bytes, uint32_t flags,
                      OpKind kind, uint64_t id) {
  auto* context = new OpContext{this, kind, id};
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = &UcxStaging::on_send_done;
  param.user_data = context;
  param.flags = flags;
  ++num_ops_in_flight_;
  ucs_status_ptr_t r = ucp_am_send_nbx(ep, kStagingAmId, header, sizeof(*header), data, bytes, &param);
  if (!UCS_PTR_IS_PTR(r)) {  // done (or failed) at once: no callback will run
    delete context;
    std::lock_guard lock(events_mutex_);
    done_ops_.push_back({kind, id, UCS_PTR_STATUS(r)});
  }
}

void UcxStaging::receive(void* desc, uint8_t* buffer, uint64_t bytes, OpKind kind, uint64_t id) {
  auto* context = new OpContext{this, kind, id};
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.recv_am = &UcxStaging::on_recv_done;
  param.user_data = context;
  ++num_ops_in_flight_;
  ucs_status_ptr_t r = ucp_am_recv_data_nbx(worker_, desc, buffer, bytes, &param);
  if (!UCS_PTR_IS_PTR(r)) {
    delete context;
    std::lock_guard lock(events_mutex_);
    done_ops_.push_back({kind, id, UCS_PTR_STATUS(r)});
  }
}

void UcxStaging::release_arrival(Arrival& arrival) {
  if (arrival.desc != nullptr) ucp_am_data_release(worker_, arrival.desc);
  arrival.desc = nullptr;
  arrival.bytes = nullptr;
}

// ---- progress thread ----

bool UcxStaging::progress() {
  take_posted();
  // Handling one event can complete an operation at once (a new event): drain both.
  while (true) {
    std::vector<Arrival> arrivals;
    std::vector<OpDone> done;
    {
      std::lock_guard lock(events_mutex_);
      arrivals.swap(arrivals_);
      done.swap(done_ops_);
    }
    if (arrivals.empty() && done.empty()) break;
    for (const OpDone& d : done) {
      --num_ops_in_flight_;
      handle_done(d);
    }
    for (Arrival& a : arrivals) handle_arrival(std::move(a));
  }
  const auto now = SteadyClock::now();
  for (const auto& batch : active_) {
    if (!batch->failure.empty()) continue;
    if (batch->peer->failed.load()) {
      fail_batch(*batch, fmt::format("UCX endpoint to '{}' failed", batch->peer->name));
    } else if (now >= batch->deadline) {
      fail_batch(*batch, "batch deadline passed (staged chunks dropped)");
    }
  }
  while (!runnable_.empty() && (!free_initiator_slots_.empty() || all_slots_.empty())) {
    std::shared_ptr<Batch> batch = runnable_.front();
    if (!batch->failure.empty() || batch->next_chunk == batch->chunks.size()) {
      runnable_.pop_front();
      continue;
    }
    if (Status s = ensure_slots(); !s.ok()) {
      fail_batch(*batch, s.to_string());
      continue;
    }
    if (free_initiator_slots_.empty()) break;
    start_chunk(batch);
  }
  while (!jobs_waiting_for_slot_.empty() && (!free_target_slots_.empty() || all_slots_.empty())) {
    const uint64_t job = jobs_waiting_for_slot_.front();
    jobs_waiting_for_slot_.pop_front();
    start_target_job(job);
  }
  finish_batches();
  std::lock_guard lock(posted_mutex_);
  return !active_.empty() || !target_jobs_.empty() || num_ops_in_flight_ > 0 || !posted_.empty();
}

void UcxStaging::take_posted() {
  std::vector<std::shared_ptr<Batch>> posted;
  {
    std::lock_guard lock(posted_mutex_);
    posted.swap(posted_);
  }
  for (auto& batch : posted) {
    if (batch->local.device && device_copier_ == nullptr) {
      batch->failure = "no device copier for the local region";  // the backend refuses such routes first
    } else {
      runnable_.push_back(batch);
    }
    active_.push_back(std::move(batch));
  }
}

void UcxStaging::start_chunk(const std::shared_ptr<Batch>& batch) {
  const size_t index = batch->next_chunk++;
  const StagingChunk& plan = batch->chunks[index];
  const uint64_t token = next_token();
  Chunk& chunk = chunks_[token];
  chunk.batch = batch;
  chunk.index = index;
  chunk.slot = free_initiator_slots_.back();
  free_initiator_slots_.pop_back();
  ++batch->num_live;
  const uint64_t table_bytes = plan.pieces.size() * sizeof(WirePiece);
  chunk.header.token = token;
  chunk.header.region_id = batch->remote_region;
  chunk.header.num_pieces = static_cast<uint32_t>(plan.pieces.size());
  chunk.header.data_bytes = plan.bytes;
  std::vector<WirePiece> table;
  table.reserve(plan.pieces.size());
  for (const Op& piece : plan.pieces) table.push_back({piece.remote_offset, piece.bytes});
  if (batch->direction == Direction::kWrite) {
    // Slot: [piece table][packed bytes], sent as one message.
    std::memcpy(chunk.slot, table.data(), table_bytes);
    std::vector<StagingPiece> local;
    local.reserve(plan.pieces.size());
    uint64_t packed = table_bytes;
    for (const Op& piece : plan.pieces) {
      local.push_back({piece.local_offset, packed, piece.bytes});
      packed += piece.bytes;
    }
    Status copied =
        copier_for(batch->local).to_staging(batch->local.device_ordinal, batch->local.ptr, chunk.slot, local);
    if (!copied.ok()) {
      fail_batch(*batch, "copying a chunk out of the local region: " + copied.to_string());
      return;
    }
    chunk.header.type = static_cast<uint32_t>(StagingMessage::kWrite);
    chunk.send_in_flight = true;
    send(batch->peer->ep, &chunk.header, chunk.slot, table_bytes + plan.bytes, UCP_AM_SEND_FLAG_REPLY,
         OpKind::kInitiatorSend, token);
  } else {
    // The slot receives the bytes; the request carries the table only (eager: the
    // target answers from its handler's data).
    chunk.table = std::move(table);
    chunk.header.type = static_cast<uint32_t>(StagingMessage::kReadRequest);
    chunk.send_in_flight = true;
    send(batch->peer->ep, &chunk.header, chunk.table.data(), table_bytes,
         UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER, OpKind::kInitiatorSend, token);
  }
}

void UcxStaging::handle_arrival(Arrival arrival) {
  const StagingHeader& h = arrival.header;
  const auto type = static_cast<StagingMessage>(h.type);
  if (type == StagingMessage::kAck || type == StagingMessage::kReadData) {
    // A reply to one of our chunks.
    auto it = chunks_.find(h.token);
    if (it == chunks_.end() || !it->second.reply_pending) {
      release_arrival(arrival);  // late (the batch failed and the chunk was dropped) or unknown
      return;
    }
    Chunk& chunk = it->second;
    Batch& batch = *chunk.batch;
    const bool expected = (type == StagingMessage::kAck) == (batch.direction == Direction::kWrite);
    // From here on `chunk` may be retired (erased) by fail_batch: it is not touched after.
    chunk.reply_pending = false;
    if (!expected || h.status != static_cast<uint32_t>(StagingStatus::kOk)) {
      if (!expected) num_bad_messages_.fetch_add(1);
      release_arrival(arrival);
      fail_batch(batch, fmt::format("peer '{}' refused a staged chunk: {}", batch.peer->name,
                                    expected ? staging_status_name(h.status) : "unexpected reply type"));
      try_retire_chunk(h.token);
      return;
    }
    if (type == StagingMessage::kAck) {
      release_arrival(arrival);
      try_retire_chunk(h.token);
      return;
    }
    const StagingChunk& plan = batch.chunks[chunk.index];
    if (arrival.length != plan.bytes || !batch.failure.empty()) {
      release_arrival(arrival);
      if (batch.failure.empty()) {
        num_bad_messages_.fetch_add(1);
        fail_batch(batch, fmt::format("staged read data of {} bytes for a chunk of {}", arrival.length, plan.bytes));
      }
      try_retire_chunk(h.token);
      return;
    }
    if (arrival.rndv) {
      chunk.reply_pending = true;  // until the data is in: the receive below
      chunk.recv_in_flight = true;
      receive(arrival.desc, chunk.slot, plan.bytes, OpKind::kInitiatorRecv, h.token);
      return;
    }
    std::vector<StagingPiece> local;
    uint64_t packed = 0;
    for (const Op& piece : plan.pieces) {
      local.push_back({piece.local_offset, packed, piece.bytes});
      packed += piece.bytes;
    }
    Status copied =
        copier_for(batch.local).to_region(batch.local.device_ordinal, batch.local.ptr, arrival.bytes, local);
    release_arrival(arrival);
    if (!copied.ok()) fail_batch(batch, "copying a chunk into the local region: " + copied.to_string());
    try_retire_chunk(h.token);
    return;
  }
  // A peer's chunk for one of our regions.
  if (arrival.reply_ep == nullptr || (type == StagingMessage::kReadRequest && arrival.rndv)) {
    num_bad_messages_.fetch_add(1);  // no way to answer, or a table that should have been eager
    release_arrival(arrival);
    return;
  }
  const uint64_t job_id = next_job_++;
  TargetJob& job = target_jobs_[job_id];
  job.arrival = std::move(arrival);
  if (type == StagingMessage::kWrite && !job.arrival.rndv) {
    StagingStatus status = apply_write(job.arrival.header, job.arrival.bytes, job.arrival.length);
    release_arrival(job.arrival);
    send_reply(job_id, StagingMessage::kAck, status, nullptr, 0);
    return;
  }
  if (type == StagingMessage::kReadRequest) {
    // Check the table now (the data is released at once); the copy waits for a slot.
    StagedMemory region;
    bool known = false;
    {
      std::lock_guard lock(regions_mutex_);
      if (auto r = regions_.find(job.arrival.header.region_id); r != regions_.end()) {
        region = r->second;
        known = true;
      }
    }
    Result<std::vector<WirePiece>> pieces =
        known ? read_piece_table(job.arrival.header, job.arrival.bytes, job.arrival.length, region.bytes)
              : Result<std::vector<WirePiece>>(not_found("region"));
    release_arrival(job.arrival);
    if (!pieces.ok() || job.arrival.header.data_bytes > config_.chunk_bytes) {
      if (known) num_bad_messages_.fetch_add(1);
      send_reply(job_id, StagingMessage::kReadData, known ? StagingStatus::kBadRequest : StagingStatus::kUnknownRegion,
                 nullptr, 0);
      return;
    }
    job.pieces = std::move(pieces).value();
  }
  jobs_waiting_for_slot_.push_back(job_id);
}

void UcxStaging::start_target_job(uint64_t job_id) {
  auto it = target_jobs_.find(job_id);
  if (it == target_jobs_.end()) return;
  TargetJob& job = it->second;
  const auto type = static_cast<StagingMessage>(job.arrival.header.type);
  if (Status s = ensure_slots(); !s.ok()) {
    release_arrival(job.arrival);
    send_reply(job_id, type == StagingMessage::kWrite ? StagingMessage::kAck : StagingMessage::kReadData,
               StagingStatus::kCopyFailed, nullptr, 0);
    return;
  }
  if (type == StagingMessage::kWrite) {  // rendezvous: receive into a slot, then copy in
    if (job.arrival.length > slot_bytes_) {
      num_bad_messages_.fetch_add(1);
      release_arrival(job.arrival);
      send_reply(job_id, StagingMessage::kAck, StagingStatus::kBadRequest, nullptr, 0);
      return;
    }
    job.slot = free_target_slots_.back();
    free_target_slots_.pop_back();
    void* desc = job.arrival.desc;
    job.arrival.desc = nullptr;  // ucp_am_recv_data_nbx owns it now
    receive(desc, job.slot, job.arrival.length, OpKind::kTargetRecv, job_id);
    return;
  }
  // Read request: copy the pieces out of the region into a slot, send them back.
  job.slot = free_target_slots_.back();
  free_target_slots_.pop_back();
  StagingStatus status = StagingStatus::kOk;
  {
    std::lock_guard lock(regions_mutex_);
    auto r = regions_.find(job.arrival.header.region_id);
    if (r == regions_.end()) {
      status = StagingStatus::kUnknownRegion;
    } else {
      std::vector<StagingPiece> pieces;
      uint64_t packed = 0;
      for (const WirePiece& p : job.pieces) {
        pieces.push_back({p.region_offset, packed, p.bytes});
        packed += p.bytes;
      }
      Status copied = copier_for(r->second).to_staging(r->second.device_ordinal, r->second.ptr, job.slot, pieces);
      if (!copied.ok()) {
        PD_LOG_WARN("xfer ucx staging: copying a read chunk out of region {} failed: {}", r->first, copied.to_string());
        status = StagingStatus::kCopyFailed;
      }
    }
  }
  const bool ok = status == StagingStatus::kOk;
  send_reply(job_id, StagingMessage::kReadData, status, ok ? job.slot : nullptr,
             ok ? job.arrival.header.data_bytes : 0);
}

StagingStatus UcxStaging::apply_write(const StagingHeader& header, const uint8_t* payload, uint64_t length) {
  std::lock_guard lock(regions_mutex_);
  auto r = regions_.find(header.region_id);
  if (r == regions_.end()) return StagingStatus::kUnknownRegion;
  const uint64_t table_bytes = uint64_t{header.num_pieces} * sizeof(WirePiece);
  if (header.num_pieces > config_.max_pieces || length < table_bytes || length - table_bytes != header.data_bytes) {
    num_bad_messages_.fetch_add(1);
    return StagingStatus::kBadRequest;
  }
  Result<std::vector<WirePiece>> table = read_piece_table(header, payload, table_bytes, r->second.bytes);
  if (!table.ok()) {
    num_bad_messages_.fetch_add(1);
    return StagingStatus::kBadRequest;
  }
  std::vector<StagingPiece> pieces;
  pieces.reserve(table->size());
  uint64_t packed = table_bytes;
  for (const WirePiece& p : *table) {
    pieces.push_back({p.region_offset, packed, p.bytes});
    packed += p.bytes;
  }
  Status copied = copier_for(r->second).to_region(r->second.device_ordinal, r->second.ptr, payload, pieces);
  if (!copied.ok()) {
    PD_LOG_WARN("xfer ucx staging: copying a write chunk into region {} failed: {}", r->first, copied.to_string());
    return StagingStatus::kCopyFailed;
  }
  return StagingStatus::kOk;
}

void UcxStaging::send_reply(uint64_t job_id, StagingMessage type, StagingStatus status, const void* data,
                            uint64_t bytes) {
  TargetJob& job = target_jobs_.at(job_id);
  job.reply.type = static_cast<uint32_t>(type);
  job.reply.token = job.arrival.header.token;
  job.reply.region_id = job.arrival.header.region_id;
  job.reply.status = static_cast<uint32_t>(status);
  job.reply.data_bytes = bytes;
  send(job.arrival.reply_ep, &job.reply, data, bytes, 0, OpKind::kTargetSend, job_id);
}

void UcxStaging::handle_done(const OpDone& done) {
  switch (done.kind) {
    case OpKind::kInitiatorSend: {
      auto it = chunks_.find(done.id);
      if (it == chunks_.end()) return;
      it->second.send_in_flight = false;
      if (done.status != UCS_OK) {
        fail_batch(*it->second.batch, fmt::format("staged send to '{}' failed: {}", it->second.batch->peer->name,
                                                  ucs_status_string(done.status)));
      }
      try_retire_chunk(done.id);
      return;
    }
    case OpKind::kInitiatorRecv: {
      auto it = chunks_.find(done.id);
      if (it == chunks_.end()) return;
      Chunk& chunk = it->second;
      Batch& batch = *chunk.batch;
      chunk.recv_in_flight = false;
      chunk.reply_pending = false;
      if (done.status != UCS_OK) {
        fail_batch(batch, fmt::format("staged read data from '{}' failed: {}", batch.peer->name,
                                      ucs_status_string(done.status)));
      } else if (batch.failure.empty()) {
        std::vector<StagingPiece> local;
        uint64_t packed = 0;
        for (const Op& piece : batch.chunks[chunk.index].pieces) {
          local.push_back({piece.local_offset, packed, piece.bytes});
          packed += piece.bytes;
        }
        Status copied =
            copier_for(batch.local).to_region(batch.local.device_ordinal, batch.local.ptr, chunk.slot, local);
        if (!copied.ok()) fail_batch(batch, "copying a chunk into the local region: " + copied.to_string());
      }
      try_retire_chunk(done.id);
      return;
    }
    case OpKind::kTargetRecv: {
      auto it = target_jobs_.find(done.id);
      if (it == target_jobs_.end()) return;
      TargetJob& job = it->second;
      // A failed receive leaves the sender's request failed too: no ack to send.
      if (done.status != UCS_OK) {
        free_target_slots_.push_back(job.slot);
        target_jobs_.erase(it);
        return;
      }
      StagingStatus status = apply_write(job.arrival.header, job.slot, job.arrival.length);
      free_target_slots_.push_back(job.slot);
      job.slot = nullptr;
      send_reply(done.id, StagingMessage::kAck, status, nullptr, 0);
      return;
    }
    case OpKind::kTargetSend: {
      auto it = target_jobs_.find(done.id);
      if (it == target_jobs_.end()) return;
      if (it->second.slot != nullptr) free_target_slots_.push_back(it->second.slot);
      target_jobs_.erase(it);
      return;
    }
  }
}

void UcxStaging::fail_batch(Batch& batch, const std::string& why) {
  if (!batch.failure.empty()) return;
  batch.failure = why;
  // Chunks with no UCX operation in flight are dropped now (a late reply finds no
  // token); the others when their operation completes.
  std::vector<uint64_t> tokens;
  for (const auto& [token, chunk] : chunks_) {
    if (chunk.batch.get() == &batch) tokens.push_back(token);
  }
  for (uint64_t token : tokens) try_retire_chunk(token);
}

void UcxStaging::try_retire_chunk(uint64_t token) {
  auto it = chunks_.find(token);
  if (it == chunks_.end()) return;
  Chunk& chunk = it->second;
  if (chunk.send_in_flight || chunk.recv_in_flight) return;  // UCX still uses the slot
  if (chunk.reply_pending && chunk.batch->failure.empty()) return;
  free_initiator_slots_.push_back(chunk.slot);
  --chunk.batch->num_live;
  ++chunk.batch->num_finished;
  chunks_.erase(it);
}

void UcxStaging::finish_batches() {
  std::erase_if(active_, [](const std::shared_ptr<Batch>& batch) {
    if (batch->num_live > 0) return false;
    if (!batch->failure.empty()) {
      batch->completion->fail(batch->failure);
      return true;
    }
    if (batch->num_finished < batch->chunks.size()) return false;
    batch->completion->finish(UCS_OK);
    return true;
  });
}

void UcxStaging::shutdown(Deadline deadline) {
  take_posted();
  for (const auto& batch : active_) fail_batch(*batch, "engine shutting down");
  runnable_.clear();
  for (uint64_t job : jobs_waiting_for_slot_) {
    auto it = target_jobs_.find(job);
    if (it == target_jobs_.end()) continue;
    release_arrival(it->second.arrival);
    target_jobs_.erase(it);
  }
  jobs_waiting_for_slot_.clear();
  while (true) {
    progress();
    if (num_ops_in_flight_ == 0 || deadline.expired()) break;
    ucp_worker_progress(worker_);
  }
  // Whatever is left (a peer that never completed) is abandoned: fail its batches so
  // that no waiter hangs. Slots stay allocated until the destructor.
  for (const auto& batch : active_)
    batch->completion->fail(batch->failure.empty() ? "engine shut down" : batch->failure);
  active_.clear();
  std::lock_guard lock(events_mutex_);
  for (Arrival& arrival : arrivals_) release_arrival(arrival);
  arrivals_.clear();
}

}  // namespace pd::xfer
