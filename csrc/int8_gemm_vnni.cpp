// int8_gemm.h's AVX512-VNNI GEMM: a tile of up to 6 rows by 4 panels (64 outputs) sums in 24 vector registers over
// the whole input, so that each sum is written once, as a float. And its AMX GEMM, whose tiles of up to 32 rows sum
// in the tile registers and leave their outputs as AVX512-VNNI's do.
#include "int8_gemm.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "int8_gemm_tiles.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FASTFORMER_INT8_GEMM 1
#include <cpuid.h>
#include <immintrin.h>
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif
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

// sum [16] int32 of a row and panel -> their 16 outputs, from the panel's offsets, weight scales and bias (has_bias)
// and the row's scale. In linear.cpp's order for its other int8 routes: the weights' scales first, then the row's and
// the bias.
FASTFORMER_INLINE __m512 output_from(__m512i sum, __m512i offsets, __m512 w_scales, __m512 x_scale, bool has_bias,
                                     __m512 bias, bool relu) {
  const __m512 product = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum, offsets)), w_scales);
  __m512 value = _mm512_mul_ps(product, x_scale);
  if (has_bias) value = _mm512_add_ps(value, bias);
  // max(0, NaN) is NaN here (the second operand wins a comparison with NaN): a NaN reaches the finite check.
  return relu ? _mm512_max_ps(_mm512_setzero_ps(), value) : value;
}

// One output vector of a tile: sum [16] int32 -> the row's 16 outputs of panel p.
FASTFORMER_INLINE __m512 output_of(const Tile& t, int r, int p, __m512i sum) {
  return output_from(sum, _mm512_loadu_si512(t.offsets + p * 16), _mm512_loadu_ps(t.w_scales + p * 16),
                     _mm512_set1_ps(t.x_scales[r]), t.bias != nullptr,
                     t.bias ? _mm512_loadu_ps(t.bias + p * 16) : _mm512_setzero_ps(), t.relu);
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

// Int8Gemm::quantize_row with zero point 128. 64 inputs at a time are packed into one 64-byte store (the packs
// work within 128-bit lanes, so a permutation puts their 4-byte groups in order), and the last ones 16 at a time:
// a masked narrowing store for each 16 ran at 0.39-0.72x the speed on rows in L2 on the Intel Xeon
// (benchmarks/results/2026-12-01-cpu-intel-xeon-2core-c). |x| * 127 / absmax <= 127: no pack saturates.
void quantize_row(const float* row, int64_t in, float inverse, uint8_t* x_q) {
  const int64_t bytes = int8_input_groups(in) * 4;
  if (inverse == 0.0f) {
    std::memset(x_q, 128, bytes);
    return;
  }
  std::memset(x_q + in, 128, bytes - in);
  const __m512 factor = _mm512_set1_ps(inverse);
  int64_t i = 0;
  const __m512i group_order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  const __m512i byte_zero_point = _mm512_set1_epi8(static_cast<char>(128));
  for (; i + 64 <= in; i += 64) {
    __m512i q[4];
    for (int v = 0; v < 4; ++v) q[v] = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(row + i + 16 * v), factor));
    const __m512i bytes_in_lanes =
        _mm512_packs_epi16(_mm512_packs_epi32(q[0], q[1]), _mm512_packs_epi32(q[2], q[3]));
    _mm512_storeu_si512(x_q + i,
                        _mm512_add_epi8(_mm512_permutexvar_epi32(group_order, bytes_in_lanes), byte_zero_point));
  }
  const __m512i zero_point = _mm512_set1_epi32(128);
  for (; i < in; i += 16) {
    const __mmask16 lanes = in - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (in - i)) - 1);
    // Rounded to nearest even, as std::nearbyint in the default rounding mode; |x| * 127 / absmax <= 127.
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, row + i), factor));
    _mm512_mask_cvtepi32_storeu_epi8(x_q + i, lanes, _mm512_add_epi32(q, zero_point));
  }
}

constexpr Int8Gemm kVnniGemm{"avx512-vnni", "vnni-int8", 128, 127, kTileRows, kTilePanels, tile_function,
                             quantize_row};

// The AMX tile: up to 32 rows (two blocks of up to 16) by up to 4 panels, a pair of panels at a time in the 8 tile
// registers: sums (block b, panel q of the pair) in tmm(2b + q), the blocks' row bytes in tmm4 and tmm5, the pair's
// weights in tmm6 and tmm7. The sums go to memory once, then the input groups past the last whole 64 inputs are
// added by vpdpbusd, and the outputs leave as in the AVX512-VNNI tile.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,prfchw,amx-tile,amx-int8")

constexpr int kAmxTileRows = 32;
constexpr int kAmxBlockRows = 16;
constexpr int kAmxStepGroups = 16;  // a tdpbusd's inputs: 64 bytes of each row
// Calls of fewer rows run AVX512-VNNI's tiles: a tdpbusd takes as long for 1 row as for 16, and at 8 to 16 rows of
// the 37k-vocabulary projection AMX read 0.90-1.04x AVX512-VNNI's speed
// (benchmarks/results/2026-12-01-cpu-intel-xeon-2core/amx_gemm_bench.log).
constexpr int64_t kAmxMinRows = 16;

