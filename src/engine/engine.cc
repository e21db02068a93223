#include "engine/engine.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <variant>

#include "common/clock.h"
#include "common/log.h"
#include "common/metrics.h"
#include "engine/output_processor.h"
#include "engine/sampler.h"
#include "engine/scheduler.h"
#include "tokenizer/tokenizer.h"

namespace pd::engine {
namespace {

// Longest idle wait: bounds how stale a missed wakeup can make the loop, and
// how late connector-side timeouts (checked inside poll()) are noticed.
constexpr int64_t kIdleWaitMs = 50;

struct AddMessage {
  std::unique_ptr<Request> request;
  OutputCallback callback;
};
struct AbortMessage {
  std::string request_id;
};
using Message = std::variant<AddMessage, AbortMessage>;

// A counter series follows its owner's count (several engines in one process
// add up, as they share the series).
void advance(metrics::Counter& counter, int64_t now, int64_t before) {
  if (now > before) counter.inc(static_cast<double>(now - before));
}

struct EngineMetrics {
  metrics::Gauge& running;
  metrics::Gauge& waiting;
  metrics::Gauge& blocks_used;
  metrics::Gauge& blocks_free;
  metrics::Counter& prompt_tokens;
  metrics::Counter& generation_tokens;
  metrics::Histogram& ttft;
  metrics::Histogram& itl;
  metrics::Counter& preemptions;
  metrics::Counter& recomputed_tokens;
  metrics::Counter& remote_admissions_deferred;
  metrics::Gauge& waiting_for_remote_kv;
  metrics::Counter& prefix_hit_tokens;

  static EngineMetrics create() {
    auto& r = metrics::Registry::global();
    return EngineMetrics{
        r.gauge("pd_num_requests_running", "Requests in the running set"),
        r.gauge("pd_num_requests_waiting", "Requests waiting to be scheduled (including waiting for remote KV)"),
        r.gauge("pd_kv_blocks_used", "KV blocks referenced by requests or held for transfers"),
        r.gauge("pd_kv_blocks_free", "KV blocks on the free list (including cached, unreferenced ones)"),
        r.counter("pd_prompt_tokens_total", "Prompt tokens of admitted requests"),
        r.counter("pd_generation_tokens_total", "Generated tokens"),
        r.histogram("pd_time_to_first_token_seconds", "Arrival to first generated token"),
        r.histogram("pd_inter_token_latency_seconds", "Time between consecutive generated tokens"),
        r.counter("pd_preemptions_total", "Recompute preemptions"),
        r.counter("pd_recomputed_tokens_total", "Computed or received tokens whose KV a preemption threw away"),
        r.counter("pd_remote_admissions_deferred_total",
                  "P/D requests that waited for the KV reserve before loading their prompt"),
        r.gauge("pd_num_requests_waiting_for_remote_kv", "Requests whose prompt KV is being loaded from a producer"),
        r.counter("pd_prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix cache"),
    };
  }

  void publish(const EngineStats& now, const EngineStats& before) {
    running.set(now.num_running);
    waiting.set(now.num_waiting);
    waiting_for_remote_kv.set(now.num_waiting_for_remote_kv);
    blocks_used.set(now.num_blocks_in_use);
    blocks_free.set(now.num_blocks_free);
    advance(prompt_tokens, now.engine.num_prompt_tokens, before.engine.num_prompt_tokens);
    advance(generation_tokens, now.engine.num_generation_tokens, before.engine.num_generation_tokens);
    advance(preemptions, now.scheduler.num_preemptions, before.scheduler.num_preemptions);
    advance(recomputed_tokens, now.scheduler.num_recomputed_tokens, before.scheduler.num_recomputed_tokens);
    advance(remote_admissions_deferred, now.scheduler.num_remote_admissions_deferred,
            before.scheduler.num_remote_admissions_deferred);
    advance(prefix_hit_tokens, now.scheduler.num_prefix_cache_hit_tokens, before.scheduler.num_prefix_cache_hit_tokens);
  }
};

// The series vLLM exports (names, labels and buckets of its v1 engine), so a
// vLLM dashboard reads a pdserve instance as it is. Labelled with model_name.
struct VllmMetrics {
  metrics::Gauge& running;
  metrics::Gauge& waiting;
  metrics::Gauge& kv_cache_usage;
  metrics::Counter& prompt_tokens;
  metrics::Counter& generation_tokens;
  metrics::Counter& preemptions;
  metrics::Histogram& ttft;
  metrics::Histogram& itl;
  metrics::Histogram& tpot;
  metrics::Histogram& e2e;
  metrics::Histogram& queue;
  metrics::Histogram& prefill;
  metrics::Histogram& decode;
  metrics::Histogram& inference;
  metrics::Histogram& request_tpot;
  metrics::Histogram& request_prompt_tokens;
  metrics::Histogram& request_generation_tokens;
  metrics::Histogram& request_max_tokens;
  // Indexed by FinishReason (kStop .. kError); kNone is never counted.
  std::array<metrics::Counter*, 5> success{};

