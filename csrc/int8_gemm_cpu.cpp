// int8_gemm.h's GEMM in AVX512-VNNI intrinsics: a tile of up to 6 rows by 4 panels (64 outputs) sums in 24 vector
// registers over the whole input, so that each sum is written once, as a float.
#include "int8_gemm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "beam_ops.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FASTFORMER_INT8_GEMM 1
#include <immintrin.h>
#endif

namespace fastformer {

void int8_merge_summaries(const Int8RowSummary* parts, int n_parts, int64_t rows, const Int8RowSummary& into) {
  const int k = into.k;
  std::vector<std::pair<float, int64_t>> best;
  for (int64_t r = 0; r < rows; ++r) {
    best.clear();
    bool finite = true;
    float top = -std::numeric_limits<float>::infinity(), picked = -std::numeric_limits<float>::infinity();
    for (int p = 0; p < n_parts; ++p) {
      const Int8RowSummary& part = parts[p];
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

#ifdef FASTFORMER_INT8_GEMM

bool int8_gemm_runs() {
  __builtin_cpu_init();
  // Every CPU with AVX512-VNNI has PREFETCHW too (run_tile's prefetch of its outputs).
  static const bool runs = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
                           std::string(cpu_loops().isa) == "avx512";
  return runs;
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,prfchw")
// GCC 12's intrinsics start some results from _mm512_undefined_ps(), a variable initialized from itself, which its
// own uninitialized-use warnings then flag.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define FASTFORMER_INLINE inline __attribute__((always_inline))
#define FASTFORMER_NOINLINE __attribute__((noinline))

namespace {

constexpr int kTileRows = 6;    // 6 x 4 sums, 4 panel vectors and a broadcast row: 29 of the 32 vector registers
constexpr int kTilePanels = 4;
constexpr int64_t kRowChunkBytes = 192 << 10;  // a chunk of rows quantized stays in L2 while every panel passes

// The lanes of a panel that hold outputs: all 16, or the out - 16 * panel left in the last one.
FASTFORMER_INLINE __mmask16 panel_lanes(int64_t panel, int64_t out) {
  const int64_t left = out - panel * 16;
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

// int8_gemm_summary's running summary of one row (Int8RowSummary): its best outputs so far (ranked best first, ties to
// the lower id: the panels come in order of their ids, so an output equal to one kept loses to it), NaN in `poison`
// where any output was NaN or inf, each lane's highest output and sum of e^(output - that), and the picked output.
// Plain arrays: a vector's heap blocks are 16-byte aligned, not 64.
struct RowSummary {
  float values[kInt8GemmMaxTopK];
  int64_t ids[kInt8GemmMaxTopK];
  int size;
  float bar;  // the value an output must beat to enter: -inf until `size` reaches k, then the k-th best
  float poison[16];
  float lane_tops[16];
  float lane_totals[16];
  float picked;
};

struct Tile {
  const uint8_t* x_q;  // the tile's first row
  int64_t row_bytes;   // input_groups * 4
  const float* x_scales;
  const int8_t* panels;  // the tile's first panel
  int64_t panel_bytes;   // input_groups * 64
  int64_t input_groups;
  const int32_t* offsets;  // from the tile's first output on, as w_scales and bias
  const float* w_scales;
  const float* bias;
  // The next 4 panels, to prefetch into L2 while the first tile of these reads its own from memory (into L1 they
  // would evict the panels in use); null in the others.
  const int8_t* next_panels;
  bool relu;
  int64_t first_panel, out;
  float* y;  // the tile's first row and output; null: `rows` summarizes the outputs instead
  RowSummary* rows;  // int8_gemm_summary: the tile's first row's
  const Int8RowSummary* summary;  // int8_gemm_summary: what is kept
  const int64_t* picked_ids;  // int8_gemm_summary: the tile's first row's, or null
};

// sum + the 4-byte dot products of row (uint8) and weights (int8) in each int32 lane. In assembly: GCC 12 compiles
// _mm512_dpbusd_epi32 with a copy of the sum into a scratch register and back, and a store of it to the stack, at
// every call (a third of the speed measured).
FASTFORMER_INLINE __m512i dot_add(__m512i sum, __m512i row, __m512i weights) {
  asm("vpdpbusd %2, %1, %0" : "+v"(sum) : "v"(row), "v"(weights));
  return sum;
}

// One output vector of a tile: sum [16] int32 -> the row's 16 outputs of panel p.
FASTFORMER_INLINE __m512 output_of(const Tile& t, int r, int p, __m512i sum) {
  // In linear.cpp's order for its other int8 routes: the weights' scales first, then the row's and the bias.
  const __m512i centered = _mm512_sub_epi32(sum, _mm512_loadu_si512(t.offsets + p * 16));
  const __m512 product = _mm512_mul_ps(_mm512_cvtepi32_ps(centered), _mm512_loadu_ps(t.w_scales + p * 16));
  __m512 value = _mm512_mul_ps(product, _mm512_set1_ps(t.x_scales[r]));
  if (t.bias) value = _mm512_add_ps(value, _mm512_loadu_ps(t.bias + p * 16));
  // max(0, NaN) is NaN here (the second operand wins a comparison with NaN): a NaN reaches the finite check.
  return t.relu ? _mm512_max_ps(_mm512_setzero_ps(), value) : value;
}

// The lanes of panel p of a tile that may be a row's best: its outputs (panel_lanes) but the barred ids.
FASTFORMER_INLINE __mmask16 allowed_lanes(const Tile& t, int p) {
  const int64_t panel = t.first_panel + p;
  __mmask16 allowed = panel_lanes(panel, t.out);
  const Int8RowSummary& s = *t.summary;
  for (int i = 0; i < s.n_barred; ++i) {
    if (s.barred[i] / 16 == panel) allowed &= static_cast<__mmask16>(~(1u << (s.barred[i] % 16)));
  }
  return allowed;
}

// e^x for x <= 0 (to ~2 ulp; x < -87 gives ~1e-38 rather than 0, and NaN gives it too): 2^n * e^r with n =
// round(x / ln 2) and |r| <= ln(2) / 2 by a degree-6 polynomial, ln 2 split in two so that r stays exact.
FASTFORMER_INLINE __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f),
                                    _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x));
  __m512 p = _mm512_set1_ps(1.38888889e-3f);
  for (const float c : {8.33333333e-3f, 4.16666667e-2f, 1.66666667e-1f, 0.5f, 1.0f, 1.0f}) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  }
  return _mm512_scalef_ps(p, n);
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

// Offers row's outputs `value` of panel `panel` in the lanes of `candidates` to its best, in the order of their ids.
FASTFORMER_NOINLINE void offer(RowSummary& row, int k, int64_t panel, __m512 value, __mmask16 candidates) {
  alignas(64) float values[16];
  _mm512_store_ps(values, value);
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

// The tile's outputs into y, or (y null) into each row's summary (RowSummary): a panel's outputs cost one comparison
// with the row's bar unless one of them beats it, and their exponentials where the summary takes log_totals.
template <int kRows, int kPanels>
FASTFORMER_INLINE void finish(const Tile& t, const __m512i (&sums)[kRows][kPanels]) {
  if (t.y) {
    for (int r = 0; r < kRows; ++r) {
      for (int p = 0; p < kPanels; ++p) {
        _mm512_mask_storeu_ps(t.y + r * t.out + p * 16, panel_lanes(t.first_panel + p, t.out),
                              output_of(t, r, p, sums[r][p]));
      }
    }
    return;
  }
  __mmask16 lanes[kPanels], allowed[kPanels];
  for (int p = 0; p < kPanels; ++p) {
    lanes[p] = panel_lanes(t.first_panel + p, t.out);
    allowed[p] = allowed_lanes(t, p);
  }
  const Int8RowSummary& s = *t.summary;
  for (int r = 0; r < kRows; ++r) {
    RowSummary& row = t.rows[r];
    __m512 value[kPanels];
    __m512 poison = _mm512_setzero_ps();
    for (int p = 0; p < kPanels; ++p) {
      value[p] = output_of(t, r, p, sums[r][p]);
      poison = _mm512_mask_add_ps(poison, lanes[p], poison, _mm512_mul_ps(value[p], _mm512_setzero_ps()));
      if (s.k == 0) continue;
      const __mmask16 above = _mm512_mask_cmp_ps_mask(allowed[p], value[p], _mm512_set1_ps(row.bar), _CMP_GT_OQ);
      if (above) offer(row, s.k, t.first_panel + p, value[p], above);
    }
    _mm512_storeu_ps(row.poison, _mm512_add_ps(_mm512_loadu_ps(row.poison), poison));
    if (s.log_totals) add_to_totals(row, value, lanes);
    if (t.picked_ids) {
      const int64_t p = t.picked_ids[r] / 16 - t.first_panel;
      if (p >= 0 && p < kPanels) {
        alignas(64) float values[16];
        _mm512_store_ps(values, value[p]);
        row.picked = values[t.picked_ids[r] % 16];
      }
    }
  }
}

template <int kRows, int kPanels>
void run_tile(const Tile& t) {
  __m512i sums[kRows][kPanels];
  for (int r = 0; r < kRows; ++r) {
    for (int p = 0; p < kPanels; ++p) sums[r][p] = _mm512_setzero_si512();
  }
  // The outputs' cache lines, asked for with the intent to write while the sums are made: stored at the end without
  // them, each waited for its line to be read in first. 1344 rows (the encoder's at 64 sentences), 2048 outputs: 176
  // -> 193 G multiply-adds/s on one thread on the AVX-512 test CPU; 128 rows, whose outputs are still in cache,
  // unchanged (benchmarks/results/2026-11-27-cpu-amd-epyc-2core-b).
  if (t.y) {
    for (int r = 0; r < kRows; ++r) {
      for (int p = 0; p < kPanels; ++p) __builtin_prefetch(t.y + r * t.out + p * 16, /*rw=*/1, /*locality=*/3);
    }
  }
  for (int64_t g = 0; g < t.input_groups; ++g) {
    __m512i weights[kPanels];
    for (int p = 0; p < kPanels; ++p) weights[p] = _mm512_loadu_si512(t.panels + p * t.panel_bytes + g * 64);
    if (t.next_panels) {
      for (int p = 0; p < kTilePanels; ++p) {
        _mm_prefetch(reinterpret_cast<const char*>(t.next_panels + p * t.panel_bytes + g * 64), _MM_HINT_T1);
      }
    }
    for (int r = 0; r < kRows; ++r) {
      int32_t four;
      std::memcpy(&four, t.x_q + r * t.row_bytes + g * 4, sizeof four);
      const __m512i row = _mm512_set1_epi32(four);
      for (int p = 0; p < kPanels; ++p) sums[r][p] = dot_add(sums[r][p], row, weights[p]);
    }
  }
  finish(t, sums);
}

using TileFunction = void (*)(const Tile&);

template <int kRows>
constexpr TileFunction tile_of(int panels) {
  return panels == 1 ? run_tile<kRows, 1>
                     : panels == 2 ? run_tile<kRows, 2> : panels == 3 ? run_tile<kRows, 3> : run_tile<kRows, 4>;
}

TileFunction tile_function(int rows, int panels) {
  switch (rows) {
    case 1: return tile_of<1>(panels);
    case 2: return tile_of<2>(panels);
    case 3: return tile_of<3>(panels);
    case 4: return tile_of<4>(panels);
    case 5: return tile_of<5>(panels);
    default: return tile_of<6>(panels);
  }
}

}  // namespace

void int8_pack_panels(const int8_t* weight, int64_t out, int64_t in, int8_t* panels, int32_t* offsets) {
  const int64_t n_panels = int8_panel_count(out), groups = int8_input_groups(in);
  std::memset(panels, 0, n_panels * groups * 64);
  std::fill(offsets, offsets + n_panels * 16, 0);
  for (int64_t o = 0; o < out; ++o) {
    int8_t* panel = panels + (o / 16) * groups * 64 + (o % 16) * 4;
    int32_t sum = 0;
    for (int64_t i = 0; i < in; ++i) {
      panel[(i / 4) * 64 + i % 4] = weight[o * in + i];
      sum += weight[o * in + i];
    }
    offsets[o] = 128 * sum;
  }
}

void int8_quantize_row(const float* row, int64_t in, float inverse, uint8_t* x_q) {
  std::memset(x_q, 128, int8_input_groups(in) * 4);
  if (inverse == 0.0f) return;
  const __m512 factor = _mm512_set1_ps(inverse);
  const __m512i zero_point = _mm512_set1_epi32(128);
  for (int64_t i = 0; i < in; i += 16) {
    const __mmask16 lanes = in - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (in - i)) - 1);
    // Rounded to nearest even, as std::nearbyint in the default rounding mode; |x| * 127 / absmax <= 127.
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, row + i), factor));
    _mm512_mask_cvtepi32_storeu_epi8(x_q + i, lanes, _mm512_add_epi32(q, zero_point));
  }
}

