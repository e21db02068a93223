#include "server/openai_service.h"

#include <fmt/format.h>
#include <boost/asio/post.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

#include <algorithm>
#include <chrono>
#include <deque>
#include <random>

#include "common/clock.h"
#include "common/log.h"
#include "common/metrics.h"
#include "contract/transfer_params.h"
#include "grammar/constraint.h"
#include "server/tool_calls.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

// g++ 12 at -O2 flags Asio's awaitable frame (allocated by its own operator
// new, freed by its matching operator delete) as mismatched: a known false
// positive of -Wmismatched-new-delete with coroutine frames.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

namespace pd::server {

using nlohmann::json;
using ojson = nlohmann::ordered_json;
using boost::system::error_code;

namespace {

// 128 random bits as hex: request ids must be unique among live requests and
// must not be guessable from outside.
std::string random_hex_id() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return fmt::format("{:016x}{:016x}", rng(), rng());
}

metrics::Counter& disconnects_counter() {
  static metrics::Counter& counter = metrics::Registry::global().counter(
      "pd_http_client_disconnects_total", "Generations aborted because the client went away mid-request");
  return counter;
}

metrics::Counter& timeouts_counter() {
  static metrics::Counter& counter = metrics::Registry::global().counter("pd_http_request_timeouts_total",
                                                                         "Generations aborted at --request-timeout-ms");
  return counter;
}

template <typename T>
ApiError take_error(Parsed<T>& parsed) {
  return std::get<ApiError>(std::move(parsed));
}

}  // namespace

// One HTTP generation request: one engine request per prompt (choice).
// Lives on the connection's strand; the engine reaches it only via post().
struct OpenAiService::LiveGeneration {
  explicit LiveGeneration(OpenAiService& s) : service(s) { service.num_live_generations_.fetch_add(1); }
  ~LiveGeneration() {
    std::lock_guard lock(service.idle_mutex_);
    if (service.num_live_generations_.fetch_sub(1) == 1) service.idle_cv_.notify_all();
  }
  LiveGeneration(const LiveGeneration&) = delete;
  LiveGeneration& operator=(const LiveGeneration&) = delete;
  OpenAiService& service;
};

struct OpenAiService::Generation {
  enum class Api { kCompletion, kChat };

  struct Choice {
    std::string request_id;
    std::vector<int32_t> prompt;
    int32_t sample_index = 0;         // j of the prompt's n choices: seeded with seed + j
    bool counts_prompt = true;        // usage counts a prompt once, not once per choice
    bool deferred = false;            // waits for its prompt's first choice to fill the prefix cache
    std::optional<std::string> echo;  // completions with echo: the prompt's text, sent first
    int32_t max_tokens = 0;
    bool finished = false;
    bool sent_role = false;  // chat streams open each choice with the role
    std::string text;
    std::vector<engine::TokenLogprob> logprobs;
    // Its prompt's logprobs (prompt_logprobs): computed by the prompt's first choice only.
    std::vector<engine::PromptTokenLogprob> prompt_logprobs;
    std::vector<int32_t> token_ids;  // return_token_ids
    int64_t text_offset = 0;
    engine::FinishReason finish_reason = engine::FinishReason::kNone;
    ResponseJson stop_reason;
    int32_t num_prompt_tokens = 0;
    int32_t num_output_tokens = 0;
    std::optional<contract::ProducerAnswer> kv_transfer_params;  // a P/D producer's, with the final output
    std::optional<GenerationFailure> failure;                    // the engine failed this choice
    std::optional<ToolCallStreamParser> tool_parser;             // chat streams that parse tool calls
    std::shared_ptr<engine::TokenConstraint> constraint;         // structured output; handed to the engine
    std::optional<ForcedToolCallStream> forced_tool_stream;      // chat streams with tool_choice required / named
  };
  struct Pending {
    size_t index;
    engine::RequestOutput output;
  };

  explicit Generation(const ConnectionExecutor& connection) : executor(connection), wake(connection) {}

  ConnectionExecutor executor;
  Api api = Api::kCompletion;
  ToolCallFormat tool_format = ToolCallFormat::kNone;                    // chat with tool_choice "auto"
  ChatRequest::ForcedTool forced_tool = ChatRequest::ForcedTool::kNone;  // chat with tool_choice required / named
  std::string forced_tool_name;
  GenerationFields fields;
  ResponseHeader header;
  std::optional<contract::TransferParams> transfer_params;  // every choice's (one prompt's transfer)
  std::vector<Choice> choices;
  size_t num_finished = 0;
  std::optional<GenerationFailure> failure;  // ends the generation
  bool stream_started = false;               // the stream's 200 went out

  std::deque<Pending> pending;  // outputs posted by the engine, not yet handled
  bool client_gone = false;
  net::steady_timer wake;  // cancelled whenever pending or client_gone changes
};

OpenAiService::OpenAiService(const ServerConfig& config, engine::Engine& engine,
                             std::shared_ptr<const tokenizer::Tokenizer> tokenizer, int32_t max_model_len)
    : config_(config),
      engine_(engine),
      tokenizer_(std::move(tokenizer)),
      max_model_len_(max_model_len),
      created_unix_s_(unix_seconds()),
      max_generation_tokens_(metrics::Registry::global().histogram(
          "vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
          {{"model_name", config.primary_model_name()}}, metrics::one_two_five_buckets(max_model_len))),
      params_n_(metrics::Registry::global().histogram("vllm:request_params_n", "Histogram of the n request parameter.",
                                                      {{"model_name", config.primary_model_name()}},
                                                      {1, 2, 5, 10, 20})) {
  limits_.max_model_len = max_model_len;
}

