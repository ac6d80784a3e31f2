// What the AVX-512 GEMMs' tiles of up to 6 rows by 4 panels share: the choice of a tile by its size, and the summary
// (gemm_summary.h) of their outputs. Included, after its `#pragma GCC target` with AVX512F, by each of those files
// (int8_gemm_vnni.cpp, float32_gemm_avx512.cpp); everything here has internal linkage, compiled in each for its own
// instruction sets.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "exp_nonpositive.h"
#include "gemm_summary.h"

#define FASTFORMER_INLINE inline __attribute__((always_inline))

namespace fastformer {
namespace {

using summary_tiles::RowSummary;

// The tile of `rows` (1 to 6; more take 6) by `panels` (1 to 4): pick(R, P), with R and P as
// std::integral_constant, gives the including file's tile of R rows by P panels.
template <typename Pick>
auto tile_of_size(int rows, int panels, Pick&& pick) {
  auto of_rows = [&](auto r) {
    using std::integral_constant;
    return panels == 1   ? pick(r, integral_constant<int, 1>{})
           : panels == 2 ? pick(r, integral_constant<int, 2>{})
           : panels == 3 ? pick(r, integral_constant<int, 3>{})
                         : pick(r, integral_constant<int, 4>{});
  };
  switch (rows) {
    case 1: return of_rows(std::integral_constant<int, 1>{});
    case 2: return of_rows(std::integral_constant<int, 2>{});
    case 3: return of_rows(std::integral_constant<int, 3>{});
    case 4: return of_rows(std::integral_constant<int, 4>{});
    case 5: return of_rows(std::integral_constant<int, 5>{});
    default: return of_rows(std::integral_constant<int, 6>{});
  }
}

// The lanes of a panel that hold outputs: all 16, or the out - 16 * panel left in the last one.
FASTFORMER_INLINE __mmask16 panel_lanes(int64_t panel, int64_t out) {
  const int64_t left = out - panel * 16;
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// e^x for x <= 0 (exp_nonpositive.h); NaN gives e^-87 (the maximum's second operand wins a comparison with NaN).
FASTFORMER_INLINE __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpLowest));
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r =
      _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x));
  __m512 p = _mm512_set1_ps(kExpPolynomial[0]);
  for (size_t i = 1; i < std::size(kExpPolynomial); ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPolynomial[i]));
  return _mm512_scalef_ps(p, n);
}

// Asks for a tile's output lines (y: its first row and output, rows y_stride apart) with the intent to write, while
// the sums are made: stored at the end without them, each waited for its line to be read in first. 1344 rows (the
// encoder's at 64 sentences), 2048 outputs: 176 -> 193 G multiply-adds/s on one thread of the int8 GEMM on the
// AVX-512 test CPU; 128 rows, whose outputs are still in cache, unchanged
// (benchmarks/results/2026-11-27-cpu-amd-epyc-2core-b).
template <int kRows, int kPanels>
FASTFORMER_INLINE void prefetch_outputs(const float* y, int64_t y_stride) {
  for (int r = 0; r < kRows; ++r) {
    for (int p = 0; p < kPanels; ++p) __builtin_prefetch(y + r * y_stride + p * 16, /*rw=*/1, /*locality=*/3);
  }
}

