// The NCCL loader of the CUDA runner's tensor-parallel group (runner_cuda/nccl_comm.h): a
// missing or wrong library is refused at creation with a message that names the file and
// the fix, before any device is touched. Each case runs in a child process: the library is
// loaded once per process.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

#include "engine/runner_cuda/nccl_comm.h"

namespace pd::engine {
namespace {

// Creates a group over device 0 with PDSERVE_NCCL_LIBRARY = library, prints the status to
// stderr and exits 0 when its code is `expected`.
[[noreturn]] void create_and_exit(const char* library, ErrorCode expected) {
  setenv("PDSERVE_NCCL_LIBRARY", library, 1);
  auto group = NcclGroup::create({0});
  std::fprintf(stderr, "%s\n", group.status().to_string().c_str());
  std::exit(!group.ok() && group.status().code() == expected ? 0 : 1);
}

TEST(NcclLoader, MissingLibraryIsRefusedNamingTheFileAndWhereToFindOne) {
  EXPECT_EXIT(create_and_exit("/nonexistent/libnccl.so.2", ErrorCode::kFailedPrecondition), testing::ExitedWithCode(0),
              "dlopen\\('/nonexistent/libnccl.so.2'\\) failed.*LD_LIBRARY_PATH");
}

TEST(NcclLoader, LibraryWithoutNcclSymbolsIsRefused) {
  EXPECT_EXIT(create_and_exit("libm.so.6", ErrorCode::kFailedPrecondition), testing::ExitedWithCode(0),
              "libm.so.6 has no symbol ncclGetVersion");
}

TEST(NcclLoader, EmptyDeviceListIsRefusedWithoutLoading) {
  auto group = NcclGroup::create({});
  ASSERT_FALSE(group.ok());
  EXPECT_EQ(group.status().code(), ErrorCode::kInvalidArgument);
}

}  // namespace
}  // namespace pd::engine
