// Teacher-forced scoring (decoder.h's score_targets): the decoder over whole targets at once, with the search's
// linear layers (DecoderLinears, so every compute type) and layers (decoder_layers), causal self-attention, and the
// output projection's log-softmax taken a chunk of rows at a time.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <optional>
#include <utility>

#include "decoder.h"

namespace fastformer {
namespace {

// A projection's rows [n * len, parts * d_model] -> [parts, n, heads, len, head_dim].
at::Tensor split_heads(const at::Tensor& projected, int64_t n, int64_t len, int64_t parts, int64_t heads) {
  const int64_t head_dim = projected.size(1) / (parts * heads);
  return projected.view({n, len, parts, heads, head_dim}).permute({2, 0, 3, 1, 4});
}

// [n, heads, len, head_dim] -> rows [n * len, heads * head_dim].
at::Tensor merge_heads(const at::Tensor& attended) {
  return attended.transpose(1, 2).reshape({attended.size(0) * attended.size(2), -1});
}

// The batch's sentences [begin, end) scored into their rows of scores [n_sentences, tgt_len].
void score_sentences(const at::Tensor& memory, const at::Tensor& src_lengths, const at::Tensor& decoder_input,
                     const at::Tensor& targets, const at::Tensor& tgt_lengths, const DecoderWeights& weights,
                     const DecoderOptions& options, const DecoderLinears& linears, Activation activation,
                     int64_t begin, int64_t end, at::Tensor& scores) {
  const int64_t n = end - begin, src_len = memory.size(1), d_model = memory.size(2), tgt_len = decoder_input.size(1);
  const int64_t heads = options.n_heads;
  const at::Tensor memory_rows = memory.narrow(0, begin, n).reshape({n * src_len, d_model});
  const auto longs = at::TensorOptions().dtype(at::kLong).device(memory.device());
  // The model's embed(): embedding * embedding_scale + the positions, in the same operation order.
  const at::Tensor x = at::embedding(weights.embedding, decoder_input.narrow(0, begin, n))
                           .mul(options.embedding_scale)
                           .add(weights.positions.narrow(0, 0, tgt_len))
                           .view({n * tgt_len, d_model});
  // Causal self-attention over the target: a real position sees only real ones (right padding); a padding position
  // sees at least position 0, so that it stays finite. Cross-attention over each sentence's real source positions
  // (src_lengths >= 1: no row is all masked). On the CPU, block_attention reads q, k and v where the projections left
  // them: ATen's attention, two small GEMMs a sentence and head, took 15% of scoring's time there (base, 37k
  // vocabulary, int8, 2 threads). The keys a sentence attends to, made once for every layer: block_attention's key
  // lengths (int32 [n]) on the CPU, ATen's cross-attention mask ([n, 1, 1, src_len]) on CUDA.
  const bool on_cpu = memory.is_cpu();
  const at::Tensor source_lengths = src_lengths.narrow(0, begin, n);
  const at::Tensor target_keys = on_cpu ? at::full({n}, tgt_len, source_lengths.options().dtype(at::kInt))
                                        : at::Tensor();
  const at::Tensor source_keys =
      on_cpu ? source_lengths.to(at::kInt).contiguous()
             : (at::arange(src_len, longs).unsqueeze(0) < source_lengths.unsqueeze(1)).view({n, 1, 1, src_len});
  auto self_block = [&](const at::Tensor& h, int64_t layer) {
    const DecoderLayerLinears& linear = linears.layers[layer];
    const at::Tensor projected = linear.self_qkv(h);
    linears.round_as_caches(projected.narrow(1, d_model, 2 * d_model));
    const at::Tensor qkv = split_heads(projected, n, tgt_len, 3, heads);
    if (on_cpu) {
      return linear.self_out(
          block_attention(projected.narrow(1, 0, d_model), qkv[1], qkv[2], target_keys, /*causal=*/true));
    }
    return linear.self_out(merge_heads(
        at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], std::nullopt, 0.0, /*is_causal=*/true)));
  };
  auto cross_block = [&](const at::Tensor& h, int64_t layer) {
    const DecoderLayerLinears& linear = linears.layers[layer];
    const at::Tensor projected = linear.cross_kv(memory_rows);
    linears.round_as_caches(projected);
    const at::Tensor keys_values = split_heads(projected, n, src_len, 2, heads);
    if (on_cpu) {
      return linear.cross_out(
          block_attention(linear.cross_q(h), keys_values[0], keys_values[1], source_keys, /*causal=*/false));
    }
    const at::Tensor q = split_heads(linear.cross_q(h), n, tgt_len, 1, heads)[0];
    return linear.cross_out(
        merge_heads(at::scaled_dot_product_attention(q, keys_values[0], keys_values[1], source_keys)));
  };
  const at::Tensor hidden = decoder_layers(x, weights, linears, options, activation, self_block, cross_block);
  // Only the real positions reach the output projection.
  const at::Tensor real_rows =
      (at::arange(tgt_len, longs).unsqueeze(0) < tgt_lengths.narrow(0, begin, n).unsqueeze(1)).view({-1}).nonzero()
          .view({-1});
  const at::Tensor real_hidden = hidden.index_select(0, real_rows);
  const at::Tensor real_targets = targets.narrow(0, begin, n).reshape({-1}).index_select(0, real_rows);
  const int64_t n_rows = real_rows.numel();
  at::Tensor log_probs = at::empty({n_rows}, scores.options());
  // The output projection's summary (the own int8 and AVX-512 float32 GEMMs) gives each row's target logit and
  // log-softmax terms and never writes the logits: up to scoring_summary_rows() rows in one call, so that the GEMM
  // reads the weights once for each of its own chunks of rows. Otherwise a chunk of rows at a time: only their logits
  // are ever held (a chunk's are 9.5 MB at 37k words).
  const bool summarized = real_hidden.is_cpu() && !linears.output_ids && linears.output.has_summary();
  const int64_t chunk_rows =
      summarized ? scoring_summary_rows() : logits_rows_per_block(weights.output_weight.size(0));
  for (int64_t first = 0; first < n_rows; first += chunk_rows) {
    const int64_t rows = std::min(chunk_rows, n_rows - first);
    const at::Tensor chunk_hidden = real_hidden.narrow(0, first, rows);
    const at::Tensor chunk_targets = real_targets.narrow(0, first, rows).contiguous();
    if (summarized) {
      const PackedLinear::Summary summary =
          linears.output.summarize(chunk_hidden, 0, {}, /*with_log_totals=*/true, chunk_targets);
      log_probs.narrow(0, first, rows)
          .copy_(at::where(summary.finite, (summary.picked - summary.tops) - summary.log_totals,
                           std::numeric_limits<float>::quiet_NaN()));
      continue;
    }
    const at::Tensor logits = linears.output(chunk_hidden).to(at::kFloat).contiguous();
    if (logits.is_cpu()) {
      // ATen's log_softmax writes every row's log-probabilities out and reads them again: 18% of scoring's time
      // (base, 37k vocabulary, int8, 2 threads) where one target's is wanted.
      target_log_probs_cpu(logits.const_data_ptr<float>(), rows, logits.size(1),
                           chunk_targets.const_data_ptr<int64_t>(), log_probs.data_ptr<float>() + first);
    } else {
      log_probs.narrow(0, first, rows)
          .copy_(at::log_softmax(logits, 1).gather(1, chunk_targets.unsqueeze(1)).view({-1}));
    }
  }
  scores.narrow(0, begin, n).view({-1}).index_copy_(0, real_rows, log_probs);
}

}  // namespace

