#include "connector/transfer_params.h"

#include "connector/messages.h"

namespace pd::connector {
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

}  // namespace

Result<TransferParams> parse_transfer_params(const json& params, const KvTransferConfig& config,
                                             int32_t num_prompt_tokens, int32_t block_size) {
  if (!params.is_object()) return invalid_argument("kv_transfer_params must be an object");
  if (params.size() > 32) return invalid_argument("kv_transfer_params has {} keys (limit 32)", params.size());
  TransferParams out;
  PD_ASSIGN_OR_RETURN(bool remote_decode, optional_bool(params, "do_remote_decode"));
  PD_ASSIGN_OR_RETURN(bool remote_prefill, optional_bool(params, "do_remote_prefill"));
  if (remote_decode == remote_prefill) {
    return invalid_argument("kv_transfer_params: exactly one of do_remote_decode / do_remote_prefill must be true");
  }
  out.side = remote_decode ? TransferSide::kProducer : TransferSide::kConsumer;
  if (out.side == TransferSide::kProducer && !config.is_producer()) {
    return invalid_argument("kv_transfer_params: do_remote_decode sent to a {} instance",
                            kv_role_short_name(config.role));
  }
  if (out.side == TransferSide::kConsumer && !config.is_consumer()) {
    return invalid_argument("kv_transfer_params: do_remote_prefill sent to a {} instance",
                            kv_role_short_name(config.role));
  }
  PD_ASSIGN_OR_RETURN(out.transfer_id, required_string(params, "transfer_id", 32));
  if (!is_valid_transfer_id(out.transfer_id)) {
    return invalid_argument("kv_transfer_params.transfer_id must be 32 hex digits");
  }
  out.read_mode = config.read_mode;
  if (auto mode = params.find("mode"); mode != params.end() && !mode->is_null()) {
    if (!mode->is_string() || (*mode != "read" && *mode != "write")) {
      return invalid_argument("kv_transfer_params.mode must be \"read\" or \"write\"");
    }
    out.read_mode = *mode == "read";
  }
  if (out.side == TransferSide::kProducer) return out;

  PD_ASSIGN_OR_RETURN(out.remote_instance_id, required_string(params, "remote_instance_id", kMaxInstanceIdBytes));
  PD_ASSIGN_OR_RETURN(out.remote_control, required_string(params, "remote_control", 64));
  if (auto split = split_host_port(out.remote_control); !split.ok()) {
    return invalid_argument("kv_transfer_params.remote_control: {}", split.status().message());
  }
  if (!peer_allowed(config.allowed_peers, out.remote_control)) {
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
  const int64_t num_tokens = tokens->get<int64_t>();
  if (num_tokens != num_prompt_tokens) {
    return invalid_argument("kv_transfer_params.num_tokens is {} but the prompt has {} tokens", num_tokens,
                            num_prompt_tokens);
  }
  out.num_tokens = static_cast<int32_t>(num_tokens);
  auto ids = params.find("block_ids");
  if (ids == params.end() || !ids->is_array()) return invalid_argument("kv_transfer_params.block_ids must be an array");
  const size_t expected = static_cast<size_t>(blocks_for_tokens(out.num_tokens, block_size));
  if (ids->size() != expected) {
    return invalid_argument("kv_transfer_params.block_ids has {} ids, {} tokens need {}", ids->size(), num_tokens,
                            expected);
  }
  for (const auto& id : *ids) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX) {
      return invalid_argument("kv_transfer_params.block_ids must hold non-negative int32 block ids");
    }
    out.remote_block_ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
  }
  return out;
}

}  // namespace pd::connector
