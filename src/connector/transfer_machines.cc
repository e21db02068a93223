#include "connector/transfer_machines.h"

#include <algorithm>
#include <unordered_set>
#include <utility>

#include "connector/transfer_params.h"

namespace pd::connector {

// ============================================================================
// Producer
// ============================================================================

Status ProducerTransfers::start(const std::string& transfer_id, const std::string& request_id, bool read_mode,
                                int32_t num_prompt_tokens, int64_t now_ms) {
  if (auto existing = transfers_.find(transfer_id); existing != transfers_.end()) {
    // The scheduler may ask again for a request it could not admit yet.
    if (existing->second.request_id == request_id) return Status::Ok();
    return failed_precondition("transfer {} is already active on this producer", transfer_id);
  }
  Transfer& t = transfers_[transfer_id];
  t.request_id = request_id;
  t.read_mode = read_mode;
  t.num_prompt_tokens = num_prompt_tokens;
  t.layer_ready.assign(static_cast<size_t>(num_layers_), false);
  t.layer_posted.assign(static_cast<size_t>(num_layers_), false);
  if (closed_set_.count(transfer_id)) {
    // The consumer gave up on this transfer before our leg arrived: compute, but hold nothing.
    t.failed = true;
    t.failure = "transfer aborted by the consumer before the request arrived";
    ++actions_.num_failed;
    return Status::Ok();
  }
  auto early = early_blocks_.find(transfer_id);
  if (early != early_blocks_.end()) {
    EarlyBlocks buffered = std::move(early->second);
    erase_early(early);
    on_blocks(buffered.from, buffered.msg, buffered.peer_num_blocks, now_ms, buffered.pieces_per_layer);
  }
  return Status::Ok();
}

ProducerTransfers::EarlyBlocksMap::iterator ProducerTransfers::erase_early(EarlyBlocksMap::iterator it) {
  early_block_ids_ -= it->second.num_ids;
  return early_blocks_.erase(it);
}

void ProducerTransfers::send(const PeerRef& to, MessageType type, const std::string& transfer_id, std::string text,
                             bool ok, int32_t num_tokens) {
  OutgoingMessage out;
  out.to = to.key;
  out.message.type = type;
  out.message.transfer_id = transfer_id;
  out.message.text = std::move(text);
  out.message.ok = ok;
  out.message.num_tokens = num_tokens;
  actions_.sends.push_back(std::move(out));
}

Status ProducerTransfers::attach_destination(Transfer& t, const std::string& transfer_id, const PeerRef& from,
                                             const ControlMessage& msg, int32_t peer_num_blocks,
                                             int32_t pieces_per_layer) {
  if (msg.num_tokens != t.num_prompt_tokens) {
    return invalid_argument("transfer {}: blocks for {} tokens, the prompt has {}", transfer_id, msg.num_tokens,
                            t.num_prompt_tokens);
  }
  // The consumer takes the KV of n - 1 tokens (it computes the last one) or of
  // all n (first-token hand-over).
  if (msg.kv_tokens != t.num_prompt_tokens && msg.kv_tokens != t.num_prompt_tokens - 1) {
    return invalid_argument("transfer {}: KV asked for {} tokens of a {}-token prompt", transfer_id, msg.kv_tokens,
                            t.num_prompt_tokens);
  }
  const int32_t needed = blocks_for_tokens(msg.kv_tokens, block_size_);
  if (msg.num_skip_blocks > needed ||
      static_cast<int64_t>(msg.block_ids.size()) != static_cast<int64_t>(needed) - msg.num_skip_blocks) {
    return invalid_argument("transfer {}: {} destination blocks after skipping {}, expected {}", transfer_id,
                            msg.block_ids.size(), msg.num_skip_blocks, needed - std::min(needed, msg.num_skip_blocks));
  }
  std::unordered_set<int32_t> seen;
  for (int32_t id : msg.block_ids) {
    if (id < 0 || id >= peer_num_blocks) {
      return out_of_range("transfer {}: destination block {} outside the consumer's {} blocks", transfer_id, id,
                          peer_num_blocks);
    }
    if (!seen.insert(id).second) return invalid_argument("transfer {}: destination block {} repeated", transfer_id, id);
  }
  t.dest = Destination{from, msg.block_ids, msg.num_skip_blocks, msg.kv_tokens, std::max(1, pieces_per_layer)};
  return Status::Ok();
}

void ProducerTransfers::on_blocks(const PeerRef& from, const ControlMessage& msg, int32_t peer_num_blocks,
                                  int64_t now_ms, int32_t pieces_per_layer) {
  auto it = transfers_.find(msg.transfer_id);
  if (it == transfers_.end() && closed_set_.count(msg.transfer_id)) {
    send(from, MessageType::kAbort, msg.transfer_id, "transfer already ended on the producer");
    return;
  }
  if (it == transfers_.end()) {
    // The consumer's leg can beat ours: keep the ids until our request arrives. No list can
    // name more blocks than the consumer's pool holds; the total held is bounded too.
    if (early_blocks_.count(msg.transfer_id) || early_blocks_.size() >= kMaxEarlyBlocks ||
        msg.block_ids.size() > static_cast<size_t>(std::max(peer_num_blocks, 0)) ||
        early_block_ids_ + msg.block_ids.size() > kMaxEarlyBlockIds) {
      ++actions_.num_refused;
      send(from, MessageType::kAbort, msg.transfer_id, "duplicate, oversized or too many unclaimed block lists");
      return;
    }
    early_block_ids_ += msg.block_ids.size();
    early_blocks_[msg.transfer_id] = EarlyBlocks{
        from, msg, peer_num_blocks, now_ms + timeouts_.defer_timeout_ms, msg.block_ids.size(), pieces_per_layer};
    return;
  }
  Transfer& t = it->second;
  if (t.read_mode || t.dest) {
    // Not ours to change: a second list (or one for a READ transfer) is refused, the
    // transfer keeps its first destination.
    ++actions_.num_refused;
    send(from, MessageType::kError, msg.transfer_id,
         t.read_mode ? "blocks sent for a READ transfer" : "destination blocks already received");
    return;
  }
  if (t.failed) {
    send(from, MessageType::kAbort, msg.transfer_id, "transfer already failed on the producer");
    return;
  }
  Status status = attach_destination(t, msg.transfer_id, from, msg, peer_num_blocks, pieces_per_layer);
  if (!status.ok()) {
    ++actions_.num_refused;
    t.failed = true;
    ++actions_.num_failed;
    send(from, MessageType::kAbort, msg.transfer_id, status.message());
    maybe_finish(msg.transfer_id);
    return;
  }
  post_ready_layers(msg.transfer_id, t);
  maybe_finish(msg.transfer_id);
}

void ProducerTransfers::post_ready_layers(const std::string& transfer_id, Transfer& t) {
  if (!t.dest || t.failed) return;
  for (int32_t layer = 0; layer < num_layers_; ++layer) {
    if (!t.layer_ready[layer] || t.layer_posted[layer]) continue;
    t.layer_posted[layer] = true;
    if (t.dest->block_ids.empty()) continue;  // the consumer had every block already
    for (int32_t piece = 0; piece < t.dest->pieces_per_layer; ++piece) {
      ++t.num_in_flight;
      actions_.writes.push_back({transfer_id, layer, piece});
    }
  }
}

void ProducerTransfers::begin_final_step(const std::string& transfer_id, std::vector<int32_t> local_block_ids) {
  auto it = transfers_.find(transfer_id);
  if (it != transfers_.end()) it->second.local_block_ids = std::move(local_block_ids);
}

void ProducerTransfers::on_layer_saved(const std::string& transfer_id, int32_t layer) {
  auto it = transfers_.find(transfer_id);
  if (it == transfers_.end() || layer < 0 || layer >= num_layers_) return;
  it->second.layer_ready[layer] = true;
  post_ready_layers(transfer_id, it->second);
}

void ProducerTransfers::on_forward_done(const std::string& transfer_id, bool ok) {
  auto it = transfers_.find(transfer_id);
  if (it == transfers_.end()) return;
  Transfer& t = it->second;
  if (!ok) {
    fail(transfer_id, t, "forward pass failed");
    return;
  }
  // Sealed: every layer's KV exists now, so the expected write count is num_layers.
  t.phase = Phase::kKvReady;
  std::fill(t.layer_ready.begin(), t.layer_ready.end(), true);
  post_ready_layers(transfer_id, t);
  maybe_finish(transfer_id);
}

bool ProducerTransfers::request_finished(const std::string& transfer_id, const std::vector<int32_t>& block_ids,
                                         bool kv_complete, int64_t now_ms) {
  auto it = transfers_.find(transfer_id);
  if (it == transfers_.end()) return false;
  it->second.finished = true;
  if (it->second.local_block_ids.empty()) it->second.local_block_ids = block_ids;
  if (!kv_complete || it->second.phase != Phase::kKvReady) {
    fail(transfer_id, it->second, "request finished before its KV was computed");
    it = transfers_.find(transfer_id);
    if (it == transfers_.end()) return false;
  }
  Transfer& t = it->second;
  if (t.failed || t.done_sent) {
    if (t.num_in_flight > 0) {
      t.holding = true;  // released when the last in-flight write ends
      return true;
    }
    remember_closed(transfer_id);
    transfers_.erase(it);
    return false;
  }
  t.holding = true;
  t.deadline_ms = now_ms + (t.read_mode ? timeouts_.transfer_timeout_ms : timeouts_.defer_timeout_ms);
  maybe_finish(transfer_id);
  return true;
}

void ProducerTransfers::on_write_done(const std::string& transfer_id, int32_t layer, bool ok, int32_t piece) {
  auto it = transfers_.find(transfer_id);
  if (it == transfers_.end()) return;
  Transfer& t = it->second;
  if (t.num_in_flight > 0) --t.num_in_flight;
  if (!ok)
    fail(transfer_id, t, fmt::format("write of layer {} (plan piece {}) failed", layer, piece));
  else
    maybe_finish(transfer_id);
}

void ProducerTransfers::fail(const std::string& transfer_id, Transfer& t, const std::string& reason) {
  if (!t.failed) {
    t.failed = true;
    t.failure = reason;
    ++actions_.num_failed;
    if (t.done_offered_early && !t.done_sent) actions_.withdrawn_early_dones.push_back(transfer_id);
  }
  maybe_finish(transfer_id);
}

void ProducerTransfers::maybe_finish(const std::string& transfer_id) {
  auto it = transfers_.find(transfer_id);
  if (it == transfers_.end()) return;
  Transfer& t = it->second;
  if (t.num_in_flight > 0) {  // the one release path waits for in-flight writes
    if (t.failed || t.done_offered_early) return;
    if (auto done = settled_done(transfer_id, t)) {
      actions_.early_dones.push_back(std::move(*done));
      t.done_offered_early = true;
    }
    return;
  }
  if (t.failed) {
    // "done" (ok or not) promises no more writes, which is why it waits for in-flight ones.
    if (t.dest && !t.done_sent && !t.peer_gone) {
      send(t.dest->peer, MessageType::kDone, transfer_id, t.failure, /*ok=*/false, t.num_prompt_tokens);
      t.done_sent = true;
    }
    if (t.holding) actions_.released_request_ids.push_back(t.request_id);
    if (t.holding || t.finished) {
      remember_closed(transfer_id);
      transfers_.erase(it);
    }
    return;
  }
  if (t.read_mode) return;  // READ ends on release or timeout
  if (auto done = settled_done(transfer_id, t)) {
    actions_.sends.push_back(std::move(*done));
    t.done_sent = true;
    ++actions_.num_completed;
  }
  if (t.done_sent && (t.holding || t.finished)) {
    if (t.holding) actions_.released_request_ids.push_back(t.request_id);
    remember_closed(transfer_id);
    transfers_.erase(it);
  }
}

std::optional<OutgoingMessage> ProducerTransfers::settled_done(const std::string& transfer_id,
                                                               const Transfer& t) const {
  if (t.read_mode || t.failed || t.done_sent || !t.dest || t.phase != Phase::kKvReady) return std::nullopt;
  if (!std::all_of(t.layer_posted.begin(), t.layer_posted.end(), [](bool b) { return b; })) return std::nullopt;
  // A consumer that took the whole prompt waits for the first token with done;
  // it is sampled in the step that sealed the KV, so this waits microseconds.
  const bool wants_token = t.dest->kv_tokens == t.num_prompt_tokens;
  if (wants_token && !t.first_token && !t.finished) return std::nullopt;
  OutgoingMessage out;
  out.to = t.dest->peer.key;
  out.message.type = MessageType::kDone;
  out.message.transfer_id = transfer_id;
  out.message.ok = true;
  out.message.num_tokens = t.num_prompt_tokens;
  if (wants_token && t.first_token) {
    out.message.first_token = t.first_token;
    out.message.sampling_key = t.sampling_key;
  }
  return out;
}

void ProducerTransfers::on_done_sent_early(const std::string& transfer_id) {
  auto it = transfers_.find(transfer_id);
  if (it == transfers_.end() || !it->second.done_offered_early || it->second.done_sent) return;
  it->second.done_sent = true;  // a done went out: the failure path sends no second one
  if (it->second.failed) {      // it failed after the offer, before the withdrawal reached the adapter
    maybe_finish(transfer_id);
    return;
  }
  ++actions_.num_completed;
  maybe_finish(transfer_id);
}

void ProducerTransfers::remember_closed(const std::string& transfer_id) {
  if (closed_set_.insert(transfer_id).second) closed_order_.push_back(transfer_id);
  while (closed_order_.size() > kMaxEarlyBlocks) {
    closed_set_.erase(closed_order_.front());
    closed_order_.pop_front();
  }
}

void ProducerTransfers::on_read(const PeerRef& from, const ControlMessage& msg, int64_t now_ms) {
  auto it = transfers_.find(msg.transfer_id);
  std::string refusal;
  bool invalid_params = true;  // unless the refusal is about state, not about the parameters
  if (it == transfers_.end()) {
    refusal = "unknown transfer (expired or never started)";
    invalid_params = false;
  } else if (!it->second.read_mode)
    refusal = "read for a WRITE transfer";
  else if (!it->second.holding || it->second.failed) {
    refusal = "transfer has no KV held";
    invalid_params = false;
  } else if (it->second.reader && !(*it->second.reader == from)) {
    refusal = "transfer is being read by another peer";
    invalid_params = false;
  } else if (msg.num_tokens != it->second.num_prompt_tokens)
    refusal = "num_tokens does not match the transfer";
  else if (msg.kv_tokens != msg.num_tokens && msg.kv_tokens != msg.num_tokens - 1)
    refusal = "kv_tokens is neither the prompt nor the prompt less its last token";
  else {
    const auto& held = it->second.local_block_ids;
    std::unordered_set<int32_t> seen;
    for (int32_t id : msg.block_ids) {
      if (std::find(held.begin(), held.end(), id) == held.end() || !seen.insert(id).second) {
        refusal = fmt::format("block {} does not belong to transfer {}", id, msg.transfer_id);
        break;
      }
    }
  }
  if (!refusal.empty()) {
    ++actions_.num_refused;
    OutgoingMessage out;
    out.to = from.key;
    out.message.type = MessageType::kError;
    out.message.transfer_id = msg.transfer_id;
    out.message.text = refusal;
    out.message.invalid_params = invalid_params;
    actions_.sends.push_back(std::move(out));
    return;
  }
  Transfer& t = it->second;
  t.reader = from;
  t.deadline_ms = now_ms + timeouts_.transfer_timeout_ms;
  OutgoingMessage out;
  out.to = from.key;
  out.message.type = MessageType::kReadOk;
  out.message.transfer_id = msg.transfer_id;
  if (msg.kv_tokens == t.num_prompt_tokens && t.first_token) {
    out.message.first_token = t.first_token;
    out.message.sampling_key = t.sampling_key;
  }
  actions_.sends.push_back(std::move(out));
}

void ProducerTransfers::first_token_sampled(const std::string& transfer_id, int32_t token_id, uint64_t sampling_key) {
  auto it = transfers_.find(transfer_id);
  if (it == transfers_.end() || it->second.first_token) return;
  it->second.first_token = token_id;
  it->second.sampling_key = sampling_key;
  maybe_finish(transfer_id);
}

void ProducerTransfers::on_release(const PeerRef& from, const ControlMessage& msg) {
  auto it = transfers_.find(msg.transfer_id);
  if (it == transfers_.end() || !it->second.read_mode || !it->second.holding ||
      (it->second.reader && !(*it->second.reader == from))) {
    if (!closed_set_.count(msg.transfer_id)) ++actions_.num_refused;
    return;
  }
  actions_.released_request_ids.push_back(it->second.request_id);
  ++actions_.num_completed;
  remember_closed(msg.transfer_id);
  transfers_.erase(it);
}

void ProducerTransfers::on_abort(const PeerRef& from, const ControlMessage& msg) {
  auto early = early_blocks_.find(msg.transfer_id);
  if (early != early_blocks_.end() && !(early->second.from == from)) {
    ++actions_.num_refused;
    return;
  }
  auto it = transfers_.find(msg.transfer_id);
  if (it != transfers_.end()) {
    const Transfer& t = it->second;
    const bool bound_elsewhere = t.read_mode ? t.reader && !(*t.reader == from) : t.dest && !(t.dest->peer == from);
    if (bound_elsewhere) {
      ++actions_.num_refused;
      return;
    }
  }
  abort_transfer(msg.transfer_id, "consumer aborted: " + msg.text);
}

bool ProducerTransfers::release(const std::string& transfer_id) {
  const bool active = early_blocks_.count(transfer_id) > 0 || transfers_.count(transfer_id) > 0;
  abort_transfer(transfer_id, "released by the router");
  return active;
}

void ProducerTransfers::abort_transfer(const std::string& transfer_id, const std::string& reason) {
  auto early = early_blocks_.find(transfer_id);
  if (early != early_blocks_.end()) {
    // Acknowledged, so the consumer can release the blocks it holds for us at once.
    send(early->second.from, MessageType::kAbort, transfer_id, "aborted before the producer saw the request");
    erase_early(early);
    remember_closed(transfer_id);
    return;
  }
  auto it = transfers_.find(transfer_id);
  if (it == transfers_.end()) {
    // Our leg has not arrived yet (legs race): remember, so it never holds blocks for nobody.
    remember_closed(transfer_id);
    return;
  }
  Transfer& t = it->second;
  if (t.read_mode && t.holding) {
    actions_.released_request_ids.push_back(t.request_id);
    remember_closed(transfer_id);
    transfers_.erase(it);
    return;
  }
  // WRITE: the done{ok:false} that follows (after in-flight writes) is the consumer's
  // acknowledgement that no more writes will land in its blocks.
  fail(transfer_id, t, reason);
}

void ProducerTransfers::on_peer_gone(const std::string& instance_id, uint64_t boot_nonce) {
  for (auto it = early_blocks_.begin(); it != early_blocks_.end();) {
    if (it->second.from.instance_id == instance_id && it->second.from.boot_nonce == boot_nonce)
      it = erase_early(it);
    else
      ++it;
  }
  std::vector<std::string> doomed;
  for (auto& [id, t] : transfers_) {
    if (t.dest && t.dest->peer.instance_id == instance_id && t.dest->peer.boot_nonce == boot_nonce)
      doomed.push_back(id);
  }
  for (const auto& id : doomed) {
    auto it = transfers_.find(id);
    if (it == transfers_.end()) continue;
    it->second.peer_gone = true;  // nobody to tell
    fail(id, it->second, "consumer instance restarted or gone");
  }
}

void ProducerTransfers::tick(int64_t now_ms) {
  for (auto it = early_blocks_.begin(); it != early_blocks_.end();) {
    if (now_ms >= it->second.deadline_ms) {
      ++actions_.num_timeouts;
      send(it->second.from, MessageType::kAbort, it->first, "the producer never received this transfer's request");
      remember_closed(it->first);
      it = erase_early(it);
    } else {
      ++it;
    }
  }
  std::vector<std::string> expired;
  for (auto& [id, t] : transfers_) {
    if (!t.holding || t.failed || now_ms < t.deadline_ms) continue;
    // WRITE: only while no destination arrived (writes in flight are bounded by xfer).
    if (t.read_mode || !t.dest) expired.push_back(id);
  }
  for (const auto& id : expired) {
    auto it = transfers_.find(id);
    ++actions_.num_timeouts;
    actions_.released_request_ids.push_back(it->second.request_id);
    remember_closed(id);
    transfers_.erase(it);
  }
}

ProducerActions ProducerTransfers::take_actions() {
  ProducerActions out = std::move(actions_);
  actions_ = ProducerActions{};
  return out;
}

const ProducerTransfers::Destination* ProducerTransfers::destination(const std::string& transfer_id) const {
  auto it = transfers_.find(transfer_id);
  return it == transfers_.end() || !it->second.dest ? nullptr : &*it->second.dest;
}

const std::vector<int32_t>* ProducerTransfers::local_blocks(const std::string& transfer_id) const {
  auto it = transfers_.find(transfer_id);
  return it == transfers_.end() ? nullptr : &it->second.local_block_ids;
}

size_t ProducerTransfers::num_blocks_held() const {
  size_t total = 0;
  for (const auto& [id, t] : transfers_) {
    if (t.holding) total += t.local_block_ids.size();
  }
  return total;
}

std::optional<std::string> ProducerTransfers::transfer_of_request(const std::string& request_id) const {
  for (const auto& [id, t] : transfers_) {
    if (t.request_id == request_id && !t.finished) return id;
  }
  return std::nullopt;
}

}  // namespace pd::connector

