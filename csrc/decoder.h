// The incremental decoder and the whole beam-search loop in C++ (ATen for the GEMMs, the fused ops for the rest),
// plus the ATen-level wrappers of the fused ops (device dispatch and checks) that the torch ops register. The decoder,
// the search's state and the wrappers are defined in decoder.cpp, the loop over the steps (beam_search) in search.cpp,
// and teacher-forced scoring (score_targets: the decoder over whole targets at once) in scorer.cpp.
//
// The Python side hands the decoder over as named structs (DecoderWeights, DecoderOptions, SearchOptions), bound
// field by field in bindings.cpp and filled by name in fastformer/decoding/search.py: a new model feature is one field
// here and one keyword there.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "beam_ops.h"
#include "linear.h"

namespace fastformer {

// [1] int32 on `device`: a step as the ops read it (beam_ops.h says why it lives where the data does).
at::Tensor step_tensor(int64_t step, const at::Device& device);

// q | k | v of position `step` -> attention over each row's cache ([n_rows, d_model]); appends k/v to the cache.
// qkv: [n_rows, 3 * d_model]; k_cache/v_cache: [n_slots, heads, cache_len, head_dim] (written at `step`);
// indirection: [n_slots, cache_len] int32; row_slots: [n_rows] int32; step: [1] int32 (step_tensor) or an int.
at::Tensor self_attention_step(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& indirection, const at::Tensor& row_slots, int64_t beam_size,
                               const at::Tensor& step);
at::Tensor self_attention_step(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& indirection, const at::Tensor& row_slots, int64_t beam_size,
                               int64_t step);

// q: [n_rows, d_model], k/v: [n_sentences, heads, src_len, head_dim], src_lengths: [n_sentences] int32,
// row_slots: [n_rows] int32 -> [n_rows, d_model]. On the CPU, q, k and v may be views with head_dim contiguous (k and
// v strided alike), such as those of a linear layer's output; on CUDA contiguous.
at::Tensor cross_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& src_lengths, const at::Tensor& row_slots, int64_t beam_size);

// The encoder's self-attention: cross_attention with beam_size 1 where q's row r is position r % src_len of sentence
// r / src_len (row_slots: each row's sentence); on the CPU, rows at or past their sentence's length are padding,
// returned as zeros.
at::Tensor encoder_self_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& src_lengths, const at::Tensor& row_slots);

// Many queries a sentence over its own keys (BlockAttentionArgs), on the CPU, float32: q: [n_sentences * q_len,
// d_model] rows (a view with contiguous rows), k/v: [n_sentences, heads, k_len, head_dim] (views with head_dim
// contiguous, strided alike), k_lengths: [n_sentences] int32 in [1, k_len] -> [n_sentences * q_len, d_model].
at::Tensor block_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_lengths,
                           bool causal);

struct LayerNormWeights {
  at::Tensor weight, bias;  // [d_model] each
  double eps = 1e-5;
};

// x [rows, d_model] (+ residual, where defined) -> LayerNorm of it [rows, d_model]: on the CPU in float32 one fused
// op (add_layer_norm_cpu) over the rows, split across threads outside the search's own; elsewhere ATen's add and
// layer_norm.
at::Tensor add_layer_norm(const at::Tensor& x, const at::Tensor& residual, const LayerNormWeights& norm);

// The tensors of one decoder layer, listed once: X(name) for each, in the order of a layer's computation.
#define FASTFORMER_DECODER_LAYER_TENSORS(X)                                                            \
  X(self_qkv_weight)  /* [3 * d_model, d_model]: self-attention q | k | v */                           \
  X(self_qkv_bias)    /* [3 * d_model] */                                                              \
  X(self_out_weight)  /* [d_model, d_model] */                                                         \
  X(self_out_bias)    /* [d_model] */                                                                  \
  X(cross_q_weight)   /* [d_model, d_model]: cross-attention q */                                      \
  X(cross_q_bias)     /* [d_model] */                                                                  \
  X(cross_kv_weight)  /* [2 * d_model, d_model]: cross-attention k | v of the encoder's memory */      \
  X(cross_kv_bias)    /* [2 * d_model] */                                                              \
  X(cross_out_weight) /* [d_model, d_model] */                                                         \
  X(cross_out_bias)   /* [d_model] */                                                                  \
  X(linear1_weight)   /* [d_ff, d_model] */                                                            \
  X(linear1_bias)     /* [d_ff] */                                                                     \
  X(linear2_weight)   /* [d_model, d_ff] */                                                            \
  X(linear2_bias)     /* [d_model] */

