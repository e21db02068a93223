// Fuzzes what a peer instance can send us on the control plane (DESIGN.md §3.3): connector
// control frames and the xfer descriptors they carry. Refusals are fine; crashes, hangs, leaks,
// sanitizer reports and broken round trips are not.
//
// The first input byte picks the mode:
//   0: the rest is a raw control frame            -> decode_message
//   1: the rest is a raw engine descriptor        -> xfer::decode_engine_desc
//   2: the rest is a raw memory descriptor        -> xfer::decode_mem_desc
//   3: the rest builds a well-formed message (every type, random fields), which is encoded, then
//      has a few bytes overwritten (possibly none) and is decoded. Raw bytes rarely get past the
//      msgpack map and the version check; this mode reaches every type's field checks.
// Whatever decodes must survive encode -> decode unchanged: the decoder accepts exactly what
// the encoder can write, and encoding is canonical.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdio>
#include <cstdlib>
#include <span>
#include <vector>

#include "connector/messages.h"
#include "xfer/types.h"

namespace {

using pd::connector::ControlMessage;
using pd::connector::MessageType;

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_control_message: %s\n", what);
  std::abort();
}

// decode(x) succeeded: encode it, decode again, and the second encoding must be identical.
void check_message_round_trip(const ControlMessage& decoded) {
  const std::vector<uint8_t> first = pd::connector::encode_message(decoded);
  auto again = pd::connector::decode_message(first);
  if (!again.ok()) fail("a decoded message does not decode after re-encoding");
  if (pd::connector::encode_message(*again) != first) fail("message encoding is not stable across a round trip");
}

template <typename Desc, typename Decode>
void check_desc_round_trip(const Desc& decoded, Decode decode) {
  const std::vector<uint8_t> first = pd::xfer::encode(decoded);
  auto again = decode(std::span<const uint8_t>(first));
  if (!again.ok()) fail("a decoded descriptor does not decode after re-encoding");
  if (pd::xfer::encode(*again) != first) fail("descriptor encoding is not stable across a round trip");
}

void decode_frame(std::span<const uint8_t> frame) {
  auto decoded = pd::connector::decode_message(frame);
  if (!decoded.ok()) return;
  check_message_round_trip(*decoded);
  // A meta message's descriptors are peer bytes too: the connector decodes them next.
  if (auto engine = pd::xfer::decode_engine_desc(decoded->engine_desc); engine.ok()) {
    check_desc_round_trip(*engine, pd::xfer::decode_engine_desc);
  }
  for (const auto& layer : decoded->layer_descs) {
    if (auto mem = pd::xfer::decode_mem_desc(layer); mem.ok()) check_desc_round_trip(*mem, pd::xfer::decode_mem_desc);
  }
}

std::string hex_id(FuzzedDataProvider& in) {
  static const char kDigits[] = "0123456789abcdefABCDEF";
  std::string id(32, '0');
  for (auto& c : id) c = kDigits[in.ConsumeIntegralInRange<size_t>(0, sizeof(kDigits) - 2)];
  return id;
}

std::vector<uint8_t> some_bytes(FuzzedDataProvider& in, size_t max) {
  return in.ConsumeBytes<uint8_t>(in.ConsumeIntegralInRange<size_t>(1, max));
}

