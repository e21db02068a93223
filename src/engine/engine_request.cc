#include "engine/engine_request.h"

#include <utility>

namespace pd::engine {

Request::Request(std::string request_id, uint64_t arrival_seq, std::vector<int32_t> prompt_token_ids,
                 SamplingParams sampling, std::optional<contract::TransferParams> kv_transfer_params,
                 int64_t arrival_ns, uint64_t rng_base_seed, int32_t max_output_tokens)
    : request_id_(std::move(request_id)),
      arrival_seq_(arrival_seq),
      token_ids_(std::move(prompt_token_ids)),
      num_prompt_tokens_(static_cast<int32_t>(token_ids_.size())),
      sampling_(std::move(sampling)),
      kv_transfer_params_(std::move(kv_transfer_params)),
      arrival_ns_(arrival_ns),
      rng_base_seed_(rng_base_seed),
      max_output_tokens_(max_output_tokens) {
  external_kv_eligible = kv_transfer_params_.has_value();
}

bool is_valid_transition(RequestState from, RequestState to) {
  using S = RequestState;
  switch (from) {
    case S::kWaiting:
      return to == S::kWaitingForRemoteKv || to == S::kRunning || to == S::kFinishedAborted || to == S::kFinishedError;
    case S::kWaitingForRemoteKv:
      return to == S::kWaiting || to == S::kFinishedAborted || to == S::kFinishedError;
    case S::kRunning:
      return to == S::kPreempted || to == S::kFinishedStopped || to == S::kFinishedLength ||
             to == S::kFinishedAborted || to == S::kFinishedError;
    case S::kPreempted:
      return to == S::kWaiting || to == S::kFinishedAborted || to == S::kFinishedError;
    case S::kFinishedStopped:
    case S::kFinishedLength:
    case S::kFinishedAborted:
    case S::kFinishedError:
      return false;
  }
  return false;
}

Status Request::transition_to(RequestState next) {
  if (!is_valid_transition(state_, next)) {
    return internal_error("request {}: illegal state transition {} -> {}", request_id_, request_state_name(state_),
                          request_state_name(next));
  }
  state_ = next;
  return Status::Ok();
}

}  // namespace pd::engine
