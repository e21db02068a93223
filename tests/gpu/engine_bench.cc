// Engine benchmark of the CUDA runner against the floors measured in the same
// run (DESIGN.md §7): decode steps at batch 1/16/64/128 with 2,048-token
// contexts vs the HBM floor ((weights read + KV read) / device-to-device copy
// bandwidth), and prefill of 1 and 8 prompts of 2,000 tokens vs the bf16 GEMM
// rate (2 * linear params * tokens + causal attention + lm_head of the sampled
// rows). Qwen3-8B and Qwen3-32B shapes with dummy weights generated on the GPU.
// Usage: pd_gpu_engine_bench [--model qwen3-8b|qwen3-32b|all] [--ctx 2048] [--decode-kernel tc|simt]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/runner_cuda/cuda_model_runner.h"
#include "tests/gpu/bench_util.h"
#include "tests/gpu/gpu_util.h"

namespace pd::gpu_test {
namespace {

model::ModelConfig qwen3_config(bool big) {
  model::ModelConfig c;
  c.architecture = "Qwen3ForCausalLM";
  c.family = model::ModelFamily::kQwen3;
  c.vocab_size = 151936;
  c.hidden_size = big ? 5120 : 4096;
  c.intermediate_size = big ? 25600 : 12288;
  c.num_layers = big ? 64 : 36;
  c.num_heads = big ? 64 : 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.rms_norm_eps = 1e-6f;
  c.rope_theta = 1e6;
  c.max_position_embeddings = 40960;
  c.tie_word_embeddings = false;
  c.qk_norm = true;
  return c;
}

struct Row {
  std::string what;
  double floor_ms;
  double measured_ms;
  std::string note;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Wall time of execute() (it returns once the sampled tokens are on the host).
double time_step(engine::CudaModelRunner& runner, const engine::StepInput& in, int warmup, int reps) {
  for (int i = 0; i < warmup; ++i) {
    auto r = runner.execute(in);
    PD_STATUS_CHECK(r.status());
  }
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    auto r = runner.execute(in);
    const auto t1 = std::chrono::steady_clock::now();
    PD_STATUS_CHECK(r.status());
    ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  return median(ms);
}

engine::StepInput make_step(int num_seqs, int new_tokens, int computed, int vocab, std::mt19937_64& rng) {
  engine::StepInput in;
  const int ctx = computed + new_tokens;
  const int blocks = (ctx + 15) / 16;
  std::uniform_int_distribution<int> tok(0, vocab - 1);
  for (int s = 0; s < num_seqs; ++s) {
    engine::SeqStep st;
    st.token_offset = static_cast<int32_t>(in.token_ids.size());
    st.num_new_tokens = new_tokens;
    st.num_computed_tokens = computed;
    for (int b = 0; b < blocks; ++b) st.block_table.push_back(s * blocks + b);
    st.sample = true;
    st.sampling.temperature = 0.0f;
    st.rng_seed = rng();
    for (int j = 0; j < new_tokens; ++j) in.token_ids.push_back(tok(rng));
    in.seqs.push_back(std::move(st));
  }
  return in;
}

void bench_model(bool big, int ctx, double copy_gbs, double gemm_tflops, kernels::cuda::DecodeKernel decode_kernel,
                 std::vector<Row>* rows) {
  const model::ModelConfig cfg = qwen3_config(big);
  const char* name = big ? "Qwen3-32B" : "Qwen3-8B";
  const std::vector<int> batches = big ? std::vector<int>{1, 16, 64} : std::vector<int>{1, 16, 64, 128};
  const int prefill_tokens = 2000;
  const std::vector<int> prefill_prompts = big ? std::vector<int>{1} : std::vector<int>{1, 8};
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  const int blocks_needed = std::max(max_batch * ((ctx + 15) / 16), 8 * ((prefill_tokens + 15) / 16));
  engine::CudaRunnerOptions opt;
  opt.max_model_len = std::max(ctx, prefill_tokens) + 64;
  opt.max_num_seqs = max_batch;
  opt.max_num_batched_tokens = 8 * prefill_tokens;
  opt.num_kv_blocks = blocks_needed + 16;
  opt.decode_kernel = decode_kernel;
  const auto t0 = std::chrono::steady_clock::now();
  auto created = engine::CudaModelRunner::create(cfg, nullptr, opt);
  PD_STATUS_CHECK(created.status());
  auto& runner = **created;
  PD_STATUS_CHECK(runner.fill_kv_random(42));
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  size_t free_b = 0, total_b = 0;
  PD_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  std::printf("%s: weights %.2f GB, KV pool %d blocks, load+fill %.1f s, device memory used %.1f / %.1f GB\n", name,
              runner.weight_bytes() / 1e9, runner.kv_cache_spec().num_blocks, load_s, (total_b - free_b) / 1e9,
              total_b / 1e9);
  // Decode reads every weight except the embedding table (B rows of it).
  const double h = cfg.hidden_size;
  const double weights_read =
      static_cast<double>(runner.weight_bytes()) - (cfg.tie_word_embeddings ? 0.0 : cfg.vocab_size * h * 2);
  std::mt19937_64 rng(7);
  for (int b : batches) {
    const auto in = make_step(b, 1, ctx - 1, cfg.vocab_size, rng);
    const double ms = time_step(runner, in, 3, 20);
    const double bytes = weights_read + static_cast<double>(b) * ctx * runner.kv_bytes_per_token();
    const double floor_ms = bytes / (copy_gbs * 1e6);
    rows->push_back({std::string(name) + " decode b" + std::to_string(b) + " ctx" + std::to_string(ctx), floor_ms, ms,
                     "HBM floor " + std::to_string(static_cast<int>(bytes / 1e6)) + " MB"});
  }
  const double linear_params =
      static_cast<double>(cfg.num_layers) *
      (h * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim +
       static_cast<double>(cfg.num_heads) * cfg.head_dim * h + 3.0 * h * cfg.intermediate_size);
  for (int n : prefill_prompts) {
    const auto in = make_step(n, prefill_tokens, 0, cfg.vocab_size, rng);
    const double ms = time_step(runner, in, 2, 5);
    const double t = prefill_tokens;
    const double flops = 2.0 * linear_params * t * n +
                         4.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * (t * (t + 1) / 2.0) * n +
                         2.0 * cfg.vocab_size * h * n;
    const double floor_ms = flops / (gemm_tflops * 1e9);
    rows->push_back({std::string(name) + " prefill " + std::to_string(n) + "x" + std::to_string(prefill_tokens),
                     floor_ms, ms, std::to_string(static_cast<int>(flops / 1e12)) + " TFLOP"});
  }
  std::printf("%s: %d decode graphs captured\n", name, runner.num_graphs_captured());
}

}  // namespace
}  // namespace pd::gpu_test

int main(int argc, char** argv) {
  using namespace pd::gpu_test;
  std::string which = "all";
  int ctx = 2048;
  auto decode_kernel = pd::kernels::cuda::DecodeKernel::kTensorCore;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--model") == 0) which = argv[i + 1];
    if (std::strcmp(argv[i], "--ctx") == 0) ctx = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--decode-kernel") == 0 && std::strcmp(argv[i + 1], "simt") == 0) {
      decode_kernel = pd::kernels::cuda::DecodeKernel::kCudaCore;
    }
  }
  PD_CUDA_CHECK(cudaSetDevice(0));
  cudaDeviceProp prop{};
  PD_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const double copy_gbs = measure_copy_gbs();
  const double gemm_tflops = measure_gemm_tflops();
  std::printf("device %s: d2d copy %.1f GB/s, bf16 GEMM 8192^3 %.1f TFLOP/s, decode attention on %s cores\n", prop.name,
              copy_gbs, gemm_tflops, decode_kernel == pd::kernels::cuda::DecodeKernel::kTensorCore ? "tensor" : "CUDA");
  std::vector<Row> rows;
  if (which == "all" || which == "qwen3-8b") bench_model(false, ctx, copy_gbs, gemm_tflops, decode_kernel, &rows);
  if (which == "all" || which == "qwen3-32b") bench_model(true, ctx, copy_gbs, gemm_tflops, decode_kernel, &rows);
  std::printf("\n%-36s %10s %10s %8s  %s\n", "step", "floor_ms", "meas_ms", "x floor", "note");
  for (const auto& r : rows) {
    std::printf("%-36s %10.3f %10.3f %8.2f  %s\n", r.what.c_str(), r.floor_ms, r.measured_ms,
                r.measured_ms / r.floor_ms, r.note.c_str());
  }
  return 0;
}
