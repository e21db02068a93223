// Whole-model check of the CUDA runner against the fp32 CPU runner with the
// same (seeded dummy) weights: mixed prefill lengths, chunked prefill mixed
// with decodes (eager path), and decode-only steps (CUDA graphs), feeding both
// runners the same tokens. Pass: logits relative L2 <= 2e-2 on every step and
// greedy tokens equal (a differing pick whose CPU logit is within the step's
// max abs logit error of the CPU's best is reported as a near-tie). Prints a table; exit 1 on failure.
// Also Qwen3-MoE (bf16 and FP8 experts) and block-FP8 Qwen3; --moe-fp8-only runs only those.
// The sampler rows (penalties, logit_bias, allowed ids, bad words, min_tokens suppression, seeds)
// against engine::sample_step_token and prompt logprobs against the CPU runner; --sampling-only
// runs only those (tests/gpu/device_sampling_checks.sh).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "engine/runner/cpu_model_runner.h"
#include "engine/runner_cuda/cuda_model_runner.h"
#include "engine/sampler.h"
#include "model/weights.h"
#include "tests/gpu/gpu_util.h"

namespace pd::gpu_test {
namespace {

constexpr double kLogitsTolerance = 2e-2;  // bf16 activations rounded at every op over 3 layers
// Block-FP8 models: the CPU runner quantizes every linear's input per token per 128 columns
// (as the checkpoints' dynamic activation scheme does); the CUDA runner does so on its
// cuBLASLt path but its weight-streaming path (small M: decode, MoE experts) multiplies the
// bf16 activations unquantized, which differs from the reference by the activation rounding.
// That rounding (2^-4 relative per element) reaches the logits through every FP8 linear.
constexpr double kFp8LogitsTolerance = 1e-1;

model::ModelConfig small_config(model::ModelFamily family, int head_dim, bool fp8 = false) {
  model::ModelConfig c;
  c.family = family;
  c.architecture = family == model::ModelFamily::kQwen3      ? "Qwen3ForCausalLM"
                   : family == model::ModelFamily::kQwen3Moe ? "Qwen3MoeForCausalLM"
                                                             : "Qwen2ForCausalLM";
  c.vocab_size = 4096;
  c.hidden_size = 512;
  c.intermediate_size = 1024;
  c.num_layers = 3;
  c.num_heads = 512 / head_dim * (head_dim == 64 ? 1 : 1);
  c.num_kv_heads = c.num_heads / 4;
  c.head_dim = head_dim;
  c.rms_norm_eps = 1e-6f;
  c.rope_theta = 1e6;
  c.max_position_embeddings = 4096;
  c.tie_word_embeddings = family == model::ModelFamily::kQwen3;
  c.qk_norm = family == model::ModelFamily::kQwen3 || family == model::ModelFamily::kQwen3Moe;
  c.qkv_bias = family == model::ModelFamily::kQwen2;
  if (family == model::ModelFamily::kQwen3Moe) {
    // 16 experts, top 4 renormalized; layer 1 stays a dense MLP (mlp_only_layers).
    c.moe.num_experts = 16;
    c.moe.num_experts_per_tok = 4;
    c.moe.moe_intermediate_size = 256;
    c.moe.norm_topk_prob = true;
    c.moe.decoder_sparse_step = 1;
    c.moe.mlp_only_layers = {1};
  }
  if (fp8) {
    c.quant.method = model::QuantMethod::kFp8Block;
    c.quant.block_out = 128;
    c.quant.block_in = 128;
  }
  return c;
}

struct Seq {
  std::vector<int32_t> tokens;  // all known tokens
  int32_t computed = 0;
  std::vector<int32_t> blocks;
};

// Options other than the defaults a variant of the check runs with.
struct Variant {
  bool merge_in_attention = false;  // split-K merge in decode attention's last CTA
  int32_t decode_partition_tokens = 0;
  bool kv_evict_first = true;
  int32_t kv_stages = 0;      // 0 = the runner's rule by batch
  bool fuse_norms = true;     // CudaRunnerOptions::fuse_norms_into_gemms
  bool skinny_gemms = false;  // GemmPolicy::kSkinny: skinny v0 (norm in-kernel) wherever M <= 16
  bool fp8 = false;           // block-FP8 weights (quantization_config)
};

int run_check(model::ModelFamily family, int head_dim, bool graphs, Variant variant = {}) {
  const auto cfg = small_config(family, head_dim, variant.fp8);
  const double tolerance = variant.fp8 ? kFp8LogitsTolerance : kLogitsTolerance;
  // Both runners get the same bf16-representable weights, so the check sees
  // the kernels' error, not the weight rounding.
  auto weights = model::dummy_weights(cfg, 1234, 0.05f);
  for (const auto& spec : model::weight_specs(cfg)) {
    const model::Tensor* t = weights.find(spec.name);
    if (t == nullptr) continue;
    model::Tensor rounded = *t;
    // MoE routers 8x larger (logits std ~9): the softmax is peaked, so when bf16 noise swaps the
    // k-th and (k+1)-th experts of a token their weights are negligible, and a swap does not
    // show as a logits error the way it would with near-uniform routing.
    const bool router = spec.name.size() > 16 && spec.name.compare(spec.name.size() - 16, 16, ".mlp.gate.weight") == 0;
    for (float& v : rounded.data) v = bf16_round(router ? 8.0f * v : v);
    weights.put(spec.name, std::move(rounded));
  }
  const int num_blocks = 256, max_len = 1024;
  auto cpu_r = engine::CpuModelRunner::create(cfg, weights, 16, num_blocks, max_len);
  PD_STATUS_CHECK(cpu_r.status());
  engine::CudaRunnerOptions opt;
  opt.max_model_len = max_len;
  opt.max_num_seqs = 16;
  opt.max_num_batched_tokens = 512;
  opt.num_kv_blocks = num_blocks;
  opt.enable_cuda_graphs = graphs;
  opt.decode_merge_in_attention = variant.merge_in_attention;
  opt.decode_partition_tokens = variant.decode_partition_tokens;
  opt.decode_kv_evict_first = variant.kv_evict_first;
  opt.decode_kv_stages = variant.kv_stages;
  opt.fuse_norms_into_gemms = variant.fuse_norms;
  if (variant.skinny_gemms) opt.gemm_policy = kernels::cuda::GemmPolicy::kSkinny;
  auto gpu_r = engine::CudaModelRunner::create(cfg, &weights, opt);
  PD_STATUS_CHECK(gpu_r.status());

  std::vector<Seq> seqs(4);
  const int prompt_len[4] = {5, 37, 100, 70};
  int next_block = 0;
  uint32_t x = 12345;
  for (int s = 0; s < 4; ++s) {
    for (int i = 0; i < prompt_len[s]; ++i) {
      x = x * 1664525u + 1013904223u;
      seqs[s].tokens.push_back(static_cast<int32_t>(x % cfg.vocab_size));
    }
    for (int b = 0; b < 16; ++b) seqs[s].blocks.push_back(next_block++);
  }
  int failures = 0;
  // Step plan: (seq, num_new) lists. Seq 3 is prefilled in chunks of 40 + 30 beside decodes.
  std::vector<std::vector<std::pair<int, int>>> plan = {
      {{0, 5}, {1, 37}, {2, 100}},
      {{0, 1}, {1, 1}, {2, 1}, {3, 40}},
      {{0, 1}, {3, 30}, {1, 1}, {2, 1}},
  };
  for (int i = 0; i < 10; ++i) plan.push_back({{0, 1}, {1, 1}, {2, 1}, {3, 1}});
  plan.push_back({{2, 1}});
  std::printf(
      "variant: merge in attention %d, partition %d, kv evict-first %d, kv stages %d, norms fused %d, skinny gemms "
      "%d, fp8 weights %d\n",
      variant.merge_in_attention ? 1 : 0, variant.decode_partition_tokens, variant.kv_evict_first ? 1 : 0,
      variant.kv_stages, variant.fuse_norms ? 1 : 0, variant.skinny_gemms ? 1 : 0, variant.fp8 ? 1 : 0);
  std::printf("%-8s %-5s %-6s %-34s %10s %8s\n", "family", "D", "graphs", "step", "rel_l2", "tokens");
  for (size_t step = 0; step < plan.size(); ++step) {
    engine::StepInput in;
    std::string desc;
    for (auto [s, n] : plan[step]) {
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
      desc += std::to_string(s) + ":" + std::to_string(n) + " ";
    }
    auto cpu_logits = (*cpu_r)->forward(in, engine::CpuModelRunner::LogitsRows::kSampled);
    PD_STATUS_CHECK(cpu_logits.status());
    auto out = (*gpu_r)->execute(in);
    PD_STATUS_CHECK(out.status());
    const auto num_rows = static_cast<int32_t>(out->sampled.size());
    auto gpu_logits = (*gpu_r)->last_logits(num_rows);
    PD_STATUS_CHECK(gpu_logits.status());
    const ErrorStats e = compare(*gpu_logits, *cpu_logits);
    // A differing greedy token counts as a failure unless the CPU logits of the two
    // picks are within the step's bf16 noise (max abs logit error): a near-tie.
    int agree = 0, near_ties = 0;
    for (int32_t r = 0; r < num_rows; ++r) {
      const float* row = cpu_logits->data() + static_cast<size_t>(r) * cfg.vocab_size;
      int best = 0;
      for (int v = 1; v < cfg.vocab_size; ++v)
        if (row[v] > row[best]) best = v;
      const int32_t picked = out->sampled[static_cast<size_t>(r)].token_id;
      if (best == picked) {
        ++agree;
      } else if (picked >= 0 && picked < cfg.vocab_size && row[best] - row[picked] <= e.max_abs) {
        ++near_ties;
      }
    }
    // Advance: the GPU's tokens feed both runners.
    int r = 0;
    for (size_t k = 0; k < in.seqs.size(); ++k) {
      Seq& q = seqs[static_cast<size_t>(plan[step][k].first)];
      q.computed += in.seqs[k].num_new_tokens;
      if (in.seqs[k].sample) q.tokens.push_back(out->sampled[static_cast<size_t>(r++)].token_id);
    }
    const bool pass = e.num_nan == 0 && e.rel_l2 <= tolerance && agree + near_ties == num_rows;
    if (!pass) ++failures;
    std::printf("%-8s %-5d %-6s %-34s %10.2e %5d/%-2d %s%s\n",
                family == model::ModelFamily::kQwen3      ? "qwen3"
                : family == model::ModelFamily::kQwen3Moe ? "qwen3moe"
                                                          : "qwen2",
                head_dim, graphs ? "on" : "off", desc.c_str(), e.rel_l2, agree, num_rows, pass ? "PASS" : "FAIL",
                near_ties > 0 ? " (near-tie)" : "");
  }
  std::printf("graphs captured: %d\n", (*gpu_r)->num_graphs_captured());
  return failures;
}

// Rows with penalties, logit_bias, allowed_token_ids or bad words: the runner
// must sample each from its own logits exactly as engine::sample_step_token
// does (the token history reaches the sampler), and each processor must act.
int check_logits_processing_rows() {
  const auto cfg = small_config(model::ModelFamily::kQwen3, 128);
  auto weights = model::dummy_weights(cfg, 99, 0.05f);
  engine::CudaRunnerOptions opt;
  opt.max_model_len = 256;
  opt.max_num_seqs = 8;
  opt.max_num_batched_tokens = 256;
  opt.num_kv_blocks = 64;
  opt.enable_cuda_graphs = false;
  auto gpu_r = engine::CudaModelRunner::create(cfg, &weights, opt);
  PD_STATUS_CHECK(gpu_r.status());
  const std::vector<int32_t> prompt = {11, 12, 13, 14, 15, 16, 17, 18};
  const std::vector<int32_t> history = {21, 21, 22, 23};  // "generated" tokens the penalties see
  struct Case {
    const char* name;
    engine::SamplingParams sampling;
  };
  std::vector<Case> cases(7);
  for (auto& c : cases) c.sampling.temperature = 0.0f;
  cases[0].name = "presence+frequency";
  cases[0].sampling.presence_penalty = 1.5f;
  cases[0].sampling.frequency_penalty = 2.0f;
  cases[1].name = "repetition";
  cases[1].sampling.repetition_penalty = 1.8f;
  cases[2].name = "logit_bias";
  cases[2].sampling.logit_bias = {{4000, 100.0f}};
  cases[3].name = "allowed_token_ids";
  cases[3].sampling.allowed_token_ids = {7, 3001, 4095};
  cases[4].name = "bad_words";
  cases[4].sampling.bad_words_token_ids = {{23, 4001}, {4002}};
  cases[5].name = "seeded+bias";
  cases[5].sampling.temperature = 0.9f;
  cases[5].sampling.seed = 5;
  cases[5].sampling.logit_bias = {{9, 2.0f}, {10, -2.0f}};
  cases[6].name = "penalties+top_p";
  cases[6].sampling.temperature = 1.1f;
  cases[6].sampling.top_p = 0.9f;
  cases[6].sampling.frequency_penalty = -1.0f;
  engine::StepInput in;
  for (size_t k = 0; k < cases.size(); ++k) {
    engine::SeqStep st;
    st.token_offset = static_cast<int32_t>(in.token_ids.size());
    st.num_new_tokens = static_cast<int32_t>(prompt.size());
    for (int b = 0; b < 2; ++b) st.block_table.push_back(static_cast<int32_t>(k) * 2 + b);
    st.sample = true;
    st.sampling = cases[k].sampling;
    st.rng_seed = engine::derive_rng_seed(1000 + k, 4);
    st.prompt_token_ids = prompt;
    st.output_token_ids = history;
    in.token_ids.insert(in.token_ids.end(), prompt.begin(), prompt.end());
    in.seqs.push_back(st);
  }
  auto out = (*gpu_r)->execute(in);
  PD_STATUS_CHECK(out.status());
  auto gpu_logits = (*gpu_r)->last_logits(static_cast<int32_t>(cases.size()));
  PD_STATUS_CHECK(gpu_logits.status());
  int failures = 0;
  for (size_t k = 0; k < cases.size(); ++k) {
    std::vector<float> row(gpu_logits->begin() + static_cast<std::ptrdiff_t>(k * cfg.vocab_size),
                           gpu_logits->begin() + static_cast<std::ptrdiff_t>((k + 1) * cfg.vocab_size));
    const int32_t want = engine::sample_step_token(row, in.seqs[k]).token_id;
    const int32_t got = out->sampled[k].token_id;
    bool acts = true;
    if (k == 2) acts = got == 4000;
    if (k == 3) acts = got == 7 || got == 3001 || got == 4095;
    if (k == 4) acts = got != 4001 && got != 4002;
    const bool pass = got == want && acts;
    if (!pass) ++failures;
    std::printf("logits processing %-20s token %6d cpu sampler %6d %s\n", cases[k].name, got, want,
                pass ? "PASS" : "FAIL");
  }
  return failures;
}

// min_tokens (EOS / stop ids suppressed: a short list in the GPU kernel, a list over
// kernels::cuda::kMaxSuppressedPerRow on the host) and seeded temperature / min-p rows in
// the GPU kernel: each must give engine::sample_step_token's token on the same logits.
int check_suppression_and_seed_rows() {
  const auto cfg = small_config(model::ModelFamily::kQwen3, 128);
  auto weights = model::dummy_weights(cfg, 77, 0.05f);
  engine::CudaRunnerOptions opt;
  opt.max_model_len = 256;
  opt.max_num_seqs = 8;
  opt.max_num_batched_tokens = 256;
  opt.num_kv_blocks = 64;
  opt.enable_cuda_graphs = false;
  auto gpu_r = engine::CudaModelRunner::create(cfg, &weights, opt);
  PD_STATUS_CHECK(gpu_r.status());
  const std::vector<int32_t> prompt = {31, 32, 33, 34, 35, 36};
  // First the greedy picks without suppression, to suppress exactly those.
  auto step_of = [&](const std::vector<engine::SamplingParams>& params,
                     const std::vector<std::vector<int32_t>>& suppressed) {
    engine::StepInput in;
    for (size_t k = 0; k < params.size(); ++k) {
      engine::SeqStep st;
      st.token_offset = static_cast<int32_t>(in.token_ids.size());
      st.num_new_tokens = static_cast<int32_t>(prompt.size());
      st.block_table = {static_cast<int32_t>(k)};
      st.sample = true;
      st.sampling = params[k];
      st.rng_seed = engine::derive_rng_seed(500 + k, 0);
      st.suppressed_token_ids = suppressed[k];
      in.token_ids.insert(in.token_ids.end(), prompt.begin(), prompt.end());
      in.seqs.push_back(st);
    }
    return in;
  };
  engine::SamplingParams greedy;
  greedy.temperature = 0.0f;
  auto first = (*gpu_r)->execute(step_of({greedy}, {{}}));
  PD_STATUS_CHECK(first.status());
  const int32_t favourite = first->sampled[0].token_id;
  std::vector<int32_t> long_list;
  for (int32_t id = 0; id < 80; ++id) long_list.push_back(id == 0 ? favourite : 1000 + id);
  struct Case {
    const char* name;
    engine::SamplingParams sampling;
    std::vector<int32_t> suppressed;
    bool must_avoid_favourite;
  };
  std::vector<Case> cases(5);
  cases[0] = {"min_tokens (kernel)", greedy, {favourite, 4095}, true};
  cases[1] = {"min_tokens (host, 80 ids)", greedy, long_list, true};
  cases[2].name = "seed 1 temperature 0.8";
  cases[2].sampling.temperature = 0.8f;
  cases[2].sampling.seed = 1;
  cases[3].name = "seed 2 min_p 0.05";
  cases[3].sampling.temperature = 1.0f;
  cases[3].sampling.min_p = 0.05f;
  cases[3].sampling.seed = 2;
  cases[4] = {"seeded + min_tokens", cases[2].sampling, {favourite}, true};
  std::vector<engine::SamplingParams> params;
  std::vector<std::vector<int32_t>> suppressed;
  for (const Case& c : cases) {
    params.push_back(c.sampling);
    suppressed.push_back(c.suppressed);
  }
  const engine::StepInput in = step_of(params, suppressed);
  auto out = (*gpu_r)->execute(in);
  PD_STATUS_CHECK(out.status());
  // The rows the kernel sampled hold -inf at their suppressed ids now; the host rows are raw.
  // Both give sample_step_token's pick (suppression applied to -inf twice is the same row).
  auto gpu_logits = (*gpu_r)->last_logits(static_cast<int32_t>(cases.size()));
  PD_STATUS_CHECK(gpu_logits.status());
  int failures = 0;
  for (size_t k = 0; k < cases.size(); ++k) {
    std::vector<float> row(gpu_logits->begin() + static_cast<std::ptrdiff_t>(k * cfg.vocab_size),
                           gpu_logits->begin() + static_cast<std::ptrdiff_t>((k + 1) * cfg.vocab_size));
    const int32_t want = engine::sample_step_token(row, in.seqs[k]).token_id;
    const int32_t got = out->sampled[k].token_id;
    const bool pass = got == want && (!cases[k].must_avoid_favourite || got != favourite);
    if (!pass) ++failures;
    std::printf("sampling %-28s token %6d cpu sampler %6d (unsuppressed greedy %d) %s\n", cases[k].name, got, want,
                favourite, pass ? "PASS" : "FAIL");
  }
  return failures;
}

// Prompt logprobs (SeqStep::prompt_logprobs) from the CUDA runner against the fp32 CPU
// runner on the same bf16-representable weights: one prompt in one step, one in chunks of
// 40 + 30 beside a decode. Per position: the same next prompt token, its logprob within
// bf16 noise, and the top-1 id equal unless the CPU's two best logits are within that noise.
int check_prompt_logprobs() {
  const auto cfg = small_config(model::ModelFamily::kQwen3, 128);
  auto weights = model::dummy_weights(cfg, 4321, 0.05f);
  for (const auto& spec : model::weight_specs(cfg)) {
    const model::Tensor* t = weights.find(spec.name);
    if (t == nullptr) continue;
    model::Tensor rounded = *t;
    for (float& v : rounded.data) v = bf16_round(v);
    weights.put(spec.name, std::move(rounded));
  }
  auto cpu_r = engine::CpuModelRunner::create(cfg, weights, 16, 64, 256);
  PD_STATUS_CHECK(cpu_r.status());
  engine::CudaRunnerOptions opt;
  opt.max_model_len = 256;
  opt.max_num_seqs = 8;  // so a 40-row chunk goes through final_logits in 5 groups
  opt.max_num_batched_tokens = 256;
  opt.num_kv_blocks = 64;
  opt.enable_cuda_graphs = false;
  auto gpu_r = engine::CudaModelRunner::create(cfg, &weights, opt);
  PD_STATUS_CHECK(gpu_r.status());
  std::vector<int32_t> a(23), b(70);
  uint32_t x = 99;
  for (auto* p : {&a, &b})
    for (int32_t& t : *p) t = static_cast<int32_t>((x = x * 1664525u + 1013904223u) % cfg.vocab_size);
  auto seq = [](const std::vector<int32_t>& prompt, int32_t computed, int32_t n, int32_t first_block, bool sample) {
    engine::SeqStep st;
    st.num_computed_tokens = computed;
    st.num_new_tokens = n;
    for (int32_t blk = 0; blk < 8; ++blk) st.block_table.push_back(first_block + blk);
    st.sample = sample;
    st.sampling.temperature = 0.0f;
    st.prompt_logprobs = 4;
    st.prompt_token_ids = prompt;
    return st;
  };
  std::vector<engine::StepInput> steps(2);
  auto add = [](engine::StepInput& in, engine::SeqStep st, const std::vector<int32_t>& prompt) {
    st.token_offset = static_cast<int32_t>(in.token_ids.size());
    in.token_ids.insert(in.token_ids.end(), prompt.begin() + st.num_computed_tokens,
                        prompt.begin() + st.num_computed_tokens + st.num_new_tokens);
    in.seqs.push_back(st);
  };
  add(steps[0], seq(a, 0, 23, 0, true), a);
  add(steps[0], seq(b, 0, 40, 8, false), b);
  add(steps[1], seq(b, 40, 30, 8, true), b);
  int failures = 0;
  double max_diff = 0.0;
  int num_rows = 0, top_agree = 0, near_ties = 0;
  for (const engine::StepInput& in : steps) {
    auto cpu = (*cpu_r)->execute(in);
    PD_STATUS_CHECK(cpu.status());
    auto gpu = (*gpu_r)->execute(in);
    PD_STATUS_CHECK(gpu.status());
    if (gpu->prompt_logprobs.size() != cpu->prompt_logprobs.size()) {
      std::printf("prompt logprobs: %zu chunks on cuda, %zu on cpu FAIL\n", gpu->prompt_logprobs.size(),
                  cpu->prompt_logprobs.size());
      ++failures;
      continue;
    }
    for (size_t c = 0; c < gpu->prompt_logprobs.size(); ++c) {
      const auto& g = gpu->prompt_logprobs[c];
      const auto& w = cpu->prompt_logprobs[c];
      if (g.seq_index != w.seq_index || g.first_position != w.first_position || g.rows.size() != w.rows.size()) {
        std::printf("prompt logprobs chunk %zu: seq %d/%d, position %d/%d, rows %zu/%zu FAIL\n", c, g.seq_index,
                    w.seq_index, g.first_position, w.first_position, g.rows.size(), w.rows.size());
        ++failures;
        continue;
      }
      for (size_t r = 0; r < g.rows.size(); ++r) {
        ++num_rows;
        const auto& gr = g.rows[r];
        const auto& wr = w.rows[r];
        max_diff = std::max(max_diff, static_cast<double>(std::fabs(gr.logprob - wr.logprob)));
        const bool same_token = gr.token_id == wr.token_id && gr.top_logprobs.size() == 4;
        const bool top_same = same_token && gr.top_logprobs[0].first == wr.top_logprobs[0].first;
        const bool near_tie = same_token && wr.top_logprobs[0].second - wr.top_logprobs[1].second < 5e-2f;
        top_agree += top_same;
        near_ties += !top_same && near_tie;
        if (!same_token || std::fabs(gr.logprob - wr.logprob) > 5e-2f || (!top_same && !near_tie)) ++failures;
      }
    }
  }
  std::printf("prompt logprobs: %d rows, max |logprob diff| %.3e, top-1 equal %d, near-ties %d, %d failing %s\n",
              num_rows, max_diff, top_agree, near_ties, failures,
              failures == 0 && num_rows == 22 + 69 ? "PASS" : "FAIL");
  return failures + (num_rows == 22 + 69 ? 0 : 1);
}

}  // namespace
}  // namespace pd::gpu_test