bool OpenAiService::wait_until_idle(int64_t timeout_ms) {
  std::unique_lock lock(idle_mutex_);
  return idle_cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                           [this] { return num_live_generations_.load() == 0; });
}

std::optional<ApiError> OpenAiService::check_model(const std::string& model) const {
  if (model.empty() || config_.serves_model(model)) return std::nullopt;
  return model_not_found(model);
}

std::string OpenAiService::response_model(const std::string& requested) const {
  return requested.empty() ? config_.primary_model_name() : requested;
}

std::string OpenAiService::token_text(int32_t token_id) const {
  if (!tokenizer_) return fmt::format("token_id:{}", token_id);
  int32_t ids[1] = {token_id};
  return tokenizer_->decode(ids, /*skip_special_tokens=*/false);
}

void OpenAiService::register_routes(HttpServer& server) {
  auto bind = [this](net::awaitable<void> (OpenAiService::*method)(HttpExchange&)) {
    return [this, method](HttpExchange& exchange) { return (this->*method)(exchange); };
  };
  server.route(http::verb::post, "/v1/completions", bind(&OpenAiService::handle_completions), true);
  server.route(http::verb::post, "/v1/chat/completions", bind(&OpenAiService::handle_chat), true);
  server.route(http::verb::get, "/v1/models", bind(&OpenAiService::handle_models), true);
  server.route(http::verb::post, "/tokenize", bind(&OpenAiService::handle_tokenize), true);
  server.route(http::verb::post, "/detokenize", bind(&OpenAiService::handle_detokenize), true);
  if (releaser_) server.route(http::verb::post, "/pd/release", bind(&OpenAiService::handle_release), true);
  server.route(http::verb::get, "/health", [](HttpExchange& exchange) -> net::awaitable<void> {
    co_await exchange.respond(http::status::ok, "", "text/plain");
  });
  server.route(http::verb::get, "/metrics", [](HttpExchange& exchange) -> net::awaitable<void> {
    std::string text = metrics::Registry::global().render_prometheus();
    co_await exchange.respond(http::status::ok, std::move(text), "text/plain; version=0.0.4; charset=utf-8");
  });
  server.route(http::verb::get, "/version", [](HttpExchange& exchange) -> net::awaitable<void> {
    json body = json::object();
    body["version"] = kPdserveVersion;
    co_await exchange.respond_json(http::status::ok, body);
  });
}

namespace {

json models_json(const std::vector<std::string>& names, const std::string& root, int64_t created,
                 int32_t max_model_len) {
  json data = json::array();
  for (const auto& name : names) {
    data.push_back({{"id", name},
                    {"object", "model"},
                    {"created", created},
                    {"owned_by", "pdserve"},
                    {"root", root},
                    {"parent", nullptr},
                    {"max_model_len", max_model_len}});
  }
  return {{"object", "list"}, {"data", std::move(data)}};
}

}  // namespace

net::awaitable<void> OpenAiService::handle_models(HttpExchange& exchange) {
  std::vector<std::string> names = config_.served_model_names;
  if (names.empty()) names.push_back(config_.model);
  json body = models_json(names, config_.model, created_unix_s_, max_model_len_);
  co_await exchange.respond_json(http::status::ok, body);
}

namespace {

// The body of POST /pd/release: exactly {"transfer_id": "<32 hex digits>"}.
Parsed<std::string> parse_release_body(const ojson& body) {
  for (const auto& [key, value] : body.items()) {
    if (key != "transfer_id") return bad_request(fmt::format("unknown field '{}'", key), key);
  }
  auto it = body.find("transfer_id");
  if (it == body.end() || !it->is_string()) return bad_request("transfer_id (a string) is required", "transfer_id");
  const std::string& id = it->get_ref<const std::string&>();
  if (!contract::is_transfer_id(id)) return bad_request("transfer_id must be 32 hex digits", "transfer_id");
  return id;
}

// How long POST /pd/release waits for the engine thread to take the release.
constexpr int64_t kReleaseAnswerTimeoutMs = 10'000;

}  // namespace

net::awaitable<void> OpenAiService::handle_release(HttpExchange& exchange) {
  auto body = parse_json_object(exchange.request().body(), limits_.max_json_depth);
  if (failed(body)) {
    ApiError error = take_error(body);
    co_await exchange.respond_error(error);
    co_return;
  }
  auto id = parse_release_body(std::get<ojson>(body));
  if (failed(id)) {
    ApiError error = take_error(id);
    co_await exchange.respond_error(error);
    co_return;
  }
  const std::string transfer_id = std::get<std::string>(std::move(id));
  // The engine thread answers through a post to this connection's strand.
  struct Answer {
    explicit Answer(const ConnectionExecutor& executor) : wake(executor) {}
    net::steady_timer wake;
    std::optional<bool> released;
  };
  auto answer = std::make_shared<Answer>(exchange.executor());
  auto executor = exchange.executor();
  answer->wake.expires_after(std::chrono::milliseconds(kReleaseAnswerTimeoutMs));
  releaser_(transfer_id, [answer, executor](bool released) {
    net::post(executor, [answer, released] {
      answer->released = released;
      answer->wake.cancel();
    });
  });
  if (!answer->released) {
    error_code ec;
    co_await answer->wake.async_wait(net::redirect_error(net::use_awaitable, ec));
  }
  if (!answer->released) {
    ApiError error{503, "the engine did not take the release in time; retry", "service_unavailable", "", "unavailable"};
    co_await exchange.respond_error(error);
    co_return;
  }
  json out = {{"transfer_id", transfer_id}, {"released", *answer->released}};
  co_await exchange.respond_json(http::status::ok, out);
}