struct DecoderLayerWeights {
#define FASTFORMER_TENSOR_FIELD(name) at::Tensor name;
  FASTFORMER_DECODER_LAYER_TENSORS(FASTFORMER_TENSOR_FIELD)
#undef FASTFORMER_TENSOR_FIELD
  // After self-attention, cross-attention and the feed-forward (post-LN), or before each of them (pre-LN).
  LayerNormWeights norm1, norm2, norm3;

  // f(name, tensor) for every tensor of the layer, the norms' included.
  template <typename Visit>
  void for_each_tensor(Visit&& visit) const {
#define FASTFORMER_VISIT_FIELD(name) visit(#name, name);
    FASTFORMER_DECODER_LAYER_TENSORS(FASTFORMER_VISIT_FIELD)
#undef FASTFORMER_VISIT_FIELD
    visit("norm1.weight", norm1.weight), visit("norm1.bias", norm1.bias);
    visit("norm2.weight", norm2.weight), visit("norm2.bias", norm2.bias);
    visit("norm3.weight", norm3.weight), visit("norm3.bias", norm3.bias);
  }
};

struct DecoderWeights {
  std::vector<DecoderLayerWeights> layers;
  at::Tensor embedding;                        // [vocab, d_model]
  at::Tensor positions;                        // [max_positions, d_model]: the model's table, in its own layout
  at::Tensor output_weight;                    // [vocab, d_model]
  std::optional<at::Tensor> output_bias;       // [vocab], added to the logits (Marian's final_logits_bias)
  std::optional<LayerNormWeights> final_norm;  // closes a pre-LN decoder; none for post-LN
};

// The linear layers of one decoder layer, in the order of its computation (cross_kv: the encoder's memory -> the
// cross-attention's keys | values, once per search).
struct DecoderLayerLinears {
  PackedLinear self_qkv, self_out, cross_q, cross_kv, cross_out, linear1, linear2;
};

// Whether an int8 output projection (a vocabulary wide) may take FBGEMM's GEMM (PackedLinear's fbgemm): not where the
// CPU has VNNI, where oneDNN's is faster at that width (decoder.cpp has the timings). The layers always may.
bool output_projection_takes_fbgemm();

// Every linear layer of a decoder in one compute type, converted once and shared by searches and their groups of
// sentences (fastformer/decoding/search.py keeps it with the model until a parameter changes); rows: the rows a step
// usually has.
struct DecoderLinears {
  DecoderLinears(const DecoderWeights& weights, int64_t rows, ComputeType compute_type = ComputeType::kFloat32);
  std::vector<DecoderLayerLinears> layers;
  PackedLinear output;
  ComputeType compute_type;
  // With a shortlist: the vocabulary ids of output's rows ([n_ids] int64, sorted); the decoder's step spreads their
  // logits into the vocabulary's columns, -inf elsewhere. Unset: output is the whole vocabulary's.
  std::optional<at::Tensor> output_ids;

  // Whether a search with these linears keeps its keys and values in float16 (CachedDecoder): on the CPU in int8 and
  // bfloat16, whose linear layers round their inputs more than float16 does, where the loops widen float16 a vector at
  // a time. The scorer rounds its keys and values alike (round_as_caches), so that a score is the search's.
  bool float16_caches(const at::Device& device) const;
  // rows' values rounded in place as float16_caches keeps them; rows: [n, width] float32, each row contiguous.
  void round_as_caches(const at::Tensor& rows) const;

