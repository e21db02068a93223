#include "engine/runner/cpu_model_runner.h"

#include <algorithm>
#include <cmath>
#include <string_view>

#include "engine/sampler.h"
#include "model/tp_weight_slice.h"

namespace pd::engine {
namespace cpu = kernels::cpu;

Result<std::unique_ptr<CpuModelRunner>> CpuModelRunner::create(model::ModelConfig config, model::ModelWeights weights,
                                                               int32_t block_size, int32_t num_kv_blocks,
                                                               int32_t max_model_len, KvDtype kv_dtype,
                                                               int32_t tensor_parallel_size,
                                                               bool enable_expert_parallel) {
  PD_RETURN_IF_ERROR(config.validate());
  if (block_size <= 0 || block_size > 1024)
    return invalid_argument("block_size must be in [1, 1024], got {}", block_size);
  if (num_kv_blocks <= 0) return invalid_argument("num_kv_blocks must be > 0, got {}", num_kv_blocks);
  if (max_model_len <= 0) return invalid_argument("max_model_len must be > 0, got {}", max_model_len);
  if (kv_dtype != KvDtype::kFloat32 && kv_dtype != KvDtype::kFp8E4m3)
    return invalid_argument("the CPU runner keeps its KV cache in float32 or fp8_e4m3, not {}",
                            kv_dtype_name(kv_dtype));
  PD_ASSIGN_OR_RETURN(model::TpSplit split,
                      model::plan_tensor_parallel(config, tensor_parallel_size, enable_expert_parallel));
  std::unique_ptr<CpuModelRunner> r(new CpuModelRunner());
  r->split_ = split;
  const int32_t tp = split.tp_size;
  r->config_ = std::move(config);
  r->weights_ = std::move(weights);
  r->max_model_len_ = max_model_len;
  const model::ModelConfig& c = r->config_;

  // Resolve every tensor once; a missing or mis-shaped one fails here, not mid-step.
  for (const model::WeightSpec& spec : model::weight_specs(c)) {
    const model::Tensor* t = r->weights_.find(spec.name);
    if (t == nullptr) return invalid_argument("model weights: tensor '{}' is missing", spec.name);
    if (t->shape != spec.shape) return invalid_argument("model weights: tensor '{}' has the wrong shape", spec.name);
    const size_t n = static_cast<size_t>(t->num_elements());
    const bool fp8 = spec.dtype == model::WeightDtype::kF8E4M3;
    if (t->dtype != spec.dtype || (fp8 ? t->fp8.size() : t->data.size()) != n)
      return invalid_argument("model weights: tensor '{}' does not hold {} {} values", spec.name, n,
                              fp8 ? "F8_E4M3" : "fp32");
  }
  auto get = [&](const std::string& name) -> const float* {
    const model::Tensor* t = r->weights_.find(name);
    return t ? t->data.data() : nullptr;
  };
  std::vector<std::vector<float>> full_copies;
  auto linear = [&](const std::string& name, const float* bias) {
    Linear l;
    l.bias = bias;
    const model::Tensor* w = r->weights_.find(name + ".weight");
    if (w->dtype == model::WeightDtype::kF32) {
      l.weight = w->data.data();
      return l;
    }
    const model::Tensor* scales = r->weights_.find(name + ".weight_scale_inv");
    std::vector<float> dense(w->fp8.size());
    model::dequantize_fp8_blocks(w->fp8.data(), scales->data.data(), w->shape[0], w->shape[1], dense.data());
    // With more than one rank the full copy lives only until the ranks' slices are cut.
    auto& store = tp == 1 ? r->dequantised_ : full_copies;
    store.push_back(std::move(dense));
    l.weight = store.back().data();
    l.fp8_input = true;
    return l;
  };
  r->embed_ = get("model.embed_tokens.weight");
  r->final_norm_ = get("model.norm.weight");
  r->lm_head_ = c.tie_word_embeddings ? r->embed_ : get("lm_head.weight");
  std::vector<LayerPtrs> full_layers;
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    LayerPtrs lp;
    lp.input_norm = get(p + "input_layernorm.weight");
    lp.q_proj = linear(p + "self_attn.q_proj", c.qkv_bias ? get(p + "self_attn.q_proj.bias") : nullptr);
    lp.k_proj = linear(p + "self_attn.k_proj", c.qkv_bias ? get(p + "self_attn.k_proj.bias") : nullptr);
    lp.v_proj = linear(p + "self_attn.v_proj", c.qkv_bias ? get(p + "self_attn.v_proj.bias") : nullptr);
    if (c.qk_norm) {
      lp.q_norm = get(p + "self_attn.q_norm.weight");
      lp.k_norm = get(p + "self_attn.k_norm.weight");
    }
    lp.o_proj = linear(p + "self_attn.o_proj", c.o_bias ? get(p + "self_attn.o_proj.bias") : nullptr);
    lp.post_norm = get(p + "post_attention_layernorm.weight");
    if (c.is_moe_layer(l)) {
      lp.router = get(p + "mlp.gate.weight");
      for (int32_t e = 0; e < c.moe.num_experts; ++e) {
        const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
        lp.experts.push_back(
            {linear(x + "gate_proj", nullptr), linear(x + "up_proj", nullptr), linear(x + "down_proj", nullptr)});
      }
    } else {
      lp.gate_proj = linear(p + "mlp.gate_proj", nullptr);
      lp.up_proj = linear(p + "mlp.up_proj", nullptr);
      lp.down_proj = linear(p + "mlp.down_proj", nullptr);
    }
    full_layers.push_back(std::move(lp));
  }
  r->ranks_.resize(static_cast<size_t>(tp));
  if (tp == 1) {
    r->ranks_[0].layers = std::move(full_layers);
  } else {
    // Megatron split, planned once for every runner by model::rank_linear_parts:
    // column-parallel linears keep a range of output rows (and that slice of
    // their bias); row-parallel ones keep a range of input columns, their bias
    // only on rank 0 (added once before the reduction).
    auto keep = [&](std::vector<float> v) {
      r->dequantised_.push_back(std::move(v));
      return r->dequantised_.back().data();
    };
    auto cut = [&](const Linear& full, const model::LinearPart& part, int32_t rank) {
      Linear l;
      l.fp8_input = full.fp8_input;
      l.weight = keep(model::copy_part(full.weight, part));
      if (full.bias != nullptr) {
        const bool row_parallel = part.col_begin != 0 || part.col_end != part.cols;
        if (!row_parallel)
          l.bias = keep(model::copy_bias_part(full.bias, part));
        else if (rank == 0)
          l.bias = full.bias;
      }
      return l;
    };
    using model::FusedLinear;
    for (int32_t rank = 0; rank < tp; ++rank) {
      for (int32_t layer = 0; layer < c.num_layers; ++layer) {
        const LayerPtrs& f = full_layers[static_cast<size_t>(layer)];
        const std::string prefix = "model.layers." + std::to_string(layer) + ".";
        const auto parts = [&](const std::string& at, FusedLinear which, bool expert) {
          return model::rank_linear_parts(c, split, rank, at, which, expert);
        };
        LayerPtrs lp;
        lp.input_norm = f.input_norm;
        const auto qkv = parts(prefix, FusedLinear::kQkv, false);
        lp.q_proj = cut(f.q_proj, qkv[0], rank);
        lp.k_proj = cut(f.k_proj, qkv[1], rank);
        lp.v_proj = cut(f.v_proj, qkv[2], rank);
        lp.q_norm = f.q_norm;
        lp.k_norm = f.k_norm;
        lp.o_proj = cut(f.o_proj, parts(prefix, FusedLinear::kOProj, false)[0], rank);
        lp.post_norm = f.post_norm;
        lp.router = f.router;
        if (f.router != nullptr) {
          // With expert parallelism the rank holds experts [e0, e0 + experts_per_rank)
          // whole, so an FP8 expert's 128x128 scale blocks and its input
          // quantisation stay as at one rank; otherwise a slice of every expert.
          const int32_t e0 = split.expert_begin(rank);
          for (int32_t e = e0; e < e0 + split.experts_per_rank; ++e) {
            const Expert& x = f.experts[static_cast<size_t>(e)];
            const std::string at = prefix + "mlp.experts." + std::to_string(e) + ".";
            const auto gate_up = parts(at, FusedLinear::kGateUp, true);
            lp.experts.push_back({cut(x.gate_proj, gate_up[0], rank), cut(x.up_proj, gate_up[1], rank),
                                  cut(x.down_proj, parts(at, FusedLinear::kDown, true)[0], rank)});
          }
        } else {
          const auto gate_up = parts(prefix, FusedLinear::kGateUp, false);
          lp.gate_proj = cut(f.gate_proj, gate_up[0], rank);
          lp.up_proj = cut(f.up_proj, gate_up[1], rank);
          lp.down_proj = cut(f.down_proj, parts(prefix, FusedLinear::kDown, false)[0], rank);
        }
        r->ranks_[static_cast<size_t>(rank)].layers.push_back(std::move(lp));
      }
    }
    // The full linear weights are no longer read (row-parallel biases stay: rank 0 points at them).
    full_copies.clear();
    for (const model::WeightSpec& spec : model::weight_specs(c)) {
      const std::string_view name = spec.name;
      if (name.ends_with("_proj.weight") || name.ends_with("_proj.weight_scale_inv") ||
          (name.ends_with("_proj.bias") && !name.ends_with("o_proj.bias")))
        r->weights_.erase(spec.name);
    }
  }
  // The codes are no longer needed: the forward pass reads the fp32 copies.
  if (c.quant.fp8()) {
    for (const model::WeightSpec& spec : model::weight_specs(c))
      if (spec.dtype == model::WeightDtype::kF8E4M3) r->weights_.erase(spec.name);
  }
  r->pool_ = std::make_unique<RankPool>(tp);

