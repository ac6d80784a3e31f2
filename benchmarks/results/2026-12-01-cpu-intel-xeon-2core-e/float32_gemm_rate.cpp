// The AVX2 float32 GEMM (float32_gemm.h) from C++, one thread: its best of 30 calls at ROWS x IN x OUT, against the
// core's rate of 256-bit FMAs (12 independent chains, the best of 3 runs of 12 M), in G multiply-adds/s.
//     cmake -S <repo> -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build --target fastformer_cpu
//     g++ -O2 -std=c++17 -I<repo>/csrc float32_gemm_rate.cpp build/libfastformer_cpu.a -fopenmp -o rate && ./rate 256 512 2048
#include <immintrin.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include "float32_gemm.h"
using namespace fastformer;
template <typename T> T* aligned(size_t n) { return static_cast<T*>(aligned_alloc(64, (n * sizeof(T) + 4095) / 4096 * 4096)); }
__attribute__((target("avx2,fma"), noinline)) double peak() {
  __m256 s[12]; for (int i = 0; i < 12; ++i) s[i] = _mm256_set1_ps(i);
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(0.001f);
  auto t0 = std::chrono::steady_clock::now();
  for (int k = 0; k < 1000000; ++k) {
    s[0] = _mm256_fmadd_ps(s[0], a, b); s[1] = _mm256_fmadd_ps(s[1], a, b); s[2] = _mm256_fmadd_ps(s[2], a, b);
    s[3] = _mm256_fmadd_ps(s[3], a, b); s[4] = _mm256_fmadd_ps(s[4], a, b); s[5] = _mm256_fmadd_ps(s[5], a, b);
    s[6] = _mm256_fmadd_ps(s[6], a, b); s[7] = _mm256_fmadd_ps(s[7], a, b); s[8] = _mm256_fmadd_ps(s[8], a, b);
    s[9] = _mm256_fmadd_ps(s[9], a, b); s[10] = _mm256_fmadd_ps(s[10], a, b); s[11] = _mm256_fmadd_ps(s[11], a, b);
  }
  double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float sink = 0; for (int i = 0; i < 12; ++i) { float v[8]; _mm256_storeu_ps(v, s[i]); sink += v[0]; }
  if (sink == 1234.5f) printf(" ");
  return 12e6 * 8 / sec / 1e9;
}
int main(int argc, char** argv) {
  const Float32Gemm* g = nullptr;
  for (const Float32Gemm* x : float32_gemms()) if (std::string(x->isa) == "avx2") g = x;
  const int64_t rows = atol(argv[1]), in = atol(argv[2]), out = atol(argv[3]);
  const int64_t panels = gemm_panel_count(out);
  float* w = aligned<float>(out * in); for (int64_t i = 0; i < out * in; ++i) w[i] = (i % 7) * 0.01f;
  float* p = aligned<float>(panels * in * 16); float32_pack_panels(w, out, in, p);
  float* x = aligned<float>(rows * in); for (int64_t i = 0; i < rows * in; ++i) x[i] = (i % 5) * 0.1f;
  float* px = aligned<float>(float32_row_tiles(rows) * in * 6); float32_pack_rows(x, rows, in, px);
  float* y = aligned<float>(rows * out);
  double best = 1e9;
  for (int r = 0; r < 30; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    g->gemm(px, rows, in, p, nullptr, false, out, 0, panels, y);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  double pk = 0; for (int i = 0; i < 3; ++i) pk = std::max(pk, peak());
  printf("%lld x %lld x %lld: %.3f ms %.1f G/s; FMA peak %.1f G/s (%.0f%%)\n", (long long)rows, (long long)in, (long long)out, best * 1e3, rows * in * out / best / 1e9, pk, 100 * rows * in * out / best / 1e9 / pk);
}
