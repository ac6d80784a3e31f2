// int8_gemm.h's AVX512-VNNI GEMM: a tile of up to 6 rows by 4 panels (64 outputs) sums in 24 vector registers over
// the whole input, so that each sum is written once, as a float.
#include "int8_gemm.h"

#include <cstdint>
#include <cstring>
#include <limits>

#include "exp_nonpositive.h"
#include "int8_gemm_tiles.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FASTFORMER_INT8_GEMM 1
#include <immintrin.h>
#endif

namespace fastformer {

#ifdef FASTFORMER_INT8_GEMM

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,prfchw")
// GCC 12's intrinsics start some results from _mm512_undefined_ps(), a variable initialized from itself, which its
// own uninitialized-use warnings then flag.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define FASTFORMER_INLINE inline __attribute__((always_inline))

namespace {

using int8_tiles::RowSummary;
using int8_tiles::Tile;

constexpr int kTileRows = 6;    // 6 x 4 sums, 4 panel vectors and a broadcast row: 29 of the 32 vector registers
constexpr int kTilePanels = 4;

// The lanes of a panel that hold outputs: all 16, or the out - 16 * panel left in the last one.
FASTFORMER_INLINE __mmask16 panel_lanes(int64_t panel, int64_t out) {
  const int64_t left = out - panel * 16;
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
}

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

// Offers a row's outputs of a tile to its best as int8_tiles::offer does: values [n_panels * 16] from first_panel's
// first output on, a candidate a bit (bit i: output 16 * first_panel + i). Out of line: inlined, it made GCC keep
// finish's sums and outputs on the stack. Where k <= 16 the best stay in three vectors while the candidates go in,
// each by a compare, permutes and blends: with offer's loop of shifts and stores, and a branch a panel, the output
// projection's top-10 summary took 5-6% longer than its top-1, now 3-4% (32 to 128 rows, one thread).
__attribute__((noinline)) void offer_tile(RowSummary& row, int k, int64_t first_panel, const float* values,
                                          uint64_t candidates, int n_panels) {
  if (k > 16) {
    for (int p = 0; p < n_panels; ++p) {
      const uint32_t lanes = (candidates >> (16 * p)) & 0xFFFF;
      if (lanes) int8_tiles::offer(row, k, first_panel + p, values + 16 * p, lanes);
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
    allowed[p] = static_cast<__mmask16>(int8_tiles::allowed_lanes(*t.summary, t.first_panel + p, t.out));
  }
  const Int8RowSummary& s = *t.summary;
  for (int r = 0; r < kRows; ++r) {
    RowSummary& row = t.rows[r];
    __m512 value[kPanels];
    __m512 poison = _mm512_setzero_ps();
    uint64_t candidates = 0;  // the tile's outputs that beat the row's bar: one branch a row
    for (int p = 0; p < kPanels; ++p) {
      value[p] = output_of(t, r, p, sums[r][p]);
      poison = _mm512_mask_add_ps(poison, lanes[p], poison, _mm512_mul_ps(value[p], _mm512_setzero_ps()));
      if (s.k == 0) continue;
      const __mmask16 above = _mm512_mask_cmp_ps_mask(allowed[p], value[p], _mm512_set1_ps(row.bar), _CMP_GT_OQ);
      candidates |= static_cast<uint64_t>(above) << (16 * p);
    }
    if (candidates) {
      alignas(64) float values[kPanels * 16];
      for (int p = 0; p < kPanels; ++p) _mm512_store_ps(values + 16 * p, value[p]);
      offer_tile(row, s.k, t.first_panel, values, candidates, kPanels);
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
