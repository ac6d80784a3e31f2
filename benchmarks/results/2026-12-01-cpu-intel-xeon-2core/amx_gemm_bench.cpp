// The AMX int8 GEMM against AVX512-VNNI's (int8_gemm.h), one thread, from C++, at the base model's shapes: each
// shape's calls alternate between the two GEMMs on the same packed weights and rows, ms a call and G multiply-adds/s
// (the medians of 5 rounds of `calls` calls), and whether their outputs are bitwise equal.
//     cmake -S . -B build && cmake --build build --target fastformer_cpu
//     g++ -O2 -std=c++17 -Icsrc amx_gemm_bench.cpp build/libfastformer_cpu.a -fopenmp -o bench && ./bench
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#include "int8_gemm.h"

using namespace fastformer;

int main() {
  const Int8Gemm* amx = nullptr;
  for (const Int8Gemm* gemm : int8_gemms()) {
    if (gemm->fewer_rows) amx = gemm;
  }
  if (!amx) {
    std::printf("no AMX int8 GEMM runs here\n");
    return 1;
  }
  const Int8Gemm* vnni = amx->fewer_rows;
  Int8Gemm amx_at_every_row_count = *amx;  // its own tiles below min_rows too, to find where they stop paying
  amx_at_every_row_count.fewer_rows = nullptr;
  struct Shape { int64_t in, out; const char* what; };
  const Shape shapes[] = {{512, 1536, "self-attention qkv"}, {512, 512, "attention out"}, {512, 2048, "ffn 1"},
                          {2048, 512, "ffn 2"}, {512, 37000, "output projection"}};
  std::printf("rows in out what | AVX512-VNNI ms G/s | AMX ms G/s | AMX speed-up | bitwise equal\n");
  for (const Shape& shape : shapes) {
    for (int64_t rows : {4, 8, 12, 16, 32, 64, 128, 256, 1344}) {
      if (shape.out == 37000 && rows == 1344) continue;
      const int64_t in = shape.in, out = shape.out, groups = int8_input_groups(in), panels = gemm_panel_count(out);
      std::vector<int8_t> weight(out * in);
      for (size_t i = 0; i < weight.size(); ++i) {
        weight[i] = static_cast<int8_t>(static_cast<int64_t>(i * 37 % 255) - 127);
      }
      std::vector<int8_t> packed(int8_packed_bytes(out, in, amx->tile_panels));
      std::vector<int32_t> offsets(panels * 16);
      int8_pack_panels(weight.data(), out, in, amx->zero_point, amx->tile_panels, packed.data(), offsets.data());
      std::vector<uint8_t> x_q(rows * groups * 4);
      for (size_t i = 0; i < x_q.size(); ++i) x_q[i] = static_cast<uint8_t>(i * 53 % 255 + 1);
      std::vector<float> x_scales(rows, 0.01f), w_scales(panels * 16, 0.01f), y_vnni(rows * out), y_amx(rows * out);
      const auto run = [&](const Int8Gemm& gemm, std::vector<float>& y) {
        int8_gemm(gemm, x_q.data(), x_scales.data(), rows, in, packed.data(), offsets.data(), w_scales.data(),
                  nullptr, false, out, 0, panels, y.data());
      };
      const double work = double(rows) * in * out;
      const int calls = std::max(3, static_cast<int>(2e9 / work));
      std::vector<double> times[2];
      for (int round = 0; round < 6; ++round) {
        for (int which = 0; which < 2; ++which) {
          const Int8Gemm& gemm = which ? amx_at_every_row_count : *vnni;
          std::vector<float>& y = which ? y_amx : y_vnni;
          const auto start = std::chrono::steady_clock::now();
          for (int i = 0; i < calls; ++i) run(gemm, y);
          const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
          if (round) times[which].push_back(seconds / calls);  // round 0 warms up
        }
      }
      for (auto& t : times) std::sort(t.begin(), t.end());
      const double vnni_s = times[0][2], amx_s = times[1][2];
      std::printf("%lld %lld %lld %s | %.3f %.0f | %.3f %.0f | %.2fx | %s\n", (long long)rows, (long long)in,
                  (long long)out, shape.what, vnni_s * 1e3, work / vnni_s / 1e9, amx_s * 1e3, work / amx_s / 1e9,
                  vnni_s / amx_s, std::memcmp(y_vnni.data(), y_amx.data(), y_amx.size() * 4) == 0 ? "yes" : "NO");
    }
  }
}