// GCC 12's tile intrinsics are asm statements that do not say they read or write memory: this orders them with the
// code's own loads and stores.
FASTFORMER_INLINE void memory_barrier() { asm volatile("" ::: "memory"); }

// ldtilecfg's 64 bytes: palette 1, each tile register's bytes a row and rows.
struct alignas(64) AmxConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// The tile registers configured for blocks of first_rows and second_rows rows. A call's tiles keep the rows they are
// configured for in Tile::call_state (first * 64 + second, -1 for none), from the call's first tile to its end
// (amx_end): other code (oneDNN's AMX kernels) may configure them between calls. A thread_local in its place cost
// each tile a call of __tls_get_addr (1-2% of scoring's perf samples with amx_configure).
void amx_configure(int* configured, int first_rows, int second_rows) {
  const int key = first_rows * 64 + second_rows;
  if (key == *configured) return;
  AmxConfig config;
  for (int block = 0; block < 2; ++block) {
    const int rows = block ? second_rows : first_rows;
    for (int tile : {2 * block, 2 * block + 1, 4 + block}) {
      config.rows[tile] = static_cast<uint8_t>(rows);
      config.bytes_per_row[tile] = rows ? 64 : 0;
    }
  }
  for (int tile : {6, 7}) {
    config.rows[tile] = kAmxStepGroups;
    config.bytes_per_row[tile] = 64;
  }
  memory_barrier();
  _tile_loadconfig(&config);
  *configured = key;
}

// Leaves the tile registers in their initial state, so that the kernel saves no tile data at a context switch.
void amx_end(int configured) {
  if (configured != -1) _tile_release();
}

