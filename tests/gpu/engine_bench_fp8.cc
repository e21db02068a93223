// FP8 and MoE part of pd_gpu_engine_bench: the FP8 GEMM rate (cuBLASLt block-scaled,
// 1 x 128 activations x 128 x 128 weights) next to the bf16 rate, and whole forward passes
// of FP8 model shapes built from the kernels (kernel-level steps: every layer's kernels in
// the order a runner issues them, with each layer's own weights and KV, the decode step
// captured in one CUDA graph and launched with PDL as the runner launches decode), against
// floors measured in the same process:
// - decode: (dense weights + the DISTINCT experts the step routed to, counted per layer
//   from the routing + KV read + lm_head) / device-to-device copy bandwidth;
// - prefill: (2 x active linear params x tokens + causal attention + lm_head of the last
//   rows) / the FP8 GEMM rate; the target ">= 60 % of the FP8 GEMM rate" is x floor <= 1.67.
// MoE models: each decode batch also without PDL and with each expert kernel of the decode path
// at every batch (MoeStreamKernel: tiled, warp items), and a per-stage breakdown of the expert
// path (moe_stage_breakdown: route, align, gate_up and down at 1 / 2 / 4 column tiles per CTA and
// on the warp-item kernel, SwiGLU, combine, each replayed over every layer's experts in one graph,
// against its expert-bytes floor).
// FP8 KV: one more decode step at kv_fp8_batch with the KV cache in FP8 (write + attention
// kernels of the FP8 layout) beside the bf16-KV step of the same batch.
// Dummy weights (e4m3 uniform, 128 x 128 scales of one value per weight shape shared by the
// layers: scales are 1/16,384 of the weight bytes), random-ish routing from a random router.
#include "tests/gpu/engine_bench_fp8.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "engine/runner_cuda/cuda_model_runner.h"
#include "kernels/cuda/fp8_gemm.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/grouped_fp8_gemm.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/moe_layer.h"
#include "tests/gpu/bench_util.h"
#include "tests/gpu/gpu_util.h"

