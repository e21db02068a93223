#include "server/server_config.h"

#include <gtest/gtest.h>

#include <vector>

namespace pd::server {
namespace {

CliOutcome parse(std::vector<const char*> args) {
  args.insert(args.begin(), "pdserve");
  return parse_server_cli(static_cast<int>(args.size()), args.data());
}

TEST(ServerCli, DefaultsMatchVllmServe) {
  auto outcome = parse({});
  ASSERT_TRUE(outcome.config);
  EXPECT_EQ(outcome.config->host, "127.0.0.1");
  EXPECT_EQ(outcome.config->model, "builtin:tiny");
  EXPECT_EQ(outcome.config->primary_model_name(), "builtin:tiny");
  EXPECT_FALSE(outcome.config->max_model_len);
  EXPECT_TRUE(validate_server_config(*outcome.config).ok());
}

TEST(ServerCli, ReadsVllmFlags) {
  auto outcome = parse({"--model", "/m", "--port", "0", "--max-model-len", "512", "--max-num-seqs", "8",
                        "--served-model-name", "a", "b", "--api-key", "k", "--seed", "7", "--block-size", "32"});
  ASSERT_TRUE(outcome.config);
  const auto& c = *outcome.config;
  EXPECT_EQ(c.port, 0);
  EXPECT_EQ(c.max_model_len, 512);
  EXPECT_EQ(c.max_num_seqs, 8);
  EXPECT_EQ(c.primary_model_name(), "a");
  EXPECT_TRUE(c.serves_model("b"));
  EXPECT_FALSE(c.serves_model("/m"));
  EXPECT_EQ(c.api_key, "k");
  EXPECT_EQ(c.seed, 7u);
  EXPECT_EQ(c.block_size, 32);
}

TEST(ServerCli, ReadsTheRemoteAdmissionReserve) {
  auto defaults = parse({});
  ASSERT_TRUE(defaults.config);
  EXPECT_EQ(defaults.config->remote_output_reserve, 1.0);
  EXPECT_EQ(defaults.config->kv_watermark, 0.01);
  auto outcome = parse({"--remote-output-reserve", "-1", "--kv-watermark", "0.05"});
  ASSERT_TRUE(outcome.config);
  EXPECT_EQ(outcome.config->remote_output_reserve, -1.0);
  EXPECT_EQ(outcome.config->kv_watermark, 0.05);
  EXPECT_TRUE(validate_server_config(*outcome.config).ok());
}

TEST(ServerCli, UnknownFlagIsAnErrorAndHelpExitsZero) {
  auto bad = parse({"--no-such-flag"});
  EXPECT_FALSE(bad.config);
  EXPECT_NE(bad.exit_code, 0);
  auto help = parse({"--help"});
  EXPECT_FALSE(help.config);
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.message.find("--max-model-len"), std::string::npos);
}

TEST(ServerConfigValidation, TensorParallelRunsOnCpuAndCudaPdOnCpuOnly) {
  auto cpu = parse({"--tensor-parallel-size", "2"});
  ASSERT_TRUE(cpu.config);
  EXPECT_TRUE(validate_server_config(*cpu.config).ok());

  auto cuda = parse({"--tensor-parallel-size", "2", "--device", "cuda"});
  ASSERT_TRUE(cuda.config);
  EXPECT_TRUE(validate_server_config(*cuda.config).ok());

  auto cuda_pd = parse({"--tensor-parallel-size", "2", "--device", "cuda", "--kv-role", "kv_consumer"});
  ASSERT_TRUE(cuda_pd.config);
  auto status = validate_server_config(*cuda_pd.config);
  EXPECT_EQ(status.code(), ErrorCode::kUnimplemented);
  EXPECT_NE(status.message().find("--tensor-parallel-size 2 with --device cuda and --kv-transfer-config"),
            std::string::npos)
      << status.to_string();

  // P/D moves every rank's KV shards on cpu.
  auto pd = parse({"--tensor-parallel-size", "2", "--kv-transfer-config", R"({"kv_role":"kv_producer"})"});
  ASSERT_TRUE(pd.config);
  EXPECT_TRUE(validate_server_config(*pd.config).ok());

  auto zero = parse({"--tensor-parallel-size", "0"});
  ASSERT_TRUE(zero.config);
  EXPECT_EQ(validate_server_config(*zero.config).code(), ErrorCode::kInvalidArgument);
}

TEST(ServerConfigValidation, ExpertParallelRunsOnCpuOnly) {
  auto cpu = parse({"--tensor-parallel-size", "2", "--enable-expert-parallel"});
  ASSERT_TRUE(cpu.config);
  EXPECT_TRUE(cpu.config->enable_expert_parallel);
  EXPECT_TRUE(validate_server_config(*cpu.config).ok());

  auto cuda = parse({"--enable-expert-parallel", "--device", "cuda"});
  ASSERT_TRUE(cuda.config);
  auto status = validate_server_config(*cuda.config);
  EXPECT_EQ(status.code(), ErrorCode::kUnimplemented);
  EXPECT_NE(status.message().find("--enable-expert-parallel with --device cuda"), std::string::npos)
      << status.to_string();
}

TEST(ServerConfigValidation, KvTransferConfigMustBeAJsonObject) {
  auto bad = parse({"--kv-transfer-config", "{not json"});
  ASSERT_TRUE(bad.config);
  EXPECT_EQ(validate_server_config(*bad.config).code(), ErrorCode::kInvalidArgument);

  auto good = parse({"--kv-transfer-config", R"({"kv_connector":"PdConnector","kv_role":"kv_producer"})"});
  ASSERT_TRUE(good.config);
  ASSERT_TRUE(validate_server_config(*good.config).ok());
  EXPECT_EQ(good.config->kv_transfer.kv_role, "kv_producer");
  EXPECT_EQ(good.config->kv_transfer.config["kv_connector"], "PdConnector");
}

TEST(ServerConfigValidation, ContradictoryKvRolesAreRefused) {
  auto outcome = parse({"--kv-role", "kv_consumer", "--kv-transfer-config", R"({"kv_role":"kv_producer"})"});
  ASSERT_TRUE(outcome.config);
  EXPECT_FALSE(validate_server_config(*outcome.config).ok());
}

TEST(ServerConfigValidation, AProducerWithoutABudgetFlagGetsTheProducerDefault) {
  for (const char* role : {"kv_producer", "producer"}) {
    auto outcome = parse({"--kv-role", role});
    ASSERT_TRUE(outcome.config);
    ASSERT_TRUE(validate_server_config(*outcome.config).ok());
    EXPECT_EQ(outcome.config->max_num_batched_tokens, kProducerMaxNumBatchedTokens) << role;
  }
  auto from_json = parse({"--kv-transfer-config", R"({"kv_connector":"PdConnector","kv_role":"kv_producer"})"});
  ASSERT_TRUE(from_json.config);
  ASSERT_TRUE(validate_server_config(*from_json.config).ok());
  EXPECT_EQ(from_json.config->max_num_batched_tokens, kProducerMaxNumBatchedTokens);
}

TEST(ServerConfigValidation, AGivenBudgetAndOtherRolesKeepTheirBudget) {
  auto given = parse({"--kv-role", "kv_producer", "--max-num-batched-tokens", "8192"});
  ASSERT_TRUE(given.config);
  ASSERT_TRUE(validate_server_config(*given.config).ok());
  EXPECT_EQ(given.config->max_num_batched_tokens, 8192);
  for (const char* role : {"kv_consumer", "kv_both"}) {
    auto outcome = parse({"--kv-role", role});
    ASSERT_TRUE(outcome.config);
    ASSERT_TRUE(validate_server_config(*outcome.config).ok());
    EXPECT_EQ(outcome.config->max_num_batched_tokens, kDefaultMaxNumBatchedTokens) << role;
  }
}

TEST(ServerCli, MaxConnectionsIsReadWhenGiven) {
  auto outcome = parse({"--max-connections", "4"});
  ASSERT_TRUE(outcome.config);
  EXPECT_EQ(outcome.config->max_connections, 4);
  EXPECT_EQ(outcome.config->max_connections_or_default(), 4);
  EXPECT_TRUE(validate_server_config(*outcome.config).ok());
}

TEST(ServerCli, DefaultMaxConnectionsHoldsEveryRequestTheEngineCanQueue) {
  auto defaults = parse({});
  ASSERT_TRUE(defaults.config);
  EXPECT_FALSE(defaults.config->max_connections);
  EXPECT_EQ(defaults.config->max_connections_or_default(), 256 + 4096 + ServerConfig::kIdleConnectionAllowance);
  auto small = parse({"--max-num-seqs", "8", "--max-waiting-requests", "100"});
  ASSERT_TRUE(small.config);
  EXPECT_EQ(small.config->max_connections_or_default(), 8 + 100 + ServerConfig::kIdleConnectionAllowance);
}

TEST(ServerConfigValidation, RangesAreChecked) {
  for (std::vector<const char*> args : std::vector<std::vector<const char*>>{{"--port", "70000"},
                                                                             {"--max-num-seqs", "0"},
                                                                             {"--gpu-memory-utilization", "1.5"},
                                                                             {"--load-format", "pickle"},
                                                                             {"--device", "tpu"},
                                                                             {"--max-model-len", "1"},
                                                                             {"--io-threads", "0"},
                                                                             {"--max-waiting-requests", "0"},
                                                                             {"--max-connections", "0"},
                                                                             {"--max-connections", "-3"},
                                                                             {"--kv-watermark", "1"},
                                                                             {"--kv-watermark", "-0.1"},
                                                                             {"--remote-output-reserve", "1.5"}}) {
    auto outcome = parse(args);
    ASSERT_TRUE(outcome.config) << args[0];
    EXPECT_FALSE(validate_server_config(*outcome.config).ok()) << args[0];
  }
}

}  // namespace
}  // namespace pd::server