  static VllmMetrics create(const std::string& model_name, int32_t max_model_len) {
    auto& r = metrics::Registry::global();
    const metrics::Labels labels = {{"model_name", model_name}};
    const std::vector<double> ttft_buckets = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,  0.5,   0.75,
                                              1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
    const std::vector<double> itl_buckets = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
                                             0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
    const std::vector<double> request_buckets = {0.3,  0.5,   0.8,   1.0,   1.5,   2.0,    2.5,
                                                 5.0,  10.0,  15.0,  20.0,  30.0,  40.0,   50.0,
                                                 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
    const std::vector<double> token_buckets = metrics::one_two_five_buckets(max_model_len);
    VllmMetrics m{
        r.gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels),
        r.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels),
        r.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels),
        r.counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.", labels),
        r.counter("vllm:generation_tokens_total", "Number of generation tokens processed.", labels),
        r.counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.", labels),
        r.histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", labels,
                    ttft_buckets),
        r.histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", labels,
                    itl_buckets),
        r.histogram("vllm:time_per_output_token_seconds",
                    "Histogram of time per output token in seconds (the inter-token latency).", labels, itl_buckets),
        r.histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", labels,
                    request_buckets),
        r.histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", labels,
                    request_buckets),
        r.histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                    labels, request_buckets),
        r.histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", labels,
                    request_buckets),
        r.histogram("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
                    labels, request_buckets),
        r.histogram("vllm:request_time_per_output_token_seconds",
                    "Histogram of time_per_output_token_seconds per request.", labels, itl_buckets),
        r.histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", labels, token_buckets),
        r.histogram("vllm:request_generation_tokens", "Number of generation tokens processed.", labels, token_buckets),
        r.histogram("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", labels,
                    token_buckets),
        {},
    };
    for (FinishReason reason :
         {FinishReason::kStop, FinishReason::kLength, FinishReason::kAbort, FinishReason::kError}) {
      metrics::Labels with_reason = labels;
      with_reason.emplace_back("finished_reason", finish_reason_name(reason));
      m.success[static_cast<size_t>(reason)] =
          &r.counter("vllm:request_success_total", "Count of successfully processed requests.", with_reason);
    }
    return m;
  }

  void publish(const EngineStats& now, const EngineStats& before) {
    running.set(now.num_running);
    waiting.set(now.num_waiting);
    kv_cache_usage.set(now.num_blocks_total > 0 ? static_cast<double>(now.num_blocks_in_use) / now.num_blocks_total
                                                : 0.0);
    advance(prompt_tokens, now.engine.num_prompt_tokens, before.engine.num_prompt_tokens);
    advance(generation_tokens, now.engine.num_generation_tokens, before.engine.num_generation_tokens);
    advance(preemptions, now.scheduler.num_preemptions, before.scheduler.num_preemptions);
  }

  // A request's end: latencies of its phases (those it reached) and its sizes.
  void observe_finished(const Request& r, FinishReason reason, int64_t now_ns) {
    auto seconds = [](int64_t from, int64_t to) { return static_cast<double>(to - from) * 1e-9; };
    if (auto* counter = success[static_cast<size_t>(reason)]) counter->inc();
    e2e.observe(seconds(r.arrival_ns(), now_ns));
    if (r.first_scheduled_ns != 0) {
      queue.observe(seconds(r.arrival_ns(), r.first_scheduled_ns));
      if (r.first_token_ns != 0) {
        prefill.observe(seconds(r.first_scheduled_ns, r.first_token_ns));
        decode.observe(seconds(r.first_token_ns, r.last_token_ns));
        inference.observe(seconds(r.first_scheduled_ns, r.last_token_ns));
      }
    }
    if (r.num_output_tokens() > 1)
      request_tpot.observe(seconds(r.first_token_ns, r.last_token_ns) / (r.num_output_tokens() - 1));
    request_prompt_tokens.observe(r.num_prompt_tokens());
    request_generation_tokens.observe(r.num_output_tokens());
    request_max_tokens.observe(r.sampling().max_tokens);
  }
};

// First tokens handed over by a P/D producer, streamed from the thread that
// received them (KvConnector::bind_first_token_sink) while the engine thread may
// be inside a step. The engine thread arms a slot when a consumer request that may
// get a handed-over token arrives: the slot holds a copy of the request as it is
// before any output, its own output state (detokenizer at the end of the prompt)
// and a copy of the callback, so streaming touches nothing the engine thread owns.
// The engine thread closes the slot before it emits anything for that request.
// The mutex guards the map and the slots' state only: the client callback runs
// outside it (one slow client holds up no other request's arm, stream or close),
// and close() waits for a callback of that request still running, so a streamed
// token precedes every later output of its request and is emitted once.
class EarlyFirstTokens {
 public:
  struct Streamed {
    int32_t token_id = 0;
    int64_t at_ns = 0;
  };

  void arm(const Request& request, OutputCallback callback, RequestOutputState output) {
    auto slot = std::make_unique<Slot>(Slot{request, std::move(callback), std::move(output), std::nullopt, false});
    slot->request.constraint.reset();  // the engine thread alone drives a request's constraint
    std::lock_guard lock(mutex_);
    slots_.insert_or_assign(request.request_id(), std::move(slot));
  }

