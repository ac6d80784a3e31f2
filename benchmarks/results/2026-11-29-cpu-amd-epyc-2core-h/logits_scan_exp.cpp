// From the repository root, after ctest's cmake build (build/cmake/libfastformer_cpu.a):
//   g++ -O2 -std=c++17 -I csrc -o scan_exp logits_scan_exp.cpp build/cmake/libfastformer_cpu.a -lpthread && ./scan_exp
// float32's logits scan (CpuLoops::top_k_row: a row's 8 best, and with `top` its log-softmax terms, the sum of
// e^(x - top) over the row) over 4 rows of 37000 (in L2 after the first round) and over 128 (from memory, as the
// search's): ns a logit, the best of 30 rounds, with and without the log-softmax terms.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>
#include "beam_ops.h"
using fastformer::CpuLoops;
int main() {
  const CpuLoops& loops = fastformer::cpu_loops();
  const int64_t vocab = 37000;
  for (int64_t rows : {4, 128}) {
    std::vector<float> block(rows * vocab);
    for (int64_t i = 0; i < rows * vocab; ++i) block[i] = static_cast<float>((i * 2654435761u) % 100000) * 1e-4f;
    float values[8], top, log_total; int64_t ids[8], ex[2] = {0, 1};
    for (bool with_top : {true, false}) {
      double best = 1e30;
      for (int r = 0; r < 30; ++r) {
        if (rows == 128) for (int64_t i = 0; i < rows * vocab; i += 16) block[i] += 0;  // touch
        auto t = std::chrono::steady_clock::now();
        for (int64_t row = 0; row < rows; ++row)
          loops.top_k_row(block.data() + row * vocab, vocab, 8, ex, 2, -1, values, ids, with_top ? &top : nullptr, &log_total);
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
      }
      std::printf("%s, %ld rows, %s: %.3f ns a logit\n", loops.isa, rows, with_top ? "best 8 and log-softmax terms" : "best 8 only", best * 1e9 / (rows * vocab));
    }
  }
}
