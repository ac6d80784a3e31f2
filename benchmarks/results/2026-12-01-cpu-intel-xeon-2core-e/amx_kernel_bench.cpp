// The AMX int8 GEMM (int8_gemm.h) from C++, one thread, aligned buffers: int8_gemm at ROWS x IN x OUT, its best
// call of 10 rounds timed only when a probe of bare tdpbusd first reads >= 2300 G/s (the machine's AMX rate moves by
// up to 4x: amx_phases.log), in ms and G multiply-adds/s, and a checksum of the outputs.
//     g++ -O2 -std=c++17 -I<repo>/csrc amx_kernel_bench.cpp <build>/libfastformer_cpu.a -fopenmp -o bench
//     ./bench ROWS IN OUT
#include <immintrin.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <unistd.h>
#include "int8_gemm.h"
using namespace fastformer;
template <typename T> T* aligned(size_t n) { return static_cast<T*>(aligned_alloc(64, (n * sizeof(T) + 4095) / 4096 * 4096)); }
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-int8")
struct alignas(64) Cfg { uint8_t palette=1, start=0, r[14]={}; uint16_t bpr[16]={}; uint8_t rows[16]={}; };
alignas(64) static uint8_t PA[2][1024]; alignas(64) static int8_t PB[2][1024];
double probe() {
  Cfg c; for (int t=0;t<8;++t){c.rows[t]=16;c.bpr[t]=64;} _tile_loadconfig(&c);
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 20000; ++i) {
    _tile_loadd(4, PA[0], 64); _tile_loadd(6, PB[0], 64); _tile_dpbusd(0,4,6);
    _tile_loadd(7, PB[1], 64); _tile_dpbusd(1,4,7);
    _tile_loadd(5, PA[1], 64); _tile_dpbusd(2,5,6); _tile_dpbusd(3,5,7);
  }
  double r = 20000*4.0*16384/std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count()/1e9;
  _tile_release();
  return r;
}
#pragma GCC pop_options
int main(int argc, char** argv) {
  const Int8Gemm* amx = nullptr;
  for (const Int8Gemm* gemm : int8_gemms()) if (gemm->fewer_rows) amx = gemm;
  if (!amx) { std::printf("no AMX\n"); return 1; }
  const int64_t rows = atol(argv[1]), in = atol(argv[2]), out = atol(argv[3]);
  const int64_t groups = int8_input_groups(in), panels = gemm_panel_count(out);
  int8_t* weight = aligned<int8_t>(out * in);
  for (int64_t i = 0; i < out * in; ++i) weight[i] = static_cast<int8_t>(i * 37 % 255 - 127);
  int8_t* packed = aligned<int8_t>(int8_packed_bytes(out, in, amx->tile_panels));
  int32_t* offsets = aligned<int32_t>(panels * 16);
  int8_pack_panels(weight, out, in, amx->zero_point, amx->tile_panels, packed, offsets);
  uint8_t* x_q = aligned<uint8_t>(rows * groups * 4);
  for (int64_t i = 0; i < rows * groups * 4; ++i) x_q[i] = static_cast<uint8_t>(i * 53 % 255 + 1);
  float* x_scales = aligned<float>(rows); float* w_scales = aligned<float>(panels * 16); float* y = aligned<float>(rows * out);
  std::fill(x_scales, x_scales + rows, 0.01f); std::fill(w_scales, w_scales + panels * 16, 0.01f);
  const double work = double(rows) * in * out;
  const int calls = std::max(2, static_cast<int>(2e8 / work));
  double best = 1e9; int fast = 0, tries = 0;
  for (; fast < 10 && tries < 3000; ++tries) {
    if (probe() < 2300) { usleep(2000); continue; }
    ++fast;
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i)
      int8_gemm(*amx, x_q, x_scales, rows, in, packed, offsets, w_scales, nullptr, false, out, 0, panels, y);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / calls);
  }
  double check = 0; for (int64_t i = 0; i < rows * out; ++i) check += y[i];
  std::printf("%lld x %lld x %lld: %.3f ms %.0f G/s (%d fast of %d) check %.6g\n", (long long)rows, (long long)in,
              (long long)out, best * 1e3, work / best / 1e9, fast, tries, check);
}