namespace {

// Everything a generation handler does before talking to the engine, kept
// out of coroutines (plain functions are easier for g++ 12 and for tests).
Parsed<std::vector<int32_t>> tokenize_text(const tokenizer::Tokenizer* tokenizer, const std::string& text,
                                           bool add_special_tokens) {
  if (!tokenizer) return bad_request("this model has no tokenizer: send the prompt as token ids", "prompt");
  return tokenizer->encode(text, add_special_tokens);
}

Parsed<std::string> render_chat(const tokenizer::Tokenizer* tokenizer, const ojson& messages,
                                bool add_generation_prompt, const ojson& tools, const ojson& kwargs) {
  if (!tokenizer) return bad_request("this model has no tokenizer, so chat is unavailable", "messages");
  if (!tokenizer->has_chat_template())
    return bad_request("this model's tokenizer has no chat template; use /v1/completions", "messages");
  auto rendered = tokenizer->apply_chat_template_ordered(messages, add_generation_prompt, tools, kwargs);
  if (!rendered.ok()) return api_error_from_status(rendered.status(), "messages");
  return std::move(rendered).value();
}

}  // namespace

void OpenAiService::truncate_prompt(std::vector<int32_t>& ids, std::optional<int32_t> keep_last) {
  if (keep_last && ids.size() > static_cast<size_t>(*keep_last))
    ids.erase(ids.begin(), ids.end() - static_cast<std::ptrdiff_t>(*keep_last));
}

std::string OpenAiService::echo_text(const std::vector<int32_t>& ids) const {
  if (!tokenizer_) return {};
  return tokenizer_->decode(ids, /*skip_special_tokens=*/false);
}

void OpenAiService::add_choices(Generation& generation, std::vector<int32_t> prompt, int32_t n,
                                std::optional<std::string> echo) {
  for (int32_t j = 0; j < n; ++j) {
    Generation::Choice choice;
    choice.prompt = prompt;
    choice.sample_index = j;
    choice.counts_prompt = j == 0;
    choice.echo = echo;
    generation.choices.push_back(std::move(choice));
  }
}

// bad_words are words: each is banned as its own tokens and, as vLLM does, as
// the tokens of " word" when that spelling starts with a different token of
// the same count (the word in the middle of a text).
std::optional<ApiError> OpenAiService::prepare_sampling(GenerationFields& fields) const {
  if (fields.bad_words.empty()) return std::nullopt;
  if (!tokenizer_) return unsupported("'bad_words' needs a tokenizer; this model has none", "bad_words");
  for (const std::string& word : fields.bad_words) {
    const std::string bare = word.substr(word.find_first_not_of(" \t\n\r"));
    std::vector<int32_t> plain = tokenizer_->encode(bare, /*add_special_tokens=*/false);
    std::vector<int32_t> spaced = tokenizer_->encode(" " + bare, /*add_special_tokens=*/false);
    if (plain.empty()) continue;
    const bool add_spaced = !spaced.empty() && spaced.size() == plain.size() && spaced.front() != plain.front();
    fields.sampling.bad_words_token_ids.push_back(std::move(plain));
    if (add_spaced) fields.sampling.bad_words_token_ids.push_back(std::move(spaced));
  }
  return std::nullopt;
}

void OpenAiService::set_grammar(std::shared_ptr<const grammar::GrammarTokenizer> grammar,
                                std::string unavailable_reason) {
  grammar_ = std::move(grammar);
  grammar_unavailable_ = std::move(unavailable_reason);
}

namespace {

// llguidance's JSON options ("x-guidance" in the schema): the request's whitespace wishes.
grammar::ConstraintSpec with_json_whitespace(grammar::ConstraintSpec spec, const GenerationFields& fields) {
  if (!fields.json_compact_whitespace && !fields.json_whitespace_pattern) return spec;
  ojson schema = ojson::parse(spec.source);
  ojson& options = schema["x-guidance"];
  if (!options.is_object()) options = ojson::object();
  // Defaults, as vLLM passes them: options the schema sets itself win.
  if (fields.json_compact_whitespace && !options.contains("whitespace_flexible"))
    options["whitespace_flexible"] = false;
  if (fields.json_whitespace_pattern && !options.contains("whitespace_pattern"))
    options["whitespace_pattern"] = *fields.json_whitespace_pattern;
  spec.source = schema.dump();
  return spec;
}

grammar::ConstraintSpec constraint_spec(const StructuredOutput& wanted, const GenerationFields& fields) {
  switch (wanted.kind) {
    case StructuredOutput::Kind::kJsonObject:
      return with_json_whitespace(grammar::json_object_constraint(), fields);
    case StructuredOutput::Kind::kChoice:
      return grammar::choice_constraint(wanted.choices);
    case StructuredOutput::Kind::kRegex:
      return grammar::ConstraintSpec{grammar::ConstraintKind::kRegex, wanted.source};
    case StructuredOutput::Kind::kGrammar:
      return grammar::ConstraintSpec{grammar::ConstraintKind::kLark, wanted.source};
    case StructuredOutput::Kind::kJsonSchema:
      break;
  }
  return with_json_whitespace(grammar::ConstraintSpec{grammar::ConstraintKind::kJsonSchema, wanted.source}, fields);
}

}  // namespace

