// top_k_row_cpu (beam_ops.h) over 128 rows of 37,000 floats (19 MB: the rows come from L3, as a search's block of
// logits does), k = 8 (beam 4's candidates), with and without the log-softmax's terms: the best of 15 passes, in
// microseconds a row. Random rows (N(0, 3): the k-th best rises ~70 times a row) and the same rows sorted in
// descending order (nothing past the first k beats it: the scan alone).
//
//   cmake -S . -B build/cmake && cmake --build build/cmake --target fastformer_cpu
//   g++ -O2 -std=c++17 -Icsrc top_k_row_bench.cpp build/cmake/libfastformer_cpu.a -o top_k_row_bench
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <random>
#include <vector>

#include "beam_ops.h"

int main() {
  const int64_t vocab = 37000, rows = 128, k = 8;
  std::vector<float> random_rows(rows * vocab);
  std::mt19937 generator(0);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (float& x : random_rows) x = normal(generator);
  std::vector<float> sorted_rows(random_rows);
  for (int64_t r = 0; r < rows; ++r) {
    std::sort(sorted_rows.begin() + r * vocab, sorted_rows.begin() + (r + 1) * vocab, std::greater<float>());
  }
  const int64_t excluded[] = {0, 2};
  std::vector<float> values(k);
  std::vector<int64_t> ids(k);
  for (const auto* data : {&random_rows, &sorted_rows}) {
    for (const bool with_totals : {false, true}) {
      float top, log_total;
      double best = 1e9;
      for (int pass = 0; pass < 15; ++pass) {
        const auto start = std::chrono::steady_clock::now();
        for (int64_t r = 0; r < rows; ++r) {
          fastformer::top_k_row_cpu(data->data() + r * vocab, vocab, k, excluded, 2, -1, values.data(), ids.data(),
                                    with_totals ? &top : nullptr, with_totals ? &log_total : nullptr);
        }
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
      std::printf("%s rows, top-%ld%s: %.2f us a row\n", data == &random_rows ? "random" : "sorted", long(k),
                  with_totals ? " and log-softmax terms" : "", best / rows * 1e6);
    }
  }
}
