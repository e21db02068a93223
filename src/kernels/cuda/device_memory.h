// Device memory this process holds, counted per device: every long-lived
// allocation of the CUDA runner and its kernels goes through device_malloc, so
// the KV-cache budget (--gpu-memory-utilization) subtracts exactly this
// instance's weights and buffers — not what another process on the same GPU
// allocates while this one starts (a free-memory difference would count both).
// Allocations made inside libraries (cuBLASLt, NCCL, CUDA graphs) are not
// counted; the budget keeps a reserve for them.
#pragma once

#include <cstddef>

#include "common/status.h"

namespace pd::kernels::cuda {

// cudaMalloc on the current device, counted. *ptr is nullptr on failure.
Status device_malloc(void** ptr, size_t bytes, const char* what);
// Frees what device_malloc returned (nullptr is ignored) and uncounts it.
void device_free(void* ptr);
// Bytes held through device_malloc on CUDA device `device`.
size_t device_bytes_held(int device);

}  // namespace pd::kernels::cuda