// Offers a row's outputs of a tile to its best as summary_tiles::offer does: values [n_panels * 16] from
// first_panel's first output on, a candidate a bit (bit i: output 16 * first_panel + i). Out of line: inlined, it
// made GCC keep the tile's sums and outputs on the stack. Where k <= 16 the best stay in three vectors while the
// candidates go in, each by a compare, permutes and blends: with offer's loop of shifts and stores, and a branch a
// panel, the int8 output projection's top-10 summary took 5-6% longer than its top-1, now 3-4% (32 to 128 rows, one
// thread).
__attribute__((noinline)) void offer_tile(RowSummary& row, int k, int64_t first_panel, const float* values,
                                          uint64_t candidates, int n_panels) {
  if (k > 16) {
    for (int p = 0; p < n_panels; ++p) {
      const uint32_t lanes = (candidates >> (16 * p)) & 0xFFFF;
      if (lanes) summary_tiles::offer(row, k, first_panel + p, values + 16 * p, lanes);
    }
    return;
  }
  const __mmask16 kept = static_cast<__mmask16>((1u << k) - 1);
  // Lane i takes lane i - 1: of the values; of the ids' low half; of the ids' high half (its lane 0: low lane 7).
  const __m512i values_down = _mm512_set_epi32(14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 0);
  const __m512i low_down = _mm512_set_epi64(6, 5, 4, 3, 2, 1, 0, 0);
  const __m512i high_down = _mm512_set_epi64(14, 13, 12, 11, 10, 9, 8, 7);
  __m512 best = _mm512_loadu_ps(row.values);
  __m512i ids_low = _mm512_loadu_si512(row.ids), ids_high = _mm512_loadu_si512(row.ids + 8);
  for (; candidates; candidates &= candidates - 1) {
    const int i = __builtin_ctzll(candidates);
    if (!(values[i] > row.bar)) continue;  // an output before it in this tile raised the bar
    const __m512 candidate = _mm512_set1_ps(values[i]);
    // The best are ranked, -inf past size: those >= the candidate (ties to the lower id) are lanes [0, at).
    const uint32_t ahead = _mm512_mask_cmp_ps_mask(kept, best, candidate, _CMP_GE_OQ);
    const uint32_t at = ahead + 1;                // the candidate's lane, as a bit
    const uint32_t moved = kept & ~(ahead | at);  // lanes (at, k) take their upper neighbours; lane k - 1's leaves
    best = _mm512_mask_mov_ps(_mm512_mask_permutexvar_ps(best, static_cast<__mmask16>(moved), values_down, best),
                              static_cast<__mmask16>(at), candidate);
    const __m512i id = _mm512_set1_epi64(first_panel * 16 + i);
    ids_high = _mm512_mask_mov_epi64(ids_high, static_cast<__mmask8>(moved >> 8),
                                     _mm512_permutex2var_epi64(ids_low, high_down, ids_high));
    ids_low = _mm512_mask_permutexvar_epi64(ids_low, static_cast<__mmask8>(moved), low_down, ids_low);
    ids_low = _mm512_mask_mov_epi64(ids_low, static_cast<__mmask8>(at), id);
    ids_high = _mm512_mask_mov_epi64(ids_high, static_cast<__mmask8>(at >> 8), id);
    if (row.size < k) ++row.size;
    if (row.size == k) row.bar = _mm512_cvtss_f32(_mm512_permutexvar_ps(_mm512_set1_epi32(k - 1), best));
  }
  _mm512_storeu_ps(row.values, best);
  _mm512_storeu_si512(row.ids, ids_low);
  _mm512_storeu_si512(row.ids + 8, ids_high);
}

// Adds a tile's outputs of one row (value[p] in the `lanes` of panel p) to the row's lane-wise highest outputs and
// sums of e^(output - highest): a lane's sum is rescaled only where the tile raises its highest.
template <int kPanels>
FASTFORMER_INLINE void add_to_totals(RowSummary& row, const __m512 (&value)[kPanels],
                                     const __mmask16 (&lanes)[kPanels]) {
  __m512 tile_top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int p = 0; p < kPanels; ++p) tile_top = _mm512_mask_max_ps(tile_top, lanes[p], tile_top, value[p]);
  __m512 top = _mm512_loadu_ps(row.lane_tops), total = _mm512_loadu_ps(row.lane_totals);
  const __mmask16 raised = _mm512_cmp_ps_mask(tile_top, top, _CMP_GT_OQ);
  if (raised) {
    total = _mm512_mask_mul_ps(total, raised, total, exp_nonpositive(_mm512_sub_ps(top, tile_top)));
    top = _mm512_mask_mov_ps(top, raised, tile_top);
    _mm512_storeu_ps(row.lane_tops, top);
  }
  for (int p = 0; p < kPanels; ++p) {
    total = _mm512_mask_add_ps(total, lanes[p], total, exp_nonpositive(_mm512_sub_ps(value[p], top)));
  }
  _mm512_storeu_ps(row.lane_totals, total);
}

