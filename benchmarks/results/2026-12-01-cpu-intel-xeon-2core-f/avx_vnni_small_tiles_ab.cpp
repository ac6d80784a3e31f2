// The AVX-VNNI int8 GEMM's tiles before (old.inc: csrc/int8_gemm_avx2.inc at e7e0aac) and after (new.inc: the same
// file at the commit that adds this) in one process, one thread, through the library's int8_gemm: pairs of calls,
// old then new and new then old in turn, each pair's ratio old / new; prints the medians, the ratios' median and
// quartiles, and checks that both wrote the same outputs.
//     git show e7e0aac:csrc/int8_gemm_avx2.inc > old.inc; cp <repo>/csrc/int8_gemm_avx2.inc new.inc
//     g++ -O2 -std=c++17 -I<repo>/csrc -I. avx_vnni_small_tiles_ab.cpp <build>/libfastformer_cpu.a -fopenmp -o ab
//     ./ab ROWS IN OUT [PAIRS]
#include <immintrin.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>
#include "exp_nonpositive.h"
#include "int8_gemm.h"
#include "int8_gemm_tiles.h"
namespace fastformer {
#pragma GCC push_options
#pragma GCC target("avx2,fma,avxvnni")
#define FASTFORMER_INT8_AVX_VNNI 1
namespace old_vnni {
#include "old.inc"
}
namespace new_vnni {
#include "new.inc"
}
#pragma GCC pop_options
}  // namespace fastformer
using namespace fastformer;
template <typename T> T* aligned(size_t n) { return static_cast<T*>(aligned_alloc(64, (n * sizeof(T) + 4095) / 4096 * 4096)); }
int main(int argc, char** argv) {
  const Int8Gemm* gemms[2] = {&old_vnni::kGemm, &new_vnni::kGemm};
  const int64_t rows = atol(argv[1]), in = atol(argv[2]), out = atol(argv[3]);
  const int pairs = argc > 4 ? atoi(argv[4]) : 200;
  const int64_t groups = int8_input_groups(in), panels = gemm_panel_count(out);
  int8_t* weight = aligned<int8_t>(out * in);
  for (int64_t i = 0; i < out * in; ++i) weight[i] = static_cast<int8_t>(i * 37 % 255 - 127);
  int8_t* packed = aligned<int8_t>(int8_packed_bytes(out, in, 1));
  int32_t* offsets = aligned<int32_t>(panels * 16);
  int8_pack_panels(weight, out, in, 128, 1, packed, offsets);
  uint8_t* x_q = aligned<uint8_t>(rows * groups * 4);
  for (int64_t i = 0; i < rows * groups * 4; ++i) x_q[i] = static_cast<uint8_t>(i * 53 % 255 + 1);
  float* x_scales = aligned<float>(rows); float* w_scales = aligned<float>(panels * 16);
  float* y[2] = {aligned<float>(rows * out), aligned<float>(rows * out)};
  std::fill(x_scales, x_scales + rows, 0.01f); std::fill(w_scales, w_scales + panels * 16, 0.01f);
  auto call = [&](int which) {
    auto t0 = std::chrono::steady_clock::now();
    int8_gemm(*gemms[which], x_q, x_scales, rows, in, packed, offsets, w_scales, nullptr, false, out, 0, panels, y[which]);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  for (int i = 0; i < 5; ++i) { call(0); call(1); }
  if (std::memcmp(y[0], y[1], rows * out * sizeof(float)) != 0) { std::printf("outputs differ\n"); return 1; }
  std::vector<double> ratios, times[2];
  for (int p = 0; p < pairs; ++p) {
    const int first = p % 2;
    double t[2];
    t[first] = call(first);
    t[1 - first] = call(1 - first);
    ratios.push_back(t[0] / t[1]);
    times[0].push_back(t[0]); times[1].push_back(t[1]);
  }
  auto median = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
  auto quant = [](std::vector<double> v, double q) { std::sort(v.begin(), v.end()); return v[size_t(q * (v.size() - 1))]; };
  std::printf("%ld x %ld -> %ld: old %.1f us, new %.1f us (medians), old/new median %.3f (quartiles %.3f-%.3f), outputs equal\n",
              rows, in, out, median(times[0]) * 1e6, median(times[1]) * 1e6, median(ratios), quant(ratios, 0.25), quant(ratios, 0.75));
}