  // Any thread. Streams the token unless the slot is closed or streamed, or the
  // token would finish the request (its final output carries what only the engine
  // thread knows: the finish bookkeeping); the engine thread emits that one itself.
  void stream(const std::string& request_id, int32_t token_id) {
    Slot* slot = nullptr;
    RequestOutput out;
    {
      std::lock_guard lock(mutex_);
      auto it = slots_.find(request_id);
      if (it == slots_.end() || it->second->streamed) return;
      slot = it->second.get();
      slot->request.append_output_token(token_id);
      TokenVerdict verdict = slot->output.on_token(slot->request, token_id);
      if (verdict.finished) {
        slots_.erase(it);  // the engine thread decides and emits it
        return;
      }
      out.request_id = request_id;
      out.num_prompt_tokens = slot->request.num_prompt_tokens();
      out.num_output_tokens = 1;
      out.num_cached_tokens = slot->request.num_prompt_tokens();  // a hand-over computes no prompt token here
      out.new_token_ids.push_back(token_id);
      out.text_delta = std::move(verdict.text_delta);
      slot->streamed = Streamed{token_id, now_ns()};
      slot->in_callback = true;  // close() waits; the slot stays until then
    }
    num_streamed_.fetch_add(1, std::memory_order_relaxed);
    try {
      slot->callback(std::move(out));
    } catch (const std::exception& e) {
      PD_LOG_ERROR("output callback threw while streaming a first token: {}", e.what());
    } catch (...) {
      PD_LOG_ERROR("output callback threw a non-std exception while streaming a first token");
    }
    {
      std::lock_guard lock(mutex_);
      slot->in_callback = false;
    }
    callback_done_.notify_all();
  }

  // Engine thread, before it emits anything for the request (or when it ends):
  // what was streamed, if anything. Later stream() calls do nothing. Waits, as a
  // lock would, for that request's streaming callback if one is running (callbacks
  // must not block: request.h).
  std::optional<Streamed> close(const std::string& request_id) {
    std::unique_lock lock(mutex_);
    auto it = slots_.find(request_id);
    if (it == slots_.end()) return std::nullopt;
    Slot* slot = it->second.get();
    callback_done_.wait(lock, [slot] { return !slot->in_callback; });
    std::optional<Streamed> streamed = slot->streamed;
    slots_.erase(request_id);  // only this thread erases a slot with a stream started
    return streamed;
  }

  int64_t num_streamed() const { return num_streamed_.load(std::memory_order_relaxed); }

 private:
  struct Slot {
    Request request;
    OutputCallback callback;
    RequestOutputState output;
    std::optional<Streamed> streamed;
    bool in_callback = false;
  };
  std::mutex mutex_;
  std::condition_variable callback_done_;
  std::unordered_map<std::string, std::unique_ptr<Slot>> slots_;
  std::atomic<int64_t> num_streamed_{0};
};

class EngineImpl final : public Engine {
 public:
  EngineImpl(EngineConfig config, std::unique_ptr<ModelRunner> runner,
             std::shared_ptr<const tokenizer::Tokenizer> tokenizer, std::unique_ptr<KvConnector> connector,
             SchedulerConfig scheduler_config)
      : config_(std::move(config)),
        runner_(std::move(runner)),
        tokenizer_(std::move(tokenizer)),
        connector_(std::move(connector)),
        kv_spec_(runner_->kv_cache_spec()),
        vocab_size_(runner_->vocab_size()),
        scheduler_(std::move(scheduler_config), connector_.get()),
        metrics_(EngineMetrics::create()),
        vllm_(VllmMetrics::create(config_.model_name, config_.max_model_len)) {
    stats_.num_blocks_total = kv_spec_.num_blocks;
    stats_.num_blocks_free = kv_spec_.num_blocks;
    published_ = stats_;
    if (connector_ != nullptr) {
      connector_->bind_engine_wakeup([this] { wake(); });
      connector_->bind_first_token_sink(
          [this](const std::string& request_id, int32_t token_id) { early_.stream(request_id, token_id); });
    }
    reports_load_ = connector_ != nullptr && connector_->wants_load_reports();
    thread_ = std::thread([this] { run(); });
  }

  ~EngineImpl() override {
    shutdown();
    // The connector may point at the runner: it goes first.
    connector_.reset();
  }

  Status add_request(GenerateRequest request, OutputCallback on_output) override {
    PD_RETURN_IF_ERROR(validate(request));
    const int32_t prompt_len = static_cast<int32_t>(request.prompt_token_ids.size());
    const int32_t max_output = std::min(request.sampling.max_tokens, config_.max_model_len - prompt_len);
    const int32_t blocks_needed = (prompt_len + max_output + kv_spec_.block_size - 1) / kv_spec_.block_size;
    if (blocks_needed > kv_spec_.num_blocks) {
      return invalid_argument("request {} needs up to {} KV blocks ({} prompt + {} output tokens); the cache has {}",
                              request.request_id, blocks_needed, prompt_len, max_output, kv_spec_.num_blocks);
    }
    std::lock_guard lock(mutex_);
    if (stopping_) return unavailable("engine is shut down");
    const size_t num_waiting = num_inbox_adds_ + num_scheduler_waiting_;
    if (num_waiting >= config_.max_waiting_requests) {
      return resource_exhausted("{} requests already waiting (max_waiting_requests {})", num_waiting,
                                config_.max_waiting_requests);
    }
    if (!ids_in_use_.insert(request.request_id).second) {
      return invalid_argument("request id '{}' is already in use", request.request_id);
    }
    const uint64_t seq = next_arrival_seq_++;
    const uint64_t rng_base = request.sampling.seed.has_value()
                                  ? *request.sampling.seed
                                  : derive_rng_seed(config_.seed, static_cast<int32_t>(seq));
    const int64_t arrival = request.arrival_ns != 0 ? request.arrival_ns : now_ns();
    auto r = std::make_unique<Request>(std::move(request.request_id), seq, std::move(request.prompt_token_ids),
                                       std::move(request.sampling), std::move(request.kv_transfer_params), arrival,
                                       rng_base, max_output);
    r->constraint = std::move(request.constraint);
    ++num_inbox_adds_;
    inbox_.emplace_back(AddMessage{std::move(r), std::move(on_output)});
    cv_.notify_one();
    return Status::Ok();
  }