  cpu::RopeScalingParams scaling;
  scaling.llama3 = c.rope_scaling.type == model::RopeScalingType::kLlama3;
  scaling.factor = c.rope_scaling.factor;
  scaling.low_freq_factor = c.rope_scaling.low_freq_factor;
  scaling.high_freq_factor = c.rope_scaling.high_freq_factor;
  scaling.original_max_position_embeddings = c.rope_scaling.original_max_position_embeddings;
  r->inv_freq_ = cpu::rope_inv_freq(c.head_dim, c.rope_theta, scaling);

  r->spec_.num_layers = c.num_layers;
  // The instance's pool: every rank holds kv_heads_per_rank heads of every block
  // (tp_size * kv_heads_per_rank heads in all, replicas included).
  r->spec_.num_kv_heads = split.kv_heads_per_rank * tp;
  r->spec_.head_dim = c.head_dim;
  r->spec_.block_size = block_size;
  r->spec_.dtype = kv_dtype;
  r->spec_.num_blocks = num_kv_blocks;
  for (Rank& rank : r->ranks_) {
    rank.layout = {num_kv_blocks, block_size, split.kv_heads_per_rank, c.head_dim};
    const size_t blocks = static_cast<size_t>(num_kv_blocks);
    for (int32_t l = 0; l < c.num_layers; ++l) {
      if (kv_dtype == KvDtype::kFp8E4m3) {
        rank.kv_fp8.push_back(
            std::make_unique_for_overwrite<uint8_t[]>(blocks * static_cast<size_t>(rank.layout.fp8_block_bytes())));
      } else {
        rank.kv_f32.push_back(
            std::make_unique_for_overwrite<float[]>(blocks * static_cast<size_t>(rank.layout.block_stride())));
      }
    }
  }
  return r;
}

