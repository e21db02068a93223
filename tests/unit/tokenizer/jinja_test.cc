#include "tokenizer/jinja.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

namespace pd::tokenizer::jinja {
namespace {

using ojson = nlohmann::ordered_json;

Result<std::string> render(std::string_view source, const ojson& context = ojson::object()) {
  PD_ASSIGN_OR_RETURN(auto tmpl, Template::parse(source));
  return tmpl->render(context);
}

std::string render_ok(std::string_view source, const ojson& context = ojson::object()) {
  auto out = render(source, context);
  EXPECT_TRUE(out.ok()) << out.status().to_string();
  return out.ok() ? *out : std::string();
}

// Each line of jinja_reference_cases.jsonl holds [name, template, context, output of jinja2 configured
// as transformers configures it] (see make_jinja_reference_cases.py).
TEST(JinjaTest, MatchesJinja2OnReferenceCases) {
  const char* root = std::getenv("PDSERVE_SOURCE_DIR");
  std::ifstream in(std::filesystem::path(root != nullptr ? root : ".") /
                   "tests/unit/tokenizer/jinja_reference_cases.jsonl");
  ASSERT_TRUE(in.good());
  std::string line;
  int checked = 0;
  while (std::getline(in, line)) {
    const ojson c = ojson::parse(line);
    SCOPED_TRACE(c[0].get<std::string>());
    EXPECT_EQ(render_ok(c[1].get<std::string>(), c[2]), c[3].get<std::string>());
    ++checked;
  }
  EXPECT_GE(checked, 20);
}

TEST(JinjaTest, TrimBlocksAndLstripBlocksAreOn) {
  EXPECT_EQ(render_ok("  {% if true %}\nx\n  {% endif %}\ny"), "x\ny");
  // "+" keeps the whitespace lstrip_blocks would remove.
  EXPECT_EQ(render_ok("  {%+ if true %}x{% endif %}"), "  x");
}

TEST(JinjaTest, RaiseExceptionIsInvalidArgumentWithTheMessage) {
  auto out = render("{{ raise_exception('bad role: ' ~ role) }}", {{"role", "robot"}});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(out.status().message().find("bad role: robot"), std::string::npos) << out.status().message();
}

TEST(JinjaTest, UnsupportedConstructsFailAtParseNamingConstructAndPosition) {
  struct Case {
    const char* source;
    const char* construct;
    const char* position;
  };
  for (const Case& c : {Case{"x\n  {% extends 'base' %}", "extends", "line 2 column 6"},
                        Case{"{{ x | frobnicate }}", "frobnicate", "line 1 column 8"},
                        Case{"{% if x is prime %}{% endif %}", "prime", "line 1 column 12"},
                        Case{"{% for x in y recursive %}{% endfor %}", "recursive", "line 1"},
                        Case{"{% raw %}x{% endraw %}", "raw", "line 1"}}) {
    auto parsed = Template::parse(c.source);
    ASSERT_FALSE(parsed.ok()) << c.source;
    EXPECT_EQ(parsed.status().code(), ErrorCode::kUnimplemented) << c.source;
    EXPECT_NE(parsed.status().message().find(c.construct), std::string::npos) << parsed.status().message();
    EXPECT_NE(parsed.status().message().find(c.position), std::string::npos) << parsed.status().message();
  }
}

TEST(JinjaTest, SyntaxErrorsNameTheirPosition) {
  auto parsed = Template::parse("ok\n{% if x %}never closed");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(parsed.status().message().find("endif"), std::string::npos) << parsed.status().message();
  auto bad_expr = Template::parse("{{ 1 + }}");
  ASSERT_FALSE(bad_expr.ok());
  EXPECT_NE(bad_expr.status().message().find("line 1"), std::string::npos);
}

TEST(JinjaTest, ListMutationIsRejectedAsInTheImmutableSandbox) {
  auto out = render("{% set xs = [] %}{{ xs.append(1) }}");
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.status().message().find("unsafe"), std::string::npos);
}

TEST(JinjaTest, AttributeOfUndefinedIsAnErrorButMissingKeyIsUndefined) {
  EXPECT_EQ(render_ok("{{ d.missing }}|{{ d.missing is defined }}", {{"d", ojson::object()}}), "|False");
  auto out = render("{{ nothing.attr }}");
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.status().message().find("nothing"), std::string::npos);
}

TEST(JinjaTest, RunawayTemplatesHitLimitsInsteadOfHanging) {
  auto recursion = render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
  ASSERT_FALSE(recursion.ok());
  EXPECT_EQ(recursion.status().code(), ErrorCode::kResourceExhausted);
  auto big_range = render("{% for i in range(1000000000) %}x{% endfor %}");
  ASSERT_FALSE(big_range.ok());
  auto tmpl = Template::parse("{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}");
  ASSERT_TRUE(tmpl.ok());
  RenderLimits limits;
  limits.max_steps = 20'000;
  auto nested = (*tmpl)->render(ojson::object(), limits);
  ASSERT_FALSE(nested.ok());
  EXPECT_EQ(nested.status().code(), ErrorCode::kResourceExhausted);
  limits.max_output_bytes = 10;
  auto long_output = (*Template::parse("{{ 'x' * 11 }}"))->render(ojson::object(), limits);
  ASSERT_FALSE(long_output.ok());
  EXPECT_EQ(long_output.status().code(), ErrorCode::kResourceExhausted);
}

TEST(JinjaTest, StrftimeNowFormatsTheCurrentDate) {
  const std::string year = render_ok("{{ strftime_now('%Y') }}");
  ASSERT_EQ(year.size(), 4u);
  EXPECT_GE(std::stoi(year), 2024);
}

}  // namespace
}  // namespace pd::tokenizer::jinja
