#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
static const int N = 256;
alignas(64) uint16_t h[N * 64];
alignas(64) float f[N * 64];
alignas(64) float w[N];
#define F32(p, j) _mm512_load_ps(f + (p) * 64 + 16 * (j))
#define F16(p, j) _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)(h + (p) * 64 + 16 * (j))))
template <int MODE> __attribute__((noinline)) float run(int reps) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  const __m512i hi = _mm512_set1_epi32(0xFFFF0000);
  for (int r = 0; r < reps; ++r)
    for (int p = 0; p < N; p += 2) {
      const __m512 w0 = _mm512_set1_ps(w[p]), w1 = _mm512_set1_ps(w[p + 1]);
      if (MODE == 0) {
        a0 = _mm512_fmadd_ps(w0, F32(p, 0), a0); a1 = _mm512_fmadd_ps(w0, F32(p, 1), a1);
        a2 = _mm512_fmadd_ps(w0, F32(p, 2), a2); a3 = _mm512_fmadd_ps(w0, F32(p, 3), a3);
        a4 = _mm512_fmadd_ps(w1, F32(p + 1, 0), a4); a5 = _mm512_fmadd_ps(w1, F32(p + 1, 1), a5);
        a6 = _mm512_fmadd_ps(w1, F32(p + 1, 2), a6); a7 = _mm512_fmadd_ps(w1, F32(p + 1, 3), a7);
      } else if (MODE == 1) {
        a0 = _mm512_fmadd_ps(w0, F16(p, 0), a0); a1 = _mm512_fmadd_ps(w0, F16(p, 1), a1);
        a2 = _mm512_fmadd_ps(w0, F16(p, 2), a2); a3 = _mm512_fmadd_ps(w0, F16(p, 3), a3);
        a4 = _mm512_fmadd_ps(w1, F16(p + 1, 0), a4); a5 = _mm512_fmadd_ps(w1, F16(p + 1, 1), a5);
        a6 = _mm512_fmadd_ps(w1, F16(p + 1, 2), a6); a7 = _mm512_fmadd_ps(w1, F16(p + 1, 3), a7);
      } else if (MODE == 3) {
#define B16(p, j) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_load_si256((const __m256i*)(h + (p) * 64 + 16 * (j)))), 16))
        a0 = _mm512_fmadd_ps(w0, B16(p, 0), a0); a1 = _mm512_fmadd_ps(w0, B16(p, 1), a1);
        a2 = _mm512_fmadd_ps(w0, B16(p, 2), a2); a3 = _mm512_fmadd_ps(w0, B16(p, 3), a3);
        a4 = _mm512_fmadd_ps(w1, B16(p + 1, 0), a4); a5 = _mm512_fmadd_ps(w1, B16(p + 1, 1), a5);
        a6 = _mm512_fmadd_ps(w1, B16(p + 1, 2), a6); a7 = _mm512_fmadd_ps(w1, B16(p + 1, 3), a7);
      } else {
        const __m512i x0 = _mm512_load_si512(h + p * 64), x1 = _mm512_load_si512(h + p * 64 + 32);
        const __m512i y0 = _mm512_load_si512(h + p * 64 + 64), y1 = _mm512_load_si512(h + p * 64 + 96);
        a0 = _mm512_fmadd_ps(w0, _mm512_castsi512_ps(_mm512_slli_epi32(x0, 16)), a0);
        a1 = _mm512_fmadd_ps(w0, _mm512_castsi512_ps(_mm512_and_si512(x0, hi)), a1);
        a2 = _mm512_fmadd_ps(w0, _mm512_castsi512_ps(_mm512_slli_epi32(x1, 16)), a2);
        a3 = _mm512_fmadd_ps(w0, _mm512_castsi512_ps(_mm512_and_si512(x1, hi)), a3);
        a4 = _mm512_fmadd_ps(w1, _mm512_castsi512_ps(_mm512_slli_epi32(y0, 16)), a4);
        a5 = _mm512_fmadd_ps(w1, _mm512_castsi512_ps(_mm512_and_si512(y0, hi)), a5);
        a6 = _mm512_fmadd_ps(w1, _mm512_castsi512_ps(_mm512_slli_epi32(y1, 16)), a6);
        a7 = _mm512_fmadd_ps(w1, _mm512_castsi512_ps(_mm512_and_si512(y1, hi)), a7);
      }
    }
  __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                           _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
  return _mm512_reduce_add_ps(s);
}
int main() {
  for (int i = 0; i < N * 64; ++i) { h[i] = 0x3c00; f[i] = 1; }
  for (int i = 0; i < N; ++i) w[i] = 1e-9f;
  const int reps = 40000;
  for (int round = 0; round < 2; ++round)
    for (int m = 0; m < 4; ++m) {
      auto t0 = std::chrono::steady_clock::now();
      float s = m == 0 ? run<0>(reps) : m == 1 ? run<1>(reps) : m == 2 ? run<2>(reps) : run<3>(reps);
      double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
      printf("mode %d: %.3f ns a position (%g)\n", m, ns / (reps * (double)N), s);
    }
}
