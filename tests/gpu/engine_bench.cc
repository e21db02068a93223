// Engine benchmark of the CUDA runner against the floors measured in the same
// run (DESIGN.md §7): decode steps at batch 1/16/64/128 with 2,048-token
// contexts vs the HBM floor ((weights read + KV read) / device-to-device copy
// bandwidth), and prefill of 1 and 8 prompts of 2,000 tokens vs the bf16 GEMM
// rate (2 * linear params * tokens + causal attention + lm_head of the sampled
// rows). Qwen3-8B and Qwen3-32B shapes with dummy weights generated on the GPU.
// --ops first times every kernel of a Qwen3-8B decode step on its own (GEMMs
// with cuBLASLt's first heuristic choice, the autotuned plan and the skinny
// kernel, against their bytes / copy-bandwidth floor; norms, RoPE, SwiGLU;
// decode attention per split-K partition size), sums them per step, and the
// decode rows then show that sum beside the graph replay and execute() times.
// Usage: pd_gpu_engine_bench [--model qwen3-8b|qwen3-32b|all|none] [--ctx 2048] [--decode-kernel tc|simt]
//        [--gemm autotune|heuristic|skinny] [--decode-only 1] [--ops 1] [--pdl 0|1] [--merge-in-attention 0|1]
//        [--pdl-max-tokens N] [--decode-partition N] [--kv-evict-first 0|1] [--kv-stages 2|3] [--fuse-norms 0|1]
// --ops attn: only the decode attention sweep (partition sizes; merged, no evict-first, 3 stages).
// --ops timeline: the same plus per-CTA timelines of the runner's configuration
// (AttentionArgs::decode_cta_clock).
// --ops probe: launches a fixed list of kernels once each, for ncu (probe_for_profiler).
// --merge-in-attention 1: decode attention merges its partitions in its last CTA instead of the reduce
// kernel (CudaRunnerOptions::decode_merge_in_attention; off by default).
// --pdl-max-tokens N: programmatic dependent launch for passes of up to N tokens (default 256).
// --fp8-model qwen3-30b-a3b-fp8|qwen3-235b-a22b-fp8|qwen3-32b-fp8|fp8-all: the FP8 rate (cuBLASLt
// block-scaled, 2048x4096x4096) beside the bf16 rate, then kernel-level FP8 forward passes of
// that shape (engine_bench_fp8.cc) instead of the bf16 runner; --layers N overrides the layer
// count, --batches 1,16,64 the decode batches, --decode-only 1 skips prefill, --kv-fp8-batch N
// (default 64, 0 = off) adds a decode step at batch N with the FP8 KV cache.
// --pd-sweep 1: the P/D engine sweep instead of the floors (bench_pd_sweep; --model picks the shape,
// --sweep-decode-batch N the decode rows of the mixed steps, default 16): producer prefill steps for
// token budgets 512..16384 at prompt lengths 2,048 and 8,192; mixed steps (a decode batch plus one
// prefill chunk of 64..512 tokens) at 2,048- and 8,192-token contexts; the first-token path's steps.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "engine/runner_cuda/cuda_model_runner.h"
#include "tests/gpu/bench_util.h"
#include "tests/gpu/engine_bench_fp8.h"
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

namespace kc = pd::kernels::cuda;
using bf16 = __nv_bfloat16;

struct Row {
  std::string what;
  double floor_ms;
  double measured_ms;
  std::string note;
  double graph_ms = -1.0;       // decode: one replay of the captured graph
  double kernel_sum_ms = -1.0;  // decode, with --ops: sum of the step's kernels timed alone
};

// --ops: batch size -> sum of the kernels of one decode step (ms).
std::map<int, double> g_kernel_sum_ms;
// --pdl-max-tokens: CudaRunnerOptions::programmatic_launch_max_tokens (0 = the runner's default).
int g_pdl_max_tokens = 0;
// --decode-partition, --kv-evict-first: the CudaRunnerOptions of the same names (-1 = the
// runner's default).
int g_decode_partition = -1;
int g_kv_evict_first = -1;
int g_kv_stages = -1;               // --kv-stages: CudaRunnerOptions::decode_kv_stages
int g_fuse_norms = -1;              // --fuse-norms 0|1: CudaRunnerOptions::fuse_norms_into_gemms
bool g_attention_timeline = false;  // --ops timeline: the attention sweep plus per-CTA timelines

const char* policy_name(kc::GemmPolicy p) {
  return p == kc::GemmPolicy::kAutotune ? "autotune" : p == kc::GemmPolicy::kHeuristic ? "heuristic" : "skinny";
}

// Per-op timings of a Qwen3-8B decode step at batch m (bench_ops).
constexpr int kOpsCallsPerGraph = 20;
struct OpsContext {
  double copy_gbs;
  int ctx;
};

// Weight copies cycled between calls so that repeated timing reads HBM, not L2
// (each layer of the real model reads different weights).
struct WeightPool {
  std::vector<DeviceBuffer<bf16>> copies;
  size_t next = 0;
  WeightPool(size_t elems, size_t min_total_bytes) {
    const size_t bytes = elems * sizeof(bf16);
    const size_t n = std::max<size_t>(1, (min_total_bytes + bytes - 1) / bytes);
    for (size_t i = 0; i < n; ++i) {
      copies.emplace_back(elems);
      PD_STATUS_CHECK(kc::fill_uniform(copies.back().get(), elems, 100 + i, 0.03f, nullptr));
    }
  }
  const bf16* take() { return copies[next++ % copies.size()].get(); }
};

