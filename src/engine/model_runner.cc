#include "engine/model_runner.h"

namespace pd::engine {

size_t kv_dtype_bytes(KvDtype dtype) {
  switch (dtype) {
    case KvDtype::kFloat32:
      return 4;
    case KvDtype::kBFloat16:
      return 2;
    case KvDtype::kFloat16:
      return 2;
    case KvDtype::kFp8E4m3:
      return 1;
  }
  return 0;
}

const char* kv_dtype_name(KvDtype dtype) {
  switch (dtype) {
    case KvDtype::kFloat32:
      return "float32";
    case KvDtype::kBFloat16:
      return "bfloat16";
    case KvDtype::kFloat16:
      return "float16";
    case KvDtype::kFp8E4m3:
      return "fp8_e4m3";
  }
  return "?";
}

}  // namespace pd::engine
