// tokenizer_bench: single-thread encode/decode throughput of pd_tokenizer on a text file.
//
//   tokenizer_bench --dir assets/tokenizers/qwen3 --input mixed.txt [--chunk-bytes 4096] [--repeats 5]
//
// The file is cut into chunks at line ends (about chunk-bytes each, like request prompts), and each
// repeat encodes every chunk once; the best repeat is reported (wall and thread CPU time), as one
// JSON line on stdout.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <fstream>
#include <iostream>
#include <sstream>

#include "tokenizer/tokenizer.h"

int main(int argc, char** argv) {
  CLI::App app{"pd_tokenizer encode/decode throughput (one thread)"};
  std::string dir, input;
  size_t chunk_bytes = 4096;
  int repeats = 5;
  app.add_option("--dir", dir, "tokenizer folder")->required();
  app.add_option("--input", input, "UTF-8 text file")->required();
  app.add_option("--chunk-bytes", chunk_bytes, "approximate bytes per encode call");
  app.add_option("--repeats", repeats, "passes over the file; the best is reported");
  CLI11_PARSE(app, argc, argv);

  auto loaded = pd::tokenizer::Tokenizer::load(dir);
  if (!loaded.ok()) {
    std::cerr << loaded.status().to_string() << "\n";
    return 1;
  }
  const auto& tok = *loaded;
  std::ifstream in(input, std::ios::binary);
  if (!in) {
    std::cerr << "cannot open " << input << "\n";
    return 1;
  }
  std::ostringstream buffer;
  buffer << in.rdbuf();
  const std::string text = buffer.str();
  std::vector<std::string_view> chunks;
  for (size_t pos = 0; pos < text.size();) {
    size_t end = std::min(text.size(), pos + chunk_bytes);
    const size_t nl = text.find('\n', end);
    end = nl == std::string::npos ? text.size() : nl + 1;
    chunks.emplace_back(text.data() + pos, end - pos);
    pos = end;
  }

  // CPU time of this thread: the build machine is shared, so wall time mostly measures the neighbours.
  auto cpu_now = [] {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
  };
  using Clock = std::chrono::steady_clock;
  double best_encode_cpu_s = 1e30;
  double first_encode_cpu_s = 0;  // the first pass runs with a cold per-thread word cache
  double best_encode_s = 1e30, best_decode_s = 1e30;
  size_t num_tokens = 0;
  std::vector<std::vector<int32_t>> encoded(chunks.size());
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = Clock::now();
    const double c0 = cpu_now();
    size_t tokens = 0;
    for (size_t i = 0; i < chunks.size(); ++i) {
      encoded[i] = tok->encode(chunks[i], /*add_special_tokens=*/false);
      tokens += encoded[i].size();
    }
    const auto t1 = Clock::now();
    const double pass_cpu_s = cpu_now() - c0;
    if (r == 0) first_encode_cpu_s = pass_cpu_s;
    best_encode_cpu_s = std::min(best_encode_cpu_s, pass_cpu_s);
    size_t decoded_bytes = 0;
    for (const auto& ids : encoded) decoded_bytes += tok->decode(ids, false).size();
    const auto t2 = Clock::now();
    if (decoded_bytes != text.size()) {
      // NFC can change byte counts; report it rather than fail.
      std::cerr << "note: decoded " << decoded_bytes << " bytes of " << text.size() << "\n";
    }
    num_tokens = tokens;
    best_encode_s = std::min(best_encode_s, std::chrono::duration<double>(t1 - t0).count());
    best_decode_s = std::min(best_decode_s, std::chrono::duration<double>(t2 - t1).count());
  }
  const double mb = static_cast<double>(text.size()) / 1e6;
  std::cout << "{\"impl\":\"pd_tokenizer\",\"bytes\":" << text.size() << ",\"chunks\":" << chunks.size()
            << ",\"tokens\":" << num_tokens << ",\"encode_s\":" << best_encode_s
            << ",\"encode_cpu_s\":" << best_encode_cpu_s << ",\"encode_mb_per_s\":" << mb / best_encode_s
            << ",\"encode_mb_per_cpu_s\":" << mb / best_encode_cpu_s
            << ",\"cold_cache_encode_mb_per_cpu_s\":" << mb / first_encode_cpu_s
            << ",\"decode_mb_per_s\":" << mb / best_decode_s << "}" << std::endl;
  return 0;
}
