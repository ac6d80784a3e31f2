// The constants of e^x for x <= 0 in the vector loops (beam_ops_cpu.inc, int8_gemm_vnni.cpp, int8_gemm_avx2.inc),
// each written in its own instructions: 2^n * e^r with n = round(x / ln 2) and |r| <= ln(2) / 2 by a degree-6
// polynomial, to ~2 ulp; x is first raised to kExpLowest, so that 2^n stays a normal float (e^-87 ~ 1.6e-38 rather
// than 0).
#pragma once

#include <iterator>  // std::size, the loops' bound over kExpPolynomial

namespace fastformer {

constexpr float kExpLowest = -87.0f;
constexpr float kLog2E = 1.44269504f;
// ln 2 in two parts, so that r = x - n * ln 2 stays exact: kLn2High has few enough significant bits (15) that
// n * kLn2High is exact for every |n| <= 126.
constexpr float kLn2High = 0.693145751953125f;
constexpr float kLn2Low = 1.42860677e-6f;
// e^r's Taylor terms 1/6! ... 1/0!, highest degree first (Horner's order).
constexpr float kExpPolynomial[7] = {1.38888889e-3f, 8.33333333e-3f, 4.16666667e-2f, 1.66666667e-1f, 0.5f, 1.0f, 1.0f};

}  // namespace fastformer
