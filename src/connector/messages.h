// Control-plane messages between connectors (DESIGN.md §3.3).
//
// One ZMQ frame = one msgpack map {"v": kProtocolVersion, "type": ..., "instance_id": ...,
// "boot_nonce": ..., <type fields>}. Decoding is strict: unknown versions, unknown
// types, unknown or missing keys, wrong types, out-of-range sizes and ids are all
// refused with a message naming the field. Callers count and drop refused frames.
//
//   meta / meta_ok  handshake: engine descriptor, memory descriptors (one per rank per
//                   layer), KV layout fingerprint with the TP size and head map,
//                   number of blocks (bounds for block ids)
//   blocks          consumer -> producer (WRITE): destination block ids of a transfer
//   read            consumer -> producer (READ): the producer block ids it will read;
//                   the producer checks they are the ones it holds for that transfer
//   read_ok         producer -> consumer (READ): ids confirmed, hold extended
//                   (+ the first output token when the consumer asked for it)
//   done            producer -> consumer (WRITE): all writes completed (ok) or failed
//                   (+ the first output token when the consumer asked for it)
//   abort           either way: the transfer is cancelled
//   release         consumer -> producer (READ): reads finished, free the blocks
//   error           either way: a refusal (layout mismatch, unknown transfer, ...)
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "connector/transfer_plan.h"
#include "contract/transfer_params.h"

namespace pd::connector {

// 2: kv_tokens in blocks/read, first_token + sampling_key in done/read_ok
// (first-token hand-over).
inline constexpr uint32_t kProtocolVersion = 2;
inline constexpr size_t kMaxFrameBytes = 8u << 20;
inline constexpr size_t kMaxInstanceIdBytes = contract::kMaxInstanceIdBytes;
inline constexpr size_t kMaxBlocksPerTransfer = 1u << 20;
inline constexpr size_t kMaxLayers = 1024;
// meta / meta_ok carry one region per rank per layer.
inline constexpr size_t kMaxLayerDescs = kMaxLayers * kMaxTpSize;
inline constexpr size_t kMaxDescriptorBytes = 64u << 10;
inline constexpr size_t kMaxTextBytes = 1024;

enum class MessageType : uint8_t { kMeta, kMetaOk, kBlocks, kRead, kReadOk, kDone, kAbort, kRelease, kError };
const char* message_type_name(MessageType type);

// An instance's KV layout. num_layers, num_kv_heads (the model's), head_dim,
// dtype and block_size must match between producer and consumer for KV bytes to
// mean the same thing; tp_size and the head map may differ (transfer_plan.h maps
// one onto the other).
struct KvFingerprint {
  int32_t num_layers = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  std::string dtype;  // engine::kv_dtype_name: "float32" | "bfloat16" | "float16" | "fp8_e4m3"
  int32_t block_size = 0;
  int32_t tp_size = 1;
  // Per rank, the KV heads it holds (tp_size entries). Empty: one rank holding
  // every head (what a peer without tensor parallelism sends; "head_map" is then
  // left out of the frame, so such frames are those of builds before it).
  std::vector<RankHeads> head_map;
  bool operator==(const KvFingerprint&) const = default;
  // head_map, or the one rank holding every head when it is empty.
  std::vector<RankHeads> ranks() const;
};
// Ok when the model-defined fields are equal and the remote head map is valid
// (tp_size entries covering every head); else kFailedPrecondition naming every
// field that differs (local vs remote) or what is wrong with the head map.
Status check_layout_compatible(const KvFingerprint& local, const KvFingerprint& remote);

// True for exactly 32 hex digits (the router's transfer ids; contract::is_transfer_id).
inline bool is_valid_transfer_id(std::string_view id) {
  return contract::is_transfer_id(id);
}

// One decoded message. Fields not used by `type` stay default.
struct ControlMessage {
  MessageType type = MessageType::kError;
  std::string instance_id;  // sender
  uint64_t boot_nonce = 0;  // sender
  int32_t tp_rank = 0;
  // meta, meta_ok
  std::vector<uint8_t> engine_desc;  // xfer::encode(EngineDesc)
  // xfer::encode(MemDesc): rank r's region of layer l at r * num_layers + l.
  std::vector<std::vector<uint8_t>> layer_descs;
  KvFingerprint fingerprint;
  int32_t num_blocks = 0;
  // blocks, read, read_ok, done, abort, release, error (error: may be empty)
  std::string transfer_id;
  std::vector<int32_t> block_ids;  // blocks, read
  int32_t num_skip_blocks = 0;     // blocks: leading prompt blocks the consumer already has
  int32_t num_tokens = 0;          // blocks, read, done: the prompt's length
  // blocks, read: prompt tokens whose KV the consumer takes: num_tokens - 1
  // (it computes the last one), or num_tokens to ask for the first-token
  // hand-over.
  int32_t kv_tokens = 0;
  bool ok = false;  // done
  // done (ok), read_ok: the producer's first output token for a consumer that
  // asked for it, with the first_token_sampling_key of the producer's request.
  std::optional<int32_t> first_token;
  uint64_t sampling_key = 0;
  std::string text;  // abort reason, done/error message
  // error: true when the refused message carried request parameters that are
  // wrong in themselves (block ids not of that transfer, a different prompt
  // length, a READ of a WRITE transfer), not merely stale or busy. The consumer
  // then fails that request as the client's error instead of recomputing.
  bool invalid_params = false;
};

std::vector<uint8_t> encode_message(const ControlMessage& message);
// Refuses anything malformed (kInvalidArgument with the field named).
Result<ControlMessage> decode_message(std::span<const uint8_t> frame);

}  // namespace pd::connector
