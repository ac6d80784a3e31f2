// The tiles of the instruction sets' int8 GEMMs (int8_gemm.h): their arguments, which int8_gemm_cpu.cpp, compiled
// for the build's baseline, runs them with. Each set's file has its tiles
// (int8_gemm_vnni.cpp, int8_gemm_avx2.cpp).
#pragma once

#include <cstdint>

#include "gemm_summary.h"
#include "int8_gemm.h"

namespace fastformer::int8_tiles {

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
  summary_tiles::RowSummary* rows;  // gemm_summary: the tile's first row's
  const GemmSummary* summary;        // gemm_summary: what is kept
  const int64_t* picked_ids;  // gemm_summary: the tile's first row's, or null
  int n_rows;  // the tile's rows: the AMX tile reads it, the others are built for theirs
  // What a GEMM's tiles keep from tile to tile of a thread's call, -1 at its start (the AMX tile's configuration of
  // the tile registers), for Int8Gemm::end.
  int* call_state;
};

using TileFunction = void (*)(const Tile&);

}  // namespace fastformer::int8_tiles
