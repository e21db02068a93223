// What the router knows about one engine instance: the contract's registration
// record (src/contract/registration.h, docs/pd_contract.md "Registration"),
// learnt from a ZMQ registration (msgpack) or GET /pd/info (JSON). Everything
// from the network is validated field by field and rejected with a reason.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string_view>

#include "common/status.h"
#include "contract/address.h"
#include "contract/registration.h"
#include "contract/roles.h"

namespace pd::router {

using InstanceRole = contract::Role;
using contract::mode_name;
using contract::parse_mode;
using contract::parse_role;
using contract::role_name;
using contract::TransferMode;

using contract::HostPort;
using contract::parse_host_port;
// "http://host:port" with an optional trailing "/"; nothing else (no path, no https).
Result<HostPort> parse_http_url(std::string_view url);

using contract::kMaxInstanceIdBytes;
using contract::kMaxModelNameBytes;
using contract::kMaxParallelSize;
using contract::kMaxRegistrationBytes;

// model is empty for a static instance known only from /v1/models; everything
// the router decodes has every field.
using InstanceInfo = contract::RegistrationRecord;

// A registration message (contract::decode_registration).
inline Result<InstanceInfo> parse_registration(const void* data, size_t size) {
  return contract::decode_registration(data, size);
}

// The JSON object served at GET /pd/info (contract::registration_from_json).
inline Result<InstanceInfo> parse_instance_info_json(const nlohmann::json& object) {
  return contract::registration_from_json(object);
}

}  // namespace pd::router