  void abort(const std::string& request_id) override {
    std::lock_guard lock(mutex_);
    if (stopping_) return;
    inbox_.emplace_back(AbortMessage{request_id});
    cv_.notify_one();
  }

  EngineStats stats() const override {
    std::lock_guard lock(stats_mutex_);
    return stats_;
  }
  const EngineConfig& config() const override { return config_; }
  const KvCacheSpec& kv_cache_spec() const override { return kv_spec_; }

  void shutdown() override {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
      cv_.notify_one();
    }
    if (thread_.joinable()) thread_.join();
  }

 private:
  // A live request's output callback and output state, kept on the request
  // (Request::engine_io) from the moment the engine thread takes it in.
  struct LiveIo final : RequestSlot {
    LiveIo(OutputCallback cb, RequestOutputState out) : callback(std::move(cb)), output(std::move(out)) {}
    OutputCallback callback;
    RequestOutputState output;
  };
  static LiveIo* io_of(const Request& r) { return static_cast<LiveIo*>(r.engine_io.get()); }

  Status validate(const GenerateRequest& request) const {
    if (request.request_id.empty()) return invalid_argument("request_id must not be empty");
    if (request.prompt_token_ids.empty()) return invalid_argument("request {}: empty prompt", request.request_id);
    const auto prompt_len = static_cast<int64_t>(request.prompt_token_ids.size());
    if (prompt_len >= config_.max_model_len) {
      return invalid_argument("request {}: prompt has {} tokens; max_model_len {} leaves no room for output",
                              request.request_id, prompt_len, config_.max_model_len);
    }
    for (size_t i = 0; i < request.prompt_token_ids.size(); ++i) {
      const int32_t id = request.prompt_token_ids[i];
      if (id < 0 || id >= vocab_size_) {
        return invalid_argument("request {}: prompt token {} at position {} outside the vocabulary [0, {})",
                                request.request_id, id, i, vocab_size_);
      }
    }
    PD_RETURN_IF_ERROR(request.sampling.validate(vocab_size_).with_context("request " + request.request_id));
    if (!request.sampling.stop.empty() && tokenizer_ == nullptr) {
      return invalid_argument("request {}: stop strings need a tokenizer; this engine has none", request.request_id);
    }
    if (connector_ != nullptr) PD_RETURN_IF_ERROR(connector_->validate_request(request));
    return Status::Ok();
  }

  void wake() {
    std::lock_guard lock(mutex_);
    woken_ = true;
    cv_.notify_one();
  }

  // Delivers one output; a throwing callback is a caller bug that must not kill the engine.
  // A final output goes out after a snapshot that counts it, so a client that
  // has its response reads the request's tokens in /metrics.
  void emit(OutputCallback& callback, RequestOutput output) {
    if (output.finished) publish_snapshot(snapshot());
    try {
      callback(std::move(output));
    } catch (const std::exception& e) {
      PD_LOG_ERROR("output callback threw: {}", e.what());
    } catch (...) {
      PD_LOG_ERROR("output callback threw a non-std exception");
    }
  }

  RequestOutput base_output(const Request& r) const {
    RequestOutput out;
    out.request_id = r.request_id();
    out.num_prompt_tokens = r.num_prompt_tokens();
    out.num_output_tokens = r.num_output_tokens();
    out.num_cached_tokens = r.num_cached_tokens;
    return out;
  }

  // Emits the final output of a request the scheduler has finished.
  void finalize(FinishedRequest finished, std::string text_delta, std::string error, bool invalid_request = false) {
    const Request& r = *finished.request;
    LiveIo* io = io_of(r);
    if (io == nullptr) return;
    early_.close(r.request_id());  // a token streamed before this final output stays before it
    RequestOutput out = base_output(r);
    out.finished = true;
    out.finish_reason = r.finish_reason;
    out.text_delta = std::move(text_delta);
    out.error = std::move(error);
    out.invalid_request = invalid_request;
    out.conflict = finished.conflict;
    out.kv_transfer_params = std::move(finished.decision.kv_transfer_params);
    vllm_.observe_finished(r, r.finish_reason, now_ns());
    OutputCallback callback = std::move(io->callback);
    finished.request->engine_io.reset();
    release_id_if_unused(r.request_id());
    emit(callback, std::move(out));
  }

  void release_id_if_unused(const std::string& id) {
    if (scheduler_.is_id_in_use(id)) return;
    std::lock_guard lock(mutex_);
    ids_in_use_.erase(id);
  }

  // Finishes a live request for a reason other than a sampled token.
  void finish_live(Request& r, RequestState state, FinishReason reason, std::string error,
                   bool invalid_request = false) {
    std::string text;
    LiveIo* io = io_of(r);
    if (io != nullptr && state != RequestState::kFinishedError) text = io->output.flush();
    FinishedRequest f = scheduler_.finish_request(r, state, reason);
    finalize(std::move(f), std::move(text), std::move(error), invalid_request);
  }

  void handle_message(Message& message) {
    if (auto* add = std::get_if<AddMessage>(&message)) {
      Request& r = *add->request;
      const std::string id = r.request_id();
      // A P/D consumer request may get its first token handed over (kv_connector.h);
      // without logprobs, since the producer sends none. Producers never do.
      if (connector_ != nullptr && r.kv_transfer_params() &&
          r.kv_transfer_params()->side == contract::TransferSide::kConsumer && r.sampling().logprobs < 0) {
        early_.arm(r, add->callback, RequestOutputState(tokenizer_, r, config_.eos_token_ids, config_.max_model_len));
      }
      RequestOutputState output(tokenizer_, r, config_.eos_token_ids, config_.max_model_len);
      counters_.num_prompt_tokens += r.num_prompt_tokens();
      Status s = scheduler_.add_request(std::move(add->request));
      if (!s.ok()) {
        // Cannot happen while ids_in_use_ mirrors the scheduler; answered, not crashed.
        RequestOutput out;
        out.request_id = id;
        out.finished = true;
        out.finish_reason = FinishReason::kError;
        out.error = s.message();
        early_.close(id);
        emit(add->callback, std::move(out));
        return;
      }
      // The scheduler owns the request now; its output state goes with it.
      scheduler_.find(id)->engine_io = std::make_unique<LiveIo>(std::move(add->callback), std::move(output));
      return;
    }
    const auto& abort_msg = std::get<AbortMessage>(message);
    if (Request* r = scheduler_.find(abort_msg.request_id)) {
      finish_live(*r, RequestState::kFinishedAborted, FinishReason::kAbort, "");
    }
  }

  void fail_all_live(RequestState state, FinishReason reason, const std::string& error) {
    for (Request* r : scheduler_.live_requests()) finish_live(*r, state, reason, error);
  }

  void poll_connector(std::unordered_set<std::string>* moved_back) {
    if (connector_ == nullptr) return;
    ConnectorEvents events = connector_->poll();
    for (const FailedRequest& failed : events.failed_requests) {
      if (Request* r = scheduler_.find(failed.request_id)) {
        finish_live(*r, RequestState::kFinishedError, FinishReason::kError, failed.message, failed.invalid_request);
      }
    }
    std::unordered_set<std::string> moved = scheduler_.apply_load_errors(events.load_errors);
    const std::vector<Scheduler::HandedOver> handed_over = scheduler_.apply_connector_events(events);
    for (const auto& id : events.finished_sending) release_id_if_unused(id);
    for (const auto& id : events.finished_recving) release_id_if_unused(id);
    if (moved_back != nullptr) *moved_back = std::move(moved);
    // First-token hand-over: the producer's token is this request's first
    // output, emitted now; its next step is a decode.
    const int64_t now = now_ns();
    for (const Scheduler::HandedOver& h : handed_over) {
      SampledToken token;
      token.token_id = h.token_id;
      process_token(*h.request, token, now);
    }
    counters_.num_handed_over_tokens += static_cast<int64_t>(handed_over.size());
    counters_.num_handed_over_tokens_ignored += static_cast<int64_t>(events.first_tokens.size() - handed_over.size());
  }

  void run() {
    while (true) {
      std::deque<Message> batch;
      bool stop = false;
      {
        std::unique_lock lock(mutex_);
        batch.swap(inbox_);
        // These adds join the scheduler's queue now: they stay counted (as waiting,
        // until the count below is exact again), or a long step would let the bound
        // admit another max_waiting_requests on top of them.
        num_scheduler_waiting_ += num_inbox_adds_;
        num_inbox_adds_ = 0;
        stop = stopping_;
        woken_ = false;
      }
      for (Message& m : batch) handle_message(m);
      if (!batch.empty()) publish_snapshot(snapshot());  // admitted prompts count before their first token
      batch.clear();
      if (stop) {
        fail_all_live(RequestState::kFinishedAborted, FinishReason::kAbort, "");
        break;
      }
      // Deadlines are checked against a time read before the poll: a first token
      // streamed before its deadline (bind_first_token_sink) is either in this
      // poll's events or streamed after this time, so its request is never expired.
      const int64_t before_poll = now_ns();
      poll_connector(nullptr);
      for (FinishedRequest& f : scheduler_.expire_remote_kv_waits(before_poll)) {
        std::string error = f.error;
        finalize(std::move(f), "", std::move(error));
      }

      std::vector<FinishedRequest> failed;
      StepPlan plan = scheduler_.schedule(&failed);
      for (FinishedRequest& f : failed) {
        std::string error = f.error;
        finalize(std::move(f), "", std::move(error));
      }
      if (plan.empty()) {
        publish_stats();
        wait_idle();
        continue;
      }
      publish_num_waiting();  // exact again before a step of unknown length
      execute_step(plan);
      publish_stats();
    }
    publish_stats();
  }

  void wait_idle() {
    std::unique_lock lock(mutex_);
    auto deadline = SteadyClock::now() + std::chrono::milliseconds(kIdleWaitMs);
    if (auto remote = scheduler_.next_remote_kv_deadline_ns()) {
      const auto at = SteadyClock::time_point(std::chrono::nanoseconds(*remote));
      deadline = std::min(deadline, at);
    }
    cv_.wait_until(lock, deadline, [this] { return !inbox_.empty() || stopping_ || woken_; });
  }

  void execute_step(const StepPlan& plan) {
    StepInput input = scheduler_.build_step_input(plan);
    attach_token_history(plan, input);
    attach_allowed_token_masks(plan, input);
    const int64_t step_start = now_ns();
    for (const ScheduledSeq& s : plan.seqs)
      if (s.request->first_scheduled_ns == 0) s.request->first_scheduled_ns = step_start;
    if (connector_ != nullptr) input.layer_hooks = connector_->build_step_hooks(input, plan);
    Result<StepOutput> result = runner_->execute(input);
    int32_t num_samples = 0;
    for (const SeqStep& s : input.seqs) num_samples += s.sample;
    Status status = result.status();
    if (status.ok() && static_cast<int32_t>(result->sampled.size()) != num_samples) {
      status = internal_error("runner returned {} sampled tokens for {} sampling sequences", result->sampled.size(),
                              num_samples);
    }
    if (status.ok()) status = check_prompt_logprobs(input, result->prompt_logprobs);
    if (connector_ != nullptr) connector_->after_step(plan, status);
    ++counters_.num_steps;
    if (!status.ok()) {
      ++counters_.num_step_errors;
      PD_LOG_ERROR("model step failed; failing its {} requests: {}", plan.seqs.size(), status.to_string());
      for (const ScheduledSeq& s : plan.seqs) {
        finish_live(*s.request, RequestState::kFinishedError, FinishReason::kError,
                    "model execution failed: " + status.message());
      }
      return;
    }
    std::unordered_set<std::string> moved_back;
    poll_connector(&moved_back);
    scheduler_.complete_step(plan, moved_back);

    store_prompt_logprobs(plan, moved_back, result->prompt_logprobs);
    const int64_t now = now_ns();
    size_t sample_index = 0;
    for (const ScheduledSeq& s : plan.seqs) {
      if (!s.sample) continue;
      SampledToken& token = result->sampled[sample_index++];
      Request& r = *s.request;
      if (moved_back.contains(r.request_id())) continue;  // sampled on KV that failed to load
      process_token(r, token, now);
    }
  }

  // The runner returned exactly the prompt logprobs rows the step asked for.
  static Status check_prompt_logprobs(const StepInput& input, const std::vector<PromptLogprobsChunk>& chunks) {
    size_t next = 0;
    for (size_t i = 0; i < input.seqs.size(); ++i) {
      const int32_t wanted = num_prompt_logprob_rows(input.seqs[i]);
      if (wanted == 0) continue;
      if (next >= chunks.size() || chunks[next].seq_index != static_cast<int32_t>(i) ||
          chunks[next].first_position != input.seqs[i].num_computed_tokens ||
          static_cast<int32_t>(chunks[next].rows.size()) != wanted) {
        return internal_error("runner did not return the {} prompt logprobs rows of step sequence {}", wanted, i);
      }
      ++next;
    }
    if (next != chunks.size())
      return internal_error("runner returned {} unrequested prompt logprobs chunks", chunks.size() - next);
    return Status::Ok();
  }

  // Keeps each request's prompt logprobs rows until its first token goes out.
  static void store_prompt_logprobs(const StepPlan& plan, const std::unordered_set<std::string>& moved_back,
                                    std::vector<PromptLogprobsChunk>& chunks) {
    for (PromptLogprobsChunk& chunk : chunks) {
      if (chunk.seq_index < 0 || static_cast<size_t>(chunk.seq_index) >= plan.seqs.size()) continue;
      Request& r = *plan.seqs[static_cast<size_t>(chunk.seq_index)].request;
      if (moved_back.contains(r.request_id()) || r.num_output_tokens() > 0) continue;
      const auto num_entries = static_cast<size_t>(r.num_prompt_tokens() - 1);
      r.prompt_logprobs.resize(num_entries);
      for (size_t i = 0; i < chunk.rows.size(); ++i) {
        const size_t position = static_cast<size_t>(chunk.first_position) + i;
        if (position >= num_entries) break;
        PromptPositionLogprobs& row = chunk.rows[i];
        PromptTokenLogprob& entry = r.prompt_logprobs[position];
        entry.token_id = row.token_id;
        entry.logprob = row.logprob;
        entry.rank = row.rank;
        entry.top.clear();
        entry.top.reserve(row.top_logprobs.size());
        for (const auto& [id, value] : row.top_logprobs) entry.top.push_back(TopLogprob{id, value});
      }
    }
  }

  // Penalties and bad words read the tokens a request has seen; the views
  // stay valid through execute() (requests live until their outputs are processed).
  static void attach_token_history(const StepPlan& plan, StepInput& input) {
    for (size_t i = 0; i < plan.seqs.size() && i < input.seqs.size(); ++i) {
      SeqStep& step = input.seqs[i];
      if (!step.sample || !step.sampling.has_logits_processing()) continue;
      const Request& r = *plan.seqs[i].request;
      step.prompt_token_ids = std::span<const int32_t>(r.token_ids()).first(static_cast<size_t>(r.num_prompt_tokens()));
      step.output_token_ids = r.output_token_ids();
    }
  }

  // Structured output: each constrained row's mask, computed before the step (a step without
  // constrained rows pays one null check per row). A mask that fails leaves
  // the row unconstrained and the request ends with that error when its token comes back.
  void attach_allowed_token_masks(const StepPlan& plan, StepInput& input) {
    const size_t num_words = (static_cast<size_t>(vocab_size_) + 31) / 32;
    for (size_t i = 0; i < plan.seqs.size() && i < input.seqs.size(); ++i) {
      SeqStep& step = input.seqs[i];
      Request& r = *plan.seqs[i].request;
      if (!step.sample || r.constraint == nullptr || !r.constraint_error.empty()) continue;
      r.allowed_token_mask.resize(num_words);
      Status status = r.constraint->fill_allowed_mask(r.allowed_token_mask);
      if (!status.ok()) {
        r.constraint_error = status.message();
        continue;
      }
      step.allowed_token_mask = r.allowed_token_mask;
    }
  }

  // Advances a constrained request past its new token (sampled or handed over); false when
  // the request ended with an error instead.
  bool advance_constraint(Request& r, int32_t token_id) {
    Status status =
        r.constraint_error.empty() ? r.constraint->consume_token(token_id) : invalid_argument("{}", r.constraint_error);
    if (status.ok()) return true;
    finish_live(r, RequestState::kFinishedError, FinishReason::kError, status.message());
    return false;
  }

  void process_token(Request& r, SampledToken& token, int64_t now) {
    LiveIo& io = *io_of(r);
    // A handed-over first token may have been streamed already: it is taken here
    // as usual, not emitted again, and its arrival is the first-token time.
    std::optional<EarlyFirstTokens::Streamed> streamed;
    if (r.num_output_tokens() == 0) streamed = early_.close(r.request_id());
    if (streamed) {
      if (streamed->token_id != token.token_id) {
        finish_live(r, RequestState::kFinishedError, FinishReason::kError,
                    fmt::format("first token {} was streamed, the engine took {}", streamed->token_id, token.token_id));
        return;
      }
      now = streamed->at_ns;
    }
    if (token.token_id < 0 || token.token_id >= vocab_size_) {
      finish_live(r, RequestState::kFinishedError, FinishReason::kError,
                  fmt::format("runner sampled token {} outside the vocabulary [0, {})", token.token_id, vocab_size_));
      return;
    }
    if (r.constraint != nullptr && !advance_constraint(r, token.token_id)) return;
    scheduler_.append_token(r, token.token_id);
    if (connector_ != nullptr && r.num_output_tokens() == 1) connector_->first_token_sampled(r, token.token_id);
    ++counters_.num_generation_tokens;
    if (r.first_token_ns == 0) {
      r.first_token_ns = now;
      const double ttft = static_cast<double>(now - r.arrival_ns()) * 1e-9;
      metrics_.ttft.observe(ttft);
      vllm_.ttft.observe(ttft);
    } else {
      const double itl = static_cast<double>(now - r.last_token_ns) * 1e-9;
      metrics_.itl.observe(itl);
      vllm_.itl.observe(itl);
      vllm_.tpot.observe(itl);
    }
    r.last_token_ns = now;

    TokenVerdict verdict = io.output.on_token(r, token.token_id);
    if (!verdict.finished && r.constraint != nullptr && r.constraint->is_finished()) {
      // The grammar is complete and allows only the end: the output ends here, as it would
      // with the EOS that is all the mask still allows (vLLM samples it; this saves the step).
      verdict.text_delta += io.output.flush();
      verdict.finished = true;
      verdict.final_state = RequestState::kFinishedStopped;
      verdict.reason = FinishReason::kStop;
    }
    RequestOutput out = base_output(r);
    out.new_token_ids.push_back(token.token_id);
    out.text_delta = std::move(verdict.text_delta);
    if (r.sampling().logprobs >= 0) {
      TokenLogprob lp{token.token_id, token.logprob, {}};
      lp.top.reserve(token.top_logprobs.size());
      for (const auto& [id, value] : token.top_logprobs) lp.top.push_back(TopLogprob{id, value});
      out.logprobs.push_back(std::move(lp));
    }
    if (r.num_output_tokens() == 1 && r.sampling().prompt_logprobs >= 0)
      out.prompt_logprobs = std::move(r.prompt_logprobs);
    if (streamed) {
      // The client has this token and its text already.
      out.new_token_ids.clear();
      out.text_delta.clear();
    }
    if (!verdict.finished) {
      if (!streamed) emit(io.callback, std::move(out));
      return;
    }
    FinishedRequest f = scheduler_.finish_request(r, verdict.final_state, verdict.reason);
    vllm_.observe_finished(r, verdict.reason, now);
    out.finished = true;
    out.finish_reason = verdict.reason;
    out.stop_string = std::move(verdict.stop_string);
    out.stop_token_id = verdict.stop_token_id;
    out.kv_transfer_params = std::move(f.decision.kv_transfer_params);
    OutputCallback callback = std::move(io.callback);
    f.request->engine_io.reset();
    release_id_if_unused(f.request->request_id());
    emit(callback, std::move(out));
  }

  // The admission bound's view of the scheduler's queue (add_request).
  void publish_num_waiting() {
    const auto num_waiting = static_cast<size_t>(scheduler_.num_waiting());
    std::lock_guard lock(mutex_);
    num_scheduler_waiting_ = num_waiting;
  }

  EngineStats snapshot() const {
    const BlockPool& pool = scheduler_.block_pool();
    EngineStats s;
    s.num_running = scheduler_.num_running();
    s.num_waiting = scheduler_.num_waiting();
    s.num_waiting_for_remote_kv = scheduler_.num_remote_waiting();
    s.num_blocks_total = pool.num_blocks();
    s.num_blocks_free = pool.num_free_blocks();
    s.num_blocks_in_use = pool.num_used_blocks();
    s.scheduler = scheduler_.counters();
    s.engine = counters_;
    s.num_first_tokens_streamed_on_arrival = early_.num_streamed();
    return s;
  }

  // The snapshot becomes what stats() returns and what /metrics shows: gauges
  // are set, counters advance by what their owners counted since the last one.
  void publish_snapshot(const EngineStats& s) {
    metrics_.publish(s, published_);
    vllm_.publish(s, published_);
    published_ = s;
    std::lock_guard lock(stats_mutex_);
    stats_ = s;
  }

  // End of an engine-thread iteration: the snapshot, the admission bound and
  // (with a connector that wants them) the load report.
  void publish_stats() {
    const EngineStats s = snapshot();
    publish_snapshot(s);
    {
      std::lock_guard lock(mutex_);
      num_scheduler_waiting_ = static_cast<size_t>(s.num_waiting);
    }
    if (reports_load_) {
      EngineLoad load;
      load.num_running = s.num_running;
      load.num_waiting = s.num_waiting;
      load.num_kv_blocks_free = s.num_blocks_free;
      load.num_kv_blocks_total = s.num_blocks_total;
      load.num_queued_prefill_tokens = scheduler_.num_queued_prefill_tokens();
      load.block_size = kv_spec_.block_size;
      connector_->report_load(load, scheduler_.take_cache_events());
    }
  }

  const EngineConfig config_;
  std::unique_ptr<ModelRunner> runner_;
  std::shared_ptr<const tokenizer::Tokenizer> tokenizer_;
  std::unique_ptr<KvConnector> connector_;
  const KvCacheSpec kv_spec_;
  const int32_t vocab_size_;

  // Shared with the connector's threads (its own mutex).
  EarlyFirstTokens early_;

  // Engine thread only.
  // Owns every live Request, and with it each one's LiveIo (Request::engine_io).
  Scheduler scheduler_;
  EngineCounters counters_;
  EngineStats published_;      // the last snapshot the metrics were written from
  bool reports_load_ = false;  // set before the thread starts
  EngineMetrics metrics_;
  VllmMetrics vllm_;

  // Shared with caller threads, under mutex_.
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Message> inbox_;
  bool stopping_ = false;
  bool woken_ = false;
  uint64_t next_arrival_seq_ = 0;
  // Admission bound (max_waiting_requests): adds not yet drained plus the
  // scheduler's waiting count, published by the engine thread before each step
  // and after each iteration; drained adds count as waiting until then.
  size_t num_inbox_adds_ = 0;
  size_t num_scheduler_waiting_ = 0;
  // Ids of live requests and of block holds: a new request may not reuse them.
  std::unordered_set<std::string> ids_in_use_;

  mutable std::mutex stats_mutex_;
  EngineStats stats_;

  std::thread thread_;  // last: starts after everything above is built
};

}  // namespace

