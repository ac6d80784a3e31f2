// PackedLinear (see linear.h): torch's oneDNN ops for the GEMMs, reached through the dispatcher where this torch
// build has them, and at::linear everywhere else.
#include "linear.h"

#include "beam_ops.h"
#include "float32_gemm.h"
#include "int8_gemm.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace fastformer {
namespace {

// torch's oneDNN and FBGEMM linear ops, where this torch build has them (looked up once).
struct GemmOps {
  std::optional<c10::OperatorHandle> reorder_weight, linear, onednn_int8_prepack, onednn_int8_linear,
      fbgemm_int8_prepack, fbgemm_int8_linear;
};

const GemmOps& gemm_ops() {
  auto& dispatcher = c10::Dispatcher::singleton();
  static const GemmOps ops{dispatcher.findSchema({"mkldnn::_reorder_linear_weight", ""}),
                           dispatcher.findSchema({"mkldnn::_linear_pointwise", ""}),
                           dispatcher.findSchema({"onednn::qlinear_prepack", ""}),
                           dispatcher.findSchema({"onednn::qlinear_pointwise", ""}),
                           dispatcher.findSchema({"quantized::linear_prepack", ""}),
                           dispatcher.findSchema({"quantized::linear_dynamic", ""})};
  return ops;
}

// oneDNN's int8 GEMM takes the activations as u8 around this zero point: 64 or 128.
int64_t activation_zero_point() { return static_cast<int64_t>(int8_activation_max()) + 1; }

// Drops the warnings raised while it lives: torch's deprecation of the quantized tensors that FBGEMM's packing
// takes is about torch's API, not something a user of fastformer can act on.
class SilentWarnings : public c10::WarningHandler {
 public:
  void process(const c10::Warning&) override {}
};

// Each row's scale (linear.h): absmax / int8_activation_max(), NaN for a row holding NaN or inf (so that its
// outputs are NaN for the search's finite check), 1 for an all-zero row. Calls write(row, inverse) with 1 / scale
// (0 for the two others).
template <typename WriteRow>
at::Tensor row_scales(const at::Tensor& x, WriteRow&& write) {
  const int64_t rows = x.size(0), in = x.size(1);
  at::Tensor scales = at::empty({rows}, x.options());
  const float* source = x.data_ptr<float>();
  float* scale = scales.data_ptr<float>();
  const float levels = int8_activation_max();
  at::parallel_for(0, rows, rows_per_task(in), [&](int64_t first_row, int64_t end_row) {
    // A block of rows at a time, so that `write` reads them from L1.
    const int64_t block_rows = std::max<int64_t>(1, (16 << 10) / (in * static_cast<int64_t>(sizeof(float))));
    for (int64_t r = first_row; r < end_row; ++r) {
      if ((r - first_row) % block_rows == 0) {
        row_absmax_cpu(source + r * in, std::min(block_rows, end_row - r), in, scale + r);
      }
      const float absmax = scale[r];
      const bool finite = !std::isnan(absmax);
      const bool usable = finite && absmax > 0.0f;
      scale[r] = !finite ? absmax : (usable ? absmax / levels : 1.0f);
      write(r, source + r * in, usable ? levels / absmax : 0.0f);
    }
  });
  return scales;
}

// x: [rows, in] float32 -> (x_q [rows, in] uint8, scales [rows]), x ~ (x_q - 64) * scale per row.
std::pair<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x) {
  const int64_t in = x.size(1);
  at::Tensor quantized = at::empty(x.sizes(), x.options().dtype(at::kByte));
  uint8_t* target = quantized.data_ptr<uint8_t>();
  const int64_t zero_point = activation_zero_point();
  at::Tensor scales = row_scales(x, [&](int64_t r, const float* row, float inverse) {
    uint8_t* out = target + r * in;
    if (inverse == 0.0f) {
      std::fill(out, out + in, static_cast<uint8_t>(zero_point));
      return;
    }
    for (int64_t i = 0; i < in; ++i) {
      out[i] = static_cast<uint8_t>(std::nearbyint(row[i] * inverse) + zero_point);
    }
  });
  return {quantized, scales};
}

