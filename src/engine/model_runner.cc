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
  }
  return 0;
}

}  // namespace pd::engine