int64_t scoring_summary_rows() {
  // A row's running summary is about 1 KB (top-k room that scoring does not use), held for the call: 16 MB at most.
  // A group's rows in one call (992 or 1,984 at 64 sentences) rather than chunks of 212 scored 1.004-1.020x as fast on
  // the Intel Xeon (benchmarks/results/2026-12-01-cpu-intel-xeon-2core-f).
  return 16384;
}

at::Tensor score_targets(const at::Tensor& memory, const at::Tensor& src_lengths, const at::Tensor& decoder_input,
                         const at::Tensor& targets, const at::Tensor& tgt_lengths, const DecoderWeights& weights,
                         const DecoderOptions& options, std::shared_ptr<const DecoderLinears> linears) {
  c10::InferenceMode inference;
  c10::DeviceGuard guard(memory.device());
  TORCH_CHECK(memory.dim() == 3, "memory must be [n_sentences, src_len, d_model], got ", memory.sizes());
  const int64_t n_sentences = memory.size(0), d_model = memory.size(2);
  const at::Device device = memory.device();
  TORCH_CHECK(decoder_input.dim() == 2 && decoder_input.size(0) == n_sentences && decoder_input.size(1) >= 1,
              "decoder_input must be [n_sentences=", n_sentences, ", tgt_len >= 1], got ", decoder_input.sizes());
  const int64_t tgt_len = decoder_input.size(1);
  TORCH_CHECK(targets.sizes() == decoder_input.sizes(), "targets must have decoder_input's shape ",
              decoder_input.sizes(), ", got ", targets.sizes());
  for (const auto& [tensor, name] : {std::pair{&decoder_input, "decoder_input"}, std::pair{&targets, "targets"}}) {
    TORCH_CHECK(tensor->scalar_type() == at::kLong, name, " must be int64, got ", tensor->scalar_type());
    TORCH_CHECK(tensor->device() == device, name, " is on ", tensor->device(), ", expected ", device);
  }
  for (const auto& [tensor, name] : {std::pair{&src_lengths, "src_lengths"}, std::pair{&tgt_lengths, "tgt_lengths"}}) {
    TORCH_CHECK(tensor->dim() == 1 && tensor->size(0) == n_sentences, name, " must be [", n_sentences, "], got ",
                tensor->sizes());
    TORCH_CHECK(tensor->device() == device, name, " is on ", tensor->device(), ", expected ", device);
  }
  TORCH_CHECK(options.n_heads >= 1 && d_model % options.n_heads == 0, "n_heads must divide d_model=", d_model);
  check_decoder_weights(weights, options, device);
  TORCH_CHECK(tgt_len <= weights.positions.size(0), "tgt_len=", tgt_len, " exceeds max_positions=",
              weights.positions.size(0));
  const Activation activation = parse_activation(options.activation);
  at::Tensor scores = at::zeros({n_sentences, tgt_len}, at::TensorOptions().dtype(at::kFloat).device(device));
  if (n_sentences == 0) return scores;
  const at::Tensor source_lengths = src_lengths.to(at::kLong), target_lengths = tgt_lengths.to(at::kLong);
  TORCH_CHECK(target_lengths.min().item<int64_t>() >= 1 && target_lengths.max().item<int64_t>() <= tgt_len,
              "tgt_lengths must be in [1, tgt_len=", tgt_len, "]");
  const int64_t vocab = weights.output_weight.size(0);
  TORCH_CHECK(targets.min().item<int64_t>() >= 0 && targets.max().item<int64_t>() < vocab,
              "targets must be ids in [0, vocab=", vocab, ")");
  if (!linears) linears = std::make_shared<const DecoderLinears>(weights, logits_rows_per_block(vocab));
  TORCH_CHECK(linears->layers.size() == weights.layers.size(), "the decoder's linears have ", linears->layers.size(),
              " layers, its weights ", weights.layers.size());
  const at::Tensor memory_in = memory.contiguous();
  auto score = [&](int64_t begin, int64_t end) {
    score_sentences(memory_in, source_lengths, decoder_input, targets, target_lengths, weights, options, *linears,
                    activation, begin, end, scores);
  };
  const int64_t n_groups =
      memory.is_cuda() ? 1
                       : cpu_sentence_groups(n_sentences, target_lengths.sum().item<int64_t>(), linears->compute_type,
                                             at::get_num_threads());
  if (n_groups == 1) {
    score(0, n_sentences);
    return scores;
  }
  // As in beam_search: on the CPU each thread scores its own group of sentences, its ops single-threaded.
  at::parallel_for(0, n_groups, 1, [&](int64_t first_group, int64_t end_group) {
    c10::InferenceMode group_inference;  // thread-local: each worker thread sets its own
    for (int64_t group = first_group; group < end_group; ++group) {
      score(group * n_sentences / n_groups, (group + 1) * n_sentences / n_groups);
    }
  });
  return scores;
}

}  // namespace fastformer
