// CompiledEncoder (see encoder.h).
#include "encoder.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>

namespace fastformer {

CompiledEncoder::CompiledEncoder(EncoderWeights weights, DecoderOptions options, int64_t rows,
                                 ComputeType compute_type)
    : weights_(std::move(weights)), options_(std::move(options)) {
  c10::InferenceMode inference;
  TORCH_CHECK(!weights_.layers.empty(), "the encoder must have at least one layer");
  TORCH_CHECK(options_.norm_first == weights_.final_norm.has_value(),
              "a pre-LN encoder (norm_first) needs final_norm and a post-LN one has none");
  activation_ = parse_activation(options_.activation);
  for (const EncoderLayerWeights& w : weights_.layers) {
#define FASTFORMER_CHECK_FIELD(name) TORCH_CHECK(w.name.defined(), "encoder weight " #name " is missing");
    FASTFORMER_ENCODER_LAYER_TENSORS(FASTFORMER_CHECK_FIELD)
#undef FASTFORMER_CHECK_FIELD
    linears_.push_back({PackedLinear(w.self_qkv_weight, w.self_qkv_bias, rows, compute_type),
                        PackedLinear(w.self_out_weight, w.self_out_bias, rows, compute_type),
                        PackedLinear(w.linear1_weight, w.linear1_bias, rows, compute_type),
                        PackedLinear(w.linear2_weight, w.linear2_bias, rows, compute_type)});
  }
}

at::Tensor CompiledEncoder::self_attention(const at::Tensor& h, const EncoderLayerLinears& linear,
                                           const at::Tensor& src_lengths, const at::Tensor& row_slots,
                                           int64_t n_sentences, int64_t src_len) const {
  const int64_t d_model = h.size(1), heads = options_.n_heads, head_dim = d_model / heads;
  const at::Tensor qkv = linear.self_qkv(h);
  // Views of qkv on the CPU, which cross_attention reads where they lie; copies for the CUDA kernels.
  auto placed = [](const at::Tensor& t) { return t.is_cpu() ? t : t.contiguous(); };
  const at::Tensor keys_values = placed(
      qkv.narrow(1, d_model, 2 * d_model).view({n_sentences, src_len, 2, heads, head_dim}).permute({2, 0, 3, 1, 4}));
  const at::Tensor attended = encoder_self_attention(placed(qkv.narrow(1, 0, d_model)), keys_values[0],
                                                     keys_values[1], src_lengths, row_slots);
  return linear.self_out(attended);
}

at::Tensor CompiledEncoder::operator()(const at::Tensor& x, const at::Tensor& src_lengths) const {
  c10::InferenceMode inference;
  c10::DeviceGuard guard(x.device());
  TORCH_CHECK(x.dim() == 3, "x must be [n_sentences, src_len, d_model], got ", x.sizes());
  const int64_t n_sentences = x.size(0), src_len = x.size(1), d_model = x.size(2);
  TORCH_CHECK(options_.n_heads >= 1 && d_model % options_.n_heads == 0, "n_heads must divide d_model=", d_model);
  TORCH_CHECK(src_lengths.dim() == 1 && src_lengths.size(0) == n_sentences, "src_lengths must be [", n_sentences,
              "], got ", src_lengths.sizes());
  const at::Tensor lengths = src_lengths.to(at::kInt).contiguous();
  const auto ints = at::TensorOptions().dtype(at::kInt).device(x.device());
  const at::Tensor row_slots = at::arange(n_sentences, ints).repeat_interleave(src_len);
  at::Tensor h = x.reshape({n_sentences * src_len, d_model}).contiguous();
  for (size_t i = 0; i < linears_.size(); ++i) {
    const EncoderLayerWeights& w = weights_.layers[i];
    const EncoderLayerLinears& linear = linears_[i];
    auto attend = [&](const at::Tensor& y) {
      return self_attention(y, linear, lengths, row_slots, n_sentences, src_len);
    };
    auto feed_forward = [&](const at::Tensor& y) { return linear.linear2(linear.linear1(y, activation_)); };
    if (options_.norm_first) {
      h = h + attend(add_layer_norm(h, {}, w.norm1));
      h = h + feed_forward(add_layer_norm(h, {}, w.norm2));
    } else {
      h = add_layer_norm(h, attend(h), w.norm1);
      h = add_layer_norm(h, feed_forward(h), w.norm2);
    }
  }
  if (weights_.final_norm) h = add_layer_norm(h, {}, *weights_.final_norm);
  return h.view({n_sentences, src_len, d_model});
}

int64_t CompiledEncoder::nbytes() const {
  int64_t total = 0;
  for (const EncoderLayerLinears& l : linears_) {
    for (const PackedLinear* linear : {&l.self_qkv, &l.self_out, &l.linear1, &l.linear2}) total += linear->nbytes();
  }
  return total;
}

}  // namespace fastformer
