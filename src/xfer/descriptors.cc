// msgpack encoding of EngineDesc / MemDesc. Maps with short string keys so a
// later version can add fields; the decoder checks the version, every type and
// every limit, and turns any msgpack exception into kInvalidArgument.
#include <msgpack.hpp>

#include <algorithm>
#include <limits>
#include <set>

#include "xfer/types.h"

namespace pd::xfer {
namespace {

constexpr size_t kMaxDescriptorBytes = 64 * 1024;
constexpr size_t kMaxNameBytes = 256;
constexpr size_t kMaxBlobBytes = 16 * 1024;
constexpr size_t kMaxMapEntries = 16;
constexpr size_t kMaxGpus = 64;

using Blobs = std::map<std::string, std::vector<uint8_t>>;

void pack_blobs(msgpack::packer<msgpack::sbuffer>& pk, const Blobs& blobs) {
  pk.pack_map(static_cast<uint32_t>(blobs.size()));
  for (const auto& [name, blob] : blobs) {
    pk.pack(name);
    pk.pack_bin(static_cast<uint32_t>(blob.size()));
    pk.pack_bin_body(reinterpret_cast<const char*>(blob.data()), static_cast<uint32_t>(blob.size()));
  }
}

std::vector<uint8_t> to_bytes(const msgpack::sbuffer& buffer) {
  const auto* data = reinterpret_cast<const uint8_t*>(buffer.data());
  return {data, data + buffer.size()};
}

// Read-only view of a decoded msgpack map with typed, checked field access.
class Fields {
 public:
  explicit Fields(const msgpack::object& map) : map_(map.via.map) {}

  const msgpack::object* find(std::string_view key) const {
    for (uint32_t i = 0; i < map_.size; ++i) {
      const msgpack::object& k = map_.ptr[i].key;
      if (k.type == msgpack::type::STR && std::string_view(k.via.str.ptr, k.via.str.size) == key) {
        return &map_.ptr[i].val;
      }
    }
    return nullptr;
  }
  Result<uint64_t> u64(std::string_view key) const {
    const msgpack::object* o = find(key);
    if (o == nullptr || o->type != msgpack::type::POSITIVE_INTEGER) {
      return invalid_argument("descriptor field '{}' missing or not an unsigned integer", key);
    }
    return o->via.u64;
  }
  Result<int64_t> i64(std::string_view key) const {
    const msgpack::object* o = find(key);
    if (o == nullptr) return invalid_argument("descriptor field '{}' missing", key);
    if (o->type == msgpack::type::POSITIVE_INTEGER && o->via.u64 <= uint64_t(std::numeric_limits<int64_t>::max())) {
      return static_cast<int64_t>(o->via.u64);
    }
    if (o->type == msgpack::type::NEGATIVE_INTEGER) return o->via.i64;
    return invalid_argument("descriptor field '{}' not an integer", key);
  }
  Result<std::string> str(std::string_view key) const {
    const msgpack::object* o = find(key);
    if (o == nullptr || o->type != msgpack::type::STR) {
      return invalid_argument("descriptor field '{}' missing or not a string", key);
    }
    if (o->via.str.size > kMaxNameBytes) {
      return invalid_argument("descriptor field '{}' is {} bytes, limit {}", key, o->via.str.size, kMaxNameBytes);
    }
    return std::string(o->via.str.ptr, o->via.str.size);
  }
  Result<Blobs> blobs(std::string_view key) const {
    const msgpack::object* o = find(key);
    if (o == nullptr || o->type != msgpack::type::MAP) {
      return invalid_argument("descriptor field '{}' missing or not a map", key);
    }
    if (o->via.map.size > kMaxMapEntries) return invalid_argument("descriptor field '{}' has too many entries", key);
    Blobs out;
    for (uint32_t i = 0; i < o->via.map.size; ++i) {
      const msgpack::object& k = o->via.map.ptr[i].key;
      const msgpack::object& v = o->via.map.ptr[i].val;
      // Blobs go to backend parsers that take no length (ucp_ep_create, ucp_ep_rkey_unpack):
      // an empty one would hand them a null pointer.
      if (k.type != msgpack::type::STR || k.via.str.size > kMaxNameBytes || v.type != msgpack::type::BIN ||
          v.via.bin.size == 0 || v.via.bin.size > kMaxBlobBytes) {
        return invalid_argument("descriptor field '{}' entry {} is not a (name, blob) pair within limits", key, i);
      }
      const auto* data = reinterpret_cast<const uint8_t*>(v.via.bin.ptr);
      const bool inserted =
          out.emplace(std::string(k.via.str.ptr, k.via.str.size), std::vector<uint8_t>(data, data + v.via.bin.size))
              .second;
      if (!inserted) return invalid_argument("descriptor field '{}' names entry {} twice", key, i);
    }
    return out;
  }

