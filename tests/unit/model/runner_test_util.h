// Shared by the CPU runner's parity tests: the golden checkpoints' directory,
// a step row over a block table, and the row-by-row logits comparison.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/model_runner.h"

namespace pd::engine::runner_test {

// tests/data/golden/<family> (PDSERVE_SOURCE_DIR overrides the source tree the build saw).
inline std::filesystem::path golden_dir(const std::string& family) {
  const char* src = std::getenv("PDSERVE_SOURCE_DIR");
  return std::filesystem::path(src != nullptr ? src : PDSERVE_TEST_SOURCE_DIR) / "tests" / "data" / "golden" / family;
}

// One sequence's row of a step: num_new tokens from token_offset of the step's
// tokens after num_computed cached ones, the blocks they need from `table`, greedy.
inline SeqStep seq_step(int32_t offset, int32_t num_new, int32_t num_computed, const std::vector<int32_t>& table,
                        int32_t block_size, bool sample = true) {
  SeqStep s;
  s.token_offset = offset;
  s.num_new_tokens = num_new;
  s.num_computed_tokens = num_computed;
  const int32_t blocks = (num_computed + num_new + block_size - 1) / block_size;
  s.block_table.assign(table.begin(), table.begin() + blocks);
  s.sample = sample;
  s.sampling.temperature = 0.0f;
  return s;
}

// Every row of `got` within max_relative_error of `want` (L2 over the row) and the same argmax.
inline void expect_rows_close(const std::vector<float>& want, const std::vector<float>& got, int32_t vocab,
                              double max_relative_error, const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  for (size_t row = 0; row * vocab < want.size(); ++row) {
    const float* a = want.data() + row * vocab;
    const float* b = got.data() + row * vocab;
    double diff2 = 0.0, ref2 = 0.0;
    for (int32_t i = 0; i < vocab; ++i) {
      diff2 += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
      ref2 += static_cast<double>(a[i]) * a[i];
    }
    EXPECT_LE(std::sqrt(diff2) / std::sqrt(ref2), max_relative_error) << what << " row " << row;
    EXPECT_EQ(std::max_element(a, a + vocab) - a, std::max_element(b, b + vocab) - b) << what << " row " << row;
  }
}

}  // namespace pd::engine::runner_test
