#include "router/request_rewrite.h"

#include <cmath>

namespace pd::router {

Result<nlohmann::ordered_json> parse_json_bounded(std::string_view text, size_t max_depth) {
  if (json_nesting_depth(text) > max_depth) return invalid_argument("JSON nests deeper than {} levels", max_depth);
  nlohmann::ordered_json value = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) return invalid_argument("not valid JSON");
  return value;
}

Result<ClientRequest> parse_client_request(std::string_view body) {
  ClientRequest request;
  Result<nlohmann::ordered_json> parsed = parse_json_bounded(body);
  if (!parsed.ok()) return invalid_argument("request body: {}", parsed.status().message());
  request.body = std::move(parsed).value();
  if (!request.body.is_object()) return invalid_argument("request body must be a JSON object");
  if (auto it = request.body.find("stream"); it != request.body.end() && !it->is_null()) {
    if (!it->is_boolean()) return invalid_argument("'stream' must be a boolean");
    request.stream = it->get<bool>();
  }
  if (auto it = request.body.find("model"); it != request.body.end() && !it->is_null()) {
    if (!it->is_string()) return invalid_argument("'model' must be a string");
    request.model = it->get<std::string>();
  }
  request.dropped_kv_transfer_params = request.body.erase("kv_transfer_params") > 0;
  return request;
}

std::string format_transfer_id(uint64_t high, uint64_t low) {
  return fmt::format("{:016x}{:016x}", high, low);
}

bool is_transfer_id(std::string_view text) {
  if (text.size() != 32) return false;
  for (char c : text) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

namespace {

// An integer (or a float with an integral value, which pdserve also takes as one) above 1.
bool is_integral_above_one(const nlohmann::ordered_json& value) {
  if (value.is_number_unsigned()) return value.get<uint64_t>() > 1;
  if (value.is_number_integer()) return value.get<int64_t>() > 1;
  if (value.is_number_float()) {
    const double number = value.get<double>();
    return std::isfinite(number) && std::floor(number) == number && number > 1;
  }
  return false;
}

}  // namespace

nlohmann::ordered_json make_producer_body(const nlohmann::ordered_json& body, std::string_view transfer_id,
                                          TransferMode mode) {
  nlohmann::ordered_json leg = body;
  leg["max_tokens"] = 1;
  if (leg.contains("max_completion_tokens")) leg["max_completion_tokens"] = 1;
  // pdserve refuses min_tokens > max_tokens, so min_tokens >= 2 would fail every P/D request.
  // On this one-token leg only min_tokens > 0 matters: it makes the first token be drawn with
  // EOS and stop ids suppressed, and engine::first_token_sampling_key hashes exactly that
  // bool, so clamping to 1 keeps the producer's key equal to the consumer's. Anything that is
  // not an integral number is left for the engine to refuse, as the consumer will.
  if (auto it = leg.find("min_tokens"); it != leg.end() && is_integral_above_one(*it)) *it = 1;
  leg["stream"] = false;
  leg.erase("stream_options");
  leg["kv_transfer_params"] = {
      {"transfer_id", transfer_id},
      {"do_remote_decode", true},
      {"mode", mode_name(mode)},
  };
  return leg;
}

nlohmann::ordered_json make_write_consumer_body(const nlohmann::ordered_json& body, std::string_view transfer_id,
                                                const InstanceInfo& producer) {
  nlohmann::ordered_json leg = body;
  leg["kv_transfer_params"] = {
      {"transfer_id", transfer_id},
      {"do_remote_prefill", true},
      {"mode", "write"},
      {"remote_instance_id", producer.instance_id},
      {"remote_control", producer.control ? producer.control->to_string() : std::string()},
      {"remote_boot_nonce", producer.boot_nonce},
  };
  return leg;
}

namespace {

bool is_non_negative_integer(const nlohmann::ordered_json& value) {
  return value.is_number_unsigned() || (value.is_number_integer() && value.get<int64_t>() >= 0);
}

}  // namespace

Result<nlohmann::ordered_json> make_read_consumer_body(const nlohmann::ordered_json& body, std::string_view transfer_id,
                                                       std::string_view producer_response_text,
                                                       std::string_view expected_producer_id) {
  Result<nlohmann::ordered_json> parsed = parse_json_bounded(producer_response_text);
  if (!parsed.ok()) return invalid_argument("producer response: {}", parsed.status().message());
  const nlohmann::ordered_json& producer_response = *parsed;
  if (!producer_response.is_object()) return invalid_argument("producer response is not a JSON object");
  auto params_it = producer_response.find("kv_transfer_params");
  if (params_it == producer_response.end() || !params_it->is_object()) {
    return invalid_argument("producer response has no kv_transfer_params object");
  }
  const nlohmann::ordered_json& params = *params_it;
  auto id_it = params.find("transfer_id");
  if (id_it == params.end() || !id_it->is_string() || id_it->get_ref<const std::string&>() != transfer_id) {
    return invalid_argument("producer kv_transfer_params.transfer_id does not match the minted {}", transfer_id);
  }
  auto require = [&](const char* key, auto check, const char* what) -> Status {
    auto it = params.find(key);
    if (it == params.end() || !check(*it))
      return invalid_argument("producer kv_transfer_params.{} must be {}", key, what);
    return Status::Ok();
  };
  PD_RETURN_IF_ERROR(require(
      "remote_instance_id", [](const nlohmann::ordered_json& v) { return v.is_string(); }, "a string"));
  PD_RETURN_IF_ERROR(require(
      "remote_control", [](const nlohmann::ordered_json& v) { return v.is_string(); }, "a string"));
  PD_RETURN_IF_ERROR(require("remote_boot_nonce", is_non_negative_integer, "an unsigned integer"));
  PD_RETURN_IF_ERROR(require(
      "block_ids", [](const nlohmann::ordered_json& v) { return v.is_array(); }, "an array"));
  PD_RETURN_IF_ERROR(require("num_tokens", is_non_negative_integer, "an unsigned integer"));
  if (!expected_producer_id.empty() &&
      params["remote_instance_id"].get_ref<const std::string&>() != expected_producer_id) {
    return invalid_argument("producer kv_transfer_params.remote_instance_id '{}' is not the chosen producer '{}'",
                            params["remote_instance_id"].get<std::string>(), expected_producer_id);
  }
  nlohmann::ordered_json leg = body;
  nlohmann::ordered_json consumer_params = params;
  consumer_params["do_remote_prefill"] = true;
  consumer_params["mode"] = "read";
  consumer_params.erase("do_remote_decode");
  leg["kv_transfer_params"] = std::move(consumer_params);
  return leg;
}

}  // namespace pd::router