// Compiled here, at the edge: an invalid constraint is the client's 400 before any engine
// work, and the engine thread never compiles a grammar. Choice 0 compiles; the others copy it.
std::optional<ApiError> OpenAiService::prepare_constraints(Generation& generation) const {
  const std::optional<StructuredOutput>& wanted = generation.fields.structured_output;
  if (!wanted) return std::nullopt;
  if (grammar_ == nullptr) {
    return unsupported(fmt::format("structured output is unavailable on this server: {}", grammar_unavailable_),
                       wanted->field);
  }
  const grammar::ConstraintSpec spec = constraint_spec(*wanted, generation.fields);
  auto first = grammar_->new_matcher(spec);
  if (!first.ok()) return bad_request(fmt::format("'{}': {}", wanted->field, first.status().message()), wanted->field);
  generation.fields.sampling.constraint_digest = grammar::constraint_digest(spec);
  std::unique_ptr<grammar::Matcher> matcher = std::move(first).value();
  for (size_t i = 1; i < generation.choices.size(); ++i) {
    auto copy = matcher->clone();
    if (!copy.ok()) return internal(copy.status().message());
    generation.choices[i].constraint = std::move(copy).value();
  }
  if (!generation.choices.empty()) generation.choices.front().constraint = std::move(matcher);
  return std::nullopt;
}

// The completion request's generation (its prompts tokenized), or the error that refuses it.
std::optional<ApiError> OpenAiService::build_completion(std::string_view body, Generation& g) const {
  auto json_body = parse_json_object(body, limits_.max_json_depth);
  if (failed(json_body)) return take_error(json_body);
  auto parsed = parse_completion_request(std::get<ojson>(json_body), limits_);
  if (failed(parsed)) return take_error(parsed);
  auto& request = std::get<CompletionRequest>(parsed);
  if (auto error = check_model(request.fields.model)) return error;
  g.api = Generation::Api::kCompletion;
  for (auto& prompt : request.prompts) {
    std::vector<int32_t> ids;
    if (prompt.text) {
      auto tokenized = tokenize_text(tokenizer_.get(), *prompt.text, request.add_special_tokens);
      if (failed(tokenized)) return take_error(tokenized);
      ids = std::get<std::vector<int32_t>>(std::move(tokenized));
    } else {
      ids = std::move(prompt.token_ids);
    }
    truncate_prompt(ids, request.fields.truncate_prompt_tokens);
    std::optional<std::string> echo;
    if (request.echo) echo = prompt.text && !request.fields.truncate_prompt_tokens ? *prompt.text : echo_text(ids);
    add_choices(g, std::move(ids), request.fields.n, std::move(echo));
  }
  if (auto error = prepare_sampling(request.fields)) return error;
  g.fields = std::move(request.fields);
  return prepare_constraints(g);
}

// The chat request's generation (its messages rendered and tokenized), or the error that refuses it.
std::optional<ApiError> OpenAiService::build_chat(std::string_view body, Generation& g) const {
  auto json_body = parse_json_object(body, limits_.max_json_depth);
  if (failed(json_body)) return take_error(json_body);
  auto parsed = parse_chat_request(std::get<ojson>(json_body), limits_);
  if (failed(parsed)) return take_error(parsed);
  auto& request = std::get<ChatRequest>(parsed);
  if (auto error = check_model(request.fields.model)) return error;
  auto text = render_chat(tokenizer_.get(), request.messages, request.add_generation_prompt, request.tools,
                          request.chat_template_kwargs);
  if (failed(text)) return take_error(text);
  // The template already writes any BOS it wants (add_special_tokens defaults to false).
  auto ids = tokenize_text(tokenizer_.get(), std::get<std::string>(text), request.add_special_tokens);
  if (failed(ids)) return take_error(ids);
  g.api = Generation::Api::kChat;
  g.forced_tool = request.forced_tool;
  g.forced_tool_name = request.forced_tool_name;
  if (request.parse_tool_calls) {
    g.tool_format = tool_call_format_for_template(tokenizer_->chat_template()->source());
    if (g.tool_format == ToolCallFormat::kNone) {
      return unsupported(
          "this model's chat template asks for no tool-call format this server parses (Hermes "
          "<tool_call> blocks or Llama 3 JSON); send 'tool_choice' \"none\" to only show the tools",
          "tools");
    }
  }
  auto prompt = std::get<std::vector<int32_t>>(std::move(ids));
  truncate_prompt(prompt, request.fields.truncate_prompt_tokens);
  add_choices(g, std::move(prompt), request.fields.n, std::nullopt);
  if (auto error = prepare_sampling(request.fields)) return error;
  g.fields = std::move(request.fields);
  return prepare_constraints(g);
}

net::awaitable<void> OpenAiService::handle_completions(HttpExchange& exchange) {
  auto generation = std::make_shared<Generation>(exchange.executor());
  std::optional<ApiError> refusal = build_completion(exchange.request().body(), *generation);
  co_await run_generation(exchange, std::move(generation), std::move(refusal));
}

net::awaitable<void> OpenAiService::handle_chat(HttpExchange& exchange) {
  auto generation = std::make_shared<Generation>(exchange.executor());
  std::optional<ApiError> refusal = build_chat(exchange.request().body(), *generation);
  co_await run_generation(exchange, std::move(generation), std::move(refusal));
}

namespace {

// Stream chunks and final responses, built outside coroutines.
ResponseJson logprobs_for(bool chat, const std::vector<engine::TokenLogprob>& logprobs, const TokenTextFn& token_text,
                          int64_t& text_offset) {
  if (chat) return chat_logprobs_json(logprobs, token_text);
  return completion_logprobs_json(logprobs, token_text, text_offset);
}

ResponseJson chat_role_delta() {
  return {{"role", "assistant"}, {"content", ""}};
}

// The engine refused a choice's launch (its message names the field: prompt ids, stop ids, lengths).
ApiError launch_error(const Status& status) {
  ApiError error = api_error_from_status(status);
  if (status.code() == ErrorCode::kResourceExhausted)
    error.message = "the engine's queue is full; retry later (" + status.message() + ")";
  return error;
}

}  // namespace

