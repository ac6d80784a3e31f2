// float32_gemm.h's AVX-512 GEMM: a tile of up to 6 rows by 4 panels (64 outputs) sums in 24 vector registers over
// the whole input, so that each sum is written once, or summarized (gemm_tiles_avx512.h).
#include "float32_gemm.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FASTFORMER_FLOAT32_AVX512 1
#include <immintrin.h>
#endif

#ifdef FASTFORMER_FLOAT32_AVX512
// Everything up to pop_options below compiled for the instruction sets of the tiles.
#pragma GCC push_options
#pragma GCC target("avx512f,prfchw")
// GCC 12's intrinsics start some results from _mm512_undefined_ps(), a variable initialized from itself, which its
// own uninitialized-use warnings then flag.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "gemm_tiles_avx512.h"
#endif

namespace fastformer {

#ifdef FASTFORMER_FLOAT32_AVX512

namespace {

// Tiles of kFloat32TileRows (6) rows by 4 panels: 6 x 4 sums, 4 panel vectors and a broadcast row, 29 of the 32
// vector registers.
constexpr int kTilePanels = 4;

struct Tile {
  const float* rows;    // the tile's packed rows, [in, 6]
  int64_t in;           // the panels' depth
  const float* panels;  // the tile's first panel, [in, 16]; the others follow, in * 16 floats apart
  // The next block's panels, to prefetch into L2 while this block's tiles read their own: its inputs [first_next,
  // first_next + next_count) are this tile's share, asked for spread over its loop; null where there is no next block.
  const float* next_panels;
  int64_t first_next, next_count;
  const float* bias;  // the tile's first panel's 16, or null
  bool relu;
  int64_t first_panel, out;
  float* y;  // the tile's first row and output; null: `summary_rows` summarizes the outputs instead
  int64_t y_stride;
  summary_tiles::RowSummary* summary_rows;  // gemm_summary: the tile's first row's
  const GemmSummary* summary;               // gemm_summary: what is kept
  const int64_t* picked_ids;                // gemm_summary: the tile's first row's, or null
};

template <int kRows, int kPanels>
void run_tile(const Tile& t) {
  __m512 sums[kRows][kPanels];
  for (int r = 0; r < kRows; ++r) {
    for (int p = 0; p < kPanels; ++p) sums[r][p] = _mm512_setzero_ps();
  }
  if (t.y) prefetch_outputs<kRows, kPanels>(t.y, t.y_stride);
  const int64_t panel_floats = t.in * 16;
  int64_t next = t.first_next, progress = 0;
  for (int64_t i = 0; i < t.in; ++i) {
    __m512 weights[kPanels];
    for (int p = 0; p < kPanels; ++p) weights[p] = _mm512_loadu_ps(t.panels + p * panel_floats + i * 16);
    // One of the next block's inputs (a line of each of its panels) every in / next_count of this tile's.
    progress += t.next_count;
    if (progress >= t.in) {
      progress -= t.in;
      for (int p = 0; p < kTilePanels; ++p) {
        _mm_prefetch(reinterpret_cast<const char*>(t.next_panels + p * panel_floats + next * 16), _MM_HINT_T1);
      }
      ++next;
    }
    for (int r = 0; r < kRows; ++r) {
      const __m512 row = _mm512_set1_ps(t.rows[i * 6 + r]);
      for (int p = 0; p < kPanels; ++p) sums[r][p] = _mm512_fmadd_ps(row, weights[p], sums[r][p]);
    }
  }
  // The bias first, as the AVX2 GEMM adds it.
  auto value_of = [&](int r, int p) {
    return t.bias ? _mm512_add_ps(sums[r][p], _mm512_loadu_ps(t.bias + p * 16)) : sums[r][p];
  };
  if (!t.y) {
    summarize_tile<kRows, kPanels>(t.summary_rows, *t.summary, t.first_panel, t.out, t.picked_ids, value_of);
    return;
  }
  for (int r = 0; r < kRows; ++r) {
    for (int p = 0; p < kPanels; ++p) {
      __m512 value = value_of(r, p);
      // max(0, NaN) is NaN here (the second operand wins a comparison with NaN): a NaN reaches the finite check.
      if (t.relu) value = _mm512_max_ps(_mm512_setzero_ps(), value);
      _mm512_mask_storeu_ps(t.y + r * t.y_stride + p * 16, panel_lanes(t.first_panel + p, t.out), value);
    }
  }
}

using TileFunction = void (*)(const Tile&);

TileFunction tile_function(int rows, int panels) {
  return tile_of_size(rows, panels, [](auto r, auto p) -> TileFunction { return run_tile<r.value, p.value>; });
}

// The tiles of rows [0, rows) x panels [first_panel, end_panel): `whole` holds what they share (rows, panels, bias,
// y and summary_rows at their starts, and the rest as it is), each tile its own part. A chunk of rows at a time
// (float32_balanced_chunk_tiles), every block of kTilePanels panels passing over its tiles in turn.
void run_tiles(const Tile& whole, int64_t rows, int64_t first_panel, int64_t end_panel) {
  const int64_t in = whole.in;
  const int64_t n_tiles = float32_row_tiles(rows);
  const int64_t chunk_tiles = float32_balanced_chunk_tiles(in, n_tiles);
  for (int64_t chunk = 0; chunk < n_tiles; chunk += chunk_tiles) {
    const int64_t chunk_end = std::min(n_tiles, chunk + chunk_tiles), chunk_size = chunk_end - chunk;
    for (int64_t panel = first_panel; panel < end_panel; panel += kTilePanels) {
      const int n_panels = static_cast<int>(std::min<int64_t>(kTilePanels, end_panel - panel));
      // A whole next block only: a part of one is another thread's.
      const bool has_next = panel + 2 * kTilePanels <= end_panel;
      for (int64_t tile = chunk; tile < chunk_end; ++tile) {
        const int64_t row = float32_tile_start(tile, rows);
        Tile t = whole;
        t.rows = whole.rows + tile * in * 6;
        t.panels = whole.panels + panel * in * 16;
        t.next_panels = has_next ? t.panels + kTilePanels * in * 16 : nullptr;
        t.first_next = (tile - chunk) * in / chunk_size;
        t.next_count = has_next ? (tile + 1 - chunk) * in / chunk_size - t.first_next : 0;
        t.bias = whole.bias ? whole.bias + panel * 16 : nullptr;
        t.first_panel = panel;
        t.y = whole.y ? whole.y + row * whole.y_stride + panel * 16 : nullptr;
        t.summary_rows = whole.summary_rows ? whole.summary_rows + row : nullptr;
        t.picked_ids = whole.picked_ids ? whole.picked_ids + row : nullptr;
        tile_function(static_cast<int>(float32_tile_start(tile + 1, rows) - row), n_panels)(t);
      }
    }
  }
}

}  // namespace

#pragma GCC pop_options

// Compiled for the build's baseline: the summaries' std::vector must not be an AVX-512 copy that other files link.
namespace {

void gemm(const float* packed_rows, int64_t rows, int64_t in, const float* panels, const float* bias, bool relu,
          int64_t out, int64_t first_panel, int64_t end_panel, float* y) {
  const Tile whole{packed_rows, in, panels, nullptr, 0, 0, bias, relu, first_panel, out, y, out, nullptr, nullptr,
                   nullptr};
  run_tiles(whole, rows, first_panel, end_panel);
}

void gemm_summary(const float* packed_rows, int64_t rows, int64_t in, const float* panels, const float* bias,
                  int64_t out, int64_t first_panel, int64_t end_panel, const GemmSummary& summary) {
  std::vector<summary_tiles::RowSummary> summaries = summary_tiles::start_rows(rows, summary);
  const Tile whole{packed_rows, in, panels, nullptr, 0, 0, bias, false, first_panel, out, nullptr, out,
                   summaries.data(), &summary, summary.picked_ids};
  run_tiles(whole, rows, first_panel, end_panel);
  summary_tiles::end_rows(summaries, summary);
}

constexpr Float32Gemm kAvx512Gemm{"avx512", "avx512-float32", kTilePanels, gemm, gemm_summary};

}  // namespace

const Float32Gemm* avx512_float32_gemm() {
  __builtin_cpu_init();
  static const bool runs = __builtin_cpu_supports("avx512f");
  return runs ? &kAvx512Gemm : nullptr;
}

#else  // no x86-64 GCC build

const Float32Gemm* avx512_float32_gemm() { return nullptr; }

#endif

}  // namespace fastformer
