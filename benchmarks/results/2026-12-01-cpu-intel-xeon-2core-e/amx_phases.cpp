// The AMX unit's rate over time on this machine, beside the core's clock: each sample times 200,000 tdpbusd from
// L1-resident tiles (2x2 blocking, as the int8 GEMM's AMX tile; G multiply-adds/s, 1024 a cycle at full rate) and
// then 3.2 M AVX-512 FMAs in 8 dependent chains (G lane-FMAs/s: bound by the FMA's latency, so by the clock).
//     g++ -O2 -mamx-tile -mamx-int8 -mavx512f -mfma amx_phases.cpp -o amx_phases && ./amx_phases 200
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};
alignas(64) uint8_t a[2][1024];
alignas(64) int8_t b[2][1024];

double amx_rate() {
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 50000; ++i) {
    _tile_loadd(4, a[0], 64);
    _tile_loadd(6, b[0], 64);
    _tile_dpbusd(0, 4, 6);
    _tile_loadd(7, b[1], 64);
    _tile_dpbusd(1, 4, 7);
    _tile_loadd(5, a[1], 64);
    _tile_dpbusd(2, 5, 6);
    _tile_dpbusd(3, 5, 7);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return 50000 * 4.0 * 16 * 16 * 64 / seconds / 1e9;
}

__attribute__((noinline)) double fma_rate() {
  __m512 chains[8];
  for (int i = 0; i < 8; ++i) chains[i] = _mm512_set1_ps(static_cast<float>(i));
  const __m512 m = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(0.001f);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < 400000; ++i) {
    for (auto& chain : chains) chain = _mm512_fmadd_ps(chain, m, c);
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  float sum = 0;
  for (auto& chain : chains) sum += _mm512_reduce_add_ps(chain);
  if (sum == 12345.0f) std::printf(" ");
  return 400000 * 8.0 * 16 / seconds / 1e9;
}

int main(int argc, char** argv) {
  syscall(SYS_arch_prctl, 0x1023, 18);  // ARCH_REQ_XCOMP_PERM, XTILEDATA
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.bytes_per_row[t] = 64;
  _tile_loadconfig(&config);
  std::printf("amx G/s / dependent-FMA G/s, sample by sample\n");
  for (int k = 0; k < (argc > 1 ? atoi(argv[1]) : 100); ++k) {
    const double amx = amx_rate();
    std::printf("%.0f/%.0f%s", amx, fma_rate(), k % 10 == 9 ? "\n" : " ");
  }
  _tile_release();
}
