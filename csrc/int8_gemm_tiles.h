// The tiles of the instruction sets' int8 GEMMs (int8_gemm.h): their arguments and a row's running summary, which
// int8_gemm_cpu.cpp, compiled for the build's baseline, runs them with. Each set's file has its tiles
// (int8_gemm_vnni.cpp, int8_gemm_avx2.cpp).
#pragma once

#include <cstdint>

#include "int8_gemm.h"

namespace fastformer::int8_tiles {

// A row's running summary (Int8RowSummary): its best outputs so far (ranked best first, ties to the lower id: the
// panels come in order of their ids, so an output equal to one kept loses to it; -inf and -1 past size), NaN in
// `poison` where any output was NaN or inf, each lane's highest output and sum of e^(output - that), and the picked
// output. The lanes are a panel's 16 outputs. Plain arrays, not vectors: a std::vector's heap blocks are 16-byte
// aligned, not 64.
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
  const int8_t* panels;  // the tile's block of panels (int8_gemm.h's layout): input_groups * 64 bytes a panel
  int64_t input_groups;
  const int32_t* offsets;  // from the tile's first output on, as w_scales and bias
  const float* w_scales;
  const float* bias;
  // The next block's panels, to prefetch into L2 (into L1 they would evict the panels in use) while this block's
  // tiles read their own: its input groups [0, prefetch_groups) from next_panels on, the tile's share of them
  // (run_tiles spreads them over the block's tiles); null and 0 where there is no next block.
  const int8_t* next_panels;
  int64_t prefetch_groups;
  // The AVX512-VNNI tile spreads those groups' requests over its first prefetch_span input groups (prefetch_groups
  // to input_groups); the others ask for one a group from the start.
  int64_t prefetch_span;
  bool relu;
  int64_t first_panel, out;
  float* y;  // the tile's first row and output; null: `rows` summarizes the outputs instead
  RowSummary* rows;  // gemm_summary: the tile's first row's
  const Int8RowSummary* summary;  // gemm_summary: what is kept
  const int64_t* picked_ids;  // gemm_summary: the tile's first row's, or null
};

using TileFunction = void (*)(const Tile&);

// The lanes of panel `panel` (bit i: output 16 * panel + i) that may be a row's best: those below out but the
// summary's barred ids. Inlined in each tile's file (static: each compiled for its own instruction set), where a call
// a panel of every tile was 0.5% of an int8 search's time.
static inline uint32_t allowed_lanes(const Int8RowSummary& summary, int64_t panel, int64_t out) {
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

}  // namespace fastformer::int8_tiles
