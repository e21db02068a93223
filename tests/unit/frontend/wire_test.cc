#include "frontend/wire.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <boost/asio/error.hpp>
#include <boost/beast/core/error.hpp>
#include <boost/beast/http/error.hpp>

namespace pd::frontend {
namespace {

TEST(PathOf, DropsTheQueryString) {
  EXPECT_EQ(path_of("/v1/models?x=1&y=2"), "/v1/models");
  EXPECT_EQ(path_of("/health"), "/health");
  EXPECT_EQ(path_of("/?"), "/");
  EXPECT_EQ(path_of(""), "");
}

TEST(BearerAuthorized, AnyRequestPassesWithoutAKey) {
  EXPECT_TRUE(bearer_authorized("", ""));
  EXPECT_TRUE(bearer_authorized("Basic abc", ""));
}

TEST(BearerAuthorized, OnlyTheExactBearerKeyPasses) {
  EXPECT_TRUE(bearer_authorized("Bearer secret", "secret"));
  EXPECT_FALSE(bearer_authorized("", "secret"));
  EXPECT_FALSE(bearer_authorized("Bearer secreT", "secret"));
  EXPECT_FALSE(bearer_authorized("Bearer secret2", "secret"));
  EXPECT_FALSE(bearer_authorized("Bearer secre", "secret"));
  EXPECT_FALSE(bearer_authorized("bearer secret", "secret"));
  EXPECT_FALSE(bearer_authorized("Bearer  secret", "secret"));
  EXPECT_FALSE(bearer_authorized("secret", "secret"));
}

TEST(ClassifyReadError, AClientThatLeftIsClosedSilently) {
  namespace net = boost::asio;
  EXPECT_EQ(classify_read_error(http::error::end_of_stream), ReadFailure::kClosed);
  EXPECT_EQ(classify_read_error(net::error::eof), ReadFailure::kClosed);
  EXPECT_EQ(classify_read_error(boost::beast::error::timeout), ReadFailure::kClosed);
  EXPECT_EQ(classify_read_error(net::error::connection_reset), ReadFailure::kClosed);
  EXPECT_EQ(classify_read_error(net::error::operation_aborted), ReadFailure::kClosed);
}

TEST(ClassifyReadError, ABodyOverTheLimitIsTooLargeAndBrokenFramingIsMalformed) {
  EXPECT_EQ(classify_read_error(http::error::body_limit), ReadFailure::kTooLarge);
  EXPECT_EQ(classify_read_error(http::error::header_limit), ReadFailure::kMalformed);
  EXPECT_EQ(classify_read_error(http::error::bad_method), ReadFailure::kMalformed);
  EXPECT_EQ(classify_read_error(http::error::bad_chunk), ReadFailure::kMalformed);
}

TEST(ErrorResponse, CarriesTheNestedOpenAiErrorAndItsStatus) {
  const Response response = error_response(body_too_large(100), 11, false, "pdserve");
  EXPECT_EQ(response.result_int(), 413);
  EXPECT_EQ(response[http::field::content_type], "application/json");
  EXPECT_EQ(response[http::field::server], "pdserve");
  EXPECT_FALSE(response.keep_alive());
  const nlohmann::json body = nlohmann::json::parse(response.body());
  EXPECT_EQ(body["error"]["type"], "invalid_request_error");
  EXPECT_EQ(body["error"]["code"], "request_too_large");
  EXPECT_TRUE(body["error"]["param"].is_null());
  EXPECT_NE(body["error"]["message"].get<std::string>().find("100 bytes"), std::string::npos);
  EXPECT_EQ(response[http::field::content_length], std::to_string(response.body().size()));
}

TEST(ErrorResponse, WithoutAServerNameThereIsNoServerHeader) {
  const Response response = error_response(too_many_connections(8), 10, true, "");
  EXPECT_EQ(response.result_int(), 503);
  EXPECT_EQ(response.version(), 10u);
  EXPECT_EQ(response.count(http::field::server), 0u);
  const nlohmann::json body = nlohmann::json::parse(response.body());
  EXPECT_EQ(body["error"]["type"], "service_unavailable");
  EXPECT_EQ(body["error"]["code"], "too_many_connections");
  EXPECT_NE(body["error"]["message"].get<std::string>().find("--max-connections"), std::string::npos);
}

TEST(ApiErrorText, InvalidUtf8FromAClientBecomesReplacementCharacters) {
  const std::string text = route_not_found("/bad\xff").to_text();
  const nlohmann::json body = nlohmann::json::parse(text);
  EXPECT_EQ(body["error"]["message"], "No route for /bad\xEF\xBF\xBD");
  EXPECT_EQ(body["error"]["code"], "not_found");
}

}  // namespace
}  // namespace pd::frontend
