// Two int8 GEMMs of int8_gemms() by route (ROUTE_A, ROUTE_B) at the shapes given, one thread, their calls in turn
// (which goes first alternating) over 40 rounds after one untimed, cycling COPIES copies of the packed weights (1: in
// L2 where they fit; 8: from L3, as in a search) -> each one's median G multiply-adds/s and B's time over A's, round by
// round (median, 10th-90th percentile), and whether their outputs are bitwise equal. SUMMARY_K=k summarizes the
// outputs instead (int8_gemm_summary: the best k, pad and BOS barred; TOTALS=1 adds each row's log-softmax terms).
// Built against a trial build holding the AMX tile before this change as route amx-before (amx_before_trial.patch):
//     git apply amx_before_trial.patch && cmake -S . -B build && cmake --build build --target fastformer_cpu
//     g++ -O2 -std=c++17 -Icsrc amx_outputs_bench.cpp build/libfastformer_cpu.a -fopenmp -o bench
//     OMP_NUM_THREADS=1 ./bench ROUTE_A ROUTE_B COPIES ROWS IN OUT [ROWS IN OUT ...]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "int8_gemm.h"

using namespace fastformer;

// 64-byte aligned, as the extension's tensors are: a tile row of unaligned bytes straddles two cache lines.
template <class T>
struct Aligned {
  using value_type = T;
  Aligned() = default;
  template <class U>
  Aligned(const Aligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  bool operator==(const Aligned&) const { return true; }
  bool operator!=(const Aligned&) const { return false; }
};
template <class T>
using Buffer = std::vector<T, Aligned<T>>;

int main(int argc, char** argv) {
  const Int8Gemm* g[2] = {nullptr, nullptr};
  for (const Int8Gemm* gemm : int8_gemms()) {
    for (int w = 0; w < 2; ++w) {
      if (std::string(gemm->route) == argv[1 + w]) g[w] = gemm;
    }
  }
  if (!g[0] || !g[1]) {
    std::printf("routes missing\n");
    return 1;
  }
  const int copies = std::atoi(argv[3]);
  const int summary_k = std::getenv("SUMMARY_K") ? std::atoi(std::getenv("SUMMARY_K")) : -1;
  const bool totals = std::getenv("TOTALS") != nullptr;
  for (int a = 4; a + 2 < argc; a += 3) {
    const int64_t rows = std::atoll(argv[a]), in = std::atoll(argv[a + 1]), out = std::atoll(argv[a + 2]);
    const int64_t groups = int8_input_groups(in), panels = gemm_panel_count(out);
    std::vector<int8_t> weight(out * in);
    for (size_t i = 0; i < weight.size(); ++i) {
      weight[i] = static_cast<int8_t>(static_cast<int64_t>(i * 37 % 255) - 127);
    }
    std::vector<Buffer<int8_t>> packed(copies, Buffer<int8_t>(int8_packed_bytes(out, in, g[0]->tile_panels)));
    std::vector<int32_t> offsets(panels * 16);
    for (auto& p : packed) {
      int8_pack_panels(weight.data(), out, in, g[0]->zero_point, g[0]->tile_panels, p.data(), offsets.data());
    }
    Buffer<uint8_t> x_q(rows * groups * 4);
    for (size_t i = 0; i < x_q.size(); ++i) x_q[i] = static_cast<uint8_t>(i * 53 % 255 + 1);
    Buffer<float> x_scales(rows, 0.01f), w_scales(panels * 16, 0.01f), y[2] = {Buffer<float>(rows * out),
                                                                                Buffer<float>(rows * out)};
    const int64_t barred[2] = {0, 2};
    std::vector<float> values[2], tops[2], log_totals[2];
    std::vector<int64_t> ids[2];
    std::vector<int32_t> finite[2];
    GemmSummary summary[2];
    for (int w = 0; w < 2; ++w) {
      values[w].resize(rows * kGemmMaxTopK), ids[w].resize(rows * kGemmMaxTopK), finite[w].resize(rows);
      tops[w].resize(rows), log_totals[w].resize(rows);
      summary[w].k = std::max(summary_k, 0);
      summary[w].barred = barred, summary[w].n_barred = 2;
      summary[w].values = values[w].data(), summary[w].ids = ids[w].data(), summary[w].finite = finite[w].data();
      if (totals) summary[w].tops = tops[w].data(), summary[w].log_totals = log_totals[w].data();
    }
    const double work = double(rows) * in * out;
    const int calls = std::max(copies, static_cast<int>(2e8 / work) / copies * copies);
    std::vector<double> t[2];
    for (int round = 0; round < 41; ++round) {
      for (int w = 0; w < 2; ++w) {
        const int which = round % 2 ? w : 1 - w;
        const auto start = std::chrono::steady_clock::now();
        for (int i = 0; i < calls; ++i) {
          if (summary_k < 0) {
            int8_gemm(*g[which], x_q.data(), x_scales.data(), rows, in, packed[i % copies].data(), offsets.data(),
                      w_scales.data(), nullptr, false, out, 0, panels, y[which].data());
          } else {
            int8_gemm_summary(*g[which], x_q.data(), x_scales.data(), rows, in, packed[i % copies].data(),
                              offsets.data(), w_scales.data(), nullptr, out, 0, panels, summary[which]);
          }
        }
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (round) t[which].push_back(seconds / calls);
      }
    }
    if (summary_k >= 0) {
      const bool same = values[0] == values[1] && ids[0] == ids[1] && tops[0] == tops[1] &&
                        log_totals[0] == log_totals[1] && finite[0] == finite[1];
      std::printf("summary k %d totals %d: %s | ", summary_k, totals, same ? "equal" : "DIFFERENT");
    } else {
      std::printf("y %s | ", y[0] == y[1] ? "equal" : "DIFFERENT");
    }
    std::vector<double> ratio;
    for (size_t i = 0; i < t[0].size(); ++i) ratio.push_back(t[1][i] / t[0][i]);
    for (auto& v : t) std::sort(v.begin(), v.end());
    std::sort(ratio.begin(), ratio.end());
    const size_t m = t[0].size() / 2;
    std::printf("%5lld %5lld %5lld c%-2d | %s %.0f G/s | %s %.0f G/s | time ratio %.3f (%.3f-%.3f)\n",
                static_cast<long long>(rows), static_cast<long long>(in), static_cast<long long>(out), copies, argv[1],
                work / t[0][m] / 1e9, argv[2], work / t[1][m] / 1e9, ratio[m], ratio[ratio.size() / 10],
                ratio[ratio.size() * 9 / 10]);
  }
}
