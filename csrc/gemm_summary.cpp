// gemm_summary.h's plain C++ parts: a row's running summary started, offered outputs and ended, and summaries of
// consecutive panel ranges merged.
#include "gemm_summary.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <utility>
#include <vector>

#include "beam_ops.h"

namespace fastformer {

void merge_gemm_summaries(const GemmSummary* parts, int n_parts, int64_t rows, const GemmSummary& into) {
  const int k = into.k;
  std::vector<std::pair<float, int64_t>> best;
  for (int64_t r = 0; r < rows; ++r) {
    best.clear();
    bool finite = true;
    float top = -std::numeric_limits<float>::infinity(), picked = -std::numeric_limits<float>::infinity();
    for (int p = 0; p < n_parts; ++p) {
      const GemmSummary& part = parts[p];
      for (int i = 0; i < k && part.ids[r * k + i] >= 0; ++i) {
        best.emplace_back(part.values[r * k + i], part.ids[r * k + i]);
      }
      finite = finite && part.finite[r];
      if (part.tops) top = std::max(top, part.tops[r]);
      if (part.picked) picked = std::max(picked, part.picked[r]);
    }
    // Higher first, ties to the lower id (the parts are in the order of their ids).
    std::stable_sort(best.begin(), best.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    for (int i = 0; i < k; ++i) {
      const bool kept = i < static_cast<int>(best.size());
      into.values[r * k + i] = kept ? best[i].first : -std::numeric_limits<float>::infinity();
      into.ids[r * k + i] = kept ? best[i].second : -1;
    }
    into.finite[r] = finite;
    if (into.picked) into.picked[r] = picked;
    if (!into.log_totals) continue;
    float total = 0.0f;
    for (int p = 0; p < n_parts; ++p) total += std::exp(parts[p].tops[r] - top + parts[p].log_totals[r]);
    into.tops[r] = top;
    into.log_totals[r] = std::log(total);
  }
}

namespace summary_tiles {

std::vector<RowSummary> start_rows(int64_t rows, const GemmSummary& summary) {
  if (summary.k < 0 || summary.k > kGemmMaxTopK) throw std::invalid_argument("a GEMM summary takes k in [0, 64]");
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<RowSummary> started(rows);
  for (RowSummary& row : started) {
    // -inf and -1 past size: the AVX-512 tiles rank an output among the first 16 at once (offer_tile).
    std::fill(row.values, row.values + kGemmMaxTopK, -inf);
    std::fill(row.ids, row.ids + kGemmMaxTopK, -1);
    row.size = 0;
    row.bar = -inf;
    std::fill(row.poison, row.poison + 16, 0.0f);
    std::fill(row.lane_tops, row.lane_tops + 16, -inf);
    std::fill(row.lane_totals, row.lane_totals + 16, 0.0f);
    row.picked = -inf;
  }
  return started;
}

void end_rows(const std::vector<RowSummary>& rows, const GemmSummary& summary) {
  const int k = summary.k;
  const float inf = std::numeric_limits<float>::infinity();
  for (size_t r = 0; r < rows.size(); ++r) {
    const RowSummary& row = rows[r];
    for (int i = 0; i < k; ++i) {
      summary.values[r * k + i] = i < row.size ? row.values[i] : -inf;
      summary.ids[r * k + i] = i < row.size ? row.ids[i] : -1;
    }
    summary.finite[r] = std::none_of(row.poison, row.poison + 16, [](float x) { return std::isnan(x); });
    if (summary.picked) summary.picked[r] = row.picked;
    if (!summary.log_totals) continue;
    summary.log_totals[r] = log_total_of_parts(row.lane_tops, row.lane_totals, 16, &summary.tops[r]);
  }
}

void offer(RowSummary& row, int k, int64_t panel, const float* values, uint32_t candidates) {
  for (; candidates; candidates &= candidates - 1) {
    const int lane = __builtin_ctz(candidates);
    if (!(values[lane] > row.bar)) continue;  // an earlier lane of this panel raised the bar
    int at = row.size < k ? row.size++ : k - 1;
    for (; at > 0 && row.values[at - 1] < values[lane]; --at) {
      row.values[at] = row.values[at - 1];
      row.ids[at] = row.ids[at - 1];
    }
    row.values[at] = values[lane];
    row.ids[at] = panel * 16 + lane;
    if (row.size == k) row.bar = row.values[k - 1];
  }
}

}  // namespace summary_tiles

}  // namespace fastformer
