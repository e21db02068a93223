#include "connector/messages.h"

#include <msgpack.hpp>

#include <set>

namespace pd::connector {
namespace {

using Packer = msgpack::packer<msgpack::sbuffer>;

void pack_str(Packer& pk, std::string_view text) {
  pk.pack_str(static_cast<uint32_t>(text.size()));
  pk.pack_str_body(text.data(), static_cast<uint32_t>(text.size()));
}

void pack_bin(Packer& pk, const std::vector<uint8_t>& bytes) {
  pk.pack_bin(static_cast<uint32_t>(bytes.size()));
  pk.pack_bin_body(reinterpret_cast<const char*>(bytes.data()), static_cast<uint32_t>(bytes.size()));
}

// Reads typed fields out of one msgpack map, remembering which keys were used so
// that unknown keys can be refused.
class MapReader {
 public:
  explicit MapReader(const msgpack::object_map& map) : map_(map) {}

  const msgpack::object* find(std::string_view key) {
    for (uint32_t i = 0; i < map_.size; ++i) {
      const auto& kv = map_.ptr[i];
      if (kv.key.type == msgpack::type::STR && std::string_view(kv.key.via.str.ptr, kv.key.via.str.size) == key) {
        used_.insert(std::string(key));
        return &kv.val;
      }
    }
    return nullptr;
  }

  Status str(std::string_view key, std::string* out, size_t max_bytes, bool required = true) {
    const auto* value = find(key);
    if (value == nullptr) return required ? invalid_argument("missing key '{}'", key) : Status::Ok();
    if (value->type != msgpack::type::STR) return invalid_argument("'{}' must be a string", key);
    if (value->via.str.size > max_bytes) return invalid_argument("'{}' longer than {} bytes", key, max_bytes);
    out->assign(value->via.str.ptr, value->via.str.size);
    return Status::Ok();
  }

  Status bin(std::string_view key, std::vector<uint8_t>* out, size_t max_bytes) {
    const auto* value = find(key);
    if (value == nullptr) return invalid_argument("missing key '{}'", key);
    return bin_value(key, *value, out, max_bytes);
  }

  static Status bin_value(std::string_view key, const msgpack::object& value, std::vector<uint8_t>* out,
                          size_t max_bytes) {
    if (value.type != msgpack::type::BIN) return invalid_argument("'{}' must be binary", key);
    if (value.via.bin.size == 0 || value.via.bin.size > max_bytes) {
      return invalid_argument("'{}' size {} outside [1, {}]", key, value.via.bin.size, max_bytes);
    }
    const auto* begin = reinterpret_cast<const uint8_t*>(value.via.bin.ptr);
    out->assign(begin, begin + value.via.bin.size);
    return Status::Ok();
  }

  Status u64(std::string_view key, uint64_t* out) {
    const auto* value = find(key);
    if (value == nullptr) return invalid_argument("missing key '{}'", key);
    if (value->type != msgpack::type::POSITIVE_INTEGER)
      return invalid_argument("'{}' must be an unsigned integer", key);
    *out = value->via.u64;
    return Status::Ok();
  }

  Status i32(std::string_view key, int32_t* out, int64_t min_value, int64_t max_value, bool required = true) {
    const auto* value = find(key);
    if (value == nullptr) return required ? invalid_argument("missing key '{}'", key) : Status::Ok();
    if (value->type != msgpack::type::POSITIVE_INTEGER)
      return invalid_argument("'{}' must be an unsigned integer", key);
    if (value->via.u64 < static_cast<uint64_t>(min_value) || value->via.u64 > static_cast<uint64_t>(max_value)) {
      return invalid_argument("'{}' = {} outside [{}, {}]", key, value->via.u64, min_value, max_value);
    }
    *out = static_cast<int32_t>(value->via.u64);
    return Status::Ok();
  }

