// int8_gemm.h's choice of GEMM, its packing and merging, and (int8_gemm_tiles.h) what the instruction sets' GEMMs
// share: plain C++, no instruction set's intrinsics.
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
#include "int8_gemm_tiles.h"

namespace fastformer {

// Defined in int8_gemm_vnni.cpp and int8_gemm_avx2.cpp: null where the build or the CPU lacks the instruction set.
const Int8Gemm* amx_int8_gemm();
const Int8Gemm* vnni_int8_gemm();
const Int8Gemm* avx_vnni_int8_gemm();
const Int8Gemm* avx2_int8_gemm();

std::vector<const Int8Gemm*> int8_gemms() {
  std::vector<const Int8Gemm*> gemms;
  for (const Int8Gemm* gemm : {amx_int8_gemm(), vnni_int8_gemm(), avx_vnni_int8_gemm(), avx2_int8_gemm()}) {
    if (gemm) gemms.push_back(gemm);
  }
  return gemms;
}

bool cpu_has_amx() {
  static const bool allowed = cpu_switch_on("FASTFORMER_CPU_AMX", "AMX off");  // a bad value throws at each call
  return allowed && amx_int8_gemm() != nullptr;
}

const Int8Gemm* int8_gemm_here() {
  static const Int8Gemm* const chosen = [] () -> const Int8Gemm* {
    const std::string isa = cpu_loops().isa;
    const bool amx = cpu_has_amx();  // first: a bad FASTFORMER_CPU_AMX is an error wherever int8 layers are made
    if (isa == "avx512" && cpu_has_vnni() && amx) return amx_int8_gemm();
    if (isa == "avx512" && cpu_has_vnni() && vnni_int8_gemm()) return vnni_int8_gemm();
    if (isa == "baseline") return nullptr;
    // With VNNI of any width the rows are 8-bit (linear.h's int8_activation_max), which vpmaddubsw's int16 pairs
    // would saturate on: AVX-VNNI's vpdpbusd takes them.
    return cpu_has_vnni() ? avx_vnni_int8_gemm() : avx2_int8_gemm();
  }();
  return chosen;
}

void int8_pack_panels(const int8_t* weight, int64_t out, int64_t in, int zero_point, int block_panels,
                      int8_t* panels, int32_t* offsets) {
  const int64_t n_panels = gemm_panel_count(out), groups = int8_input_groups(in);
  std::memset(panels, 0, int8_packed_bytes(out, in, block_panels));
  std::fill(offsets, offsets + n_panels * 16, 0);
  const int64_t group_bytes = block_panels * 64;  // a block's 64-byte vectors of one group
  for (int64_t o = 0; o < out; ++o) {
    const int64_t panel_index = o / 16;
    int8_t* panel = panels + (panel_index / block_panels) * groups * group_bytes +
                    (panel_index % block_panels) * 64 + (o % 16) * 4;
    int32_t sum = 0;
    for (int64_t i = 0; i < in; ++i) {
      panel[(i / 4) * group_bytes + i % 4] = weight[o * in + i];
      sum += weight[o * in + i];
    }
    offsets[o] = zero_point * sum;
  }
}

namespace int8_tiles {

namespace {

constexpr int64_t kRowChunkBytes = 192 << 10;  // a chunk of rows quantized stays in L2 while every panel passes
// From this many row tiles in a block (43 rows on AVX512-VNNI) each tile's share of the next block is small, and the
// tile asks for it from its first input groups on; over fewer, it spreads the requests over its whole loop
// (Tile::prefetch_span). Spread at every row count, the 37k output projection summarized from memory (one thread,
// k 8) ran 1% slower at 128 rows in 5 of 8 rounds, in a trial not kept.
constexpr int64_t kBurstFromRowTiles = 8;

// The tiles of rows [0, rows) x panels [first_panel, end_panel): `tile` holds what they share (x_q, x_scales,
// panels, offsets, w_scales, bias, y and rows at their starts, and the rest as they are), each tile its own part.
// A chunk of rows at a time (kRowChunkBytes), every panel passing over it, a block of gemm.tile_panels panels over
// its tiles of gemm.tile_rows rows in turn.
void run_tiles(const Int8Gemm& chosen, Tile tile, int64_t rows, int64_t first_panel, int64_t end_panel) {
  const Int8Gemm& gemm = chosen.fewer_rows && rows < chosen.min_rows ? *chosen.fewer_rows : chosen;
  int call_state = -1;
  tile.call_state = &call_state;
  const Tile whole = tile;
  const int64_t row_bytes = tile.row_bytes, panel_bytes = tile.input_groups * 64;
  const int64_t tile_rows = gemm.tile_rows;
  const int64_t chunk_rows = std::max<int64_t>(tile_rows, kRowChunkBytes / row_bytes / tile_rows * tile_rows);
  for (int64_t chunk = 0; chunk < rows; chunk += chunk_rows) {
    const int64_t chunk_end = std::min(rows, chunk + chunk_rows);
    // Each of a block's tiles asks for a share of the next block's weights, in proportion to its rows (to the time
    // it takes): all of them from its first tile stalled that tile on the full miss buffers while they came from
    // memory.
    const int64_t chunk_size = chunk_end - chunk, n_row_tiles = (chunk_size + tile_rows - 1) / tile_rows;
    for (int64_t panel = first_panel; panel < end_panel; panel += gemm.tile_panels) {
      const int n_panels = static_cast<int>(std::min<int64_t>(gemm.tile_panels, end_panel - panel));
      const bool has_next = panel + gemm.tile_panels < end_panel;
      for (int64_t row = chunk; row < chunk_end; row += tile_rows) {
        const int n_rows = static_cast<int>(std::min<int64_t>(tile_rows, chunk_end - row));
        tile.x_q = whole.x_q + row * row_bytes;
        tile.x_scales = whole.x_scales + row;
        tile.panels = whole.panels + panel * panel_bytes;
        tile.offsets = whole.offsets + panel * 16;
        tile.w_scales = whole.w_scales + panel * 16;
        tile.bias = whole.bias ? whole.bias + panel * 16 : nullptr;
        const int64_t first_group = (row - chunk) * tile.input_groups / chunk_size;
        tile.prefetch_groups = has_next ? (row + n_rows - chunk) * tile.input_groups / chunk_size - first_group : 0;
        tile.prefetch_span = n_row_tiles >= kBurstFromRowTiles ? tile.prefetch_groups : tile.input_groups;
        tile.next_panels =
            has_next ? whole.panels + (panel + gemm.tile_panels) * panel_bytes + first_group * 64 * gemm.tile_panels
                     : nullptr;
        tile.first_panel = panel;
        tile.y = whole.y ? whole.y + row * whole.out + panel * 16 : nullptr;
        tile.rows = whole.rows ? whole.rows + row : nullptr;
        tile.picked_ids = whole.picked_ids ? whole.picked_ids + row : nullptr;
        tile.n_rows = n_rows;
        gemm.tile_of(n_rows, n_panels)(tile);
      }
    }
  }
  if (gemm.end) gemm.end(call_state);
}

}  // namespace

}  // namespace int8_tiles

void int8_gemm(const Int8Gemm& gemm, const uint8_t* x_q, const float* x_scales, int64_t rows, int64_t in,
               const int8_t* panels, const int32_t* offsets, const float* w_scales, const float* bias, bool relu,
               int64_t out, int64_t first_panel, int64_t end_panel, float* y) {
  const int64_t groups = int8_input_groups(in);
  const int8_tiles::Tile tile{x_q, groups * 4, x_scales, panels, groups, offsets, w_scales, bias, nullptr, 0, 0,
                              relu, first_panel, out, y, nullptr, nullptr, nullptr, 0, nullptr};
  int8_tiles::run_tiles(gemm, tile, rows, first_panel, end_panel);
}

void int8_gemm_summary(const Int8Gemm& gemm, const uint8_t* x_q, const float* x_scales, int64_t rows, int64_t in,
                       const int8_t* panels, const int32_t* offsets, const float* w_scales, const float* bias,
                       int64_t out, int64_t first_panel, int64_t end_panel, const GemmSummary& summary) {
  const int64_t groups = int8_input_groups(in);
  std::vector<summary_tiles::RowSummary> summaries = summary_tiles::start_rows(rows, summary);
  const int8_tiles::Tile tile{x_q, groups * 4, x_scales, panels, groups, offsets, w_scales, bias, nullptr, 0, 0,
                              false, first_panel, out, nullptr, summaries.data(), &summary, summary.picked_ids, 0,
                              nullptr};
  int8_tiles::run_tiles(gemm, tile, rows, first_panel, end_panel);
  summary_tiles::end_rows(summaries, summary);
}

}  // namespace fastformer
