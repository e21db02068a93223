// A read-only safetensors reader over mmap. Opening validates the whole header
// (length, JSON, dtypes, shapes, offsets in range and non-overlapping, byte
// counts matching shapes) so that later reads cannot go out of bounds; every
// error names the file and, where there is one, the tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"

namespace pd::model {

enum class TensorDtype : uint8_t { kF32, kF16, kBF16, kF64, kI64, kI32, kI16, kI8, kU8, kBool, kF8E4M3, kF8E5M2 };
const char* tensor_dtype_name(TensorDtype dtype);  // safetensors spelling: "F32", "BF16", ...
size_t tensor_dtype_bytes(TensorDtype dtype);

struct TensorInfo {
  std::string name;
  TensorDtype dtype = TensorDtype::kF32;
  std::vector<int64_t> shape;
  uint64_t data_begin = 0;  // relative to the data section (after the header)
  uint64_t data_end = 0;
  int64_t num_elements() const;
};

class SafetensorsFile {
 public:
  // Header bytes above this are refused (real headers are a few MB at most).
  static constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
  static constexpr size_t kMaxTensors = 1u << 20;

  static Result<std::unique_ptr<SafetensorsFile>> open(const std::filesystem::path& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(const std::string& name) const;
  // The tensor's raw little-endian bytes (validated in range at open()).
  std::span<const std::byte> bytes(const TensorInfo& info) const;
  // Converts F32/F16/BF16 to fp32. `out` must hold num_elements() floats.
  Status read_as_f32(const TensorInfo& info, std::span<float> out) const;
  // Copies the codes of an F8_E4M3 tensor. `out` must hold num_elements() bytes;
  // any other dtype is an error naming the tensor.
  Status read_fp8_e4m3(const TensorInfo& info, std::span<uint8_t> out) const;

 private:
  SafetensorsFile() = default;
  Status parse(std::span<const std::byte> file);

  std::filesystem::path path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const std::byte* data_ = nullptr;  // start of the data section inside the mapping
  uint64_t data_bytes_ = 0;
  std::map<std::string, TensorInfo> tensors_;
};

// All tensors of a checkpoint: one model.safetensors, or the shards named by
// model.safetensors.index.json (each shard opened once), or, lacking both, all
// *.safetensors files of the directory. A tensor present in two files is an error.
class SafetensorsCheckpoint {
 public:
  static Result<SafetensorsCheckpoint> open_dir(const std::filesystem::path& model_dir);
  // True when the directory holds any safetensors weights.
  static bool dir_has_weights(const std::filesystem::path& model_dir);

  struct Entry {
    const SafetensorsFile* file;
    const TensorInfo* info;
  };
  Result<Entry> find(const std::string& name) const;
  size_t num_tensors() const { return index_.size(); }

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, Entry> index_;
};

// fp16 / bf16 bit patterns to fp32 (exact).
float bf16_to_f32(uint16_t bits);
float f16_to_f32(uint16_t bits);

}  // namespace pd::model
