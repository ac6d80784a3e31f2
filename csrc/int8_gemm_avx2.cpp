// int8_gemm.h's GEMMs on 256-bit vectors: AVX2's, and AVX-VNNI's for CPUs that have VNNI on 256-bit vectors only
// (AVX-VNNI without AVX512-VNNI, or AVX-512 capped to AVX2 by FASTFORMER_CPU_ISA), the same tiles compiled twice
// (int8_gemm_avx2.inc).
#include "int8_gemm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "exp_nonpositive.h"
#include "int8_gemm_tiles.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FASTFORMER_INT8_GEMM_AVX2 1
#include <immintrin.h>
#endif

namespace fastformer {

#ifdef FASTFORMER_INT8_GEMM_AVX2

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define FASTFORMER_INT8_AVX_VNNI 0
namespace avx2 {
#include "int8_gemm_avx2.inc"
}  // namespace avx2
#undef FASTFORMER_INT8_AVX_VNNI
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avxvnni")
#define FASTFORMER_INT8_AVX_VNNI 1
namespace avx_vnni {
#include "int8_gemm_avx2.inc"
}  // namespace avx_vnni
#undef FASTFORMER_INT8_AVX_VNNI
#pragma GCC pop_options

const Int8Gemm* avx2_int8_gemm() {
  __builtin_cpu_init();
  static const bool runs = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return runs ? &avx2::kGemm : nullptr;
}

const Int8Gemm* avx_vnni_int8_gemm() {
  __builtin_cpu_init();
  static const bool runs = avx2_int8_gemm() && __builtin_cpu_supports("avxvnni");
  return runs ? &avx_vnni::kGemm : nullptr;
}

#else  // no x86-64 GCC build: the int8 compute type runs FBGEMM's or oneDNN's GEMM (linear.cpp)

const Int8Gemm* avx2_int8_gemm() { return nullptr; }
const Int8Gemm* avx_vnni_int8_gemm() { return nullptr; }

#endif

}  // namespace fastformer