void* CpuModelRunner::kv_layer_base(int32_t layer) {
  if (split_.tp_size != 1) return nullptr;
  return kv_layer_base(0, layer);
}

void* CpuModelRunner::kv_layer_base(int32_t rank, int32_t layer) {
  if (layer < 0 || layer >= config_.num_layers || rank < 0 || rank >= split_.tp_size) return nullptr;
  Rank& rk = ranks_[static_cast<size_t>(rank)];
  if (spec_.dtype == KvDtype::kFp8E4m3) return rk.kv_fp8[static_cast<size_t>(layer)].get();
  return rk.kv_f32[static_cast<size_t>(layer)].get();
}

void CpuModelRunner::all_reduce(int64_t count, float* delta) {
  std::vector<const float*> partials;
  partials.reserve(ranks_.size());
  for (const Rank& rk : ranks_) partials.push_back(rk.partial.data());
  cpu::sum_rank_partials(partials, count, delta);
}

void CpuModelRunner::run_linear(const Linear& l, const float* x, int32_t m, int32_t n, int32_t k, float* out,
                                std::vector<float>* scratch) const {
  if (l.fp8_input) {
    scratch->resize(static_cast<size_t>(m) * static_cast<size_t>(k));
    cpu::fp8_quantize_activations(x, m, k, scratch->data());
    x = scratch->data();
  }
  cpu::matmul(x, l.weight, l.bias, m, n, k, out);
}