// The lanes of a tile's panels (from first_panel on) that hold outputs, and those of them a summary may keep (not
// barred): the same for every row of the tile.
template <int kPanels>
struct PanelLanes {
  __mmask16 lanes[kPanels], allowed[kPanels];
  PanelLanes(const GemmSummary& s, int64_t first_panel, int64_t out) {
    for (int p = 0; p < kPanels; ++p) {
      lanes[p] = panel_lanes(first_panel + p, out);
      allowed[p] = static_cast<__mmask16>(summary_tiles::allowed_lanes(s, first_panel + p, out));
    }
  }
};

// One row's outputs of a tile (value[p]: its 16 outputs of panel p, the tile's first panel first_panel) into the row's
// running summary: a panel's outputs cost one comparison with the row's bar unless one of them beats it, and their
// exponentials where the summary takes log_totals. picked_id: the row's, or null.
template <int kPanels>
FASTFORMER_INLINE void summarize_row(RowSummary& row, const GemmSummary& s, int64_t first_panel,
                                     const PanelLanes<kPanels>& panels, const __m512 (&value)[kPanels],
                                     const int64_t* picked_id) {
  __m512 poison = _mm512_setzero_ps();
  uint64_t candidates = 0;  // the tile's outputs that beat the row's bar: one branch a row
  for (int p = 0; p < kPanels; ++p) {
    poison = _mm512_mask_add_ps(poison, panels.lanes[p], poison, _mm512_mul_ps(value[p], _mm512_setzero_ps()));
    if (s.k == 0) continue;
    const __mmask16 above =
        _mm512_mask_cmp_ps_mask(panels.allowed[p], value[p], _mm512_set1_ps(row.bar), _CMP_GT_OQ);
    candidates |= static_cast<uint64_t>(above) << (16 * p);
  }
  if (candidates) {
    alignas(64) float values[kPanels * 16];
    for (int p = 0; p < kPanels; ++p) _mm512_store_ps(values + 16 * p, value[p]);
    offer_tile(row, s.k, first_panel, values, candidates, kPanels);
  }
  _mm512_storeu_ps(row.poison, _mm512_add_ps(_mm512_loadu_ps(row.poison), poison));
  if (s.log_totals) add_to_totals(row, value, panels.lanes);
  if (picked_id) {
    const int64_t p = *picked_id / 16 - first_panel;
    if (p >= 0 && p < kPanels) {
      alignas(64) float values[16];
      _mm512_store_ps(values, value[p]);
      row.picked = values[*picked_id % 16];
    }
  }
}

// A tile's outputs (value_of(r, p): row r's 16 outputs of panel p, the tile's first panel first_panel) into each row's
// running summary (summarize_row; rows: the tile's first row's). picked_ids: the tile's first row's, or null.
template <int kRows, int kPanels, typename ValueOf>
FASTFORMER_INLINE void summarize_tile(RowSummary* rows, const GemmSummary& s, int64_t first_panel,
                                      int64_t out, const int64_t* picked_ids, ValueOf&& value_of) {
  const PanelLanes<kPanels> panels(s, first_panel, out);
  for (int r = 0; r < kRows; ++r) {
    __m512 value[kPanels];
    for (int p = 0; p < kPanels; ++p) value[p] = value_of(r, p);
    summarize_row(rows[r], s, first_panel, panels, value, picked_ids ? picked_ids + r : nullptr);
  }
}

}  // namespace
}  // namespace fastformer
