// pdserve: one engine instance behind the OpenAI HTTP API.
//
// Start-up: parse flags -> load the model (runner + tokenizer dir) -> load
// the tokenizer -> start the engine thread -> listen and print the address.
// Shutdown (SIGINT/SIGTERM): stop accepting, abort live requests and join
// the engine, let streams write their last event (bounded), stop I/O, exit 0.
#include <utility>

#include <csignal>
#include <cstdio>
#include <memory>

#include "common/connection_limit.h"
#include "common/log.h"
#include "connector/pd_connector.h"
#include "engine/engine.h"
#include "engine/runner/load_model.h"
#include "grammar/constraint.h"
#include "grammar/grammar_library.h"
#include "server/http_server.h"
#include "server/load_options.h"
#include "server/openai_service.h"
#include "server/server_config.h"
#include "tokenizer/tokenizer.h"

namespace {

constexpr int64_t kShutdownDrainMs = 3000;
// Files pdserve holds besides its connections: model and log files, epoll/event/timer fds,
// the listener, and with --device cuda and a P/D connector, device handles and the
// transfer's sockets (a CPU instance holds about 10).
constexpr int64_t kReservedFds = 256;

int run(pd::server::ServerConfig config) {
  using namespace pd;
  const engine::ModelLoadOptions load_options = server::model_load_options(config);
  auto loaded = engine::load_model(load_options);
  if (!loaded.ok()) {
    PD_LOG_ERROR("cannot load model '{}': {}", config.model, loaded.status().to_string());
    return 1;
  }

  std::shared_ptr<const tokenizer::Tokenizer> tokenizer;
  if (!loaded->tokenizer_dir.empty()) {
    auto tok = tokenizer::Tokenizer::load(loaded->tokenizer_dir);
    if (!tok.ok()) {
      PD_LOG_ERROR("cannot load tokenizer from {}: {}", loaded->tokenizer_dir.string(), tok.status().to_string());
      return 1;
    }
    tokenizer = std::move(tok).value();
  } else {
    PD_LOG_WARN("model '{}' has no tokenizer: only token-id prompts will work", config.model);
  }

  engine::EngineConfig engine_config;
  engine_config.max_num_seqs = config.max_num_seqs;
  engine_config.max_num_batched_tokens = config.max_num_batched_tokens;
  engine_config.max_model_len = loaded->max_model_len;
  engine_config.seed = config.seed;
  engine_config.max_waiting_requests = static_cast<size_t>(config.max_waiting_requests);
  engine_config.eos_token_ids = loaded->eos_token_ids;
  engine_config.remote_output_reserve = config.remote_output_reserve;
  engine_config.kv_watermark = config.kv_watermark;
  engine_config.model_name = config.primary_model_name();
  if (engine_config.eos_token_ids.empty() && tokenizer && tokenizer->eos_token_id())
    engine_config.eos_token_ids.push_back(*tokenizer->eos_token_id());
  const int32_t max_model_len = loaded->max_model_len;
  const int32_t runner_vocab_size = loaded->runner->vocab_size();
  const std::string architecture = loaded->architecture;

  // P/D connector: built before the engine, which then owns it and
  // destroys it before the runner it points at.
  std::unique_ptr<engine::KvConnector> kv_connector;
  connector::PdConnector* pd_connector = nullptr;
  if (!config.kv_transfer.config_json.empty() || !config.kv_transfer.kv_role.empty()) {
    auto kv_config =
        connector::kv_transfer_config_from_flags(config.kv_transfer.config_json, config.kv_transfer.kv_role);
    if (!kv_config.ok()) {
      PD_LOG_ERROR("{}", kv_config.status().to_string());
      return 1;
    }
    connector::PdConnectorOptions connector_options;
    connector_options.config = *kv_config;
    connector_options.served_model_name = config.primary_model_name();
    auto made = connector::PdConnector::create(std::move(connector_options), loaded->runner.get());
    if (!made.ok()) {
      PD_LOG_ERROR("cannot start the P/D connector: {}", made.status().to_string());
      return 1;
    }
    pd_connector = made->get();
    kv_connector = std::move(made).value();
  }

  auto created =
      engine::Engine::create(std::move(engine_config), std::move(loaded->runner), tokenizer, std::move(kv_connector));
  if (!created.ok()) {
    PD_LOG_ERROR("cannot start the engine: {}", created.status().to_string());
    return 1;
  }
  std::unique_ptr<engine::Engine> engine = std::move(created).value();

  server::HttpServerOptions http_options;
  http_options.host = config.host;
  http_options.port = static_cast<uint16_t>(config.port);
  http_options.num_io_threads = config.num_io_threads;
  http_options.max_body_bytes = config.max_body_bytes;
  http_options.keep_alive_timeout_ms = config.keep_alive_timeout_ms;
  http_options.max_connections = config.max_connections_or_default();
  http_options.api_key = config.api_key;
  // The service outlives the HTTP server: coroutine frames that the server
  // destroys at the end still refer to it.
  server::OpenAiService service(config, *engine, tokenizer, max_model_len);
  {
    // Structured output: llguidance over this model's tokenizer, built once. Without it the
    // server still serves; requests that ask for structured output get a 400 saying why.
    std::string reason;
    std::shared_ptr<const grammar::GrammarTokenizer> grammar_tokenizer;
    if (tokenizer == nullptr) {
      reason = "the model has no tokenizer";
    } else if (auto library = grammar::GrammarLibrary::load(grammar::default_library_paths()); !library.ok()) {
      reason = "the grammar library (llguidance) is unavailable: " + library.status().message();
    } else if (auto made = grammar::GrammarTokenizer::create(*library, tokenizer, runner_vocab_size,
                                                             engine->config().eos_token_ids);
               !made.ok()) {
      reason = "the grammar library (llguidance) refused the tokenizer: " + made.status().message();
    } else {
      grammar_tokenizer = std::move(made).value();
    }
    if (grammar_tokenizer == nullptr) PD_LOG_WARN("structured output disabled: {}", reason);
    service.set_grammar(std::move(grammar_tokenizer), std::move(reason));
  }
  server::HttpServer http(http_options);
  if (pd_connector != nullptr) {
    service.set_kv_params_parser([pd_connector](const nlohmann::json& params, int32_t num_prompt_tokens) {
      return pd_connector->parse_request_params(params, num_prompt_tokens);
    });
    service.set_transfer_releaser([pd_connector](std::string transfer_id, std::function<void(bool)> done) {
      pd_connector->release_transfer(std::move(transfer_id), std::move(done));
    });
  }
  service.register_routes(http);
  if (pd_connector != nullptr) {
    http.route(server::http::verb::get, "/pd/info",
               [pd_connector](server::HttpExchange& exchange) -> server::net::awaitable<void> {
                 co_await exchange.respond_json(server::http::status::ok, pd_connector->info_json());
               });
  }
  if (Status status = http.start(); !status.ok()) {
    PD_LOG_ERROR("{}", status.to_string());
    engine->shutdown();
    return 1;
  }
  PD_LOG_INFO("model {} ({}), max_model_len {}, {} KV blocks of {} tokens", config.model, architecture, max_model_len,
              engine->kv_cache_spec().num_blocks, engine->kv_cache_spec().block_size);
  if (pd_connector != nullptr) {
    const auto& kv = pd_connector->config();
    const int32_t advertised_port = kv.http_port > 0 ? kv.http_port : static_cast<int32_t>(http.port());
    if (Status status = pd_connector->start_registration(fmt::format("{}:{}", config.host, advertised_port));
        !status.ok()) {
      PD_LOG_ERROR("P/D registration: {}", status.to_string());
      http.stop();
      engine->shutdown();
      return 1;
    }
  }
  // Tests and scripts read this line to learn the port (--port 0).
  std::printf("pdserve listening on http://%s:%u\n", config.host.c_str(), static_cast<unsigned>(http.port()));
  std::fflush(stdout);

  // Signals are blocked in every thread (see main); this thread takes them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  int signal_number = 0;
  while (signal_number <= 0) {
    timespec tick{1, 0};
    signal_number = sigtimedwait(&signals, nullptr, &tick);
  }
  PD_LOG_INFO("signal {}: shutting down", signal_number);
  http.stop_accepting();
  engine->shutdown();  // aborts live requests; their streams get a final event
  if (!service.wait_until_idle(kShutdownDrainMs))
    PD_LOG_WARN("{} streams still open after {} ms; closing them", service.num_live_generations(), kShutdownDrainMs);
  http.stop();
  engine.reset();
  PD_LOG_INFO("pdserve stopped");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Block SIGINT/SIGTERM before any thread starts so only run()'s
  // sigtimedwait sees them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);

  auto outcome = pd::server::parse_server_cli(argc, argv);
  if (!outcome.config) {
    std::fputs(outcome.message.c_str(), outcome.exit_code == 0 ? stdout : stderr);
    std::fputs("\n", outcome.exit_code == 0 ? stdout : stderr);
    return outcome.exit_code;
  }
  pd::log::init(outcome.config->log_level);
  if (pd::Status status = pd::server::validate_server_config(*outcome.config); !status.ok()) {
    PD_LOG_ERROR("{}", status.to_string());
    return 2;
  }
  // Before the model loads: a cap the open-file limit cannot honour fails fast.
  pd::server::ServerConfig& config = *outcome.config;
  const pd::ConnectionFdBudget budget{1, kReservedFds + pd::server::HttpServer::kMaxRefusalsInFlight};
  auto max_connections = pd::fit_connection_limit_to_open_files(
      "--max-connections", config.max_connections_or_default(), config.max_connections.has_value(), budget);
  if (!max_connections.ok()) {
    PD_LOG_ERROR("{}", max_connections.status().to_string());
    return 2;
  }
  config.max_connections = *max_connections;
  return run(std::move(*outcome.config));
}
