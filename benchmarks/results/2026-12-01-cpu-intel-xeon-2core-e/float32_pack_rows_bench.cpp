// float32_pack_rows (float32_gemm.h) from C++, one thread: its best of 200 calls on ROWS x IN floats, in us.
//     g++ -O2 -std=c++17 -I<repo>/csrc float32_pack_rows_bench.cpp <build>/libfastformer_cpu.a -fopenmp -o pack
//     ./pack ROWS IN
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <vector>
#include "float32_gemm.h"
using namespace fastformer;
int main(int argc, char** argv) {
  const int64_t rows = atol(argv[1]), in = atol(argv[2]);
  std::vector<float> x(rows * in, 1.0f), p(float32_row_tiles(rows) * in * 6);
  double best = 1e9;
  for (int r = 0; r < 200; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    float32_pack_rows(x.data(), rows, in, p.data());
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  printf("%lld x %lld: %.1f us\n", (long long)rows, (long long)in, best * 1e6);
}
