#include "contract/roles.h"

#include <gtest/gtest.h>

namespace pd::contract {
namespace {

TEST(Roles, EveryRoleRoundTripsThroughItsName) {
  for (Role role : {Role::kProducer, Role::kConsumer, Role::kBoth}) {
    auto parsed = parse_role(role_name(role));
    ASSERT_TRUE(parsed.ok()) << role_name(role);
    EXPECT_EQ(*parsed, role);
  }
  EXPECT_STREQ(role_name(Role::kProducer), "producer");
  EXPECT_STREQ(role_name(Role::kConsumer), "consumer");
  EXPECT_STREQ(role_name(Role::kBoth), "both");
}

TEST(Roles, EveryModeRoundTripsThroughItsName) {
  for (TransferMode mode : {TransferMode::kRead, TransferMode::kWrite}) {
    auto parsed = parse_mode(mode_name(mode));
    ASSERT_TRUE(parsed.ok()) << mode_name(mode);
    EXPECT_EQ(*parsed, mode);
  }
  EXPECT_STREQ(mode_name(TransferMode::kRead), "read");
  EXPECT_STREQ(mode_name(TransferMode::kWrite), "write");
}

TEST(Roles, OnlyTheExactSpellingsAreAccepted) {
  for (const char* text : {"", "Producer", "kv_producer", "prefill", "producer ", " both"}) {
    EXPECT_FALSE(parse_role(text).ok()) << text;
  }
  for (const char* text : {"", "READ", "push", "pull", "write "}) {
    EXPECT_FALSE(parse_mode(text).ok()) << text;
  }
  auto refused = parse_role("kv_consumer");
  EXPECT_EQ(refused.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("kv_consumer"), std::string::npos);
}

TEST(Roles, ARefusalQuotesAtMost32BytesOfTheText) {
  const std::string huge(10'000, 'x');
  auto refused = parse_mode(huge);
  ASSERT_FALSE(refused.ok());
  EXPECT_LT(refused.status().message().size(), 100u);
}

}  // namespace
}  // namespace pd::contract
