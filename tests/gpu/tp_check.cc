// Tensor parallelism on the CUDA runner (CudaTpRunner, NcclGroup):
//  1. the collectives: NCCL all-reduce (bf16) and all-gather over every visible rank
//     count up to --max-tp, eagerly and replayed from a captured CUDA graph;
//  2. whole small models (Qwen3 D128 / D64, Qwen2 bias, Qwen3-MoE, block-FP8 Qwen3 and
//     Qwen3-MoE) through CudaTpRunner at TP 1 (the path pdserve loads) and, when enough
//     GPUs are visible, TP 2: every step against the fp32 CPU runner with the same weights
//     (the runner_check criteria: logits relative L2, greedy tokens equal or near-ties),
//     and TP 2's tokens against TP 1's; decode steps in CUDA graphs (and eagerly);
//  3. dummy weights generated on the GPU: TP 2 slices the same fused tensors TP 1 generates
//     (logits of the two within the bf16 tolerance, tokens equal or near-ties).
// Prints a table; exit 1 on any failure. TP 2 rows are skipped (and said so) on one GPU.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "engine/runner/cpu_model_runner.h"
#include "engine/runner_cuda/cuda_tp_runner.h"
#include "engine/runner_cuda/nccl_comm.h"
#include "model/weights.h"
#include "tests/gpu/gpu_util.h"

