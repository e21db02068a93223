#include "grammar/grammar_library.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <cstdlib>
#include <string_view>

namespace pd::grammar {
namespace {

std::string env_or(const char* name, const char* fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? std::string(value) : std::string(fallback);
}

template <typename Fn>
bool resolve(void* handle, const char* name, Fn*& out, std::string& missing) {
  out = reinterpret_cast<Fn*>(dlsym(handle, name));
  if (out == nullptr) {
    if (!missing.empty()) missing += ", ";
    missing += name;
  }
  return out != nullptr;
}

}  // namespace

LibraryPaths default_library_paths() {
#ifndef PDSERVE_LIBPYTHON_PATH
#define PDSERVE_LIBPYTHON_PATH ""
#endif
#ifndef PDSERVE_LLGUIDANCE_PATH
#define PDSERVE_LLGUIDANCE_PATH ""
#endif
  return LibraryPaths{env_or("PDSERVE_LIBPYTHON", PDSERVE_LIBPYTHON_PATH),
                      env_or("PDSERVE_LLGUIDANCE_LIBRARY", PDSERVE_LLGUIDANCE_PATH)};
}

Result<std::shared_ptr<const GrammarLibrary>> GrammarLibrary::load(const LibraryPaths& paths) {
  if (paths.llguidance.empty()) {
    return unavailable(
        "the llguidance library was not found when pdserve was configured (pip install llguidance=={}, then "
        "reconfigure, or set PDSERVE_LLGUIDANCE_LIBRARY to .../site-packages/llguidance/_lib.abi3.so)",
        kRequiredLlguidanceVersion);
  }
  if (!paths.libpython.empty() && dlopen(paths.libpython.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
    const char* why = dlerror();
    return unavailable("llguidance needs libpython: dlopen('{}') failed: {} (set PDSERVE_LIBPYTHON)", paths.libpython,
                       why != nullptr ? why : "unknown error");
  }
  void* handle = dlopen(paths.llguidance.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return unavailable(
        "dlopen('{}') failed: {} (set PDSERVE_LLGUIDANCE_LIBRARY, and PDSERVE_LIBPYTHON to the "
        "libpython of the Python that installed it)",
        paths.llguidance, why != nullptr ? why : "unknown error");
  }
  std::shared_ptr<GrammarLibrary> library(new GrammarLibrary());
  llg::Api& api = library->api_;
  std::string missing;
  resolve(handle, "llg_get_version", api.get_version, missing);
  resolve(handle, "llg_constraint_init_set_defaults", api.constraint_init_set_defaults, missing);
  resolve(handle, "llg_new_tokenizer_v2", api.new_tokenizer_v2, missing);
  resolve(handle, "llg_free_tokenizer", api.free_tokenizer, missing);
  resolve(handle, "llg_new_matcher", api.new_matcher, missing);
  resolve(handle, "llg_validate_grammar", api.validate_grammar, missing);
  resolve(handle, "llg_matcher_compute_mask_into", api.matcher_compute_mask_into, missing);
  resolve(handle, "llg_matcher_get_mask_byte_size", api.matcher_get_mask_byte_size, missing);
  resolve(handle, "llg_matcher_consume_token", api.matcher_consume_token, missing);
  resolve(handle, "llg_matcher_get_error", api.matcher_get_error, missing);
  resolve(handle, "llg_matcher_is_error", api.matcher_is_error, missing);
  resolve(handle, "llg_matcher_is_accepting", api.matcher_is_accepting, missing);
  resolve(handle, "llg_matcher_is_stopped", api.matcher_is_stopped, missing);
  resolve(handle, "llg_matcher_rollback", api.matcher_rollback, missing);
  resolve(handle, "llg_clone_matcher", api.clone_matcher, missing);
  resolve(handle, "llg_free_matcher", api.free_matcher, missing);
  if (!missing.empty()) return unavailable("{} lacks llguidance functions: {}", paths.llguidance, missing);

  // "llguidance@<version> derivre@<version>"
  const char* version = api.get_version();
  library->version_ = version != nullptr ? version : "";
  const std::string expected = fmt::format("llguidance@{}", kRequiredLlguidanceVersion);
  const std::string_view got(library->version_);
  if (got.substr(0, expected.size()) != expected || (got.size() > expected.size() && got[expected.size()] != ' ')) {
    return unavailable("{} is '{}'; pdserve is built for llguidance {} (pip install llguidance=={})", paths.llguidance,
                       library->version_, kRequiredLlguidanceVersion, kRequiredLlguidanceVersion);
  }
  return std::shared_ptr<const GrammarLibrary>(std::move(library));
}

}  // namespace pd::grammar
