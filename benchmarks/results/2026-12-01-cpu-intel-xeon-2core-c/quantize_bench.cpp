// row_absmax_cpu and the int8 GEMM's quantize_row (the AVX-512 ones' here), GB/s of float rows, one thread, best of
// 7 rounds; then a checksum of the quantized bytes. Built against the C++ library of each commit:
//     cmake -S . -B build && cmake --build build --target fastformer_cpu
//     g++ -O2 -std=c++17 -Icsrc quantize_bench.cpp build/libfastformer_cpu.a -fopenmp -o bench && ./bench
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cstdint>
#include "beam_ops.h"
#include "int8_gemm.h"
using namespace fastformer;
int main() {
  const Int8Gemm* g = int8_gemm_here();
  uint64_t checksum = 0;
  for (auto [rows, in] : std::vector<std::pair<int64_t, int64_t>>{{16, 2048}, {256, 2048}, {1344, 2048}, {64, 512}, {1344, 512}}) {
    float* x = static_cast<float*>(std::aligned_alloc(64, rows * in * 4));
    for (int64_t i = 0; i < rows * in; ++i) x[i] = ((i * 37) % 1001) * 0.001f - 0.5f;
    uint8_t* q = static_cast<uint8_t*>(std::aligned_alloc(64, size_t(rows) * in));
    std::vector<float> absmax(rows);
    const int reps = std::max<int64_t>(3, 200000000 / (rows * in * 4));
    double best[3] = {1e9, 1e9, 1e9};
    for (int round = 0; round < 7; ++round) {
      auto t0 = std::chrono::steady_clock::now();
      for (int k = 0; k < reps; ++k) row_absmax_cpu(x, rows, in, absmax.data());
      auto t1 = std::chrono::steady_clock::now();
      for (int k = 0; k < reps; ++k)
        for (int64_t r = 0; r < rows; ++r) g->quantize_row(x + r * in, in, 127.0f / absmax[r], q + r * in);
      auto t2 = std::chrono::steady_clock::now();
      // as linear.cpp's row_scales: 16 KB of rows' absmax, then each of them quantized from L1
      const int64_t block = std::max<int64_t>(1, (16 << 10) / (in * 4));
      for (int k = 0; k < reps; ++k)
        for (int64_t r = 0; r < rows; r += block) {
          const int64_t n = std::min(block, rows - r);
          row_absmax_cpu(x + r * in, n, in, absmax.data() + r);
          for (int64_t j = r; j < r + n; ++j) g->quantize_row(x + j * in, in, 127.0f / absmax[j], q + j * in);
        }
      auto t3 = std::chrono::steady_clock::now();
      best[0] = std::min(best[0], std::chrono::duration<double>(t1 - t0).count() / reps);
      best[1] = std::min(best[1], std::chrono::duration<double>(t2 - t1).count() / reps);
      best[2] = std::min(best[2], std::chrono::duration<double>(t3 - t2).count() / reps);
    }
    for (int64_t i = 0; i < rows * in; ++i) checksum = checksum * 31 + q[i];
    const double b = rows * in * 4;
    std::printf("%s %5lld x %4lld (%5.1f MB) | absmax %5.1f | quantize_row %5.1f | both as row_scales %5.1f GB/s\n", g->isa,
                (long long)rows, (long long)in, b / 1e6, b / best[0] / 1e9, b / best[1] / 1e9, b / best[2] / 1e9);
  }
  std::printf("checksum of the bytes %016llx\n", (unsigned long long)checksum);
}
