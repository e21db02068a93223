// The llguidance library, opened at run time. It lives in the llguidance Python wheel
// (llguidance/_lib.abi3.so) and needs libpython's symbols, so libpython is opened first with
// RTLD_GLOBAL (Python is never initialised; only its symbols are resolved). Both handles stay
// open for the life of the process: llguidance is Rust with thread-local state, which dlclose
// cannot unload safely.
#pragma once

#include <memory>
#include <string>

#include "common/status.h"
#include "grammar/llg_abi.h"

namespace pd::grammar {

// The only llguidance version whose ABI llg_abi.h declares.
inline constexpr const char* kRequiredLlguidanceVersion = "1.9.1";

struct LibraryPaths {
  std::string libpython;   // e.g. <prefix>/lib/libpython3.11.so.1.0; empty: not opened first
  std::string llguidance;  // <site-packages>/llguidance/_lib.abi3.so
};

// PDSERVE_LIBPYTHON / PDSERVE_LLGUIDANCE_LIBRARY when set, else the paths CMake found at
// configure time (the python3 that has llguidance installed).
LibraryPaths default_library_paths();

class GrammarLibrary {
 public:
  // Opens both libraries, resolves every function of llg::Api and checks llg_get_version()
  // against kRequiredLlguidanceVersion. Errors name the path and what failed (kUnavailable).
  static Result<std::shared_ptr<const GrammarLibrary>> load(const LibraryPaths& paths);

  const llg::Api& api() const { return api_; }
  const std::string& version() const { return version_; }  // llg_get_version()

 private:
  GrammarLibrary() = default;
  llg::Api api_{};
  std::string version_;
};

}  // namespace pd::grammar
