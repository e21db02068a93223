#include "contract/roles.h"

namespace pd::contract {

const char* role_name(Role role) {
  switch (role) {
    case Role::kProducer:
      return "producer";
    case Role::kConsumer:
      return "consumer";
    case Role::kBoth:
      return "both";
  }
  return "?";
}

const char* mode_name(TransferMode mode) {
  return mode == TransferMode::kRead ? "read" : "write";
}

Result<Role> parse_role(std::string_view text) {
  if (text == "producer") return Role::kProducer;
  if (text == "consumer") return Role::kConsumer;
  if (text == "both") return Role::kBoth;
  return invalid_argument("role must be producer|consumer|both, got '{}'", text.substr(0, 32));
}

Result<TransferMode> parse_mode(std::string_view text) {
  if (text == "read") return TransferMode::kRead;
  if (text == "write") return TransferMode::kWrite;
  return invalid_argument("mode must be read|write, got '{}'", text.substr(0, 32));
}

}  // namespace pd::contract
