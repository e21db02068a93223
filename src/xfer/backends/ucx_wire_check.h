// Checks of a peer's UCX blobs before UCX parses them.
//
// UCX 1.13 parses a worker address (ucp_ep_create) and a packed remote key
// (ucp_ep_rkey_unpack) without knowing their length, trusts every length and
// index inside them, and aborts the process on an address version it does not
// know (an always-on assertion). Its only other parser, ucp_worker_address_query,
// runs the same header code. So a peer's blobs are walked here first, with every
// read bounds-checked, over UCX 1.13's packed layouts:
//
//   worker address: header (version in the low 4 bits; v1: flags in the high 4,
//     v2: flags in a second byte) | uuid (v1 always, v2 when flagged) | client id
//     (flagged) | name (flagged debug info: length byte + bytes) | then either
//     0xff (no devices) or devices: md byte (0x80 = no transports; index in the
//     low 5 (v1) / 7 (v2) bits, v2 extends an all-ones index into a second byte)
//     | device-address length byte (0x80 last device, 0x40 path count follows,
//     0x20 system device follows; length in the low 5 bits, v2 extends 31) |
//     [paths] [sys dev] | device address | transports: name checksum (2 bytes) |
//     attributes (v1: 16 bytes, three floats and a flags word; v2: 8 bytes) |
//     address length byte (0x80 last transport, 0x40 endpoint addresses follow;
//     length in the low 6 bits, v2 extends 63) | interface address.
//   remote key: md map (8 bytes) | memory type (1 byte) | per md bit: length byte
//     + that many bytes.
//
// A blob is accepted only if the walk ends exactly at its last byte, every index
// and count is within UCX's own limits (md index < 64, <= 128 transports, no
// endpoint addresses in a worker address, a known memory type), v1 attributes
// are finite and in range, its version is the one our own worker packs, and every
// transport we also have (same name checksum) carries addresses of a length our
// own worker uses for it (UCX hands those bytes to the transport, which reads the
// length it expects). Pure functions: no UCX calls, fuzzed and unit-tested alone.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <span>
#include <vector>

#include "common/status.h"

namespace pd::xfer {

struct UcxAddressEntry {
  uint16_t tl_checksum = 0;
  uint8_t md_index = 0;
  uint32_t device_address_bytes = 0;
  uint32_t iface_address_bytes = 0;
};

struct UcxAddressLayout {
  uint8_t version = 0;  // 0 = UCX's v1 format, 1 = v2
  uint8_t flags = 0;
  std::vector<UcxAddressEntry> entries;
};

// Walks a packed worker address; refuses anything UCX 1.13 could misread.
Result<UcxAddressLayout> parse_ucx_worker_address(std::span<const uint8_t> blob);

// What a peer's address must agree with: our own worker's format.
struct UcxAddressProfile {
  uint8_t version = 0;
  // transport name checksum -> the address lengths our worker packs for it
  std::map<uint16_t, std::set<uint32_t>> device_address_bytes;
  std::map<uint16_t, std::set<uint32_t>> iface_address_bytes;
};
UcxAddressProfile ucx_address_profile(const UcxAddressLayout& own);

// parse_ucx_worker_address + agreement with `own`.
Status check_ucx_worker_address(std::span<const uint8_t> blob, const UcxAddressProfile& own);
// Header-only check for a worker whose own address this walker cannot parse
// (e.g. UCX_UNIFIED_MODE, another UCX release): size bounds and the same version.
Status check_ucx_worker_address_header(std::span<const uint8_t> blob, uint8_t own_version);

// Walks a packed remote key (ucp_rkey_pack's output). posix_md_index: the md index of
// this worker's posix shared-memory md (-1: none). Its section must be a posix key
// (segment id, address, length) of non-zero length: uct_posix_rkey_unpack asserts on a
// zero length (found by fuzz_ucx_descriptor). Peers are assumed to run this UCX build with
// the same md order (one image per deployment); a key laid out otherwise is refused.
Status check_ucx_rkey(std::span<const uint8_t> blob, int posix_md_index = -1);

// Largest blobs accepted (real ones are a few hundred bytes).
inline constexpr size_t kMaxUcxAddressBytes = 8192;
inline constexpr size_t kMaxUcxRkeyBytes = 4096;
// Zero bytes appended to the copy handed to UCX: a transport that reads a fixed-size
// address from a (checked) shorter one reads zeros, never past the buffer.
inline constexpr size_t kUcxBlobPadding = 256;

}  // namespace pd::xfer
