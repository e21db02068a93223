// The safetensors reader accepts well-formed files (F32/F16/BF16) and rejects
// every kind of broken file with an error that names the tensor.
#include "model/safetensors.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "model/weights.h"

namespace pd::model {
namespace {

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("pd_safetensors_" + std::to_string(::getpid()) + "_" +
                                                     ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Writes [u64 header length][header][data] and returns the path.
  std::filesystem::path write(const std::string& header, const std::vector<uint8_t>& data,
                              const std::string& name = "model.safetensors", int64_t header_len_override = -1) {
    const auto path = dir_ / name;
    std::ofstream out(path, std::ios::binary);
    uint64_t len = header_len_override >= 0 ? static_cast<uint64_t>(header_len_override) : header.size();
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>((len >> (8 * i)) & 0xff));
    out.write(header.data(), static_cast<std::streamsize>(header.size()));
    out.write(reinterpret_cast<const char*>(data.data()), static_cast<std::streamsize>(data.size()));
    return path;
  }

  static std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
    std::vector<uint8_t> b(v.size() * 4);
    std::memcpy(b.data(), v.data(), b.size());
    return b;
  }

  // Expects open() to fail with a message containing every given fragment.
  void expect_rejected(const std::filesystem::path& path, const std::vector<std::string>& fragments) {
    auto file = SafetensorsFile::open(path);
    ASSERT_FALSE(file.ok()) << "accepted a broken file";
    for (const auto& f : fragments)
      EXPECT_NE(file.status().message().find(f), std::string::npos)
          << "'" << f << "' not in: " << file.status().message();
  }

  std::filesystem::path dir_;
};

TEST_F(SafetensorsTest, ReadsF32F16AndBf16TensorsAsF32) {
  std::vector<uint8_t> data = f32_bytes({1.5f, -2.0f});
  // F16: 1.0 (0x3c00), -2.0 (0xc000), smallest subnormal 2^-24 (0x0001). BF16: 1.0 (0x3f80), -0.5 (0xbf00).
  for (uint16_t h : {0x3c00, 0xc000, 0x0001, 0x3f80, 0xbf00}) {
    data.push_back(static_cast<uint8_t>(h & 0xff));
    data.push_back(static_cast<uint8_t>(h >> 8));
  }
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("h":{"dtype":"F16","shape":[3],"data_offsets":[8,14]},"b":{"dtype":"BF16","shape":[1,2],"data_offsets":[14,18]}})";
  auto file = SafetensorsFile::open(write(header, data));
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  EXPECT_EQ((*file)->tensors().size(), 3u);
  std::vector<float> out(2);
  ASSERT_TRUE((*file)->read_as_f32(*(*file)->find("a"), out).ok());
  EXPECT_EQ(out, (std::vector<float>{1.5f, -2.0f}));
  std::vector<float> h(3);
  ASSERT_TRUE((*file)->read_as_f32(*(*file)->find("h"), h).ok());
  EXPECT_EQ(h, (std::vector<float>{1.0f, -2.0f, std::ldexp(1.0f, -24)}));
  const TensorInfo* b = (*file)->find("b");
  EXPECT_EQ(b->shape, (std::vector<int64_t>{1, 2}));
  ASSERT_TRUE((*file)->read_as_f32(*b, out).ok());
  EXPECT_EQ(out, (std::vector<float>{1.0f, -0.5f}));
}

TEST_F(SafetensorsTest, RejectsTruncatedDataNamingTheTensor) {
  const std::string header = R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})";
  expect_rejected(write(header, f32_bytes({1, 2, 3})), {"'w'", "out of range"});
}

TEST_F(SafetensorsTest, RejectsFileShorterThanTheLengthPrefix) {
  const auto path = dir_ / "short.safetensors";
  std::ofstream(path, std::ios::binary).write("\x05\x00\x00", 3);
  expect_rejected(path, {"too short"});
}

TEST_F(SafetensorsTest, RejectsHeaderLengthPastEndOfFile) {
  const std::string header = R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  expect_rejected(write(header, f32_bytes({1}), "model.safetensors", 4096), {"header length 4096"});
}

TEST_F(SafetensorsTest, RejectsAbsurdHeaderLength) {
  expect_rejected(write("{}", {}, "model.safetensors", int64_t{1} << 40), {"exceeds"});
}

TEST_F(SafetensorsTest, RejectsHeaderThatIsNotJson) {
  expect_rejected(write("{not json", {}), {"not valid JSON"});
}

TEST_F(SafetensorsTest, RejectsOverlappingTensorsNamingBoth) {
  const std::string header = R"({"first":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("second":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})";
  expect_rejected(write(header, f32_bytes({1, 2, 3})), {"'second'", "'first'", "overlap"});
}

TEST_F(SafetensorsTest, RejectsOffsetsOutOfRangeNamingTheTensor) {
  const std::string header = R"({"far":{"dtype":"F32","shape":[1],"data_offsets":[100,104]}})";
  expect_rejected(write(header, f32_bytes({1, 2})), {"'far'", "out of range"});
}

TEST_F(SafetensorsTest, RejectsReversedOffsetsNamingTheTensor) {
  const std::string header = R"({"rev":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})";
  expect_rejected(write(header, f32_bytes({1, 2})), {"'rev'", "begin 8 > end 4"});
}