  // These linears, the output projection restricted to ids ([n_ids] int64 sorted vocabulary ids of weights).
  std::shared_ptr<const DecoderLinears> with_output_shortlist(const DecoderWeights& weights, const at::Tensor& ids,
                                                              int64_t rows) const;

  // f(linear) for every linear layer, the output projection's included.
  template <typename Visit>
  void for_each_linear(Visit&& visit) const {
    for (const DecoderLayerLinears& l : layers) {
      for (const PackedLinear* linear : {&l.self_qkv, &l.self_out, &l.cross_q, &l.cross_kv, &l.cross_out,
                                         &l.linear1, &l.linear2}) {
        visit(*linear);
      }
    }
    visit(output);
  }
};

struct DecoderOptions {
  int64_t n_heads = 1;
  bool norm_first = false;
  std::string activation = "relu";  // fastformer.TransformerConfig.activation: "relu", "gelu" or "swish" (SiLU)
  double embedding_scale = 1.0;     // the embeddings' factor before the positions are added (sqrt(d_model) or 1)
};

// Checks that every tensor of the decoder is there and on `device`, and that the layout is one the decoder runs.
void check_decoder_weights(const DecoderWeights& weights, const DecoderOptions& options, const at::Device& device);

struct SearchOptions {
  int64_t beam_size = 1;
  double length_penalty = 0.0;
  std::string length_penalty_form = "gnmt";  // "gnmt" or "length" (beam_ops.h's LengthPenaltyForm)
  int64_t min_len = 0, pad_id = 0, bos_id = 0, eos_id = 0;
  // How the batch of rows shrinks as sentences finish (same results either way):
  // - "every_step": finished sentences leave after each step, which the host learns by waiting for the step;
  // - "buckets": the rows come in power-of-two buckets of sentences; finished ones stay (skipped by beam_step) until
  //   the next smaller bucket holds the rest; the host reads the done flags a step late, so it never waits for the
  //   step it queued, and on CUDA each bucket's step is captured once as a CUDA graph and replayed;
  // - "auto": every_step, on CUDA too until buckets pass the GPU tests on a GPU (docs/gpu.md).
  std::string shrink = "auto";
  // false: the caller wants the hypotheses' tokens only, and greedy search (beam_size 1) on the CPU takes each
  // step's argmax without a log-softmax (beam_ops.h's BeamStepArgs::with_scores).
  bool return_scores = true;
  // true: each hypothesis also gets its alignment, the last decoder layer's cross-attention probabilities averaged
  // over heads at each of its steps (BeamState::history_attention), computed apart from the fused cross-attention.
  bool return_attention = false;
  // Random sampling, CTranslate2's options (beam_size 1): sampling_topk 1 is no sampling, 0 the whole vocabulary,
  // k > 1 the k most likely tokens; then sampling_topp in (0, 1] keeps the smallest most likely set whose
  // probability reaches it; sampling_temperature divides the logits first.
  int64_t sampling_topk = 1;
  double sampling_topp = 1.0, sampling_temperature = 1.0;
  // When sampling, one per sentence: the key of its random stream (the caller hashes the seed, the sentence's source
  // ids and the sample's index into it), so that a sentence draws the same whatever its batch.
  std::vector<int64_t> sampling_keys;
  // [n_sentences, prefix_len] int32: each sentence's forced first tokens, -1 past its prefix; none when unset.
  std::optional<at::Tensor> target_prefix;
  // CTranslate2's no_repeat_ngram_size (0: off) and repetition_penalty (1: off), over each hypothesis's tokens so far
  // (a target prefix's included).
  int64_t no_repeat_ngram_size = 0;
  double repetition_penalty = 1.0;
  // A vocabulary shortlist (CTranslate2's vocabulary map, Marian's lexical shortlist), CPU only: [n_ids] int64 sorted
  // ids, EOS among them; the output projection computes their logits alone, the others are -inf. Unset: the whole
  // vocabulary.
  std::optional<at::Tensor> vocabulary;
};

