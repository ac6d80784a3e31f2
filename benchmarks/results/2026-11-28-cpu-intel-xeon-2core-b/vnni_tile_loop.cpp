// The AVX-VNNI tile's inner loop alone (int8_gemm_avx2.inc: 6 rows x 16 outputs, a broadcast row and two weight
// vectors a group), over `rows` rows of 512 inputs and `panels` panels: whether memory or the instructions bound it.
//     g++ -O2 vnni_tile_loop.cpp -o vnni_tile_loop && ./vnni_tile_loop 6 1 && ./vnni_tile_loop 126 16
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

__attribute__((target("avx2,fma,avxvnni"), noinline))
void tile(const uint8_t* x, int64_t row_bytes, const int8_t* w, int64_t groups, int32_t* out) {
  __m256i sums[12];
  for (__m256i& sum : sums) sum = _mm256_setzero_si256();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 64));
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * 64 + 32));
#pragma GCC unroll 6
    for (int r = 0; r < 6; ++r) {
      int32_t four;
      std::memcpy(&four, x + r * row_bytes + g * 4, sizeof four);
      const __m256i row = _mm256_set1_epi32(four);
      sums[2 * r] = _mm256_dpbusd_avx_epi32(sums[2 * r], row, low);
      sums[2 * r + 1] = _mm256_dpbusd_avx_epi32(sums[2 * r + 1], row, high);
    }
  }
  for (int i = 0; i < 12; ++i) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8 * i), sums[i]);
}

int main(int argc, char** argv) {
  const int64_t in = 512, groups = in / 4;
  const int64_t rows = argc > 1 ? std::atoi(argv[1]) : 6;  // 6: the rows stay in L1; 126: in L2
  const int64_t panels = argc > 2 ? std::atoi(argv[2]) : 1;
  std::vector<uint8_t> x(rows * in, 100);
  std::vector<int8_t> w(panels * groups * 64, 3);
  std::vector<int32_t> out(96);
  const long repeats = 2000000 / (rows / 6) / panels;
  const auto start = std::chrono::steady_clock::now();
  for (long i = 0; i < repeats; ++i) {
    for (int64_t p = 0; p < panels; ++p) {
      for (int64_t r = 0; r + 6 <= rows; r += 6) {
        tile(x.data() + r * in, in, w.data() + p * groups * 64, groups, out.data());
      }
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double multiply_adds = static_cast<double>(repeats) * panels * (rows / 6) * 6 * 16 * in;
  std::printf("rows %ld, panels %ld: %.0f G multiply-adds/s\n", rows, panels, multiply_adds / seconds / 1e9);
}
