#include "server/load_options.h"

#include <gtest/gtest.h>

#include <utility>
#include <vector>

namespace pd::server {
namespace {

TEST(ModelLoadOptions, EveryRunnerFlagReachesTheLoader) {
  const std::vector<std::pair<const char*, const char*>> flags = {{"--model", "/m"},
                                                                  {"--load-format", "dummy"},
                                                                  {"--device", "cuda"},
                                                                  {"--cuda-device", "1"},
                                                                  {"--seed", "9"},
                                                                  {"--block-size", "32"},
                                                                  {"--num-kv-blocks", "77"},
                                                                  {"--kv-cache-bytes", "1048576"},
                                                                  {"--max-model-len", "1024"},
                                                                  {"--max-num-seqs", "12"},
                                                                  {"--gpu-memory-utilization", "0.5"},
                                                                  {"--max-num-batched-tokens", "4096"},
                                                                  {"--tensor-parallel-size", "4"}};
  std::vector<const char*> args = {"pdserve"};
  for (const auto& [flag, value] : flags) {
    args.push_back(flag);
    args.push_back(value);
  }
  auto outcome = parse_server_cli(static_cast<int>(args.size()), args.data());
  ASSERT_TRUE(outcome.config) << outcome.message;
  const engine::ModelLoadOptions o = model_load_options(*outcome.config);
  EXPECT_EQ(o.model, "/m");
  EXPECT_EQ(o.load_format, "dummy");
  EXPECT_EQ(o.device, "cuda");
  EXPECT_EQ(o.cuda_device, 1);
  EXPECT_EQ(o.seed, 9u);
  EXPECT_EQ(o.block_size, 32);
  EXPECT_EQ(o.num_kv_blocks, 77);
  EXPECT_EQ(o.kv_cache_bytes, 1048576);
  EXPECT_EQ(o.max_model_len, 1024);
  EXPECT_DOUBLE_EQ(o.gpu_memory_utilization, 0.5);
  EXPECT_EQ(o.max_num_seqs, 12);
  EXPECT_EQ(o.max_num_batched_tokens, 4096);
  EXPECT_EQ(o.tensor_parallel_size, 4);
}

TEST(ModelLoadOptions, ExpertParallelFlagReachesTheLoader) {
  std::vector<const char*> args = {"pdserve", "--tensor-parallel-size", "2", "--enable-expert-parallel"};
  auto outcome = parse_server_cli(static_cast<int>(args.size()), args.data());
  ASSERT_TRUE(outcome.config) << outcome.message;
  EXPECT_TRUE(model_load_options(*outcome.config).enable_expert_parallel);
  args.pop_back();
  outcome = parse_server_cli(static_cast<int>(args.size()), args.data());
  ASSERT_TRUE(outcome.config) << outcome.message;
  EXPECT_FALSE(model_load_options(*outcome.config).enable_expert_parallel);
}

TEST(ModelLoadOptions, NegativeCudaDeviceIsRefused) {
  std::vector<const char*> args = {"pdserve", "--cuda-device", "-1"};
  auto outcome = parse_server_cli(static_cast<int>(args.size()), args.data());
  EXPECT_FALSE(outcome.config);
  EXPECT_NE(outcome.exit_code, 0);
}

}  // namespace
}  // namespace pd::server
