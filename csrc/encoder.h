// The encoder of fastformer.Transformer in C++, for translation: its linear layers in a CPU compute type
// (linear.h), its self-attention the decoder's fused cross-attention op over the layer's own keys and values (one
// "beam" per sentence, every position a row). fastformer/decoding/search.py embeds the tokens and hands the rest over.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "decoder.h"
#include "linear.h"

namespace fastformer {

// The tensors of one encoder layer, listed once: X(name) for each, in the order of a layer's computation.
#define FASTFORMER_ENCODER_LAYER_TENSORS(X)                                                  \
  X(self_qkv_weight) /* [3 * d_model, d_model]: self-attention q | k | v */                  \
  X(self_qkv_bias)   /* [3 * d_model] */                                                     \
  X(self_out_weight) /* [d_model, d_model] */                                                \
  X(self_out_bias)   /* [d_model] */                                                         \
  X(linear1_weight)  /* [d_ff, d_model] */                                                   \
  X(linear1_bias)    /* [d_ff] */                                                            \
  X(linear2_weight)  /* [d_model, d_ff] */                                                   \
  X(linear2_bias)    /* [d_model] */

struct EncoderLayerWeights {
#define FASTFORMER_TENSOR_FIELD(name) at::Tensor name;
  FASTFORMER_ENCODER_LAYER_TENSORS(FASTFORMER_TENSOR_FIELD)
#undef FASTFORMER_TENSOR_FIELD
  // After self-attention and the feed-forward (post-LN), or before each of them (pre-LN).
  LayerNormWeights norm1, norm2;
};

struct EncoderWeights {
  std::vector<EncoderLayerWeights> layers;
  std::optional<LayerNormWeights> final_norm;  // closes a pre-LN encoder; none for post-LN
};

struct EncoderLayerLinears {
  PackedLinear self_qkv, self_out, linear1, linear2;
};

// The encoder's weights with its linear layers converted once into a compute type (kept with the model by
// fastformer/decoding/search.py until a parameter changes); rows: the source positions a batch usually has.
class CompiledEncoder {
 public:
  CompiledEncoder(EncoderWeights weights, DecoderOptions options, int64_t rows,
                  ComputeType compute_type = ComputeType::kFloat32);

  // x: [n_sentences, src_len, d_model] float32, the embedded sources (embedding * scale + positions), and
  // src_lengths: [n_sentences] -> memory [n_sentences, src_len, d_model] float32. Positions past a sentence's length
  // hold values no one reads (the decoder's cross-attention stops at src_lengths).
  at::Tensor operator()(const at::Tensor& x, const at::Tensor& src_lengths) const;

  int64_t nbytes() const;

 private:
  at::Tensor self_attention(const at::Tensor& h, const EncoderLayerLinears& linear, const at::Tensor& src_lengths,
                            const at::Tensor& row_slots, int64_t n_sentences, int64_t src_len) const;

  EncoderWeights weights_;
  DecoderOptions options_;
  Activation activation_;
  std::vector<EncoderLayerLinears> linears_;
};

}  // namespace fastformer
