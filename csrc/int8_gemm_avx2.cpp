// int8_gemm.h's AVX2 GEMM: a tile of up to 4 rows by one panel (16 outputs) sums in 8 vectors over the whole input,
// so that each sum is written once, as a float.
#include "int8_gemm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "int8_gemm_tiles.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FASTFORMER_INT8_GEMM_AVX2 1
#include <immintrin.h>
#endif

namespace fastformer {

#ifdef FASTFORMER_INT8_GEMM_AVX2

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace {

using int8_tiles::RowSummary;
using int8_tiles::Tile;

// 4 x 2 sums, 2 weight vectors, 2 broadcast rows, the int16 ones and the products: GCC 12 keeps a few sums on the
// stack, whose loads and stores the core absorbs beside the multiplies (3 rows, with fewer, ran slower).
constexpr int kTileRows = 4;

// The lanes of a half panel below `left` outputs from its first: all bits set in each.
inline __m256i lanes_below(int64_t left) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(left, 0, 8))), index);
}

// A row's 8 outputs of half `half` of the tile's panel from their int32 sums.
inline __m256 output_of(const Tile& t, int r, int half, __m256i sum) {
  // In linear.cpp's order for its other int8 routes: the weights' scales first, then the row's and the bias.
  const __m256i offsets = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.offsets + half * 8));
  const __m256 product = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sum, offsets)),
                                       _mm256_loadu_ps(t.w_scales + half * 8));
  __m256 value = _mm256_mul_ps(product, _mm256_set1_ps(t.x_scales[r]));
  if (t.bias) value = _mm256_add_ps(value, _mm256_loadu_ps(t.bias + half * 8));
  // max(0, NaN) is NaN here (the second operand wins a comparison with NaN): a NaN reaches the finite check.
  return t.relu ? _mm256_max_ps(_mm256_setzero_ps(), value) : value;
}

// e^x for x <= 0 (to ~2 ulp; x < -87 gives ~1e-38 rather than 0, and NaN gives it too): 2^n * e^r with n =
// round(x / ln 2) and |r| <= ln(2) / 2 by a degree-6 polynomial, ln 2 split in two so that r stays exact; 2^n, n in
// [-126, 0], built in its exponent bits.
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f),
                                    _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x));
  __m256 p = _mm256_set1_ps(1.38888889e-3f);
  for (const float c : {8.33333333e-3f, 4.16666667e-2f, 1.66666667e-1f, 0.5f, 1.0f, 1.0f}) {
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  }
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}

// Adds a row's outputs of one panel (value[half] in the lanes of lanes[half]) to its lane-wise highest outputs and
// sums of e^(output - highest): a lane's sum is rescaled only where the panel raises its highest.
inline void add_to_totals(RowSummary& row, const __m256 (&value)[2], const __m256i (&lanes)[2]) {
  for (int half = 0; half < 2; ++half) {
    const __m256 in_lanes = _mm256_castsi256_ps(lanes[half]);
    const __m256 panel_top =
        _mm256_blendv_ps(_mm256_set1_ps(-std::numeric_limits<float>::infinity()), value[half], in_lanes);
    __m256 top = _mm256_loadu_ps(row.lane_tops + half * 8), total = _mm256_loadu_ps(row.lane_totals + half * 8);
    const __m256 raised = _mm256_cmp_ps(panel_top, top, _CMP_GT_OQ);
    if (_mm256_movemask_ps(raised)) {
      total = _mm256_blendv_ps(total, _mm256_mul_ps(total, exp_nonpositive(_mm256_sub_ps(top, panel_top))), raised);
      top = _mm256_blendv_ps(top, panel_top, raised);
      _mm256_storeu_ps(row.lane_tops + half * 8, top);
    }
    total = _mm256_add_ps(total, _mm256_and_ps(exp_nonpositive(_mm256_sub_ps(value[half], top)), in_lanes));
    _mm256_storeu_ps(row.lane_totals + half * 8, total);
  }
}

