// Nesting depth of JSON text, counted before parsing. nlohmann parses iteratively but copies,
// compares and serialises values recursively (one stack frame per level), so every parser of
// outside JSON (server request bodies, router bodies and producer answers) bounds the depth
// first: a 2 MB body of brackets would otherwise overflow the stack later.
#pragma once

#include <cstddef>
#include <string_view>

namespace pd {

// Deepest [ / { nesting in `text` (the outermost value is level 1), ignoring brackets inside
// strings. Linear and non-recursive, so safe on any input; exact for valid JSON.
size_t json_nesting_depth(std::string_view text);

}  // namespace pd
