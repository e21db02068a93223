#include "server/kv_params.h"

#include "contract/transfer_params.h"

namespace pd::server {

Parsed<std::optional<contract::TransferParams>> parse_kv_params(const std::optional<nlohmann::ordered_json>& params,
                                                                int32_t num_prompt_tokens,
                                                                const KvParamsParser& parse) {
  if (!params || !parse) return std::optional<contract::TransferParams>();
  Result<contract::TransferParams> parsed = parse(nlohmann::json(*params), num_prompt_tokens);
  if (!parsed.ok()) return bad_request(parsed.status().message(), "kv_transfer_params");
  return std::optional<contract::TransferParams>(std::move(parsed).value());
}

ResponseJson kv_params_json(const contract::ProducerAnswer& answer) {
  return ResponseJson(contract::encode_producer_answer(answer));
}

}  // namespace pd::server
