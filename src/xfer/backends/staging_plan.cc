#include "xfer/backends/staging_plan.h"

#include <algorithm>
#include <cstring>

namespace pd::xfer {

std::vector<StagingChunk> plan_staging_chunks(std::span<const Op> ops, uint64_t chunk_bytes, uint32_t max_pieces) {
  std::vector<StagingChunk> chunks;
  StagingChunk current;
  for (const Op& op : ops) {
    uint64_t done = 0;
    while (done < op.bytes) {
      if (current.bytes == chunk_bytes || current.pieces.size() == max_pieces) {
        chunks.push_back(std::move(current));
        current = StagingChunk{};
      }
      const uint64_t take = std::min(op.bytes - done, chunk_bytes - current.bytes);
      current.pieces.push_back({op.local_offset + done, op.remote_offset + done, take});
      current.bytes += take;
      done += take;
    }
  }
  if (!current.pieces.empty()) chunks.push_back(std::move(current));
  return chunks;
}

const char* staging_status_name(uint32_t status) {
  switch (static_cast<StagingStatus>(status)) {
    case StagingStatus::kOk:
      return "ok";
    case StagingStatus::kUnknownRegion:
      return "unknown region";
    case StagingStatus::kBadRequest:
      return "bad request";
    case StagingStatus::kCopyFailed:
      return "device copy failed";
  }
  return "unknown status";
}

std::optional<StagingHeader> decode_staging_header(const void* header, size_t header_bytes) {
  if (header == nullptr || header_bytes != sizeof(StagingHeader)) return std::nullopt;
  StagingHeader h;
  std::memcpy(&h, header, sizeof(h));
  if (h.magic != kStagingMagic) return std::nullopt;
  if (h.type < static_cast<uint32_t>(StagingMessage::kWrite) || h.type > static_cast<uint32_t>(StagingMessage::kAck)) {
    return std::nullopt;
  }
  return h;
}

Result<std::vector<WirePiece>> read_piece_table(const StagingHeader& header, const uint8_t* table, uint64_t table_bytes,
                                                uint64_t region_bytes) {
  if (header.num_pieces == 0 || table_bytes / sizeof(WirePiece) != header.num_pieces ||
      table_bytes % sizeof(WirePiece) != 0) {
    return invalid_argument("piece table of {} bytes for {} pieces", table_bytes, header.num_pieces);
  }
  std::vector<WirePiece> pieces(header.num_pieces);
  std::memcpy(pieces.data(), table, table_bytes);
  uint64_t total = 0;
  for (const WirePiece& p : pieces) {
    if (p.bytes == 0 || p.region_offset > region_bytes || p.bytes > region_bytes - p.region_offset) {
      return invalid_argument("piece [{}, +{}) outside the region of {} bytes", p.region_offset, p.bytes, region_bytes);
    }
    if (__builtin_add_overflow(total, p.bytes, &total) || total > header.data_bytes) {
      return invalid_argument("pieces add up to more than the header's {} bytes", header.data_bytes);
    }
  }
  if (total != header.data_bytes) {
    return invalid_argument("pieces add up to {} bytes, the header says {}", total, header.data_bytes);
  }
  return pieces;
}

}  // namespace pd::xfer