namespace pd::connector {

// ============================================================================
// Consumer
// ============================================================================

void ConsumerTransfers::send(const std::string& control, MessageType type, const std::string& transfer_id,
                             std::string text) {
  OutgoingMessage out;
  out.to = PeerKey::dialled(control);
  out.message.type = type;
  out.message.transfer_id = transfer_id;
  out.message.text = std::move(text);
  actions_.sends.push_back(std::move(out));
}

int32_t ConsumerTransfers::admit(const std::string& request_id, Params params, int32_t num_local_computed_tokens,
                                 int32_t num_prompt_tokens, int64_t now_ms) {
  const std::string transfer_id = params.transfer_id;
  // Without the hand-over the last prompt token is computed here. A prompt
  // cached here up to that token moves nothing either way.
  int32_t num_external = std::max(0, num_prompt_tokens - 1 - num_local_computed_tokens);
  if (num_external > 0 && params.want_first_token) ++num_external;
  if (auto existing = transfers_.find(transfer_id); existing != transfers_.end()) {
    // Asked again for a request the scheduler could not admit yet: same answer
    // for the (possibly larger) local prefix, until blocks are allocated.
    Transfer& t = existing->second;
    if (t.request_id != request_id || (t.phase != Phase::kAdmitted && t.phase != Phase::kNotifyOnly)) {
      ++actions_.num_refused;
      return -1;
    }
    if (t.phase == Phase::kNotifyOnly) return 0;
    t.num_skip_blocks = num_local_computed_tokens / block_size_;
    if (num_external == 0) {
      by_request_.erase(request_id);
      t.phase = Phase::kNotifyOnly;
      t.request_live = false;
      ensure_peer(transfer_id, t, now_ms);
    }
    return num_external;
  }
  if (by_request_.count(request_id)) {
    ++actions_.num_refused;
    return -1;
  }
  Transfer& t = transfers_[transfer_id];
  t.request_id = request_id;
  t.params = std::move(params);
  t.num_prompt_tokens = num_prompt_tokens;
  t.num_skip_blocks = num_local_computed_tokens / block_size_;
  if (num_external == 0) {
    // Everything is here already: tell the producer to let go, run as a normal request.
    t.phase = Phase::kNotifyOnly;
    t.request_live = false;
    ensure_peer(transfer_id, t, now_ms);
    return 0;
  }
  by_request_[request_id] = transfer_id;
  return num_external;
}

void ConsumerTransfers::allocated(const std::string& request_id, const std::vector<int32_t>& block_table,
                                  int32_t num_local_computed_tokens, int32_t num_external_tokens, int64_t now_ms) {
  auto r = by_request_.find(request_id);
  if (r == by_request_.end()) return;
  Transfer& t = transfers_.at(r->second);
  t.num_skip_blocks = num_local_computed_tokens / block_size_;
  t.kv_tokens = num_local_computed_tokens + num_external_tokens;
  const int32_t end = blocks_for_tokens(t.kv_tokens, block_size_);
  if (end > static_cast<int32_t>(block_table.size()) ||
      (t.params.read_mode && end > static_cast<int32_t>(t.params.remote_block_ids.size()))) {
    finish(r->second, t, false, "block table shorter than the external range");
    return;
  }
  t.local_block_ids.assign(block_table.begin() + t.num_skip_blocks, block_table.begin() + end);
  if (t.params.read_mode) {
    t.read_remote_ids.assign(t.params.remote_block_ids.begin() + t.num_skip_blocks,
                             t.params.remote_block_ids.begin() + end);
  }
  ensure_peer(r->second, t, now_ms);
}

void ConsumerTransfers::ensure_peer(const std::string& transfer_id, Transfer& t, int64_t now_ms) {
  if (t.phase != Phase::kNotifyOnly) t.phase = Phase::kAwaitingPeer;
  const std::string& control = t.params.remote_control;
  auto it = peers_.find(control);
  if (it != peers_.end() && it->second.phase == PeerPhase::kReady) {
    if (it->second.boot_nonce == t.params.remote_boot_nonce && it->second.instance_id == t.params.remote_instance_id) {
      proceed(transfer_id, t, it->second);
      return;
    }
    // The request names another incarnation than the one we know at that address. Either
    // the producer restarted, or the request is stale (router registration lag) or forged.
    // Ask the address again on the same connection: a restarted producer answers with its
    // new nonce (on_peer_ready then fails what was bound to the old one); the same
    // incarnation answers with its own, this request fails, and the transfers in flight on
    // that connection are untouched (dropping it would lose their `done`s on the producer).
    it->second.phase = PeerPhase::kHandshaking;
    it->second.deadline_ms = now_ms + timeouts_.handshake_timeout_ms;
    actions_.handshakes.push_back(control);
    return;
  } else if (it != peers_.end() && it->second.phase == PeerPhase::kHandshaking) {
    return;
  }
  Peer& peer = peers_[control];
  peer = Peer{};
  peer.phase = PeerPhase::kHandshaking;
  peer.deadline_ms = now_ms + timeouts_.handshake_timeout_ms;
  actions_.handshakes.push_back(control);
}

void ConsumerTransfers::proceed(const std::string& transfer_id, Transfer& t, const Peer& peer) {
  const int32_t needed = blocks_for_tokens(t.num_prompt_tokens - 1, block_size_);
  if (t.phase == Phase::kNotifyOnly) t.kv_tokens = std::max(0, t.num_prompt_tokens - 1);
  if (t.phase == Phase::kNotifyOnly) {
    if (t.params.read_mode) {
      send(t.params.remote_control, MessageType::kRelease, transfer_id);
    } else {
      OutgoingMessage out;
      out.to = PeerKey::dialled(t.params.remote_control);
      out.message.type = MessageType::kBlocks;
      out.message.transfer_id = transfer_id;
      out.message.num_tokens = t.num_prompt_tokens;
      out.message.kv_tokens = t.kv_tokens;
      out.message.num_skip_blocks = needed;
      actions_.sends.push_back(std::move(out));
    }
    transfers_.erase(transfer_id);
    return;
  }
  if (t.params.read_mode) {
    for (int32_t id : t.read_remote_ids) {
      if (id >= peer.num_blocks) {
        finish(transfer_id, t, false, fmt::format("producer block {} outside its {} blocks", id, peer.num_blocks));
        return;
      }
    }
    OutgoingMessage out;
    out.to = PeerKey::dialled(t.params.remote_control);
    out.message.type = MessageType::kRead;
    out.message.transfer_id = transfer_id;
    out.message.block_ids = t.read_remote_ids;
    out.message.num_tokens = t.num_prompt_tokens;
    out.message.kv_tokens = t.kv_tokens;
    actions_.sends.push_back(std::move(out));
    t.phase = Phase::kAwaitingReadOk;
    return;
  }
  OutgoingMessage out;
  out.to = PeerKey::dialled(t.params.remote_control);
  out.message.type = MessageType::kBlocks;
  out.message.transfer_id = transfer_id;
  out.message.block_ids = t.local_block_ids;
  out.message.num_skip_blocks = t.num_skip_blocks;
  out.message.num_tokens = t.num_prompt_tokens;
  out.message.kv_tokens = t.kv_tokens;
  actions_.sends.push_back(std::move(out));
  t.phase = Phase::kWaitingDone;
  t.data_may_move = true;
}

void ConsumerTransfers::on_peer_ready(const std::string& control, const std::string& instance_id, uint64_t boot_nonce,
                                      int32_t peer_num_blocks, int32_t pieces_per_layer) {
  Peer& peer = peers_[control];
  const std::string previous_instance = std::exchange(peer.instance_id, instance_id);
  const uint64_t previous_nonce = std::exchange(peer.boot_nonce, boot_nonce);
  peer.phase = PeerPhase::kReady;
  peer.num_blocks = peer_num_blocks;
  peer.pieces_per_layer = std::max(1, pieces_per_layer);
  if (previous_nonce != 0 && (previous_instance != instance_id || previous_nonce != boot_nonce)) {
    fail_orphans(control, previous_instance, previous_nonce,
                 fmt::format("producer at {} restarted (nonce {} -> {}) during the transfer", control, previous_nonce,
                             boot_nonce));
  }
  std::vector<std::string> waiting;
  for (auto& [id, t] : transfers_) {
    if (t.params.remote_control != control) continue;
    if (t.phase == Phase::kAwaitingPeer || t.phase == Phase::kNotifyOnly) waiting.push_back(id);
  }
  for (const auto& id : waiting) {
    auto it = transfers_.find(id);
    if (it == transfers_.end()) continue;
    Transfer& t = it->second;
    if (t.params.remote_instance_id != instance_id || t.params.remote_boot_nonce != boot_nonce) {
      const std::string reason =
          fmt::format("producer at {} is {} (nonce {}), the request names {} (nonce {})", control, instance_id,
                      boot_nonce, t.params.remote_instance_id, t.params.remote_boot_nonce);
      if (t.phase == Phase::kNotifyOnly)
        transfers_.erase(it);
      else
        finish(id, t, false, reason);
      continue;
    }
    proceed(id, t, peer);
  }
}

void ConsumerTransfers::fail_orphans(const std::string& control, const std::string& instance_id, uint64_t boot_nonce,
                                     const std::string& reason) {
  // Another process owns the address now: the old incarnation is gone and will neither
  // write nor answer, so its transfers recompute now instead of at their timeouts. (Reads
  // of our own in flight, kReading, end through their completions.)
  std::vector<std::string> orphaned;
  for (auto& [id, t] : transfers_) {
    if (t.params.remote_control == control && (t.phase == Phase::kWaitingDone || t.phase == Phase::kAwaitingReadOk) &&
        t.params.remote_instance_id == instance_id && t.params.remote_boot_nonce == boot_nonce) {
      orphaned.push_back(id);
    }
  }
  for (const auto& id : orphaned) {
    auto it = transfers_.find(id);
    finish(id, it->second, false, reason);
  }
}

void ConsumerTransfers::on_producer_identity(const std::string& control, const std::string& instance_id,
                                             uint64_t boot_nonce) {
  auto it = peers_.find(control);
  if (it == peers_.end() || it->second.phase != PeerPhase::kReady) return;
  if (it->second.instance_id == instance_id && it->second.boot_nonce == boot_nonce) return;
  const std::string previous_instance = it->second.instance_id;
  const uint64_t previous_nonce = it->second.boot_nonce;
  // The next request for this address handshakes again (ensure_peer on an unknown peer).
  peers_.erase(it);
  fail_orphans(control, previous_instance, previous_nonce,
               fmt::format("producer at {} restarted (now {} nonce {}, was nonce {}) during the transfer", control,
                           instance_id, boot_nonce, previous_nonce));
}

void ConsumerTransfers::on_peer_failed(const std::string& control, const std::string& reason) {
  Peer& peer = peers_[control];
  peer.phase = PeerPhase::kFailed;
  actions_.dropped_dealers.push_back(control);
  std::vector<std::string> waiting;
  for (auto& [id, t] : transfers_) {
    if (t.params.remote_control == control && (t.phase == Phase::kAwaitingPeer || t.phase == Phase::kNotifyOnly)) {
      waiting.push_back(id);
    }
  }
  for (const auto& id : waiting) {
    auto it = transfers_.find(id);
    if (it->second.phase == Phase::kNotifyOnly)
      transfers_.erase(it);
    else
      finish(id, it->second, false, "producer unreachable: " + reason);
  }
}

bool ConsumerTransfers::from_producer(const Transfer& t, const PeerRef& from) const {
  return from.key == PeerKey::dialled(t.params.remote_control) && from.instance_id == t.params.remote_instance_id &&
         from.boot_nonce == t.params.remote_boot_nonce;
}

void ConsumerTransfers::finish(const std::string& transfer_id, Transfer& t, bool ok, const std::string& reason,
                               bool invalid_params) {
  t.phase = Phase::kClosed;
  actions_.closed_transfer_ids.push_back(transfer_id);
  if (t.holding) {
    // The request is gone; this only ends the hold on its blocks.
    actions_.finished_recving.push_back(t.request_id);
  } else if (!t.silent && t.request_live) {
    actions_.finished_recving.push_back(t.request_id);
    if (ok) {
      ++actions_.num_completed;
      if (t.first_token) actions_.first_tokens.emplace_back(t.request_id, *t.first_token);
    } else {
      actions_.load_failures.push_back({t.request_id, t.local_block_ids, reason, invalid_params});
    }
  }
  auto r = by_request_.find(t.request_id);
  if (r != by_request_.end() && r->second == transfer_id) by_request_.erase(r);
  transfers_.erase(transfer_id);
}

void ConsumerTransfers::on_done(const PeerRef& from, const ControlMessage& msg) {
  auto it = transfers_.find(msg.transfer_id);
  if (it == transfers_.end() || it->second.params.read_mode || !from_producer(it->second, from) ||
      it->second.phase != Phase::kWaitingDone) {
    ++actions_.num_refused;
    return;
  }
  Transfer& t = it->second;
  if (msg.ok && msg.num_tokens != t.num_prompt_tokens) {
    finish(msg.transfer_id, t, false, "done for a different token count");
    return;
  }
  if (msg.ok) take_first_token(t, msg);
  finish(msg.transfer_id, t, msg.ok, msg.ok ? std::string() : "producer failed the transfer: " + msg.text);
}

void ConsumerTransfers::take_first_token(Transfer& t, const ControlMessage& msg) {
  if (!msg.first_token || t.kv_tokens != t.num_prompt_tokens || !t.params.want_first_token) return;
  if (msg.sampling_key != t.params.sampling_key) {
    // The producer's leg sampled under other parameters: compute it here.
    ++actions_.num_first_tokens_refused;
    return;
  }
  t.first_token = msg.first_token;
}

void ConsumerTransfers::on_read_ok(const PeerRef& from, const ControlMessage& msg) {
  auto it = transfers_.find(msg.transfer_id);
  if (it == transfers_.end() || !it->second.params.read_mode || !from_producer(it->second, from) ||
      it->second.phase != Phase::kAwaitingReadOk) {
    ++actions_.num_refused;
    return;
  }
  Transfer& t = it->second;
  take_first_token(t, msg);
  t.phase = Phase::kReading;
  t.data_may_move = true;
  // Every consumer rank pulls the heads it owns: one read per layer per plan piece.
  auto peer = peers_.find(t.params.remote_control);
  const int32_t pieces = peer == peers_.end() ? 1 : peer->second.pieces_per_layer;
  t.num_in_flight = num_layers_ * pieces;
  for (int32_t layer = 0; layer < num_layers_; ++layer) {
    for (int32_t piece = 0; piece < pieces; ++piece) actions_.reads.push_back({msg.transfer_id, layer, piece});
  }
}

void ConsumerTransfers::on_read_done(const std::string& transfer_id, int32_t layer, bool ok, int32_t piece) {
  auto it = transfers_.find(transfer_id);
  if (it == transfers_.end()) return;
  Transfer& t = it->second;
  if (t.num_in_flight > 0) --t.num_in_flight;
  if (!ok && !t.failed) {
    t.failed = true;
    t.failure = fmt::format("read of layer {} (plan piece {}) failed", layer, piece);
  }
  if (t.num_in_flight > 0) return;
  send(t.params.remote_control, MessageType::kRelease, transfer_id);
  finish(transfer_id, t, !t.failed, t.failure);
}

void ConsumerTransfers::on_abort_or_error(const PeerRef& from, const ControlMessage& msg) {
  if (msg.transfer_id.empty()) {
    // A refusal of our handshake (e.g. layout mismatch) from a producer we dialled.
    if (from.key.is_dialled()) {
      const std::string& control = from.key.name();
      auto peer = peers_.find(control);
      if (peer != peers_.end() && peer->second.phase == PeerPhase::kHandshaking) {
        on_peer_failed(control, msg.text);
        return;
      }
    }
    ++actions_.num_refused;
    return;
  }
  auto it = transfers_.find(msg.transfer_id);
  if (it == transfers_.end() || !from_producer(it->second, from)) {
    ++actions_.num_refused;
    return;
  }
  Transfer& t = it->second;
  if (t.phase == Phase::kReading) {
    // Our reads are still in flight into our blocks; they end the transfer.
    t.failed = true;
    t.failure = "producer aborted: " + msg.text;
    return;
  }
  // Only a refusal of our `read` can name the request's parameters invalid: the
  // ids and length came from the client (kv_transfer_params).
  const bool invalid_params =
      msg.type == MessageType::kError && msg.invalid_params && t.phase == Phase::kAwaitingReadOk;
  finish(msg.transfer_id, t, false,
         (invalid_params ? "producer refused kv_transfer_params: " : "producer aborted: ") + msg.text, invalid_params);
}

bool ConsumerTransfers::request_finished(const std::string& request_id, int64_t now_ms) {
  auto r = by_request_.find(request_id);
  if (r == by_request_.end()) return false;
  const std::string transfer_id = r->second;
  by_request_.erase(r);
  Transfer& t = transfers_.at(transfer_id);
  t.request_live = false;
  if (t.data_may_move) {
    // A write may still land (or our reads are in flight): keep the blocks until the
    // producer says it stopped, or transfer_timeout.
    if (!t.params.read_mode) send(t.params.remote_control, MessageType::kAbort, transfer_id, "request finished");
    t.holding = true;
    t.hold_deadline_ms = now_ms + timeouts_.transfer_timeout_ms;
    return true;
  }
  if (t.phase == Phase::kAwaitingReadOk || peer_ready(t.params.remote_control)) {
    send(t.params.remote_control, MessageType::kAbort, transfer_id, "request finished");
  }
  transfers_.erase(transfer_id);
  return false;
}

void ConsumerTransfers::on_remote_kv_timeout(const std::string& request_id) {
  auto r = by_request_.find(request_id);
  if (r == by_request_.end()) return;
  const std::string transfer_id = r->second;
  Transfer& t = transfers_.at(transfer_id);
  ++actions_.num_timeouts;
  t.silent = true;  // the engine handles the request; we only look after the blocks
  // WRITE: stop the producer's writes. READ before read_ok: let the producer's hold go.
  if ((!t.params.read_mode && (t.data_may_move || peer_ready(t.params.remote_control))) ||
      t.phase == Phase::kAwaitingReadOk) {
    send(t.params.remote_control, MessageType::kAbort, transfer_id, "consumer timed out waiting for the KV");
  }
  if (!t.data_may_move) {
    by_request_.erase(request_id);
    transfers_.erase(transfer_id);
  }
}

bool ConsumerTransfers::request_preempted(const std::string& request_id, int64_t now_ms) {
  auto r = by_request_.find(request_id);
  if (r == by_request_.end()) return false;
  const std::string transfer_id = r->second;
  Transfer& t = transfers_.at(transfer_id);
  if (!t.data_may_move) {
    // The request recomputes from scratch: let the producer go now, not at defer_timeout.
    if (peer_ready(t.params.remote_control) || t.phase == Phase::kAwaitingReadOk) {
      send(t.params.remote_control, MessageType::kAbort, transfer_id, "request preempted before its KV moved");
    }
    by_request_.erase(r);
    transfers_.erase(transfer_id);
    return false;
  }
  by_request_.erase(r);
  t.request_live = false;
  t.holding = true;
  t.hold_deadline_ms = now_ms + timeouts_.transfer_timeout_ms;
  if (!t.params.read_mode) send(t.params.remote_control, MessageType::kAbort, transfer_id, "request preempted");
  return true;
}

void ConsumerTransfers::tick(int64_t now_ms) {
  std::vector<std::string> failed_peers;
  for (auto& [control, peer] : peers_) {
    if (peer.phase == PeerPhase::kHandshaking && now_ms >= peer.deadline_ms) failed_peers.push_back(control);
  }
  for (const auto& control : failed_peers) {
    ++actions_.num_timeouts;
    on_peer_failed(control, fmt::format("handshake timed out after {} ms", timeouts_.handshake_timeout_ms));
  }
  std::vector<std::string> expired;
  for (auto& [id, t] : transfers_) {
    if (t.holding && now_ms >= t.hold_deadline_ms) expired.push_back(id);
  }
  for (const auto& id : expired) {
    ++actions_.num_timeouts;
    Transfer& t = transfers_.at(id);
    finish(id, t, false, "hold timed out");
  }
}

ConsumerActions ConsumerTransfers::take_actions() {
  ConsumerActions out = std::move(actions_);
  actions_ = ConsumerActions{};
  return out;
}

std::optional<ConsumerTransfers::TransferView> ConsumerTransfers::view(const std::string& transfer_id) const {
  auto it = transfers_.find(transfer_id);
  if (it == transfers_.end()) return std::nullopt;
  return TransferView{it->second.request_id, it->second.params.read_mode, it->second.params.remote_control,
                      it->second.local_block_ids, it->second.read_remote_ids};
}

bool ConsumerTransfers::peer_ready(const std::string& control) const {
  auto it = peers_.find(control);
  return it != peers_.end() && it->second.phase == PeerPhase::kReady;
}

std::optional<std::string> ConsumerTransfers::transfer_of_request(const std::string& request_id) const {
  auto it = by_request_.find(request_id);
  if (it == by_request_.end()) return std::nullopt;
  return it->second;
}

}  // namespace pd::connector