// The one way a generation that was launched fails, as the ApiError its client sees.
OpenAiService::GenerationFailure OpenAiService::GenerationFailure::timeout() {
  GenerationFailure failure;
  failure.error = request_timeout("request exceeded --request-timeout-ms");
  failure.stream_event = failure.error;
  failure.is_timeout = true;
  return failure;
}

OpenAiService::GenerationFailure OpenAiService::GenerationFailure::launch(const Status& status) {
  GenerationFailure failure;
  failure.error = launch_error(status);
  failure.stream_event = internal(failure.error.message);
  return failure;
}

OpenAiService::GenerationFailure OpenAiService::GenerationFailure::engine(const engine::RequestOutput& out) {
  std::string message = out.error.empty() ? "the engine failed this request" : out.error;
  GenerationFailure failure;
  failure.error = out.conflict          ? conflict(message, "kv_transfer_params")
                  : out.invalid_request ? bad_request(message, "kv_transfer_params")
                                        : internal(message);
  failure.stream_event = internal(std::move(message));
  failure.refuses_request = out.conflict || out.invalid_request;
  return failure;
}

TokenTextFn OpenAiService::text_of(const Generation& g) const {
  return [this, as_ids = g.fields.return_tokens_as_token_ids](int32_t id) {
    return as_ids ? fmt::format("token_id:{}", id) : token_text(id);
  };
}

std::optional<ApiError> OpenAiService::prepare(Generation& g) const {
  const bool chat = g.api == Generation::Api::kChat;
  const int32_t default_max_tokens = chat ? max_model_len_ : 16;
  // Every choice's length is resolved before any is added, so a bad prompt in a
  // batch refuses the whole request without engine work.
  for (auto& choice : g.choices) {
    auto max_tokens = resolve_max_tokens(static_cast<int32_t>(choice.prompt.size()), g.fields.max_tokens,
                                         default_max_tokens, max_model_len_);
    if (failed(max_tokens)) return take_error(max_tokens);
    choice.max_tokens = std::get<int32_t>(max_tokens);
  }
  // kv_transfer_params name one prompt's transfer (the parser refused them with more prompts or
  // choices): parsed here, once, into the typed params the engine and the connector carry.
  const int32_t num_first_prompt_tokens = g.choices.empty() ? 0 : static_cast<int32_t>(g.choices.front().prompt.size());
  auto kv_params = parse_kv_params(g.fields.kv_transfer_params, num_first_prompt_tokens, kv_params_parser_);
  if (failed(kv_params)) return take_error(kv_params);
  g.transfer_params = std::get<0>(std::move(kv_params));
  const std::string base_id = g.fields.request_id ? *g.fields.request_id : random_hex_id();
  g.header = ResponseHeader{(chat ? "chatcmpl-" : "cmpl-") + base_id, unix_seconds(), response_model(g.fields.model)};
  return std::nullopt;
}

Status OpenAiService::launch(const std::shared_ptr<Generation>& generation, size_t i) {
  Generation& g = *generation;
  auto& choice = g.choices[i];
  engine::GenerateRequest request;
  request.request_id = g.choices.size() == 1 ? g.header.id : fmt::format("{}-{}", g.header.id, i);
  request.prompt_token_ids = choice.prompt;
  request.sampling = g.fields.sampling;
  request.sampling.max_tokens = choice.max_tokens;
  // vLLM's parallel sampling: choice j of a prompt draws from seed + j.
  if (request.sampling.seed) *request.sampling.seed += static_cast<uint64_t>(choice.sample_index);
  // The siblings share the first choice's prompt logprobs (and so may read its prompt from the prefix cache).
  if (choice.sample_index > 0) request.sampling.prompt_logprobs = -1;
  request.kv_transfer_params = g.transfer_params;
  request.constraint = std::move(choice.constraint);
  request.arrival_ns = now_ns();
  std::string id = request.request_id;
  Status status =
      engine_.add_request(std::move(request), [generation, i, executor = g.executor](engine::RequestOutput output) {
        // Engine thread: hand over and return; the strand does the rest.
        net::post(executor, [generation, i, output = std::move(output)]() mutable {
          generation->pending.push_back(Generation::Pending{i, std::move(output)});
          generation->wake.cancel();
        });
      });
  if (status.ok()) choice.request_id = std::move(id);
  return status;
}

// n > 1: a prompt's first choice goes first and its siblings once it has
// produced its first output (launch_siblings). A block enters the prefix cache
// after the step that wrote its KV, so the siblings then find the prompt's full
// blocks cached and compute only the rest. A prompt without a full block shares
// nothing: its choices all go at once.
std::optional<ApiError> OpenAiService::launch_first_choices(const std::shared_ptr<Generation>& generation) {
  Generation& g = *generation;
  const auto block_size = static_cast<size_t>(engine_.kv_cache_spec().block_size);
  for (auto& choice : g.choices) choice.deferred = choice.sample_index > 0 && choice.prompt.size() > block_size;
  for (size_t i = 0; i < g.choices.size(); ++i) {
    if (g.choices[i].deferred) continue;
    Status status = launch(generation, i);
    if (!status.ok()) {
      abort_unfinished(g);
      return launch_error(status);
    }
  }
  return std::nullopt;
}

// A sibling the engine refuses ends the generation (the first refusal is its failure).
void OpenAiService::launch_siblings(const std::shared_ptr<Generation>& generation, size_t first) {
  Generation& g = *generation;
  for (size_t k = first + 1; k < g.choices.size() && g.choices[k].sample_index > 0; ++k) {
    auto& sibling = g.choices[k];
    if (!sibling.deferred) continue;
    sibling.deferred = false;
    Status status = launch(generation, k);
    if (status.ok()) continue;
    sibling.finished = true;
    ++g.num_finished;
    if (!g.failure) g.failure = GenerationFailure::launch(status);
  }
}