// Decode attention of m one-token queries over ctx-token contexts in 16-token blocks; the
// caller sets the block tables (and the partition) it wants.
kc::AttentionArgs decode_attention_args(const bf16* q, bf16* out, const bf16* kv_cache, const int32_t* query_start,
                                        const int32_t* context_lens, int m, int blocks_per_seq, int ctx, int hq,
                                        int hkv, int d) {
  kc::AttentionArgs a;
  a.q = q;
  a.out = out;
  a.kv_cache = kv_cache;
  a.query_start = query_start;
  a.context_lens = context_lens;
  a.max_blocks_per_seq = blocks_per_seq;
  a.num_seqs = m;
  a.max_query_len = 1;
  a.max_context_len = ctx;
  a.num_q_heads = hq;
  a.num_kv_heads = hkv;
  a.head_dim = d;
  a.scale = 1.0f / std::sqrt(static_cast<float>(d));
  return a;
}

void bench_ops(const model::ModelConfig& cfg, const OpsContext& oc, const std::vector<int>& batches,
               bool attention_only) {
  const int h = cfg.hidden_size, inter = cfg.intermediate_size, hq = cfg.num_heads, hkv = cfg.num_kv_heads,
            d = cfg.head_dim;
  struct Shape {
    const char* name;
    int n, k;
    kc::GemmOut out;
  };
  const std::vector<Shape> shapes = {{"qkv", (hq + 2 * hkv) * d, h, kc::GemmOut::kBFloat16},
                                     {"o_proj", h, hq * d, kc::GemmOut::kBFloat16},
                                     {"gate_up", 2 * inter, h, kc::GemmOut::kBFloat16},
                                     {"down", h, inter, kc::GemmOut::kBFloat16},
                                     {"lm_head", cfg.vocab_size, h, kc::GemmOut::kFloat32}};
  const int max_m = *std::max_element(batches.begin(), batches.end());
  const size_t kMinPoolBytes = 512ull << 20;  // >> the 50-60 MB L2
  DeviceBuffer<bf16> act(static_cast<size_t>(max_m) * std::max(inter, h) * 2);
  PD_STATUS_CHECK(kc::fill_uniform(act.get(), act.count(), 5, 1.0f, nullptr));
  DeviceBuffer<float> out(static_cast<size_t>(max_m) * cfg.vocab_size);
  std::printf(
      "\nper-op timings, %s shapes: device ms per call, %d calls back to back in one CUDA graph "
      "(floor = bytes / %.0f GB/s copy bandwidth)\n",
      cfg.architecture.c_str(), kOpsCallsPerGraph, oc.copy_gbs);
  std::printf("%-8s %4s %9s %9s %9s %9s %7s %7s  %s\n", "op", "M", "floor", "heur", "tuned", "skinny", "heur/fl",
              "tuned/fl", "tuned choice (best skinny variant)");
  // gemm_ms[m][shape] = the autotuned time (what the runner runs).
  std::map<int, std::vector<double>> gemm_ms;
  for (const Shape& sh : shapes) {
    if (attention_only) break;
    WeightPool pool(static_cast<size_t>(sh.n) * sh.k, kMinPoolBytes);
    for (int m : batches) {
      const double out_bytes = sh.out == kc::GemmOut::kFloat32 ? 4.0 : 2.0;
      const double bytes = 2.0 * sh.n * sh.k + 2.0 * m * sh.k + out_bytes * m * sh.n;
      const double floor_ms = bytes / (oc.copy_gbs * 1e6);
      auto time_policy = [&](kc::GemmPolicy policy, int variant, std::string* choice) {
        auto gemm = kc::Gemm::create(64ull << 20, policy, variant);
        PD_STATUS_CHECK(gemm.status());
        const double ms = time_in_graph_ms(
            [&](cudaStream_t st) {
              PD_STATUS_CHECK((*gemm)->run(out.get(), sh.out, act.get(), pool.take(), m, sh.n, sh.k, st));
            },
            kOpsCallsPerGraph);
        if (choice != nullptr && !(*gemm)->tunings().empty()) {
          const kc::GemmTuning& t = (*gemm)->tunings().back();
          *choice = std::string(t.chose_skinny ? "skinny" : "cublas") + " (v" + std::to_string(t.skinny_variant) + ")";
        }
        return ms;
      };
      std::string choice;
      const double heur = time_policy(kc::GemmPolicy::kHeuristic, 0, nullptr);
      const double tuned = time_policy(kc::GemmPolicy::kAutotune, 0, &choice);
      double skinny = -1.0;
      for (int v = 0; v < kc::Gemm::num_skinny_variants() && m <= 16; ++v) {
        if (m > kc::Gemm::skinny_variant_max_m(v)) continue;
        const double ms = time_policy(kc::GemmPolicy::kSkinny, v, nullptr);
        if (skinny < 0.0 || ms < skinny) skinny = ms;
      }
      gemm_ms[m].push_back(tuned);
      std::printf("%-8s %4d %9.4f %9.4f %9.4f %9.4f %7.2f %7.2f  %s\n", sh.name, m, floor_ms, heur, tuned, skinny,
                  heur / floor_ms, tuned / floor_ms, choice.c_str());
    }
  }

  // Elementwise kernels and attention at each batch size. The KV pool spans at
  // least kMinPoolBytes and each call reads other blocks, so attention reads HBM.
  const int blocks_per_seq = (oc.ctx + 15) / 16;
  const size_t block_bytes = 2ull * 16 * hkv * d * sizeof(bf16);
  const int num_blocks =
      std::max(max_m * blocks_per_seq, static_cast<int>((kMinPoolBytes + block_bytes - 1) / block_bytes));
  const int num_seq_slots = num_blocks / blocks_per_seq;  // sequences' worth of blocks in the pool
  DeviceBuffer<bf16> kv(static_cast<size_t>(num_blocks) * block_bytes / sizeof(bf16));
  PD_STATUS_CHECK(kc::fill_uniform(kv.get(), kv.count(), 9, 1.0f, nullptr));
  std::vector<int32_t> table(static_cast<size_t>(num_blocks));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937_64(3));
  DeviceBuffer<int32_t> d_table(table.size());
  d_table.upload(table);
  DeviceBuffer<bf16> q(static_cast<size_t>(max_m) * hq * d), attn_out(q.count()),
      qkv(static_cast<size_t>(max_m) * (hq + 2 * hkv) * d), x(static_cast<size_t>(max_m) * h), resid(x.count()),
      norm_w(static_cast<size_t>(h)), gate_up(static_cast<size_t>(max_m) * 2 * inter),
      act_out(static_cast<size_t>(max_m) * inter), qk_norm_w(static_cast<size_t>(d));
  for (auto* b : {&q, &qkv, &x, &resid, &norm_w, &gate_up, &qk_norm_w}) {
    PD_STATUS_CHECK(kc::fill_uniform(b->get(), b->count(), 11, 1.0f, nullptr));
  }
  DeviceBuffer<float> inv_freq(static_cast<size_t>(d / 2));
  {
    std::vector<float> f(static_cast<size_t>(d / 2));
    for (int i = 0; i < d / 2; ++i) f[static_cast<size_t>(i)] = std::pow(1e6f, -2.0f * i / d);
    inv_freq.upload(f);
  }
  std::printf("\n%-30s %4s %9s %9s %7s\n", "op", "M", "floor", "ms", "x floor");
  for (int m : batches) {
    std::vector<int32_t> ctx_lens(static_cast<size_t>(m), oc.ctx), qstart(static_cast<size_t>(m) + 1),
        positions(static_cast<size_t>(m), oc.ctx - 1), slots(static_cast<size_t>(m));
    for (int s = 0; s <= m; ++s) qstart[static_cast<size_t>(s)] = s;
    for (int s = 0; s < m; ++s) {
      slots[static_cast<size_t>(s)] =
          table[static_cast<size_t>(s * blocks_per_seq + (oc.ctx - 1) / 16)] * 16 + (oc.ctx - 1) % 16;
    }
    DeviceBuffer<int32_t> d_ctx(ctx_lens.size()), d_qstart(qstart.size()), d_pos(positions.size()),
        d_slots(slots.size());
    d_ctx.upload(ctx_lens);
    d_qstart.upload(qstart);
    d_pos.upload(positions);
    d_slots.upload(slots);
    auto row = [&](const std::string& what, double bytes, double ms) {
      const double floor_ms = bytes / (oc.copy_gbs * 1e6);
      std::printf("%-30s %4d %9.4f %9.4f %7.2f\n", what.c_str(), m, floor_ms, ms, ms / floor_ms);
    };
    const double rms_ms = time_in_graph_ms(
        [&](cudaStream_t st) {
          PD_STATUS_CHECK(kc::rmsnorm(x.get(), x.get(), resid.get(), norm_w.get(), m, h, 1e-6f, st));
        },
        kOpsCallsPerGraph);
    row("add+rmsnorm", 2.0 * m * h * 4 + 2.0 * h, rms_ms);
    kc::RopeKvArgs rope;
    rope.qkv = qkv.get();
    rope.q_out = q.get();
    rope.kv_cache = kv.get();
    rope.positions = d_pos.get();
    rope.slot_mapping = d_slots.get();
    rope.inv_freq = inv_freq.get();
    rope.q_norm_weight = qk_norm_w.get();
    rope.k_norm_weight = qk_norm_w.get();
    rope.num_tokens = m;
    rope.num_q_heads = hq;
    rope.num_kv_heads = hkv;
    rope.head_dim = d;
    const double rope_ms =
        time_in_graph_ms([&](cudaStream_t st) { PD_STATUS_CHECK(kc::rope_kv_write(rope, st)); }, kOpsCallsPerGraph);
    row("qk-norm+rope+kv write", 2.0 * 2.0 * m * (hq + 2 * hkv) * d, rope_ms);
    const double silu_ms = time_in_graph_ms(
        [&](cudaStream_t st) { PD_STATUS_CHECK(kc::silu_mul(act_out.get(), gate_up.get(), m, inter, st)); },
        kOpsCallsPerGraph);
    row("silu_mul", 2.0 * m * inter * 3, silu_ms);
    kc::AttentionArgs a = decode_attention_args(q.get(), attn_out.get(), kv.get(), d_qstart.get(), d_ctx.get(), m,
                                                blocks_per_seq, oc.ctx, hq, hkv, d);
    const double kv_bytes = static_cast<double>(m) * oc.ctx * 2.0 * hkv * d * 2.0;
    const int runner_part = engine::CudaModelRunner::decode_partition_tokens_for(m, hkv);
    double attn_ms = 0.0;
    DeviceBuffer<uint32_t> merge_counters(static_cast<size_t>(m) * hkv);
    PD_CUDA_CHECK(cudaMemset(merge_counters.get(), 0, merge_counters.count() * sizeof(uint32_t)));
    for (int part : {32, 64, 128, 256, 512, 1024, 2048}) {
      if (part > 256 && static_cast<int64_t>(m) * hkv < 64) continue;  // fewer CTAs than SMs
      a.decode_partition_tokens = part;
      const size_t ws_bytes = kc::decode_attention_workspace_bytes(m, hq, d, oc.ctx, part);
      DeviceBuffer<uint8_t> ws(ws_bytes);
      // Reduce kernel, K/V evict-first, 2 ring stages; then with the merge in the attention
      // kernel's last CTA per row, without evict-first, and with 3 ring stages.
      for (int variant = 0; variant < 4; ++variant) {
        uint32_t* counters = variant == 1 ? merge_counters.get() : nullptr;
        int call = 0;
        const double ms = time_in_graph_ms(
            [&](cudaStream_t st) {
              // Each call reads other sequences' blocks of the pool (a different layer of the real model).
              const int first_seq = (call++ * m) % (num_seq_slots - m + 1);
              kc::AttentionArgs args = a;
              args.block_tables = d_table.get() + static_cast<size_t>(first_seq) * blocks_per_seq;
              args.decode_merge_counters = counters;
              args.decode_kv_evict_first = variant != 2;
              args.decode_kv_stages = variant == 3 ? 3 : 2;
              PD_STATUS_CHECK(kc::decode_attention(args, ws.get(), ws_bytes, st));
            },
            kOpsCallsPerGraph);
        const bool runs =
            part == runner_part && variant == (engine::CudaModelRunner::decode_kv_stages_for(m, hkv) == 3 ? 3 : 0);
        row("decode attn part " + std::to_string(part) +
                (variant == 1   ? " merged"
                 : variant == 2 ? " no evict-first"
                 : variant == 3 ? " 3 stages"
                                : "") +
                (runs ? " (runner)" : ""),
            kv_bytes, ms);
        if (runs) attn_ms = ms;
      }
    }
    if (g_attention_timeline) {
      // Where each CTA's time goes (AttentionArgs::decode_cta_clock), for the last of the calls
      // in one graph: entry, prior grids done, last block consumed, exit; µs from the first entry.
      const int64_t max_ctas = static_cast<int64_t>(m) * hkv * ((oc.ctx + 127) / 128);
      DeviceBuffer<unsigned long long> clock(static_cast<size_t>(4 * max_ctas));
      struct Config {
        int part, stages;
      };
      std::vector<Config> configs = {{runner_part, engine::CudaModelRunner::decode_kv_stages_for(m, hkv)}, {2048, 3}};
      for (const Config& c : configs) {
        PD_CUDA_CHECK(cudaMemset(clock.get(), 0, clock.count() * sizeof(unsigned long long)));
        kc::AttentionArgs args = a;
        args.decode_partition_tokens = c.part;
        args.decode_kv_stages = c.stages;
        args.decode_kv_evict_first = true;
        args.decode_cta_clock = clock.get();
        const size_t ws_bytes = kc::decode_attention_workspace_bytes(m, hq, d, oc.ctx, c.part);
        DeviceBuffer<uint8_t> ws(ws_bytes);
        int call = 0;
        const double ms = time_in_graph_ms(
            [&](cudaStream_t st) {
              const int first_seq = (call++ * m) % (num_seq_slots - m + 1);
              kc::AttentionArgs per_call = args;
              per_call.block_tables = d_table.get() + static_cast<size_t>(first_seq) * blocks_per_seq;
              PD_STATUS_CHECK(kc::decode_attention(per_call, ws.get(), ws_bytes, st));
            },
            kOpsCallsPerGraph);
        std::vector<unsigned long long> t(clock.count());
        PD_CUDA_CHECK(cudaMemcpy(t.data(), clock.get(), t.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
        std::vector<double> entry, waited, consumed, exited;
        unsigned long long t0 = ~0ull;
        for (size_t i = 0; i + 3 < t.size(); i += 4) {
          if (t[i] != 0) t0 = std::min(t0, t[i]);
        }
        for (size_t i = 0; i + 3 < t.size(); i += 4) {
          if (t[i] == 0) continue;
          entry.push_back((t[i] - t0) * 1e-3);
          waited.push_back((t[i + 1] - t0) * 1e-3);
          consumed.push_back((t[i + 2] - t0) * 1e-3);
          exited.push_back((t[i + 3] - t0) * 1e-3);
        }
        auto pct = [](std::vector<double> v, double frac) {
          if (v.empty()) return -1.0;
          std::sort(v.begin(), v.end());
          return v[std::min(v.size() - 1, static_cast<size_t>(frac * (v.size() - 1) + 0.5))];
        };
        std::printf(
            "timeline b%d part %d, %d stages: %.1f us/call, %zu CTAs; us from first entry: entry p50/max "
            "%.1f/%.1f, waited max %.1f, last block p0/p10/p50/p90/max %.1f/%.1f/%.1f/%.1f/%.1f, exit max %.1f\n",
            m, c.part, c.stages, ms * 1e3, entry.size(), pct(entry, 0.5), pct(entry, 1.0), pct(waited, 1.0),
            pct(consumed, 0.0), pct(consumed, 0.1), pct(consumed, 0.5), pct(consumed, 0.9), pct(consumed, 1.0),
            pct(exited, 1.0));
      }
    }
    if (attention_only) continue;
    const auto& g = gemm_ms[m];
    const double layer_ms = 2 * rms_ms + g[0] + rope_ms + attn_ms + g[1] + g[2] + silu_ms + g[3];
    const double step_ms = cfg.num_layers * layer_ms + g[4] + rms_ms;
    g_kernel_sum_ms[m] = step_ms;
    std::printf(
        "M=%d: one layer %.4f ms (gemms %.4f, attention %.4f, norms/rope/silu %.4f); step %.3f ms "
        "(%d layers + lm_head %.4f)\n",
        m, layer_ms, g[0] + g[1] + g[2] + g[3], attn_ms, 2 * rms_ms + rope_ms + silu_ms, step_ms, cfg.num_layers, g[4]);
  }
}

// --ops probe: each kernel of interest launched once on plain streams (no graph, no
// timing), in a fixed order printed first, for a hardware-counter profiler (ncu) to
// attach to: the qkv and down GEMMs at M = 1 and 16 through every skinny variant that
// fits and through cuBLASLt's first choice, then decode attention at batch 16 as the
// runner configures it.
void probe_for_profiler(const model::ModelConfig& cfg, int ctx) {
  const int h = cfg.hidden_size, inter = cfg.intermediate_size, hq = cfg.num_heads, hkv = cfg.num_kv_heads,
            d = cfg.head_dim;
  struct Shape {
    const char* name;
    int n, k;
  };
  const Shape shapes[] = {{"qkv", (hq + 2 * hkv) * d, h}, {"down", h, inter}};
  DeviceBuffer<bf16> act(static_cast<size_t>(16) * std::max(inter, h));
  PD_STATUS_CHECK(kc::fill_uniform(act.get(), act.count(), 5, 1.0f, nullptr));
  DeviceBuffer<bf16> out(static_cast<size_t>(16) * std::max(inter, (hq + 2 * hkv) * d));
  int launch = 0;
  for (const Shape& sh : shapes) {
    DeviceBuffer<bf16> w(static_cast<size_t>(sh.n) * sh.k);
    PD_STATUS_CHECK(kc::fill_uniform(w.get(), w.count(), 3, 0.03f, nullptr));
    for (int m : {1, 16}) {
      for (int v = -1; v < kc::Gemm::num_skinny_variants(); ++v) {
        if (v >= 0 && m > kc::Gemm::skinny_variant_max_m(v)) continue;
        auto gemm =
            kc::Gemm::create(64ull << 20, v < 0 ? kc::GemmPolicy::kHeuristic : kc::GemmPolicy::kSkinny, std::max(v, 0));
        PD_STATUS_CHECK(gemm.status());
        PD_STATUS_CHECK((*gemm)->run(out.get(), kc::GemmOut::kBFloat16, act.get(), w.get(), m, sh.n, sh.k, nullptr));
        PD_CUDA_CHECK(cudaDeviceSynchronize());
        std::printf("probe launch %d: %s M=%d %s\n", launch++, sh.name, m,
                    v < 0 ? "cuBLASLt first choice" : ("skinny v" + std::to_string(v)).c_str());
      }
    }
  }
  const int m = 16;
  const int blocks_per_seq = (ctx + 15) / 16;
  const size_t block_elems = 2ull * 16 * hkv * d;
  const int num_blocks = m * blocks_per_seq;
  DeviceBuffer<bf16> kv(static_cast<size_t>(num_blocks) * block_elems);
  PD_STATUS_CHECK(kc::fill_uniform(kv.get(), kv.count(), 9, 1.0f, nullptr));
  std::vector<int32_t> table(static_cast<size_t>(num_blocks));
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), std::mt19937_64(3));
  DeviceBuffer<int32_t> d_table(table.size()), d_ctx(m), d_qstart(m + 1);
  d_table.upload(table);
  std::vector<int32_t> qstart(static_cast<size_t>(m) + 1);
  std::iota(qstart.begin(), qstart.end(), 0);
  d_ctx.upload(std::vector<int32_t>(static_cast<size_t>(m), ctx));
  d_qstart.upload(qstart);
  DeviceBuffer<bf16> q(static_cast<size_t>(m) * hq * d), attn_out(q.count());
  PD_STATUS_CHECK(kc::fill_uniform(q.get(), q.count(), 11, 1.0f, nullptr));
  kc::AttentionArgs a = decode_attention_args(q.get(), attn_out.get(), kv.get(), d_qstart.get(), d_ctx.get(), m,
                                              blocks_per_seq, ctx, hq, hkv, d);
  a.block_tables = d_table.get();
  a.decode_partition_tokens = engine::CudaModelRunner::decode_partition_tokens_for(m, hkv);
  a.decode_kv_stages = engine::CudaModelRunner::decode_kv_stages_for(m, hkv);
  const size_t ws_bytes = kc::decode_attention_workspace_bytes(m, hq, d, ctx, a.decode_partition_tokens);
  DeviceBuffer<uint8_t> ws(ws_bytes);
  PD_STATUS_CHECK(kc::decode_attention(a, ws.get(), ws_bytes, nullptr));
  PD_CUDA_CHECK(cudaDeviceSynchronize());
  std::printf("probe launch %d: decode attention b%d ctx %d, partition %d, %d stages (+ its reduce)\n", launch++, m,
              ctx, a.decode_partition_tokens, a.decode_kv_stages);
}

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