int main(int argc, char** argv) {
  using pd::model::ModelFamily;
  PD_CUDA_CHECK(cudaSetDevice(0));
  int failures = 0;
  if (argc > 1 && std::string(argv[1]) == "--sampling-only") {
    failures += pd::gpu_test::check_logits_processing_rows();
    failures += pd::gpu_test::check_suppression_and_seed_rows();
    failures += pd::gpu_test::check_prompt_logprobs();
    std::printf("sampling check: %d failing rows\n", failures);
    return failures == 0 ? 0 : 1;
  }
  if (argc > 1 && std::string(argv[1]) == "--moe-fp8-only") {
    failures += pd::gpu_test::run_check(ModelFamily::kQwen3Moe, 128, true);
    failures += pd::gpu_test::run_check(ModelFamily::kQwen3Moe, 128, false);
    failures += pd::gpu_test::run_check(ModelFamily::kQwen3Moe, 128, true, {.fp8 = true});
    failures += pd::gpu_test::run_check(ModelFamily::kQwen3, 128, true, {.fp8 = true});
    failures += pd::gpu_test::run_check(ModelFamily::kQwen3, 64, false, {.fp8 = true});
    std::printf("runner check: %d failing steps\n", failures);
    return failures == 0 ? 0 : 1;
  }
  failures += pd::gpu_test::run_check(ModelFamily::kQwen3, 128, true);
  failures += pd::gpu_test::run_check(ModelFamily::kQwen3, 64, false);
  failures += pd::gpu_test::run_check(ModelFamily::kQwen2, 128, true);
  failures += pd::gpu_test::run_check(ModelFamily::kQwen3, 128, true, {.merge_in_attention = true});
  // The largest partition (one per sequence here), K/V loads without the evict-first hint
  // (the default has it) and a 3-stage K/V ring, with graphs and eagerly.
  const pd::gpu_test::Variant one_partition{.decode_partition_tokens = 2048, .kv_evict_first = false, .kv_stages = 3};
  failures += pd::gpu_test::run_check(ModelFamily::kQwen3, 128, true, one_partition);
  failures += pd::gpu_test::run_check(ModelFamily::kQwen2, 64, false, one_partition);
  // Norms as their own kernels (the unfused layer), and the skinny kernels forced wherever
  // M <= 16 so every decode GEMM that reads a norm computes it in-kernel.
  failures += pd::gpu_test::run_check(ModelFamily::kQwen3, 128, true, {.fuse_norms = false});
  failures += pd::gpu_test::run_check(ModelFamily::kQwen2, 64, false, {.fuse_norms = false});
  failures += pd::gpu_test::run_check(ModelFamily::kQwen3, 128, true, {.skinny_gemms = true});
  failures += pd::gpu_test::run_check(ModelFamily::kQwen2, 128, false, {.skinny_gemms = true});
  failures += pd::gpu_test::check_logits_processing_rows();
  failures += pd::gpu_test::check_suppression_and_seed_rows();
  failures += pd::gpu_test::check_prompt_logprobs();
  // Qwen3-MoE (bf16 and block-FP8 experts; decode through the graphs' streaming experts,
  // prefill and mixed steps through one GEMM per expert) and a dense block-FP8 Qwen3.
  failures += pd::gpu_test::run_check(ModelFamily::kQwen3Moe, 128, true);
  failures += pd::gpu_test::run_check(ModelFamily::kQwen3Moe, 128, false);
  failures += pd::gpu_test::run_check(ModelFamily::kQwen3Moe, 128, true, {.fp8 = true});
  failures += pd::gpu_test::run_check(ModelFamily::kQwen3, 128, true, {.fp8 = true});
  failures += pd::gpu_test::run_check(ModelFamily::kQwen3, 64, false, {.fp8 = true});
  std::printf("runner check: %d failing steps\n", failures);
  return failures == 0 ? 0 : 1;
}
