#include "contract/transfer_params.h"

#include <cstdint>

#include "contract/address.h"

namespace pd::contract {

std::string format_transfer_id(uint64_t high, uint64_t low) {
  return fmt::format("{:016x}{:016x}", high, low);
}

bool is_minted_transfer_id(std::string_view text) {
  if (text.size() != kTransferIdChars) return false;
  for (char c : text) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

bool is_transfer_id(std::string_view text) {
  if (text.size() != kTransferIdChars) return false;
  for (char c : text) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'))) return false;
  }
  return true;
}

nlohmann::ordered_json encode_producer_leg(const ProducerLeg& leg) {
  return {
      {"transfer_id", leg.transfer_id},
      {"do_remote_decode", true},
      {"mode", mode_name(leg.mode)},
  };
}

nlohmann::ordered_json encode_write_consumer_leg(const WriteConsumerLeg& leg) {
  return {
      {"transfer_id", leg.transfer_id},          {"do_remote_prefill", true},
      {"mode", mode_name(TransferMode::kWrite)}, {"remote_instance_id", leg.producer.instance_id},
      {"remote_control", leg.producer.control},  {"remote_boot_nonce", leg.producer.boot_nonce},
  };
}

nlohmann::json encode_producer_answer(const ProducerAnswer& answer) {
  nlohmann::json params{{"transfer_id", answer.transfer_id},
                        {"remote_instance_id", answer.producer.instance_id},
                        {"remote_control", answer.producer.control},
                        {"remote_boot_nonce", answer.producer.boot_nonce},
                        {"mode", mode_name(answer.mode)},
                        {"num_tokens", answer.num_tokens}};
  if (answer.block_ids) params["block_ids"] = *answer.block_ids;
  return params;
}

namespace {

bool is_non_negative_integer(const nlohmann::ordered_json& value) {
  return value.is_number_unsigned() || (value.is_number_integer() && value.get<int64_t>() >= 0);
}

}  // namespace

Status check_producer_answer(const nlohmann::ordered_json& params, std::string_view minted_transfer_id,
                             std::string_view expected_producer_id) {
  if (!params.is_object()) return invalid_argument("producer kv_transfer_params must be an object");
  auto id_it = params.find("transfer_id");
  if (id_it == params.end() || !id_it->is_string() || id_it->get_ref<const std::string&>() != minted_transfer_id) {
    return invalid_argument("producer kv_transfer_params.transfer_id does not match the minted {}", minted_transfer_id);
  }
  auto require = [&](const char* key, auto check, const char* what) -> Status {
    auto it = params.find(key);
    if (it == params.end() || !check(*it)) {
      return invalid_argument("producer kv_transfer_params.{} must be {}", key, what);
    }
    return Status::Ok();
  };
  auto is_string = [](const nlohmann::ordered_json& v) { return v.is_string(); };
  auto is_array = [](const nlohmann::ordered_json& v) { return v.is_array(); };
  PD_RETURN_IF_ERROR(require("remote_instance_id", is_string, "a string"));
  PD_RETURN_IF_ERROR(require("remote_control", is_string, "a string"));
  PD_RETURN_IF_ERROR(require("remote_boot_nonce", is_non_negative_integer, "an unsigned integer"));
  PD_RETURN_IF_ERROR(require("block_ids", is_array, "an array"));
  PD_RETURN_IF_ERROR(require("num_tokens", is_non_negative_integer, "an unsigned integer"));
  const auto& producer_id = params["remote_instance_id"].get_ref<const std::string&>();
  if (!expected_producer_id.empty() && producer_id != expected_producer_id) {
    return invalid_argument("producer kv_transfer_params.remote_instance_id '{}' is not the chosen producer '{}'",
                            producer_id, expected_producer_id);
  }
  return Status::Ok();
}

Result<nlohmann::ordered_json> make_read_consumer_params(const nlohmann::ordered_json& producer_params,
                                                         std::string_view minted_transfer_id,
                                                         std::string_view expected_producer_id) {
  PD_RETURN_IF_ERROR(check_producer_answer(producer_params, minted_transfer_id, expected_producer_id));
  nlohmann::ordered_json params = producer_params;
  params["do_remote_prefill"] = true;
  params["mode"] = mode_name(TransferMode::kRead);
  params.erase("do_remote_decode");
  return params;
}

namespace {

using nlohmann::json;

Result<bool> optional_bool(const json& params, const char* key) {
  auto it = params.find(key);
  if (it == params.end() || it->is_null()) return false;
  if (!it->is_boolean()) return invalid_argument("kv_transfer_params.{} must be a boolean", key);
  return it->get<bool>();
}

Result<std::string> required_string(const json& params, const char* key, size_t max_bytes) {
  auto it = params.find(key);
  if (it == params.end() || !it->is_string()) return invalid_argument("kv_transfer_params.{} must be a string", key);
  const auto& text = it->get_ref<const std::string&>();
  if (text.empty() || text.size() > max_bytes) {
    return invalid_argument("kv_transfer_params.{} must be 1..{} bytes", key, max_bytes);
  }
  return text;
}

bool takes_producer_side(Role role) {
  return role != Role::kConsumer;
}
bool takes_consumer_side(Role role) {
  return role != Role::kProducer;
}

}  // namespace

Result<TransferParams> parse_transfer_params(const json& params, const EngineContext& context) {
  if (!params.is_object()) return invalid_argument("kv_transfer_params must be an object");
  if (params.size() > kMaxParamsKeys) {
    return invalid_argument("kv_transfer_params has {} keys (limit {})", params.size(), kMaxParamsKeys);
  }
  TransferParams out;
  PD_ASSIGN_OR_RETURN(bool remote_decode, optional_bool(params, "do_remote_decode"));
  PD_ASSIGN_OR_RETURN(bool remote_prefill, optional_bool(params, "do_remote_prefill"));
  if (remote_decode == remote_prefill) {
    return invalid_argument("kv_transfer_params: exactly one of do_remote_decode / do_remote_prefill must be true");
  }
  out.side = remote_decode ? TransferSide::kProducer : TransferSide::kConsumer;
  if (out.side == TransferSide::kProducer && !takes_producer_side(context.role)) {
    return invalid_argument("kv_transfer_params: do_remote_decode sent to a {} instance", role_name(context.role));
  }
  if (out.side == TransferSide::kConsumer && !takes_consumer_side(context.role)) {
    return invalid_argument("kv_transfer_params: do_remote_prefill sent to a {} instance", role_name(context.role));
  }
  PD_ASSIGN_OR_RETURN(out.transfer_id, required_string(params, "transfer_id", kTransferIdChars));
  if (!is_transfer_id(out.transfer_id)) {
    return invalid_argument("kv_transfer_params.transfer_id must be 32 hex digits");
  }
  out.read_mode = context.default_mode == TransferMode::kRead;
  if (auto mode = params.find("mode"); mode != params.end() && !mode->is_null()) {
    if (!mode->is_string() || (*mode != "read" && *mode != "write")) {
      return invalid_argument("kv_transfer_params.mode must be \"read\" or \"write\"");
    }
    out.read_mode = *mode == "read";
  }
  if (out.side == TransferSide::kProducer) return out;

  PD_ASSIGN_OR_RETURN(out.remote_instance_id, required_string(params, "remote_instance_id", kMaxInstanceIdBytes));
  PD_ASSIGN_OR_RETURN(out.remote_control, required_string(params, "remote_control", kMaxRemoteControlBytes));
  if (auto address = parse_host_port(out.remote_control); !address.ok()) {
    return invalid_argument("kv_transfer_params.remote_control: {}", address.status().message());
  }
  if (context.peer_allowed && !context.peer_allowed(out.remote_control)) {
    return invalid_argument("kv_transfer_params.remote_control {} is not an allowed peer (see allowed_peers)",
                            out.remote_control);
  }
  auto nonce = params.find("remote_boot_nonce");
  if (nonce == params.end() || !nonce->is_number_unsigned()) {
    return invalid_argument("kv_transfer_params.remote_boot_nonce must be an unsigned integer");
  }
  out.remote_boot_nonce = nonce->get<uint64_t>();
  if (!out.read_mode) return out;

  auto tokens = params.find("num_tokens");
  if (tokens == params.end() || !tokens->is_number_integer()) {
    return invalid_argument("kv_transfer_params.num_tokens must be an integer");
  }
  const bool matches_prompt = tokens->is_number_unsigned()
                                  ? tokens->get<uint64_t>() == static_cast<uint64_t>(context.num_prompt_tokens)
                                  : tokens->get<int64_t>() == context.num_prompt_tokens;
  if (!matches_prompt || context.num_prompt_tokens < 0) {
    return invalid_argument("kv_transfer_params.num_tokens is {} but the prompt has {} tokens", tokens->dump(),
                            context.num_prompt_tokens);
  }
  out.num_tokens = context.num_prompt_tokens;
  auto ids = params.find("block_ids");
  if (ids == params.end() || !ids->is_array()) return invalid_argument("kv_transfer_params.block_ids must be an array");
  const size_t expected = static_cast<size_t>(blocks_for_tokens(out.num_tokens, context.block_size));
  if (ids->size() != expected) {
    return invalid_argument("kv_transfer_params.block_ids has {} ids, {} tokens need {}", ids->size(), out.num_tokens,
                            expected);
  }
  out.remote_block_ids.reserve(expected);
  for (const auto& id : *ids) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX) {
      return invalid_argument("kv_transfer_params.block_ids must hold non-negative int32 block ids");
    }
    out.remote_block_ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
  }
  return out;
}

}  // namespace pd::contract
