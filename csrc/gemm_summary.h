// What fastformer's own GEMMs keep of their rows' outputs instead of writing them (int8_gemm.h's int8_gemm_summary,
// float32_gemm.h's AVX-512 gemm_summary): a search step's or a scorer's view of its logits, and the running summary
// their tiles keep while the panels pass. Plain C++, torch-free.
#pragma once

#include <cstdint>
#include <vector>

namespace fastformer {

// The largest k a summary keeps.
constexpr int kGemmMaxTopK = 64;

// The panels of 16 outputs that hold `out` outputs: fastformer's own GEMMs (int8_gemm.h, float32_gemm.h) hold their
// weights in such panels, and a summary's lanes are a panel's outputs.
inline int64_t gemm_panel_count(int64_t out) { return (out + 15) / 16; }

// What a summary keeps of each of `rows` rows of outputs y (as the GEMM computes them without ReLU, over the panels
// it is given), which it never writes. The optional parts are null where not wanted.
struct GemmSummary {
  // The k (0..kGemmMaxTopK) highest outputs of each row whose ids are not in barred ([n_barred]), best first, ties to
  // the lower id: values [rows, k] and ids [rows, k], -inf and -1 past a row's finite allowed outputs (a greedy
  // search's argmax, sampling's top-k, a beam search's candidates).
  int k = 0;
  const int64_t* barred = nullptr;
  int n_barred = 0;
  float* values = nullptr;
  int64_t* ids = nullptr;
  // [rows]: 0 where a row's outputs hold NaN or inf (the barred too), else 1.
  int32_t* finite = nullptr;
  // [rows] or null: each row's highest output (all ids) and log(sum over all ids of e^(y - top)), so that
  // log_softmax(y)[i] = (y[i] - top) - log_total. Summed as the panels pass, rescaled where the top rises.
  float* tops = nullptr;
  float* log_totals = nullptr;
  // [rows] or null: an id of each row in [0, out), and that row's output there (a scored target, or EOS); -inf
  // where the id is outside the panels summarized.
  const int64_t* picked_ids = nullptr;
  float* picked = nullptr;
};

// The summaries of the same rows over consecutive panel ranges (parts [n_parts], in the order of the ranges, each
// with into's k and optional parts) as one over all of them, into `into`: the best merged (ties to the lower id, so
// to the earlier part), the log-softmax's terms combined, finite where every part is, picked from the part that holds
// the id.
void merge_gemm_summaries(const GemmSummary* parts, int n_parts, int64_t rows, const GemmSummary& into);

namespace summary_tiles {

// A row's running summary (GemmSummary): its best outputs so far (ranked best first, ties to the lower id: the
// panels come in order of their ids, so an output equal to one kept loses to it; -inf and -1 past size), NaN in
// `poison` where any output was NaN or inf, each lane's highest output and sum of e^(output - that), and the picked
// output. The lanes are a panel's 16 outputs. Plain arrays, not vectors: a std::vector's heap blocks are 16-byte
// aligned, not 64.
struct RowSummary {
  float values[kGemmMaxTopK];
  int64_t ids[kGemmMaxTopK];
  int size;
  float bar;  // the value an output must beat to enter: -inf until `size` reaches k, then the k-th best
  float poison[16];
  float lane_tops[16];
  float lane_totals[16];
  float picked;
};

// `rows` empty running summaries; throws std::invalid_argument where summary.k is outside [0, kGemmMaxTopK].
std::vector<RowSummary> start_rows(int64_t rows, const GemmSummary& summary);

// The running summaries, the panels passed, into summary's arrays.
void end_rows(const std::vector<RowSummary>& rows, const GemmSummary& summary);

// The lanes of panel `panel` (bit i: output 16 * panel + i) that may be a row's best: those below out but the
// summary's barred ids. Inlined in each tile's file (static: each compiled for its own instruction set), where a call
// a panel of every tile was 0.5% of an int8 search's time.
static inline uint32_t allowed_lanes(const GemmSummary& summary, int64_t panel, int64_t out) {
  const int64_t left = out - panel * 16;
  uint32_t allowed = left >= 16 ? 0xFFFFu : (1u << left) - 1;
  for (int i = 0; i < summary.n_barred; ++i) {
    if (summary.barred[i] / 16 == panel) allowed &= ~(1u << (summary.barred[i] % 16));
  }
  return allowed;
}

// Offers a row's outputs `values` [16] of panel `panel` in the lanes of `candidates` to its best, in the order of
// their ids (those that beat its bar when the panel came).
void offer(RowSummary& row, int k, int64_t panel, const float* values, uint32_t candidates);

}  // namespace summary_tiles

}  // namespace fastformer
