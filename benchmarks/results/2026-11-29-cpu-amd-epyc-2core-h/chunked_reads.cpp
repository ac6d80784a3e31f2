#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <random>
// g++ -O2 -march=native -o chunked_reads chunked_reads.cpp && ./chunked_reads CHUNK PATTERN   (an AVX-512 CPU)
// One thread reads a 256 MiB buffer (from memory) in contiguous CHUNK-byte pieces in random order, as the attention
// ops read a row's cache entries: GB/s, three passes. PATTERN 0: each piece's lines in order; 1: as a float16 cache
// of 8 heads read position-major, a head at a time (128 bytes of each 1 KB); 2: as 0, each line read also asking for
// the same line of the next piece (prefetcht1); 3: as 2, asking only for each 4 KB page's first 4 lines.
int main(int argc, char** argv) {
  const size_t total = 256u << 20, chunk = atoi(argv[1]); const int pattern = atoi(argv[2]);
  std::vector<char> buf(total, 1);
  std::vector<size_t> order(total / chunk);
  for (size_t i = 0; i < order.size(); ++i) order[i] = i * chunk;
  std::shuffle(order.begin(), order.end(), std::mt19937(1));
  for (int rep = 0; rep < 3; ++rep) {
    __m512 acc = _mm512_setzero_ps();
    auto t = std::chrono::steady_clock::now();
    for (size_t c = 0; c < order.size(); ++c) {
      const char* base = buf.data() + order[c];
      const char* next = buf.data() + order[c + 1 < order.size() ? c + 1 : c];
      if (pattern == 2) {
        for (size_t o = 0; o < chunk; o += 64) { __builtin_prefetch(next + o, 0, 2); acc = _mm512_add_ps(acc, _mm512_load_ps((const float*)(base + o))); }
      } else if (pattern == 3) {
        for (size_t o = 0; o < chunk; o += 64) { if (o % 4096 < 256) __builtin_prefetch(next + o, 0, 2); acc = _mm512_add_ps(acc, _mm512_load_ps((const float*)(base + o))); }
      } else if (pattern == 0) {
        for (size_t o = 0; o < chunk; o += 64) acc = _mm512_add_ps(acc, _mm512_load_ps((const float*)(base + o)));
      } else {  // 1 KB positions, 8 heads of 128 B: head outer, position inner
        for (size_t h = 0; h < 1024; h += 128)
          for (size_t p = 0; p < chunk; p += 1024)
            for (size_t o = 0; o < 128; o += 64) acc = _mm512_add_ps(acc, _mm512_load_ps((const float*)(base + p + h + o)));
      }
    }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    float x[16]; _mm512_storeu_ps(x, acc);
    printf("chunk %zu pattern %d: %.1f GB/s (%g)\n", chunk, pattern, total / s / 1e9, x[0]);
  }
}
