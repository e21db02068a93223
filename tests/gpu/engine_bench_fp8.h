// FP8 / MoE kernel-level forward passes for pd_gpu_engine_bench (engine_bench_fp8.cc).
#pragma once

#include <string>
#include <vector>

namespace pd::gpu_test {

struct Fp8Row {
  std::string what;
  double floor_ms;
  double measured_ms;
  std::string note;
};

// TFLOP/s of cuBLASLt's block-scaled FP8 GEMM at m x n x k (activations quantized
// beforehand); 0 with *note saying why when the mode is unavailable.
double measure_fp8_gemm_tflops(int m, int n, int k, std::string* note);

// name: qwen3-30b-a3b-fp8 | qwen3-235b-a22b-fp8 | qwen3-32b-fp8; layers_override > 0 replaces
// the layer count (the 235B shape defaults to 16 of its 94 layers); kv_fp8_batch > 0 adds a
// decode step at that batch with the FP8 KV cache.
void bench_fp8_model(const std::string& name, int layers_override, int ctx, double copy_gbs, double fp8_tflops,
                     bool decode_only, const std::vector<int>& decode_batches, int kv_fp8_batch,
                     std::vector<Fp8Row>* rows);

}  // namespace pd::gpu_test