// The search's per-sentence state, n_slots = n_sentences * beam_size slots (see beam_ops.h for each field's
// meaning).
struct BeamState {
  at::Tensor sums;              // [n_slots] float32
  at::Tensor tokens;            // [n_slots] int32
  at::Tensor history_tokens;    // [cache_len, n_slots] int32
  at::Tensor history_beams;     // [cache_len, n_slots] int32
  at::Tensor finished_count;    // [n_sentences] int32
  at::Tensor finished_scores;   // [n_sentences, 2 * beam_size] float64
  at::Tensor finished_steps;    // [n_sentences, 2 * beam_size] int32
  at::Tensor finished_beams;    // [n_sentences, 2 * beam_size] int32
  at::Tensor done;              // [n_sentences] int32
  at::Tensor candidate_scores;  // [n_slots, 2 * beam_size] float32 workspace
  at::Tensor candidate_ids;     // [n_slots, 2 * beam_size] int32 workspace
  at::Tensor step;              // [1] int32: the step decoded next
  // [cache_len, n_slots, src_len] float32 with SearchOptions::return_attention (else undefined): at step t, slot's
  // cross-attention row (CachedDecoder::step's cross_attention) as it predicted the token after position t.
  at::Tensor history_attention;
  at::Tensor forced_tokens;     // [n_sentences] int32 (BeamStepArgs::forced_tokens), or undefined: none

  BeamState(int64_t n_sentences, int64_t beam_size, int64_t cache_len, int64_t bos_id, const at::Device& device);
  // [n_slots, cache_len] int32: the cache indirection this step reads, and the one it writes for the next.
  const at::Tensor& indirection_in() const { return indirection_[read_]; }
  const at::Tensor& indirection_out() const { return indirection_[1 - read_]; }
  void swap_indirection() { read_ = 1 - read_; }
  // The same as swap_indirection for the next step's reads, with both buffers kept where they are (a CUDA graph
  // holds their addresses): copies the written indirection over the one read.
  void copy_indirection_back() { indirection_[read_].copy_(indirection_[1 - read_]); }

 private:
  at::Tensor indirection_[2];
  int read_ = 0;
};

// Step state.step of the search (beam_ops.h's BeamStepArgs): logits [n_active * beam_size, vocab], active
// [n_active] and max_lens [n_sentences] int32; `state` is updated in place (its indirection written, not swapped,
// and its step not advanced).
void beam_step(const at::Tensor& logits, const at::Tensor& active, const at::Tensor& max_lens, BeamState& state,
               const SearchOptions& options);
// Whether a search of these options is a greedy one without scores (beam_ops.h's BeamStepArgs::with_scores 0): beam
// size 1, no return_scores, no n-gram blocking.
bool greedy_without_scores(const SearchOptions& options);
// beam_step of a greedy search on the CPU that takes each row's allowed argmax as found with the output projection
// (CachedDecoder::summarize) instead of its logits: greedy_tokens [n_active] int32, -1 for a row that is not
// finite; vocab: the logits' width. Only where greedy_without_scores(options).
void greedy_step(const at::Tensor& greedy_tokens, int64_t vocab, const at::Tensor& active, const at::Tensor& max_lens,
                 BeamState& state, const SearchOptions& options);
// beam_step on the CPU from each row's best logits instead of its logits (beam_ops.h's BestLogits): `best` as
// CachedDecoder::summarize gives it for the rows [n_active * beam_size] with k >= 2 * beam_size, log_totals, and
// EOS picked; vocab: the logits' width. No forced tokens (a prefix, sampling).
void beam_step_from_best(const PackedLinear::Summary& best, int64_t vocab, const at::Tensor& active,
                         const at::Tensor& max_lens, BeamState& state, const SearchOptions& options);

// An attention block of decoder layer `layer`: its input rows [rows, d_model] -> its output [rows, d_model].
using DecoderBlock = std::function<at::Tensor(const at::Tensor& h, int64_t layer)>;

