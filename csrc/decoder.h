// The incremental decoder and the whole beam-search loop in C++ (ATen for the GEMMs, the fused ops for the rest),
// plus the ATen-level wrappers of the fused ops (device dispatch and checks) that the torch ops register.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace fastformer {

// q | k | v of position `step` -> attention over each row's cache ([n_rows, d_model]); appends k/v to the cache.
// qkv: [n_rows, 3 * d_model]; k_cache/v_cache: [n_slots, heads, cache_len, head_dim] (written at `step`);
// indirection: [n_slots, cache_len] int32; row_slots: [n_rows] int32.
at::Tensor self_attention_step(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& indirection, const at::Tensor& row_slots, int64_t beam_size,
                               int64_t step);

// q: [n_rows, d_model], k/v: [n_sentences, heads, src_len, head_dim], src_lengths: [n_sentences] int32,
// row_slots: [n_rows] int32 -> [n_rows, d_model].
at::Tensor cross_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& src_lengths, const at::Tensor& row_slots, int64_t beam_size);

// The search's per-sentence state, [n_sentences * beam_size] slots (see beam_ops.h for each field's meaning).
struct BeamState {
  at::Tensor sums;              // [n_slots] float32
  at::Tensor tokens;            // [n_slots] int32
  at::Tensor indirection[2];    // [n_slots, cache_len] int32 each: read one, write the other, swap
  at::Tensor history_tokens;    // [cache_len, n_slots] int32
  at::Tensor history_beams;     // [cache_len, n_slots] int32
  at::Tensor finished_count;    // [n_sentences] int32
  at::Tensor finished_scores;   // [n_sentences, 2 * beam_size] float64
  at::Tensor finished_steps;    // [n_sentences, 2 * beam_size] int32
  at::Tensor finished_beams;    // [n_sentences, 2 * beam_size] int32
  at::Tensor done;              // [n_sentences] int32
  at::Tensor candidate_scores;  // [n_slots, 2 * beam_size] float32 workspace
  at::Tensor candidate_ids;     // [n_slots, 2 * beam_size] int32 workspace

  BeamState(int64_t n_sentences, int64_t beam_size, int64_t cache_len, int64_t bos_id, const at::Device& device);
  // The tensors in the order of the torch op fastformer::beam_step's `state` argument.
  std::vector<at::Tensor> as_list(int read_indirection) const;
  static constexpr size_t kListSize = 13;
};

struct SearchOptions {
  int64_t beam_size;
  double length_penalty;
  int64_t min_len, pad_id, bos_id, eos_id;
};

// One step of the search (beam_ops.h's BeamStepArgs): logits [n_active * beam_size, vocab], active [n_active] and
// max_lens [n_sentences] int32; state: BeamState::as_list's tensors, updated in place.
void beam_step(const at::Tensor& logits, const at::Tensor& active, const at::Tensor& max_lens,
               const std::vector<at::Tensor>& state, int64_t step, const SearchOptions& options);

struct DecoderOptions {
  int64_t n_heads;
  bool norm_first;
  bool gelu;
  std::vector<double> norm_eps;  // norm1..3 of each layer, then the final norm (used with norm_first only)
};

// The decoder of fastformer.Transformer, one position at a time, with a preallocated self-attention cache
// ([layers, n_sentences * beam_size, heads, cache_len, head_dim] in the weights' dtype) and the encoder's
// keys/values computed once per layer ([n_sentences, heads, src_len, head_dim], shared by a sentence's beams).
//
// weights, per decoder layer: self q|k|v weight [3d, d] and bias, self out weight and bias, cross q weight [d, d]
// and bias, cross k|v weight [2d, d] and bias, cross out weight and bias, linear1 weight and bias, linear2 weight
// and bias, norm1..3 weight and bias (20 tensors); then embedding [vocab, d], positions [max_positions, d], output
// weight [vocab, d], final norm weight and bias (read with norm_first only).
class CachedDecoder {
 public:
  static constexpr size_t kTensorsPerLayer = 20;

  CachedDecoder(const at::Tensor& memory, const at::Tensor& src_lengths, std::vector<at::Tensor> weights,
                DecoderOptions options, int64_t beam_size, int64_t cache_len);

  // tokens: [n_rows] ids at position `step` of the rows' hypotheses, row_slots: [n_rows] int32, indirection:
  // [n_slots, cache_len] int32 -> logits [n_rows, vocab].
  at::Tensor step(const at::Tensor& tokens, const at::Tensor& row_slots, const at::Tensor& indirection,
                  int64_t step);

  int64_t n_slots() const { return n_slots_; }
  int64_t cache_len() const { return cache_len_; }

 private:
  at::Tensor self_block(const at::Tensor& h, int64_t layer, const at::Tensor& row_slots,
                        const at::Tensor& indirection, int64_t step);
  at::Tensor cross_block(const at::Tensor& h, int64_t layer, const at::Tensor& row_slots);
  at::Tensor feed_forward(const at::Tensor& h, int64_t layer);
  at::Tensor layer_norm(const at::Tensor& x, int64_t layer, int64_t which);
  const at::Tensor& weight(int64_t layer, int64_t index) const { return weights_[layer * kTensorsPerLayer + index]; }

  std::vector<at::Tensor> weights_;
  DecoderOptions options_;
  int64_t n_layers_, d_model_, beam_size_, cache_len_, n_slots_;
  at::Tensor src_lengths_;          // [n_sentences] int32
  at::Tensor cross_keys_values_;    // [layers, 2, n_sentences, heads, src_len, head_dim]
  at::Tensor k_cache_, v_cache_;    // [layers, n_slots, heads, cache_len, head_dim]
};

// (tokens without BOS/EOS, score) of a sentence's hypotheses, best first.
using Hypotheses = std::vector<std::pair<std::vector<int64_t>, double>>;

// The whole search (rules of fastformer/reference/beam_search.py) for memory [n_sentences, src_len, d_model] and
// src_lengths [n_sentences]; max_lens: per sentence, the step at which EOS is forced. -> up to n_best per sentence.
std::vector<Hypotheses> beam_search(const at::Tensor& memory, const at::Tensor& src_lengths,
                                    std::vector<at::Tensor> weights, const DecoderOptions& decoder_options,
                                    const SearchOptions& search_options, const std::vector<int64_t>& max_lens,
                                    int64_t n_best);

}  // namespace fastformer
