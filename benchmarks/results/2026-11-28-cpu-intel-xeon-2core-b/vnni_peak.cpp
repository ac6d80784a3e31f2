// The core's vpdpbusd rate on 256-bit (AVX-VNNI) and 512-bit (AVX512-VNNI) vectors: 12 independent sums, no loads.
//     g++ -O3 -mavx512f -mavx512vnni -mavx512vl -mavxvnni vnni_peak.cpp -o vnni_peak && ./vnni_peak
#include <immintrin.h>

#include <chrono>
#include <cstdio>

template <typename Vector, typename Dot>
long instructions_per_second(Vector one, Dot dot) {
  constexpr long kLoops = 200000000;
  Vector sums[12], row = one, weights = one;
  for (Vector& sum : sums) sum = one;
  const auto start = std::chrono::steady_clock::now();
  for (long i = 0; i < kLoops; ++i) {
#pragma GCC unroll 12
    for (Vector& sum : sums) sum = dot(sum, row, weights);
    asm volatile("" : "+v"(row));  // keeps the loop from being folded away
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (Vector& sum : sums) asm volatile("" : : "v"(sum));  // every sum is used: none is optimized away
  return static_cast<long>(12.0 * kLoops / seconds);
}

int main() {
  const long ymm = instructions_per_second(_mm256_set1_epi32(3), [](__m256i s, __m256i a, __m256i b) {
    return _mm256_dpbusd_avx_epi32(s, a, b);
  });
  const long zmm = instructions_per_second(_mm512_set1_epi32(3), [](__m512i s, __m512i a, __m512i b) {
    return _mm512_dpbusd_epi32(s, a, b);
  });
  std::printf("ymm (AVX-VNNI) vpdpbusd: %.2f G/s, %.0f G multiply-adds/s\n", ymm / 1e9, ymm * 32 / 1e9);
  std::printf("zmm (AVX512-VNNI) vpdpbusd: %.2f G/s, %.0f G multiply-adds/s\n", zmm / 1e9, zmm * 64 / 1e9);
}
