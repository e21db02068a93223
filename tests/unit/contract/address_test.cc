#include "contract/address.h"

#include <gtest/gtest.h>

namespace pd::contract {
namespace {

TEST(HostPort, ParsesAndPrintsBackIPv4NamesAndBracketedIPv6) {
  for (const char* text : {"127.0.0.1:8100", "node-7.example:1", "[::1]:65535", "[fe80::1]:443"}) {
    auto parsed = parse_host_port(text);
    ASSERT_TRUE(parsed.ok()) << text << ": " << parsed.status().to_string();
    EXPECT_EQ(parsed->to_string(), text);
  }
  EXPECT_EQ(*parse_host_port("[::1]:80"), (HostPort{"::1", 80}));
}

TEST(HostPort, RefusesWhatWouldNotPrintBackOrConnect) {
  for (const char* text : {"", "127.0.0.1", ":80", "host:", "host:0", "host:65536", "host:8a", "host:+80", "::1:80",
                           "[name]:80", "[::1]80", "[::1]:", "a b:80", "a/b:80", "[[1]:9", "host:-1"}) {
    auto parsed = parse_host_port(text);
    ASSERT_FALSE(parsed.ok()) << text;
    EXPECT_EQ(parsed.status().code(), ErrorCode::kInvalidArgument) << text;
  }
  EXPECT_FALSE(parse_host_port(std::string(254, 'h') + ":80").ok());
  EXPECT_TRUE(parse_host_port(std::string(253, 'h') + ":80").ok());
}

TEST(Text, PrintableAsciiExcludesSpacesAndControls) {
  EXPECT_TRUE(is_printable_ascii("p0-node_7.x~!"));
  EXPECT_FALSE(is_printable_ascii("p 0"));
  EXPECT_FALSE(is_printable_ascii("p\t0"));
  EXPECT_FALSE(is_printable_ascii("p\x7f"));
  EXPECT_FALSE(is_printable_ascii("\xc3\xa9"));
}

TEST(Text, Utf8RefusesOverlongSurrogatesAndTruncation) {
  EXPECT_TRUE(is_valid_utf8("plain"));
  EXPECT_TRUE(is_valid_utf8("\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80"));  // é € 😀
  EXPECT_FALSE(is_valid_utf8("\xc0\xaf"));                             // overlong '/'
  EXPECT_FALSE(is_valid_utf8("\xe0\x80\xaf"));                         // overlong, 3 bytes
  EXPECT_FALSE(is_valid_utf8("\xed\xa0\x80"));                         // surrogate
  EXPECT_FALSE(is_valid_utf8("\xf4\x90\x80\x80"));                     // above U+10FFFF
  EXPECT_FALSE(is_valid_utf8("\xe2\x82"));                             // truncated
  EXPECT_FALSE(is_valid_utf8("\xff"));
}

}  // namespace
}  // namespace pd::contract