void CpuModelRunner::run_moe(Rank& rank, const LayerPtrs& w, const float* x, int32_t t,
                             const std::vector<std::vector<std::pair<int32_t, float>>>& routed) {
  const int32_t hidden = config_.hidden_size;
  const int32_t inter = split_.moe_intermediate_per_rank;
  // Experts run in ascending id and add into the partial in that order (HF's
  // loop over the hit experts); each rank covers its slice of the intermediate dim.
  rank.partial.assign(static_cast<size_t>(t) * hidden, 0.0f);
  for (size_t e = 0; e < routed.size(); ++e) {
    const auto& rows = routed[e];
    if (rows.empty()) continue;
    const int32_t m = static_cast<int32_t>(rows.size());
    rank.xs.resize(static_cast<size_t>(m) * hidden);
    for (int32_t i = 0; i < m; ++i)
      std::copy_n(x + static_cast<int64_t>(rows[static_cast<size_t>(i)].first) * hidden, hidden,
                  rank.xs.data() + static_cast<int64_t>(i) * hidden);
    rank.gate.resize(static_cast<size_t>(m) * inter);
    rank.up.resize(rank.gate.size());
    rank.out.resize(rank.xs.size());
    const Expert& ex = w.experts[e];
    run_linear(ex.gate_proj, rank.xs.data(), m, inter, hidden, rank.gate.data(), &rank.quant_scratch);
    run_linear(ex.up_proj, rank.xs.data(), m, inter, hidden, rank.up.data(), &rank.quant_scratch);
    cpu::silu_mul(rank.gate.data(), rank.up.data(), static_cast<int64_t>(m) * inter, rank.gate.data());
    run_linear(ex.down_proj, rank.gate.data(), m, hidden, inter, rank.out.data(), &rank.quant_scratch);
    for (int32_t i = 0; i < m; ++i) {
      const auto [row, weight] = rows[static_cast<size_t>(i)];
      float* d = rank.partial.data() + static_cast<int64_t>(row) * hidden;
      const float* o = rank.out.data() + static_cast<int64_t>(i) * hidden;
      for (int32_t j = 0; j < hidden; ++j) d[j] += o[j] * weight;
    }
  }
}

void CpuModelRunner::run_expert_parallel_moe(size_t layer, const float* x, int32_t t, float* delta) {
  const model::MoeConfig& moe = config_.moe;
  const int32_t hidden = config_.hidden_size;
  const int32_t top_k = moe.num_experts_per_tok;
  const int32_t num_ranks = split_.tp_size;
  // The exchange, one slice of token rows per rank. Dispatch: rank r routes its
  // rows (the router is replicated) into its rows of the shared routing table;
  // their hidden states are rows of x, one buffer in shared memory, so the
  // all-gather of hidden states moves nothing. After the join every rank sees
  // every token's hidden state and routes.
  std::vector<int32_t> expert_ids(static_cast<size_t>(t) * top_k);
  std::vector<float> route_weights(expert_ids.size());
  pool_->run([&](int32_t ri) {
    const auto [row0, row1] = model::token_slice(ri, num_ranks, t);
    if (row0 == row1) return;
    Rank& rk = ranks_[static_cast<size_t>(ri)];
    const int32_t m = row1 - row0;
    rk.scratch.resize(static_cast<size_t>(m) * moe.num_experts);
    cpu::matmul(x + static_cast<int64_t>(row0) * hidden, rk.layers[layer].router, nullptr, m, moe.num_experts, hidden,
                rk.scratch.data());
    const size_t at = static_cast<size_t>(row0) * top_k;
    cpu::moe_route(rk.scratch.data(), m, moe.num_experts, top_k, moe.norm_topk_prob, expert_ids.data() + at,
                   route_weights.data() + at);
  });
  // Each rank runs its experts over every gathered row routed to them (rows
  // ascending per expert, as at one rank) into its partial [t][hidden].
  pool_->run([&](int32_t ri) {
    Rank& rk = ranks_[static_cast<size_t>(ri)];
    const int32_t e0 = split_.expert_begin(ri);
    rk.local_routed.assign(static_cast<size_t>(split_.experts_per_rank), {});
    for (int32_t r = 0; r < t; ++r)
      for (int32_t i = 0; i < top_k; ++i) {
        const size_t at = static_cast<size_t>(r) * top_k + i;
        const int32_t local = expert_ids[at] - e0;
        if (local >= 0 && local < split_.experts_per_rank)
          rk.local_routed[static_cast<size_t>(local)].push_back({r, route_weights[at]});
      }
    run_moe(rk, rk.layers[layer], x, t, rk.local_routed);
  });
  // Combine (reduce-scatter): rank r sums its token rows over every rank's
  // partial in rank order, into its rows of delta; the slices tile delta, so
  // the engine thread then reads the whole sum (the closing all-gather).
  pool_->run([&](int32_t ri) {
    const auto [row0, row1] = model::token_slice(ri, num_ranks, t);
    if (row0 == row1) return;
    const int64_t offset = static_cast<int64_t>(row0) * hidden;
    std::vector<const float*> partials;
    partials.reserve(ranks_.size());
    for (const Rank& rk : ranks_) partials.push_back(rk.partial.data() + offset);
    cpu::sum_rank_partials(partials, static_cast<int64_t>(row1 - row0) * hidden, delta + offset);
  });
}