// x: [rows, in] float32 -> (x_n [rows + 2, in] float32, scales [rows]): each row divided by 63 * its scale, so in
// [-1, 1], then the rows [+1, 0, ...] and [-1, 0, ...], which make FBGEMM's per-tensor range [-1, 1] at every call.
std::pair<at::Tensor, at::Tensor> normalize_rows(const at::Tensor& x) {
  const int64_t rows = x.size(0), in = x.size(1);
  at::Tensor normalized = at::empty({rows + 2, in}, x.options());
  float* target = normalized.data_ptr<float>();
  const float levels = int8_activation_max();
  at::Tensor scales = row_scales(x, [&](int64_t r, const float* row, float inverse) {
    float* out = target + r * in;
    if (inverse == 0.0f) {
      std::fill(out, out + in, 0.0f);
      return;
    }
    // Clamped: a row's maximum may round to 1 + 1 ulp, which would move the range, and so every row's rounding.
    clamped_scale_cpu(row, in, inverse / levels, out);
  });
  std::fill(target + rows * in, target + (rows + 2) * in, 0.0f);
  target[rows * in] = 1.0f;
  target[(rows + 1) * in] = -1.0f;
  return {normalized, scales};
}

// y [rows, out] (or more rows, the first `rows` used) <- y * scales[row] + bias, in place.
void scale_rows(at::Tensor& y, int64_t rows, const at::Tensor& scales, const std::optional<at::Tensor>& bias_tensor) {
  const int64_t out = y.size(1);
  float* values = y.data_ptr<float>();
  const float* row_scale = scales.data_ptr<float>();
  const float* bias = bias_tensor ? bias_tensor->data_ptr<float>() : nullptr;
  at::parallel_for(0, rows, rows_per_task(out), [&](int64_t first_row, int64_t end_row) {
    for (int64_t r = first_row; r < end_row; ++r) scale_and_add_cpu(values + r * out, out, row_scale[r], bias);
  });
}

// [n] float32 -> [n rounded up to 16], zeros past n (the own int8 routes' scales and bias, the own float32 routes'
// bias: whole panels of 16 outputs).
at::Tensor padded_to_panels(const at::Tensor& values) {
  at::Tensor padded = at::zeros({(values.size(0) + 15) / 16 * 16}, values.options());
  padded.narrow(0, 0, values.size(0)).copy_(values);
  return padded;
}

at::Tensor apply_activation(at::Tensor x, std::optional<Activation> activation) {
  if (!activation) return x;
  switch (*activation) {
    case Activation::kRelu: return at::relu_(x);
    case Activation::kGelu: return at::gelu(x);
    case Activation::kSwish: return at::silu_(x);
  }
  return x;
}

// Calls a boxed op with `arguments` -> its one tensor result.
at::Tensor call(const c10::OperatorHandle& op, std::vector<c10::IValue> arguments) {
  op.callBoxed(arguments);
  return arguments[0].toTensor();
}

// The weights' steps a side in FBGEMM's and oneDNN's int8 routes (the own GEMMs' are Int8Gemm::weight_max).
constexpr int kLibraryInt8WeightMax = 127;

// The units (blocks of a GEMM's outputs, each of outputs_per_unit) a thread's task takes: at least 2^22 multiply-adds
// a task, or as long reading weights. Below `weight_bound_rows` rows a GEMM's time is that of reading its weights
// from memory (a decoding step's, which pass through the L3 every step), and a task takes as long as
// weight_bound_rows rows' multiply-adds would.
int64_t units_per_task(int64_t rows, int64_t in, int64_t outputs_per_unit, int64_t weight_bound_rows) {
  const int64_t unit_work = std::max<int64_t>(1, std::max(rows, weight_bound_rows) * in * outputs_per_unit);
  return std::max<int64_t>(1, (int64_t{1} << 22) / unit_work);
}