void OpenAiService::abort_unfinished(const Generation& g) {
  for (const auto& choice : g.choices)
    if (!choice.request_id.empty() && !choice.finished) engine_.abort(choice.request_id);
}

// What an engine output says about its choice, streamed or not.
void OpenAiService::record_output(Generation& g, size_t index, const engine::RequestOutput& out) {
  auto& choice = g.choices[index];
  choice.num_prompt_tokens = out.num_prompt_tokens;
  choice.num_output_tokens = out.num_output_tokens;
  if (!out.finished) return;
  choice.finished = true;
  ++g.num_finished;
  choice.finish_reason = out.finish_reason;
  choice.stop_reason = stop_reason_json(out.stop_string, out.stop_token_id);
  choice.kv_transfer_params = out.kv_transfer_params;
  if (out.finish_reason == engine::FinishReason::kError) choice.failure = GenerationFailure::engine(out);
}

// A non-streamed choice keeps its text, tokens and logprobs for the response.
void OpenAiService::accumulate(Generation& g, size_t index, engine::RequestOutput& out) {
  auto& choice = g.choices[index];
  if (choice.echo) {
    choice.text = std::move(*choice.echo) + choice.text;
    choice.echo.reset();
  }
  choice.text += out.text_delta;
  if (g.fields.return_token_ids)
    choice.token_ids.insert(choice.token_ids.end(), out.new_token_ids.begin(), out.new_token_ids.end());
  if (g.fields.sampling.logprobs >= 0)
    choice.logprobs.insert(choice.logprobs.end(), out.logprobs.begin(), out.logprobs.end());
  if (!out.prompt_logprobs.empty()) choice.prompt_logprobs = std::move(out.prompt_logprobs);
}

// The SSE events one output of a streamed choice sends (empty: nothing to send yet).
std::string OpenAiService::stream_events(Generation& g, size_t index, engine::RequestOutput& out) const {
  const bool chat = g.api == Generation::Api::kChat;
  auto& choice = g.choices[index];
  ResponseJson logprobs = nullptr;
  if (g.fields.sampling.logprobs >= 0 && !out.logprobs.empty())
    logprobs = logprobs_for(chat, out.logprobs, text_of(g), choice.text_offset);
  std::string events;
  if (chat && !choice.sent_role) {
    choice.sent_role = true;
    events +=
        sse_event(chat_chunk(g.header, static_cast<int32_t>(index), chat_role_delta(), nullptr, nullptr, nullptr));
  }
  // Without a tokenizer there is never text: each step's tokens still get their chunk,
  // or a streaming client would see nothing until the end (and measure TTFT as e2e).
  const bool untokenized_tokens = !tokenizer_ && !out.new_token_ids.empty();
  if (choice.echo) {
    out.text_delta = std::move(*choice.echo) + out.text_delta;
    choice.echo.reset();
  }
  const bool listed_tokens = g.fields.return_token_ids && !out.new_token_ids.empty();
  // Chat: the delta object; with a tool-call parser, text it holds back
  // (a possible "<tool_call>") is not sent yet.
  ResponseJson delta = ResponseJson::object();
  bool tool_calls_finish = false;
  if (chat && g.forced_tool != ChatRequest::ForcedTool::kNone) {
    if (!choice.forced_tool_stream)
      choice.forced_tool_stream.emplace(g.forced_tool, g.forced_tool_name, random_tool_call_id);
    ToolCallStreamDelta parsed = choice.forced_tool_stream->feed(out.text_delta, out.finished);
    tool_calls_finish = out.finished && choice.forced_tool_stream->finishes_with_tool_calls();
    delta = tool_call_stream_delta_json(parsed);
  } else if (chat && g.tool_format != ToolCallFormat::kNone) {
    if (!choice.tool_parser) choice.tool_parser.emplace(g.tool_format, random_tool_call_id);
    ToolCallStreamDelta parsed = choice.tool_parser->feed(out.text_delta);
    if (out.finished) {
      ToolCallStreamDelta tail = choice.tool_parser->finish();
      parsed.content += tail.content;
      parsed.calls.insert(parsed.calls.end(), tail.calls.begin(), tail.calls.end());
      tool_calls_finish = choice.tool_parser->num_calls() > 0;
    }
    delta = tool_call_stream_delta_json(parsed);
  } else if (chat && !out.text_delta.empty()) {
    delta["content"] = out.text_delta;
  }
  const bool has_text = chat ? !delta.empty() : !out.text_delta.empty();
  if (!has_text && logprobs.is_null() && !out.finished && !untokenized_tokens && !listed_tokens) return events;
  ResponseJson finish = !out.finished       ? ResponseJson(nullptr)
                        : tool_calls_finish ? ResponseJson("tool_calls")
                                            : finish_reason_json(choice.finish_reason);
  ResponseJson stop = out.finished ? choice.stop_reason : ResponseJson(nullptr);
  ResponseJson chunk = chat ? chat_chunk(g.header, static_cast<int32_t>(index), std::move(delta), std::move(logprobs),
                                         std::move(finish), std::move(stop))
                            : completion_chunk(g.header, static_cast<int32_t>(index), out.text_delta,
                                               std::move(logprobs), std::move(finish), std::move(stop));
  if (out.finished && choice.kv_transfer_params)
    chunk["kv_transfer_params"] = kv_params_json(*choice.kv_transfer_params);
  if (g.fields.return_token_ids) chunk["choices"][0]["token_ids"] = out.new_token_ids;
  // vLLM's continuous usage: each chunk carries its choice's counts so far.
  if (g.fields.include_usage && g.fields.continuous_usage_stats)
    chunk["usage"] = usage_json(Usage{choice.num_prompt_tokens, choice.num_output_tokens, 0});
  events += sse_event(chunk);
  return events;
}

