// The server's error vocabulary is the front end's (src/frontend/api_error.h): one shape, type,
// code and status per kind of error for pdserve and pdrouter alike. Named here so the OpenAI
// layer writes them unqualified.
#pragma once

#include "frontend/api_error.h"

namespace pd::server {

using frontend::api_error_from_status;
using frontend::ApiError;
using frontend::bad_request;
using frontend::body_too_large;
using frontend::conflict;
using frontend::internal;
using frontend::method_not_allowed;
using frontend::model_not_found;
using frontend::overloaded;
using frontend::request_timeout;
using frontend::route_not_found;
using frontend::too_many_connections;
using frontend::unauthorized;
using frontend::unsupported;

}  // namespace pd::server