// The own int8 GEMM's weight_bound_rows: on the AVX-512 test CPU, one thread, it multiply-adds at ~460 G/s and reads
// weights from memory at ~34 GB/s, one byte a weight (a one-row step's 41 MB in 1.2 ms): 14 rows. Counting a task in
// multiply-adds alone, one thread had taken every GEMM of a one-row step but the output projection; split, on 2
// threads: the step's GEMMs 0.93-1.13 -> 0.68-0.81 ms, a sentence's greedy search 30-34 -> 24-30 ms
// (benchmarks/results/2026-11-29-cpu-amd-epyc-2core-c).
constexpr int64_t kInt8WeightBoundRows = 14;

// A summary's panels split among threads in blocks of 4 (the AVX-512 GEMMs' tiles): a part must start at a multiple
// of its GEMM's tile_panels (int8_gemm.h's layout, float32_gemm.h's tiles), 1 or 4.
constexpr int64_t kPanelsPerBlock = 4;

}  // namespace

int64_t rows_per_task(int64_t width) { return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(width, 1)); }

float int8_activation_max() {
  static const float levels = cpu_has_vnni() ? 127.0f : 63.0f;
  return levels;
}

ComputeType parse_compute_type(const std::string& name) {
  if (name == "float32") return ComputeType::kFloat32;
  if (name == "bfloat16") return ComputeType::kBFloat16;
  if (name == "int8") return ComputeType::kInt8;
  TORCH_CHECK(false, "compute_type must be \"float32\", \"bfloat16\" or \"int8\", got \"", name, "\"");
}

Activation parse_activation(const std::string& name) {
  if (name == "relu") return Activation::kRelu;
  if (name == "gelu") return Activation::kGelu;
  if (name == "swish") return Activation::kSwish;
  TORCH_CHECK(false, "the compiled model takes activation \"relu\", \"gelu\" or \"swish\", got \"", name, "\"");
}

void keep_freed_buffers() {
#if defined(__GLIBC__)
  static std::once_flag once;
  std::call_once(once, [] {
    const char* tunables = std::getenv("GLIBC_TUNABLES");
    if (std::getenv("MALLOC_TRIM_THRESHOLD_") || std::getenv("MALLOC_MMAP_THRESHOLD_") ||
        std::getenv("MALLOC_TOP_PAD_") || (tunables && std::strstr(tunables, "glibc.malloc."))) {
      return;  // the user's own allocator settings stand
    }
    mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's largest: bigger blocks are always mapped
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
    mallopt(M_TOP_PAD, 64 << 20);  // a thread arena's heap size: an emptied heap is kept, not unmapped
  });
#endif
}

PackedLinear::PackedLinear(const at::Tensor& weight, const std::optional<at::Tensor>& bias, int64_t rows,
                           ComputeType compute_type, bool fbgemm, bool own_gemm)
    : weight_(weight), bias_(bias), out_features_(weight.size(0)), in_features_(weight.size(1)) {
  TORCH_CHECK(weight.dim() == 2, "a linear weight must be [out, in], got ", weight.sizes());
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == out_features_), "a linear bias must be [",
              out_features_, "], got ", bias ? bias->sizes() : at::IntArrayRef{});
  if (!weight.is_cpu()) return;
  keep_freed_buffers();
  const GemmOps& ops = gemm_ops();
  rows = std::max<int64_t>(rows, 1);
  if (compute_type == ComputeType::kInt8) {
    pack_int8(weight.to(at::kFloat).contiguous(), rows, fbgemm, own_gemm);
    if (bias_) bias_ = bias_->to(at::kFloat).contiguous();
    if (bias_ && route_ == Route::kOwnInt8) bias_ = padded_to_panels(*bias_);
    return;
  }
  const at::ScalarType dtype = compute_type == ComputeType::kBFloat16 ? at::kBFloat16 : at::kFloat;
  weight_ = weight.to(dtype).contiguous();
  if (bias_) bias_ = bias_->to(dtype).contiguous();
  const Float32Gemm* own_float32 = own_gemm ? float32_gemm_here() : nullptr;
  if (compute_type == ComputeType::kFloat32 && own_float32) {
    const at::Tensor panels = at::empty({gemm_panel_count(out_features_) * in_features_ * 16}, at::kFloat);
    float32_pack_panels(weight_.data_ptr<float>(), out_features_, in_features_, panels.data_ptr<float>());
    weight_ = panels;
    if (bias_) bias_ = padded_to_panels(*bias_);
    own_float32_gemm_ = own_float32;
    route_ = Route::kOwnFloat32;
    return;
  }
  if (!ops.reorder_weight || !ops.linear) return;
  try {
    weight_ = call(*ops.reorder_weight, {weight_, rows});
    route_ = Route::kOneDnn;
  } catch (const c10::Error&) {
    // oneDNN refuses bfloat16 weights on CPUs without the instructions its bfloat16 GEMM needs: at::linear runs.
  }
}

