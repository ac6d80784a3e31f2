// A core's peak multiply-add rates, measured: 12 independent accumulators of VNNI's vpdpbusd (64 int8 multiply-adds
// each, on 512 bits) and of AVX2's vfmadd231ps (8 float multiply-adds each), so that the loops are bound by the
// instructions' throughput, not their latency. Single-threaded.
//   g++ -O3 -mavx512f -mavx512vnni -mavx2 -mfma -o peak_probe peak_probe.cpp && ./peak_probe
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>

template <typename F>
double best_seconds(F run) {
  double best = 1e9;
  for (int i = 0; i < 7; ++i) {
    const auto start = std::chrono::steady_clock::now();
    run();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

int main() {
  constexpr int64_t kRounds = 20'000'000;
  // Twelve named accumulators, each chain 12 instructions apart: more than the instruction's latency times its
  // issue rate, so that the loop is bound by throughput.
  __m512i a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11;
  __m512i x = _mm512_set1_epi32(0x01010101), y = _mm512_set1_epi32(0x02020202);
  const double vnni_seconds = best_seconds([&] {
    // Distinct starts, so that no two chains are the same computation to the compiler.
    a0 = _mm512_set1_epi32(0), a1 = _mm512_set1_epi32(1), a2 = _mm512_set1_epi32(2), a3 = _mm512_set1_epi32(3);
    a4 = _mm512_set1_epi32(4), a5 = _mm512_set1_epi32(5), a6 = _mm512_set1_epi32(6), a7 = _mm512_set1_epi32(7);
    a8 = _mm512_set1_epi32(8), a9 = _mm512_set1_epi32(9), a10 = _mm512_set1_epi32(10), a11 = _mm512_set1_epi32(11);
    for (int64_t i = 0; i < kRounds; ++i) {
      asm volatile("" : "+v"(x), "+v"(y));  // unknown to the compiler each round: no chain is folded
      a0 = _mm512_dpbusd_epi32(a0, x, y), a1 = _mm512_dpbusd_epi32(a1, x, y), a2 = _mm512_dpbusd_epi32(a2, x, y);
      a3 = _mm512_dpbusd_epi32(a3, x, y), a4 = _mm512_dpbusd_epi32(a4, x, y), a5 = _mm512_dpbusd_epi32(a5, x, y);
      a6 = _mm512_dpbusd_epi32(a6, x, y), a7 = _mm512_dpbusd_epi32(a7, x, y), a8 = _mm512_dpbusd_epi32(a8, x, y);
      a9 = _mm512_dpbusd_epi32(a9, x, y), a10 = _mm512_dpbusd_epi32(a10, x, y), a11 = _mm512_dpbusd_epi32(a11, x, y);
    }
  });
  const __m512i vnni_sum = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11;
  __m256 f0, f1, f2, f3, f4, f5, f6, f7, f8, f9, f10, f11;
  __m256 u = _mm256_set1_ps(1.0f), w = _mm256_set1_ps(1e-9f);
  const double fma_seconds = best_seconds([&] {
    f0 = _mm256_set1_ps(0), f1 = _mm256_set1_ps(1), f2 = _mm256_set1_ps(2), f3 = _mm256_set1_ps(3);
    f4 = _mm256_set1_ps(4), f5 = _mm256_set1_ps(5), f6 = _mm256_set1_ps(6), f7 = _mm256_set1_ps(7);
    f8 = _mm256_set1_ps(8), f9 = _mm256_set1_ps(9), f10 = _mm256_set1_ps(10), f11 = _mm256_set1_ps(11);
    for (int64_t i = 0; i < kRounds; ++i) {
      asm volatile("" : "+x"(u), "+x"(w));
      f0 = _mm256_fmadd_ps(u, w, f0), f1 = _mm256_fmadd_ps(u, w, f1), f2 = _mm256_fmadd_ps(u, w, f2);
      f3 = _mm256_fmadd_ps(u, w, f3), f4 = _mm256_fmadd_ps(u, w, f4), f5 = _mm256_fmadd_ps(u, w, f5);
      f6 = _mm256_fmadd_ps(u, w, f6), f7 = _mm256_fmadd_ps(u, w, f7), f8 = _mm256_fmadd_ps(u, w, f8);
      f9 = _mm256_fmadd_ps(u, w, f9), f10 = _mm256_fmadd_ps(u, w, f10), f11 = _mm256_fmadd_ps(u, w, f11);
    }
  });
  const __m256 fma_sum = f0 + f1 + f2 + f3 + f4 + f5 + f6 + f7 + f8 + f9 + f10 + f11;
  const double vnni_macs = 12.0 * kRounds * 64 / vnni_seconds, fma_macs = 12.0 * kRounds * 8 / fma_seconds;
  std::printf("{\"vnni_int8_gmacs\": %.1f, \"avx2_fma_float_gmacs\": %.1f}\n", vnni_macs / 1e9, fma_macs / 1e9);
  // The sums printed to stderr, so that the compiler keeps every chain.
  std::fprintf(stderr, "%d %g\n", _mm512_reduce_add_epi32(vnni_sum), fma_sum[0]);
  return 0;
}
