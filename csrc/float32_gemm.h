// fastformer's own float32 GEMMs for x86-64 CPUs with AVX2 and FMA, and with AVX-512, torch-free: the float32
// compute type's linear layer there (linear.h), y = x W^T + b (then ReLU where asked).
//
// Why: capped to AVX2 on the AVX-512 test CPU (one thread, call by call in turn), oneDNN's float32 GEMM ran the base
// model's layers at 39-50 G multiply-adds/s, the AVX2 one at 49-54; the 37k-vocabulary output projection at 32 rows
// 37 against 44, at 4 rows (a sentence's beams) 11 against 16 (benchmarks/results/2026-11-27-cpu-amd-epyc-2core-e).
// The AVX-512 one on the Zen 4 EPYC, against oneDNN's AVX-512 GEMM which it replaced: 0.60-0.94 of its time at 4
// rows, 0.85-1.03 at 32 and 128, 0.93-1.06 at 256 and 1344; with the output projection's summary, float32 searches
// 2-4% faster (benchmarks/results/2026-11-30-cpu-amd-epyc-2core-b).
//
// Layout: W [out, in] is held in panels of 16 outputs, each [in, 16]: the 16 outputs' weights for one input are one
// 64-byte line. A tile of up to 6 rows by one panel (AVX2: 12 vector registers of 8 sums) or by 4 panels (AVX-512: 24
// of 16) sums over the whole input, in order, so each output is one chain of fused multiply-adds whatever the tile,
// the batch or the threads: a row's result depends on that row only, and is the same in both GEMMs. (Blocking the
// inputs, which keeps the chains, was no faster in a first probe.)
#pragma once

#include <cstdint>
#include <vector>

#include "gemm_summary.h"

namespace fastformer {

// weight [out, in] float32 -> panels [panel_count, in, 16] (zeros past out).
void float32_pack_panels(const float* weight, int64_t out, int64_t in, float* panels);

// The rows go in tiles of up to 6, of as equal sizes as can be (32 rows: 6 tiles of 5 or 6, not 5 of 6 and one of 2,
// whose 4 chains of sums would wait on the multiply-adds' latency), each tile's rows interleaved, [in, 6] (nothing past
// its rows): a tile reads one stream of rows, not 6 (2-8% faster at 32 to 1344 rows in a first probe, not kept).
constexpr int64_t kFloat32TileRows = 6;
inline int64_t float32_row_tiles(int64_t rows) { return (rows + kFloat32TileRows - 1) / kFloat32TileRows; }

// Row tile t holds rows [float32_tile_start(t, rows), float32_tile_start(t + 1, rows)).
inline int64_t float32_tile_start(int64_t tile, int64_t rows) { return tile * rows / float32_row_tiles(rows); }

// The row tiles of `in` inputs that float32_gemm takes a chunk at a time, every panel passing over the chunk: as many
// as fill half the core's L2 (at least 256 KiB of packed rows), at least one.
int64_t float32_chunk_tiles(int64_t in);

// The row tiles of each chunk of n_tiles: as equal as can be, none above float32_chunk_tiles(in). (256 rows of 512
// inputs, 43 tiles: chunks of 22 and 21, not 42 and 1, the second of which read all the weights again for one tile.)
inline int64_t float32_balanced_chunk_tiles(int64_t in, int64_t n_tiles) {
  const int64_t most = float32_chunk_tiles(in), chunks = (n_tiles + most - 1) / most;
  return (n_tiles + chunks - 1) / chunks;
}

// x [rows, in] float32 -> packed_rows [float32_row_tiles(rows), in, 6] (lanes past a tile's rows not written).
void float32_pack_rows(const float* x, int64_t rows, int64_t in, float* packed_rows);

// One instruction set's float32 GEMM.
struct Float32Gemm {
  const char* isa;    // the CPU loops it goes with (beam_ops.h's cpu_loops()): "avx512" or "avx2"
  const char* route;  // linear.h's PackedLinear::route for layers on it: "avx512-float32" or "avx2-float32"
  int tile_panels;    // a tile's panels: a thread's share of the panels starts at a multiple of it
  // y[:, panels first_panel .. end_panel) <- x W^T + bias, then ReLU where relu (NaN stays NaN); y's row stride is
  // out (a last panel past it is stored in part). packed_rows: x's rows as float32_pack_rows packs them, panels:
  // float32_pack_panels', bias: [panel_count * 16] (0 past out) or null; first_panel a multiple of tile_panels.
  // Single-threaded: the caller splits the panels across threads.
  void (*gemm)(const float* packed_rows, int64_t rows, int64_t in, const float* panels, const float* bias, bool relu,
               int64_t out, int64_t first_panel, int64_t end_panel, float* y);
  // The summary of y's rows over panels [first_panel, end_panel) into `summary`'s arrays (gemm_summary.h), y never
  // written; arguments as gemm's. Single-threaded: the caller splits the rows, or the panels (then
  // merge_gemm_summaries), across threads. Null where the GEMM has none (AVX2's: the logits are written and scanned).
  void (*gemm_summary)(const float* packed_rows, int64_t rows, int64_t in, const float* panels, const float* bias,
                       int64_t out, int64_t first_panel, int64_t end_panel, const GemmSummary& summary);
};

// The float32 GEMMs this build has and this CPU runs, widest first, whatever FASTFORMER_CPU_ISA says (the tests run
// each): on an x86-64 build by GCC, AVX-512's where the CPU has AVX512F, and AVX2's where it has AVX2 and FMA.
std::vector<const Float32Gemm*> float32_gemms();

// The one float32 layers take, or null: the one of the CPU loops' instruction set (an AVX-512 or AVX2 CPU, or
// FASTFORMER_CPU_ISA=avx2); none in the baseline's loops, where oneDNN's runs.
const Float32Gemm* float32_gemm_here();

}  // namespace fastformer
