#include "xfer/backends/ucx_wire_check.h"

#include <ucs/memory/memory_type.h>

#include <cmath>
#include <cstring>

namespace pd::xfer {
namespace {

// UCX 1.13 limits (ucp_types.h): md indices index a 64-bit map; at most 128
// transport resources per address.
constexpr uint32_t kMaxMdIndex = 64;
constexpr size_t kMaxEntries = 128;
constexpr uint8_t kNullResource = 0xff;
constexpr uint8_t kVersionV1 = 0;
constexpr uint8_t kVersionV2 = 1;
// Header flags: debug info (name), uuid, client id, AM-only.
constexpr uint8_t kFlagDebugInfo = 0x1;
constexpr uint8_t kFlagUuid = 0x2;
constexpr uint8_t kFlagClientId = 0x4;
constexpr uint8_t kKnownFlags = 0xf;

// A bounds-checked reader; every take fails instead of reading past the end.
class Reader {
 public:
  explicit Reader(std::span<const uint8_t> blob) : blob_(blob) {}
  bool take(size_t n, const uint8_t** out = nullptr) {
    if (n > blob_.size() - pos_) return false;
    if (out != nullptr) *out = blob_.data() + pos_;
    pos_ += n;
    return true;
  }
  bool byte(uint8_t* out) {
    const uint8_t* p = nullptr;
    if (!take(1, &p)) return false;
    *out = *p;
    return true;
  }
  bool peek(uint8_t* out) const {
    if (pos_ >= blob_.size()) return false;
    *out = blob_[pos_];
    return true;
  }
  size_t pos() const { return pos_; }
  bool done() const { return pos_ == blob_.size(); }