namespace {

// The tiles of rows [0, rows) x panels [first_panel, end_panel): `tile` holds what they share (x_q, x_scales,
// panels, offsets, w_scales, bias, y and best at their starts, and the rest as they are), each tile its own part.
// A chunk of rows at a time (kRowChunkBytes), every panel passing over it, a block of kTilePanels panels over
// its tiles of kTileRows rows in turn.
void run_tiles(Tile tile, int64_t rows, int64_t first_panel, int64_t end_panel) {
  const Tile whole = tile;
  const int64_t row_bytes = tile.row_bytes, panel_bytes = tile.panel_bytes;
  const int64_t chunk_rows = std::max<int64_t>(kTileRows, kRowChunkBytes / row_bytes / kTileRows * kTileRows);
  for (int64_t chunk = 0; chunk < rows; chunk += chunk_rows) {
    const int64_t chunk_end = std::min(rows, chunk + chunk_rows);
    for (int64_t panel = first_panel; panel < end_panel; panel += kTilePanels) {
      const int n_panels = static_cast<int>(std::min<int64_t>(kTilePanels, end_panel - panel));
      for (int64_t row = chunk; row < chunk_end; row += kTileRows) {
        const int n_rows = static_cast<int>(std::min<int64_t>(kTileRows, chunk_end - row));
        tile.x_q = whole.x_q + row * row_bytes;
        tile.x_scales = whole.x_scales + row;
        tile.panels = whole.panels + panel * panel_bytes;
        tile.offsets = whole.offsets + panel * 16;
        tile.w_scales = whole.w_scales + panel * 16;
        tile.bias = whole.bias ? whole.bias + panel * 16 : nullptr;
        tile.next_panels = row == chunk && panel + kTilePanels < end_panel
                               ? whole.panels + (panel + kTilePanels) * panel_bytes
                               : nullptr;
        tile.first_panel = panel;
        tile.y = whole.y ? whole.y + row * whole.out + panel * 16 : nullptr;
        tile.rows = whole.rows ? whole.rows + row : nullptr;
        tile.picked_ids = whole.picked_ids ? whole.picked_ids + row : nullptr;
        tile_function(n_rows, n_panels)(tile);
      }
    }
  }
}

}  // namespace