Status CpuModelRunner::validate(const StepInput& input) const {
  const int64_t num_tokens = static_cast<int64_t>(input.token_ids.size());
  for (size_t i = 0; i < input.token_ids.size(); ++i) {
    const int32_t id = input.token_ids[i];
    if (id < 0 || id >= config_.vocab_size)
      return invalid_argument("step input: token_ids[{}] = {} is outside the vocabulary [0, {})", i, id,
                              config_.vocab_size);
  }
  for (size_t s = 0; s < input.seqs.size(); ++s) {
    const SeqStep& seq = input.seqs[s];
    if (seq.num_new_tokens < 0 || seq.num_computed_tokens < 0 || seq.token_offset < 0)
      return invalid_argument("step input: seq {} has a negative count (offset {}, new {}, computed {})", s,
                              seq.token_offset, seq.num_new_tokens, seq.num_computed_tokens);
    if (seq.token_offset + static_cast<int64_t>(seq.num_new_tokens) > num_tokens)
      return invalid_argument("step input: seq {} tokens [{}, {}) run past the {} token ids", s, seq.token_offset,
                              seq.token_offset + static_cast<int64_t>(seq.num_new_tokens), num_tokens);
    if (seq.sample && seq.num_new_tokens == 0)
      return invalid_argument("step input: seq {} asks to sample but computes no token", s);
    const int64_t end = static_cast<int64_t>(seq.num_computed_tokens) + seq.num_new_tokens;
    if (end > max_model_len_)
      return invalid_argument("step input: seq {} reaches position {} beyond max_model_len {}", s, end, max_model_len_);
    const int64_t blocks_needed = (end + spec_.block_size - 1) / spec_.block_size;
    if (static_cast<int64_t>(seq.block_table.size()) < blocks_needed)
      return invalid_argument("step input: seq {} covers {} tokens but its block table has {} blocks (needs {})", s,
                              end, seq.block_table.size(), blocks_needed);
    for (int64_t b = 0; b < blocks_needed; ++b) {
      const int32_t id = seq.block_table[static_cast<size_t>(b)];
      if (id < 0 || id >= spec_.num_blocks)
        return invalid_argument("step input: seq {} block_table[{}] = {} is outside [0, {})", s, b, id,
                                spec_.num_blocks);
    }
  }
  return Status::Ok();
}

Result<std::vector<float>> CpuModelRunner::forward(const StepInput& input, LogitsRows rows_kind) {
  PD_ASSIGN_OR_RETURN(std::vector<float> hidden_rows, forward_hidden(input, rows_kind));
  const int32_t hidden = config_.hidden_size;
  const auto n_out = static_cast<int32_t>(hidden_rows.size() / static_cast<size_t>(hidden));
  std::vector<float> logits(static_cast<size_t>(n_out) * config_.vocab_size);
  kernels::cpu::matmul(hidden_rows.data(), lm_head_, nullptr, n_out, config_.vocab_size, hidden, logits.data());
  return logits;
}

