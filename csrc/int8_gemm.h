// fastformer's own int8 GEMMs for x86-64 CPUs, torch-free: the int8 compute type's linear layer (linear.h)
// y = (x_q W_q^T) * x_scale * w_scale + b, with the rows quantized straight into the bytes they multiply (their
// absmax, then the bytes) and the result scaled, biased and (optionally) put through ReLU as it leaves the
// registers. FBGEMM's int8 GEMM, which they replace where they run, takes the activations through four passes (the
// absmax, per-row normalization, the library's range search and quantization) and the result through two (the
// library's dequantization, then the rows' scales and the bias).
//
// Layout: W_q [out, in] int8 is held in panels of 16 outputs, each [in_groups, 16, 4] (in_groups = ceil(in / 4)):
// the 4 consecutive inputs of 16 outputs are one 64-byte vector. The panels go in blocks of the GEMM's tile_panels,
// interleaved group by group ([in_groups, tile_panels, 16, 4] a block), so that a tile reads its weights as one
// stream. The rows go in as uint8 x_q + zero_point (the instructions multiply unsigned by signed bytes), and
// zero_point * each output's weight sum (its offset) is subtracted from the sums. One Int8Gemm per instruction set:
// - AVX512-VNNI: 8-bit rows (x_q in [-127, 127], zero point 128). vpdpbusd multiplies 4 bytes of a row, broadcast,
//   with the 64-byte vector, summing into 16 int32 lanes.
// - AVX-VNNI (VNNI on 256-bit vectors: CPUs with AVX2 and AVX-VNNI but no AVX512-VNNI, or AVX-512 ones under
//   FASTFORMER_CPU_ISA=avx2): AVX512-VNNI's 8-bit rows and weights, vpdpbusd on half a vector (8 int32 lanes).
// - AMX (Intel's tile registers, Sapphire Rapids on): AVX512-VNNI's rows, weights and outputs, the products summed by
//   tdpbusd, 16 rows by 16 outputs by 64 inputs an instruction, from the same panels (a panel's 16 consecutive groups
//   are one tile of weights, its rows 4 * tile_panels * 16 bytes apart). Its sums are exact int32 as vpdpbusd's, so
//   its outputs are AVX512-VNNI's, bit for bit.
// - AVX2: 7-bit rows (x_q in [-63, 63], zero point 64: bytes in [1, 127]), the rows linear.h's int8_activation_max()
//   gives CPUs without VNNI, and 7-bit weights (W_q in [-64, 64]). vpmaddubsw multiplies each 32-byte half of the
//   vector with the row's bytes into pairs summed in saturating int16; two groups' pairs are added in int16, which
//   such rows and weights never overflow (4 * 127 * 64 < 32767), and vpmaddwd sums them into 8 int32 lanes.
#pragma once

#include <cstdint>
#include <vector>

#include "gemm_summary.h"

