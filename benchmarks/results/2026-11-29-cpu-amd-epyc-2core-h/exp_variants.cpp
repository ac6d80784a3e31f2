// g++ -O2 -march=native -std=c++17 -o exp_variants exp_variants.cpp && ./exp_variants   (an AVX-512 CPU)
// The sum of e^x over 4 rows of 37000 floats x <= 0 (in L2), in AVX-512 intrinsics: "old" as the CPU loops compute
// e^x today (exp_nonpositive in beam_ops_cpu.inc: n = round(x / ln 2) by a magic constant, r by two products,
// a degree-6 polynomial, 2^n by the exponent's bits); "new" as 2^(x log2 e) with vrndscaleps, a degree-5 polynomial
// of 2^f on [-1/2, 1/2] (least squares on Chebyshev nodes) and vscalefps. Each variant's largest relative error
// against double's exp, then ns a logit, the best of 50 sums, three times.
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <vector>
#include <algorithm>
static const float P6[7] = {1.38888889e-3f, 8.33333333e-3f, 4.16666667e-2f, 1.66666667e-1f, 0.5f, 1.0f, 1.0f};
static const float Q5[6] = {0.0013266971f, 0.00967546f, 0.055507425f, 0.24022122f, 0.69314694f, 1.0000001f};
__attribute__((always_inline)) inline __m512 exp_old(__m512 x) {  // beam_ops_cpu.inc's, in intrinsics
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504f), magic), magic);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x));
  __m512 p = _mm512_set1_ps(P6[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(P6[i]));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
__attribute__((always_inline)) inline __m512 exp_new(__m512 x) {  // 2^(x log2 e): n + f, |f| <= 1/2
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(Q5[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(Q5[i]));
  return _mm512_scalef_ps(p, n);
}
template <bool New>
__attribute__((noinline)) float lse(const float* x, long n, float top) {
  __m512 tot[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  const __m512 tp = _mm512_set1_ps(top), ninf = _mm512_set1_ps(-INFINITY);
  for (long i = 0; i < n; i += 32) {
    for (int u = 0; u < 2; ++u) {
      __m512 v = _mm512_loadu_ps(x + i + 16 * u);
      __m512 d = _mm512_sub_ps(v, tp);
      __mmask16 m = _mm512_cmp_ps_mask(v, ninf, _CMP_NEQ_UQ);
      tot[u] = _mm512_mask_add_ps(tot[u], m, tot[u], New ? exp_new(d) : exp_old(d));
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(tot[0], tot[1]));
}
int main() {
  const long n = 4 * 37000 / 32 * 32;
  std::vector<float> x(n);
  for (long i = 0; i < n; ++i) x[i] = -(float)((i * 2654435761u) % 100000) * 1e-4f;
  for (float low : {-87.f, -20.f}) {
    double worst[2] = {0, 0};
    for (float v = low; v <= 0; v += 0.0001f) {
      float e[2][16];
      _mm512_storeu_ps(e[0], exp_old(_mm512_set1_ps(v)));
      _mm512_storeu_ps(e[1], exp_new(_mm512_set1_ps(v)));
      for (int w = 0; w < 2; ++w) worst[w] = std::max(worst[w], std::fabs(e[w][0] / std::exp((double)v) - 1));
    }
    printf("largest relative error on [%g, 0]: old %.3g, new %.3g\n", low, worst[0], worst[1]);
  }
  for (int rep = 0; rep < 3; ++rep) {
    for (int which = 0; which < 2; ++which) {
      double best = 1e30; float s = 0;
      for (int r = 0; r < 50; ++r) {
        auto t = std::chrono::steady_clock::now();
        s += which ? lse<true>(x.data(), n, 0.f) : lse<false>(x.data(), n, 0.f);
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
      }
      printf("%s: %.4f ns a logit (sum %.6g)\n", which ? "new" : "old", best * 1e9 / n, s / 50);
    }
  }
}
