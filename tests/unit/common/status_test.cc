#include "common/status.h"

#include <gtest/gtest.h>

namespace pd {
namespace {

Result<int> parse_positive(int value) {
  if (value <= 0) return invalid_argument("expected a positive number, got {}", value);
  return value;
}

Result<int> doubled(int value) {
  PD_ASSIGN_OR_RETURN(int parsed, parse_positive(value));
  return parsed * 2;
}

TEST(Status, ErrorCarriesCodeAndFormattedMessage) {
  Status status = invalid_argument("block id {} out of range [0, {})", 7, 4);
  EXPECT_FALSE(status.ok());
  EXPECT_EQ(status.code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(status.to_string(), "INVALID_ARGUMENT: block id 7 out of range [0, 4)");
  EXPECT_EQ(status.with_context("transfer 3").message(), "transfer 3: block id 7 out of range [0, 4)");
}

TEST(Status, AssignOrReturnPropagatesErrorsAndValues) {
  EXPECT_EQ(doubled(21).value(), 42);
  auto failed = doubled(-1);
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(failed.status().message().find("-1"), std::string::npos);
}

}  // namespace
}  // namespace pd
