#include "engine/runner/cpu_model_runner.h"

#include <algorithm>
#include <cmath>

#include "engine/sampler.h"

namespace pd::engine {
namespace cpu = kernels::cpu;

Result<std::unique_ptr<CpuModelRunner>> CpuModelRunner::create(model::ModelConfig config, model::ModelWeights weights,
                                                               int32_t block_size, int32_t num_kv_blocks,
                                                               int32_t max_model_len, KvDtype kv_dtype) {
  PD_RETURN_IF_ERROR(config.validate());
  if (block_size <= 0 || block_size > 1024)
    return invalid_argument("block_size must be in [1, 1024], got {}", block_size);
  if (num_kv_blocks <= 0) return invalid_argument("num_kv_blocks must be > 0, got {}", num_kv_blocks);
  if (max_model_len <= 0) return invalid_argument("max_model_len must be > 0, got {}", max_model_len);
  if (kv_dtype != KvDtype::kFloat32 && kv_dtype != KvDtype::kFp8E4m3)
    return invalid_argument("the CPU runner keeps its KV cache in float32 or fp8_e4m3, not {}",
                            kv_dtype_name(kv_dtype));
  std::unique_ptr<CpuModelRunner> r(new CpuModelRunner());
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
    r->dequantised_.push_back(std::move(dense));
    l.weight = r->dequantised_.back().data();
    l.fp8_input = true;
    return l;
  };
  r->embed_ = get("model.embed_tokens.weight");
  r->final_norm_ = get("model.norm.weight");
  r->lm_head_ = c.tie_word_embeddings ? r->embed_ : get("lm_head.weight");
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
    r->layers_.push_back(std::move(lp));
  }
  // The codes are no longer needed: the forward pass reads the fp32 copies.
  if (c.quant.fp8()) {
    for (const model::WeightSpec& spec : model::weight_specs(c))
      if (spec.dtype == model::WeightDtype::kF8E4M3) r->weights_.erase(spec.name);
  }

  cpu::RopeScalingParams scaling;
  scaling.llama3 = c.rope_scaling.type == model::RopeScalingType::kLlama3;
  scaling.factor = c.rope_scaling.factor;
  scaling.low_freq_factor = c.rope_scaling.low_freq_factor;
  scaling.high_freq_factor = c.rope_scaling.high_freq_factor;
  scaling.original_max_position_embeddings = c.rope_scaling.original_max_position_embeddings;
  r->inv_freq_ = cpu::rope_inv_freq(c.head_dim, c.rope_theta, scaling);

  r->spec_.num_layers = c.num_layers;
  r->spec_.num_kv_heads = c.num_kv_heads;
  r->spec_.head_dim = c.head_dim;
  r->spec_.block_size = block_size;
  r->spec_.dtype = kv_dtype;
  r->spec_.num_blocks = num_kv_blocks;
  r->layout_ = {num_kv_blocks, block_size, c.num_kv_heads, c.head_dim};
  for (int32_t l = 0; l < c.num_layers; ++l) {
    if (kv_dtype == KvDtype::kFp8E4m3) {
      r->kv_fp8_.push_back(std::make_unique_for_overwrite<uint8_t[]>(r->spec_.bytes_per_layer()));
    } else {
      r->kv_f32_.push_back(std::make_unique_for_overwrite<float[]>(r->spec_.bytes_per_layer() / sizeof(float)));
    }
  }
  return r;
}