// Like make_step, but every sequence reads the same blocks (a decode batch at long contexts
// without a pool that holds them all: each row still streams its whole context from HBM, the
// L2 being ~1,000x smaller than one 8k context; the rows' one-token writes collide, harmless here).
engine::SeqStep seq_step(int new_tokens, int computed, int first_block, bool sample, std::mt19937_64& rng, int vocab,
                         std::vector<int32_t>* tokens) {
  engine::SeqStep st;
  st.token_offset = static_cast<int32_t>(tokens->size());
  st.num_new_tokens = new_tokens;
  st.num_computed_tokens = computed;
  for (int b = 0; b < (computed + new_tokens + 15) / 16; ++b) st.block_table.push_back(first_block + b);
  st.sample = sample;
  st.sampling.temperature = 0.0f;
  st.rng_seed = rng();
  std::uniform_int_distribution<int> tok(0, vocab - 1);
  for (int j = 0; j < new_tokens; ++j) tokens->push_back(tok(rng));
  return st;
}

// --pd-sweep: what the producer's token budget and a collocated chunk budget cost
// (docs/perf/engine.md, "P/D engine sweep"; the producer role's default budget,
// kProducerMaxNumBatchedTokens in src/server, follows from part 1).
//   1. Producer prefill at prompt length L and budget B: B >= L runs B / L whole
//      prompts per step (every first token waits for the whole step); B < L runs the
//      prompt in ceil(L / B) chunks. Prefill tokens per second and each prompt's
//      time to its first token (alone: the sum of its chunks).
//   2. Mixed steps: D decode rows at context C plus one prefill chunk of K tokens
//      (the chunk at the end of a C-token prompt) vs the D rows alone (graph replay,
//      as the runner serves them): what a chunk adds to every running stream's gap.
//   3. First-token path steps: the producer's whole-prompt step (its sampled token is
//      the one handed over) and the consumer's first decode step at that context.
void bench_pd_sweep(bool big, int decode_batch) {
  const model::ModelConfig cfg = qwen3_config(big);
  const char* name = big ? "Qwen3-32B" : "Qwen3-8B";
  const std::vector<int> prompt_lens = {2048, 8192};
  const std::vector<int> budgets = {512, 1024, 2048, 4096, 8192, 16384};
  const std::vector<int> chunks = {64, 128, 256, 512};
  const int max_budget = budgets.back();
  engine::CudaRunnerOptions opt;
  opt.max_model_len = 8192 + 1024;
  opt.max_num_seqs = std::max(decode_batch + 1, max_budget / prompt_lens.front());
  opt.max_num_batched_tokens = max_budget + decode_batch;
  // Prefill prompts get their own blocks (max_budget tokens); decode rows share one context.
  const int prefill_blocks = max_budget / 16 + 16;
  const int shared_blocks = opt.max_model_len / 16;
  opt.num_kv_blocks = prefill_blocks + 2 * shared_blocks + 16;
  if (g_pdl_max_tokens > 0) opt.programmatic_launch_max_tokens = g_pdl_max_tokens;
  auto created = engine::CudaModelRunner::create(cfg, nullptr, opt);
  PD_STATUS_CHECK(created.status());
  auto& runner = **created;
  PD_STATUS_CHECK(runner.fill_kv_random(42));
  std::printf("\n%s P/D engine sweep: weights %.2f GB, %zu decode graphs (buckets up to %d), prepared in %.1f s\n",
              name, runner.weight_bytes() / 1e9, runner.decode_buckets().size(), runner.decode_buckets().back(),
              runner.bucket_preparation_seconds());
  std::mt19937_64 rng(11);
  const int decode_first_block = prefill_blocks;
  const int chunk_first_block = prefill_blocks + shared_blocks;

  std::printf(
      "\n1. producer prefill (%s): prompt_len budget prompts/step steps/prompt step_ms first_token_ms "
      "tok_per_s vs_best\n",
      name);
  for (int len : prompt_lens) {
    struct Point {
      int budget, prompts, steps;
      double step_ms, first_token_ms, tok_per_s;
    };
    std::vector<Point> points;
    for (int budget : budgets) {
      Point p{budget, 1, 1, 0.0, 0.0, 0.0};
      if (budget >= len) {
        p.prompts = budget / len;
        engine::StepInput in;
        for (int i = 0; i < p.prompts; ++i) {
          in.seqs.push_back(seq_step(len, 0, i * (len / 16), true, rng, cfg.vocab_size, &in.token_ids));
        }
        p.step_ms = time_step(runner, in, 1, 3);
        p.first_token_ms = p.step_ms;
        p.tok_per_s = p.prompts * len / (p.step_ms * 1e-3);
      } else {
        p.steps = (len + budget - 1) / budget;
        for (int c = 0; c < p.steps; ++c) {
          const int computed = c * budget;
          engine::StepInput in;
          in.seqs.push_back(seq_step(std::min(budget, len - computed), computed, 0, computed + budget >= len, rng,
                                     cfg.vocab_size, &in.token_ids));
          p.first_token_ms += time_step(runner, in, 1, 3);
        }
        p.step_ms = p.first_token_ms / p.steps;
        p.tok_per_s = len / (p.first_token_ms * 1e-3);
      }
      points.push_back(p);
    }
    double best = 0.0;
    for (const Point& p : points) best = std::max(best, p.tok_per_s);
    for (const Point& p : points) {
      std::printf("  prefill L%-5d B%-6d %3d %3d %9.3f %9.3f %10.0f %6.3f\n", len, p.budget, p.prompts, p.steps,
                  p.step_ms, p.first_token_ms, p.tok_per_s, p.tok_per_s / best);
    }
  }

  std::printf("\n2. mixed steps (%s, %d decode rows): context chunk decode_ms mixed_ms added_ms added_us_per_token\n",
              name, decode_batch);
  for (int ctx : prompt_lens) {
    engine::StepInput decode;
    for (int i = 0; i < decode_batch; ++i) {
      decode.seqs.push_back(seq_step(1, ctx - 1, decode_first_block, true, rng, cfg.vocab_size, &decode.token_ids));
    }
    const double decode_ms = time_step(runner, decode, 3, 20);
    for (int chunk : chunks) {
      engine::StepInput mixed = decode;
      mixed.seqs.push_back(
          seq_step(chunk, ctx - chunk, chunk_first_block, false, rng, cfg.vocab_size, &mixed.token_ids));
      const double mixed_ms = time_step(runner, mixed, 3, 20);
      std::printf("  mixed C%-5d K%-4d %9.3f %9.3f %9.3f %9.2f\n", ctx, chunk, decode_ms, mixed_ms,
                  mixed_ms - decode_ms, (mixed_ms - decode_ms) * 1e3 / chunk);
    }
  }

  std::printf("\n3. first-token path steps (%s): prompt_len producer_whole_prompt_ms consumer_first_decode_b1_ms\n",
              name);
  for (int len : prompt_lens) {
    engine::StepInput prefill;
    prefill.seqs.push_back(seq_step(len, 0, 0, true, rng, cfg.vocab_size, &prefill.token_ids));
    const double prefill_ms = time_step(runner, prefill, 1, 3);
    engine::StepInput first_decode;
    first_decode.seqs.push_back(
        seq_step(1, len, decode_first_block, true, rng, cfg.vocab_size, &first_decode.token_ids));
    const double decode_ms = time_step(runner, first_decode, 3, 20);
    std::printf("  first-token L%-5d %9.3f %9.3f\n", len, prefill_ms, decode_ms);
  }
}

