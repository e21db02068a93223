#include "engine/generate_api.h"

namespace pd::engine {

bool is_finished(RequestState state) {
  return state >= RequestState::kFinishedStopped;
}

const char* request_state_name(RequestState state) {
  switch (state) {
    case RequestState::kWaiting:
      return "waiting";
    case RequestState::kWaitingForRemoteKv:
      return "waiting_for_remote_kv";
    case RequestState::kRunning:
      return "running";
    case RequestState::kPreempted:
      return "preempted";
    case RequestState::kFinishedStopped:
      return "finished_stopped";
    case RequestState::kFinishedLength:
      return "finished_length";
    case RequestState::kFinishedAborted:
      return "finished_aborted";
    case RequestState::kFinishedError:
      return "finished_error";
  }
  return "unknown";
}

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kNone:
      return nullptr;
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kAbort:
      return "abort";
    case FinishReason::kError:
      return "error";
  }
  return nullptr;
}

}  // namespace pd::engine