void int8_gemm(const uint8_t* x_q, const float* x_scales, int64_t rows, int64_t in, const int8_t* panels,
               const int32_t* offsets, const float* w_scales, const float* bias, bool relu, int64_t out,
               int64_t first_panel, int64_t end_panel, float* y) {
  const int64_t groups = int8_input_groups(in);
  run_tiles(Tile{x_q, groups * 4, x_scales, panels, groups * 64, groups, offsets, w_scales, bias, nullptr, relu,
                 first_panel, out, y, nullptr, nullptr, nullptr},
            rows, first_panel, end_panel);
}

void int8_gemm_summary(const uint8_t* x_q, const float* x_scales, int64_t rows, int64_t in, const int8_t* panels,
                       const int32_t* offsets, const float* w_scales, const float* bias, int64_t out,
                       int64_t first_panel, int64_t end_panel, const Int8RowSummary& summary) {
  const int k = summary.k;
  if (k < 0 || k > kInt8GemmMaxTopK) throw std::invalid_argument("int8_gemm_summary takes k in [0, 64]");
  const float inf = std::numeric_limits<float>::infinity();
  const int64_t groups = int8_input_groups(in);
  std::vector<RowSummary> summaries(rows);
  for (RowSummary& row : summaries) {
    row.size = 0;
    row.bar = -inf;
    std::fill(row.poison, row.poison + 16, 0.0f);
    std::fill(row.lane_tops, row.lane_tops + 16, -inf);
    std::fill(row.lane_totals, row.lane_totals + 16, 0.0f);
    row.picked = -inf;
  }
  run_tiles(Tile{x_q, groups * 4, x_scales, panels, groups * 64, groups, offsets, w_scales, bias, nullptr, false,
                 first_panel, out, nullptr, summaries.data(), &summary, summary.picked_ids},
            rows, first_panel, end_panel);
  for (int64_t r = 0; r < rows; ++r) {
    const RowSummary& row = summaries[r];
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

#pragma GCC pop_options

#else  // no x86-64 GCC build: the int8 compute type runs FBGEMM's or oneDNN's GEMM (linear.cpp)

bool int8_gemm_runs() { return false; }

void int8_pack_panels(const int8_t*, int64_t, int64_t, int8_t*, int32_t*) {
  throw std::logic_error("int8_gemm is not in this build");
}
void int8_quantize_row(const float*, int64_t, float, uint8_t*) {
  throw std::logic_error("int8_gemm is not in this build");
}
void int8_gemm(const uint8_t*, const float*, int64_t, int64_t, const int8_t*, const int32_t*, const float*,
               const float*, bool, int64_t, int64_t, int64_t, float*) {
  throw std::logic_error("int8_gemm is not in this build");
}
void int8_gemm_summary(const uint8_t*, const float*, int64_t, int64_t, const int8_t*, const int32_t*, const float*,
                       const float*, int64_t, int64_t, int64_t, const Int8RowSummary&) {
  throw std::logic_error("int8_gemm is not in this build");
}

#endif

}  // namespace fastformer