 private:
  const msgpack::object_map& map_;
};

// Unpacks `bytes` into `handle` and checks the envelope (map, version, type tag).
Status open_envelope(std::span<const uint8_t> bytes, std::string_view type, msgpack::object_handle& handle) {
  if (bytes.empty()) return invalid_argument("empty {} descriptor", type);
  if (bytes.size() > kMaxDescriptorBytes) {
    return invalid_argument("{} descriptor is {} bytes, limit {}", type, bytes.size(), kMaxDescriptorBytes);
  }
  try {
    size_t offset = 0;
    handle = msgpack::unpack(reinterpret_cast<const char*>(bytes.data()), bytes.size(), offset, nullptr, nullptr,
                             msgpack::unpack_limit(64, 64, 1024, kMaxBlobBytes, 64, 8));
    if (offset != bytes.size()) {
      return invalid_argument("{} descriptor has {} trailing bytes", type, bytes.size() - offset);
    }
  } catch (const std::exception& e) {
    return invalid_argument("{} descriptor is not valid msgpack: {}", type, e.what());
  }
  const msgpack::object& root = handle.get();
  if (root.type != msgpack::type::MAP) return invalid_argument("{} descriptor is not a msgpack map", type);
  // Strict: a key given twice would let two readers of one descriptor see different values.
  std::set<std::string_view> keys;
  for (uint32_t i = 0; i < root.via.map.size; ++i) {
    const msgpack::object& k = root.via.map.ptr[i].key;
    if (k.type == msgpack::type::STR && !keys.insert(std::string_view(k.via.str.ptr, k.via.str.size)).second) {
      return invalid_argument("{} descriptor has key '{}' twice", type,
                              std::string_view(k.via.str.ptr, std::min<size_t>(k.via.str.size, 64)));
    }
  }
  Fields fields(root);
  PD_ASSIGN_OR_RETURN(uint64_t version, fields.u64("v"));
  if (version != kDescriptorVersion) {
    return invalid_argument("{} descriptor version {}, expected {}", type, version, kDescriptorVersion);
  }
  PD_ASSIGN_OR_RETURN(std::string tag, fields.str("t"));
  if (tag != type) return invalid_argument("descriptor type '{}', expected '{}'", tag, type);
  return Status::Ok();
}

}  // namespace

const char* mem_kind_name(MemKind kind) {
  return kind == MemKind::kHost ? "host" : "cuda";
}

const char* transfer_status_name(TransferStatus status) {
  switch (status) {
    case TransferStatus::kPending:
      return "pending";
    case TransferStatus::kDone:
      return "done";
    case TransferStatus::kFailed:
      return "failed";
  }
  return "unknown";
}

std::vector<uint8_t> encode(const EngineDesc& desc) {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> pk(buffer);
  pk.pack_map(7);
  pk.pack("v"), pk.pack(kDescriptorVersion);
  pk.pack("t"), pk.pack("engine");
  pk.pack("name"), pk.pack(desc.name);
  pk.pack("nonce"), pk.pack(desc.boot_nonce);
  pk.pack("host"), pk.pack(desc.host_id);
  pk.pack("ep"), pack_blobs(pk, desc.endpoints);
  pk.pack("gpus"), pk.pack(desc.gpu_uuids);
  return to_bytes(buffer);
}

std::vector<uint8_t> encode(const MemDesc& desc) {
  msgpack::sbuffer buffer;
  msgpack::packer<msgpack::sbuffer> pk(buffer);
  pk.pack_map(10);
  pk.pack("v"), pk.pack(kDescriptorVersion);
  pk.pack("t"), pk.pack("mem");
  pk.pack("engine"), pk.pack(desc.engine_name);
  pk.pack("nonce"), pk.pack(desc.boot_nonce);
  pk.pack("region"), pk.pack(desc.region_id);
  pk.pack("base"), pk.pack(desc.base);
  pk.pack("bytes"), pk.pack(desc.bytes);
  pk.pack("kind"), pk.pack(static_cast<uint32_t>(desc.kind));
  pk.pack("device"), pk.pack(desc.device);
  pk.pack("keys"), pack_blobs(pk, desc.keys);
  return to_bytes(buffer);
}

Result<EngineDesc> decode_engine_desc(std::span<const uint8_t> bytes) {
  msgpack::object_handle handle;
  PD_RETURN_IF_ERROR(open_envelope(bytes, "engine", handle));
  Fields fields(handle.get());
  EngineDesc desc;
  PD_ASSIGN_OR_RETURN(desc.name, fields.str("name"));
  if (desc.name.empty()) return invalid_argument("engine descriptor has an empty name");
  PD_ASSIGN_OR_RETURN(desc.boot_nonce, fields.u64("nonce"));
  if (desc.boot_nonce == 0) return invalid_argument("engine descriptor '{}' has boot nonce 0", desc.name);
  PD_ASSIGN_OR_RETURN(desc.host_id, fields.str("host"));
  PD_ASSIGN_OR_RETURN(desc.endpoints, fields.blobs("ep"));
  const msgpack::object* gpus = fields.find("gpus");
  if (gpus == nullptr || gpus->type != msgpack::type::ARRAY || gpus->via.array.size > kMaxGpus) {
    return invalid_argument("engine descriptor field 'gpus' missing, not an array or longer than {}", kMaxGpus);
  }
  for (uint32_t i = 0; i < gpus->via.array.size; ++i) {
    const msgpack::object& g = gpus->via.array.ptr[i];
    if (g.type != msgpack::type::STR || g.via.str.size > kMaxNameBytes) {
      return invalid_argument("engine descriptor gpu {} is not a string within limits", i);
    }
    desc.gpu_uuids.emplace_back(g.via.str.ptr, g.via.str.size);
  }
  return desc;
}

Result<MemDesc> decode_mem_desc(std::span<const uint8_t> bytes) {
  msgpack::object_handle handle;
  PD_RETURN_IF_ERROR(open_envelope(bytes, "mem", handle));
  Fields fields(handle.get());
  MemDesc desc;
  PD_ASSIGN_OR_RETURN(desc.engine_name, fields.str("engine"));
  if (desc.engine_name.empty()) return invalid_argument("memory descriptor has an empty engine name");
  PD_ASSIGN_OR_RETURN(desc.boot_nonce, fields.u64("nonce"));
  if (desc.boot_nonce == 0) return invalid_argument("memory descriptor has boot nonce 0");
  PD_ASSIGN_OR_RETURN(desc.region_id, fields.u64("region"));
  PD_ASSIGN_OR_RETURN(desc.base, fields.u64("base"));
  PD_ASSIGN_OR_RETURN(desc.bytes, fields.u64("bytes"));
  if (desc.bytes == 0) return invalid_argument("memory descriptor region {} has zero bytes", desc.region_id);
  if (desc.base > std::numeric_limits<uint64_t>::max() - desc.bytes) {
    return invalid_argument("memory descriptor region {} wraps the address space", desc.region_id);
  }
  PD_ASSIGN_OR_RETURN(uint64_t kind, fields.u64("kind"));
  if (kind > static_cast<uint64_t>(MemKind::kCuda)) return invalid_argument("memory descriptor kind {} unknown", kind);
  desc.kind = static_cast<MemKind>(kind);
  PD_ASSIGN_OR_RETURN(int64_t device, fields.i64("device"));
  if (device < -1 || device > 1024 || (desc.kind == MemKind::kCuda) != (device >= 0)) {
    return invalid_argument("memory descriptor device {} does not fit kind {}", device, mem_kind_name(desc.kind));
  }
  desc.device = static_cast<int32_t>(device);
  PD_ASSIGN_OR_RETURN(desc.keys, fields.blobs("keys"));
  return desc;
}

}  // namespace pd::xfer
