// fp32 CPU implementations of the beam-search ops (see beam_ops.h), torch-free: the loops of beam_ops_cpu.inc
// compiled once per instruction set, and the choice among them.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "beam_ops.h"
#include "exp_nonpositive.h"

#if defined(__x86_64__)
#include <immintrin.h>  // the float16 conversions of the AVX-512 and F16C loops
#endif

#define FASTFORMER_INLINE inline __attribute__((always_inline))
// GCC warns that a vector passed by value has another ABI without AVX; every helper taking one is inlined, so no
// vector crosses a call.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

// Every standard header is included above: the instruction sets below apply to the functions the .inc defines, never
// to a library function that another translation unit could share.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FASTFORMER_X86_ISAS 1
#pragma GCC push_options
#pragma GCC target("arch=x86-64-v4")
#define FASTFORMER_ISA isa_avx512
#define FASTFORMER_ISA_NAME "avx512"
#define FASTFORMER_LANES 16
#define FASTFORMER_F16C 1
#define FASTFORMER_FMA 1
#include "beam_ops_cpu.inc"
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("arch=x86-64-v3")
#define FASTFORMER_ISA isa_avx2
#define FASTFORMER_ISA_NAME "avx2"
#define FASTFORMER_LANES 8
#define FASTFORMER_F16C 1
#define FASTFORMER_FMA 1
#include "beam_ops_cpu.inc"
#pragma GCC pop_options
#endif

// The build's own target: SSE2 on x86-64, whatever the compiler targets elsewhere.
#define FASTFORMER_ISA isa_baseline
#define FASTFORMER_ISA_NAME "baseline"
#define FASTFORMER_LANES 8
#define FASTFORMER_F16C 0
#define FASTFORMER_FMA 0
#include "beam_ops_cpu.inc"

namespace fastformer {
namespace {

// Every instruction set this build has, widest first, and whether this CPU runs it.
struct Compiled {
  const CpuLoops* loops;
  bool runs;
};

std::vector<Compiled> compiled_isas() {
  std::vector<Compiled> isas;
#ifdef FASTFORMER_X86_ISAS
  __builtin_cpu_init();
  isas.push_back({&isa_avx512::loops, __builtin_cpu_supports("x86-64-v4") > 0});
  isas.push_back({&isa_avx2::loops, __builtin_cpu_supports("x86-64-v3") > 0});
#endif
  isas.push_back({&isa_baseline::loops, true});
  return isas;
}

// The widest instruction set this CPU runs, or the one FASTFORMER_CPU_ISA names.
const CpuLoops& chosen_loops() {
  const char* cap = std::getenv("FASTFORMER_CPU_ISA");
  std::string names;
  for (const Compiled& isa : compiled_isas()) {
    if (!isa.runs) continue;
    if (!cap || !*cap || isa.loops->isa == std::string(cap)) return *isa.loops;
    names += (names.empty() ? "" : ", ") + std::string(isa.loops->isa);
  }
  throw std::invalid_argument("FASTFORMER_CPU_ISA=" + std::string(cap) + " is not an instruction set this CPU and "
                              "build run the CPU loops in; use one of: " + names);
}

}  // namespace

std::vector<const CpuLoops*> cpu_isas() {
  std::vector<const CpuLoops*> runnable;
  for (const Compiled& isa : compiled_isas()) {
    if (isa.runs) runnable.push_back(isa.loops);
  }
  return runnable;
}

const CpuLoops& cpu_loops() {
  static const CpuLoops& loops = chosen_loops();  // a bad FASTFORMER_CPU_ISA throws again at the next call
  return loops;
}

bool cpu_switch_on(const char* variable, const char* off) {
  const char* value = std::getenv(variable);
  if (!value || !*value || std::string(value) == "1") return true;
  if (std::string(value) == "0") return false;
  throw std::invalid_argument(std::string(variable) + "=" + value + " is neither 0 (" + off + ") nor 1");
}

namespace {

// Whether FASTFORMER_CPU_VNNI leaves VNNI on.
bool vnni_allowed() {
  static const bool allowed = cpu_switch_on("FASTFORMER_CPU_VNNI", "VNNI off");  // a bad value throws at each call
  return allowed;
}

}  // namespace

bool cpu_has_vnni() {
#ifdef FASTFORMER_X86_ISAS
  if (!vnni_allowed()) return false;
  __builtin_cpu_init();
  const std::string isa = cpu_loops().isa;
  return (isa == "avx512" && __builtin_cpu_supports("avx512vnni")) ||
         (isa != "baseline" && __builtin_cpu_supports("avxvnni"));
#else
  return false;
#endif
}

void self_attention_step_cpu(const SelfAttentionArgs& args) { cpu_loops().self_attention_step(args); }
void cross_attention_cpu(const CrossAttentionArgs& args) { cpu_loops().cross_attention(args); }
void block_attention_cpu(const BlockAttentionArgs& args) { cpu_loops().block_attention(args); }
void beam_step_cpu(const BeamStepArgs& args) { cpu_loops().beam_step(args); }
void row_absmax_cpu(const float* x, int64_t n_rows, int64_t width, float* absmax) {
  cpu_loops().row_absmax(x, n_rows, width, absmax);
}
void add_layer_norm_cpu(const float* x, const float* residual, int64_t n_rows, int64_t width, const float* gamma,
                        const float* beta, float eps, float* out) {
  cpu_loops().add_layer_norm(x, residual, n_rows, width, gamma, beta, eps, out);
}
void clamped_scale_cpu(const float* x, int64_t width, float factor, float* out) {
  cpu_loops().clamped_scale(x, width, factor, out);
}
void target_log_probs_cpu(const float* logits, int64_t n_rows, int64_t width, const int64_t* targets, float* out) {
  cpu_loops().target_log_probs(logits, n_rows, width, targets, out);
}
void top_k_row_cpu(const float* row, int64_t width, int64_t k, const int64_t* excluded, int64_t n_excluded,
                   int64_t fill_id, float* values, int64_t* ids, float* top, float* log_total) {
  cpu_loops().top_k_row(row, width, k, excluded, n_excluded, fill_id, values, ids, top, log_total);
}
void scale_and_add_cpu(float* y, int64_t width, float scale, const float* bias) {
  cpu_loops().scale_and_add(y, width, scale, bias);
}
void round_to_float16_cpu(float* x, int64_t n_rows, int64_t width, int64_t row_stride) {
  cpu_loops().round_to_float16(x, n_rows, width, row_stride);
}

}  // namespace fastformer
