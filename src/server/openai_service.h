// The OpenAI API over one engine: /v1/completions, /v1/chat/completions,
// /v1/models, /tokenize, /detokenize, /health, /metrics, /version; with a P/D
// connector also POST /pd/release (set_transfer_releaser).
//
// Threads: handlers run on their connection's strand (HttpServer). The
// engine calls each request's OutputCallback on the engine thread; the
// callback only posts the output to the connection's strand, so the engine
// thread never blocks on a client and per-request state has one owner.
//
// Invariant: every request this service adds to the engine is either seen to
// finish (final output) or aborted: on client disconnect, on a failed write,
// on the request deadline, and when a later prompt of a batch is refused.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "common/metrics.h"
#include "engine/engine.h"
#include "server/http_server.h"
#include "server/kv_params.h"
#include "server/openai_protocol.h"
#include "server/server_config.h"

namespace pd::tokenizer {
class Tokenizer;
}
namespace pd::grammar {
class GrammarTokenizer;
}

namespace pd::server {

inline constexpr const char* kPdserveVersion = "0.1.0";

class OpenAiService {
 public:
  // engine must outlive the service; tokenizer may be null (token-id prompts only).
  OpenAiService(const ServerConfig& config, engine::Engine& engine,
                std::shared_ptr<const tokenizer::Tokenizer> tokenizer, int32_t max_model_len);

  // POST /pd/release {"transfer_id": "<32 hex digits>"} -> 200 {"transfer_id", "released"}:
  // the P/D producer lets go of that transfer's KV as if its consumer had sent
  // `abort`. The releaser is called on an HTTP thread and must answer (`done`,
  // from any thread, once) without blocking it. Set before register_routes.
  using TransferReleaser = std::function<void(std::string transfer_id, std::function<void(bool released)> done)>;
  void set_transfer_releaser(TransferReleaser releaser) { releaser_ = std::move(releaser); }
  // With a P/D connector: parses a request's kv_transfer_params against this instance (its
  // role, mode, block size, peer policy). Without one they are ignored, as vLLM does.
  void set_kv_params_parser(KvParamsParser parser) { kv_params_parser_ = std::move(parser); }
  // Structured output: the model's tokenizer for llguidance, or null with the reason it is
  // unavailable (then requests that ask for structured output get a 400 saying so).
  void set_grammar(std::shared_ptr<const grammar::GrammarTokenizer> grammar, std::string unavailable_reason);

  void register_routes(HttpServer& server);

  // Generations still writing to a client (shutdown waits for this to reach 0).
  int32_t num_live_generations() const { return num_live_generations_.load(); }
  // Waits until no generation is live or the deadline passes; true when none is.
  bool wait_until_idle(int64_t timeout_ms);

 private:
  struct Generation;
  struct LiveGeneration;  // counts a generation in num_live_generations_ while it lives
  // Why a launched generation ends without every choice's final output.
  struct GenerationFailure {
    ApiError error;         // the answer while nothing was sent yet
    ApiError stream_event;  // the error event that ends a started stream
    // The engine refused the request as the client's mistake (400/409): a stream
    // that has not started answers with error's status instead of starting.
    bool refuses_request = false;
    bool is_timeout = false;  // counted in pd_http_request_timeouts_total when reported
    static GenerationFailure timeout();
    static GenerationFailure launch(const Status& status);              // the engine refused a deferred choice
    static GenerationFailure engine(const engine::RequestOutput& out);  // a choice's final output with kError
  };

  net::awaitable<void> handle_completions(HttpExchange& exchange);
  net::awaitable<void> handle_chat(HttpExchange& exchange);
  net::awaitable<void> handle_tokenize(HttpExchange& exchange);
  net::awaitable<void> handle_detokenize(HttpExchange& exchange);
  net::awaitable<void> handle_models(HttpExchange& exchange);
  net::awaitable<void> handle_release(HttpExchange& exchange);

  // A generation, in order: build_completion / build_chat (the request, its
  // prompts) -> prepare (lengths, kv_transfer_params, ids) -> launch_first_choices
  // -> collect_outputs (launch_siblings, record_output, accumulate or
  // stream_events) -> end_stream or respond. Each step before the launch returns
  // the error that refuses the request; run_generation answers it.
  std::optional<ApiError> build_completion(std::string_view body, Generation& g) const;
  std::optional<ApiError> build_chat(std::string_view body, Generation& g) const;
  net::awaitable<void> run_generation(HttpExchange& exchange, std::shared_ptr<Generation> generation,
                                      std::optional<ApiError> refusal);
  std::optional<ApiError> prepare(Generation& g) const;
  Status launch(const std::shared_ptr<Generation>& generation, size_t i);
  std::optional<ApiError> launch_first_choices(const std::shared_ptr<Generation>& generation);
  void launch_siblings(const std::shared_ptr<Generation>& generation, size_t first);
  void abort_unfinished(const Generation& g);
  net::awaitable<void> collect_outputs(HttpExchange& exchange, std::shared_ptr<Generation> generation);
  static void record_output(Generation& g, size_t index, const engine::RequestOutput& out);
  static void accumulate(Generation& g, size_t index, engine::RequestOutput& out);
  std::string stream_events(Generation& g, size_t index, engine::RequestOutput& out) const;
  void observe_finished_prompts(const Generation& g);
  static Usage usage_of(const Generation& g);
  net::awaitable<void> end_stream(HttpExchange& exchange, Generation& g);
  net::awaitable<void> respond(HttpExchange& exchange, Generation& g);
  ResponseJson response_json(Generation& g) const;
  TokenTextFn text_of(const Generation& g) const;

  std::optional<ApiError> check_model(const std::string& model) const;
  static void truncate_prompt(std::vector<int32_t>& ids, std::optional<int32_t> keep_last);
  std::string echo_text(const std::vector<int32_t>& ids) const;
  static void add_choices(Generation& generation, std::vector<int32_t> prompt, int32_t n,
                          std::optional<std::string> echo);
  // Turns the request's words (bad_words) into token sequences for the engine.
  std::optional<ApiError> prepare_sampling(GenerationFields& fields) const;
  // Compiles the request's structured output (400 naming the field when it is invalid) into
  // one constraint per choice of the generation.
  std::optional<ApiError> prepare_constraints(Generation& generation) const;
  std::string response_model(const std::string& requested) const;
  std::string token_text(int32_t token_id) const;

  const ServerConfig& config_;
  engine::Engine& engine_;
  std::shared_ptr<const tokenizer::Tokenizer> tokenizer_;
  int32_t max_model_len_;
  RequestLimits limits_;
  int64_t created_unix_s_;
  TransferReleaser releaser_;
  KvParamsParser kv_params_parser_;
  std::shared_ptr<const grammar::GrammarTokenizer> grammar_;
  std::string grammar_unavailable_ = "structured output is not configured";

  // vLLM's per-prompt series (a prompt's n choices are one group there).
  metrics::Histogram& max_generation_tokens_;
  metrics::Histogram& params_n_;

  std::atomic<int32_t> num_live_generations_{0};
  std::mutex idle_mutex_;
  std::condition_variable idle_cv_;
};

}  // namespace pd::server