// Row r's 16 outputs of the tile's panel from their sums (low: outputs 0-7, high: 8-15) into y, or (y null) into
// the row's summary (RowSummary): they cost one comparison with the row's bar unless one of them beats it, and their
// exponentials where the summary takes log_totals. allowed: the panel's lanes that may be a row's best.
inline void finish_row(const Tile& t, int r, __m256i low, __m256i high, uint32_t allowed) {
  const __m256 value[2] = {output_of(t, r, 0, low), output_of(t, r, 1, high)};
  const int64_t left = t.out - t.first_panel * 16;
  if (t.y) {
    float* y = t.y + r * t.out;
    if (left >= 16) {
      _mm256_storeu_ps(y, value[0]);
      _mm256_storeu_ps(y + 8, value[1]);
    } else {
      _mm256_maskstore_ps(y, lanes_below(left), value[0]);
      _mm256_maskstore_ps(y + 8, lanes_below(left - 8), value[1]);
    }
    return;
  }
  RowSummary& row = t.rows[r];
  const Int8RowSummary& s = *t.summary;
  // value * 0 is NaN where value is NaN or inf. The lanes past out hold 0 (zero weights, scales and bias), or NaN in
  // a row that is NaN everywhere.
  for (int half = 0; half < 2; ++half) {
    _mm256_storeu_ps(row.poison + half * 8, _mm256_add_ps(_mm256_loadu_ps(row.poison + half * 8),
                                                          _mm256_mul_ps(value[half], _mm256_setzero_ps())));
  }
  alignas(32) float values[16];
  _mm256_store_ps(values, value[0]);
  _mm256_store_ps(values + 8, value[1]);
  if (s.k > 0) {
    const __m256 bar = _mm256_set1_ps(row.bar);
    const uint32_t above = (static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(value[0], bar, _CMP_GT_OQ))) |
                            static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(value[1], bar, _CMP_GT_OQ))) << 8) &
                           allowed;
    if (above) int8_tiles::offer(row, s.k, t.first_panel, values, above);
  }
  if (s.log_totals) add_to_totals(row, value, {lanes_below(left), lanes_below(left - 8)});
  if (t.picked_ids && t.picked_ids[r] / 16 == t.first_panel) row.picked = values[t.picked_ids[r] % 16];
}

// Named sums, not an array: GCC 12 kept an array of them on the stack in float32_gemm's tile, storing every sum at
// every input. A row's 4 bytes of group g, broadcast, times a half panel's 4 bytes of 8 outputs: vpmaddubsw's int16
// pairs, summed into the int32 sums by vpmaddwd. The multiplies bound the tile, so two groups' pairs are added in
// int16 first: 3 multiplies per 8 inputs where each group took 2. The 7-bit weights keep that sum of four products
// below 32767 (4 * 127 * 64 = 32512).
#define FASTFORMER_ROW_STEP(r, low, high)                                                                \
  if constexpr (kRows > r) {                                                                             \
    int32_t four;                                                                                        \
    std::memcpy(&four, t.x_q + r * t.row_bytes + g * 4, sizeof four);                                    \
    const __m256i row = _mm256_set1_epi32(four);                                                         \
    low = _mm256_add_epi32(low, _mm256_madd_epi16(_mm256_maddubs_epi16(row, w_low), ones));              \
    high = _mm256_add_epi32(high, _mm256_madd_epi16(_mm256_maddubs_epi16(row, w_high), ones));           \
  }
#define FASTFORMER_ROW_PAIR_STEP(r, sum, w, next_w)                                                      \
  if constexpr (kRows > r) {                                                                             \
    int32_t four, next_four;                                                                             \
    std::memcpy(&four, t.x_q + r * t.row_bytes + g * 4, sizeof four);                                    \
    std::memcpy(&next_four, t.x_q + r * t.row_bytes + g * 4 + 4, sizeof next_four);                      \
    const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_set1_epi32(four), w),             \
                                           _mm256_maddubs_epi16(_mm256_set1_epi32(next_four), next_w));  \
    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, ones));                                         \
  }

