// Fuzzes the router's pure input handling: a client's request body, a producer's response (the
// READ leg copies its kv_transfer_params), a backend's SSE stream, and host:port / URL text from
// registrations and flags. Refusals are fine; crashes, hangs, leaks, sanitizer reports are not,
// and neither is a result that breaks what router/request_rewrite.h, sse.h or instance_info.h
// promise (checked below). The input is split by FuzzedDataProvider into those pieces.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <string_view>

#include "router/instance_info.h"
#include "router/prompt_tokens.h"
#include "router/request_rewrite.h"
#include "router/sse.h"

namespace {

[[noreturn]] void fail(const char* what) {
  std::fprintf(stderr, "fuzz_router_input: %s\n", what);
  std::abort();
}

constexpr const char* kTransferId = "0123456789abcdef0123456789abcdef";

void check_host_port(const std::string& text) {
  if (auto parsed = pd::router::parse_host_port(text); parsed.ok()) {
    if (parsed->host.empty() || parsed->host.size() > 253 || parsed->port == 0) fail("bad host:port accepted");
    auto again = pd::router::parse_host_port(parsed->to_string());
    if (!again.ok() || !(*again == *parsed)) fail("host:port does not survive to_string -> parse");
  }
  if (auto url = pd::router::parse_http_url(text); url.ok()) {
    if (url->host.empty() || url->port == 0) fail("bad URL accepted");
  }
}

void check_sse(const std::string& stream) {
  std::string_view rest(stream);
  while (!rest.empty()) {
    auto end = pd::router::find_event_end(rest);
    if (!end) break;
    if (*end == 0 || *end > rest.size()) fail("find_event_end outside the data");
    if (auto status = pd::router::error_event_status(rest.substr(0, *end))) {
      if (*status < 400 || *status > 599) fail("error event status outside 400..599");
    }
    rest.remove_prefix(*end);
  }
  if (auto status = pd::router::error_event_status(rest); status && (*status < 400 || *status > 599)) {
    fail("error event status outside 400..599");
  }
}

// A leg keeps the client's keys in the client's order (chat templates render tools / JSON schemas
// in the order given), less `dropped_keys`, with whatever the router adds after them; every value
// the router does not rewrite is equal to the client's, nested key order included (ordered_json
// compares objects in order).
bool keeps_client_key_order(const nlohmann::ordered_json& client, const nlohmann::ordered_json& leg,
                            std::initializer_list<std::string_view> rewritten_keys,
                            std::initializer_list<std::string_view> dropped_keys) {
  auto is_one_of = [](std::string_view key, std::initializer_list<std::string_view> keys) {
    return std::find(keys.begin(), keys.end(), key) != keys.end();
  };
  auto leg_it = leg.begin();
  for (auto client_it = client.begin(); client_it != client.end(); ++client_it) {
    if (is_one_of(client_it.key(), dropped_keys)) continue;
    if (leg_it == leg.end() || leg_it.key() != client_it.key()) return false;
    if (!is_one_of(client_it.key(), rewritten_keys) && leg_it.value() != client_it.value()) return false;
    ++leg_it;
  }
  return true;
}

void check_legs(const std::string& client_body, const std::string& producer_text) {
  auto request = pd::router::parse_client_request(client_body);
  if (!request.ok()) return;
  if (!request->body.is_object() || request->body.contains("kv_transfer_params")) {
    fail("a parsed client body is not an object free of kv_transfer_params");
  }
  // Copies and dumps of nlohmann values recurse: the body must be shallow enough for them.
  if (pd::json_nesting_depth(request->body.dump()) > pd::router::kMaxJsonDepth) {
    fail("a body nested deeper than kMaxJsonDepth was accepted");
  }
  for (auto mode : {pd::router::TransferMode::kWrite, pd::router::TransferMode::kRead}) {
    const auto leg = pd::router::make_producer_body(request->body, kTransferId, mode);
    if (leg["stream"] != false || leg["max_tokens"] != 1 || leg.contains("stream_options") ||
        leg["kv_transfer_params"]["transfer_id"] != kTransferId) {
      fail("producer leg does not carry what the contract says");
    }
    if (!keeps_client_key_order(request->body, leg, {"max_tokens", "max_completion_tokens", "min_tokens", "stream"},
                                {"stream_options"})) {
      fail("producer leg reorders or changes the client's keys");
    }
  }
  for (const char* expected : {"", "prefill-0"}) {
    auto leg = pd::router::make_read_consumer_body(request->body, kTransferId, producer_text, expected);
    if (!leg.ok()) continue;
    const auto& params = (*leg)["kv_transfer_params"];
    if (params["transfer_id"] != kTransferId || params["do_remote_prefill"] != true || params["mode"] != "read" ||
        params.contains("do_remote_decode")) {
      fail("READ consumer leg does not carry what the contract says");
    }
    if (*expected != '\0' && params["remote_instance_id"] != expected) fail("READ leg names another producer");
    if (!keeps_client_key_order(request->body, *leg, {}, {})) fail("READ consumer leg reorders the client's keys");
  }
}

// A heartbeat a peer sends: refused, or decoded into what encodes back to the same heartbeat.
void check_heartbeat(const std::string& frame) {
  auto decoded = pd::contract::decode_heartbeat(frame.data(), frame.size());
  if (!decoded.ok()) return;
  const std::vector<uint8_t> again = pd::contract::encode_heartbeat(*decoded);
  auto round = pd::contract::decode_heartbeat(again.data(), again.size());
  if (!round.ok() || round->record != decoded->record || round->load != decoded->load || round->kv != decoded->kv) {
    fail("a decoded heartbeat does not survive its own encoding");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const std::string host_port = in.ConsumeRandomLengthString(300);
  const std::string client_body = in.ConsumeRandomLengthString(4096);
  const std::string producer_text = in.ConsumeRandomLengthString(4096);
  const std::string stream = in.ConsumeRemainingBytesAsString();
  check_host_port(host_port);
  check_legs(client_body, producer_text);
  check_sse(stream);
  check_heartbeat(stream);
  (void)pd::router::parse_tokenize_answer(producer_text);
  for (const std::string* text : {&host_port, &client_body}) {
    (void)pd::router::parse_role(*text);
    (void)pd::router::parse_mode(*text);
  }
  return 0;
}