void bench_model(bool big, int ctx, double copy_gbs, double gemm_tflops, kernels::cuda::DecodeKernel decode_kernel,
                 kc::GemmPolicy gemm_policy, bool decode_only, bool pdl, bool merge_in_attention,
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
  opt.gemm_policy = gemm_policy;
  opt.programmatic_launch = pdl;
  opt.decode_merge_in_attention = merge_in_attention;
  if (g_pdl_max_tokens > 0) opt.programmatic_launch_max_tokens = g_pdl_max_tokens;
  if (g_decode_partition >= 0) opt.decode_partition_tokens = g_decode_partition;
  if (g_kv_evict_first >= 0) opt.decode_kv_evict_first = g_kv_evict_first != 0;
  if (g_kv_stages > 0) opt.decode_kv_stages = g_kv_stages;
  if (g_fuse_norms >= 0) opt.fuse_norms_into_gemms = g_fuse_norms != 0;
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
    Row row{std::string(name) + " decode b" + std::to_string(b) + " ctx" + std::to_string(ctx), floor_ms, ms,
            "HBM floor " + std::to_string(static_cast<int>(bytes / 1e6)) + " MB, gemm " + policy_name(gemm_policy) +
                (pdl ? ", pdl <= " + std::to_string(opt.programmatic_launch_max_tokens) + " tokens" : ", no pdl") +
                (merge_in_attention ? ", merge in attention" : "") +
                (opt.decode_partition_tokens > 0 ? ", partition " + std::to_string(opt.decode_partition_tokens) : "") +
                (opt.decode_kv_evict_first ? "" : ", kv without evict-first") +
                (opt.decode_kv_stages != 0 ? ", kv stages " + std::to_string(opt.decode_kv_stages) : "") +
                (opt.fuse_norms_into_gemms ? "" : ", norms unfused")};
    auto graph_ms = runner.time_decode_graph(b, 20);
    PD_STATUS_CHECK(graph_ms.status());
    row.graph_ms = *graph_ms;
    if (!big && g_kernel_sum_ms.count(b) != 0) row.kernel_sum_ms = g_kernel_sum_ms[b];
    rows->push_back(row);
  }
  std::printf("%s: GEMM plans tuned at load (us per call): m n k -> choice, cuBLASLt first / best, best skinny\n",
              name);
  for (const kc::GemmTuning& t : runner.gemm().tunings()) {
    std::printf("  %4d %6d %6d %-5s -> %-6s%s %8.1f %8.1f %8.1f (v%d)", t.m, t.n, t.k,
                t.normed       ? "norm"
                : t.accumulate ? "accum"
                               : "",
                t.chose_skinny ? "skinny" : "cublas", t.chose_norm_in_kernel ? "+norm" : "     ", t.heuristic_us,
                t.best_cublas_us, t.skinny_us, t.skinny_variant);
    if (t.normed) std::printf(" in-kernel %8.1f (v%d)", t.skinny_norm_in_kernel_us, t.skinny_norm_in_kernel_variant);
    std::printf("  (%d cuBLASLt candidates)\n", t.num_candidates);
  }
  if (decode_only) {
    std::printf("%s: %d decode graphs captured\n", name, runner.num_graphs_captured());
    return;
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
  auto gemm_policy = kc::GemmPolicy::kAutotune;
  std::string fp8_model;
  int fp8_layers = 0, kv_fp8_batch = 64;
  std::vector<int> fp8_batches;
  bool decode_only = false, ops = false, ops_attention_only = false, ops_probe = false, pdl = true,
       merge_in_attention = false, pd_sweep = false;
  int sweep_decode_batch = 16;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--gemm") == 0) {
      const std::string v = argv[i + 1];
      gemm_policy = v == "heuristic" ? kc::GemmPolicy::kHeuristic
                    : v == "skinny"  ? kc::GemmPolicy::kSkinny
                                     : kc::GemmPolicy::kAutotune;
    }
    if (std::strcmp(argv[i], "--decode-only") == 0) decode_only = std::atoi(argv[i + 1]) != 0;
    if (std::strcmp(argv[i], "--ops") == 0) {
      g_attention_timeline = std::strcmp(argv[i + 1], "timeline") == 0;
      ops_attention_only = g_attention_timeline || std::strcmp(argv[i + 1], "attn") == 0;
      ops_probe = std::strcmp(argv[i + 1], "probe") == 0;
      ops = ops_attention_only || std::atoi(argv[i + 1]) != 0;
    }
    if (std::strcmp(argv[i], "--decode-partition") == 0) g_decode_partition = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--kv-evict-first") == 0) g_kv_evict_first = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--kv-stages") == 0) g_kv_stages = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--fuse-norms") == 0) g_fuse_norms = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--pdl") == 0) pdl = std::atoi(argv[i + 1]) != 0;
    if (std::strcmp(argv[i], "--merge-in-attention") == 0) merge_in_attention = std::atoi(argv[i + 1]) != 0;
    if (std::strcmp(argv[i], "--pdl-max-tokens") == 0) g_pdl_max_tokens = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--model") == 0) which = argv[i + 1];
    if (std::strcmp(argv[i], "--fp8-model") == 0) fp8_model = argv[i + 1];
    if (std::strcmp(argv[i], "--layers") == 0) fp8_layers = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--kv-fp8-batch") == 0) kv_fp8_batch = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--batches") == 0) {
      for (const char* c = argv[i + 1]; *c != '\0';) {
        fp8_batches.push_back(std::atoi(c));
        while (*c != '\0' && *c != ',') ++c;
        if (*c == ',') ++c;
      }
    }
    if (std::strcmp(argv[i], "--ctx") == 0) ctx = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--pd-sweep") == 0) pd_sweep = std::atoi(argv[i + 1]) != 0;
    if (std::strcmp(argv[i], "--sweep-decode-batch") == 0) sweep_decode_batch = std::max(1, std::atoi(argv[i + 1]));
    if (std::strcmp(argv[i], "--decode-kernel") == 0 && std::strcmp(argv[i + 1], "simt") == 0) {
      decode_kernel = pd::kernels::cuda::DecodeKernel::kCudaCore;
    }
  }
  PD_CUDA_CHECK(cudaSetDevice(0));
  if (ops_probe) {
    probe_for_profiler(qwen3_config(false), ctx);
    return 0;
  }
  cudaDeviceProp prop{};
  PD_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const double copy_gbs = measure_copy_gbs();
  const double gemm_tflops = measure_gemm_tflops();
  std::printf("device %s: d2d copy %.1f GB/s, bf16 GEMM 8192^3 %.1f TFLOP/s, decode attention on %s cores\n", prop.name,
              copy_gbs, gemm_tflops, decode_kernel == pd::kernels::cuda::DecodeKernel::kTensorCore ? "tensor" : "CUDA");
  kc::set_programmatic_launch(pdl);
  if (pd_sweep) {
    if (which == "all" || which == "qwen3-8b") bench_pd_sweep(false, sweep_decode_batch);
    if (which == "all" || which == "qwen3-32b") bench_pd_sweep(true, sweep_decode_batch);
    return 0;
  }
  if (!fp8_model.empty()) {
    std::string fp8_note;
    const double fp8_tflops = measure_fp8_gemm_tflops(2048, 4096, 4096, &fp8_note);
    std::string big_note;
    const double fp8_big = measure_fp8_gemm_tflops(8192, 8192, 8192, &big_note);
    std::printf(
        "FP8 GEMM (cuBLASLt block-scaled 1x128 x 128x128): %.1f TFLOP/s at 2048x4096x4096, %.1f at 8192^3; "
        "bf16 %.1f TFLOP/s (8192^3); FP8 / bf16 = %.2f\n  %s\n  %s\n",
        fp8_tflops, fp8_big, gemm_tflops, fp8_tflops / gemm_tflops, fp8_note.c_str(), big_note.c_str());
    // The prefill floor takes the FP8 rate of the 2048x4096x4096 GEMM (the bf16 rate if FP8 is unavailable).
    const double rate = fp8_tflops > 0.0 ? fp8_tflops : gemm_tflops;
    std::vector<Fp8Row> fp8_rows;
    const std::vector<std::string> names =
        fp8_model == "fp8-all" ? std::vector<std::string>{"qwen3-30b-a3b-fp8", "qwen3-32b-fp8", "qwen3-235b-a22b-fp8"}
                               : std::vector<std::string>{fp8_model};
    for (const std::string& name : names) {
      std::vector<int> batches = fp8_batches;
      if (batches.empty()) {
        batches = name == "qwen3-32b-fp8" ? std::vector<int>{1, 16, 64} : std::vector<int>{1, 16, 64, 128};
      }
      bench_fp8_model(name, fp8_layers, ctx, copy_gbs, rate, decode_only, batches, kv_fp8_batch, &fp8_rows);
    }
    std::printf("\n%-44s %10s %10s %8s  %s\n", "step (kernel-level, decode = graph replay)", "floor_ms", "meas_ms",
                "x floor", "note");
    for (const auto& r : fp8_rows) {
      std::printf("%-44s %10.3f %10.3f %8.2f  %s\n", r.what.c_str(), r.floor_ms, r.measured_ms,
                  r.measured_ms / r.floor_ms, r.note.c_str());
    }
    return 0;
  }
  if (ops) bench_ops(qwen3_config(false), OpsContext{copy_gbs, ctx}, {1, 16, 64, 128}, ops_attention_only);
  std::vector<Row> rows;
  if (which == "all" || which == "qwen3-8b") {
    bench_model(false, ctx, copy_gbs, gemm_tflops, decode_kernel, gemm_policy, decode_only, pdl, merge_in_attention,
                &rows);
  }
  if (which == "all" || which == "qwen3-32b") {
    bench_model(true, ctx, copy_gbs, gemm_tflops, decode_kernel, gemm_policy, decode_only, pdl, merge_in_attention,
                &rows);
  }
  // graph_ms: device time of the decode graph alone; kernels_ms: its kernels timed one by one (--ops).
  std::printf("\n%-36s %10s %10s %8s %9s %10s  %s\n", "step", "floor_ms", "meas_ms", "x floor", "graph_ms",
              "kernels_ms", "note");
  for (const auto& r : rows) {
    std::printf("%-36s %10.3f %10.3f %8.2f %9.3f %10.3f  %s\n", r.what.c_str(), r.floor_ms, r.measured_ms,
                r.measured_ms / r.floor_ms, r.graph_ms, r.kernel_sum_ms, r.note.c_str());
  }
  return 0;
}