Result<std::vector<float>> CpuModelRunner::forward_hidden(const StepInput& input, LogitsRows rows_kind) {
  PD_RETURN_IF_ERROR(validate(input));
  const model::ModelConfig& c = config_;
  const int32_t hidden = c.hidden_size;

  // Gather the rows this step computes: only tokens named by some seq.
  std::vector<int32_t> ids, positions;
  std::vector<int64_t> slots;
  struct SeqRows {
    int32_t first_row;
    int32_t num_rows;
    const SeqStep* seq;
  };
  std::vector<SeqRows> seq_rows;
  int32_t max_keys = 0;
  for (const SeqStep& seq : input.seqs) {
    if (seq.num_new_tokens == 0) continue;
    seq_rows.push_back({static_cast<int32_t>(ids.size()), seq.num_new_tokens, &seq});
    for (int32_t i = 0; i < seq.num_new_tokens; ++i) {
      const int32_t pos = seq.num_computed_tokens + i;
      ids.push_back(input.token_ids[static_cast<size_t>(seq.token_offset + i)]);
      positions.push_back(pos);
      slots.push_back(static_cast<int64_t>(seq.block_table[static_cast<size_t>(pos / spec_.block_size)]) *
                          spec_.block_size +
                      pos % spec_.block_size);
    }
    max_keys = std::max(max_keys, seq.num_computed_tokens + seq.num_new_tokens);
  }
  const int32_t t = static_cast<int32_t>(ids.size());
  const int32_t heads = split_.heads_per_rank;
  const int32_t kv_heads = split_.kv_heads_per_rank;
  const int32_t q_size = heads * c.head_dim;
  const int32_t kv_size = kv_heads * c.head_dim;
  const int32_t inter = split_.intermediate_per_rank;
  const int64_t rows_hidden = static_cast<int64_t>(t) * hidden;

  // Shared by the ranks (read-only inside run()): residual, x; delta is the reduced sum.
  std::vector<float> residual(static_cast<size_t>(rows_hidden)), x(residual.size()), delta(residual.size());
  const bool fp8_kv = spec_.dtype == KvDtype::kFp8E4m3;
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  const size_t keys = static_cast<size_t>(std::max(max_keys, 1));
  std::vector<std::vector<std::pair<int32_t, float>>> routed;

  cpu::embedding(embed_, hidden, ids, residual.data());
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const size_t li = static_cast<size_t>(l);
    cpu::rms_norm(residual.data(), ranks_[0].layers[li].input_norm, t, hidden, c.rms_norm_eps, x.data());
    // Column-parallel q/k/v: each rank its heads.
    pool_->run([&](int32_t ri) {
      Rank& rk = ranks_[static_cast<size_t>(ri)];
      const LayerPtrs& w = rk.layers[li];
      rk.q.resize(static_cast<size_t>(t) * q_size);
      rk.k.resize(static_cast<size_t>(t) * kv_size);
      rk.v.resize(rk.k.size());
      run_linear(w.q_proj, x.data(), t, q_size, hidden, rk.q.data(), &rk.quant_scratch);
      run_linear(w.k_proj, x.data(), t, kv_size, hidden, rk.k.data(), &rk.quant_scratch);
      run_linear(w.v_proj, x.data(), t, kv_size, hidden, rk.v.data(), &rk.quant_scratch);
      if (c.qk_norm) {  // per-head RMSNorm over head_dim, before RoPE (HF Qwen3Attention)
        cpu::rms_norm(rk.q.data(), w.q_norm, t * heads, c.head_dim, c.rms_norm_eps, rk.q.data());
        cpu::rms_norm(rk.k.data(), w.k_norm, t * kv_heads, c.head_dim, c.rms_norm_eps, rk.k.data());
      }
      cpu::apply_rope(rk.q.data(), t, heads, c.head_dim, positions.data(), inv_freq_);
      cpu::apply_rope(rk.k.data(), t, kv_heads, c.head_dim, positions.data(), inv_freq_);
    });

    // KV of earlier positions (prefix hits, remote KV) must be in place before
    // this layer reads the cache.
    if (input.layer_hooks != nullptr) input.layer_hooks->wait_for_layer_load(l);
    // Each rank writes and attends over its shard of the KV blocks, then its
    // row-parallel o_proj partial.
    pool_->run([&](int32_t ri) {
      Rank& rk = ranks_[static_cast<size_t>(ri)];
      const LayerPtrs& w = rk.layers[li];
      rk.attn.resize(rk.q.size());
      rk.scratch.resize(keys);
      if (fp8_kv) {
        uint8_t* kv_layer = rk.kv_fp8[li].get();
        cpu::write_kv_cache_fp8(kv_layer, rk.layout, rk.k.data(), rk.v.data(), t, slots.data());
        for (const SeqRows& sr : seq_rows) {
          cpu::paged_attention_fp8(rk.q.data() + static_cast<int64_t>(sr.first_row) * q_size, sr.num_rows,
                                   positions.data() + sr.first_row, kv_layer, rk.layout, sr.seq->block_table, heads,
                                   scale, rk.attn.data() + static_cast<int64_t>(sr.first_row) * q_size,
                                   rk.scratch.data());
        }
      } else {
        float* kv_layer = rk.kv_f32[li].get();
        cpu::write_kv_cache(kv_layer, rk.layout, rk.k.data(), rk.v.data(), t, slots.data());
        for (const SeqRows& sr : seq_rows) {
          cpu::paged_attention(rk.q.data() + static_cast<int64_t>(sr.first_row) * q_size, sr.num_rows,
                               positions.data() + sr.first_row, kv_layer, rk.layout, sr.seq->block_table, heads, scale,
                               rk.attn.data() + static_cast<int64_t>(sr.first_row) * q_size, rk.scratch.data());
        }
      }
      rk.partial.resize(static_cast<size_t>(rows_hidden));
      run_linear(w.o_proj, rk.attn.data(), t, hidden, q_size, rk.partial.data(), &rk.quant_scratch);
    });
    if (input.layer_hooks != nullptr) input.layer_hooks->save_layer(l);

    all_reduce(rows_hidden, delta.data());
    const LayerPtrs& w0 = ranks_[0].layers[li];
    cpu::add_rms_norm(residual.data(), delta.data(), w0.post_norm, t, hidden, c.rms_norm_eps, x.data());
    const bool expert_parallel_moe = w0.router != nullptr && split_.expert_parallel;
    if (expert_parallel_moe) {
      run_expert_parallel_moe(li, x.data(), t, delta.data());
    } else if (w0.router != nullptr) {
      // The router is replicated: routed once here, the same for every rank.
      const model::MoeConfig& moe = c.moe;
      const int32_t top_k = moe.num_experts_per_tok;
      std::vector<float> router_logits(static_cast<size_t>(t) * moe.num_experts);
      cpu::matmul(x.data(), w0.router, nullptr, t, moe.num_experts, hidden, router_logits.data());
      std::vector<int32_t> expert_ids(static_cast<size_t>(t) * top_k);
      std::vector<float> route_weights(expert_ids.size());
      cpu::moe_route(router_logits.data(), t, moe.num_experts, top_k, moe.norm_topk_prob, expert_ids.data(),
                     route_weights.data());
      routed.assign(static_cast<size_t>(moe.num_experts), {});
      for (int32_t r = 0; r < t; ++r)
        for (int32_t i = 0; i < top_k; ++i) {
          const size_t at = static_cast<size_t>(r) * top_k + i;
          routed[static_cast<size_t>(expert_ids[at])].push_back({r, route_weights[at]});
        }
      pool_->run([&](int32_t ri) {
        Rank& rk = ranks_[static_cast<size_t>(ri)];
        run_moe(rk, rk.layers[li], x.data(), t, routed);
      });
    } else {
      // Column-parallel gate/up, row-parallel down.
      pool_->run([&](int32_t ri) {
        Rank& rk = ranks_[static_cast<size_t>(ri)];
        const LayerPtrs& w = rk.layers[li];
        rk.gate.resize(static_cast<size_t>(t) * inter);
        rk.up.resize(rk.gate.size());
        rk.partial.resize(static_cast<size_t>(rows_hidden));
        run_linear(w.gate_proj, x.data(), t, inter, hidden, rk.gate.data(), &rk.quant_scratch);
        run_linear(w.up_proj, x.data(), t, inter, hidden, rk.up.data(), &rk.quant_scratch);
        cpu::silu_mul(rk.gate.data(), rk.up.data(), static_cast<int64_t>(t) * inter, rk.gate.data());
        run_linear(w.down_proj, rk.gate.data(), t, hidden, inter, rk.partial.data(), &rk.quant_scratch);
      });
    }
    if (!expert_parallel_moe) all_reduce(rows_hidden, delta.data());
    for (size_t i = 0; i < residual.size(); ++i) residual[i] += delta[i];
  }

  // Final norm and lm_head only for the rows whose logits are wanted.
  std::vector<int32_t> out_rows;
  if (rows_kind == LogitsRows::kAll) {
    for (int32_t r = 0; r < t; ++r) out_rows.push_back(r);
  } else {
    for (const SeqRows& sr : seq_rows) {
      if (rows_kind == LogitsRows::kSampledAndPrompt) {
        for (int32_t r = 0; r < num_prompt_logprob_rows(*sr.seq); ++r) out_rows.push_back(sr.first_row + r);
      }
      if (sr.seq->sample) out_rows.push_back(sr.first_row + sr.num_rows - 1);
    }
  }
  const int32_t n_out = static_cast<int32_t>(out_rows.size());
  std::vector<float> picked(static_cast<size_t>(n_out) * hidden);
  for (int32_t i = 0; i < n_out; ++i)
    std::copy_n(residual.data() + static_cast<int64_t>(out_rows[static_cast<size_t>(i)]) * hidden, hidden,
                picked.data() + static_cast<int64_t>(i) * hidden);
  cpu::rms_norm(picked.data(), final_norm_, n_out, hidden, c.rms_norm_eps, picked.data());
  return picked;
}