at::Tensor PackedLinear::operator()(const at::Tensor& x, std::optional<Activation> activation) const {
  TORCH_CHECK(x.dim() == 2, "a linear layer takes [rows, in] rows, got ", x.sizes());
  if (x.size(0) == 0) return at::empty({0, out_features_}, x.options());
  if (route_ == Route::kOwnInt8) return own_int8_linear(x, activation);
  if (route_ == Route::kOwnFloat32) return own_float32_linear(x, activation);
  if (route_ == Route::kFbgemmInt8 || route_ == Route::kOneDnnInt8) {
    return apply_activation(int8_linear(x), activation);
  }
  const bool widen = x.is_cpu() && weight_.scalar_type() != x.scalar_type();
  const at::Tensor input = widen ? x.to(weight_.scalar_type()) : x;
  at::Tensor y;
  if (route_ == Route::kOneDnn) {
    // The activation is not fused: oneDNN's ReLU turns NaN into 0, and a NaN must reach the search's finite check.
    y = call(*gemm_ops().linear, {input.contiguous(), weight_, bias_ ? c10::IValue(*bias_) : c10::IValue(),
                                    std::string("none"), c10::List<std::optional<at::Scalar>>(), c10::IValue()});
  } else {
    y = at::linear(input, weight_, bias_);
  }
  return apply_activation(widen ? y.to(x.scalar_type()) : y, activation);
}

void PackedLinear::pack_int8(const at::Tensor& weight, int64_t rows, bool fbgemm, bool own_gemm) {
  const GemmOps& ops = gemm_ops();
  const Int8Gemm* own = own_gemm ? int8_gemm_here() : nullptr;
  const int weight_max = own ? own->weight_max : kLibraryInt8WeightMax;
  weight_scales_ = std::get<0>(weight.abs().max(1)).div(weight_max).clamp_min(std::numeric_limits<float>::min());
  const at::Tensor quantized =
      weight.div(weight_scales_.unsqueeze(1)).round().clamp(-weight_max, weight_max).to(at::kChar);
  if (own) {
    TORCH_CHECK(own->zero_point == activation_zero_point(), "the ", own->isa, " int8 GEMM takes rows around ",
                own->zero_point, ", the activations are around ", activation_zero_point());
    TORCH_CHECK(kPanelsPerBlock % own->tile_panels == 0, "the ", own->isa, " int8 GEMM's tiles of ",
                own->tile_panels, " panels do not divide the threads' blocks of ", kPanelsPerBlock);
    weight_ = at::empty({int8_packed_bytes(out_features_, in_features_, own->tile_panels)}, at::kChar);
    panel_offsets_ = at::empty({gemm_panel_count(out_features_) * 16}, at::kInt);
    int8_pack_panels(quantized.contiguous().data_ptr<int8_t>(), out_features_, in_features_, own->zero_point,
                     own->tile_panels, weight_.data_ptr<int8_t>(), panel_offsets_.data_ptr<int32_t>());
    weight_scales_ = padded_to_panels(weight_scales_);
    own_int8_gemm_ = own;
    route_ = Route::kOwnInt8;
    return;
  }
  weight_zero_points_ = at::zeros({out_features_}, weight.options().dtype(at::kLong));
  if (fbgemm && ops.fbgemm_int8_prepack && ops.fbgemm_int8_linear) {
    try {
      SilentWarnings silent;
      c10::WarningUtils::WarningHandlerGuard quiet(&silent);
      const at::Tensor per_channel = at::_make_per_channel_quantized_tensor(
          quantized, weight_scales_.to(at::kDouble), weight_zero_points_, /*axis=*/0);
      std::vector<c10::IValue> stack{per_channel, c10::IValue()};
      ops.fbgemm_int8_prepack->callBoxed(stack);
      fbgemm_weight_ = stack[0];
      fbgemm_weight_bytes_ = quantized.nbytes();
      weight_ = at::Tensor();
      route_ = Route::kFbgemmInt8;
      return;
    } catch (const c10::Error&) {
      // No FBGEMM engine in this build (or quantized tensors gone): oneDNN's int8 GEMM below.
    }
  }
  TORCH_CHECK(ops.onednn_int8_prepack && ops.onednn_int8_linear, "compute_type \"int8\" needs FBGEMM's or oneDNN's "
              "int8 linear (quantized::linear_dynamic, onednn::qlinear_pointwise), which this torch build lacks");
  weight_ = call(*ops.onednn_int8_prepack, {quantized, std::vector<int64_t>{rows, weight.size(1)}});
  route_ = Route::kOneDnnInt8;
}

