// The linear layers of the compiled encoder and decoder, in one of the CPU compute types (CTranslate2's names):
// "float32", "bfloat16" or "int8". Everything between two GEMMs (attention, layer norms, log-probabilities, beam
// scores) stays float32: a linear layer takes and returns float32 rows whatever its compute type.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "float32_gemm.h"
#include "int8_gemm.h"

namespace fastformer {

enum class ComputeType { kFloat32, kBFloat16, kInt8 };

// "float32", "bfloat16" or "int8"; anything else is an error listing the three.
ComputeType parse_compute_type(const std::string& name);

enum class Activation { kRelu, kGelu, kSwish };

// "relu", "gelu" or "swish" (SiLU), fastformer.TransformerConfig.activation's names.
Activation parse_activation(const std::string& name);

// Has glibc keep freed blocks of up to 32 MiB in the process, and the freed memory at the top of its heaps up to
// 1 GiB, rather than hand them back to the kernel at once: every decoding step frees and allocates blocks of
// megabytes (a group's logits over a 37k vocabulary are 19 MB), and with glibc's defaults each came back as fresh
// pages, zeroed by the kernel on first touch. Measured on the 2-core AVX-512 test CPU (base model, 37k vocabulary,
// 64 sentences, beam 4; glibc variables set and unset, 2-3 runs each): int8 decoding ~1.35x faster, bfloat16
// ~1.2x. The heaps of the other threads' arenas (64 MiB each) are kept too, by a 64 MiB top pad: glibc unmaps such
// a heap once it is empty, and the searches of the pool's threads emptied and remapped theirs at every search (int8,
// three 64-sentence searches: 43k page faults with glibc's pad, 8k with this one). CTranslate2 keeps its own
// caching allocator for the same reason. Done once per process, on the first CPU layer made, and not where the
// user set glibc's malloc options (MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_, MALLOC_TOP_PAD_,
// GLIBC_TUNABLES): those stand.
void keep_freed_buffers();

// The rows of a [rows, width] loop over floats that make a task worth a thread (at::parallel_for's grain; a serial
// loop inside the search's threads).
int64_t rows_per_task(int64_t width);

// The int8 activations' steps a side: 127 where the CPU has VNNI (beam_ops.h's cpu_has_vnni()), else 63. Without
// VNNI, the GEMMs multiply u8 x s8 pairs into saturating int16 sums, which 7-bit activations never overflow. On the
// demo's trained model (500 test sentences), 7 bits changed 4.2% of the lines and BLEU by +0.33 (before ed4ec9c),
// 8 bits 1.0% and +0.06 (at a665c1b; docs/translation.md, "Quality").
float int8_activation_max();

// y = activation(x W^T + b) with W converted once, at construction, for its compute type:
// - float32: fastformer's own GEMM (float32_gemm.h) where the CPU loops are AVX-512's ("avx512-float32") or AVX2's
//   ("avx2-float32": an AVX2 CPU, or FASTFORMER_CPU_ISA=avx2): W in panels of 16 outputs, the bias and ReLU applied
//   as the sums leave the registers. Elsewhere, where torch has oneDNN (its mkldnn ops), W reordered into oneDNN's
//   blocked layout with the bias added inside the GEMM (~10% less CPU time than at::linear's MKL at the base model's
//   shapes); else at::linear.
// - bfloat16: W in bfloat16, reordered for oneDNN where the CPU has the instructions oneDNN's bfloat16 GEMM needs
//   (AVX512-BF16, AMX or AVX-NE-CONVERT); elsewhere at::linear in bfloat16, correct but several times slower than
//   float32 (route() says which). x is rounded to bfloat16 and y widened back.
// - int8: W as int8 with one scale per output row (absmax / 127; absmax / 64 for the AVX2 GEMM, whose int16 sums
//   need 7-bit weights), and x quantized per row on the fly, symmetric: 8 bits (absmax / 127) where the CPU has VNNI,
//   else 7 (absmax / 63), as int8_activation_max() says.
//   y = (x_q W_q^T) * x_scale * w_scale + b. Each row's result depends on that row
//   only, so a sentence translates the same in any batch. Three GEMMs, the first that runs here:
//   - fastformer's own (int8_gemm.h): AVX512-VNNI's where the CPU has it ("vnni-int8"), else AVX-VNNI's
//     ("avxvnni-int8") where it has VNNI on 256-bit vectors, else AVX2's ("avx2-int8"); the rows quantized in two
//     passes, the result scaled, biased and put through ReLU in the GEMM's registers;
//   - FBGEMM's (quantized::linear_dynamic): it quantizes its input with one scale for the whole tensor, so each row
//     is first divided by its absmax, and two rows holding +1 and -1 fix that scale at every call; the rows' scales
//     multiply the result. Against oneDNN's int8 GEMM on the project's AVX2 test CPU, single-threaded: the same
//     speed at 128 rows for the layers, 1.2x for a 37k-vocabulary projection, 4.7x for it at 4 rows (one
//     sentence's beams). Its weight packing goes through torch's quantized tensors, which torch 2.13 deprecates
//     (pytorch#184982): where they are gone, oneDNN's GEMM runs.
//   - oneDNN's (onednn::qlinear_prepack/qlinear_pointwise) on u8 rows around a zero point of 64 (or 128).
// On CUDA every type is at::linear on W as given (the caller casts it).
class PackedLinear {
 public:
  PackedLinear() = default;
  // weight: [out, in], bias: [out]; rows: the rows a call usually has (oneDNN picks its blocking for it);
  // fbgemm: whether int8 may take FBGEMM's GEMM (false: oneDNN's, as where FBGEMM is missing); own_gemm: whether
  // int8 and float32 may take fastformer's own GEMMs where they run (false: the tests' way to the others there).
  PackedLinear(const at::Tensor& weight, const std::optional<at::Tensor>& bias, int64_t rows,
               ComputeType compute_type = ComputeType::kFloat32, bool fbgemm = true, bool own_gemm = true);
  // x: [rows, in] float32 (or the weight's dtype on CUDA) -> [rows, out] in x's dtype
  at::Tensor operator()(const at::Tensor& x, std::optional<Activation> activation = std::nullopt) const;