Result<StepOutput> CpuModelRunner::execute(const StepInput& input) {
  const bool any_prompt_logprobs =
      std::any_of(input.seqs.begin(), input.seqs.end(), [](const SeqStep& s) { return s.prompt_logprobs >= 0; });
  PD_ASSIGN_OR_RETURN(
      std::vector<float> hidden_rows,
      forward_hidden(input, any_prompt_logprobs ? LogitsRows::kSampledAndPrompt : LogitsRows::kSampled));
  const int32_t hidden = config_.hidden_size;
  const auto vocab = static_cast<size_t>(config_.vocab_size);
  // The lm_head runs on at most kLogitsGroupRows rows at a time: a long prompt
  // chunk with prompt logprobs never holds its whole [rows][vocab] logits.
  constexpr int32_t kLogitsGroupRows = 32;
  std::vector<float> logits;
  auto logits_of = [&](int32_t first, int32_t count) {
    logits.resize(static_cast<size_t>(count) * vocab);
    kernels::cpu::matmul(hidden_rows.data() + static_cast<size_t>(first) * hidden, lm_head_, nullptr, count,
                         config_.vocab_size, hidden, logits.data());
  };
  StepOutput out;
  int32_t row = 0;
  for (size_t s = 0; s < input.seqs.size(); ++s) {
    const SeqStep& seq = input.seqs[s];
    if (const int32_t num_prompt_rows = seq.num_new_tokens > 0 ? num_prompt_logprob_rows(seq) : 0;
        num_prompt_rows > 0) {
      PromptLogprobsChunk chunk{static_cast<int32_t>(s), seq.num_computed_tokens, {}};
      chunk.rows.reserve(static_cast<size_t>(num_prompt_rows));
      for (int32_t first = 0; first < num_prompt_rows; first += kLogitsGroupRows) {
        const int32_t count = std::min(kLogitsGroupRows, num_prompt_rows - first);
        logits_of(row + first, count);
        for (int32_t i = 0; i < count; ++i) {
          const size_t position = static_cast<size_t>(seq.num_computed_tokens + first + i);
          chunk.rows.push_back(prompt_position_logprobs(std::span<const float>(logits.data() + i * vocab, vocab),
                                                        seq.prompt_token_ids[position + 1], seq.prompt_logprobs));
        }
      }
      row += num_prompt_rows;
      out.prompt_logprobs.push_back(std::move(chunk));
    }
    if (!seq.sample) continue;
    logits_of(row, 1);
    out.sampled.push_back(sample_step_token(std::span<float>(logits.data(), vocab), seq));
    ++row;
  }
  return out;
}

}  // namespace pd::engine