// Until every choice finished, the client went away or the generation failed
// (deadline --request-timeout-ms, a sibling refused, a streamed choice failed;
// a non-streamed choice's failure waits for the others).
net::awaitable<void> OpenAiService::collect_outputs(HttpExchange& exchange, std::shared_ptr<Generation> generation) {
  Generation& g = *generation;
  const auto deadline = SteadyClock::now() + std::chrono::milliseconds(config_.request_timeout_ms);
  while (g.num_finished < g.choices.size() && !g.client_gone && !g.failure) {
    if (g.pending.empty()) {
      g.wake.expires_at(deadline);
      error_code ec;
      co_await g.wake.async_wait(net::redirect_error(net::use_awaitable, ec));
      if (!ec && g.pending.empty() && !g.client_gone) g.failure = GenerationFailure::timeout();
      continue;
    }
    Generation::Pending item = std::move(g.pending.front());
    g.pending.pop_front();
    auto& choice = g.choices[item.index];
    if (choice.sample_index == 0) launch_siblings(generation, item.index);
    if (g.failure) break;
    if (choice.finished) continue;
    record_output(g, item.index, item.output);
    if (!g.fields.stream) {
      accumulate(g, item.index, item.output);
      continue;
    }
    if (choice.failure) {
      g.failure = choice.failure;
      break;
    }
    const std::string events = stream_events(g, item.index, item.output);
    if (events.empty()) continue;
    // A stream's 200 goes out with its first event, not before: an error that
    // comes first (a P/D producer refusing the request's kv_transfer_params) can
    // still be answered with its own status.
    if (!g.stream_started) {
      g.stream_started = true;
      if (!co_await exchange.start_event_stream()) {
        g.client_gone = true;
        break;
      }
    }
    if (!co_await exchange.send_event(events)) g.client_gone = true;
  }
  // A non-streamed response reports its first failed choice.
  for (const auto& choice : g.choices) {
    if (g.failure) break;
    if (choice.failure) g.failure = choice.failure;
  }
}

// Each prompt's group of n choices, once all of them finished (vLLM's per-prompt series).
void OpenAiService::observe_finished_prompts(const Generation& g) {
  const auto n = static_cast<size_t>(g.fields.n);
  for (size_t first = 0; first < g.choices.size(); first += n) {
    int32_t max_tokens = 0;
    bool all_finished = true;
    for (size_t k = first; k < std::min(g.choices.size(), first + n); ++k) {
      all_finished = all_finished && g.choices[k].finished;
      max_tokens = std::max(max_tokens, g.choices[k].num_output_tokens);
    }
    if (!all_finished) continue;
    max_generation_tokens_.observe(max_tokens);
    params_n_.observe(g.fields.n);
  }
}

Usage OpenAiService::usage_of(const Generation& g) {
  Usage usage;
  for (const auto& choice : g.choices) {
    if (choice.counts_prompt) usage.prompt_tokens += choice.num_prompt_tokens;
    usage.completion_tokens += choice.num_output_tokens;
  }
  return usage;
}

// The stream's end: its failure as an error event, or the usage chunk (include_usage), then [DONE].
// A failure that refuses the request (the engine's 400/409) before anything was
// sent is answered with its own status instead.
net::awaitable<void> OpenAiService::end_stream(HttpExchange& exchange, Generation& g) {
  if (g.failure && g.failure->refuses_request && !g.stream_started) {
    co_await exchange.respond_error(g.failure->error);
    co_return;
  }
  if (!g.stream_started) {
    g.stream_started = true;
    if (!co_await exchange.start_event_stream()) {
      disconnects_counter().inc();
      exchange.abandon();
      co_return;
    }
  }
  std::string tail;
  if (g.failure) {
    if (g.failure->is_timeout) timeouts_counter().inc();
    tail += sse_event(g.failure->stream_event.to_json());
  } else if (g.fields.include_usage) {
    const bool chat = g.api == Generation::Api::kChat;
    tail += sse_event(usage_chunk(g.header, chat ? "chat.completion.chunk" : "text_completion", usage_of(g)));
  }
  tail += kSseDone;
  if (co_await exchange.send_event(tail)) co_await exchange.end_event_stream();
}

net::awaitable<void> OpenAiService::respond(HttpExchange& exchange, Generation& g) {
  if (g.failure) {
    if (g.failure->is_timeout) timeouts_counter().inc();
    co_await exchange.respond_error(g.failure->error);
    co_return;
  }
  const ResponseJson response = response_json(g);
  co_await exchange.respond(http::status::ok, response.dump(-1, ' ', false, ResponseJson::error_handler_t::replace),
                            "application/json");
}

ResponseJson OpenAiService::response_json(Generation& g) const {
  const bool chat = g.api == Generation::Api::kChat;
  const TokenTextFn token_text = text_of(g);
  std::optional<ResponseJson> kv_transfer_params;
  std::vector<ChoiceResult> results;
  for (auto& choice : g.choices) {
    if (!kv_transfer_params && choice.kv_transfer_params)
      kv_transfer_params = kv_params_json(*choice.kv_transfer_params);
    ChoiceResult result;
    if (g.fields.sampling.prompt_logprobs >= 0) {
      // Choice j of a prompt follows its first choice (index - j), which computed them.
      const size_t first = static_cast<size_t>(&choice - g.choices.data()) - static_cast<size_t>(choice.sample_index);
      result.prompt_logprobs = prompt_logprobs_json(g.choices[first].prompt_logprobs, token_text);
    }
    result.text = std::move(choice.text);
    if (g.fields.sampling.logprobs >= 0) {
      int64_t offset = 0;
      result.logprobs = logprobs_for(chat, choice.logprobs, token_text, offset);
    }
    result.finish_reason = choice.finish_reason;
    result.stop_reason = choice.stop_reason;
    if (g.fields.return_token_ids) result.token_ids = std::move(choice.token_ids);
    if (chat && g.tool_format != ToolCallFormat::kNone) apply_tool_calls(result, g.tool_format, random_tool_call_id);
    if (chat && g.forced_tool != ChatRequest::ForcedTool::kNone)
      apply_forced_tool_calls(result, g.forced_tool, g.forced_tool_name, random_tool_call_id);
    results.push_back(std::move(result));
  }
  const Usage usage = usage_of(g);
  return chat ? chat_response(g.header, results, usage, kv_transfer_params)
              : completion_response(g.header, results, usage, kv_transfer_params);
}

