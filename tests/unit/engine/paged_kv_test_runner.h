// A test ModelRunner whose output depends on the paged KV cache exactly the
// way a transformer's does: each computed token's id and position are written
// into its KV slot (through the block table, in a real buffer laid out as
// model_runner.h specifies), and the next token is a function of the token
// ids READ BACK from the cache for the whole context. A wrong block table, a
// wrong prefix hit or a block freed too early changes the output, which the
// tests compare against the same function on the true sequence.
#pragma once

#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <span>
#include <vector>

#include "engine/model_runner.h"
#include "engine/sampler.h"

namespace pd::engine::testing {

inline uint64_t context_hash(std::span<const int32_t> tokens) {
  uint64_t h = 1469598103934665603ull;
  for (int32_t t : tokens) h = (h ^ static_cast<uint32_t>(t)) * 1099511628211ull;
  return h;
}

// Logits of the reference "model": a pseudo-random row seeded by the context
// hash, with one clear winner so greedy decoding is a pure function of the
// context. Shared by the runner and by the tests' reference computation.
inline std::vector<float> reference_logits(std::span<const int32_t> context, int32_t vocab_size) {
  std::vector<float> logits(static_cast<size_t>(vocab_size));
  uint64_t x = context_hash(context);
  for (int32_t i = 0; i < vocab_size; ++i) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    logits[static_cast<size_t>(i)] = static_cast<float>((x >> 40) % 1000) / 250.0f;  // [0, 4)
  }
  logits[static_cast<size_t>(context_hash(context) % static_cast<uint64_t>(vocab_size))] += 6.0f;
  return logits;
}

class PagedKvTestRunner : public ModelRunner {
 public:
  // Optional override of the logits, still computed from the context read back.
  using LogitsFn = std::function<std::vector<float>(std::span<const int32_t> context, int32_t vocab_size)>;

  PagedKvTestRunner(int32_t num_blocks, int32_t block_size, int32_t vocab_size, LogitsFn logits_fn = nullptr)
      : vocab_size_(vocab_size), logits_fn_(std::move(logits_fn)) {
    spec_.num_layers = 2;
    spec_.num_kv_heads = 1;
    spec_.head_dim = 2;
    spec_.block_size = block_size;
    spec_.dtype = KvDtype::kFloat32;
    spec_.num_blocks = num_blocks;
    for (auto& layer : kv_) layer.assign(spec_.bytes_per_layer() / sizeof(float), -1.0f);
  }

  const KvCacheSpec& kv_cache_spec() const override { return spec_; }
  int32_t vocab_size() const override { return vocab_size_; }
  void* kv_layer_base(int32_t layer) override { return kv_[static_cast<size_t>(layer)].data(); }
  bool kv_on_device() const override { return false; }

  // The step with this index (0-based) fails with kInternal.
  void fail_step(int64_t step_index) { fail_step_ = step_index; }
  // Blocks execute() until release() (bounded by a deadline), for queue tests.
  void hold_steps() {
    std::lock_guard lock(mutex_);
    held_ = true;
  }
  // The step with this index blocks until release(): a deterministic
  // "mid-generation" point for abort tests.
  // Moving the hold to a later step lets a step held at an earlier one go on.
  void hold_at_step(int64_t step_index) {
    std::lock_guard lock(mutex_);
    hold_at_step_ = step_index;
    cv_.notify_all();
  }
  // Waits (bounded) until execute() sits in a hold; false on timeout.
  bool wait_blocked() {
    std::unique_lock lock(mutex_);
    return cv_.wait_for(lock, std::chrono::seconds(20), [this] { return blocked_ && (held_ || hold_at_step_ >= 0); });
  }
  // Waits (bounded) until the step with this index (0-based) sits in a hold; false on timeout.
  bool wait_blocked_in_step(int64_t step_index) {
    std::unique_lock lock(mutex_);
    return cv_.wait_for(lock, std::chrono::seconds(20),
                        [&] { return blocked_ && num_steps_.load() == step_index && (held_ || hold_at_step_ >= 0); });
  }
  void release() {
    std::lock_guard lock(mutex_);
    held_ = false;
    hold_at_step_ = -1;
    cv_.notify_all();
  }
  int64_t num_steps() const { return num_steps_.load(); }
  int64_t num_kv_mismatches() const { return num_kv_mismatches_.load(); }

