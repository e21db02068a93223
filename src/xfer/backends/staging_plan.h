// Pure parts of the ucx backend's staging protocol (ucx_staging.h): how a batch is cut
// into chunks that fit one staging buffer, and the messages' wire format. No UCX, no
// threads; unit-tested directly.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "common/status.h"
#include "xfer/types.h"

namespace pd::xfer {

// One chunk of a staged batch: pieces (local offset, remote offset, bytes) whose bytes
// travel packed back to back, in this order, in one staging buffer.
struct StagingChunk {
  std::vector<Op> pieces;
  uint64_t bytes = 0;  // sum of the pieces' bytes
};

// Cuts validated ops into chunks of at most `chunk_bytes` packed bytes and
// `max_pieces` pieces, in the ops' order; an op larger than what is left of a chunk
// continues in the next one. Precondition: chunk_bytes > 0, max_pieces > 0.
std::vector<StagingChunk> plan_staging_chunks(std::span<const Op> ops, uint64_t chunk_bytes, uint32_t max_pieces);

// ---- wire format (both ends are the same build on little-endian hosts) ----

inline constexpr uint32_t kStagingMagic = 0x50445347;  // "PDSG"
inline constexpr uint16_t kStagingAmId = 0x5044;

enum class StagingMessage : uint32_t {
  kWrite = 1,        // initiator -> target: data = piece table + packed bytes
  kReadRequest = 2,  // initiator -> target: data = piece table
  kReadData = 3,     // target -> initiator: data = packed bytes (none when status != kOk)
  kAck = 4,          // target -> initiator: a write chunk is in the region (or why not)
};

enum class StagingStatus : uint32_t {
  kOk = 0,
  kUnknownRegion = 1,  // no region with that id (never registered, or deregistered)
  kBadRequest = 2,     // piece table or sizes inconsistent, or out of the region's bounds
  kCopyFailed = 3,     // the device copy failed on the target
};
const char* staging_status_name(uint32_t status);

// The AM header of every staging message (trivially copyable).
struct StagingHeader {
  uint32_t magic = kStagingMagic;
  uint32_t type = 0;   // StagingMessage
  uint64_t token = 0;  // the initiator's id of the chunk; echoed in replies
  uint64_t region_id = 0;
  uint32_t num_pieces = 0;
  uint32_t status = 0;      // StagingStatus (replies)
  uint64_t data_bytes = 0;  // packed bytes of the chunk
};

// One entry of a piece table: where in the target region, how many bytes.
struct WirePiece {
  uint64_t region_offset = 0;
  uint64_t bytes = 0;
};

// Any bytes from the network: a header with the right size, magic and a known type.
std::optional<StagingHeader> decode_staging_header(const void* header, size_t header_bytes);

// Reads a piece table from (possibly unaligned) message bytes and checks it against
// the header and a region of `region_bytes`: `table_bytes` holds exactly num_pieces
// entries, every piece is non-empty and inside the region, and the pieces add up to
// header.data_bytes. kInvalidArgument with the reason otherwise.
Result<std::vector<WirePiece>> read_piece_table(const StagingHeader& header, const uint8_t* table, uint64_t table_bytes,
                                                uint64_t region_bytes);

// The initiator's id of its `counter`-th chunk under a random per-instance `key`: splitmix64's
// finalizer of counter + key, a bijection of 64-bit words, so ids never repeat within an
// instance and a peer cannot guess the next one (replies are matched by id alone).
inline uint64_t staging_token(uint64_t counter, uint64_t key) {
  uint64_t z = counter + key;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace pd::xfer
