// float32_gemm.h's packing and choice of GEMM, and its AVX2 GEMM in AVX2 and FMA intrinsics: a tile of up to 6 rows
// by one panel (16 outputs) sums in 12 vector registers over the whole input, so that each sum is written once.
#include "float32_gemm.h"

#include "beam_ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#ifdef __SSE2__
#include <xmmintrin.h>
#endif

#if __has_include(<unistd.h>)
#include <unistd.h>  // sysconf: the L2's size
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FASTFORMER_FLOAT32_GEMM 1
#include <immintrin.h>
#endif

namespace fastformer {

void float32_pack_panels(const float* weight, int64_t out, int64_t in, float* panels) {
  std::memset(panels, 0, sizeof(float) * gemm_panel_count(out) * in * 16);
  for (int64_t o = 0; o < out; ++o) {
    float* panel = panels + (o / 16) * in * 16 + o % 16;
    for (int64_t i = 0; i < in; ++i) panel[i * 16] = weight[o * in + i];
  }
}

// Every chunk reads all the weights again, so a chunk too small for the rows makes a call over the 37k vocabulary
// (76 MB of panels) read them several times: at 256 rows (beam 4 of 64 sentences), 256 KiB chunks ran at 0.94-1.01
// of MKL's speed, 1 MiB ones (half the Intel Xeon's 2 MiB L2) at 1.03-1.05, in alternating runs capped to AVX2
// (benchmarks/results/2026-11-28-cpu-intel-xeon-2core-d).
int64_t float32_chunk_tiles(int64_t in) {
  static const int64_t chunk_bytes = [] {
    int64_t l2_bytes = 0;
#ifdef _SC_LEVEL2_CACHE_SIZE
    l2_bytes = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    return std::max<int64_t>(l2_bytes / 2, int64_t{256} << 10);
  }();
  return std::max<int64_t>(1, chunk_bytes / (in * 6 * static_cast<int64_t>(sizeof(float))));
}

// Defined in float32_gemm_avx512.cpp and below: null where the build or the CPU lacks the instruction set.
const Float32Gemm* avx512_float32_gemm();
const Float32Gemm* avx2_float32_gemm();

std::vector<const Float32Gemm*> float32_gemms() {
  std::vector<const Float32Gemm*> gemms;
  for (const Float32Gemm* gemm : {avx512_float32_gemm(), avx2_float32_gemm()}) {
    if (gemm) gemms.push_back(gemm);
  }
  return gemms;
}

const Float32Gemm* float32_gemm_here() {
  static const Float32Gemm* const chosen = [] () -> const Float32Gemm* {
    const std::string isa = cpu_loops().isa;
    for (const Float32Gemm* gemm : float32_gemms()) {
      if (isa == gemm->isa) return gemm;
    }
    return nullptr;
  }();
  return chosen;
}

void float32_pack_rows(const float* x, int64_t rows, int64_t in, float* packed_rows) {
  for (int64_t tile = 0; tile < float32_row_tiles(rows); ++tile) {
    const int64_t first = float32_tile_start(tile, rows), n_rows = float32_tile_start(tile + 1, rows) - first;
    const float* tile_x = x + first * in;
    float* packed = packed_rows + tile * in * 6;
    int64_t i = 0;
#ifdef __SSE2__
    // 4 inputs of the tile's rows at a time, transposed in registers: a value at a time, the packing took 2.1% of a
    // float32 beam search's perf samples capped to AVX2 on the Intel Xeon. A tile of 4 or 5 rows repeats its last
    // row in the lanes past it, which no tile reads.
    if (n_rows >= 4) {
      const float* row[6];
      for (int r = 0; r < 6; ++r) row[r] = tile_x + std::min<int64_t>(r, n_rows - 1) * in;
      for (; i + 4 <= in; i += 4) {
        __m128 r0 = _mm_loadu_ps(row[0] + i), r1 = _mm_loadu_ps(row[1] + i), r2 = _mm_loadu_ps(row[2] + i),
               r3 = _mm_loadu_ps(row[3] + i);
        _MM_TRANSPOSE4_PS(r0, r1, r2, r3);  // r_j: rows 0-3 of input i + j
        const __m128 r4 = _mm_loadu_ps(row[4] + i), r5 = _mm_loadu_ps(row[5] + i);
        // rows 4 and 5 of inputs i and i + 1 (low), of i + 2 and i + 3 (high)
        const __m128 low = _mm_unpacklo_ps(r4, r5), high = _mm_unpackhi_ps(r4, r5);
        float* at = packed + i * 6;
        _mm_storeu_ps(at, r0);
        _mm_storel_pi(reinterpret_cast<__m64*>(at + 4), low);
        _mm_storeu_ps(at + 6, r1);
        _mm_storeh_pi(reinterpret_cast<__m64*>(at + 10), low);
        _mm_storeu_ps(at + 12, r2);
        _mm_storel_pi(reinterpret_cast<__m64*>(at + 16), high);
        _mm_storeu_ps(at + 18, r3);
        _mm_storeh_pi(reinterpret_cast<__m64*>(at + 22), high);
      }
    }
#endif
    // Lanes past the tile's rows are left as they are: no tile reads them.
    for (int64_t lane = 0; lane < n_rows; ++lane) {
      for (int64_t j = i; j < in; ++j) packed[j * 6 + lane] = tile_x[lane * in + j];
    }
  }
}

#ifdef FASTFORMER_FLOAT32_GEMM

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace {

constexpr int kTileRows = 6;  // 6 x 2 sums, 2 weight vectors and a broadcast: 15 of the 16 vector registers

struct Tile {
  const float* rows;   // the tile's packed rows, [in, 6]
  int64_t in;          // the panels' depth
  const float* panel;  // the tile's panel
  // The next panel, to prefetch into L2 while the panel's first tile reads its own from memory; null in the others.
  const float* next_panel;
  const float* bias;  // the panel's 16, or null
  bool relu;
  int64_t out_left;  // the outputs from the panel's first on (16 or more: a whole panel)
  float* y;          // the tile's first row and output
  int64_t y_stride;
};

// The 8 lanes of a half panel that hold outputs, as a mask for _mm256_maskstore_ps.
inline __m256i lanes_of(int64_t left) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(left, 8))), index);
}