  Result<StepOutput> execute(const StepInput& input) override {
    const int64_t step = num_steps_.load();
    {
      std::unique_lock lock(mutex_);
      blocked_ = true;
      cv_.notify_all();
      cv_.wait_for(lock, std::chrono::seconds(20), [&] { return !held_ && hold_at_step_ != step; });
      blocked_ = false;
    }
    ++num_steps_;
    if (step == fail_step_) return internal_error("injected failure at step {}", step);
    // Like a transformer layer: write every sequence's new KV, then attend.
    for (int32_t layer = 0; layer < spec_.num_layers; ++layer) {
      if (input.layer_hooks != nullptr) input.layer_hooks->wait_for_layer_load(layer);
      for (const SeqStep& seq : input.seqs) {
        for (int32_t j = 0; j < seq.num_new_tokens; ++j) {
          const int32_t pos = seq.num_computed_tokens + j;
          float* slot = kv_slot(layer, seq.block_table, pos, /*value=*/false);
          if (slot == nullptr) return internal_error("position {} outside the block table", pos);
          slot[0] = static_cast<float>(input.token_ids[static_cast<size_t>(seq.token_offset + j)]);
          slot[1] = static_cast<float>(pos);
          float* v = kv_slot(layer, seq.block_table, pos, /*value=*/true);
          v[0] = slot[0] + static_cast<float>(layer);
          v[1] = slot[1];
        }
      }
      if (input.layer_hooks != nullptr) input.layer_hooks->save_layer(layer);
    }
    StepOutput out;
    for (size_t s = 0; s < input.seqs.size(); ++s) {
      const SeqStep& seq = input.seqs[s];
      // Prompt logprobs: each asked-for position's logits from its context read back.
      const int32_t num_prompt_rows = drop_prompt_logprobs_ ? 0 : num_prompt_logprob_rows(seq);
      if (num_prompt_rows > 0) {
        PromptLogprobsChunk chunk{static_cast<int32_t>(s), seq.num_computed_tokens, {}};
        for (int32_t r = 0; r < num_prompt_rows; ++r) {
          const int32_t pos = seq.num_computed_tokens + r;
          PD_ASSIGN_OR_RETURN(std::vector<float> logits, logits_at(seq, pos + 1));
          chunk.rows.push_back(prompt_position_logprobs(logits, seq.prompt_token_ids[static_cast<size_t>(pos) + 1],
                                                        seq.prompt_logprobs));
        }
        out.prompt_logprobs.push_back(std::move(chunk));
      }
      if (!seq.sample) continue;
      PD_ASSIGN_OR_RETURN(std::vector<float> logits, logits_at(seq, seq.num_computed_tokens + seq.num_new_tokens));
      out.sampled.push_back(sample_step_token(logits, seq));
    }
    return out;
  }

  // The runner leaves out every prompt logprobs row (a runner bug the engine must catch).
  void drop_prompt_logprobs() { drop_prompt_logprobs_ = true; }

 private:
  float* kv_slot(int32_t layer, const std::vector<int32_t>& block_table, int32_t pos, bool value) {
    const size_t block_index = static_cast<size_t>(pos / spec_.block_size);
    if (block_index >= block_table.size()) return nullptr;
    const int32_t block = block_table[block_index];
    if (block < 0 || block >= spec_.num_blocks) return nullptr;
    const size_t per_token = static_cast<size_t>(spec_.num_kv_heads * spec_.head_dim);
    const size_t per_block = 2 * static_cast<size_t>(spec_.block_size) * per_token;
    const size_t offset = static_cast<size_t>(block) * per_block + (value ? 1 : 0) * spec_.block_size * per_token +
                          static_cast<size_t>(pos % spec_.block_size) * per_token;
    return kv_[static_cast<size_t>(layer)].data() + offset;
  }

  // Logits after the first context_len positions of seq, their ids read back from the cache.
  Result<std::vector<float>> logits_at(const SeqStep& seq, int32_t context_len) {
    std::vector<int32_t> context;
    context.reserve(static_cast<size_t>(context_len));
    for (int32_t pos = 0; pos < context_len; ++pos) {
      const float* k = kv_slot(spec_.num_layers - 1, seq.block_table, pos, false);
      if (k == nullptr) return internal_error("position {} outside the block table", pos);
      if (k[1] != static_cast<float>(pos)) ++num_kv_mismatches_;
      context.push_back(static_cast<int32_t>(k[0]));
    }
    return logits_fn_ ? logits_fn_(context, vocab_size_) : reference_logits(context, vocab_size_);
  }

  KvCacheSpec spec_;
  int32_t vocab_size_;
  bool drop_prompt_logprobs_ = false;
  LogitsFn logits_fn_;
  std::vector<float> kv_[2];
  int64_t fail_step_ = -1;
  std::atomic<int64_t> num_steps_{0};
  std::atomic<int64_t> num_kv_mismatches_{0};
  std::mutex mutex_;
  std::condition_variable cv_;
  bool held_ = false;
  int64_t hold_at_step_ = -1;
  bool blocked_ = false;
};

// The true output of greedy decoding on the plain sequence.
inline std::vector<int32_t> reference_greedy(std::vector<int32_t> tokens, int32_t max_tokens, int32_t vocab_size) {
  std::vector<int32_t> out;
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  for (int32_t i = 0; i < max_tokens; ++i) {
    std::vector<float> logits = reference_logits(tokens, vocab_size);
    out.push_back(sample_token(logits, greedy, 0, {}).token_id);
    tokens.push_back(out.back());
  }
  return out;
}

}  // namespace pd::engine::testing