 private:
  std::span<const uint8_t> blob_;
  size_t pos_ = 0;
};

// A length or index in the low bits of a byte; v2 puts an all-ones value's real
// value in the next byte.
bool extended(Reader& in, uint8_t first, uint8_t mask, uint8_t version, uint32_t* out) {
  uint32_t value = first & mask;
  if (version == kVersionV2 && value == mask) {
    uint8_t next = 0;
    if (!in.byte(&next)) return false;
    value = next;
  }
  *out = value;
  return true;
}

float read_float(const uint8_t* p) {
  float f = 0;
  std::memcpy(&f, p, sizeof(f));
  return f;
}

Status truncated(const char* what, size_t at) {
  return invalid_argument("UCX worker address: truncated in {} at byte {}", what, at);
}

}  // namespace

Result<UcxAddressLayout> parse_ucx_worker_address(std::span<const uint8_t> blob) {
  if (blob.empty() || blob.size() > kMaxUcxAddressBytes) {
    return invalid_argument("UCX worker address of {} bytes (1 to {} accepted)", blob.size(), kMaxUcxAddressBytes);
  }
  Reader in(blob);
  UcxAddressLayout out;
  uint8_t header = 0;
  (void)in.byte(&header);
  out.version = header & 0x0f;
  if (out.version == kVersionV1) {
    out.flags = header >> 4;
  } else if (out.version == kVersionV2) {
    if (!in.byte(&out.flags)) return truncated("header", in.pos());
  } else {
    return invalid_argument("UCX worker address version {} is not one UCX 1.13 packs", out.version);
  }
  if ((out.flags & ~kKnownFlags) != 0) return invalid_argument("UCX worker address: unknown flags 0x{:x}", out.flags);
  // UCX unpacks the uuid of every v1 address (ucp_ep_create asks for it).
  if ((out.version == kVersionV1 || (out.flags & kFlagUuid) != 0) && !in.take(8)) return truncated("uuid", in.pos());
  if ((out.flags & kFlagClientId) != 0 && !in.take(8)) return truncated("client id", in.pos());
  if ((out.flags & kFlagDebugInfo) != 0) {
    uint8_t name_bytes = 0;
    if (!in.byte(&name_bytes) || !in.take(name_bytes)) return truncated("worker name", in.pos());
  }
  uint8_t first = 0;
  if (!in.peek(&first)) return truncated("device list", in.pos());
  if (first == kNullResource) {
    (void)in.take(1);
    if (!in.done()) return invalid_argument("UCX worker address: {} bytes after an empty device list", blob.size());
    return out;
  }
  bool last_device = false;
  while (!last_device) {
    uint8_t md_byte = 0;
    if (!in.byte(&md_byte)) return truncated("device", in.pos());
    const bool empty_device = (md_byte & 0x80) != 0;
    uint32_t md_index = 0;
    if (!extended(in, md_byte, out.version == kVersionV1 ? 0x1f : 0x7f, out.version, &md_index)) {
      return truncated("md index", in.pos());
    }
    if (md_index >= kMaxMdIndex) return invalid_argument("UCX worker address: md index {} >= 64", md_index);
    uint8_t len_byte = 0;
    if (!in.byte(&len_byte)) return truncated("device address length", in.pos());
    last_device = (len_byte & 0x80) != 0;
    uint32_t device_bytes = 0;
    if (!extended(in, len_byte, 0x1f, out.version, &device_bytes)) return truncated("device address length", in.pos());
    if ((len_byte & 0x40) != 0) {
      uint8_t paths = 0;
      if (!in.byte(&paths)) return truncated("path count", in.pos());
      if (paths == 0) return invalid_argument("UCX worker address: a device with 0 paths");
    }
    if ((len_byte & 0x20) != 0 && !in.take(1)) return truncated("system device", in.pos());
    if (!in.take(device_bytes)) return truncated("device address", in.pos());
    bool last_iface = empty_device;
    while (!last_iface) {
      if (out.entries.size() >= kMaxEntries) return invalid_argument("UCX worker address: more than 128 transports");
      UcxAddressEntry entry;
      const uint8_t* p = nullptr;
      if (!in.take(2, &p)) return truncated("transport name", in.pos());
      std::memcpy(&entry.tl_checksum, p, 2);
      if (out.version == kVersionV1) {
        if (!in.take(16, &p)) return truncated("transport attributes", in.pos());
        const float overhead = read_float(p);
        const float bandwidth = read_float(p + 4);
        const float latency = read_float(p + 8);
        // Finite, in range: UCX scores lanes with these and asserts on scores that do not compare.
        if (!std::isfinite(overhead) || overhead < 0 || overhead > 1 || !std::isfinite(latency) || latency < 0 ||
            latency > 1 || !std::isfinite(bandwidth) || bandwidth == 0 || std::fabs(bandwidth) > 1e15f) {
          return invalid_argument("UCX worker address: transport attributes out of range");
        }
      } else if (!in.take(8)) {
        return truncated("transport attributes", in.pos());
      }
      uint8_t addr_byte = 0;
      if (!in.byte(&addr_byte)) return truncated("interface address length", in.pos());
      last_iface = (addr_byte & 0x80) != 0;
      if ((addr_byte & 0x40) != 0) return invalid_argument("UCX worker address carries endpoint addresses");
      if (!extended(in, addr_byte, 0x3f, out.version, &entry.iface_address_bytes)) {
        return truncated("interface address length", in.pos());
      }
      if (!in.take(entry.iface_address_bytes)) return truncated("interface address", in.pos());
      entry.md_index = static_cast<uint8_t>(md_index);
      entry.device_address_bytes = device_bytes;
      out.entries.push_back(entry);
    }
  }
  if (!in.done()) {
    return invalid_argument("UCX worker address: {} trailing bytes after its last device", blob.size() - in.pos());
  }
  return out;
}

UcxAddressProfile ucx_address_profile(const UcxAddressLayout& own) {
  UcxAddressProfile profile;
  profile.version = own.version;
  for (const auto& e : own.entries) {
    profile.device_address_bytes[e.tl_checksum].insert(e.device_address_bytes);
    profile.iface_address_bytes[e.tl_checksum].insert(e.iface_address_bytes);
  }
  return profile;
}

Status check_ucx_worker_address_header(std::span<const uint8_t> blob, uint8_t own_version) {
  if (blob.size() < 2 || blob.size() > kMaxUcxAddressBytes) {
    return invalid_argument("UCX worker address of {} bytes (2 to {} accepted)", blob.size(), kMaxUcxAddressBytes);
  }
  const uint8_t version = blob[0] & 0x0f;
  if (version != own_version) {
    return invalid_argument("UCX worker address version {}, this worker packs {}", version, own_version);
  }
  return Status::Ok();
}

Status check_ucx_worker_address(std::span<const uint8_t> blob, const UcxAddressProfile& own) {
  PD_ASSIGN_OR_RETURN(UcxAddressLayout layout, parse_ucx_worker_address(blob));
  if (layout.version != own.version) {
    return invalid_argument("UCX worker address version {}, this worker packs {}", layout.version, own.version);
  }
  for (const auto& e : layout.entries) {
    auto device = own.device_address_bytes.find(e.tl_checksum);
    if (device == own.device_address_bytes.end()) continue;  // a transport we lack: UCX never reads it
    if (!device->second.count(e.device_address_bytes) ||
        !own.iface_address_bytes.at(e.tl_checksum).count(e.iface_address_bytes)) {
      return invalid_argument(
          "UCX worker address: transport 0x{:04x} with a {}-byte device and {}-byte interface address, "
          "which this worker never packs",
          e.tl_checksum, e.device_address_bytes, e.iface_address_bytes);
    }
  }
  return Status::Ok();
}

Status check_ucx_rkey(std::span<const uint8_t> blob, int posix_md_index) {
  if (blob.size() < 9 || blob.size() > kMaxUcxRkeyBytes) {
    return invalid_argument("UCX remote key of {} bytes (9 to {} accepted)", blob.size(), kMaxUcxRkeyBytes);
  }
  Reader in(blob);
  const uint8_t* p = nullptr;
  (void)in.take(8, &p);
  uint64_t md_map = 0;
  std::memcpy(&md_map, p, sizeof(md_map));
  uint8_t memory_type = 0;
  (void)in.byte(&memory_type);
  if (memory_type >= UCS_MEMORY_TYPE_LAST) return invalid_argument("UCX remote key: memory type {}", memory_type);
  for (int bit = 0; bit < 64; ++bit) {
    if ((md_map & (uint64_t{1} << bit)) == 0) continue;
    uint8_t bytes = 0;
    const uint8_t* section = nullptr;
    if (!in.byte(&bytes) || !in.take(bytes, &section)) {
      return invalid_argument("UCX remote key: truncated in the key of md {} at byte {}", bit, in.pos());
    }
    if (bit == posix_md_index) {
      uint64_t length = 0;
      if (bytes >= 24) std::memcpy(&length, section + 16, sizeof(length));
      if (length == 0) return invalid_argument("UCX remote key: a posix key of {} bytes with no segment length", bytes);
    }
  }
  if (!in.done()) return invalid_argument("UCX remote key: {} trailing bytes", blob.size() - in.pos());
  return Status::Ok();
}

}  // namespace pd::xfer
