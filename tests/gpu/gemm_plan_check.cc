// Checks that serving steps never pay for GEMM tuning (docs/perf/goodput.md,
// 2026-11-30: chunked-prefill remainders hit new M values, and each one tuned
// four weight shapes on the spot, 100-200 ms stalls of every running request).
//
// 1. Gemm: with tuning off, a new M borrows the plan of the smallest tuned M' >= M
//    (skinny or cuBLASLt), or takes cuBLASLt's first choice; results stay right
//    (against the CPU reference, output poisoned first), nothing new is tuned, and
//    the first call of a new shape costs a small part of a tuned first call.
// 2. CudaModelRunner: every decode bucket is tuned and captured at load; then an
//    eager prefill and a mixed step of new sizes tune nothing.
// Prints a table; exit 1 on failure.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "engine/runner_cuda/cuda_model_runner.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/gemm.h"
#include "model/weights.h"
#include "tests/gpu/gpu_util.h"

namespace pd::gpu_test {
namespace {

namespace kc = pd::kernels::cuda;
namespace cpu = pd::kernels::cpu;
using bf16 = __nv_bfloat16;

int failures = 0;

void expect(bool ok, const std::string& what) {
  std::printf("%-4s %s\n", ok ? "ok" : "FAIL", what.c_str());
  if (!ok) ++failures;
}

std::mt19937_64& rng() {
  static std::mt19937_64 r(20261130);
  return r;
}

struct Operands {
  int n, k;
  std::vector<float> w_f;
  DeviceBuffer<bf16> d_w;
  Operands(int n_, int k_) : n(n_), k(k_), d_w(static_cast<size_t>(n_) * k_) {
    d_w.upload(random_bf16(static_cast<size_t>(n) * k, 1.0f, rng(), &w_f));
  }
};

// Runs one call of m rows, checks it against the CPU and returns the host wall time of the call (ms).
double run_and_check(kc::Gemm& gemm, const Operands& op, int m, kc::GemmOut out_type, const std::string& label) {
  std::vector<float> a_f;
  DeviceBuffer<bf16> d_a(static_cast<size_t>(m) * op.k);
  d_a.upload(random_bf16(static_cast<size_t>(m) * op.k, 1.0f, rng(), &a_f));
  std::vector<float> ref(static_cast<size_t>(m) * op.n);
  cpu::matmul(a_f.data(), op.w_f.data(), nullptr, m, op.n, op.k, ref.data());
  std::vector<float> got;
  double ms = 0.0;
  const auto timed = [&](auto&& call) {
    PD_CUDA_CHECK(cudaDeviceSynchronize());
    const auto t0 = std::chrono::steady_clock::now();
    PD_STATUS_CHECK(call());
    PD_CUDA_CHECK(cudaDeviceSynchronize());
    ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  if (out_type == kc::GemmOut::kBFloat16) {
    DeviceBuffer<bf16> d_out(static_cast<size_t>(m) * op.n);
    d_out.poison();
    timed([&] { return gemm.run(d_out.get(), out_type, d_a.get(), op.d_w.get(), m, op.n, op.k, nullptr); });
    got = to_float(d_out.download());
  } else {
    DeviceBuffer<float> d_out(static_cast<size_t>(m) * op.n);
    d_out.poison();
    timed([&] { return gemm.run(d_out.get(), out_type, d_a.get(), op.d_w.get(), m, op.n, op.k, nullptr); });
    got = d_out.download();
  }
  const ErrorStats e = compare(got, ref);
  char buf[200];
  std::snprintf(buf, sizeof(buf), "%s: m=%d n=%d k=%d rel_l2 %.2e, NaN %zu, first call %.2f ms", label.c_str(), m, op.n,
                op.k, e.rel_l2, e.num_nan, ms);
  expect(e.num_nan == 0 && e.rel_l2 <= 1e-2, buf);
  return ms;
}

void check_gemm_borrowing() {
  auto created = kc::Gemm::create();
  PD_STATUS_CHECK(created.status());
  kc::Gemm& gemm = **created;
  // Qwen3-8B's gate_up and o_proj shapes: large enough that tuning is visibly slow.
  const Operands gate_up(24576, 4096), o_proj(4096, 4096);
  double tuned_first_ms = 0.0;
  for (int m : {16, 64}) {
    tuned_first_ms = std::max(tuned_first_ms, run_and_check(gemm, gate_up, m, kc::GemmOut::kBFloat16, "tune gate_up"));
  }
  run_and_check(gemm, o_proj, 8, kc::GemmOut::kFloat32, "tune o_proj fp32-out");
  const size_t tuned_shapes = gemm.tunings().size();
  expect(tuned_shapes == 3, "three shapes tuned while tuning is on (got " + std::to_string(tuned_shapes) + ")");

  gemm.set_tuning(false);
  double borrowed_first_ms = 0.0;
  borrowed_first_ms =
      std::max(borrowed_first_ms, run_and_check(gemm, gate_up, 11, kc::GemmOut::kBFloat16, "borrow from m=16"));
  borrowed_first_ms =
      std::max(borrowed_first_ms, run_and_check(gemm, gate_up, 50, kc::GemmOut::kBFloat16, "borrow from m=64"));
  borrowed_first_ms =
      std::max(borrowed_first_ms, run_and_check(gemm, o_proj, 3, kc::GemmOut::kFloat32, "borrow fp32-out from m=8"));
  run_and_check(gemm, gate_up, 100, kc::GemmOut::kBFloat16, "no tuned m >= 100: cuBLASLt's first choice");
  run_and_check(gemm, o_proj, 3, kc::GemmOut::kBFloat16, "bf16-out has no tuned plan: cuBLASLt's first choice");
  expect(gemm.tunings().size() == tuned_shapes, "nothing tuned with tuning off");
  expect(gemm.num_borrowed_plans() == 3, "3 plans borrowed (got " + std::to_string(gemm.num_borrowed_plans()) + ")");
  expect(gemm.num_untuned_plans() == 2, "2 plans untuned (got " + std::to_string(gemm.num_untuned_plans()) + ")");
  char buf[160];
  std::snprintf(buf, sizeof(buf), "first call of a new shape: tuned %.2f ms, with tuning off at most %.2f ms",
                tuned_first_ms, borrowed_first_ms);
  expect(borrowed_first_ms * 4 < tuned_first_ms, buf);
}

model::ModelConfig small_qwen3() {
  model::ModelConfig c;
  c.family = model::ModelFamily::kQwen3;
  c.architecture = "Qwen3ForCausalLM";
  c.vocab_size = 4096;
  c.hidden_size = 512;
  c.intermediate_size = 1024;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 1;
  c.head_dim = 128;
  c.rms_norm_eps = 1e-6f;
  c.rope_theta = 1e6;
  c.max_position_embeddings = 4096;
  c.tie_word_embeddings = true;
  c.qk_norm = true;
  return c;
}

void check_runner_prepares_buckets(bool graphs) {
  const auto cfg = small_qwen3();
  engine::CudaRunnerOptions opt;
  opt.max_model_len = 1024;
  opt.max_num_seqs = 24;  // buckets 1, 2, 4, 8, 16, 24
  opt.max_num_batched_tokens = 512;
  opt.num_kv_blocks = 64;
  opt.enable_cuda_graphs = graphs;
  opt.dummy_seed = 7;
  auto created = engine::CudaModelRunner::create(cfg, nullptr, opt);
  PD_STATUS_CHECK(created.status());
  engine::CudaModelRunner& runner = **created;
  const std::string tag = graphs ? "graphs on: " : "graphs off: ";
  expect(runner.decode_buckets() == std::vector<int32_t>({1, 2, 4, 8, 16, 24}), tag + "buckets 1..16 and 24");
  expect(runner.num_graphs_captured() == (graphs ? 6 : 0),
         tag + "graphs captured at load: " + std::to_string(runner.num_graphs_captured()));
  expect(!runner.gemm().tuning(), tag + "GEMM tuning off after load");
  const size_t tuned = runner.gemm().tunings().size();
  expect(tuned > 0, tag + std::to_string(tuned) + " GEMM shapes tuned at load");

  // A prefill of 37 tokens, then 11 decodes beside a 29-token chunk: sizes no bucket has.
  engine::StepInput prefill;
  engine::SeqStep s;
  s.num_new_tokens = 37;
  s.block_table = {0, 1, 2, 3};
  s.sample = true;
  for (int i = 0; i < 37; ++i) prefill.token_ids.push_back(100 + i);
  prefill.seqs.push_back(s);
  auto out = runner.execute(prefill);
  PD_STATUS_CHECK(out.status());
  engine::StepInput mixed;
  for (int r = 0; r < 11; ++r) {
    engine::SeqStep d;
    d.token_offset = static_cast<int32_t>(mixed.token_ids.size());
    d.num_new_tokens = 1;
    d.num_computed_tokens = 36;
    d.block_table = {0, 1, 6 + r};  // own last block: rows write different slots
    d.sample = true;
    mixed.token_ids.push_back(out->sampled[0].token_id);
    mixed.seqs.push_back(d);
  }
  engine::SeqStep chunk;
  chunk.token_offset = static_cast<int32_t>(mixed.token_ids.size());
  chunk.num_new_tokens = 29;
  chunk.block_table = {4, 5};
  for (int i = 0; i < 29; ++i) mixed.token_ids.push_back(200 + i);
  mixed.seqs.push_back(chunk);
  auto out2 = runner.execute(mixed);
  PD_STATUS_CHECK(out2.status());
  expect(out2->sampled.size() == 11, tag + "mixed step sampled its 11 decode rows");
  expect(runner.gemm().tunings().size() == tuned, tag + "no GEMM tuned by the eager steps");
  expect(runner.gemm().num_borrowed_plans() + runner.gemm().num_untuned_plans() > 0,
         tag + "the eager steps' new shapes were planned without tuning (" +
             std::to_string(runner.gemm().num_borrowed_plans()) + " borrowed, " +
             std::to_string(runner.gemm().num_untuned_plans()) + " first choice)");
}

}  // namespace
}  // namespace pd::gpu_test

int main() {
  using namespace pd::gpu_test;
  check_gemm_borrowing();
  check_runner_prepares_buckets(true);
  check_runner_prepares_buckets(false);
  std::printf("gemm_plan_check: %d failed\n", failures);
  return failures == 0 ? 0 : 1;
}