  Status boolean(std::string_view key, bool* out) {
    const auto* value = find(key);
    if (value == nullptr) return invalid_argument("missing key '{}'", key);
    if (value->type != msgpack::type::BOOLEAN) return invalid_argument("'{}' must be a boolean", key);
    *out = value->via.boolean;
    return Status::Ok();
  }

  // Also refuses a key given twice: find() reads the first, and a frame that means two
  // things to two readers is malformed.
  Status no_unknown_keys() const {
    std::set<std::string_view> seen;
    for (uint32_t i = 0; i < map_.size; ++i) {
      const auto& key = map_.ptr[i].key;
      if (key.type != msgpack::type::STR)
        return invalid_argument("map key of type {} (expected string)", int(key.type));
      std::string name(key.via.str.ptr, key.via.str.size);
      if (!used_.count(name)) return invalid_argument("unknown key '{}'", name.substr(0, 64));
      if (!seen.insert(std::string_view(key.via.str.ptr, key.via.str.size)).second) {
        return invalid_argument("key '{}' given twice", name.substr(0, 64));
      }
    }
    return Status::Ok();
  }

 private:
  const msgpack::object_map& map_;
  std::set<std::string> used_;
};

bool parse_type(std::string_view name, MessageType* out) {
  static const std::pair<const char*, MessageType> kTypes[] = {
      {"meta", MessageType::kMeta},   {"meta_ok", MessageType::kMetaOk},  {"blocks", MessageType::kBlocks},
      {"read", MessageType::kRead},   {"read_ok", MessageType::kReadOk},  {"done", MessageType::kDone},
      {"abort", MessageType::kAbort}, {"release", MessageType::kRelease}, {"error", MessageType::kError}};
  for (const auto& [text, type] : kTypes) {
    if (name == text) {
      *out = type;
      return true;
    }
  }
  return false;
}

bool has_transfer_id(MessageType type) {
  return type != MessageType::kMeta && type != MessageType::kMetaOk;
}

// Optional pair: both keys or neither.
Status decode_first_token(MapReader& reader, ControlMessage& msg) {
  const bool has_token = reader.find("first_token") != nullptr;
  const bool has_key = reader.find("sampling_key") != nullptr;
  if (has_token != has_key) return invalid_argument("'first_token' and 'sampling_key' come together");
  if (!has_token) return Status::Ok();
  int32_t token = 0;
  PD_RETURN_IF_ERROR(reader.i32("first_token", &token, 0, INT32_MAX));
  PD_RETURN_IF_ERROR(reader.u64("sampling_key", &msg.sampling_key));
  msg.first_token = token;
  return Status::Ok();
}

// fingerprint.head_map: [begin_0, count_0, begin_1, count_1, ...], one pair per
// rank; required when tp_size > 1, optional (one rank, every head) at 1.
Status decode_head_map(MapReader& fpr, KvFingerprint& f) {
  const auto* map = fpr.find("head_map");
  if (map == nullptr) {
    if (f.tp_size > 1) return invalid_argument("fingerprint: 'head_map' is required when tp_size > 1");
    return Status::Ok();
  }
  if (map->type != msgpack::type::ARRAY || map->via.array.size != 2u * static_cast<uint32_t>(f.tp_size)) {
    return invalid_argument("fingerprint: 'head_map' must be an array of 2 x tp_size ({}) integers", 2 * f.tp_size);
  }
  for (uint32_t i = 0; i < map->via.array.size; i += 2) {
    const auto& begin = map->via.array.ptr[i];
    const auto& count = map->via.array.ptr[i + 1];
    if (begin.type != msgpack::type::POSITIVE_INTEGER || count.type != msgpack::type::POSITIVE_INTEGER ||
        begin.via.u64 > 4096 || count.via.u64 > 4096) {
      return invalid_argument("fingerprint: 'head_map[{}]' is not a (begin, count) pair of head numbers", i / 2);
    }
    f.head_map.push_back(RankHeads{static_cast<int32_t>(begin.via.u64), static_cast<int32_t>(count.via.u64)});
  }
  return validate_head_map(f.num_kv_heads, f.head_map).with_context("fingerprint");
}

Status decode_fields(MapReader& reader, ControlMessage& msg) {
  PD_RETURN_IF_ERROR(reader.str("instance_id", &msg.instance_id, kMaxInstanceIdBytes));
  if (msg.instance_id.empty()) return invalid_argument("'instance_id' is empty");
  PD_RETURN_IF_ERROR(reader.u64("boot_nonce", &msg.boot_nonce));
  PD_RETURN_IF_ERROR(reader.i32("tp_rank", &msg.tp_rank, 0, 1023));
  if (has_transfer_id(msg.type)) {
    // error may refer to no transfer (a refused handshake): empty allowed there only.
    PD_RETURN_IF_ERROR(reader.str("transfer_id", &msg.transfer_id, 32));
    if (!(msg.type == MessageType::kError && msg.transfer_id.empty()) && !is_valid_transfer_id(msg.transfer_id)) {
      return invalid_argument("'transfer_id' is not 32 hex digits");
    }
  }
  switch (msg.type) {
    case MessageType::kMeta:
    case MessageType::kMetaOk: {
      PD_RETURN_IF_ERROR(reader.bin("engine_desc", &msg.engine_desc, kMaxDescriptorBytes));
      const auto* layers = reader.find("layer_descs");
      if (layers == nullptr || layers->type != msgpack::type::ARRAY)
        return invalid_argument("'layer_descs' must be an array");
      if (layers->via.array.size == 0 || layers->via.array.size > kMaxLayerDescs) {
        return invalid_argument("'layer_descs' has {} entries, expected [1, {}]", layers->via.array.size,
                                kMaxLayerDescs);
      }
      for (uint32_t i = 0; i < layers->via.array.size; ++i) {
        std::vector<uint8_t> desc;
        PD_RETURN_IF_ERROR(MapReader::bin_value("layer_descs[]", layers->via.array.ptr[i], &desc, kMaxDescriptorBytes));
        msg.layer_descs.push_back(std::move(desc));
      }
      const auto* fp = reader.find("fingerprint");
      if (fp == nullptr || fp->type != msgpack::type::MAP) return invalid_argument("'fingerprint' must be a map");
      MapReader fpr(fp->via.map);
      auto& f = msg.fingerprint;
      PD_RETURN_IF_ERROR(fpr.i32("num_layers", &f.num_layers, 1, kMaxLayers));
      PD_RETURN_IF_ERROR(fpr.i32("num_kv_heads", &f.num_kv_heads, 1, 4096));
      PD_RETURN_IF_ERROR(fpr.i32("head_dim", &f.head_dim, 1, 4096));
      PD_RETURN_IF_ERROR(fpr.str("dtype", &f.dtype, 16));
      PD_RETURN_IF_ERROR(fpr.i32("block_size", &f.block_size, 1, 4096));
      PD_RETURN_IF_ERROR(fpr.i32("tp_size", &f.tp_size, 1, kMaxTpSize));
      PD_RETURN_IF_ERROR(decode_head_map(fpr, f));
      PD_RETURN_IF_ERROR(fpr.no_unknown_keys().with_context("fingerprint"));
      // One region per rank per layer, rank-major.
      if (static_cast<size_t>(f.num_layers) * static_cast<size_t>(f.tp_size) != msg.layer_descs.size()) {
        return invalid_argument("'layer_descs' has {} entries but fingerprint.num_layers x tp_size is {} x {}",
                                msg.layer_descs.size(), f.num_layers, f.tp_size);
      }
      PD_RETURN_IF_ERROR(reader.i32("num_blocks", &msg.num_blocks, 1, INT32_MAX));
      break;
    }
    case MessageType::kBlocks:
    case MessageType::kRead: {
      const auto* ids = reader.find("block_ids");
      if (ids == nullptr || ids->type != msgpack::type::ARRAY) return invalid_argument("'block_ids' must be an array");
      if (ids->via.array.size > kMaxBlocksPerTransfer) {
        return invalid_argument("'block_ids' has {} entries, limit {}", ids->via.array.size, kMaxBlocksPerTransfer);
      }
      msg.block_ids.reserve(ids->via.array.size);
      for (uint32_t i = 0; i < ids->via.array.size; ++i) {
        const auto& id = ids->via.array.ptr[i];
        if (id.type != msgpack::type::POSITIVE_INTEGER || id.via.u64 > static_cast<uint64_t>(INT32_MAX)) {
          return invalid_argument("'block_ids[{}]' is not a block id", i);
        }
        msg.block_ids.push_back(static_cast<int32_t>(id.via.u64));
      }
      PD_RETURN_IF_ERROR(reader.i32("num_tokens", &msg.num_tokens, 0, INT32_MAX));
      PD_RETURN_IF_ERROR(reader.i32("kv_tokens", &msg.kv_tokens, 0, INT32_MAX));
      if (msg.kv_tokens > msg.num_tokens) {
        return invalid_argument("'kv_tokens' = {} exceeds 'num_tokens' = {}", msg.kv_tokens, msg.num_tokens);
      }
      if (msg.type == MessageType::kBlocks) {
        PD_RETURN_IF_ERROR(reader.i32("num_skip_blocks", &msg.num_skip_blocks, 0, INT32_MAX));
      }
      break;
    }
    case MessageType::kDone:
      PD_RETURN_IF_ERROR(reader.boolean("ok", &msg.ok));
      PD_RETURN_IF_ERROR(reader.i32("num_tokens", &msg.num_tokens, 0, INT32_MAX));
      PD_RETURN_IF_ERROR(reader.str("text", &msg.text, kMaxTextBytes, /*required=*/false));
      PD_RETURN_IF_ERROR(decode_first_token(reader, msg));
      break;
    case MessageType::kAbort:
      PD_RETURN_IF_ERROR(reader.str("text", &msg.text, kMaxTextBytes, /*required=*/false));
      break;
    case MessageType::kError:
      PD_RETURN_IF_ERROR(reader.str("text", &msg.text, kMaxTextBytes, /*required=*/false));
      if (reader.find("invalid_params") != nullptr) {
        PD_RETURN_IF_ERROR(reader.boolean("invalid_params", &msg.invalid_params));
      }
      break;
    case MessageType::kReadOk:
      PD_RETURN_IF_ERROR(decode_first_token(reader, msg));
      break;
    case MessageType::kRelease:
      break;
  }
  return reader.no_unknown_keys();
}

}  // namespace

const char* message_type_name(MessageType type) {
  switch (type) {
    case MessageType::kMeta:
      return "meta";
    case MessageType::kMetaOk:
      return "meta_ok";
    case MessageType::kBlocks:
      return "blocks";
    case MessageType::kRead:
      return "read";
    case MessageType::kReadOk:
      return "read_ok";
    case MessageType::kDone:
      return "done";
    case MessageType::kAbort:
      return "abort";
    case MessageType::kRelease:
      return "release";
    case MessageType::kError:
      return "error";
  }
  return "?";
}

Status check_layout_compatible(const KvFingerprint& local, const KvFingerprint& remote) {
  std::string diffs;
  auto field = [&](const char* name, const auto& a, const auto& b) {
    if (a != b) diffs += fmt::format("{}{} {} here vs {} at the peer", diffs.empty() ? "" : "; ", name, a, b);
  };
  field("num_layers", local.num_layers, remote.num_layers);
  field("num_kv_heads", local.num_kv_heads, remote.num_kv_heads);
  field("head_dim", local.head_dim, remote.head_dim);
  field("dtype", local.dtype, remote.dtype);
  field("block_size", local.block_size, remote.block_size);
  if (!diffs.empty()) return failed_precondition("KV layout mismatch, refusing the peer: {}", diffs);
  // Tensor-parallel sizes may differ: the transfer plan maps the head maps onto each other.
  const std::vector<RankHeads> ranks = remote.ranks();
  if (ranks.size() != static_cast<size_t>(remote.tp_size)) {
    return failed_precondition("KV layout of the peer: head map of {} ranks for tp_size {}", ranks.size(),
                               remote.tp_size);
  }
  Status heads = validate_head_map(remote.num_kv_heads, ranks);
  if (!heads.ok()) return failed_precondition("KV layout of the peer: {}", heads.message());
  return Status::Ok();
}

std::vector<RankHeads> KvFingerprint::ranks() const {
  if (!head_map.empty()) return head_map;
  return {RankHeads{0, num_kv_heads}};
}

namespace {

void pack_first_token(Packer& pk, const ControlMessage& msg) {
  if (!msg.first_token) return;
  pack_str(pk, "first_token");
  pk.pack(static_cast<uint32_t>(*msg.first_token));
  pack_str(pk, "sampling_key");
  pk.pack(msg.sampling_key);
}

}  // namespace

std::vector<uint8_t> encode_message(const ControlMessage& msg) {
  msgpack::sbuffer buffer;
  Packer pk(buffer);
  size_t num_fields = 5;  // v, type, instance_id, boot_nonce, tp_rank
  if (has_transfer_id(msg.type)) ++num_fields;
  switch (msg.type) {
    case MessageType::kMeta:
    case MessageType::kMetaOk:
      num_fields += 4;
      break;
    case MessageType::kBlocks:
      num_fields += 4;
      break;
    case MessageType::kRead:
      num_fields += 3;
      break;
    case MessageType::kDone:
      num_fields += 3 + (msg.first_token ? 2 : 0);
      break;
    case MessageType::kAbort:
      num_fields += 1;
      break;
    case MessageType::kError:
      num_fields += 1 + (msg.invalid_params ? 1 : 0);
      break;
    case MessageType::kReadOk:
      num_fields += msg.first_token ? 2 : 0;
      break;
    case MessageType::kRelease:
      break;
  }
  pk.pack_map(static_cast<uint32_t>(num_fields));
  pack_str(pk, "v");
  pk.pack(kProtocolVersion);
  pack_str(pk, "type");
  pack_str(pk, message_type_name(msg.type));
  pack_str(pk, "instance_id");
  pack_str(pk, msg.instance_id);
  pack_str(pk, "boot_nonce");
  pk.pack(msg.boot_nonce);
  pack_str(pk, "tp_rank");
  pk.pack(static_cast<uint32_t>(msg.tp_rank));
  if (has_transfer_id(msg.type)) {
    pack_str(pk, "transfer_id");
    pack_str(pk, msg.transfer_id);
  }
  switch (msg.type) {
    case MessageType::kMeta:
    case MessageType::kMetaOk: {
      pack_str(pk, "engine_desc");
      pack_bin(pk, msg.engine_desc);
      pack_str(pk, "layer_descs");
      pk.pack_array(static_cast<uint32_t>(msg.layer_descs.size()));
      for (const auto& desc : msg.layer_descs) pack_bin(pk, desc);
      pack_str(pk, "fingerprint");
      pk.pack_map(msg.fingerprint.head_map.empty() ? 6 : 7);
      pack_str(pk, "num_layers");
      pk.pack(static_cast<uint32_t>(msg.fingerprint.num_layers));
      pack_str(pk, "num_kv_heads");
      pk.pack(static_cast<uint32_t>(msg.fingerprint.num_kv_heads));
      pack_str(pk, "head_dim");
      pk.pack(static_cast<uint32_t>(msg.fingerprint.head_dim));
      pack_str(pk, "dtype");
      pack_str(pk, msg.fingerprint.dtype);
      pack_str(pk, "block_size");
      pk.pack(static_cast<uint32_t>(msg.fingerprint.block_size));
      pack_str(pk, "tp_size");
      pk.pack(static_cast<uint32_t>(msg.fingerprint.tp_size));
      if (!msg.fingerprint.head_map.empty()) {
        pack_str(pk, "head_map");
        pk.pack_array(static_cast<uint32_t>(2 * msg.fingerprint.head_map.size()));
        for (const RankHeads& h : msg.fingerprint.head_map) {
          pk.pack(static_cast<uint32_t>(h.begin));
          pk.pack(static_cast<uint32_t>(h.count));
        }
      }
      pack_str(pk, "num_blocks");
      pk.pack(static_cast<uint32_t>(msg.num_blocks));
      break;
    }
    case MessageType::kBlocks:
    case MessageType::kRead:
      pack_str(pk, "block_ids");
      pk.pack_array(static_cast<uint32_t>(msg.block_ids.size()));
      for (int32_t id : msg.block_ids) pk.pack(static_cast<uint32_t>(id));
      pack_str(pk, "num_tokens");
      pk.pack(static_cast<uint32_t>(msg.num_tokens));
      pack_str(pk, "kv_tokens");
      pk.pack(static_cast<uint32_t>(msg.kv_tokens));
      if (msg.type == MessageType::kBlocks) {
        pack_str(pk, "num_skip_blocks");
        pk.pack(static_cast<uint32_t>(msg.num_skip_blocks));
      }
      break;
    case MessageType::kDone:
      pack_str(pk, "ok");
      pk.pack(msg.ok);
      pack_str(pk, "num_tokens");
      pk.pack(static_cast<uint32_t>(msg.num_tokens));
      pack_str(pk, "text");
      pack_str(pk, msg.text.substr(0, kMaxTextBytes));
      pack_first_token(pk, msg);
      break;
    case MessageType::kAbort:
    case MessageType::kError:
      pack_str(pk, "text");
      pack_str(pk, msg.text.substr(0, kMaxTextBytes));
      if (msg.type == MessageType::kError && msg.invalid_params) {
        pack_str(pk, "invalid_params");
        pk.pack(true);
      }
      break;
    case MessageType::kReadOk:
      pack_first_token(pk, msg);
      break;
    case MessageType::kRelease:
      break;
  }
  const auto* begin = reinterpret_cast<const uint8_t*>(buffer.data());
  return std::vector<uint8_t>(begin, begin + buffer.size());
}

Result<ControlMessage> decode_message(std::span<const uint8_t> frame) {
  if (frame.empty() || frame.size() > kMaxFrameBytes) {
    return invalid_argument("frame of {} bytes outside [1, {}]", frame.size(), kMaxFrameBytes);
  }
  msgpack::object_handle handle;
  try {
    // Limits bound what a hostile frame can make us allocate before validation.
    const msgpack::unpack_limit limit(/*array=*/kMaxBlocksPerTransfer, /*map=*/32, /*str=*/kMaxTextBytes * 4,
                                      /*bin=*/kMaxDescriptorBytes, /*ext=*/0, /*depth=*/4);
    std::size_t offset = 0;
    handle =
        msgpack::unpack(reinterpret_cast<const char*>(frame.data()), frame.size(), offset, nullptr, nullptr, limit);
    if (offset != frame.size()) return invalid_argument("{} trailing bytes after the message", frame.size() - offset);
  } catch (const std::exception& e) {
    return invalid_argument("not a msgpack message: {}", e.what());
  }
  const msgpack::object& root = handle.get();
  if (root.type != msgpack::type::MAP) return invalid_argument("message is not a map");
  MapReader reader(root.via.map);
  uint64_t version = 0;
  PD_RETURN_IF_ERROR(reader.u64("v", &version));
  if (version != kProtocolVersion) {
    return invalid_argument("protocol version {} (this build speaks {})", version, kProtocolVersion);
  }
  std::string type_name;
  PD_RETURN_IF_ERROR(reader.str("type", &type_name, 16));
  ControlMessage msg;
  if (!parse_type(type_name, &msg.type)) return invalid_argument("unknown message type '{}'", type_name);
  Status status = decode_fields(reader, msg);
  if (!status.ok()) return status.with_context(fmt::format("'{}' message", type_name));
  return msg;
}

}  // namespace pd::connector