// Half a panel (8 outputs) at a time keeps 2 weight vectors live rather than 4.
template <int kRows>
void run_tile(const Tile& t) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s0l = _mm256_setzero_si256(), s0h = s0l, s1l = s0l, s1h = s0l, s2l = s0l, s2h = s0l, s3l = s0l, s3h = s0l;
  int64_t g = 0;
  for (; g + 2 <= t.input_groups; g += 2) {
    if (t.next_panels) {
      _mm_prefetch(reinterpret_cast<const char*>(t.next_panels + g * 64), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(t.next_panels + g * 64 + 64), _MM_HINT_T1);
    }
    const __m256i* w = reinterpret_cast<const __m256i*>(t.panels + g * 64);
    const __m256i w_low = _mm256_loadu_si256(w), next_low = _mm256_loadu_si256(w + 2);
    FASTFORMER_ROW_PAIR_STEP(0, s0l, w_low, next_low)
    FASTFORMER_ROW_PAIR_STEP(1, s1l, w_low, next_low)
    FASTFORMER_ROW_PAIR_STEP(2, s2l, w_low, next_low)
    FASTFORMER_ROW_PAIR_STEP(3, s3l, w_low, next_low)
    const __m256i w_high = _mm256_loadu_si256(w + 1), next_high = _mm256_loadu_si256(w + 3);
    FASTFORMER_ROW_PAIR_STEP(0, s0h, w_high, next_high)
    FASTFORMER_ROW_PAIR_STEP(1, s1h, w_high, next_high)
    FASTFORMER_ROW_PAIR_STEP(2, s2h, w_high, next_high)
    FASTFORMER_ROW_PAIR_STEP(3, s3h, w_high, next_high)
  }
  if (g < t.input_groups) {  // an odd last group
    const __m256i* w = reinterpret_cast<const __m256i*>(t.panels + g * 64);
    const __m256i w_low = _mm256_loadu_si256(w), w_high = _mm256_loadu_si256(w + 1);
    FASTFORMER_ROW_STEP(0, s0l, s0h)
    FASTFORMER_ROW_STEP(1, s1l, s1h)
    FASTFORMER_ROW_STEP(2, s2l, s2h)
    FASTFORMER_ROW_STEP(3, s3l, s3h)
  }
  const uint32_t allowed = t.y || t.summary->k == 0 ? 0 : int8_tiles::allowed_lanes(*t.summary, t.first_panel, t.out);
  finish_row(t, 0, s0l, s0h, allowed);
  if constexpr (kRows > 1) finish_row(t, 1, s1l, s1h, allowed);
  if constexpr (kRows > 2) finish_row(t, 2, s2l, s2h, allowed);
  if constexpr (kRows > 3) finish_row(t, 3, s3l, s3h, allowed);
}

#undef FASTFORMER_ROW_STEP
#undef FASTFORMER_ROW_PAIR_STEP

int8_tiles::TileFunction tile_function(int rows, int /*panels: always 1*/) {
  switch (rows) {
    case 1: return run_tile<1>;
    case 2: return run_tile<2>;
    case 3: return run_tile<3>;
    default: return run_tile<4>;
  }
}

// Int8Gemm::quantize_row with zero point 64.
void quantize_row(const float* row, int64_t in, float inverse, uint8_t* x_q) {
  std::memset(x_q, 64, int8_input_groups(in) * 4);
  if (inverse == 0.0f) return;
  const __m256 factor = _mm256_set1_ps(inverse);
  const __m256i zero_point = _mm256_set1_epi32(64);
  int64_t i = 0;
  for (; i + 8 <= in; i += 8) {
    // Rounded to nearest even, as std::nearbyint in the default rounding mode; |x| * 63 / absmax <= 63.
    const __m256i q = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(row + i), factor)),
                                       zero_point);
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(x_q + i), _mm_packus_epi16(words, words));
  }
  for (; i < in; ++i) x_q[i] = static_cast<uint8_t>(std::nearbyint(row[i] * inverse) + 64.0f);
}

constexpr Int8Gemm kAvx2Gemm{"avx2", 64, 64, kTileRows, 1, tile_function, quantize_row};

}  // namespace

#pragma GCC pop_options

const Int8Gemm* avx2_int8_gemm() {
  __builtin_cpu_init();
  static const bool runs = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return runs ? &kAvx2Gemm : nullptr;
}

#else  // no x86-64 GCC build: the int8 compute type runs FBGEMM's or oneDNN's GEMM (linear.cpp)

const Int8Gemm* avx2_int8_gemm() { return nullptr; }

#endif

}  // namespace fastformer
