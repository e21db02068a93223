// Names of the filters and tests the interpreter implements; the parser rejects others at load,
// as jinja2 does at compile time.
#pragma once

#include <string>

namespace pd::tokenizer::jinja {

bool has_filter(const std::string& name);
bool has_test(const std::string& name);

}  // namespace pd::tokenizer::jinja