// x [rows, d_model] (the embedded tokens) through the decoder's layers, pre-LN or post-LN (options.norm_first), their
// feed-forward blocks and the final norm -> the hidden states [rows, d_model] the output projection takes. The
// attention blocks are the caller's: the incremental decoder attends over its cache, the scorer over whole targets.
at::Tensor decoder_layers(at::Tensor x, const DecoderWeights& weights, const DecoderLinears& linears,
                          const DecoderOptions& options, Activation activation, const DecoderBlock& self_block,
                          const DecoderBlock& cross_block);

// The decoder of fastformer.Transformer, one position at a time, with a preallocated self-attention cache
// ([layers, n_sentences * beam_size, heads, cache_len, head_dim] in the weights' dtype) and the encoder's
// keys/values computed once per layer ([n_sentences, heads, src_len, head_dim], shared by a sentence's beams).
class CachedDecoder {
 public:
  // linears: the decoder's linear layers when the caller built them for several decoders; built here (float32) when
  // null.
  CachedDecoder(const at::Tensor& memory, const at::Tensor& src_lengths, DecoderWeights weights,
                DecoderOptions options, int64_t beam_size, int64_t cache_len,
                std::shared_ptr<const DecoderLinears> linears = nullptr);

  // tokens: [n_rows] ids at position `step` of the rows' hypotheses, row_slots: [n_rows] int32, indirection:
  // [n_slots, cache_len] int32, step: [1] int32 (step_tensor) or an int -> logits [n_rows, vocab].
  // cross_attention, when given, receives the last layer's cross-attention probabilities averaged over heads,
  // [n_rows, src_len] float32 (zero past each sentence's source length).
  at::Tensor step(const at::Tensor& tokens, const at::Tensor& row_slots, const at::Tensor& indirection,
                  const at::Tensor& step, at::Tensor* cross_attention = nullptr);
  at::Tensor step(const at::Tensor& tokens, const at::Tensor& row_slots, const at::Tensor& indirection,
                  int64_t step);
  // step() in two parts, so that a search can project and rank its rows a block at a time: the hidden states
  // [n_rows, d_model] the output projection takes (same arguments as step), and their logits [n_rows, vocab] (with
  // a shortlist, -inf outside it).
  at::Tensor hidden(const at::Tensor& tokens, const at::Tensor& row_slots, const at::Tensor& indirection,
                    const at::Tensor& step, at::Tensor* cross_attention = nullptr);
  at::Tensor logits(const at::Tensor& hidden) const;
  // Whether summarize runs: an output projection on an own int8 route (vnni-int8, avxvnni-int8, avx2-int8) or
  // avx512-float32 (linear.h), without a shortlist.
  bool has_summary() const;
  // hidden [n_rows, d_model] -> its logits' summary (PackedLinear::summarize: each row's k highest logits among the
  // ids not in barred, whether they are finite, and where asked the log-softmax's terms and the logit at picked_ids),
  // without the logits ever written.
  PackedLinear::Summary summarize(const at::Tensor& hidden, int64_t k, const std::vector<int64_t>& barred,
                                  bool with_log_totals = false, const at::Tensor& picked_ids = {}) const;

  int64_t n_slots() const { return n_slots_; }
  int64_t cache_len() const { return cache_len_; }
  int64_t vocab() const { return weights_.output_weight.size(0); }  // the logits' width

 private:
  at::Tensor self_block(const at::Tensor& h, int64_t layer, const at::Tensor& row_slots,
                        const at::Tensor& indirection, const at::Tensor& step);
  // query, when given, receives the block's cross-attention queries [n_rows, d_model].
  at::Tensor cross_block(const at::Tensor& h, int64_t layer, const at::Tensor& row_slots,
                         at::Tensor* query = nullptr);
  // The last layer's cross-attention probabilities averaged over heads for its queries [n_rows, d_model] ->
  // [n_rows, src_len] float32, in plain ATen ops (the fused cross_attention never forms them).
  at::Tensor last_cross_attention(const at::Tensor& query, const at::Tensor& row_slots) const;

