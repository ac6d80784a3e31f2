// Each own int8 GEMM of this CPU (int8_gemm.h) at one shape, one thread, from C++: five timed rounds of ~0.3 G
// multiply-adds each, the median and the best in G multiply-adds/s. Its outputs written (int8_gemm), or with a 4th
// argument k each row's summary (int8_gemm_summary): k = 1 its best output, as greedy search asks; k > 1 its k best
// and log-softmax terms, as beam search does. Linked against two builds of the library and
// run alternately (int8_gemm_ab.sh), so that the machine's drift over minutes falls on both alike.
//     git worktree add /tmp/before 70917c7 && cmake -S /tmp/before -B /tmp/cm-before
//     cmake --build /tmp/cm-before --target fastformer_cpu
//     cmake -S . -B /tmp/cm-after && cmake --build /tmp/cm-after --target fastformer_cpu
//     g++ -O2 -std=c++17 -Icsrc int8_gemm_ab.cpp /tmp/cm-before/libfastformer_cpu.a -fopenmp -o before
//     g++ -O2 -std=c++17 -Icsrc int8_gemm_ab.cpp /tmp/cm-after/libfastformer_cpu.a -fopenmp -o after
//     bash int8_gemm_ab.sh ./before ./after avx-vnni; bash int8_gemm_ab.sh ./before ./after avx2
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "int8_gemm.h"

using namespace fastformer;

int main(int argc, char** argv) {
  if (argc != 4 && argc != 5) {
    std::fprintf(stderr, "usage: %s rows in out [k]\n", argv[0]);
    return 2;
  }
  const int64_t rows = std::atoll(argv[1]), in = std::atoll(argv[2]), out = std::atoll(argv[3]);
  const int k = argc == 5 ? std::atoi(argv[4]) : 0;
  const int64_t groups = int8_input_groups(in), panels = int8_panel_count(out);
  std::vector<uint8_t> x_q(rows * groups * 4, 100);
  std::vector<float> x_scales(rows, 0.01f), w_scales(panels * 16, 0.01f), y(rows * out);
  std::vector<float> values(rows * std::max(k, 1)), tops(rows), log_totals(rows);
  std::vector<int64_t> ids(rows * std::max(k, 1));
  std::vector<int32_t> finite(rows);
  Int8RowSummary summary;
  summary.k = k;
  summary.values = values.data();
  summary.ids = ids.data();
  summary.finite = finite.data();
  if (k > 1) {
    summary.tops = tops.data();
    summary.log_totals = log_totals.data();
  }
  const double work = static_cast<double>(rows) * in * out;
  const int64_t calls = std::max<int64_t>(1, static_cast<int64_t>(3e8 / work));
  for (const Int8Gemm* gemm : int8_gemms()) {
    std::vector<int8_t> weight(out * in), packed(panels * groups * 64);
    std::vector<int32_t> offsets(panels * 16);
    for (size_t i = 0; i < weight.size(); ++i) {
      weight[i] = static_cast<int8_t>(static_cast<int64_t>(i * 37 % (2 * gemm->weight_max + 1)) - gemm->weight_max);
    }
    int8_pack_panels(weight.data(), out, in, gemm->zero_point, packed.data(), offsets.data());
    const auto run = [&] {
      if (k > 0) {
        int8_gemm_summary(*gemm, x_q.data(), x_scales.data(), rows, in, packed.data(), offsets.data(),
                          w_scales.data(), nullptr, out, 0, panels, summary);
      } else {
        int8_gemm(*gemm, x_q.data(), x_scales.data(), rows, in, packed.data(), offsets.data(), w_scales.data(),
                  nullptr, false, out, 0, panels, y.data());
      }
    };
    std::vector<double> rates;
    run();
    for (int round = 0; round < 5; ++round) {
      const auto start = std::chrono::steady_clock::now();
      for (int64_t i = 0; i < calls; ++i) run();
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      rates.push_back(work * calls / seconds / 1e9);
    }
    std::sort(rates.begin(), rates.end());
    std::printf("%ldx%ld->%ld k%d %s best %.1f median %.1f G/s\n", rows, in, out, k, gemm->isa, rates.back(),
                rates[2]);
  }
}