ControlMessage build_message(FuzzedDataProvider& in) {
  ControlMessage m;
  m.type = static_cast<MessageType>(in.ConsumeIntegralInRange<int>(0, static_cast<int>(MessageType::kError)));
  m.instance_id = in.ConsumeRandomLengthString(pd::connector::kMaxInstanceIdBytes);
  if (m.instance_id.empty()) m.instance_id = "p";
  m.boot_nonce = in.ConsumeIntegral<uint64_t>();
  m.tp_rank = in.ConsumeIntegralInRange<int32_t>(0, 1023);
  if (m.type != MessageType::kMeta && m.type != MessageType::kMetaOk) m.transfer_id = hex_id(in);
  switch (m.type) {
    case MessageType::kMeta:
    case MessageType::kMetaOk: {
      m.engine_desc = some_bytes(in, 256);
      if (m.engine_desc.empty()) m.engine_desc = {0};
      const int layers = in.ConsumeIntegralInRange<int>(1, 8);
      const int tp = in.ConsumeIntegralInRange<int>(1, 4);
      for (int i = 0; i < layers * tp; ++i) {  // one region per rank per layer
        auto desc = some_bytes(in, 64);
        if (desc.empty()) desc = {0};
        m.layer_descs.push_back(std::move(desc));
      }
      m.fingerprint = {layers,
                       in.ConsumeIntegralInRange<int32_t>(1, 4096),
                       in.ConsumeIntegralInRange<int32_t>(1, 4096),
                       in.ConsumeRandomLengthString(16),
                       in.ConsumeIntegralInRange<int32_t>(1, 4096),
                       tp,
                       {}};
      // A valid head map (rank 0 holds every head, the others any range), required when tp > 1.
      if (tp > 1 || in.ConsumeBool()) {
        const int32_t heads = m.fingerprint.num_kv_heads;
        m.fingerprint.head_map.push_back({0, heads});
        for (int r = 1; r < tp; ++r) {
          const int32_t begin = in.ConsumeIntegralInRange<int32_t>(0, heads - 1);
          m.fingerprint.head_map.push_back({begin, in.ConsumeIntegralInRange<int32_t>(1, heads - begin)});
        }
      }
      m.num_blocks = in.ConsumeIntegralInRange<int32_t>(1, INT32_MAX);
      break;
    }
    case MessageType::kBlocks:
    case MessageType::kRead: {
      const size_t ids = in.ConsumeIntegralInRange<size_t>(0, 64);
      for (size_t i = 0; i < ids; ++i) m.block_ids.push_back(in.ConsumeIntegralInRange<int32_t>(0, INT32_MAX));
      m.num_tokens = in.ConsumeIntegralInRange<int32_t>(0, INT32_MAX);
      m.kv_tokens = in.ConsumeIntegralInRange<int32_t>(0, m.num_tokens);
      if (m.type == MessageType::kBlocks) m.num_skip_blocks = in.ConsumeIntegralInRange<int32_t>(0, INT32_MAX);
      break;
    }
    case MessageType::kDone:
    case MessageType::kReadOk:
      if (m.type == MessageType::kDone) {
        m.ok = in.ConsumeBool();
        m.num_tokens = in.ConsumeIntegralInRange<int32_t>(0, INT32_MAX);
        m.text = in.ConsumeRandomLengthString(pd::connector::kMaxTextBytes);
      }
      if (in.ConsumeBool()) {
        m.first_token = in.ConsumeIntegralInRange<int32_t>(0, INT32_MAX);
        m.sampling_key = in.ConsumeIntegral<uint64_t>();
      }
      break;
    case MessageType::kError:
      if (in.ConsumeBool()) m.transfer_id.clear();
      m.invalid_params = in.ConsumeBool();
      [[fallthrough]];
    case MessageType::kAbort:
      m.text = in.ConsumeRandomLengthString(pd::connector::kMaxTextBytes);
      break;
    case MessageType::kRelease:
      break;
  }
  return m;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::span<const uint8_t> rest(data + 1, size - 1);
  switch (data[0] % 4) {
    case 0:
      decode_frame(rest);
      break;
    case 1:
      if (auto engine = pd::xfer::decode_engine_desc(rest); engine.ok()) {
        check_desc_round_trip(*engine, pd::xfer::decode_engine_desc);
      }
      break;
    case 2:
      if (auto mem = pd::xfer::decode_mem_desc(rest); mem.ok()) check_desc_round_trip(*mem, pd::xfer::decode_mem_desc);
      break;
    default: {
      FuzzedDataProvider in(rest.data(), rest.size());
      const ControlMessage built = build_message(in);
      std::vector<uint8_t> frame = pd::connector::encode_message(built);
      const int edits = in.ConsumeIntegralInRange<int>(0, 3);
      if (edits == 0 && !pd::connector::decode_message(frame).ok()) fail("a well-formed message was refused");
      for (int i = 0; i < edits; ++i) {
        frame[in.ConsumeIntegralInRange<size_t>(0, frame.size() - 1)] = in.ConsumeIntegral<uint8_t>();
      }
      decode_frame(frame);
      break;
    }
  }
  return 0;
}