  DecoderWeights weights_;
  std::shared_ptr<const DecoderLinears> linears_;
  DecoderOptions options_;
  Activation activation_;
  int64_t n_layers_, d_model_, beam_size_, cache_len_, n_slots_;
  at::Tensor src_lengths_;          // [n_sentences] int32
  std::vector<at::Tensor> cross_keys_values_;  // a layer's [2, n_sentences, heads, src_len, head_dim] each
  // A layer's [n_slots, heads, cache_len, head_dim] each. One tensor a layer: glibc maps blocks over 32 MB afresh
  // at every search (the base model's at 128 slots are 50 MB), pages the kernel faults in and zeroes one by one;
  // a layer's (8 MB) come back from the heap that the search before freed them to.
  std::vector<at::Tensor> k_cache_, v_cache_;
};

// How many groups of n_sentences a CPU search (or scoring) runs side by side on `threads` threads, one group a thread
// (search.cpp); rows: the rows its GEMMs take at a step, all groups together (a search's sentences times its beams,
// scoring's target tokens).
int64_t cpu_sentence_groups(int64_t n_sentences, int64_t rows, ComputeType compute_type, int64_t threads);

// The rows of logits ([rows, vocab] float32) a search (a block of its sentences) or scoring (a chunk of its
// positions) makes and reads at a time: as many as stay within 30 MiB, under the 32 MiB past which glibc maps each
// block afresh (keep_freed_buffers), pages the kernel then zeroes one by one at every step. A step's logits at 64
// sentences of beam 4 over a 37k vocabulary are 38 MB. Measured on the 2-core AVX-512 test CPU (base model, int8,
// beam 4, one process alternating both): on one thread at 64 sentences, 287k page faults a search became 6k and
// the search 1.035x faster; on two threads at 256 sentences, 1.12x.
int64_t logits_rows_per_block(int64_t vocab);

// The target positions CPU scoring takes through its output projection's summary (the own int8 and AVX-512 float32
// GEMMs, which never write the logits) in one call; without a summary, logits_rows_per_block at a time.
int64_t scoring_summary_rows();

// (tokens without BOS/EOS, score, attention) of a sentence's hypotheses, best first; attention (with
// SearchOptions::return_attention, else none): [len(tokens) + 1, the sentence's src_length] float32 on the CPU, one
// row per output token, EOS last.
using Hypotheses = std::vector<std::tuple<std::vector<int64_t>, double, std::optional<at::Tensor>>>;

// The whole search (rules of fastformer/reference/beam_search.py) for memory [n_sentences, src_len, d_model] and
// src_lengths [n_sentences]; max_lens: per sentence, the step at which EOS is forced. -> up to n_best per sentence.
// linears: the decoder's converted linear layers (DecoderLinears), built here in float32 when null.
std::vector<Hypotheses> beam_search(const at::Tensor& memory, const at::Tensor& src_lengths, DecoderWeights weights,
                                    const DecoderOptions& decoder_options, const SearchOptions& search_options,
                                    const std::vector<int64_t>& max_lens, int64_t n_best,
                                    std::shared_ptr<const DecoderLinears> linears = nullptr);

// Teacher-forced log-probabilities of given targets, the decoder run over every position at once: memory
// [n_sentences, src_len, d_model] and src_lengths [n_sentences] as beam_search takes them, decoder_input [n_sentences,
// tgt_len] int64 (BOS + the target, right-padded), targets [n_sentences, tgt_len] int64 (the target + EOS, padded),
// tgt_lengths [n_sentences] (each target's length + 1, in [1, tgt_len]) -> [n_sentences, tgt_len] float32:
// log p(targets[s, t] | decoder_input[s, :t + 1], source s), 0 at padding. linears: the decoder's converted linear
// layers (DecoderLinears, any compute type), built here in float32 when null.
at::Tensor score_targets(const at::Tensor& memory, const at::Tensor& src_lengths, const at::Tensor& decoder_input,
                         const at::Tensor& targets, const at::Tensor& tgt_lengths, const DecoderWeights& weights,
                         const DecoderOptions& options, std::shared_ptr<const DecoderLinears> linears = nullptr);

}  // namespace fastformer
