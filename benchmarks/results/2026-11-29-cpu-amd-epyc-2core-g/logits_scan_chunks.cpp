// From the repository root, after ctest's cmake build (build/cmake/libfastformer_cpu.a):
//   g++ -O2 -std=c++17 -I csrc -o scan logits_scan_chunks.cpp build/cmake/libfastformer_cpu.a -lpthread
//   ./scan THREADS ROUNDS
// The float32 search's logits scan (CpuLoops::top_k_row: each row's 8 best and its log-softmax terms) on THREADS
// threads at once, each over its own group's step: 128 rows x 37000 logits. "whole": the rows written as one 19 MB
// block, then scanned (the search today: oneDNN writes the block, top_k_row reads it back). "chunks": 2048 outputs
// at a time, each chunk's 1 MB written and then scanned while in L2. The writes stand in for the GEMM's; only the
// scans are timed -> ns a logit, the best of ROUNDS steps.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "beam_ops.h"

using fastformer::CpuLoops;
constexpr int64_t kRows = 128, kVocab = 37000, kChunk = 2048, kTop = 8;

static void write_block(float* x, int64_t rows, int64_t width, unsigned seed) {
  for (int64_t i = 0; i < rows * width; ++i) x[i] = static_cast<float>((i * 2654435761u + seed) % 1000) * 1e-3f;
}

static double scan_seconds(const CpuLoops& loops, bool chunks, int rounds) {
  std::vector<float> block(kRows * kVocab), chunk(kRows * kChunk);
  float values[kTop], top, log_total;
  int64_t ids[kTop], excluded[2] = {0, 1};
  double best = 1e30;
  for (int r = 0; r < rounds; ++r) {
    double scan = 0;
    if (!chunks) {
      write_block(block.data(), kRows, kVocab, r);
      auto t = std::chrono::steady_clock::now();
      for (int64_t row = 0; row < kRows; ++row) {
        loops.top_k_row(block.data() + row * kVocab, kVocab, kTop, excluded, 2, -1, values, ids, &top, &log_total);
      }
      scan = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    } else {
      for (int64_t first = 0; first < kVocab; first += kChunk) {
        const int64_t width = std::min(kChunk, kVocab - first);
        write_block(chunk.data(), kRows, width, r + first);
        auto t = std::chrono::steady_clock::now();
        for (int64_t row = 0; row < kRows; ++row) {
          loops.top_k_row(chunk.data() + row * width, width, kTop, excluded, 2, -1, values, ids, &top, &log_total);
        }
        scan += std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
      }
    }
    best = std::min(best, scan);
  }
  return best;
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2, rounds = argc > 2 ? std::atoi(argv[2]) : 10;
  const CpuLoops& loops = fastformer::cpu_loops();
  for (int pass = 0; pass < 2; ++pass) {
    for (bool chunks : {false, true}) {
      std::vector<double> seconds(threads);
      std::vector<std::thread> workers;
      for (int i = 0; i < threads; ++i) {
        workers.emplace_back([&, i] { seconds[i] = scan_seconds(loops, chunks, rounds); });
      }
      for (auto& w : workers) w.join();
      const double worst = *std::max_element(seconds.begin(), seconds.end());
      std::printf("%s %d threads, %s: %.3f ms a step's scan, %.3f ns a logit\n", loops.isa, threads,
                  chunks ? "chunks of 2048" : "whole block", worst * 1e3, worst * 1e9 / (kRows * kVocab));
    }
  }
}