namespace pd::gpu_test {
namespace {

namespace kc = pd::kernels::cuda;
using bf16 = __nv_bfloat16;

struct Fp8Shape {
  std::string name;
  int hidden, layers, hq, hkv, d, vocab;
  int inter;                      // dense MLP (0 for MoE)
  int experts, top_k, moe_inter;  // MoE (experts 0 = dense)
};

Fp8Shape shape_for(const std::string& name, int layers_override) {
  Fp8Shape s;
  if (name == "qwen3-30b-a3b-fp8") {
    s = {name, 2048, 48, 32, 4, 128, 151936, 0, 128, 8, 768};
  } else if (name == "qwen3-235b-a22b-fp8") {
    s = {name, 4096, 94, 64, 4, 128, 151936, 0, 128, 8, 1536};
    s.layers = 16;  // 94 layers of FP8 weights (235 GB) do not fit one GPU: fewer layers
    // 64 q / 4 kv heads: GQA group 16, the 16-row tensor-core decode kernels.
  } else {
    s = {"qwen3-32b-fp8", 5120, 64, 64, 8, 128, 151936, 25600, 0, 0, 0};
  }
  if (layers_override > 0) s.layers = layers_override;
  return s;
}

// One FP8 weight shape: `copies` distinct weight matrices (one per layer or per layer x
// expert), one shared scale array.
struct Fp8Tensor {
  DeviceBuffer<uint8_t> data;
  DeviceBuffer<float> scale;
  int n, k;
  int64_t per_copy;
  Fp8Tensor(int n_, int k_, int64_t copies, uint64_t seed)
      : data(static_cast<size_t>(n_) * k_ * copies),
        scale(static_cast<size_t>((n_ + 127) / 128) * kc::fp8_weight_scale_ld(k_)),
        n(n_),
        k(k_),
        per_copy(static_cast<int64_t>(n_) * k_) {
    PD_STATUS_CHECK(kc::fill_uniform_fp8(data.get(), data.count(), seed, 1.0f, nullptr));
    // Values ~ U(-1, 1) * scale with scale ~ 1 / sqrt(k): activations stay O(1) through the layers.
    scale.upload(std::vector<float>(scale.count(), 1.0f / std::sqrt(static_cast<float>(k_))));
  }
  kc::Fp8Weight view(int64_t copy) const {
    kc::Fp8Weight w;
    w.data = data.get() + copy * per_copy;
    w.scale = scale.get();
    w.n = n;
    w.k = k;
    w.scale_ld = kc::fp8_weight_scale_ld(k);
    return w;
  }
};

// MoE experts of all layers share one scale array per shape; the per-layer MoeWeights point
// every expert at it (scale_group_stride 0 is not expressible in MoeWeights, so the scales
// are replicated per expert: small).
struct ExpertTensor {
  DeviceBuffer<uint8_t> data;
  DeviceBuffer<float> scale;  // [experts][rows][ld]
  int64_t per_layer;
  ExpertTensor(int n, int k, int experts, int layers, uint64_t seed)
      : data(static_cast<size_t>(n) * k * experts * layers),
        scale(static_cast<size_t>(experts) * ((n + 127) / 128) * kc::fp8_weight_scale_ld(k)),
        per_layer(static_cast<int64_t>(n) * k * experts) {
    PD_STATUS_CHECK(kc::fill_uniform_fp8(data.get(), data.count(), seed, 1.0f, nullptr));
    scale.upload(std::vector<float>(scale.count(), 1.0f / std::sqrt(static_cast<float>(k))));
  }
};

struct Model {
  Fp8Shape s;
  std::unique_ptr<Fp8Tensor> qkv, o, gate_up, down;  // gate_up / down: dense only
  std::unique_ptr<ExpertTensor> e_gate_up, e_down;
  DeviceBuffer<bf16> router;   // [layers][experts][hidden]
  DeviceBuffer<bf16> lm_head;  // [vocab][hidden]
  DeviceBuffer<bf16> norm_w, qk_norm_w;
  DeviceBuffer<float> inv_freq;
  explicit Model(const Fp8Shape& shape)
      : s(shape),
        router(static_cast<size_t>(shape.layers) * std::max(shape.experts, 1) * shape.hidden),
        lm_head(static_cast<size_t>(shape.vocab) * shape.hidden),
        norm_w(static_cast<size_t>(shape.hidden)),
        qk_norm_w(static_cast<size_t>(shape.d)),
        inv_freq(static_cast<size_t>(shape.d / 2)) {
    const int h = s.hidden;
    qkv = std::make_unique<Fp8Tensor>((s.hq + 2 * s.hkv) * s.d, h, s.layers, 1);
    o = std::make_unique<Fp8Tensor>(h, s.hq * s.d, s.layers, 2);
    if (s.experts == 0) {
      gate_up = std::make_unique<Fp8Tensor>(2 * s.inter, h, s.layers, 3);
      down = std::make_unique<Fp8Tensor>(h, s.inter, s.layers, 4);
    } else {
      e_gate_up = std::make_unique<ExpertTensor>(2 * s.moe_inter, h, s.experts, s.layers, 3);
      e_down = std::make_unique<ExpertTensor>(h, s.moe_inter, s.experts, s.layers, 4);
    }
    PD_STATUS_CHECK(kc::fill_uniform(router.get(), router.count(), 5, 0.05f, nullptr));
    PD_STATUS_CHECK(kc::fill_uniform(lm_head.get(), lm_head.count(), 6, 0.02f, nullptr));
    std::vector<bf16> ones(static_cast<size_t>(h), __float2bfloat16(1.0f));
    norm_w.upload(ones);
    qk_norm_w.upload(std::vector<bf16>(static_cast<size_t>(s.d), __float2bfloat16(1.0f)));
    std::vector<float> f(static_cast<size_t>(s.d / 2));
    for (int i = 0; i < s.d / 2; ++i) f[static_cast<size_t>(i)] = std::pow(1e6f, -2.0f * i / s.d);
    inv_freq.upload(f);
  }
  kc::MoeWeights moe(int layer) const {
    kc::MoeWeights w;
    w.num_experts = s.experts;
    w.hidden = s.hidden;
    w.inter = s.moe_inter;
    w.fp8 = true;
    w.gate_up = e_gate_up->data.get() + layer * e_gate_up->per_layer;
    w.down = e_down->data.get() + layer * e_down->per_layer;
    w.gate_up_scale = e_gate_up->scale.get();
    w.down_scale = e_down->scale.get();
    return w;
  }
  // Bytes a decode step reads besides the experts: attention weights, dense MLP, router,
  // norms, lm_head.
  double dense_bytes() const {
    const double h = s.hidden;
    double per_layer = static_cast<double>(qkv->per_copy + o->per_copy) + 2.0 * 2 * h + 2.0 * 2 * s.d;
    if (s.experts == 0) {
      per_layer += static_cast<double>(gate_up->per_copy + down->per_copy);
    } else {
      per_layer += 2.0 * s.experts * h;
    }
    return per_layer * s.layers + 2.0 * s.vocab * h + 2.0 * h;
  }
  double expert_bytes() const { return 3.0 * s.hidden * s.moe_inter; }
  // Linear params one token multiplies (prefill FLOPs): attention, dense MLP or top_k experts, router.
  double active_linear_params() const {
    const double h = s.hidden;
    double per_layer = static_cast<double>(qkv->per_copy + o->per_copy);
    per_layer += s.experts == 0 ? 3.0 * h * s.inter : s.top_k * 3.0 * h * s.moe_inter + s.experts * h;
    return per_layer * s.layers;
  }
};

struct Pass {
  int num_seqs, q_len, ctx;  // decode: q_len 1, ctx = context after this token
};

// The activations, KV and per-pass inputs of a forward pass.
struct PassBuffers {
  int tokens;
  DeviceBuffer<bf16> x, resid, xn, qkv, q, attn, gate_up, act;
  DeviceBuffer<float> router_logits, logits;
  DeviceBuffer<int32_t> positions, slots, qstart, ctx_lens, tables, last_rows;
  DeviceBuffer<bf16> last_hidden;
  DeviceBuffer<uint8_t> attn_ws;
  size_t attn_ws_bytes = 0;
  int blocks_per_seq;
  PassBuffers(const Model& m, const Pass& p, size_t decode_ws_bytes)
      : tokens(p.num_seqs * p.q_len),
        x(static_cast<size_t>(tokens) * m.s.hidden),
        resid(x.count()),
        xn(x.count()),
        qkv(static_cast<size_t>(tokens) * (m.s.hq + 2 * m.s.hkv) * m.s.d),
        q(static_cast<size_t>(tokens) * m.s.hq * m.s.d),
        attn(q.count()),
        gate_up(m.s.experts == 0 ? static_cast<size_t>(tokens) * 2 * m.s.inter : 0),
        act(m.s.experts == 0 ? static_cast<size_t>(tokens) * m.s.inter : 0),
        router_logits(static_cast<size_t>(tokens) * std::max(m.s.experts, 1)),
        logits(static_cast<size_t>(p.num_seqs) * m.s.vocab),
        positions(static_cast<size_t>(tokens)),
        slots(static_cast<size_t>(tokens)),
        qstart(static_cast<size_t>(p.num_seqs) + 1),
        ctx_lens(static_cast<size_t>(p.num_seqs)),
        tables(static_cast<size_t>(p.num_seqs) * ((p.ctx + 15) / 16)),
        last_rows(static_cast<size_t>(p.num_seqs)),
        last_hidden(static_cast<size_t>(p.num_seqs) * m.s.hidden),
        attn_ws(decode_ws_bytes),
        attn_ws_bytes(decode_ws_bytes),
        blocks_per_seq((p.ctx + 15) / 16) {
    PD_STATUS_CHECK(kc::fill_uniform(x.get(), x.count(), 7, 1.0f, nullptr));
    PD_STATUS_CHECK(kc::fill_uniform(resid.get(), resid.count(), 8, 1.0f, nullptr));
    std::vector<int32_t> pos, sl, qs(static_cast<size_t>(p.num_seqs) + 1), cl(static_cast<size_t>(p.num_seqs), p.ctx),
        tb(tables.count()), lr(static_cast<size_t>(p.num_seqs));
    std::iota(tb.begin(), tb.end(), 0);
    for (int sq = 0; sq < p.num_seqs; ++sq) {
      qs[static_cast<size_t>(sq)] = sq * p.q_len;
      lr[static_cast<size_t>(sq)] = sq * p.q_len + p.q_len - 1;
      for (int i = 0; i < p.q_len; ++i) {
        const int position = p.ctx - p.q_len + i;
        pos.push_back(position);
        sl.push_back((sq * blocks_per_seq + position / 16) * 16 + position % 16);
      }
    }
    qs[static_cast<size_t>(p.num_seqs)] = tokens;
    positions.upload(pos);
    slots.upload(sl);
    qstart.upload(qs);
    ctx_lens.upload(cl);
    tables.upload(tb);
    last_rows.upload(lr);
  }
};

struct Engine {
  const Model& m;
  std::unique_ptr<kc::Gemm> gemm;
  std::unique_ptr<kc::Fp8Gemm> fp8;
  std::vector<std::unique_ptr<kc::MoeLayer>> moe;  // one per layer (decode: each keeps its routing)
  bool kv_fp8;
  kc::MoePath prefill_path = kc::MoePath::kGrouped;
  size_t block_bytes;
  size_t kv_layer_bytes;
  DeviceBuffer<uint8_t> kv;  // [layers][blocks][block bytes]: bf16 or the FP8 layout
  Engine(const Model& model, int max_tokens, int kv_blocks, bool per_layer_moe, bool fp8_kv = false)
      : m(model),
        kv_fp8(fp8_kv),
        block_bytes(fp8_kv ? kc::fp8_kv_block_bytes(16, model.s.hkv, model.s.d)
                           : 2ull * 16 * model.s.hkv * model.s.d * sizeof(bf16)),
        kv_layer_bytes(block_bytes * kv_blocks),
        kv(kv_layer_bytes * model.s.layers) {
    auto g = kc::Gemm::create(64ull << 20, kc::GemmPolicy::kAutotune);
    PD_STATUS_CHECK(g.status());
    gemm = std::move(*g);
    auto f = kc::Fp8Gemm::create(max_tokens, std::max({m.s.hidden, m.s.hq * m.s.d, m.s.inter}));
    PD_STATUS_CHECK(f.status());
    fp8 = std::move(*f);
    if (m.s.experts > 0) {
      const int count = per_layer_moe ? m.s.layers : 1;
      for (int l = 0; l < count; ++l) {
        auto layer = kc::MoeLayer::create(max_tokens, m.s.top_k, m.s.experts, m.s.hidden, m.s.moe_inter);
        PD_STATUS_CHECK(layer.status());
        moe.push_back(std::move(*layer));
      }
    }
    if (kv_fp8) {
      PD_STATUS_CHECK(kc::fill_uniform_fp8(kv.get(), kv.count(), 9, 2.0f, nullptr));
      // Every (token, head) scale 0x3c3c3c3c = 0.0115.
      const size_t codes = 2ull * 16 * m.s.hkv * m.s.d;
      PD_CUDA_CHECK(cudaMemset2D(kv.get() + codes, block_bytes, 0x3c, block_bytes - codes,
                                 static_cast<size_t>(kv_blocks) * m.s.layers));
    } else {
      PD_STATUS_CHECK(kc::fill_uniform(reinterpret_cast<bf16*>(kv.get()), kv.count() / 2, 9, 1.0f, nullptr));
    }
  }

