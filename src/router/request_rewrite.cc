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
  leg["kv_transfer_params"] = contract::encode_producer_leg(contract::ProducerLeg{std::string(transfer_id), mode});
  return leg;
}

nlohmann::ordered_json make_write_consumer_body(const nlohmann::ordered_json& body, std::string_view transfer_id,
                                                const InstanceInfo& producer) {
  nlohmann::ordered_json leg = body;
  leg.erase("prompt_logprobs");
  leg["kv_transfer_params"] = contract::encode_write_consumer_leg(
      contract::WriteConsumerLeg{std::string(transfer_id), contract::producer_location(producer)});
  return leg;
}

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
  PD_ASSIGN_OR_RETURN(nlohmann::ordered_json consumer_params,
                      contract::make_read_consumer_params(*params_it, transfer_id, expected_producer_id));
  nlohmann::ordered_json leg = body;
  leg.erase("prompt_logprobs");
  leg["kv_transfer_params"] = std::move(consumer_params);
  return leg;
}

bool wants_prompt_logprobs(const nlohmann::ordered_json& body) {
  auto it = body.find("prompt_logprobs");
  return it != body.end() && !it->is_null();
}

Result<std::string> add_producer_prompt_logprobs(std::string_view consumer_answer, std::string_view producer_answer,
                                                 bool chat) {
  Result<nlohmann::ordered_json> producer = parse_json_bounded(producer_answer);
  if (!producer.ok()) return invalid_argument("producer answer: {}", producer.status().message());
  const nlohmann::ordered_json* logprobs = nullptr;
  if (producer->is_object() && chat) {
    if (auto it = producer->find("prompt_logprobs"); it != producer->end()) logprobs = &*it;
  } else if (producer->is_object()) {
    auto choices = producer->find("choices");
    if (choices != producer->end() && choices->is_array() && !choices->empty() && (*choices)[0].is_object()) {
      if (auto it = (*choices)[0].find("prompt_logprobs"); it != (*choices)[0].end()) logprobs = &*it;
    }
  }
  if (logprobs == nullptr || !logprobs->is_array())
    return invalid_argument("producer answer has no prompt_logprobs list");
  Result<nlohmann::ordered_json> consumer = parse_json_bounded(consumer_answer);
  if (!consumer.ok()) return invalid_argument("consumer answer: {}", consumer.status().message());
  if (!consumer->is_object()) return invalid_argument("consumer answer is not a JSON object");
  if (chat) {
    (*consumer)["prompt_logprobs"] = *logprobs;
  } else {
    auto choices = consumer->find("choices");
    if (choices == consumer->end() || !choices->is_array()) return invalid_argument("consumer answer has no choices");
    for (auto& choice : *choices) {
      if (!choice.is_object()) return invalid_argument("consumer answer has a choice that is not an object");
      choice["prompt_logprobs"] = *logprobs;
    }
  }
  return consumer->dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

}  // namespace pd::router