  // Whether summarize runs: fastformer's own int8 GEMMs' (vnni-int8, avxvnni-int8, avx2-int8) and AVX-512 float32
  // GEMM's (avx512-float32).
  bool has_summary() const {
    return route_ == Route::kOwnInt8 || (route_ == Route::kOwnFloat32 && own_float32_gemm_->gemm_summary);
  }
  // What summarize keeps of each row's outputs, which it never writes (gemm_summary.h's GemmSummary).
  struct Summary {
    at::Tensor values, ids;       // [rows, k] float32, int64: the k highest outputs outside barred, best first
    at::Tensor finite;            // [rows] bool: whether the row's outputs are all finite
    at::Tensor tops, log_totals;  // [rows] float32, where asked: log_softmax(y)[i] = (y[i] - top) - log_total
    at::Tensor picked;            // [rows] float32, where picked_ids were given: the output at each row's id
  };
  // x: [rows, in] float32 -> its outputs' Summary: the k (0..kGemmMaxTopK) highest among the ids not in barred
  // (ties to the lower id; -inf and -1 past a row's finite ones), with_log_totals: each row's top and log_total,
  // picked_ids ([rows] int64 in [0, out), or undefined): the output at each. Where has_summary().
  Summary summarize(const at::Tensor& x, int64_t k, const std::vector<int64_t>& barred, bool with_log_totals = false,
                    const at::Tensor& picked_ids = {}) const;

  // "avx512-float32", "avx2-float32", "onednn", "vnni-int8", "avxvnni-int8", "avx2-int8", "fbgemm-int8",
  // "onednn-int8" or "aten": the GEMM the layer runs.
  const char* route() const;
  // The bytes of the converted weight, bias and scales.
  int64_t nbytes() const;
  // An int8 layer's weight steps a side (127; the AVX2 GEMM's 64), 0 in the other compute types.
  int int8_weight_max() const;

 private:
  enum class Route { kAten, kOneDnn, kOwnFloat32, kOwnInt8, kFbgemmInt8, kOneDnnInt8 };
  void pack_int8(const at::Tensor& weight, int64_t rows, bool fbgemm, bool own_gemm);
  at::Tensor int8_linear(const at::Tensor& x) const;
  at::Tensor own_int8_linear(const at::Tensor& x, std::optional<Activation> activation) const;
  at::Tensor own_float32_linear(const at::Tensor& x, std::optional<Activation> activation) const;
  // x [rows, in] float32, its type and width checked -> contiguous, as the own float32 GEMMs' packing takes it.
  at::Tensor own_float32_input(const at::Tensor& x) const;
  // x [rows, in] float32 -> (its rows quantized [rows, input_groups * 4] uint8, their scales [rows]): int8_gemm.h's.
  std::pair<at::Tensor, at::Tensor> own_quantized(const at::Tensor& x) const;

  Route route_ = Route::kAten;
  const Int8Gemm* own_int8_gemm_ = nullptr;  // the own int8 routes' GEMM
  const Float32Gemm* own_float32_gemm_ = nullptr;  // the own float32 routes' GEMM
  // [out, in]: as given, cast, reordered for oneDNN, or int8 packed by oneDNN; own int8: int8_gemm.h's panels;
  // own float32: float32_gemm.h's
  at::Tensor weight_;
  c10::IValue fbgemm_weight_;  // the int8 weight packed by FBGEMM (a LinearPackedParamsBase)
  int64_t fbgemm_weight_bytes_ = 0;
  // [out]: float32 for int8, else the weight's dtype; own int8 and float32: [panels * 16], zeros past out
  std::optional<at::Tensor> bias_;
  at::Tensor weight_scales_;       // int8: [out] float32; own int8: [panels * 16], zeros past out
  at::Tensor weight_zero_points_;  // oneDNN int8: [out] int64 zeros (symmetric)
  at::Tensor panel_offsets_;       // own int8: [panels * 16] int32, int8_gemm.h's offsets
  int64_t out_features_ = 0, in_features_ = 0;
};

}  // namespace fastformer