Result<std::unique_ptr<Engine>> Engine::create(EngineConfig config, std::unique_ptr<ModelRunner> runner,
                                               std::shared_ptr<const tokenizer::Tokenizer> tokenizer) {
  return create(std::move(config), std::move(runner), std::move(tokenizer), nullptr);
}

Result<std::unique_ptr<Engine>> Engine::create(EngineConfig config, std::unique_ptr<ModelRunner> runner,
                                               std::shared_ptr<const tokenizer::Tokenizer> tokenizer,
                                               std::unique_ptr<KvConnector> connector) {
  if (runner == nullptr) return invalid_argument("engine needs a model runner");
  const KvCacheSpec& spec = runner->kv_cache_spec();
  if (spec.block_size <= 0 || spec.num_blocks <= 0) {
    return invalid_argument("KV cache spec needs block_size > 0 and num_blocks > 0, got {} and {}", spec.block_size,
                            spec.num_blocks);
  }
  if (runner->vocab_size() <= 0) return invalid_argument("runner reports vocab size {}", runner->vocab_size());
  if (config.max_num_seqs < 1) return invalid_argument("max_num_seqs must be >= 1, got {}", config.max_num_seqs);
  if (config.max_model_len < 2) return invalid_argument("max_model_len must be >= 2, got {}", config.max_model_len);
  if (config.max_num_batched_tokens < 1) {
    return invalid_argument("max_num_batched_tokens must be >= 1, got {}", config.max_num_batched_tokens);
  }
  if (!config.enable_chunked_prefill && config.max_num_batched_tokens < config.max_model_len) {
    return invalid_argument(
        "without chunked prefill max_num_batched_tokens ({}) must be >= max_model_len ({}) or long prompts never run",
        config.max_num_batched_tokens, config.max_model_len);
  }
  if (!(config.kv_watermark >= 0.0 && config.kv_watermark < 1.0)) {
    return invalid_argument("kv_watermark must be in [0, 1), got {}", config.kv_watermark);
  }
  if (!(config.remote_output_reserve <= 1.0)) {
    return invalid_argument("remote_output_reserve must be <= 1 (negative: none), got {}",
                            config.remote_output_reserve);
  }
  if (config.eos_token_ids.empty() && tokenizer != nullptr && tokenizer->eos_token_id().has_value()) {
    config.eos_token_ids.push_back(*tokenizer->eos_token_id());
  }
  SchedulerConfig sc;
  sc.max_num_seqs = config.max_num_seqs;
  sc.max_num_batched_tokens = config.max_num_batched_tokens;
  sc.max_model_len = config.max_model_len;
  sc.block_size = spec.block_size;
  sc.num_blocks = spec.num_blocks;
  sc.enable_prefix_caching = config.enable_prefix_caching;
  sc.enable_chunked_prefill = config.enable_chunked_prefill;
  sc.eos_token_ids = config.eos_token_ids;
  sc.remote_output_reserve = config.remote_output_reserve;
  sc.kv_watermark = config.kv_watermark;
  sc.record_cache_events = connector != nullptr && connector->wants_load_reports() && config.enable_prefix_caching;
  return std::unique_ptr<Engine>(std::make_unique<EngineImpl>(
      std::move(config), std::move(runner), std::move(tokenizer), std::move(connector), std::move(sc)));
}

}  // namespace pd::engine