// One HTTP generation: refused before any engine work (the request itself, lengths,
// kv_transfer_params, the engine refusing a first choice), or launched and its
// outputs collected; then it ends in exactly one way: the client is gone (nothing
// more is sent), the stream's end, or the response (its failure's error, or the choices).
net::awaitable<void> OpenAiService::run_generation(HttpExchange& exchange, std::shared_ptr<Generation> generation,
                                                   std::optional<ApiError> refusal) {
  Generation& g = *generation;
  LiveGeneration live(*this);
  if (!refusal) refusal = prepare(g);
  if (!refusal) refusal = launch_first_choices(generation);
  if (refusal) {
    co_await exchange.respond_error(*refusal);
    co_return;
  }
  exchange.watch_for_disconnect([generation] {
    generation->client_gone = true;
    generation->wake.cancel();
  });
  co_await collect_outputs(exchange, generation);
  if (g.client_gone || g.failure) abort_unfinished(g);
  observe_finished_prompts(g);
  co_await exchange.stop_watching();
  if (g.client_gone) {
    disconnects_counter().inc();
    PD_LOG_DEBUG("{}: client went away; aborted", g.header.id);
    exchange.abandon();
  } else if (g.fields.stream) {
    co_await end_stream(exchange, g);
  } else {
    co_await respond(exchange, g);
  }
}

namespace {

json tokenize_response(const std::vector<int32_t>& ids, int32_t max_model_len, const json& token_strs) {
  return {{"count", ids.size()}, {"max_model_len", max_model_len}, {"tokens", ids}, {"token_strs", token_strs}};
}

}  // namespace

net::awaitable<void> OpenAiService::handle_tokenize(HttpExchange& exchange) {
  auto body = parse_json_object(exchange.request().body(), limits_.max_json_depth);
  if (failed(body)) {
    ApiError error = take_error(body);
    co_await exchange.respond_error(error);
    co_return;
  }
  auto parsed = parse_tokenize_request(std::get<ojson>(body), limits_);
  if (failed(parsed)) {
    ApiError error = take_error(parsed);
    co_await exchange.respond_error(error);
    co_return;
  }
  auto& request = std::get<TokenizeRequest>(parsed);
  if (auto error = check_model(request.model)) {
    ApiError e = *error;
    co_await exchange.respond_error(e);
    co_return;
  }
  std::string text;
  if (request.prompt) {
    text = *request.prompt;
  } else {
    auto rendered = render_chat(tokenizer_.get(), request.messages, request.add_generation_prompt, request.tools,
                                request.chat_template_kwargs);
    if (failed(rendered)) {
      ApiError error = take_error(rendered);
      co_await exchange.respond_error(error);
      co_return;
    }
    text = std::get<std::string>(std::move(rendered));
  }
  auto ids = tokenize_text(tokenizer_.get(), text, request.add_special_tokens);
  if (failed(ids)) {
    ApiError error = take_error(ids);
    co_await exchange.respond_error(error);
    co_return;
  }
  const auto& tokens = std::get<std::vector<int32_t>>(ids);
  json token_strs = nullptr;
  if (request.return_token_strs) {
    token_strs = json::array();
    for (int32_t id : tokens) token_strs.push_back(tokenizer_->id_to_token(id).value_or(""));
  }
  json response = tokenize_response(tokens, max_model_len_, token_strs);
  co_await exchange.respond_json(http::status::ok, response);
}

net::awaitable<void> OpenAiService::handle_detokenize(HttpExchange& exchange) {
  auto body = parse_json_object(exchange.request().body(), limits_.max_json_depth);
  if (failed(body)) {
    ApiError error = take_error(body);
    co_await exchange.respond_error(error);
    co_return;
  }
  auto parsed = parse_detokenize_request(std::get<ojson>(body), limits_);
  if (failed(parsed)) {
    ApiError error = take_error(parsed);
    co_await exchange.respond_error(error);
    co_return;
  }
  auto& request = std::get<DetokenizeRequest>(parsed);
  if (auto error = check_model(request.model)) {
    ApiError e = *error;
    co_await exchange.respond_error(e);
    co_return;
  }
  if (!tokenizer_) {
    ApiError error = bad_request("this model has no tokenizer", "tokens");
    co_await exchange.respond_error(error);
    co_return;
  }
  for (int32_t id : request.tokens) {
    if (id >= tokenizer_->vocab_size()) {
      ApiError error = bad_request(
          fmt::format("token id {} is outside the vocabulary (size {})", id, tokenizer_->vocab_size()), "tokens");
      co_await exchange.respond_error(error);
      co_return;
    }
  }
  json response = json::object();
  response["prompt"] = tokenizer_->decode(request.tokens, /*skip_special_tokens=*/false);
  co_await exchange.respond_json(http::status::ok, response);
}

}  // namespace pd::server