namespace fastformer {

namespace int8_tiles {
struct Tile;  // int8_gemm_tiles.h
}

// One instruction set's int8 GEMM: its row quantization and its tiles, which int8_gemm and int8_gemm_summary run.
struct Int8Gemm {
  const char* isa;    // "avx512-vnni", "avx-vnni" or "avx2"
  const char* route;  // linear.h's PackedLinear::route for layers on it: "vnni-int8", "avxvnni-int8" or "avx2-int8"
  int zero_point;     // 128 (8-bit rows) or 64 (7-bit rows)
  int weight_max;     // the weights' largest magnitude, in [-weight_max, weight_max]: 127, or AVX2's 64
  // Its tiles: up to tile_rows rows by tile_panels panels, tile_of(rows, panels) the one of each size. A thread
  // given fewer rows than tile_rows leaves part of its registers idle.
  int tile_rows, tile_panels;
  void (*(*tile_of)(int rows, int panels))(const int8_tiles::Tile&);
  // row [in] float32 and its inverse scale (linear.cpp's row_scales: int8_activation_max() / absmax, or 0 for a row
  // of NaN, inf or zeros) -> x_q [input_groups * 4] uint8: round(row * inverse) + zero_point, and zero_point in the
  // padding and wherever inverse is 0 (that row's scale, NaN or 1, then gives NaN outputs or the bias).
  void (*quantize_row)(const float* row, int64_t in, float inverse, uint8_t* x_q);
  // A call of fewer than min_rows rows runs fewer_rows's tiles (the same packing and rows) instead; null: none.
  const Int8Gemm* fewer_rows = nullptr;
  int64_t min_rows = 0;
  // Called by a thread after it has run the GEMM's tiles in a call, where not null, with the state its tiles left
  // in Tile::call_state (AMX's release of its tile registers, so that the next call configures them again).
  void (*end)(int call_state) = nullptr;
};

// The int8 GEMMs this build has and this CPU runs, widest first, whatever FASTFORMER_CPU_ISA and FASTFORMER_CPU_AMX
// say (the tests run each): on an x86-64 build by GCC, AMX's where the CPU has AMX-INT8 and Linux grants the
// process its tile registers, AVX512-VNNI's where the CPU has it (and AVX512-BW), AVX-VNNI's where it has that, and
// AVX2's.
std::vector<const Int8Gemm*> int8_gemms();

// The one int8 layers take, or null: AMX's where the CPU loops are AVX-512's (beam_ops.h's cpu_loops(), which
// FASTFORMER_CPU_ISA caps), VNNI counts (beam_ops.h's cpu_has_vnni) and AMX runs here (cpu_has_amx); else
// AVX512-VNNI's there; else, where the loops are not the
// baseline's, AVX-VNNI's where VNNI counts (8-bit rows) and AVX2's where it does not (int8_activation_max() is then
// 63: 7-bit rows).
const Int8Gemm* int8_gemm_here();

// Whether the AMX int8 GEMM runs here: the build and the CPU have it, Linux grants the tile registers, and
// FASTFORMER_CPU_AMX leaves it on (unset, empty or 1; 0 turns it off, for AVX512-VNNI's GEMM; another value throws).
bool cpu_has_amx();

// Whether int8 layers run one of fastformer's own GEMMs here.
inline bool int8_gemm_runs() { return int8_gemm_here() != nullptr; }

// The groups of 4 inputs that hold `in` inputs (the panels: gemm_summary.h's gemm_panel_count).
inline int64_t int8_input_groups(int64_t in) { return (in + 3) / 4; }

// The bytes of `out` outputs' panels of `in` inputs in blocks of block_panels (whole blocks).
inline int64_t int8_packed_bytes(int64_t out, int64_t in, int block_panels) {
  return (gemm_panel_count(out) + block_panels - 1) / block_panels * block_panels * int8_input_groups(in) * 64;
}

// weight [out, in] int8 -> panels [int8_packed_bytes(out, in, block_panels)] in blocks of block_panels panels, each
// [input_groups, block_panels, 16, 4] (zeros past out and in), and offsets [panel_count * 16] (zero_point * each
// output's weight sum, 0 past out). The weights must lie in the GEMM's [-weight_max, weight_max].
void int8_pack_panels(const int8_t* weight, int64_t out, int64_t in, int zero_point, int block_panels,
                      int8_t* panels, int32_t* offsets);

// y[:, panels first_panel .. end_panel) <- (x_q - zero_point) W_q^T * x_scales[row] * w_scales + bias, then ReLU where
// relu, in `gemm`'s tiles; y's row stride is out (a last panel past it is stored in part). x_q: [rows,
// input_groups(in) * 4] uint8 (gemm.quantize_row's), x_scales: [rows], panels/offsets: int8_pack_panels' with
// gemm's zero point and block_panels gemm.tile_panels, w_scales and bias: [panel_count * 16] (0 past out; bias may
// be null); first_panel a multiple of gemm.tile_panels. Single-threaded: the caller splits the panels across threads.
void int8_gemm(const Int8Gemm& gemm, const uint8_t* x_q, const float* x_scales, int64_t rows, int64_t in,
               const int8_t* panels, const int32_t* offsets, const float* w_scales, const float* bias, bool relu,
               int64_t out, int64_t first_panel, int64_t end_panel, float* y);

// The summary of y's rows over panels [first_panel, end_panel) into `summary`'s arrays (GemmSummary), y never
// written. Arguments as int8_gemm's. Single-threaded: the caller splits the rows, or the panels (then
// merge_gemm_summaries), across threads.
void int8_gemm_summary(const Int8Gemm& gemm, const uint8_t* x_q, const float* x_scales, int64_t rows, int64_t in,
                       const int8_t* panels, const int32_t* offsets, const float* w_scales, const float* bias,
                       int64_t out, int64_t first_panel, int64_t end_panel, const GemmSummary& summary);

}  // namespace fastformer