TEST_F(SafetensorsTest, RejectsUnknownDtypeNamingTheTensor) {
  const std::string header = R"({"odd":{"dtype":"F7","shape":[1],"data_offsets":[0,4]}})";
  expect_rejected(write(header, f32_bytes({1})), {"'odd'", "unknown dtype 'F7'"});
}

TEST_F(SafetensorsTest, RejectsShapeThatDisagreesWithByteCountNamingTheTensor) {
  const std::string header = R"({"m":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,8]}})";
  expect_rejected(write(header, f32_bytes({1, 2})), {"'m'", "needs 12 bytes", "span 8"});
}

TEST_F(SafetensorsTest, RejectsNegativeShapeNamingTheTensor) {
  const std::string header = R"({"neg":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})";
  expect_rejected(write(header, f32_bytes({1})), {"'neg'"});
}

TEST_F(SafetensorsTest, RejectsMissingOffsetsNamingTheTensor) {
  const std::string header = R"({"nooff":{"dtype":"F32","shape":[1]}})";
  expect_rejected(write(header, f32_bytes({1})), {"'nooff'", "data_offsets"});
}

TEST_F(SafetensorsTest, IntegerTensorIsNotUsableAsWeights) {
  const std::string header = R"({"ids":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}})";
  auto file = SafetensorsFile::open(write(header, f32_bytes({1})));
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  std::vector<float> out(1);
  Status st = (*file)->read_as_f32(*(*file)->find("ids"), out);
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find("'ids'"), std::string::npos);
}

ModelConfig small_llama() {
  ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.vocab_size = 4;
  c.hidden_size = 2;
  c.intermediate_size = 2;
  c.num_layers = 1;
  c.num_heads = 1;
  c.num_kv_heads = 1;
  c.head_dim = 2;
  c.max_position_embeddings = 16;
  c.tie_word_embeddings = true;
  return c;
}

// Writes all tensors of the config as F32 zeros, optionally skipping or reshaping one.
std::string header_for(const ModelConfig& c, const std::string& skip, const std::string& reshape, size_t* bytes) {
  nlohmann::json h = nlohmann::json::object();
  uint64_t off = 0;
  for (const WeightSpec& s : weight_specs(c)) {
    if (s.name == skip) continue;
    std::vector<int64_t> shape = s.shape;
    if (s.name == reshape) shape.back() += 1;
    uint64_t n = 4;
    for (int64_t d : shape) n *= static_cast<uint64_t>(d);
    h[s.name] = {{"dtype", "F32"}, {"shape", shape}, {"data_offsets", {off, off + n}}};
    off += n;
  }
  *bytes = off;
  return h.dump();
}

TEST_F(SafetensorsTest, WeightLoaderNamesAMissingTensor) {
  size_t bytes = 0;
  const std::string header = header_for(small_llama(), "model.layers.0.mlp.up_proj.weight", "", &bytes);
  write(header, std::vector<uint8_t>(bytes));
  auto w = load_safetensors_weights(small_llama(), dir_);
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("model.layers.0.mlp.up_proj.weight"), std::string::npos) << w.status().message();
}

TEST_F(SafetensorsTest, WeightLoaderNamesAMisshapenTensor) {
  size_t bytes = 0;
  const std::string header = header_for(small_llama(), "", "model.layers.0.self_attn.k_proj.weight", &bytes);
  write(header, std::vector<uint8_t>(bytes));
  auto w = load_safetensors_weights(small_llama(), dir_);
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("'model.layers.0.self_attn.k_proj.weight' has shape [2, 3]"), std::string::npos)
      << w.status().message();
}

TEST_F(SafetensorsTest, WeightLoaderReadsACompleteCheckpoint) {
  size_t bytes = 0;
  const std::string header = header_for(small_llama(), "", "", &bytes);
  write(header, std::vector<uint8_t>(bytes));
  auto w = load_safetensors_weights(small_llama(), dir_);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  EXPECT_EQ(w->num_tensors(), weight_specs(small_llama()).size());
}

TEST_F(SafetensorsTest, IndexFileNamingAShardOutsideTheDirectoryIsRejected) {
  std::ofstream(dir_ / "model.safetensors.index.json") << R"({"weight_map":{"x":"../evil.safetensors"}})";
  auto ckpt = SafetensorsCheckpoint::open_dir(dir_);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_NE(ckpt.status().message().find("'x'"), std::string::npos) << ckpt.status().message();
}

TEST_F(SafetensorsTest, TensorInTwoShardsIsRejected) {
  const std::string header = R"({"dup":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  write(header, f32_bytes({1}), "a.safetensors");
  write(header, f32_bytes({2}), "b.safetensors");
  auto ckpt = SafetensorsCheckpoint::open_dir(dir_);
  ASSERT_FALSE(ckpt.ok());
  EXPECT_NE(ckpt.status().message().find("'dup'"), std::string::npos) << ckpt.status().message();
}

TEST(DummyWeights, AreSeededPerTensorAndNormsAreOne) {
  ModelConfig c = small_llama();
  ModelWeights a = dummy_weights(c, 7), b = dummy_weights(c, 7), other = dummy_weights(c, 8);
  const auto& name = "model.layers.0.self_attn.q_proj.weight";
  EXPECT_EQ(a.find(name)->data, b.find(name)->data);
  EXPECT_NE(a.find(name)->data, other.find(name)->data);
  EXPECT_EQ(a.find("model.norm.weight")->data, (std::vector<float>{1.0f, 1.0f}));
  EXPECT_EQ(a.num_tensors(), weight_specs(c).size());
}

}  // namespace
}  // namespace pd::model