// One row's 16 outputs, biased and (max(0, x) keeps NaN: the second operand wins a comparison with NaN) rectified.
inline void store_row(const Tile& t, int r, __m256 low, __m256 high) {
  if (t.bias) {
    low = _mm256_add_ps(low, _mm256_loadu_ps(t.bias));
    high = _mm256_add_ps(high, _mm256_loadu_ps(t.bias + 8));
  }
  if (t.relu) {
    low = _mm256_max_ps(_mm256_setzero_ps(), low);
    high = _mm256_max_ps(_mm256_setzero_ps(), high);
  }
  float* y = t.y + r * t.y_stride;
  if (t.out_left >= 16) {
    _mm256_storeu_ps(y, low);
    _mm256_storeu_ps(y + 8, high);
    return;
  }
  _mm256_maskstore_ps(y, lanes_of(t.out_left), low);
  if (t.out_left > 8) _mm256_maskstore_ps(y + 8, lanes_of(t.out_left - 8), high);
}

// Named sums, not an array: GCC 12 kept an array of them on the stack, storing every sum at every input (a third of
// the speed measured).
#define FASTFORMER_ROW_STEP(r, low, high)                                       \
  if constexpr (kRows > r) {                                                    \
    const __m256 a = _mm256_broadcast_ss(t.rows + i * 6 + r);                   \
    low = _mm256_fmadd_ps(a, w_low, low);                                       \
    high = _mm256_fmadd_ps(a, w_high, high);                                    \
  }

template <int kRows>
void run_tile(const Tile& t) {
  __m256 s0l = _mm256_setzero_ps(), s0h = s0l, s1l = s0l, s1h = s0l, s2l = s0l, s2h = s0l;
  __m256 s3l = s0l, s3h = s0l, s4l = s0l, s4h = s0l, s5l = s0l, s5h = s0l;
  for (int64_t i = 0; i < t.in; ++i) {
    if (t.next_panel) _mm_prefetch(reinterpret_cast<const char*>(t.next_panel + i * 16), _MM_HINT_T1);
    const __m256 w_low = _mm256_loadu_ps(t.panel + i * 16), w_high = _mm256_loadu_ps(t.panel + i * 16 + 8);
    FASTFORMER_ROW_STEP(0, s0l, s0h)
    FASTFORMER_ROW_STEP(1, s1l, s1h)
    FASTFORMER_ROW_STEP(2, s2l, s2h)
    FASTFORMER_ROW_STEP(3, s3l, s3h)
    FASTFORMER_ROW_STEP(4, s4l, s4h)
    FASTFORMER_ROW_STEP(5, s5l, s5h)
  }
  store_row(t, 0, s0l, s0h);
  if constexpr (kRows > 1) store_row(t, 1, s1l, s1h);
  if constexpr (kRows > 2) store_row(t, 2, s2l, s2h);
  if constexpr (kRows > 3) store_row(t, 3, s3l, s3h);
  if constexpr (kRows > 4) store_row(t, 4, s4l, s4h);
  if constexpr (kRows > 5) store_row(t, 5, s5l, s5h);
}

#undef FASTFORMER_ROW_STEP

using TileFunction = void (*)(const Tile&);
constexpr TileFunction kTiles[kTileRows + 1] = {nullptr,         run_tile<1>, run_tile<2>, run_tile<3>,
                                                run_tile<4>,     run_tile<5>, run_tile<6>};

void gemm(const float* packed_rows, int64_t rows, int64_t in, const float* panels, const float* bias, bool relu,
          int64_t out, int64_t first_panel, int64_t end_panel, float* y) {
  const int64_t n_tiles = float32_row_tiles(rows);
  const int64_t chunk_tiles = float32_balanced_chunk_tiles(in, n_tiles);
  for (int64_t chunk = 0; chunk < n_tiles; chunk += chunk_tiles) {
    const int64_t chunk_end = std::min(n_tiles, chunk + chunk_tiles);
    for (int64_t panel = first_panel; panel < end_panel; ++panel) {
      const float* panel_data = panels + panel * in * 16;
      for (int64_t tile = chunk; tile < chunk_end; ++tile) {
        const int64_t row = float32_tile_start(tile, rows);
        const Tile t{packed_rows + tile * in * 6,
                     in,
                     panel_data,
                     tile == chunk && panel + 1 < end_panel ? panel_data + in * 16 : nullptr,
                     bias ? bias + panel * 16 : nullptr,
                     relu,
                     out - panel * 16,
                     y + row * out + panel * 16,
                     out};
        kTiles[float32_tile_start(tile + 1, rows) - row](t);
      }
    }
  }
}

constexpr Float32Gemm kAvx2Gemm{"avx2", "avx2-float32", 1, gemm, nullptr};

}  // namespace

#pragma GCC pop_options

const Float32Gemm* avx2_float32_gemm() {
  __builtin_cpu_init();
  static const bool runs = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return runs ? &kAvx2Gemm : nullptr;
}

#else  // no x86-64 GCC build: float32 runs oneDNN's GEMM (linear.cpp)

const Float32Gemm* avx2_float32_gemm() { return nullptr; }

#endif

}  // namespace fastformer
