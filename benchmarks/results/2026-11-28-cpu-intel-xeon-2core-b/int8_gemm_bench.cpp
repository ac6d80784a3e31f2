// Each own int8 GEMM this CPU runs (int8_gemm.h), one thread, 128 rows x 512 -> 2048, from C++: G multiply-adds/s.
//     cmake -S . -B build && cmake --build build --target fastformer_cpu
//     g++ -O2 -std=c++17 -Icsrc int8_gemm_bench.cpp build/libfastformer_cpu.a -fopenmp -o bench && ./bench
#include <chrono>
#include <cstdio>
#include <vector>

#include "int8_gemm.h"

using namespace fastformer;

int main() {
  const int64_t rows = 128, in = 512, out = 2048, calls = 2000;
  const int64_t groups = int8_input_groups(in), panels = int8_panel_count(out);
  for (const Int8Gemm* gemm : int8_gemms()) {
    std::vector<int8_t> weight(out * in);
    for (size_t i = 0; i < weight.size(); ++i) {
      weight[i] = static_cast<int8_t>(static_cast<int64_t>(i * 37 % (2 * gemm->weight_max + 1)) - gemm->weight_max);
    }
    std::vector<int8_t> packed(panels * groups * 64);
    std::vector<int32_t> offsets(panels * 16);
    int8_pack_panels(weight.data(), out, in, gemm->zero_point, packed.data(), offsets.data());
    std::vector<uint8_t> x_q(rows * groups * 4, 100);
    std::vector<float> x_scales(rows, 0.01f), w_scales(panels * 16, 0.01f), y(rows * out);
    const auto run = [&] {
      int8_gemm(*gemm, x_q.data(), x_scales.data(), rows, in, packed.data(), offsets.data(), w_scales.data(),
                nullptr, false, out, 0, panels, y.data());
    };
    for (int i = 0; i < 20; ++i) run();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) run();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / calls;
    std::printf("%s: %.3f ms %.0f G/s\n", gemm->isa, seconds * 1e3, rows * in * out / seconds / 1e9);
  }
}