namespace pd::gpu_test {
namespace {

// Bounds against the fp32 CPU runner, as runner_check sets them (its header and docs/perf/engine.md
// give the measurements behind each):
constexpr double kLogitsTolerance = 2e-2;  // bf16 activations over 3 layers
// MoE with 8x routers: the router's large logits amplify the bf16 error of its input (every expert
// routed with unscaled routers gives 0.9-1.1e-2; with 8x routers 1.3-3.9e-2 even when no expert flips).
constexpr double kMoeLogitsTolerance = 5e-2;
// FP8 weights: the two CPU references runner_check compares (dequantized weights without activation
// quantization, and the checkpoint's own activation quantization) are 1.09e-1 apart on this shape;
// runner_check's bound is that distance plus 2e-2.
constexpr double kFp8LogitsTolerance = 1.3e-1;

// ---- 1. collectives ----

int check_collectives(int32_t ranks) {
  std::vector<int32_t> devices;
  for (int32_t r = 0; r < ranks; ++r) devices.push_back(r);
  auto group = engine::NcclGroup::create(devices);
  if (!group.ok()) {
    std::printf("nccl %d ranks: FAIL %s\n", ranks, group.status().to_string().c_str());
    return 1;
  }
  constexpr size_t kCount = 4096;
  engine::RankPool pool(ranks);
  std::vector<int> failures(static_cast<size_t>(ranks), 0);
  pool.run([&](int32_t r) {
    PD_CUDA_CHECK(cudaSetDevice(r));
    cudaStream_t stream = nullptr;
    PD_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    // Rank r holds (i % 17 + r) / 4: small integers and quarters, exact in bf16 and in their sums.
    std::vector<__nv_bfloat16> host(kCount);
    auto fill = [&] {
      for (size_t i = 0; i < kCount; ++i) host[i] = __float2bfloat16(static_cast<float>(i % 17 + r) / 4.0f);
    };
    auto expected = [&](size_t i, int times) {
      float sum = 0.0f;
      for (int32_t q = 0; q < ranks; ++q) sum += static_cast<float>(i % 17 + q) / 4.0f;
      float v = sum;
      for (int t = 1; t < times; ++t) v = v * static_cast<float>(ranks);  // replays reduce the reduced values
      return v;
    };
    void* data = nullptr;
    float* send = nullptr;
    float* recv = nullptr;
    PD_CUDA_CHECK(cudaMalloc(&data, kCount * sizeof(__nv_bfloat16)));
    PD_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&send), 64 * sizeof(float)));
    PD_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&recv), 64 * ranks * sizeof(float)));
    fill();
    PD_CUDA_CHECK(cudaMemcpy(data, host.data(), kCount * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
    PD_STATUS_CHECK((*group)->all_reduce_bf16(r, data, kCount, stream));
    PD_CUDA_CHECK(cudaStreamSynchronize(stream));
    PD_CUDA_CHECK(cudaMemcpy(host.data(), data, kCount * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < kCount; ++i)
      if (__bfloat162float(host[i]) != expected(i, 1)) {
        ++failures[static_cast<size_t>(r)];
        break;
      }
    // The same all-reduce captured into a graph, replayed twice (as decode graphs replay theirs).
    fill();
    PD_CUDA_CHECK(cudaMemcpy(data, host.data(), kCount * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    PD_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    PD_STATUS_CHECK((*group)->all_reduce_bf16(r, data, kCount, stream));
    PD_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    PD_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    PD_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    PD_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    PD_CUDA_CHECK(cudaStreamSynchronize(stream));
    PD_CUDA_CHECK(cudaMemcpy(host.data(), data, kCount * sizeof(__nv_bfloat16), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < kCount; ++i)
      if (__bfloat162float(host[i]) != expected(i, 2)) {
        ++failures[static_cast<size_t>(r)];
        break;
      }
    // All-gather: recv[q][j] = q * 1000 + j on every rank.
    std::vector<float> mine(64), got(64 * static_cast<size_t>(ranks));
    for (int j = 0; j < 64; ++j) mine[static_cast<size_t>(j)] = static_cast<float>(r * 1000 + j);
    PD_CUDA_CHECK(cudaMemcpy(send, mine.data(), 64 * sizeof(float), cudaMemcpyHostToDevice));
    PD_STATUS_CHECK((*group)->all_gather(r, send, recv, 64, ncclFloat32, stream));
    PD_CUDA_CHECK(cudaStreamSynchronize(stream));
    PD_CUDA_CHECK(cudaMemcpy(got.data(), recv, got.size() * sizeof(float), cudaMemcpyDeviceToHost));
    for (int32_t q = 0; q < ranks; ++q)
      for (int j = 0; j < 64; ++j)
        if (got[static_cast<size_t>(q * 64 + j)] != static_cast<float>(q * 1000 + j)) {
          ++failures[static_cast<size_t>(r)];
          q = ranks;
          break;
        }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaFree(data);
    cudaFree(send);
    cudaFree(recv);
    cudaStreamDestroy(stream);
  });
  int total = 0;
  for (int f : failures) total += f;
  std::printf("nccl %s, %d rank(s): all-reduce bf16 eager + graph replay, all-gather: %s\n",
              (*group)->version().c_str(), ranks, total == 0 ? "PASS" : "FAIL");
  return total;
}

// ---- 2. whole models against the CPU runner ----

struct ModelCase {
  const char* name;
  model::ModelFamily family;
  int head_dim;
  bool fp8;
};

model::ModelConfig small_config(const ModelCase& mc) {
  model::ModelConfig c;
  c.family = mc.family;
  c.architecture = mc.family == model::ModelFamily::kQwen3      ? "Qwen3ForCausalLM"
                   : mc.family == model::ModelFamily::kQwen3Moe ? "Qwen3MoeForCausalLM"
                                                                : "Qwen2ForCausalLM";
  c.vocab_size = 4096;
  c.hidden_size = 512;
  c.intermediate_size = 1024;
  c.num_layers = 3;
  c.num_heads = 512 / mc.head_dim;                                  // D128: 4 heads, 2 KV heads (split at TP 2)
  c.num_kv_heads = c.num_heads / 2;                                 // D64: 8 heads, 4 KV heads
  if (mc.family == model::ModelFamily::kQwen2) c.num_kv_heads = 1;  // replicated at TP 2
  c.head_dim = mc.head_dim;
  c.rms_norm_eps = 1e-6f;
  c.rope_theta = 1e6;
  c.max_position_embeddings = 4096;
  c.tie_word_embeddings = mc.family == model::ModelFamily::kQwen3;
  c.qk_norm = mc.family != model::ModelFamily::kQwen2;
  c.qkv_bias = mc.family == model::ModelFamily::kQwen2;
  if (mc.family == model::ModelFamily::kQwen3Moe) {
    c.moe.num_experts = 16;
    // FP8 experts: every expert routed (the output is continuous in the router logits), as
    // runner_check runs them; FP8 activation rounding with top 4 of 16 is ill-conditioned.
    c.moe.num_experts_per_tok = mc.fp8 ? 16 : 4;
    c.moe.moe_intermediate_size = 256;
    c.moe.norm_topk_prob = true;
    c.moe.decoder_sparse_step = 1;
    c.moe.mlp_only_layers = {1};
  }
  if (mc.fp8) {
    c.quant.method = model::QuantMethod::kFp8Block;
    c.quant.block_out = 128;
    c.quant.block_in = 128;
  }
  return c;
}

model::ModelWeights bf16_weights(const model::ModelConfig& cfg) {
  auto weights = model::dummy_weights(cfg, 1234, 0.05f);
  // 8x routers (logits std ~1 otherwise) except with every expert routed (unscaled, as runner_check).
  const float router_scale = cfg.moe.num_experts_per_tok == cfg.moe.num_experts ? 1.0f : 8.0f;
  for (const auto& spec : model::weight_specs(cfg)) {
    const model::Tensor* t = weights.find(spec.name);
    if (t == nullptr) continue;
    model::Tensor rounded = *t;
    const bool router = spec.name.size() > 16 && spec.name.compare(spec.name.size() - 16, 16, ".mlp.gate.weight") == 0;
    for (float& v : rounded.data) v = bf16_round(router ? router_scale * v : v);
    weights.put(spec.name, std::move(rounded));
  }
  return weights;
}

engine::CudaRunnerOptions runner_options(bool graphs) {
  engine::CudaRunnerOptions opt;
  opt.max_model_len = 1024;
  opt.max_num_seqs = 16;
  opt.max_num_batched_tokens = 512;
  opt.num_kv_blocks = 256;
  opt.enable_cuda_graphs = graphs;
  return opt;
}

// The step plan of runner_check: mixed prefills, a chunked prefill beside decodes, decodes.
std::vector<std::vector<std::pair<int, int>>> step_plan() {
  std::vector<std::vector<std::pair<int, int>>> plan = {
      {{0, 5}, {1, 37}, {2, 100}},
      {{0, 1}, {1, 1}, {2, 1}, {3, 40}},
      {{0, 1}, {3, 30}, {1, 1}, {2, 1}},
  };
  for (int i = 0; i < 10; ++i) plan.push_back({{0, 1}, {1, 1}, {2, 1}, {3, 1}});
  plan.push_back({{2, 1}});
  return plan;
}

struct Seq {
  std::vector<int32_t> tokens;
  int32_t computed = 0;
  std::vector<int32_t> blocks;
};

std::vector<Seq> initial_seqs(int32_t vocab) {
  std::vector<Seq> seqs(4);
  const int prompt_len[4] = {5, 37, 100, 70};
  uint32_t x = 12345;
  int next_block = 0;
  for (int s = 0; s < 4; ++s) {
    for (int i = 0; i < prompt_len[s]; ++i) {
      x = x * 1664525u + 1013904223u;
      seqs[static_cast<size_t>(s)].tokens.push_back(static_cast<int32_t>(x % static_cast<uint32_t>(vocab)));
    }
    for (int b = 0; b < 16; ++b) seqs[static_cast<size_t>(s)].blocks.push_back(next_block++);
  }
  return seqs;
}

engine::StepInput build_step(std::vector<Seq>& seqs, const std::vector<std::pair<int, int>>& step) {
  engine::StepInput in;
  for (auto [s, n] : step) {
    Seq& q = seqs[static_cast<size_t>(s)];
    engine::SeqStep st;
    st.token_offset = static_cast<int32_t>(in.token_ids.size());
    st.num_new_tokens = n;
    st.num_computed_tokens = q.computed;
    st.block_table = q.blocks;
    st.sample = q.computed + n == static_cast<int32_t>(q.tokens.size());
    st.sampling.temperature = 0.0f;
    for (int j = 0; j < n; ++j) in.token_ids.push_back(q.tokens[static_cast<size_t>(q.computed + j)]);
    in.seqs.push_back(st);
  }
  return in;
}

// Feeds `next` (one token per sampled row, in order) back into the sequences.
void advance(std::vector<Seq>& seqs, const std::vector<std::pair<int, int>>& step, const engine::StepInput& in,
             const std::vector<int32_t>& next) {
  size_t r = 0;
  for (size_t k = 0; k < in.seqs.size(); ++k) {
    Seq& q = seqs[static_cast<size_t>(step[k].first)];
    q.computed += in.seqs[k].num_new_tokens;
    if (in.seqs[k].sample) q.tokens.push_back(next[r++]);
  }
}

int32_t argmax(const float* row, int32_t n) {
  int32_t best = 0;
  for (int32_t v = 1; v < n; ++v)
    if (row[v] > row[best]) best = v;
  return best;
}

// A pick is right when it is the reference's argmax or within max_abs of it (a near-tie).
bool pick_ok(const float* ref_row, int32_t vocab, int32_t picked, float max_abs) {
  const int32_t best = argmax(ref_row, vocab);
  return picked == best || (picked >= 0 && picked < vocab && ref_row[best] - ref_row[picked] <= max_abs);
}

// Runs the plan through the CPU runner (whose greedy tokens feed every runner) and through
// CudaTpRunner at each TP size; returns the failing steps.
int check_model(const ModelCase& mc, const std::vector<int32_t>& tp_sizes, bool graphs) {
  const model::ModelConfig cfg = small_config(mc);
  const double tolerance = mc.fp8                                       ? kFp8LogitsTolerance
                           : mc.family == model::ModelFamily::kQwen3Moe ? kMoeLogitsTolerance
                                                                        : kLogitsTolerance;
  const model::ModelWeights weights = bf16_weights(cfg);
  auto cpu = engine::CpuModelRunner::create(cfg, weights, 16, 256, 1024);
  PD_STATUS_CHECK(cpu.status());
  std::vector<std::unique_ptr<engine::CudaTpRunner>> gpus;
  for (int32_t tp : tp_sizes) {
    auto r = engine::CudaTpRunner::create(cfg, &weights, runner_options(graphs), tp);
    if (!r.ok()) {
      std::printf("%-12s TP %d: FAIL create: %s\n", mc.name, tp, r.status().to_string().c_str());
      return 1;
    }
    gpus.push_back(std::move(*r));
  }
  std::vector<Seq> seqs = initial_seqs(cfg.vocab_size);
  int failures = 0;
  for (const auto& step : step_plan()) {
    const engine::StepInput in = build_step(seqs, step);
    auto ref = (*cpu)->forward(in, engine::CpuModelRunner::LogitsRows::kSampled);
    PD_STATUS_CHECK(ref.status());
    const auto rows = static_cast<int32_t>(ref->size() / static_cast<size_t>(cfg.vocab_size));
    std::vector<int32_t> greedy;
    for (int32_t r = 0; r < rows; ++r)
      greedy.push_back(argmax(ref->data() + static_cast<size_t>(r) * cfg.vocab_size, cfg.vocab_size));
    std::vector<std::vector<int32_t>> picks;
    std::string line;
    bool pass = true;
    for (size_t g = 0; g < gpus.size(); ++g) {
      auto out = gpus[g]->execute(in);
      PD_STATUS_CHECK(out.status());
      auto logits = gpus[g]->rank(0).last_logits(rows);
      PD_STATUS_CHECK(logits.status());
      const ErrorStats e = compare(*logits, *ref);
      std::vector<int32_t> p;
      int ok = 0;
      for (int32_t r = 0; r < rows; ++r) {
        p.push_back(out->sampled[static_cast<size_t>(r)].token_id);
        if (pick_ok(ref->data() + static_cast<size_t>(r) * cfg.vocab_size, cfg.vocab_size, p.back(),
                    static_cast<float>(e.max_abs)))
          ++ok;
      }
      const bool tp_pass = e.num_nan == 0 && e.rel_l2 <= tolerance && ok == rows;
      pass = pass && tp_pass;
      char cell[96];
      std::snprintf(cell, sizeof(cell), " TP%d rel_l2 %.2e tokens %d/%d", tp_sizes[g], e.rel_l2, ok, rows);
      line += cell;
      picks.push_back(std::move(p));
    }
    int same_as_tp1 = 0;
    for (size_t g = 1; g < picks.size(); ++g)
      for (int32_t r = 0; r < rows; ++r)
        same_as_tp1 += picks[g][static_cast<size_t>(r)] == picks[0][static_cast<size_t>(r)];
    if (picks.size() > 1) line += " same-as-TP1 " + std::to_string(same_as_tp1) + "/" + std::to_string(rows);
    if (!pass) ++failures;
    std::printf("%-12s graphs %-3s%s %s\n", mc.name, graphs ? "on" : "off", line.c_str(), pass ? "PASS" : "FAIL");
    advance(seqs, step, in, greedy);
  }
  return failures;
}

// ---- 3. generated weights: TP 2 against TP 1 ----

int check_generated_weights(const ModelCase& mc, bool kv_fp8 = false) {
  const model::ModelConfig cfg = small_config(mc);
  engine::CudaRunnerOptions opt = runner_options(true);
  opt.dummy_seed = 7;
  opt.kv_fp8 = kv_fp8;  // each rank quantizes its heads' K/V as one GPU does
  auto one = engine::CudaTpRunner::create(cfg, nullptr, opt, 1);
  PD_STATUS_CHECK(one.status());
  auto two = engine::CudaTpRunner::create(cfg, nullptr, opt, 2);
  if (!two.ok()) {
    std::printf("%-12s generated weights TP 2: FAIL create: %s\n", mc.name, two.status().to_string().c_str());
    return 1;
  }
  std::vector<Seq> seqs = initial_seqs(cfg.vocab_size);
  int failures = 0;
  for (const auto& step : step_plan()) {
    const engine::StepInput in = build_step(seqs, step);
    auto out1 = (*one)->execute(in);
    PD_STATUS_CHECK(out1.status());
    const auto rows = static_cast<int32_t>(out1->sampled.size());
    auto l1 = (*one)->rank(0).last_logits(rows);
    PD_STATUS_CHECK(l1.status());
    auto out2 = (*two)->execute(in);
    PD_STATUS_CHECK(out2.status());
    auto l2 = (*two)->rank(0).last_logits(rows);
    PD_STATUS_CHECK(l2.status());
    const ErrorStats e = compare(*l2, *l1);
    int ok = 0;
    std::vector<int32_t> next;
    for (int32_t r = 0; r < rows; ++r) {
      next.push_back(out1->sampled[static_cast<size_t>(r)].token_id);
      if (pick_ok(l1->data() + static_cast<size_t>(r) * cfg.vocab_size, cfg.vocab_size,
                  out2->sampled[static_cast<size_t>(r)].token_id, static_cast<float>(e.max_abs)))
        ++ok;
    }
    const bool pass = e.num_nan == 0 &&
                      e.rel_l2 <= (mc.fp8 || kv_fp8                             ? kFp8LogitsTolerance
                                   : mc.family == model::ModelFamily::kQwen3Moe ? kMoeLogitsTolerance
                                                                                : kLogitsTolerance) &&
                      ok == rows;
    if (!pass) ++failures;
    std::printf("%-12s generated weights%s TP2 vs TP1 rel_l2 %.2e tokens %d/%d %s\n", mc.name,
                kv_fp8 ? ", FP8 KV," : "", e.rel_l2, ok, rows, pass ? "PASS" : "FAIL");
    advance(seqs, step, in, next);
  }
  return failures;
}

}  // namespace
}  // namespace pd::gpu_test

int main(int argc, char** argv) {
  using pd::model::ModelFamily;
  int32_t max_tp = 2;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--max-tp") == 0) max_tp = std::atoi(argv[i + 1]);
  int visible = 0;
  PD_CUDA_CHECK(cudaGetDeviceCount(&visible));
  std::printf("tp_check: %d GPU(s) visible, TP up to %d\n", visible, max_tp);
  int failures = 0;
  for (int32_t ranks = 1; ranks <= std::min(visible, max_tp); ++ranks)
    failures += pd::gpu_test::check_collectives(ranks);
  {
    // More ranks than visible GPUs: refused at creation, naming the devices it needs.
    int32_t too_many = 2;
    while (too_many <= visible) too_many *= 2;
    if (too_many <= 8) {
      const pd::gpu_test::ModelCase d64{"qwen3-d64", ModelFamily::kQwen3, 64, false};
      auto r = pd::engine::CudaTpRunner::create(pd::gpu_test::small_config(d64), nullptr,
                                                pd::gpu_test::runner_options(true), too_many);
      const bool pass = !r.ok() && r.status().code() == pd::ErrorCode::kFailedPrecondition &&
                        r.status().message().find("GPU(s) are visible") != std::string::npos;
      if (!pass) ++failures;
      std::printf("TP %d on %d GPU(s): %s (%s)\n", too_many, visible, pass ? "refused PASS" : "FAIL",
                  r.ok() ? "created" : r.status().message().c_str());
    }
  }
  std::vector<int32_t> tp_sizes = {1};
  if (visible >= 2 && max_tp >= 2) {
    tp_sizes.push_back(2);
  } else {
    std::printf("TP 2 rows skipped: %d GPU(s) visible\n", visible);
  }
  const pd::gpu_test::ModelCase cases[] = {
      {"qwen3-d128", ModelFamily::kQwen3, 128, false}, {"qwen3-d64", ModelFamily::kQwen3, 64, false},
      {"qwen2-d128", ModelFamily::kQwen2, 128, false}, {"qwen3moe", ModelFamily::kQwen3Moe, 128, false},
      {"qwen3-fp8", ModelFamily::kQwen3, 128, true},   {"qwen3moe-fp8", ModelFamily::kQwen3Moe, 128, true},
  };
  for (const auto& mc : cases) failures += pd::gpu_test::check_model(mc, tp_sizes, true);
  failures += pd::gpu_test::check_model(cases[0], tp_sizes, false);
  failures += pd::gpu_test::check_model(cases[3], tp_sizes, false);
  if (tp_sizes.size() > 1) {
    failures += pd::gpu_test::check_generated_weights(cases[0]);
    failures += pd::gpu_test::check_generated_weights(cases[2]);
    failures += pd::gpu_test::check_generated_weights(cases[5]);
    failures += pd::gpu_test::check_generated_weights(cases[0], /*kv_fp8=*/true);
  }
  std::printf("tp check: %d failing\n", failures);
  return failures == 0 ? 0 : 1;
}
