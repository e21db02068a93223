// xfer_post_cost: host cost of each step of posting a batch on the cuda backend, on the
// CPU alone (no GPU, no engine): validation, sort, merge, op tables. Prints the median
// microseconds of each step per scenario, for the old post (sort + merge the whole batch,
// then tables of 1,000 ops) and the pipelined one (validate in place, then tables; the
// first launch after 128 ops). The CUDA runtime calls themselves are not included.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/clock.h"
#include "xfer/backends/copy_plan.h"
#include "xfer/ops.h"

namespace pd::xferbench {
namespace {

using xfer::Direction;
using xfer::Op;

struct Scenario {
  std::string name;
  std::vector<Op> ops;
  uint64_t region_bytes = 0;
};

// Median microseconds of `body` over `reps` runs after one untimed run.
double median_us(int reps, const std::function<void()>& body) {
  body();
  std::vector<double> us;
  for (int i = 0; i < reps; ++i) {
    const int64_t t0 = now_ns();
    body();
    us.push_back(static_cast<double>(now_ns() - t0) * 1e-3);
  }
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

std::vector<uint64_t> shuffled_ids(std::mt19937_64& rng, uint64_t pool, uint64_t n) {
  std::vector<uint64_t> ids(pool);
  for (uint64_t i = 0; i < pool; ++i) ids[i] = i;
  std::shuffle(ids.begin(), ids.end(), rng);
  ids.resize(n);
  return ids;
}

// The xferbench KV pattern (Qwen3-8B, 16-token blocks of 64 KiB, a pool of twice the
// prompt's blocks per layer, random distinct block ids) for `layers` layers.
Scenario kv(std::mt19937_64& rng, int layers, uint64_t prompt_blocks, const std::string& name) {
  const uint64_t block = 65536, pool = 2 * prompt_blocks, layer_bytes = pool * block;
  const auto src = shuffled_ids(rng, pool, prompt_blocks);
  const auto dst = shuffled_ids(rng, pool, prompt_blocks);
  Scenario s{name, {}, layer_bytes * 36};
  for (int l = 0; l < layers; ++l) {
    for (uint64_t b = 0; b < prompt_blocks; ++b) {
      s.ops.push_back({l * layer_bytes + src[b] * block, l * layer_bytes + dst[b] * block, block});
    }
  }
  return s;
}

struct Row {
  std::string name;
  size_t num_ops = 0;
  std::string proof;
  double old_normalize = 0, old_tables = 0, old_first = 0;
  double validate = 0, new_first_table = 0, new_tables = 0, new_first = 0;
  size_t old_launches = 0, new_launches = 0;
};

Row measure(const Scenario& s, int reps) {
  Row row;
  row.name = s.name;
  row.num_ops = s.ops.size();
  const char* proofs[] = {"ascending", "bitmap", "sort"};
  row.proof = proofs[static_cast<int>(xfer::overlap_check_for(s.ops, Direction::kWrite))];
  constexpr uint64_t kMaxCtas = 132 * 4, kChunk = 64 * 1024;
  const uint64_t local_base = uint64_t{1} << 40, remote_base = uint64_t{2} << 40;
  std::vector<Op> normalized;
  xfer::LaunchScratch scratch;
  auto plan_all = [&](std::span<const Op> ops, bool pipelined) {
    xfer::KernelLaunchPlanner planner(ops, Direction::kWrite, local_base, remote_base, kMaxCtas, kChunk, pipelined,
                                      scratch);
    size_t n = 0;
    for (; !planner.done(); ++n) planner.next();
    return n;
  };
  auto plan_first = [&](std::span<const Op> ops, bool pipelined) {
    xfer::KernelLaunchPlanner planner(ops, Direction::kWrite, local_base, remote_base, kMaxCtas, kChunk, pipelined,
                                      scratch);
    planner.next();
  };
  // Old: normalise (bounds, radix sort, merge) the whole batch, then the tables.
  row.old_normalize = median_us(reps, [&] {
    if (!xfer::normalize_ops_into(s.ops, Direction::kWrite, s.region_bytes, s.region_bytes, normalized).ok()) {
      std::abort();
    }
  });
  row.old_tables = median_us(reps, [&] { row.old_launches = plan_all(normalized, false); });
  row.old_first = median_us(reps, [&] {
    (void)xfer::normalize_ops_into(s.ops, Direction::kWrite, s.region_bytes, s.region_bytes, normalized);
    plan_first(normalized, false);
  });
  // Pipelined: validate in place, then tables in the caller's order.
  row.validate = median_us(reps, [&] {
    if (!xfer::validate_ops(s.ops, Direction::kWrite, s.region_bytes, s.region_bytes).ok()) std::abort();
  });
  row.new_first_table = median_us(reps, [&] { plan_first(s.ops, true); });
  row.new_tables = median_us(reps, [&] { row.new_launches = plan_all(s.ops, true); });
  row.new_first = median_us(reps, [&] {
    (void)xfer::validate_ops(s.ops, Direction::kWrite, s.region_bytes, s.region_bytes);
    plan_first(s.ops, true);
  });
  return row;
}

int run(int reps, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<Scenario> scenarios;
  scenarios.push_back(kv(rng, 36, 125, "kv_4500"));
  scenarios.push_back(kv(rng, 1, 125, "kv_layer_125"));
  {
    // 16,384 ops of 4 KiB between random slots of a 576 MiB region (xferbench small_4k).
    const uint64_t slots = 36 * 250 * 16;
    const auto src = shuffled_ids(rng, slots, 16384);
    const auto dst = shuffled_ids(rng, slots, 16384);
    Scenario s{"small_4k_16384", {}, slots * 4096};
    for (size_t i = 0; i < src.size(); ++i) s.ops.push_back({src[i] * 4096, dst[i] * 4096, 4096});
    scenarios.push_back(std::move(s));
  }
  {
    // The KV batch already in destination order (a caller that sorts its blocks).
    Scenario s = kv(rng, 36, 125, "kv_4500_sorted");
    std::sort(s.ops.begin(), s.ops.end(), [](const Op& a, const Op& b) { return a.remote_offset < b.remote_offset; });
    scenarios.push_back(std::move(s));
  }
  {
    // 4,500 unaligned ops spread thinly: neither ascending nor bitmap-sized (sort fallback).
    Scenario s{"sparse_unaligned_4500", {}, uint64_t{1} << 40};
    const auto dst = shuffled_ids(rng, 1 << 20, 4500);
    for (size_t i = 0; i < dst.size(); ++i) s.ops.push_back({i * 8192, dst[i] * (1 << 20) + 3, 5000});
    scenarios.push_back(std::move(s));
  }
  std::printf("xfer_post_cost: median us over %d runs, host only (CUDA calls excluded)\n", reps);
  std::printf("  old = normalize (bounds + radix sort + merge) then tables of 1,000 ops\n");
  std::printf("  new = validate in place (bounds + ascending/bitmap/sort proof) then tables, first of 128 ops\n");
  std::printf("%-22s %6s %9s | %9s %9s %9s %4s | %9s %9s %9s %9s %4s\n", "scenario", "ops", "proof", "normalize",
              "tables", "to 1st", "lnch", "validate", "1st tbl", "tables", "to 1st", "lnch");
  for (const Scenario& s : scenarios) {
    const Row r = measure(s, reps);
    std::printf("%-22s %6zu %9s | %9.2f %9.2f %9.2f %4zu | %9.2f %9.2f %9.2f %9.2f %4zu\n", r.name.c_str(), r.num_ops,
                r.proof.c_str(), r.old_normalize, r.old_tables, r.old_first, r.old_launches, r.validate,
                r.new_first_table, r.new_tables, r.new_first, r.new_launches);
  }
  std::printf("(to 1st = host time from write() to the first launch's table being ready: the GPU's earliest start)\n");
  return 0;
}

}  // namespace
}  // namespace pd::xferbench

int main(int argc, char** argv) {
  int reps = 2000;
  uint64_t seed = 12345;
  CLI::App app{"xfer_post_cost: host cost of posting a batch (cuda backend planning, CPU only)"};
  app.add_option("--reps", reps, "timed runs per step")->check(CLI::Range(1, 1000000));
  app.add_option("--seed", seed);
  CLI11_PARSE(app, argc, argv);
  return pd::xferbench::run(reps, seed);
}