at::Tensor PackedLinear::int8_linear(const at::Tensor& x) const {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "an int8 linear layer takes float32 rows, got ", x.scalar_type());
  const int64_t rows = x.size(0);
  at::Tensor y;
  at::Tensor scales;
  if (route_ == Route::kFbgemmInt8) {
    at::Tensor normalized;
    std::tie(normalized, scales) = normalize_rows(x.contiguous());
    // The normalized rows are in [-1, 1]: FBGEMM's full 8-bit range gives them 127.5 steps a side, its 7-bit range
    // (reduce_range, for CPUs without VNNI: int8_activation_max) 63.5.
    const bool reduce_range = int8_activation_max() < 127.0f;
    std::vector<c10::IValue> stack{normalized, fbgemm_weight_, reduce_range};
    gemm_ops().fbgemm_int8_linear->callBoxed(stack);
    y = stack[0].toTensor();
    scales.mul_(int8_activation_max());  // back from [-1, 1] to the row's own range
  } else {
    at::Tensor quantized;
    std::tie(quantized, scales) = quantize_rows(x.contiguous());
    // x_scale 1 and no bias: oneDNN scales by the weights' rows only; the rows' scales and the bias follow.
    y = call(*gemm_ops().onednn_int8_linear,
             {quantized, 1.0, activation_zero_point(), weight_, weight_scales_, weight_zero_points_, c10::IValue(), 1.0,
              int64_t{0}, c10::IValue(at::kFloat), std::string("none"), c10::List<std::optional<at::Scalar>>(),
              std::string("")});
  }
  scale_rows(y, rows, scales, bias_);
  return y.narrow(0, 0, rows);
}

std::pair<at::Tensor, at::Tensor> PackedLinear::own_quantized(const at::Tensor& x) const {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "an int8 linear layer takes float32 rows, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) == in_features_, "a linear layer of ", in_features_, " inputs got rows of ", x.size(1));
  const at::Tensor input = x.contiguous();
  const int64_t row_bytes = int8_input_groups(in_features_) * 4;
  at::Tensor quantized = at::empty({input.size(0), row_bytes}, input.options().dtype(at::kByte));
  uint8_t* target = quantized.data_ptr<uint8_t>();
  at::Tensor scales = row_scales(input, [&](int64_t r, const float* row, float inverse) {
    own_int8_gemm_->quantize_row(row, in_features_, inverse, target + r * row_bytes);
  });
  return {quantized, scales};
}