  // One forward pass; decode (q_len 1) takes the streaming MoE path, prefill the per-expert one.
  void forward(PassBuffers& b, const Pass& p, cudaStream_t st) {
    const Fp8Shape& s = m.s;
    const int t = b.tokens, h = s.hidden;
    const bool decode = p.q_len == 1;
    for (int l = 0; l < s.layers; ++l) {
      auto* layer_kv = reinterpret_cast<bf16*>(kv.get() + static_cast<size_t>(l) * kv_layer_bytes);
      PD_STATUS_CHECK(kc::rmsnorm(b.xn.get(), b.x.get(), b.resid.get(), m.norm_w.get(), t, h, 1e-6f, st));
      PD_STATUS_CHECK(fp8->run(b.qkv.get(), b.xn.get(), t, m.qkv->view(l), st));
      kc::RopeKvArgs rope;
      rope.qkv = b.qkv.get();
      rope.q_out = b.q.get();
      rope.kv_cache = layer_kv;
      rope.positions = b.positions.get();
      rope.slot_mapping = b.slots.get();
      rope.inv_freq = m.inv_freq.get();
      rope.q_norm_weight = m.qk_norm_w.get();
      rope.k_norm_weight = m.qk_norm_w.get();
      rope.num_tokens = t;
      rope.num_q_heads = s.hq;
      rope.num_kv_heads = s.hkv;
      rope.head_dim = s.d;
      rope.kv_fp8 = kv_fp8;
      PD_STATUS_CHECK(kc::rope_kv_write(rope, st));
      kc::AttentionArgs a;
      a.q = b.q.get();
      a.out = b.attn.get();
      a.kv_cache = layer_kv;
      a.query_start = b.qstart.get();
      a.context_lens = b.ctx_lens.get();
      a.block_tables = b.tables.get();
      a.num_seqs = p.num_seqs;
      a.max_blocks_per_seq = b.blocks_per_seq;
      a.max_query_len = p.q_len;
      a.max_context_len = p.ctx;
      a.num_q_heads = s.hq;
      a.num_kv_heads = s.hkv;
      a.head_dim = s.d;
      a.scale = 1.0f / std::sqrt(static_cast<float>(s.d));
      if (decode) {
        a.decode_partition_tokens = engine::CudaModelRunner::decode_partition_tokens_for(p.num_seqs, s.hkv);
        a.decode_kv_stages = engine::CudaModelRunner::decode_kv_stages_for(p.num_seqs, s.hkv);
        a.decode_kv_evict_first = true;
        if (kv_fp8) {
          PD_STATUS_CHECK(kc::decode_attention_fp8(a, b.attn_ws.get(), b.attn_ws_bytes, st));
        } else {
          PD_STATUS_CHECK(kc::decode_attention(a, b.attn_ws.get(), b.attn_ws_bytes, st));
        }
      } else {
        PD_STATUS_CHECK(kc::prefill_attention(a, st));
      }
      // o_proj adds into the residual stream (x holds the layer's output).
      PD_STATUS_CHECK(fp8->run(b.x.get(), b.attn.get(), t, m.o->view(l), st));
      PD_STATUS_CHECK(kc::rmsnorm(b.xn.get(), b.x.get(), b.resid.get(), m.norm_w.get(), t, h, 1e-6f, st));
      if (s.experts == 0) {
        PD_STATUS_CHECK(fp8->run(b.gate_up.get(), b.xn.get(), t, m.gate_up->view(l), st));
        PD_STATUS_CHECK(kc::silu_mul(b.act.get(), b.gate_up.get(), t, s.inter, st));
        PD_STATUS_CHECK(fp8->run(b.x.get(), b.act.get(), t, m.down->view(l), st));
      } else {
        PD_STATUS_CHECK(gemm->run(b.router_logits.get(), kc::GemmOut::kFloat32, b.xn.get(),
                                  m.router.get() + static_cast<size_t>(l) * s.experts * h, t, s.experts, h, st));
        kc::MoeLayer& layer = *moe[moe.size() == 1 ? 0 : static_cast<size_t>(l)];
        PD_STATUS_CHECK(layer.forward(b.x.get(), b.xn.get(), b.router_logits.get(), t, m.moe(l), true,
                                      decode ? kc::MoePath::kStream : prefill_path, st, false, gemm.get(), fp8.get()));
      }
    }
    // Final norm of each sequence's last row, lm_head (bf16 in FP8 checkpoints).
    PD_STATUS_CHECK(kc::embedding_lookup(b.last_hidden.get(), b.x.get(), b.last_rows.get(), p.num_seqs, t, h, st));
    PD_STATUS_CHECK(
        kc::rmsnorm(b.last_hidden.get(), b.last_hidden.get(), nullptr, m.norm_w.get(), p.num_seqs, h, 1e-6f, st));
    PD_STATUS_CHECK(gemm->run(b.logits.get(), kc::GemmOut::kFloat32, b.last_hidden.get(), m.lm_head.get(), p.num_seqs,
                              s.vocab, h, st));
  }
};

// Prints a row as soon as it is measured (a run cut short by a timeout keeps what it had).
void print_row(const Fp8Row& r) {
  std::printf("row: %-40s floor %9.3f ms  measured %9.3f ms  x floor %6.2f  %s\n", r.what.c_str(), r.floor_ms,
              r.measured_ms, r.measured_ms / r.floor_ms, r.note.c_str());
  std::fflush(stdout);
}

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median ms of one replay of the graph `issue` captures on st (2 warm-up replays, 7 timed).
template <typename Fn>
double graph_ms(cudaStream_t st, Fn&& issue) {
  cudaGraph_t graph = nullptr;
  PD_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  issue();
  PD_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
  cudaGraphExec_t exec = nullptr;
  PD_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  PD_CUDA_CHECK(cudaGraphDestroy(graph));
  cudaEvent_t e0, e1;
  PD_CUDA_CHECK(cudaEventCreate(&e0));
  PD_CUDA_CHECK(cudaEventCreate(&e1));
  std::vector<double> times;
  for (int r = 0; r < 9; ++r) {
    PD_CUDA_CHECK(cudaEventRecord(e0, st));
    PD_CUDA_CHECK(cudaGraphLaunch(exec, st));
    PD_CUDA_CHECK(cudaEventRecord(e1, st));
    PD_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    PD_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (r >= 2) times.push_back(ms);
  }
  PD_CUDA_CHECK(cudaGraphExecDestroy(exec));
  PD_CUDA_CHECK(cudaEventDestroy(e0));
  PD_CUDA_CHECK(cudaEventDestroy(e1));
  return median_of(times);
}

// Where a decode step's MoE time goes: each stage of the expert path (the kernels MoeLayer
// issues, called one by one on buffers of this function) replayed for every layer's own
// expert weights in one graph, so a stage's time per layer includes its launch and its
// dependency on the kernel before it (PDL as set by the caller). Routing: random router
// logits (std 1), the same for every layer. Floor of a GEMM stage = the bytes of the distinct
// routed experts' weights / copy bandwidth.
void moe_stage_breakdown(const Model& m, int bsz, double copy_gbs, cudaStream_t st) {
  const Fp8Shape& s = m.s;
  const int h = s.hidden, inter = s.moe_inter, e = s.experts, k = s.top_k, rows = bsz * k;
  DeviceBuffer<bf16> x(static_cast<size_t>(bsz) * h), gate_up(static_cast<size_t>(rows) * 2 * inter),
      act(static_cast<size_t>(rows) * inter), down(static_cast<size_t>(rows) * h), out(static_cast<size_t>(bsz) * h);
  PD_STATUS_CHECK(kc::fill_uniform(x.get(), x.count(), 21, 1.0f, nullptr));
  DeviceBuffer<float> logits(static_cast<size_t>(bsz) * e), weights(static_cast<size_t>(rows));
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> hl(logits.count());
  for (float& v : hl) v = nd(rng);
  logits.upload(hl);
  DeviceBuffer<int32_t> ids(static_cast<size_t>(rows)), offs(static_cast<size_t>(e) + 1),
      padded(static_cast<size_t>(e) + 1), active(static_cast<size_t>(e)), num_active(1),
      sorted(static_cast<size_t>(rows)), slot(static_cast<size_t>(rows));
  kc::MoeRouting r;
  r.expert_offsets = offs.get();
  r.padded_offsets = padded.get();
  r.active_experts = active.get();
  r.num_active = num_active.get();
  r.sorted_token = sorted.get();
  r.slot_of_choice = slot.get();
  PD_STATUS_CHECK(kc::moe_route(logits.get(), bsz, e, k, true, ids.get(), weights.get(), st));
  PD_STATUS_CHECK(kc::moe_align(ids.get(), bsz, k, e, r, st));
  PD_CUDA_CHECK(cudaStreamSynchronize(st));
  const int n_active = num_active.download()[0];
  // tiles: the tiled kernel's 16-column tiles per CTA; kernel: a warp-item kernel instead.
  auto gemm_args = [&](int l, bool is_gate_up, int tiles, kc::Fp8TcKernel kernel = kc::Fp8TcKernel::kTiled) {
    const kc::MoeWeights w = m.moe(l);
    kc::StreamGemmArgs a;
    const int n = is_gate_up ? 2 * inter : h, kk = is_gate_up ? h : inter;
    a.out = is_gate_up ? gate_up.get() : down.get();
    a.ldo = n;
    a.a = is_gate_up ? x.get() : act.get();
    a.lda = kk;
    a.tc_tiles = tiles;
    a.tc_kernel = kernel;
    a.a_rows = is_gate_up ? r.sorted_token : nullptr;
    a.w = is_gate_up ? w.gate_up : w.down;
    a.w_scale = is_gate_up ? w.gate_up_scale : w.down_scale;
    a.w_scale_ld = kc::fp8_weight_scale_ld(kk);
    a.w_group_stride = static_cast<int64_t>(n) * kk;
    a.scale_group_stride = static_cast<int64_t>((n + kc::kFp8Block - 1) / kc::kFp8Block) * a.w_scale_ld;
    a.group_offsets = r.expert_offsets;
    a.active_groups = r.active_experts;
    a.num_active = r.num_active;
    a.max_groups = std::min(e, rows);
    a.n = n;
    a.k = kk;
    return a;
  };
  const int L = s.layers;
  auto per_layer_us = [&](auto&& one) {
    return graph_ms(st,
                    [&] {
                      for (int l = 0; l < L; ++l) one(l);
                    }) *
           1e3 / L;
  };
  const double route = per_layer_us(
      [&](int) { PD_STATUS_CHECK(kc::moe_route(logits.get(), bsz, e, k, true, ids.get(), weights.get(), st)); });
  const double align = per_layer_us([&](int) { PD_STATUS_CHECK(kc::moe_align(ids.get(), bsz, k, e, r, st)); });
  double gu[3], dn[3];  // 1, 2, 4 tiles per CTA
  for (int t = 0; t < 3; ++t) {
    gu[t] = per_layer_us([&](int l) { PD_STATUS_CHECK(kc::stream_gemm(gemm_args(l, true, 1 << t), bsz, st)); });
    dn[t] = per_layer_us([&](int l) { PD_STATUS_CHECK(kc::stream_gemm(gemm_args(l, false, 1 << t), bsz, st)); });
  }
  const double gu_w = per_layer_us(
      [&](int l) { PD_STATUS_CHECK(kc::stream_gemm(gemm_args(l, true, 0, kc::Fp8TcKernel::kWarpItems), bsz, st)); });
  const double dn_w = per_layer_us(
      [&](int l) { PD_STATUS_CHECK(kc::stream_gemm(gemm_args(l, false, 0, kc::Fp8TcKernel::kWarpItems), bsz, st)); });
  const double silu =
      per_layer_us([&](int) { PD_STATUS_CHECK(kc::silu_mul(act.get(), gate_up.get(), rows, inter, st)); });
  const double comb = per_layer_us([&](int) {
    PD_STATUS_CHECK(kc::moe_combine(out.get(), down.get(), r.slot_of_choice, weights.get(), bsz, k, h, false, st));
  });
  const double gu_floor = n_active * 2.0 * inter * h / (copy_gbs * 1e3);
  const double dn_floor = n_active * 1.0 * inter * h / (copy_gbs * 1e3);
  std::printf(
      "moe stages b%d (%d distinct experts, us per layer; floor = expert bytes / copy): route %.2f, align %.2f, "
      "gate_up 1/2/4 tiles %.2f/%.2f/%.2f (floor %.2f), silu %.2f, down 1/2/4 tiles %.2f/%.2f/%.2f (floor %.2f), "
      "combine %.2f\n",
      bsz, n_active, route, align, gu[0], gu[1], gu[2], gu_floor, silu, dn[0], dn[1], dn[2], dn_floor, comb);
  std::printf("moe stages b%d warp items: gate_up %.2f (floor %.2f), down %.2f (floor %.2f)\n", bsz, gu_w, gu_floor,
              dn_w, dn_floor);
  std::fflush(stdout);
}

// MoE prefill stages on the grouped path (GroupedFp8Gemm) for `tokens` tokens, each timed over
// every layer's experts back to back (events, no graph: as the prefill pass issues them):
// quantize + gather, gate_up, SwiGLU + quantize, down; the GEMMs' rates against fp8_tflops.
void moe_prefill_breakdown(const Model& m, int tokens, double fp8_tflops, cudaStream_t st) {
  const Fp8Shape& s = m.s;
  const int h = s.hidden, inter = s.moe_inter, e = s.experts, k = s.top_k, rows = tokens * k;
  DeviceBuffer<bf16> x(static_cast<size_t>(tokens) * h), gate_up(static_cast<size_t>(rows) * 2 * inter),
      down(static_cast<size_t>(rows) * h);
  PD_STATUS_CHECK(kc::fill_uniform(x.get(), x.count(), 21, 1.0f, nullptr));
  DeviceBuffer<float> logits(static_cast<size_t>(tokens) * e), weights(static_cast<size_t>(rows));
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> hl(logits.count());
  for (float& v : hl) v = nd(rng);
  logits.upload(hl);
  DeviceBuffer<int32_t> ids(static_cast<size_t>(rows)), offs(static_cast<size_t>(e) + 1),
      padded(static_cast<size_t>(e) + 1), active(static_cast<size_t>(e)), num_active(1),
      sorted(static_cast<size_t>(rows)), slot(static_cast<size_t>(rows));
  kc::MoeRouting r{offs.get(), padded.get(), active.get(), num_active.get(), sorted.get(), slot.get()};
  PD_STATUS_CHECK(kc::moe_route(logits.get(), tokens, e, k, true, ids.get(), weights.get(), st));
  PD_STATUS_CHECK(kc::moe_align(ids.get(), tokens, k, e, r, st));
  const std::vector<int32_t> ho = offs.download();
  int max_rows = 0;
  for (int i = 0; i < e; ++i)
    max_rows = std::max(max_rows, ho[static_cast<size_t>(i) + 1] - ho[static_cast<size_t>(i)]);
  auto g = kc::GroupedFp8Gemm::create(e, rows, std::max(2 * inter, h), std::max(h, inter));
  PD_STATUS_CHECK(g.status());
  kc::GroupedFp8Gemm& gg = **g;
  auto weight = [&](int l, bool is_gate_up) {
    const kc::MoeWeights w = m.moe(l);
    const int kk = is_gate_up ? h : inter;
    return kc::Fp8Weight{static_cast<const uint8_t*>(is_gate_up ? w.gate_up : w.down),
                         is_gate_up ? w.gate_up_scale : w.down_scale, is_gate_up ? 2 * inter : h, kk,
                         kc::fp8_weight_scale_ld(kk)};
  };
  const int L = s.layers;
  auto per_layer_us = [&](auto&& one) {
    for (int l = 0; l < std::min(L, 2); ++l) one(l);  // warm-up
    cudaEvent_t e0, e1;
    PD_CUDA_CHECK(cudaEventCreate(&e0));
    PD_CUDA_CHECK(cudaEventCreate(&e1));
    PD_CUDA_CHECK(cudaEventRecord(e0, st));
    for (int l = 0; l < L; ++l) one(l);
    PD_CUDA_CHECK(cudaEventRecord(e1, st));
    PD_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    PD_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    PD_CUDA_CHECK(cudaEventDestroy(e0));
    PD_CUDA_CHECK(cudaEventDestroy(e1));
    return 1e3 * ms / L;
  };
  const double q1 = per_layer_us(
      [&](int) { PD_STATUS_CHECK(gg.quantize(x.get(), r.sorted_token, false, rows, h, r.expert_offsets, e, st)); });
  const double gu =
      per_layer_us([&](int l) { PD_STATUS_CHECK(gg.run(gate_up.get(), weight(l, true), r.expert_offsets, e, st)); });
  const double q2 = per_layer_us(
      [&](int) { PD_STATUS_CHECK(gg.quantize(gate_up.get(), nullptr, true, rows, inter, r.expert_offsets, e, st)); });
  const double dn =
      per_layer_us([&](int l) { PD_STATUS_CHECK(gg.run(down.get(), weight(l, false), r.expert_offsets, e, st)); });
  const double gu_tf = 2.0 * rows * 2 * inter * h / (gu * 1e6), dn_tf = 2.0 * rows * h * inter / (dn * 1e6);
  std::printf(
      "moe prefill stages %d tokens (grouped path, us per layer; %.1f rows per expert, most %d): quantize+gather "
      "%.1f, gate_up %.1f (%.0f TFLOP/s, %.0f %% of the FP8 rate), silu+quantize %.1f, down %.1f (%.0f TFLOP/s, "
      "%.0f %%)\n",
      tokens, static_cast<double>(rows) / e, max_rows, q1, gu, gu_tf, 100.0 * gu_tf / fp8_tflops, q2, dn, dn_tf,
      100.0 * dn_tf / fp8_tflops);
  std::fflush(stdout);
}

}  // namespace

double measure_fp8_gemm_tflops(int m, int n, int k, std::string* note) {
  DeviceBuffer<bf16> a(static_cast<size_t>(m) * k), out(static_cast<size_t>(m) * n);
  PD_STATUS_CHECK(kc::fill_uniform(a.get(), a.count(), 2, 1.0f, nullptr));
  DeviceBuffer<uint8_t> wq(static_cast<size_t>(n) * k), aq(a.count());
  PD_STATUS_CHECK(kc::fill_uniform_fp8(wq.get(), wq.count(), 3, 1.0f, nullptr));
  DeviceBuffer<float> ws(static_cast<size_t>((n + 127) / 128) * kc::fp8_weight_scale_ld(k)),
      as(static_cast<size_t>(k / 128) * kc::fp8_act_scale_ld(m));
  ws.upload(std::vector<float>(ws.count(), 0.01f));
  PD_STATUS_CHECK(kc::quantize_fp8(aq.get(), as.get(), a.get(), m, k, nullptr));
  auto gemm = kc::Fp8Gemm::create(m, k, kc::Fp8GemmPolicy::kCublas);
  PD_STATUS_CHECK(gemm.status());
  kc::Fp8Weight w{wq.get(), ws.get(), n, k, kc::fp8_weight_scale_ld(k)};
  // The GEMM alone (activations quantized beforehand), then with the quantization.
  const Status probe = (*gemm)->run_quantized(out.get(), aq.get(), as.get(), m, w, nullptr);
  if (!probe.ok()) {
    if (note != nullptr) *note = "cuBLASLt block-scaled FP8 unavailable: " + probe.to_string();
    return 0.0;
  }
  const float ms =
      time_ms([&] { PD_STATUS_CHECK((*gemm)->run_quantized(out.get(), aq.get(), as.get(), m, w, nullptr)); });
  const float ms_q = time_ms([&] { PD_STATUS_CHECK((*gemm)->run(out.get(), a.get(), m, w, nullptr)); });
  if (note != nullptr) {
    char buf[160];
    std::snprintf(buf, sizeof(buf), "%dx%dx%d: GEMM %.3f ms (%.1f TFLOP/s), with the activation quantization %.3f ms",
                  m, n, k, ms, 2.0 * m * n * static_cast<double>(k) / (ms * 1e9), ms_q);
    *note = buf;
  }
  return 2.0 * m * n * static_cast<double>(k) / (ms * 1e9);
}

void bench_fp8_model(const std::string& name, int layers_override, int ctx, double copy_gbs, double fp8_tflops,
                     bool decode_only, const std::vector<int>& decode_batches, int kv_fp8_batch,
                     std::vector<Fp8Row>* rows) {
  const Fp8Shape s = shape_for(name, layers_override);
  std::printf("\n%s: hidden %d, %d layers, %d/%d heads, %s\n", s.name.c_str(), s.hidden, s.layers, s.hq, s.hkv,
              s.experts > 0 ? ("MoE " + std::to_string(s.experts) + " experts top-" + std::to_string(s.top_k) + " x " +
                               std::to_string(s.moe_inter))
                                  .c_str()
                            : ("dense MLP " + std::to_string(s.inter)).c_str());
  Model model(s);
  const double kv_token_bytes = 2.0 * s.hkv * s.d * 2.0 * s.layers;  // bf16 K and V, all layers
  // Decode.
  for (bool fp8_kv : {false, true}) {
    // FP8 KV: the batch of kv_fp8_batch only, beside the same batch with bf16 KV.
    if (fp8_kv && kv_fp8_batch <= 0) break;
    const std::vector<int> batches = fp8_kv ? std::vector<int>{kv_fp8_batch} : decode_batches;
    const int max_batch = *std::max_element(batches.begin(), batches.end());
    const int blocks = max_batch * ((ctx + 15) / 16);
    Engine eng(model, max_batch, blocks, true, fp8_kv);
    for (int bsz : batches) {
      const Pass p{bsz, 1, ctx};
      PassBuffers b(model, p,
                    kc::decode_attention_workspace_bytes(
                        bsz, s.hq, s.d, ctx, engine::CudaModelRunner::decode_partition_tokens_for(bsz, s.hkv)));
      cudaStream_t st = nullptr;
      PD_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
      // The runner launches decode kernels with PDL (programmatic dependent launch): so does
      // the measured step. MoE models: the step also without PDL, same process.
      auto step_ms = [&](bool pdl) {
        kc::set_programmatic_launch(pdl);
        eng.forward(b, p, st);  // plans and tuning outside the capture
        PD_CUDA_CHECK(cudaStreamSynchronize(st));
        const double ms = graph_ms(st, [&] { eng.forward(b, p, st); });
        kc::set_programmatic_launch(false);
        return ms;
      };
      std::vector<double> times{step_ms(true)};
      if (s.experts > 0 && !fp8_kv) {
        std::printf("  b%d step ms: PDL %.3f, without PDL %.3f\n", bsz, times[0], step_ms(false));
        // The same step with each expert-kernel choice of the decode path (MoeStreamKernel).
        const kc::MoeStreamKernel chosen = eng.moe[0]->stream_kernel();
        const std::pair<const char*, kc::MoeStreamKernel> choices[] = {
            {"tiled experts", {kc::Fp8TcKernel::kTiled, 1}}, {"warp items", {kc::Fp8TcKernel::kWarpItems, 1}}};
        for (const auto& [what, k] : choices) {
          for (auto& layer : eng.moe) layer->set_stream_kernel(k);
          std::printf("  b%d step ms with %s: %.3f\n", bsz, what, step_ms(true));
        }
        for (auto& layer : eng.moe) layer->set_stream_kernel(chosen);
        kc::set_programmatic_launch(true);
        moe_stage_breakdown(model, bsz, copy_gbs, st);
        kc::set_programmatic_launch(false);
        times[0] = step_ms(true);  // the routing the floor counts is this step's
      }
      // Distinct experts routed in the step, per layer (the last replay's routing).
      double distinct = 0.0;
      int min_active = 1 << 30, max_active = 0;
      for (const auto& layer : eng.moe) {
        int32_t n = 0;
        PD_CUDA_CHECK(cudaMemcpy(&n, layer->num_active(), sizeof(n), cudaMemcpyDeviceToHost));
        distinct += n;
        min_active = std::min(min_active, n);
        max_active = std::max(max_active, n);
      }
      const double kv_bytes = fp8_kv ? 2.0 * s.hkv * (s.d + 4.0) * s.layers : kv_token_bytes;
      const double bytes = model.dense_bytes() + distinct * model.expert_bytes() + kv_bytes * ctx * bsz;
      const double floor_ms = bytes / (copy_gbs * 1e6);
      std::string note = s.experts > 0 ? "distinct experts/layer " + std::to_string(min_active) + ".." +
                                             std::to_string(max_active) + " (mean " +
                                             std::to_string(distinct / s.layers).substr(0, 5) + ")"
                                       : "";
      note += ", " + std::to_string(static_cast<int>(bytes / 1e6)) + " MB read";
      rows->push_back(
          {s.name + " decode b" + std::to_string(bsz) + " ctx" + std::to_string(ctx) + (fp8_kv ? " fp8 KV" : ""),
           floor_ms, median_of(times), note});
      print_row(rows->back());
      PD_CUDA_CHECK(cudaStreamDestroy(st));
    }
    std::printf("%s decode: FP8 GEMM paths chosen:", s.name.c_str());
    for (const auto& t : eng.fp8->tunings()) {
      std::printf(" [%d %d %d %s %.1f/%.1f/%.1f us]", t.m, t.n, t.k,
                  t.chose == kc::Fp8GemmPath::kCublas ? "cublas"
                  : t.chose_cuda_cores                ? "stream-cc"
                                                      : "stream-tc",
                  t.cublas_us, t.stream_us, t.stream_cuda_core_us);
    }
    std::printf("\n");
    for (const auto& f : eng.fp8->fallbacks()) std::printf("  fallback: %s\n", f.c_str());
  }
  if (decode_only) return;
  // Prefill: 1 and 8 prompts of 2,000 tokens.
  for (int n : {1, 8}) {
    const int len = 2000;
    const Pass p{n, len, len};
    const int blocks = n * ((len + 15) / 16);
    Engine eng(model, n * len, blocks, false);
    eng.gemm->set_tuning(false);  // prefill shapes take cuBLASLt's first choice (as a server after load)
    PassBuffers b(model, p, 0);
    if (s.experts > 0 && kc::GroupedFp8Gemm::available()) moe_prefill_breakdown(model, n * len, fp8_tflops, nullptr);
    // MoE: the grouped expert GEMMs (the runner's prefill path) and one GEMM per expert, in turn.
    std::vector<kc::MoePath> paths{kc::MoePath::kGrouped};
    if (s.experts > 0 && kc::GroupedFp8Gemm::available()) paths.push_back(kc::MoePath::kPerExpert);
    for (kc::MoePath path : paths) {
      eng.prefill_path = path;
      std::vector<double> times;
      for (int r = 0; r < 4; ++r) {
        PD_CUDA_CHECK(cudaDeviceSynchronize());
        cudaEvent_t e0, e1;
        PD_CUDA_CHECK(cudaEventCreate(&e0));
        PD_CUDA_CHECK(cudaEventCreate(&e1));
        PD_CUDA_CHECK(cudaEventRecord(e0, nullptr));
        eng.forward(b, p, nullptr);
        PD_CUDA_CHECK(cudaEventRecord(e1, nullptr));
        PD_CUDA_CHECK(cudaEventSynchronize(e1));
        float ms = 0;
        PD_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (r >= 1) times.push_back(ms);
        PD_CUDA_CHECK(cudaEventDestroy(e0));
        PD_CUDA_CHECK(cudaEventDestroy(e1));
      }
      const double t = len;
      const double flops = 2.0 * model.active_linear_params() * t * n +
                           4.0 * s.layers * s.hq * s.d * (t * (t + 1) / 2.0) * n + 2.0 * s.vocab * s.hidden * n;
      const double floor_ms = flops / (fp8_tflops * 1e9);
      const std::string how = s.experts == 0                    ? ""
                              : path == kc::MoePath::kPerExpert ? " per-expert"
                              : kc::GroupedFp8Gemm::available() ? " grouped"
                                                                : " per-expert (no CUTLASS)";
      rows->push_back({s.name + " prefill " + std::to_string(n) + "x" + std::to_string(len) + how, floor_ms,
                       median_of(times),
                       std::to_string(static_cast<int>(flops / 1e12)) + " TFLOP at the FP8 rate; " +
                           std::to_string(static_cast<int>(100.0 * floor_ms / median_of(times))) + " % of it"});
      print_row(rows->back());
      for (const auto& f : eng.fp8->fallbacks()) std::printf("  prefill fallback: %s\n", f.c_str());
    }
  }
}

}  // namespace pd::gpu_test