template <int kPanels>
void run_amx_tile(const Tile& t) {
  const int rows = t.n_rows, first_rows = std::min(rows, kAmxBlockRows), second_rows = rows - first_rows;
  if (rows <= kTileRows) {  // a call's last few rows: AVX512-VNNI's tile of their size
    tile_function(rows, kPanels)(t);
    return;
  }
  amx_configure(t.call_state, first_rows, second_rows);
  memory_barrier();
  if (t.y) {
    for (int r = 0; r < rows; ++r) {
      for (int p = 0; p < kPanels; ++p) __builtin_prefetch(t.y + r * t.out + p * 16, /*rw=*/1, /*locality=*/3);
    }
  }
  alignas(64) int32_t sums[kAmxTileRows][kTilePanels * 16];
  constexpr int64_t kSumsStride = sizeof sums[0];
  constexpr int64_t kGroupBytes = kTilePanels * 64;  // a block's panels' vectors of one input group
  const int64_t steps = t.input_groups / kAmxStepGroups, second_offset = kAmxBlockRows * t.row_bytes;
  // The tile's share of the next block as run_tile asks for it: group j by loop group j * prefetch_span /
  // prefetch_groups, here a step's groups at a time over the first pair's steps.
  int64_t next_group = 0;
  auto prefetch_through = [&](int64_t loop_group) {
    for (; next_group < t.prefetch_groups && next_group * t.prefetch_span <= loop_group * t.prefetch_groups;
         ++next_group) {
      for (int p = 0; p < kTilePanels; ++p) {
        _mm_prefetch(reinterpret_cast<const char*>(t.next_panels + (next_group * kTilePanels + p) * 64),
                     _MM_HINT_T1);
      }
    }
  };
  for (int pair = 0; pair < kPanels; pair += 2) {
    const bool two = pair + 1 < kPanels;
    _tile_zero(0);
    if (two) _tile_zero(1);
    if (second_rows) {
      _tile_zero(2);
      if (two) _tile_zero(3);
    }
    for (int64_t step = 0; step < steps; ++step) {
      const uint8_t* x = t.x_q + step * 64;
      const int8_t* w = t.panels + (step * kAmxStepGroups * kTilePanels + pair) * 64;
      _tile_loadd(4, x, t.row_bytes);
      _tile_loadd(6, w, kGroupBytes);
      _tile_dpbusd(0, 4, 6);
      if (two) {
        _tile_loadd(7, w + 64, kGroupBytes);
        _tile_dpbusd(1, 4, 7);
      }
      if (second_rows) {
        _tile_loadd(5, x + second_offset, t.row_bytes);
        _tile_dpbusd(2, 5, 6);
        if (two) _tile_dpbusd(3, 5, 7);
      }
      if (pair == 0) prefetch_through((step + 1) * kAmxStepGroups - 1);
    }
    _tile_stored(0, &sums[0][pair * 16], kSumsStride);
    if (two) _tile_stored(1, &sums[0][(pair + 1) * 16], kSumsStride);
    if (second_rows) {
      _tile_stored(2, &sums[kAmxBlockRows][pair * 16], kSumsStride);
      if (two) _tile_stored(3, &sums[kAmxBlockRows][(pair + 1) * 16], kSumsStride);
    }
  }
  memory_barrier();
  prefetch_through(t.input_groups);
  if (steps * kAmxStepGroups < t.input_groups) {
    for (int r = 0; r < rows; ++r) {
      for (int p = 0; p < kPanels; ++p) {
        __m512i sum = _mm512_load_si512(&sums[r][p * 16]);
        for (int64_t g = steps * kAmxStepGroups; g < t.input_groups; ++g) {
          int32_t four;
          std::memcpy(&four, t.x_q + r * t.row_bytes + g * 4, sizeof four);
          sum = dot_add(sum, _mm512_set1_epi32(four), _mm512_loadu_si512(t.panels + (g * kTilePanels + p) * 64));
        }
        _mm512_store_si512(&sums[r][p * 16], sum);
      }
    }
  }
  // The outputs leave as the AVX512-VNNI tile's do (output_from), the panels' offsets, scales and bias held in
  // registers and the tile's fields in locals: read through t, they were loaded again for every output (its stores
  // may alias them), and the outputs took up to 30% of the tile's time at 512 inputs. Called in turn with the tile
  // as it was, from C++ on the Intel Xeon, one thread: 0.92-0.98 of its time writing outputs at 512 inputs (0.97-0.99
  // at 2048), 0.73-0.90 summarizing the 37k output projection (benchmarks/results/2026-12-01-cpu-intel-xeon-2core-b).
  __m512i offsets[kPanels];
  __m512 w_scales[kPanels], bias[kPanels];
  for (int p = 0; p < kPanels; ++p) {
    offsets[p] = _mm512_loadu_si512(t.offsets + p * 16);
    w_scales[p] = _mm512_loadu_ps(t.w_scales + p * 16);
    bias[p] = t.bias ? _mm512_loadu_ps(t.bias + p * 16) : _mm512_setzero_ps();
  }
  const float* const x_scales = t.x_scales;
  const bool has_bias = t.bias != nullptr, relu = t.relu;
  auto row_outputs = [&](int r, __m512 (&value)[kPanels]) {
    const __m512 x_scale = _mm512_set1_ps(x_scales[r]);
    for (int p = 0; p < kPanels; ++p) {
      value[p] = output_from(_mm512_load_si512(&sums[r][p * 16]), offsets[p], w_scales[p], x_scale, has_bias, bias[p],
                             relu);
    }
  };
  __m512 value[kPanels];
  if (t.y) {
    float* const y = t.y;
    const int64_t out = t.out;
    __mmask16 lanes[kPanels];
    for (int p = 0; p < kPanels; ++p) lanes[p] = panel_lanes(t.first_panel + p, out);
    for (int r = 0; r < rows; ++r) {
      row_outputs(r, value);
      for (int p = 0; p < kPanels; ++p) _mm512_mask_storeu_ps(y + r * out + p * 16, lanes[p], value[p]);
    }
    return;
  }
  const PanelLanes<kPanels> panels(*t.summary, t.first_panel, t.out);
  for (int r = 0; r < rows; ++r) {
    row_outputs(r, value);
    summarize_row(t.rows[r], *t.summary, t.first_panel, panels, value, t.picked_ids ? t.picked_ids + r : nullptr);
  }
}

TileFunction amx_tile_function(int /*rows: the tile's n_rows*/, int panels) {
  switch (panels) {
    case 1: return run_amx_tile<1>;
    case 2: return run_amx_tile<2>;
    case 3: return run_amx_tile<3>;
    default: return run_amx_tile<4>;
  }
}

#pragma GCC pop_options

constexpr Int8Gemm kAmxGemm{"amx", "amx-int8", 128, 127, kAmxTileRows, kTilePanels, amx_tile_function,
                            quantize_row, &kVnniGemm, kAmxMinRows, amx_end};

// Whether the CPU has AMX-TILE and AMX-INT8 (CPUID leaf 7, EDX bits 24 and 25) and Linux gives this process the
// tile registers' state, which it does only once asked (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA, feature 18).
bool amx_runs() {
#ifdef __linux__
  unsigned int eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !((edx >> 24) & 1) || !((edx >> 25) & 1)) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

}  // namespace

#pragma GCC pop_options

const Int8Gemm* vnni_int8_gemm() {
  __builtin_cpu_init();
  // Every CPU with AVX512-VNNI has PREFETCHW too (run_tile's prefetch of its outputs).
  static const bool runs = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  return runs ? &kVnniGemm : nullptr;
}

const Int8Gemm* amx_int8_gemm() {
  static const bool runs = vnni_int8_gemm() && amx_runs();
  return runs ? &kAmxGemm : nullptr;
}

#else  // no x86-64 GCC build: the int8 compute type runs FBGEMM's or oneDNN's GEMM (linear.cpp)

const Int8Gemm* vnni_int8_gemm() { return nullptr; }
const Int8Gemm* amx_int8_gemm() { return nullptr; }

#endif

}  // namespace fastformer