at::Tensor PackedLinear::own_int8_linear(const at::Tensor& x, std::optional<Activation> activation) const {
  const auto [quantized, scales] = own_quantized(x);
  const int64_t rows = x.size(0);
  at::Tensor y = at::empty({rows, out_features_}, x.options());
  const bool relu = activation == Activation::kRelu;
  // Tasks of units_per_task blocks of panels.
  const int64_t n_panels = gemm_panel_count(out_features_);
  const int64_t n_blocks = (n_panels + kPanelsPerBlock - 1) / kPanelsPerBlock;
  const int64_t blocks_per_task = units_per_task(rows, in_features_, 16 * kPanelsPerBlock, kInt8WeightBoundRows);
  at::parallel_for(0, n_blocks, blocks_per_task, [&](int64_t first, int64_t end) {
    int8_gemm(*own_int8_gemm_, quantized.data_ptr<uint8_t>(), scales.data_ptr<float>(), rows, in_features_,
              weight_.data_ptr<int8_t>(), panel_offsets_.data_ptr<int32_t>(), weight_scales_.data_ptr<float>(),
              bias_ ? bias_->data_ptr<float>() : nullptr, relu, out_features_, first * kPanelsPerBlock,
              std::min(end * kPanelsPerBlock, n_panels), y.data_ptr<float>());
  });
  return relu ? y : apply_activation(y, activation);
}

namespace {

// Rows [first, end) of x [rows, in] float32, contiguous -> float32_pack_rows' packing of them.
at::Tensor float32_packed_rows(const at::Tensor& x, int64_t first, int64_t end) {
  const int64_t in = x.size(1);
  at::Tensor packed = at::empty({float32_row_tiles(end - first) * in * kFloat32TileRows}, x.options());
  float32_pack_rows(x.data_ptr<float>() + first * in, end - first, in, packed.data_ptr<float>());
  return packed;
}

}  // namespace

// The rows a thread must get before own_float32_linear splits a call's rows, not its panels, across threads.
constexpr int64_t kFloat32RowsToSplit = 96;

// The own float32 GEMMs' weight_bound_rows (units_per_task): capped to AVX2 on the AVX-512 test CPU, one thread, the
// AVX2 one multiply-adds at ~62 G/s and reads weights from memory at ~34 GB/s, four bytes a weight: 7 rows.
constexpr int64_t kFloat32WeightBoundRows = 7;

at::Tensor PackedLinear::own_float32_input(const at::Tensor& x) const {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "a float32 linear layer takes float32 rows, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) == in_features_, "a linear layer of ", in_features_, " inputs got rows of ", x.size(1));
  return x.contiguous();
}

at::Tensor PackedLinear::own_float32_linear(const at::Tensor& x, std::optional<Activation> activation) const {
  const at::Tensor input = own_float32_input(x);
  const int64_t rows = x.size(0), n_panels = gemm_panel_count(out_features_);
  at::Tensor y = at::empty({rows, out_features_}, x.options());
  const bool relu = activation == Activation::kRelu;
  auto packed = [&](int64_t first, int64_t end) { return float32_packed_rows(input, first, end); };
  // rows [first, end), packed, over panels [first_panel, end_panel)
  auto run = [&](const at::Tensor& rows_packed, int64_t first, int64_t end, int64_t first_panel, int64_t end_panel) {
    own_float32_gemm_->gemm(rows_packed.data_ptr<float>(), end - first, in_features_, weight_.data_ptr<float>(),
                            bias_ ? bias_->data_ptr<float>() : nullptr, relu, out_features_, first_panel, end_panel,
                            y.data_ptr<float>() + first * out_features_);
  };
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  if (rows >= kFloat32RowsToSplit * threads) {
    // Many rows (the encoder's): each thread takes its own rows over every panel, which stay in its cache, where
    // splitting the panels had each thread read all the rows for every panel (the encoder's 2048-input layer at
    // 1344 rows on 2 threads: 0.71-0.95 of oneDNN's speed in trials, call by call in turn).
    at::parallel_for(0, rows, kFloat32RowsToSplit,
                     [&](int64_t first, int64_t end) { run(packed(first, end), first, end, 0, n_panels); });
  } else {
    // The rows packed once; tasks of units_per_task whole tiles' panels.
    const at::Tensor all_rows = packed(0, rows);
    const int64_t tile_panels = own_float32_gemm_->tile_panels, n_blocks = (n_panels + tile_panels - 1) / tile_panels;
    at::parallel_for(0, n_blocks, units_per_task(rows, in_features_, 16 * tile_panels, kFloat32WeightBoundRows),
                     [&](int64_t first, int64_t end) {
                       run(all_rows, 0, rows, first * tile_panels, std::min(n_panels, end * tile_panels));
                     });
  }
  return relu ? y : apply_activation(y, activation);
}