void* CpuModelRunner::kv_layer_base(int32_t layer) {
  if (layer < 0 || layer >= config_.num_layers) return nullptr;
  if (spec_.dtype == KvDtype::kFp8E4m3) return kv_fp8_[static_cast<size_t>(layer)].get();
  return kv_f32_[static_cast<size_t>(layer)].get();
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

void CpuModelRunner::run_moe(const LayerPtrs& w, const float* x, int32_t t, float* delta) {
  const model::MoeConfig& moe = config_.moe;
  const int32_t hidden = config_.hidden_size;
  const int32_t inter = moe.moe_intermediate_size;
  const int32_t top_k = moe.num_experts_per_tok;
  std::vector<float> router_logits(static_cast<size_t>(t) * moe.num_experts);
  cpu::matmul(x, w.router, nullptr, t, moe.num_experts, hidden, router_logits.data());
  std::vector<int32_t> ids(static_cast<size_t>(t) * top_k);
  std::vector<float> route_weights(ids.size());
  cpu::moe_route(router_logits.data(), t, moe.num_experts, top_k, moe.norm_topk_prob, ids.data(), route_weights.data());
  // Rows per expert, in token order; experts run in ascending id and add into
  // delta in that order (HF's loop over the hit experts).
  std::vector<std::vector<std::pair<int32_t, float>>> routed(static_cast<size_t>(moe.num_experts));
  for (int32_t r = 0; r < t; ++r)
    for (int32_t i = 0; i < top_k; ++i) {
      const size_t at = static_cast<size_t>(r) * top_k + i;
      routed[static_cast<size_t>(ids[at])].push_back({r, route_weights[at]});
    }
  std::fill(delta, delta + static_cast<int64_t>(t) * hidden, 0.0f);
  std::vector<float> xs, gate, up, out, scratch;
  for (int32_t e = 0; e < moe.num_experts; ++e) {
    const auto& rows = routed[static_cast<size_t>(e)];
    if (rows.empty()) continue;
    const int32_t m = static_cast<int32_t>(rows.size());
    xs.resize(static_cast<size_t>(m) * hidden);
    for (int32_t i = 0; i < m; ++i)
      std::copy_n(x + static_cast<int64_t>(rows[static_cast<size_t>(i)].first) * hidden, hidden,
                  xs.data() + static_cast<int64_t>(i) * hidden);
    gate.resize(static_cast<size_t>(m) * inter);
    up.resize(gate.size());
    out.resize(xs.size());
    const Expert& ex = w.experts[static_cast<size_t>(e)];
    run_linear(ex.gate_proj, xs.data(), m, inter, hidden, gate.data(), &scratch);
    run_linear(ex.up_proj, xs.data(), m, inter, hidden, up.data(), &scratch);
    cpu::silu_mul(gate.data(), up.data(), static_cast<int64_t>(m) * inter, gate.data());
    run_linear(ex.down_proj, gate.data(), m, hidden, inter, out.data(), &scratch);
    for (int32_t i = 0; i < m; ++i) {
      const auto [row, weight] = rows[static_cast<size_t>(i)];
      float* d = delta + static_cast<int64_t>(row) * hidden;
      const float* o = out.data() + static_cast<int64_t>(i) * hidden;
      for (int32_t j = 0; j < hidden; ++j) d[j] += o[j] * weight;
    }
  }
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
  PD_RETURN_IF_ERROR(validate(input));
  const model::ModelConfig& c = config_;
  const int32_t hidden = c.hidden_size;
  const int32_t q_size = c.q_size();
  const int32_t kv_size = c.kv_size();
  const int32_t inter = c.intermediate_size;

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

  std::vector<float> residual(static_cast<size_t>(t) * hidden), x(residual.size()), delta(residual.size());
  std::vector<float> q(static_cast<size_t>(t) * q_size), attn(q.size());
  std::vector<float> k(static_cast<size_t>(t) * kv_size), v(k.size());
  std::vector<float> gate(static_cast<size_t>(t) * inter), up(gate.size());
  std::vector<float> scratch(static_cast<size_t>(std::max(max_keys, 1)));
  std::vector<float> quant_scratch;
  const bool fp8_kv = spec_.dtype == KvDtype::kFp8E4m3;
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));

  cpu::embedding(embed_, hidden, ids, residual.data());
  for (int32_t l = 0; l < c.num_layers; ++l) {
    const LayerPtrs& w = layers_[static_cast<size_t>(l)];
    cpu::rms_norm(residual.data(), w.input_norm, t, hidden, c.rms_norm_eps, x.data());
    run_linear(w.q_proj, x.data(), t, q_size, hidden, q.data(), &quant_scratch);
    run_linear(w.k_proj, x.data(), t, kv_size, hidden, k.data(), &quant_scratch);
    run_linear(w.v_proj, x.data(), t, kv_size, hidden, v.data(), &quant_scratch);
    if (c.qk_norm) {  // per-head RMSNorm over head_dim, before RoPE (HF Qwen3Attention)
      cpu::rms_norm(q.data(), w.q_norm, t * c.num_heads, c.head_dim, c.rms_norm_eps, q.data());
      cpu::rms_norm(k.data(), w.k_norm, t * c.num_kv_heads, c.head_dim, c.rms_norm_eps, k.data());
    }
    cpu::apply_rope(q.data(), t, c.num_heads, c.head_dim, positions.data(), inv_freq_);
    cpu::apply_rope(k.data(), t, c.num_kv_heads, c.head_dim, positions.data(), inv_freq_);

    // KV of earlier positions (prefix hits, remote KV) must be in place before
    // this layer reads the cache.
    if (input.layer_hooks != nullptr) input.layer_hooks->wait_for_layer_load(l);
    if (fp8_kv) {
      uint8_t* kv_layer = kv_fp8_[static_cast<size_t>(l)].get();
      cpu::write_kv_cache_fp8(kv_layer, layout_, k.data(), v.data(), t, slots.data());
      for (const SeqRows& sr : seq_rows) {
        cpu::paged_attention_fp8(q.data() + static_cast<int64_t>(sr.first_row) * q_size, sr.num_rows,
                                 positions.data() + sr.first_row, kv_layer, layout_, sr.seq->block_table, c.num_heads,
                                 scale, attn.data() + static_cast<int64_t>(sr.first_row) * q_size, scratch.data());
      }
    } else {
      float* kv_layer = kv_f32_[static_cast<size_t>(l)].get();
      cpu::write_kv_cache(kv_layer, layout_, k.data(), v.data(), t, slots.data());
      for (const SeqRows& sr : seq_rows) {
        cpu::paged_attention(q.data() + static_cast<int64_t>(sr.first_row) * q_size, sr.num_rows,
                             positions.data() + sr.first_row, kv_layer, layout_, sr.seq->block_table, c.num_heads,
                             scale, attn.data() + static_cast<int64_t>(sr.first_row) * q_size, scratch.data());
      }
    }
    if (input.layer_hooks != nullptr) input.layer_hooks->save_layer(l);

    run_linear(w.o_proj, attn.data(), t, hidden, q_size, delta.data(), &quant_scratch);
    cpu::add_rms_norm(residual.data(), delta.data(), w.post_norm, t, hidden, c.rms_norm_eps, x.data());
    if (w.router != nullptr) {
      run_moe(w, x.data(), t, delta.data());
    } else {
      run_linear(w.gate_proj, x.data(), t, inter, hidden, gate.data(), &quant_scratch);
      run_linear(w.up_proj, x.data(), t, inter, hidden, up.data(), &quant_scratch);
      cpu::silu_mul(gate.data(), up.data(), static_cast<int64_t>(t) * inter, gate.data());
      run_linear(w.down_proj, gate.data(), t, hidden, inter, delta.data(), &quant_scratch);
    }
    for (size_t i = 0; i < residual.size(); ++i) residual[i] += delta[i];
  }

  // Final norm and lm_head only for the rows whose logits are wanted.
  std::vector<int32_t> out_rows;
  if (rows_kind == LogitsRows::kAll) {
    for (int32_t r = 0; r < t; ++r) out_rows.push_back(r);
  } else {
    for (const SeqRows& sr : seq_rows)
      if (sr.seq->sample) out_rows.push_back(sr.first_row + sr.num_rows - 1);
  }
  const int32_t n_out = static_cast<int32_t>(out_rows.size());
  std::vector<float> picked(static_cast<size_t>(n_out) * hidden);
  for (int32_t i = 0; i < n_out; ++i)
    std::copy_n(residual.data() + static_cast<int64_t>(out_rows[static_cast<size_t>(i)]) * hidden, hidden,
                picked.data() + static_cast<int64_t>(i) * hidden);
  cpu::rms_norm(picked.data(), final_norm_, n_out, hidden, c.rms_norm_eps, picked.data());
  std::vector<float> logits(static_cast<size_t>(n_out) * c.vocab_size);
  cpu::matmul(picked.data(), lm_head_, nullptr, n_out, c.vocab_size, hidden, logits.data());
  return logits;
}

Result<StepOutput> CpuModelRunner::execute(const StepInput& input) {
  PD_ASSIGN_OR_RETURN(std::vector<float> logits, forward(input, LogitsRows::kSampled));
  StepOutput out;
  size_t row = 0;
  for (const SeqStep& seq : input.seqs) {
    if (!seq.sample) continue;
    std::span<float> row_logits(logits.data() + row * static_cast<size_t>(config_.vocab_size),
                                static_cast<size_t>(config_.vocab_size));
    out.sampled.push_back(sample_token(row_logits, seq.sampling, seq.rng_seed, seq.suppressed_token_ids));
    ++row;
  }
  return out;
}

}  // namespace pd::engine
