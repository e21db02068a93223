#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>

namespace pd::model {
namespace {

using nlohmann::json;

struct DtypeName {
  const char* name;
  TensorDtype dtype;
};
constexpr DtypeName kDtypeNames[] = {
    {"F32", TensorDtype::kF32},   {"F16", TensorDtype::kF16},        {"BF16", TensorDtype::kBF16},
    {"F64", TensorDtype::kF64},   {"I64", TensorDtype::kI64},        {"I32", TensorDtype::kI32},
    {"I16", TensorDtype::kI16},   {"I8", TensorDtype::kI8},          {"U8", TensorDtype::kU8},
    {"BOOL", TensorDtype::kBool}, {"F8_E4M3", TensorDtype::kF8E4M3}, {"F8_E5M2", TensorDtype::kF8E5M2},
};

uint64_t read_u64_le(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

// Parses one header entry into `info`; errors name the tensor.
Status parse_entry(const std::string& name, const json& entry, uint64_t data_bytes, TensorInfo* info) {
  info->name = name;
  if (!entry.is_object()) return data_loss("tensor '{}': header entry is not an object", name);
  auto dtype = entry.find("dtype");
  if (dtype == entry.end() || !dtype->is_string()) return data_loss("tensor '{}': missing or non-string dtype", name);
  const std::string dtype_name = dtype->get<std::string>();
  auto known = std::find_if(std::begin(kDtypeNames), std::end(kDtypeNames),
                            [&](const DtypeName& d) { return dtype_name == d.name; });
  if (known == std::end(kDtypeNames)) return data_loss("tensor '{}': unknown dtype '{}'", name, dtype_name);
  info->dtype = known->dtype;

  auto shape = entry.find("shape");
  if (shape == entry.end() || !shape->is_array()) return data_loss("tensor '{}': missing shape", name);
  if (shape->size() > 8) return data_loss("tensor '{}': rank {} is too large", name, shape->size());
  // Element count with overflow checks: the byte count below must be exact.
  uint64_t num_elements = 1;
  for (const json& d : *shape) {
    if (!d.is_number_unsigned())
      return data_loss("tensor '{}': shape entry {} is not a non-negative integer", name, d.dump());
    uint64_t dim = d.get<uint64_t>();
    if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      return data_loss("tensor '{}': shape entry {} too large", name, dim);
    info->shape.push_back(static_cast<int64_t>(dim));
    if (dim != 0 && num_elements > std::numeric_limits<uint64_t>::max() / 8 / dim)
      return data_loss("tensor '{}': shape {} overflows", name, shape->dump());
    num_elements *= dim;
  }

  auto offsets = entry.find("data_offsets");
  if (offsets == entry.end() || !offsets->is_array() || offsets->size() != 2 || !(*offsets)[0].is_number_unsigned() ||
      !(*offsets)[1].is_number_unsigned())
    return data_loss("tensor '{}': data_offsets must be [begin, end] of non-negative integers", name);
  info->data_begin = (*offsets)[0].get<uint64_t>();
  info->data_end = (*offsets)[1].get<uint64_t>();
  if (info->data_begin > info->data_end)
    return data_loss("tensor '{}': data_offsets begin {} > end {}", name, info->data_begin, info->data_end);
  if (info->data_end > data_bytes)
    return data_loss("tensor '{}': data_offsets [{}, {}) out of range of the {}-byte data section (truncated file?)",
                     name, info->data_begin, info->data_end, data_bytes);
  const uint64_t expected_bytes = num_elements * tensor_dtype_bytes(info->dtype);
  if (info->data_end - info->data_begin != expected_bytes)
    return data_loss("tensor '{}': shape {} of {} needs {} bytes but data_offsets span {}", name, shape->dump(),
                     dtype_name, expected_bytes, info->data_end - info->data_begin);
  return Status::Ok();
}

}  // namespace

const char* tensor_dtype_name(TensorDtype dtype) {
  for (const DtypeName& d : kDtypeNames)
    if (d.dtype == dtype) return d.name;
  return "?";
}

size_t tensor_dtype_bytes(TensorDtype dtype) {
  switch (dtype) {
    case TensorDtype::kF64:
    case TensorDtype::kI64:
      return 8;
    case TensorDtype::kF32:
    case TensorDtype::kI32:
      return 4;
    case TensorDtype::kF16:
    case TensorDtype::kBF16:
    case TensorDtype::kI16:
      return 2;
    case TensorDtype::kI8:
    case TensorDtype::kU8:
    case TensorDtype::kBool:
    case TensorDtype::kF8E4M3:
    case TensorDtype::kF8E5M2:
      return 1;
  }
  return 0;
}

int64_t TensorInfo::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

float bf16_to_f32(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

float f16_to_f32(uint16_t bits) {
  const uint32_t sign = (bits & 0x8000u) << 16;
  uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t mantissa = bits & 0x3ffu;
  uint32_t u;
  if (exponent == 0x1f) {
    u = sign | 0x7f800000u | (mantissa << 13);  // inf / nan
  } else if (exponent != 0) {
    u = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    u = sign;  // signed zero
  } else {
    // Subnormal: shift until the implicit bit appears.
    int e = -1;
    do {
      ++e;
      mantissa <<= 1;
    } while ((mantissa & 0x400u) == 0);
    u = sign | static_cast<uint32_t>(112 - e) << 23 | ((mantissa & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::open(const std::filesystem::path& path) {
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return not_found("{}: cannot open: {}", path.string(), std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return data_loss("{}: fstat failed: {}", path.string(), std::strerror(err));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size > 0) {
    void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      return data_loss("{}: mmap of {} bytes failed: {}", path.string(), size, std::strerror(err));
    }
    file->map_ = map;
    file->map_bytes_ = size;
  }
  ::close(fd);  // the mapping stays valid
  std::span<const std::byte> bytes(static_cast<const std::byte*>(file->map_), file->map_bytes_);
  Status status = file->parse(bytes);
  if (!status.ok()) return status.with_context(path.string());
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

Status SafetensorsFile::parse(std::span<const std::byte> file) {
  if (file.size() < 8) return data_loss("file of {} bytes is too short for the 8-byte header length", file.size());
  const uint64_t header_bytes = read_u64_le(file.data());
  if (header_bytes > kMaxHeaderBytes)
    return data_loss("header length {} exceeds the {}-byte limit", header_bytes, kMaxHeaderBytes);
  if (header_bytes > file.size() - 8)
    return data_loss("header length {} runs past the end of the {}-byte file", header_bytes, file.size());
  const char* header_begin = reinterpret_cast<const char*>(file.data() + 8);
  json header = json::parse(header_begin, header_begin + header_bytes, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded()) return data_loss("header is not valid JSON");
  if (!header.is_object()) return data_loss("header is not a JSON object");
  if (header.size() > kMaxTensors)
    return data_loss("header lists {} tensors, more than {}", header.size(), kMaxTensors);
  data_ = file.data() + 8 + header_bytes;
  data_bytes_ = file.size() - 8 - header_bytes;

  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) return data_loss("__metadata__ is not an object");
      continue;
    }
    TensorInfo info;
    PD_RETURN_IF_ERROR(parse_entry(name, entry, data_bytes_, &info));
    tensors_.emplace(name, std::move(info));
  }
  // Overlap check over tensors sorted by begin offset (empty tensors occupy nothing).
  std::vector<const TensorInfo*> by_offset;
  by_offset.reserve(tensors_.size());
  for (const auto& [name, info] : tensors_)
    if (info.data_end > info.data_begin) by_offset.push_back(&info);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const TensorInfo* a, const TensorInfo* b) { return a->data_begin < b->data_begin; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const TensorInfo* prev = by_offset[i - 1];
    const TensorInfo* cur = by_offset[i];
    if (cur->data_begin < prev->data_end)
      return data_loss("tensor '{}': data_offsets [{}, {}) overlap tensor '{}' [{}, {})", cur->name, cur->data_begin,
                       cur->data_end, prev->name, prev->data_begin, prev->data_end);
  }
  return Status::Ok();
}

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

std::span<const std::byte> SafetensorsFile::bytes(const TensorInfo& info) const {
  return {data_ + info.data_begin, static_cast<size_t>(info.data_end - info.data_begin)};
}

Status SafetensorsFile::read_as_f32(const TensorInfo& info, std::span<float> out) const {
  const size_t n = static_cast<size_t>(info.num_elements());
  if (out.size() != n)
    return internal_error("tensor '{}': destination holds {} floats, tensor has {}", info.name, out.size(), n);
  std::span<const std::byte> src = bytes(info);
  switch (info.dtype) {
    case TensorDtype::kF32:
      std::memcpy(out.data(), src.data(), n * 4);  // little-endian host assumed (x86-64, aarch64)
      return Status::Ok();
    case TensorDtype::kBF16:
    case TensorDtype::kF16: {
      const bool bf16 = info.dtype == TensorDtype::kBF16;
      for (size_t i = 0; i < n; ++i) {
        uint16_t bits;
        std::memcpy(&bits, src.data() + 2 * i, 2);
        out[i] = bf16 ? bf16_to_f32(bits) : f16_to_f32(bits);
      }
      return Status::Ok();
    }
    default:
      return invalid_argument("{}: tensor '{}': dtype {} cannot be used as model weights (F32, F16, BF16)",
                              path_.string(), info.name, tensor_dtype_name(info.dtype));
  }
}

Status SafetensorsFile::read_fp8_e4m3(const TensorInfo& info, std::span<uint8_t> out) const {
  if (info.dtype != TensorDtype::kF8E4M3)
    return invalid_argument("{}: tensor '{}' has dtype {}, expected F8_E4M3", path_.string(), info.name,
                            tensor_dtype_name(info.dtype));
  const size_t n = static_cast<size_t>(info.num_elements());
  if (out.size() != n)
    return internal_error("tensor '{}': destination holds {} bytes, tensor has {}", info.name, out.size(), n);
  std::memcpy(out.data(), bytes(info).data(), n);
  return Status::Ok();
}

bool SafetensorsCheckpoint::dir_has_weights(const std::filesystem::path& model_dir) {
  std::error_code ec;
  if (std::filesystem::exists(model_dir / "model.safetensors.index.json", ec)) return true;
  for (const auto& entry : std::filesystem::directory_iterator(model_dir, ec))
    if (entry.path().extension() == ".safetensors") return true;
  return false;
}

Result<SafetensorsCheckpoint> SafetensorsCheckpoint::open_dir(const std::filesystem::path& model_dir) {
  SafetensorsCheckpoint ckpt;
  std::vector<std::filesystem::path> shard_paths;
  std::error_code ec;
  const std::filesystem::path index_path = model_dir / "model.safetensors.index.json";
  if (std::filesystem::exists(index_path, ec)) {
    std::ifstream in(index_path);
    json index = json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (index.is_discarded() || !index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
      return data_loss("{}: not a JSON object with a 'weight_map' object", index_path.string());
    std::set<std::string> shards;
    for (const auto& [tensor, shard] : index["weight_map"].items()) {
      if (!shard.is_string())
        return data_loss("{}: tensor '{}' maps to a non-string shard", index_path.string(), tensor);
      const std::string shard_name = shard.get<std::string>();
      // Shard names are file names inside the model directory, nothing else.
      if (shard_name.empty() || shard_name.find('/') != std::string::npos || shard_name == "." || shard_name == "..")
        return data_loss("{}: tensor '{}' maps to bad shard name '{}'", index_path.string(), tensor, shard_name);
      shards.insert(shard_name);
    }
    for (const std::string& s : shards) shard_paths.push_back(model_dir / s);
  } else {
    for (const auto& entry : std::filesystem::directory_iterator(model_dir, ec))
      if (entry.path().extension() == ".safetensors") shard_paths.push_back(entry.path());
    std::sort(shard_paths.begin(), shard_paths.end());
  }
  if (ec) return not_found("{}: cannot list directory: {}", model_dir.string(), ec.message());
  if (shard_paths.empty()) return not_found("{}: no *.safetensors files", model_dir.string());
  for (const auto& p : shard_paths) {
    PD_ASSIGN_OR_RETURN(auto file, SafetensorsFile::open(p));
    for (const auto& [name, info] : file->tensors()) {
      auto [it, inserted] = ckpt.index_.emplace(name, Entry{file.get(), &info});
      if (!inserted)
        return data_loss("tensor '{}' appears in both {} and {}", name, it->second.file->path().string(), p.string());
    }
    ckpt.files_.push_back(std::move(file));
  }
  return ckpt;
}

Result<SafetensorsCheckpoint::Entry> SafetensorsCheckpoint::find(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) return not_found("tensor '{}' is missing from the checkpoint", name);
  return it->second;
}

}  // namespace pd::model
