#include "router/sse.h"

#include <gtest/gtest.h>

namespace pd::router {
namespace {

TEST(FindEventEnd, FindsTheFirstBlankLine) {
  EXPECT_FALSE(find_event_end("data: {\"a\":1}\n").has_value());
  EXPECT_EQ(find_event_end("data: x\n\ndata: y\n\n"), 9u);
  EXPECT_EQ(find_event_end("data: x\r\n\r\nrest"), 11u);
}

TEST(ErrorEventStatus, RecognisesOpenAiErrorEventsOnly) {
  EXPECT_FALSE(error_event_status("data: {\"choices\":[]}\n\n").has_value());
  EXPECT_FALSE(error_event_status("data: [DONE]\n\n").has_value());
  EXPECT_EQ(error_event_status("data: {\"error\":{\"message\":\"x\",\"code\":503}}\n\n"), 503);
  EXPECT_EQ(error_event_status("data: {\"error\":{\"message\":\"x\",\"code\":\"oops\"}}\n\n"), 502);
  EXPECT_EQ(error_event_status("data: {\"error\":\"boom\"}\n\n"), 502);
  EXPECT_FALSE(error_event_status("data: {\"error\":null,\"choices\":[]}\n\n").has_value());
}

}  // namespace
}  // namespace pd::router
