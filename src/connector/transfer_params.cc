#include "connector/transfer_params.h"

namespace pd::connector {

Result<TransferParams> parse_transfer_params(const nlohmann::json& params, const KvTransferConfig& config,
                                             int32_t num_prompt_tokens, int32_t block_size) {
  contract::EngineContext context;
  context.role = config.role;
  context.default_mode = config.read_mode ? contract::TransferMode::kRead : contract::TransferMode::kWrite;
  context.num_prompt_tokens = num_prompt_tokens;
  context.block_size = block_size;
  context.peer_allowed = [&config](std::string_view host_port) {
    return peer_allowed(config.allowed_peers, host_port);
  };
  return contract::parse_transfer_params(params, context);
}

}  // namespace pd::connector
