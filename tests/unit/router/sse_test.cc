#include "router/sse.h"

#include <gtest/gtest.h>

#include <string>
#include <string_view>

namespace pd::router {
namespace {

TEST(FindEventEnd, FindsTheFirstBlankLine) {
  EXPECT_FALSE(find_event_end("data: {\"a\":1}\n").has_value());
  EXPECT_EQ(find_event_end("data: x\n\ndata: y\n\n"), 9u);
  EXPECT_EQ(find_event_end("data: x\r\n\r\nrest"), 11u);
}

// An error event exactly as pdserve writes it (server::ApiError::to_json, then "data: ...\n\n").
std::string pdserve_error_event(std::string_view type, std::string_view code) {
  return "data: {\"error\":{\"message\":\"x\",\"type\":\"" + std::string(type) + "\",\"param\":null,\"code\":\"" +
         std::string(code) + "\"}}\n\n";
}

TEST(ErrorEventStatus, RecognisesOpenAiErrorEventsOnly) {
  EXPECT_FALSE(error_event_status("data: {\"choices\":[]}\n\n").has_value());
  EXPECT_FALSE(error_event_status("data: [DONE]\n\n").has_value());
  EXPECT_FALSE(error_event_status("data: {\"error\":null,\"choices\":[]}\n\n").has_value());
}

TEST(ErrorEventStatus, MapsPdservesStringCodesToPdservesStatuses) {
  EXPECT_EQ(error_event_status(pdserve_error_event("timeout_error", "timeout")), 504);
  EXPECT_EQ(error_event_status(pdserve_error_event("internal_error", "internal_error")), 500);
  EXPECT_EQ(error_event_status(pdserve_error_event("invalid_request_error", "invalid_value")), 400);
  EXPECT_EQ(error_event_status(pdserve_error_event("service_unavailable", "engine_overloaded")), 503);
  EXPECT_EQ(error_event_status(pdserve_error_event("service_unavailable", "unavailable")), 503);
  EXPECT_EQ(error_event_status(pdserve_error_event("timeout_error", "deadline_exceeded")), 504);
  EXPECT_EQ(error_event_status(pdserve_error_event("authentication_error", "invalid_api_key")), 401);
  EXPECT_EQ(error_event_status(pdserve_error_event("permission_error", "permission_denied")), 403);
  EXPECT_EQ(error_event_status(pdserve_error_event("invalid_request_error", "model_not_found")), 404);
  EXPECT_EQ(error_event_status(pdserve_error_event("invalid_request_error", "not_found")), 404);
  EXPECT_EQ(error_event_status(pdserve_error_event("invalid_request_error", "method_not_allowed")), 405);
  EXPECT_EQ(error_event_status(pdserve_error_event("invalid_request_error", "request_too_large")), 413);
}

TEST(ErrorEventStatus, KeepsIntegerCodesAndDefaultsTo502) {
  EXPECT_EQ(error_event_status("data: {\"error\":{\"message\":\"x\",\"code\":503}}\n\n"), 503);
  EXPECT_EQ(error_event_status("data: {\"error\":{\"message\":\"x\",\"code\":200}}\n\n"), 502);
  EXPECT_EQ(error_event_status("data: {\"error\":{\"message\":\"x\",\"code\":4294967696}}\n\n"), 502);
  EXPECT_EQ(error_event_status(pdserve_error_event("server_error", "oops")), 502);
  EXPECT_EQ(error_event_status("data: {\"error\":{\"message\":\"x\",\"code\":null}}\n\n"), 502);
  EXPECT_EQ(error_event_status("data: {\"error\":\"boom\"}\n\n"), 502);
}

}  // namespace
}  // namespace pd::router
