// fastformer's own float32 GEMM for CPUs whose widest instruction set is AVX2 with FMA, torch-free: the float32
// compute type's linear layer there (linear.h), y = x W^T + b (then ReLU where asked).
//
// Why: capped to AVX2 on the AVX-512 test CPU (one thread, call by call in turn), oneDNN's float32 GEMM ran the base
// model's layers at 39-50 G multiply-adds/s, this one at 49-54; the 37k-vocabulary output projection at 32 rows 37
// against 44, at 4 rows (a sentence's beams) 11 against 16 (benchmarks/results/2026-11-27-cpu-amd-epyc-2core-e).
// Where AVX-512 runs, oneDNN's AVX-512 GEMM stays: in a first probe on that CPU (not kept) it ran as fast as this.
//
// Layout: W [out, in] is held in panels of 16 outputs, each [in, 16]: the 16 outputs' weights for one input are one
// 64-byte line, two 8-float vectors. A tile of up to 6 rows by one panel sums in 12 vector registers over the whole
// input, in order, so each output is one chain of fused multiply-adds whatever the tile, the batch or the threads:
// a row's result depends on that row only. (Blocking the inputs, which keeps the chains, was no faster in a first
// probe.)
#pragma once

#include <cstdint>

namespace fastformer {

// Whether float32_gemm runs here: a CPU with AVX2 and FMA, on an x86-64 build by GCC. linear.h's float32 layers take
// it where the CPU loops are AVX2's too (beam_ops.h's cpu_loops(): an AVX2 CPU, or FASTFORMER_CPU_ISA=avx2).
bool float32_gemm_runs();

// The panels of 16 outputs that hold `out` outputs.
inline int64_t float32_panel_count(int64_t out) { return (out + 15) / 16; }

// weight [out, in] float32 -> panels [panel_count, in, 16] (zeros past out).
void float32_pack_panels(const float* weight, int64_t out, int64_t in, float* panels);

// The rows go in tiles of up to 6, of as equal sizes as can be (32 rows: 6 tiles of 5 or 6, not 5 of 6 and one of 2,
// whose 4 chains of sums would wait on the multiply-adds' latency), each tile's rows interleaved, [in, 6] (nothing past
// its rows): a tile reads one stream of rows, not 6 (2-8% faster at 32 to 1344 rows in a first probe, not kept).
inline int64_t float32_row_tiles(int64_t rows) { return (rows + 5) / 6; }

// The row tiles of `in` inputs that float32_gemm takes a chunk at a time, every panel passing over the chunk: as many
// as fill half the core's L2 (at least 256 KiB of packed rows), at least one.
int64_t float32_chunk_tiles(int64_t in);

// x [rows, in] float32 -> packed_rows [float32_row_tiles(rows), in, 6] (lanes past a tile's rows not written).
void float32_pack_rows(const float* x, int64_t rows, int64_t in, float* packed_rows);

// y[:, panels first_panel .. end_panel) <- x W^T + bias, then ReLU where relu (NaN stays NaN); y's row stride is out
// (a last panel past it is stored in part). packed_rows: x's rows as float32_pack_rows packs them, panels:
// float32_pack_panels', bias: [panel_count * 16] (0 past out) or null. Single-threaded: the caller splits the panels
// across threads.
void float32_gemm(const float* packed_rows, int64_t rows, int64_t in, const float* panels, const float* bias,
                  bool relu, int64_t out, int64_t first_panel, int64_t end_panel, float* y);

}  // namespace fastformer
