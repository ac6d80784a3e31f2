// int8_gemm.h's AVX512-VNNI GEMM: a tile of up to 6 rows by 4 panels (64 outputs) sums in 24 vector registers over
// the whole input, so that each sum is written once, as a float.
#include "int8_gemm.h"

#include <cstdint>
#include <cstring>
#include <limits>

#include "int8_gemm_tiles.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FASTFORMER_INT8_GEMM 1
#include <immintrin.h>
#endif

#ifdef FASTFORMER_INT8_GEMM
// Everything up to pop_options below compiled for the instruction sets of the tiles.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,prfchw")
// GCC 12's intrinsics start some results from _mm512_undefined_ps(), a variable initialized from itself, which its
// own uninitialized-use warnings then flag.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "gemm_tiles_avx512.h"
#endif

namespace fastformer {

#ifdef FASTFORMER_INT8_GEMM

namespace {

using int8_tiles::Tile;

constexpr int kTileRows = 6;    // 6 x 4 sums, 4 panel vectors and a broadcast row: 29 of the 32 vector registers
constexpr int kTilePanels = 4;

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

// The tile's outputs into y, or (y null) into each row's summary.
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
  summarize_tile<kRows, kPanels>(t.rows, *t.summary, t.first_panel, t.out, t.picked_ids,
                                 [&](int r, int p) { return output_of(t, r, p, sums[r][p]); });
}

template <int kRows, int kPanels>
void run_tile(const Tile& t) {
  __m512i sums[kRows][kPanels];
  for (int r = 0; r < kRows; ++r) {
    for (int p = 0; p < kPanels; ++p) sums[r][p] = _mm512_setzero_si512();
  }
  if (t.y) prefetch_outputs<kRows, kPanels>(t.y, t.out);
  // The tile's share of the next block, a group (kTilePanels lines) at a time spread over prefetch_span groups:
  // group j at the first g with g * prefetch_groups >= j * prefetch_span.
  int64_t next_group = 0, progress = 0, due = 0;
  for (int64_t g = 0; g < t.input_groups; ++g) {
    __m512i weights[kPanels];
    for (int p = 0; p < kPanels; ++p) weights[p] = _mm512_loadu_si512(t.panels + (g * kTilePanels + p) * 64);
    if (next_group < t.prefetch_groups && progress >= due) {
      for (int p = 0; p < kTilePanels; ++p) {
        _mm_prefetch(reinterpret_cast<const char*>(t.next_panels + (next_group * kTilePanels + p) * 64),
                     _MM_HINT_T1);
      }
      ++next_group;
      due += t.prefetch_span;
    }
    progress += t.prefetch_groups;
    for (int r = 0; r < kRows; ++r) {
      int32_t four;
      std::memcpy(&four, t.x_q + r * t.row_bytes + g * 4, sizeof four);
      const __m512i row = _mm512_set1_epi32(four);
      for (int p = 0; p < kPanels; ++p) sums[r][p] = dot_add(sums[r][p], row, weights[p]);
    }
  }
  finish(t, sums);
}

using int8_tiles::TileFunction;

TileFunction tile_function(int rows, int panels) {
  return tile_of_size(rows, panels, [](auto r, auto p) -> TileFunction { return run_tile<r.value, p.value>; });
}

// Int8Gemm::quantize_row with zero point 128.
void quantize_row(const float* row, int64_t in, float inverse, uint8_t* x_q) {
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

constexpr Int8Gemm kVnniGemm{"avx512-vnni", "vnni-int8", 128, 127, kTileRows, kTilePanels, tile_function,
                             quantize_row};

}  // namespace

#pragma GCC pop_options

const Int8Gemm* vnni_int8_gemm() {
  __builtin_cpu_init();
  // Every CPU with AVX512-VNNI has PREFETCHW too (run_tile's prefetch of its outputs).
  static const bool runs = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  return runs ? &kVnniGemm : nullptr;
}

#else  // no x86-64 GCC build: the int8 compute type runs FBGEMM's or oneDNN's GEMM (linear.cpp)

const Int8Gemm* vnni_int8_gemm() { return nullptr; }

#endif

}  // namespace fastformer