PackedLinear::Summary PackedLinear::summarize(const at::Tensor& x, int64_t k, const std::vector<int64_t>& barred,
                                              bool with_log_totals, const at::Tensor& picked_ids) const {
  TORCH_CHECK(has_summary(), "summarize runs on the own int8 routes (vnni-int8, avxvnni-int8, avx2-int8) and "
              "avx512-float32 only, this layer's is ", route());
  TORCH_CHECK(x.dim() == 2, "a linear layer takes [rows, in] rows, got ", x.sizes());
  TORCH_CHECK(k >= 0 && k <= kGemmMaxTopK, "summarize keeps k in [0, ", kGemmMaxTopK, "] outputs, got ", k);
  const int64_t rows = x.size(0);
  at::Tensor picked_in;
  if (picked_ids.defined()) {
    TORCH_CHECK(picked_ids.scalar_type() == at::kLong && picked_ids.dim() == 1 && picked_ids.size(0) == rows,
                "picked_ids must be [rows=", rows, "] int64, got ", picked_ids.scalar_type(), " ", picked_ids.sizes());
    picked_in = picked_ids.contiguous();
    TORCH_CHECK(rows == 0 || (picked_in.min().item<int64_t>() >= 0 && picked_in.max().item<int64_t>() < out_features_),
                "picked_ids must be in [0, ", out_features_, ")");
  }
  // int8: the rows quantized; float32: packed, all of them where the panels split across threads (below).
  at::Tensor quantized, scales, input, all_packed;
  if (route_ == Route::kOwnInt8) {
    std::tie(quantized, scales) = own_quantized(x);
  } else {
    input = own_float32_input(x);
  }
  const at::TensorOptions floats = x.options();
  auto make = [&] {
    Summary made{at::empty({rows, k}, floats), at::empty({rows, k}, floats.dtype(at::kLong)),
                 at::empty({rows}, floats.dtype(at::kInt))};
    if (with_log_totals) made.tops = at::empty({rows}, floats), made.log_totals = at::empty({rows}, floats);
    if (picked_in.defined()) made.picked = at::empty({rows}, floats);
    return made;
  };
  // int8_gemm.h's view of rows [first_row, ...) of a Summary.
  auto view = [&](const Summary& s, int64_t first_row) {
    auto at_row = [&](const at::Tensor& t, int64_t width) -> float* {
      return t.defined() ? t.data_ptr<float>() + first_row * width : nullptr;
    };
    GemmSummary part;
    part.k = static_cast<int>(k);
    part.barred = barred.data();
    part.n_barred = static_cast<int>(barred.size());
    part.values = at_row(s.values, k);
    part.ids = s.ids.data_ptr<int64_t>() + first_row * k;
    part.finite = s.finite.data_ptr<int32_t>() + first_row;
    part.tops = at_row(s.tops, 1);
    part.log_totals = at_row(s.log_totals, 1);
    part.picked_ids = picked_in.defined() ? picked_in.data_ptr<int64_t>() + first_row : nullptr;
    part.picked = at_row(s.picked, 1);
    return part;
  };
  auto summarize_part = [&](int64_t first_row, int64_t end_row, int64_t first_panel, int64_t end_panel,
                            const GemmSummary& part) {
    const float* bias = bias_ ? bias_->data_ptr<float>() : nullptr;
    if (route_ == Route::kOwnInt8) {
      int8_gemm_summary(*own_int8_gemm_, quantized.data_ptr<uint8_t>() + first_row * quantized.size(1),
                        scales.data_ptr<float>() + first_row, end_row - first_row, in_features_,
                        weight_.data_ptr<int8_t>(), panel_offsets_.data_ptr<int32_t>(),
                        weight_scales_.data_ptr<float>(), bias, out_features_, first_panel, end_panel, part);
      return;
    }
    const at::Tensor packed = all_packed.defined() ? all_packed : float32_packed_rows(input, first_row, end_row);
    own_float32_gemm_->gemm_summary(packed.data_ptr<float>(), end_row - first_row, in_features_,
                                    weight_.data_ptr<float>(), bias, out_features_, first_panel, end_panel, part);
  };
  Summary summary = make();
  const int64_t n_panels = gemm_panel_count(out_features_);
  const int64_t n_blocks = (n_panels + kPanelsPerBlock - 1) / kPanelsPerBlock;
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  // Fewer rows than a tile a thread (one sentence's beams): the panels split across the threads instead, in blocks
  // of kPanelsPerBlock, each part summarized over its panels, then merged in the order of the ids.
  const int64_t tile_rows = route_ == Route::kOwnInt8 ? own_int8_gemm_->tile_rows : kFloat32TileRows;
  const int64_t n_parts = rows < tile_rows * threads ? std::min(threads, n_blocks) : 1;
  if (n_parts > 1) {
    if (input.defined()) all_packed = float32_packed_rows(input, 0, rows);
    std::vector<Summary> parts(n_parts);
    std::vector<GemmSummary> views(n_parts);
    for (int64_t p = 0; p < n_parts; ++p) parts[p] = make(), views[p] = view(parts[p], 0);
    at::parallel_for(0, n_parts, 1, [&](int64_t first, int64_t end) {
      for (int64_t p = first; p < end; ++p) {
        summarize_part(0, rows, p * n_blocks / n_parts * kPanelsPerBlock,
                       std::min(n_panels, (p + 1) * n_blocks / n_parts * kPanelsPerBlock), views[p]);
      }
    });
    merge_gemm_summaries(views.data(), static_cast<int>(n_parts), rows, view(summary, 0));
  } else {
    // Rows split across threads: each row's summary is over every panel, in order.
    at::parallel_for(0, rows, tile_rows, [&](int64_t first_row, int64_t end_row) {
      summarize_part(first_row, end_row, 0, n_panels, view(summary, first_row));
    });
  }
  summary.finite = summary.finite.to(at::kBool);
  return summary;
}

const char* PackedLinear::route() const {
  switch (route_) {
    case Route::kOneDnn: return "onednn";
    case Route::kOwnInt8: return own_int8_gemm_->route;
    case Route::kOwnFloat32: return own_float32_gemm_->route;
    case Route::kFbgemmInt8: return "fbgemm-int8";
    case Route::kOneDnnInt8: return "onednn-int8";
    case Route::kAten: return "aten";
  }
  return "aten";
}

int PackedLinear::int8_weight_max() const {
  if (route_ == Route::kOwnInt8) return own_int8_gemm_->weight_max;
  return route_ == Route::kFbgemmInt8 || route_ == Route::kOneDnnInt8 ? kLibraryInt8WeightMax : 0;
}

int64_t PackedLinear::nbytes() const {
  int64_t total = 0;
  for (const at::Tensor* t : {&weight_, &weight_scales_, &weight_zero_points_, &panel_offsets_}) {
    if (t->defined()) total += t->is_mkldnn() ? t->numel() * t->element_size() : t->nbytes();
  }
  if (bias_) total += bias_->nbytes();
  total += fbgemm_weight_bytes_;
  return total;
}

}  // namespace fastformer
