// The beam-search loop over the compiled decoder (decoder.h's beam_search): groups of sentences on the CPU's
// threads, the batch of rows shrinking as sentences finish (SearchOptions::shrink), the CUDA graphs of the bucketed
// step, and the back-tracking of the finished hypotheses.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "decoder.h"

#ifdef FASTFORMER_WITH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace fastformer {
namespace {

// [values.size()] int32 on `device`. On CUDA the copy comes from pinned memory, so that it is queued behind the
// steps already queued instead of waiting for them.
at::Tensor to_device(const std::vector<int32_t>& values, const at::Device& device) {
  const at::Tensor host = at::tensor(values, at::kInt);
  return device.is_cuda() ? host.pin_memory().to(device, /*non_blocking=*/true) : host;
}

// The rows of a decoding step: the sentences it decodes and their beams' slots (row a * k + j is slot
// active[a] * k + j), on the search's device.
struct Rows {
  Rows(const std::vector<int32_t>& sentences, int64_t beam_size, const at::Device& device)
      : active(to_device(sentences, device)),
        row_slots((active.unsqueeze(1) * beam_size + at::arange(beam_size, active.options())).view({-1})),
        row_slots_long(row_slots.to(at::kLong)) {}
  // The rows of active sentences [first, first + count): views of these.
  Rows block(int64_t first, int64_t count, int64_t beam_size) const {
    return Rows(active.narrow(0, first, count), row_slots.narrow(0, first * beam_size, count * beam_size),
                row_slots_long.narrow(0, first * beam_size, count * beam_size));
  }
  at::Tensor active;          // [n_active] int32
  at::Tensor row_slots;       // [n_active * beam_size] int32
  at::Tensor row_slots_long;  // the same as int64, for index_select

 private:
  Rows(at::Tensor active, at::Tensor row_slots, at::Tensor row_slots_long)
      : active(std::move(active)), row_slots(std::move(row_slots)), row_slots_long(std::move(row_slots_long)) {}
};

// The active sentences a step projects and ranks at a time: on the CPU a block of logits_rows_per_block's rows (the
// blocks of even size), on CUDA all of them (one graph, one launch each).
int64_t sentences_per_block(int64_t n_active, int64_t beam_size, int64_t vocab, const at::Device& device) {
  if (!device.is_cpu()) return n_active;
  const int64_t most = std::max<int64_t>(1, logits_rows_per_block(vocab) / beam_size);
  const int64_t n_blocks = (n_active + most - 1) / most;
  return (n_active + n_blocks - 1) / n_blocks;
}

// The decoder's hidden states for the rows at `row_slots` at state.step (CachedDecoder::hidden); with
// SearchOptions::return_attention their cross-attention rows are written into state.history_attention at (step,
// slot), the step read on the device (a CUDA graph replays this at every step).
at::Tensor decode_hidden(CachedDecoder& decoder, BeamState& state, const at::Tensor& row_slots,
                         const at::Tensor& row_slots_long, const SearchOptions& options) {
  const at::Tensor tokens = state.tokens.index_select(0, row_slots_long);
  if (!options.return_attention) return decoder.hidden(tokens, row_slots, state.indirection_in(), state.step);
  at::Tensor attention;
  at::Tensor hidden = decoder.hidden(tokens, row_slots, state.indirection_in(), state.step, &attention);
  const int64_t n_slots = state.history_attention.size(1);
  state.history_attention.view({-1, state.history_attention.size(2)})
      .index_copy_(0, state.step.to(at::kLong) * n_slots + row_slots_long, attention);
  return hidden;
}

// The options that act on each step's logits (SearchOptions): a target prefix and sampling force each sentence's
// token through BeamState::forced_tokens; no_repeat_ngram_size and repetition_penalty change the logits from each
// hypothesis's tokens so far. All of it is ATen work where the data lives, reading the step from its tensor (no host
// sync, so that the bucketed search's CUDA graphs replay it too); an option that is off makes and runs nothing.
class StepRules {
 public:
  // The rules of the batch's sentences [begin, end) (their state `state`, on `device`).
  StepRules(const SearchOptions& options, BeamState& state, int64_t begin, int64_t end, int64_t cache_len,
            const at::Device& device)
      : options_(options), sampling_(options.sampling_topk != 1) {
    const int64_t n_sentences = end - begin, k = options.beam_size, n_slots = n_sentences * k;
    const auto ints = at::TensorOptions().dtype(at::kInt).device(device);
    if (options.target_prefix) {
      const at::Tensor& prefix = *options.target_prefix;
      const int64_t width = std::min(prefix.size(1), cache_len);  // past each sentence's length limit: all -1
      prefix_ = at::full({n_sentences, cache_len}, -1, ints);
      prefix_.narrow(1, 0, width).copy_(prefix.narrow(0, begin, n_sentences).narrow(1, 0, width));
    }
    if (sampling_) {
      std::vector<float> uniforms(cache_len * n_sentences);
      for (int64_t step = 0; step < cache_len; ++step) {
        for (int64_t s = 0; s < n_sentences; ++s) {
          uniforms[step * n_sentences + s] = uniform(options.sampling_keys[begin + s], step);
        }
      }
      uniforms_ = at::tensor(uniforms, at::kFloat).view({cache_len, n_sentences}).to(device);
    }
    if (prefix_.defined() || sampling_) state.forced_tokens = at::full({n_sentences}, -1, ints);
    if (options.no_repeat_ngram_size > 0 || options.repetition_penalty != 1.0) {
      history_ = at::zeros({n_slots, cache_len}, ints);
      const auto longs = at::TensorOptions().dtype(at::kLong).device(device);
      slots_ = at::arange(n_slots, longs);
      first_slots_ = slots_ - slots_.remainder(k);
      positions_ = at::arange(cache_len, longs);
      // beam_step leaves a finished sentence's history unwritten: -1 there reads as "no parent, no token".
      state.history_beams.fill_(-1);
      state.history_tokens.fill_(-1);
    }
  }

  // The logits beam_step ranks at state.step for `rows` ([n_rows, vocab], changed in place by the history rules),
  // with state.forced_tokens set.
  at::Tensor before_step(const at::Tensor& logits, const Rows& rows, BeamState& state) const {
    if (!act_on_logits(state)) return logits;
    const at::Tensor step = state.step.to(at::kLong);
    if (history_.defined()) {
      at::Tensor forced_rows;  // a prefix's token is taken as it is, scored by the model's own logits
      if (prefix_.defined()) {
        forced_rows = prefix_.index_select(1, step).view({-1}).index_select(
            0, at::floor_divide(rows.row_slots_long, options_.beam_size)).ge(0);
      }
      apply_history(logits, history_.index_select(0, rows.row_slots_long), state.step, forced_rows);
    }
    if (!state.forced_tokens.defined()) return logits;
    at::Tensor forced = prefix_.defined() ? prefix_.index_select(1, step).view({-1})
                                          : at::full_like(state.forced_tokens, -1);
    if (sampling_) {
      // beam_size 1: row r is sentence rows.active[r]; a prefix's token wins over the draw.
      const at::Tensor drawn = sample(logits, row_uniforms(rows, step), state.step);
      const at::Tensor row_forced = forced.index_select(0, rows.row_slots_long);
      forced = forced.index_copy(0, rows.row_slots_long, at::where(row_forced.ge(0), row_forced, drawn));
    }
    state.forced_tokens.copy_(forced);
    return logits;
  }

  // Whether before_step changes the logits or forces tokens (no option of them is on: it returns them untouched).
  bool act_on_logits(const BeamState& state) const { return history_.defined() || state.forced_tokens.defined(); }

  // How many of each row's best logits (pad and BOS barred, EOS before min_len) the step needs where that is all it
  // needs: without scores, 1 for a greedy search's argmax and sampling_topk for a draw from the top-k
  // (draw_from_top_k); with scores, 2 * beam_size for a search's candidates (beam_step_from_best); 0 where the step
  // needs the logits themselves (a prefix, the history rules, sampling with scores or from more than the scan's
  // top-k).
  int64_t best_logits_needed(int64_t vocab, bool with_scores) const {
    if (prefix_.defined() || history_.defined()) return 0;
    const int64_t needed = sampling_      ? (with_scores ? 0 : options_.sampling_topk)
                           : with_scores ? 2 * options_.beam_size
                                         : 1;
    return needed > 0 && needed <= kMaxScannedTopK && needed < vocab ? needed : 0;
  }

  // before_step's draw for `rows` from their best logits found already (values [n_rows, k] float32 and ids [n_rows,
  // k] int64 as top_k_allowed_cpu gives them, k = best_logits_needed): state.forced_tokens set to the draws.
  void draw_from_top_k(const at::Tensor& values, const at::Tensor& ids, const Rows& rows, BeamState& state) const {
    if (values.is_cpu()) {
      // Row by row in plain loops: the ATen ops below, a dozen small ones a step, made sampling 3% slower than greedy
      // search at the headline (64 sentences, 2 threads).
      const at::Tensor row_values = values.contiguous(), row_ids = ids.contiguous();
      const int64_t n_rows = row_values.size(0), k = row_values.size(1);
      const float* uniforms = uniforms_.data_ptr<float>() + state.step.item<int64_t>() * uniforms_.size(1);
      const int64_t* slots = rows.row_slots_long.contiguous().data_ptr<int64_t>();
      int32_t* forced = state.forced_tokens.data_ptr<int32_t>();
      std::fill_n(forced, state.forced_tokens.numel(), -1);
      for (int64_t r = 0; r < n_rows; ++r) {
        forced[slots[r]] = static_cast<int32_t>(draw_row(row_values.data_ptr<float>() + r * k,
                                                         row_ids.data_ptr<int64_t>() + r * k, k, uniforms[slots[r]],
                                                         options_.sampling_temperature));
      }
      return;
    }
    const at::Tensor drawn = draw(values.div(options_.sampling_temperature), ids,
                                  row_uniforms(rows, state.step.to(at::kLong)));
    state.forced_tokens.copy_(at::full_like(state.forced_tokens, -1).index_copy(0, rows.row_slots_long, drawn));
  }

  // After beam_step at state.step: each slot's history becomes its new parent's, plus the token it took.
  void after_step(const BeamState& state) {
    if (!history_.defined()) return;
    const at::Tensor step = state.step.to(at::kLong);
    const at::Tensor beams = state.history_beams.index_select(0, step).view({-1}).to(at::kLong);
    const at::Tensor tokens = state.history_tokens.index_select(0, step).view({-1, 1});
    at::Tensor next = history_.index_select(0, at::where(beams.ge(0), first_slots_ + beams, slots_));
    next.index_copy_(1, step, tokens);
    history_.copy_(next);
  }

 private:
  // A uniform draw in [0, 1 - 2^-24] of 24 random bits: splitmix64's finalizer over the sentence's key and the step.
  static float uniform(int64_t key, int64_t step) {
    uint64_t x = static_cast<uint64_t>(key) + static_cast<uint64_t>(step + 1) * 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    return static_cast<float>(x >> 40) * (1.0f / 16777216.0f);
  }

  // In place on logits [n_rows, vocab], from the rows' hypotheses (history [n_rows, cache_len], its first `step`
  // columns), but not on the rows `skip` marks ([n_rows] bool; undefined: none): CTranslate2's RepetitionPenalty and
  // NoRepeatNgram (decoding_utils.cc), whose history is every token taken so far, a target prefix's included and the
  // start token not. The work is over the tokens taken, not over the vocabulary: a gather and a scatter of them.
  void apply_history(const at::Tensor& logits, const at::Tensor& history, const at::Tensor& step,
                     const at::Tensor& skip) const {
    const int64_t pad = options_.pad_id, cache_len = history.size(1);
    at::Tensor taken = positions_.lt(step).unsqueeze(0) & history.ge(0);  // [n_rows, cache_len]
    if (skip.defined()) taken = taken & skip.logical_not().unsqueeze(1);
    // PAD stands in where no token was taken: it is never taken itself, and every write to its column writes back
    // its own logit, so it stays out of both rules.
    const at::Tensor tokens = history.to(at::kLong).masked_fill(taken.logical_not(), pad);
    const double penalty = options_.repetition_penalty;
    if (penalty != 1.0) {
      // A token taken before: its logit divided by the penalty where positive, multiplied where negative (each
      // copy of a token taken twice writes the same value).
      const at::Tensor values = logits.gather(1, tokens);
      logits.scatter_(1, tokens, at::where(taken & values.gt(0), values / penalty,
                                           at::where(taken, values * penalty, values)));
    }
    const int64_t n = options_.no_repeat_ngram_size;
    if (n > 0 && n <= cache_len) {
      // The token that would complete an n-gram the hypothesis holds already: a window of n taken tokens whose first
      // n - 1 are the hypothesis's last n - 1 bans its last.
      const at::Tensor windows = tokens.unfold(1, n, 1);  // [n_rows, cache_len - n + 1, n]
      at::Tensor banned = taken.unfold(1, n, 1).all(2);
      if (n > 1) {
        const at::Tensor tail = tokens.index_select(
            1, (step.to(at::kLong) - (n - 1) + positions_.narrow(0, 0, n - 1)).clamp_min(0));
        banned = banned & windows.narrow(2, 0, n - 1).eq(tail.unsqueeze(1)).all(2);
      }
      const at::Tensor pad_logits = logits.narrow(1, pad, 1).clone().expand({-1, windows.size(1)});
      logits.scatter_(1, windows.select(2, n - 1).masked_fill(banned.logical_not(), pad),
                      at::where(banned, -std::numeric_limits<double>::infinity(), pad_logits));
    }
  }

  // One token per row of logits [n_rows, vocab] by inverse CDF at uniforms [n_rows]: the logits over the
  // temperature, pad and BOS barred, EOS barred before min_len, then top-k and top-p (SearchOptions).
  at::Tensor sample(const at::Tensor& logits, const at::Tensor& uniforms, const at::Tensor& step) const {
    const double inf = std::numeric_limits<double>::infinity();
    const int64_t topk = options_.sampling_topk;
    const double topp = options_.sampling_topp;
    at::Tensor values, ids;  // ids undefined: the vocabulary's order
    if (logits.is_cpu() && logits.scalar_type() == at::kFloat && topk > 0 && topk <= kMaxScannedTopK &&
        topk < logits.size(1)) {
      std::tie(values, ids) = top_k_allowed_cpu(logits.contiguous(), topk, step.item<int64_t>() < options_.min_len);
      values = values.div(options_.sampling_temperature);
    } else {
      at::Tensor x = logits.to(at::kFloat).div(options_.sampling_temperature);  // a copy: beam_step reads logits
      x.select(1, options_.pad_id).fill_(-inf);
      x.select(1, options_.bos_id).fill_(-inf);
      x.select(1, options_.eos_id).masked_fill_(step.lt(options_.min_len), -inf);
      values = x;
      if (topk > 0 && topk < x.size(1)) {
        std::tie(values, ids) = x.topk(topk);
      } else if (topp < 1.0) {
        std::tie(values, ids) = x.sort(/*dim=*/-1, /*descending=*/true);
      }
    }
    return draw(values, ids, uniforms);
  }

  // One token per row by inverse CDF at uniforms [n_rows] from its candidates' logits over the temperature (values
  // [n_rows, n]: best first where top-p applies, -inf for none) and their ids ([n_rows, n] int64; undefined: the
  // vocabulary's order), top-p applied. On the CPU a row at a time (draw_row).
  at::Tensor draw(const at::Tensor& values, const at::Tensor& ids, const at::Tensor& uniforms) const {
    const double topp = options_.sampling_topp;
    if (values.is_cpu()) {
      const at::Tensor row_values = values.to(at::kFloat).contiguous(), row_uniforms = uniforms.contiguous();
      const at::Tensor row_ids = ids.defined() ? ids.contiguous() : ids;
      const int64_t* const id_rows = row_ids.defined() ? row_ids.data_ptr<int64_t>() : nullptr;
      const int64_t n_rows = row_values.size(0), n = row_values.size(1);
      at::Tensor drawn = at::empty({n_rows}, values.options().dtype(at::kInt));
      for (int64_t r = 0; r < n_rows; ++r) {
        // Temperature 1: the callers' values are over it already.
        drawn.data_ptr<int32_t>()[r] = static_cast<int32_t>(draw_row(
            row_values.data_ptr<float>() + r * n, id_rows ? id_rows + r * n : nullptr, n,
            row_uniforms.data_ptr<float>()[r], /*temperature=*/1.0));
      }
      return drawn;
    }
    at::Tensor probs = values.softmax(-1);
    if (topp < 1.0) probs = probs * (probs.cumsum(-1) - probs).lt(topp);  // the most likely set reaching topp
    const at::Tensor cdf = probs.cumsum(-1);
    // uniforms <= 1 - 2^-24 keep the target below the total (so the token drawn has a positive probability).
    const at::Tensor target = cdf.narrow(1, cdf.size(1) - 1, 1) * uniforms.unsqueeze(1);
    const at::Tensor choice = cdf.le(target).sum(1, /*keepdim=*/true);
    return (ids.defined() ? ids.gather(1, choice) : choice).view({-1}).to(at::kInt);
  }

  // draw's inverse CDF for one row on the CPU, the same steps in the same order: logits[0:n] over the temperature
  // (best first where top-p applies, -inf for none) and their ids[0:n] (null: the vocabulary's order) -> the id of
  // the candidate drawn at uniform u.
  int64_t draw_row(const float* logits, const int64_t* ids, int64_t n, float u, double temperature) const {
    const float divisor = static_cast<float>(temperature);
    thread_local std::vector<float> probs;
    probs.resize(n);
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) {
      probs[i] = logits[i] / divisor;
      top = std::max(top, probs[i]);
    }
    float total = 0.0f;
    for (int64_t i = 0; i < n; ++i) total += probs[i] = std::exp(probs[i] - top);
    for (int64_t i = 0; i < n; ++i) probs[i] /= total;
    if (options_.sampling_topp < 1.0) {
      float sum = 0.0f;
      for (int64_t i = 0; i < n; ++i) {
        sum += probs[i];
        if (!(sum - probs[i] < static_cast<float>(options_.sampling_topp))) probs[i] = 0.0f;
      }
    }
    for (int64_t i = 1; i < n; ++i) probs[i] += probs[i - 1];  // the CDF
    const float target = probs[n - 1] * u;
    const int64_t choice = std::min<int64_t>(std::upper_bound(probs.begin(), probs.end(), target) - probs.begin(),
                                             n - 1);
    return ids ? ids[choice] : choice;
  }

  // The draws' uniforms [n_rows] of `rows` at step ([1] int64).
  at::Tensor row_uniforms(const Rows& rows, const at::Tensor& step) const {
    return uniforms_.index_select(0, step).view({-1}).index_select(0, rows.row_slots_long);
  }

  // The largest top-k the CPU's one-pass scan takes (top_k_allowed_cpu); a larger one goes to ATen's topk.
  static constexpr int64_t kMaxScannedTopK = 64;

  // The k largest logits of each row of logits [n_rows, vocab] (float32, contiguous, on the CPU) among the tokens a
  // draw may take (PAD and BOS never, EOS not where eos_barred), best first, ties to the lower id -> (values
  // [n_rows, k] float32, ids [n_rows, k] int64; -inf past a row's finite ones). One vectorized pass per row
  // (top_k_row_cpu), where ATen's topk copies and partly sorts the whole row.
  std::pair<at::Tensor, at::Tensor> top_k_allowed_cpu(const at::Tensor& logits, int64_t k, bool eos_barred) const {
    const int64_t n_rows = logits.size(0), vocab = logits.size(1);
    at::Tensor values = at::empty({n_rows, k}, logits.options());
    at::Tensor ids = at::empty({n_rows, k}, logits.options().dtype(at::kLong));
    const int64_t excluded[] = {options_.pad_id, options_.bos_id, options_.eos_id};
    for (int64_t r = 0; r < n_rows; ++r) {
      top_k_row_cpu(logits.data_ptr<float>() + r * vocab, vocab, k, excluded, eos_barred ? 3 : 2, options_.pad_id,
                    values.data_ptr<float>() + r * k, ids.data_ptr<int64_t>() + r * k);
    }
    return {values, ids};
  }

  const SearchOptions& options_;
  bool sampling_;
  at::Tensor prefix_;     // [n_sentences, cache_len] int32, -1 past each prefix; undefined: none
  at::Tensor uniforms_;   // [cache_len, n_sentences] float32: each sentence's draw at each step; undefined: none
  at::Tensor history_;    // [n_slots, cache_len] int32: each slot's tokens so far; undefined: neither option on
  at::Tensor slots_, first_slots_, positions_;  // [n_slots], [n_slots] (its sentence's first), [cache_len] int64
};

// At step 0 only beam 0 of each sentence holds a hypothesis (BeamState), so only its rows are decoded (a
// beam_size-th of the step's work): the decoder's hidden states of the step's rows, only beam 0's on its first step
// with beams.
at::Tensor step_hidden(CachedDecoder& decoder, BeamState& state, const Rows& rows, const SearchOptions& options,
                       bool first_beams_only) {
  if (!first_beams_only) return decode_hidden(decoder, state, rows.row_slots, rows.row_slots_long, options);
  const at::Tensor first_beams = rows.row_slots.view({-1, options.beam_size}).select(1, 0).contiguous();
  return decode_hidden(decoder, state, first_beams, first_beams.to(at::kLong), options);
}

// Rows of beam 0 of n sentences ([n, ...]) as the rows of all their beams ([n * beam_size, ...]): beam_step skips
// the other beams' rows for their -inf sums, and reads zeros there.
at::Tensor spread_first_beams(const at::Tensor& first_rows, int64_t beam_size) {
  std::vector<int64_t> shape = first_rows.sizes().vec();
  const int64_t n = shape[0];
  shape[0] = n * beam_size;
  at::Tensor rows = at::zeros(shape, first_rows.options());
  shape[0] = beam_size;
  shape.insert(shape.begin(), n);
  rows.view(shape).select(1, 0).copy_(first_rows);
  return rows;
}

// decode_step where the step needs only each row's best logits (StepRules::best_logits_needed: `needed` of them) and
// the output projection finds them (CachedDecoder::summarize): the logits are never made (at 64 sentences, beam 4
// and 37k words, 38 MB a step, written and read back). A greedy search's argmax, or sampling's top-k, without
// scores; else a search's 2 * beam_size candidates a row with its log-softmax's terms and EOS's logit.
void best_logits_step(CachedDecoder& decoder, BeamState& state, const Rows& rows, const at::Tensor& max_lens,
                      const SearchOptions& options, StepRules& rules, bool first_step, int64_t needed) {
  std::vector<int64_t> barred{options.pad_id, options.bos_id};
  if (state.step.item<int64_t>() < options.min_len) barred.push_back(options.eos_id);
  if (greedy_without_scores(options)) {
    const at::Tensor hidden = step_hidden(decoder, state, rows, options, /*first_beams_only=*/false);
    const PackedLinear::Summary best = decoder.summarize(hidden, needed, barred);
    if (state.forced_tokens.defined()) rules.draw_from_top_k(best.values, best.ids, rows, state);
    const at::Tensor tokens = at::where(best.finite, best.ids.select(1, 0), -1).to(at::kInt);  // -1: not finite
    greedy_step(tokens, decoder.vocab(), rows.active, max_lens, state, options);
    return;
  }
  const int64_t k = options.beam_size;
  const bool first_beams_only = first_step && k > 1;
  const at::Tensor hidden = step_hidden(decoder, state, rows, options, first_beams_only);
  const at::Tensor eos = at::full({hidden.size(0)}, options.eos_id, hidden.options().dtype(at::kLong));
  PackedLinear::Summary best = decoder.summarize(hidden, needed, barred, /*with_log_totals=*/true, eos);
  if (first_beams_only) {
    for (at::Tensor* part : {&best.values, &best.ids, &best.finite, &best.tops, &best.log_totals, &best.picked}) {
      *part = spread_first_beams(*part, k);
    }
  }
  beam_step_from_best(best, decoder.vocab(), rows.active, max_lens, state, options);
}

// One step of the search over `rows` at state.step: the decoder's hidden states, then a block of sentences at a time
// (sentences_per_block) their logits and beam_step under `rules` (the indirection written, the step not advanced);
// best_logits_step where it runs.
void decode_step(CachedDecoder& decoder, BeamState& state, const Rows& rows, const at::Tensor& max_lens,
                 const SearchOptions& options, StepRules& rules, bool first_step) {
  const int64_t k = options.beam_size, n_active = rows.active.numel();
  const int64_t best_needed = rules.best_logits_needed(decoder.vocab(), !greedy_without_scores(options));
  if (state.sums.is_cpu() && best_needed > 0 && decoder.has_summary()) {
    best_logits_step(decoder, state, rows, max_lens, options, rules, first_step, best_needed);
    return;
  }
  const bool first_beams_only = first_step && k > 1;
  const at::Tensor hidden = step_hidden(decoder, state, rows, options, first_beams_only);
  const int64_t block = sentences_per_block(n_active, k, decoder.vocab(), hidden.device());
  for (int64_t first = 0; first < n_active; first += block) {
    const int64_t count = std::min(block, n_active - first);
    const Rows block_rows = rows.block(first, count, k);
    const at::Tensor logits = first_beams_only ? spread_first_beams(decoder.logits(hidden.narrow(0, first, count)), k)
                                               : decoder.logits(hidden.narrow(0, first * k, count * k));
    beam_step(rules.before_step(logits, block_rows, state), block_rows.active, max_lens, state, options);
  }
  rules.after_step(state);
}

std::vector<int32_t> every_sentence(int64_t n_sentences) {
  std::vector<int32_t> sentences(n_sentences);
  std::iota(sentences.begin(), sentences.end(), 0);
  return sentences;
}

// `sentences` split by their done flags (is_done: [n_sentences]) -> (still searching, finished), each in order.
std::pair<std::vector<int32_t>, std::vector<int32_t>> split_by_done(const std::vector<int32_t>& sentences,
                                                                    const int32_t* is_done) {
  std::pair<std::vector<int32_t>, std::vector<int32_t>> split;
  for (int32_t s : sentences) (is_done[s] ? split.second : split.first).push_back(s);
  return split;
}

// shrink = "every_step": finished sentences leave the rows after each step, which the host learns by reading the
// done flags the step wrote (a wait for the step on CUDA, nothing on the CPU).
void search_every_step(CachedDecoder& decoder, BeamState& state, const at::Tensor& max_lens,
                       const SearchOptions& options, StepRules& rules) {
  const at::Device device = state.sums.device();
  std::vector<int32_t> searching = every_sentence(state.finished_count.numel());
  Rows rows(searching, options.beam_size, device);
  for (int64_t step = 0; step < decoder.cache_len() && !searching.empty(); ++step) {
    decode_step(decoder, state, rows, max_lens, options, rules, step == 0);
    state.swap_indirection();
    state.step.add_(1);
    const at::Tensor flags = state.done.cpu();
    std::vector<int32_t> still_searching = split_by_done(searching, flags.data_ptr<int32_t>()).first;
    if (still_searching.size() == searching.size()) continue;
    searching = std::move(still_searching);
    if (!searching.empty()) rows = Rows(searching, options.beam_size, device);
  }
  TORCH_CHECK(searching.empty(), "internal error: the search ended with sentences still searching");
}

// The sentences' done flags as the host reads them, a step late: each step's flags are copied behind the step (into
// pinned memory on CUDA) and the host reads the copy of the step before, so that on CUDA it waits for a step only
// while the next one is already queued. On the CPU the copy is made at once; the lag is the same, so that the CPU
// runs (and its tests prove) the algorithm CUDA runs.
class LaggedDoneFlags {
 public:
  LaggedDoneFlags(int64_t n_sentences, const at::Device& device) : on_cuda_(device.is_cuda()) {
    for (at::Tensor& copy : copies_) {
      copy = at::empty({n_sentences}, at::TensorOptions().dtype(at::kInt).pinned_memory(on_cuda_));
    }
#ifdef FASTFORMER_WITH_CUDA
    for (cudaEvent_t& event : copied_) {
      if (on_cuda_) C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    }
#endif
  }
  LaggedDoneFlags(const LaggedDoneFlags&) = delete;
  LaggedDoneFlags& operator=(const LaggedDoneFlags&) = delete;
  ~LaggedDoneFlags() {
#ifdef FASTFORMER_WITH_CUDA
    for (cudaEvent_t event : copied_) {
      if (on_cuda_) cudaEventDestroy(event);  // no check: a destructor must not throw
    }
#endif
  }

  // Queues the copy of `done` ([n_sentences] int32) behind the work queued so far; once per step.
  void record(const at::Tensor& done) {
    const int64_t slot = recorded_++ % 2;
    copies_[slot].copy_(done, /*non_blocking=*/true);
#ifdef FASTFORMER_WITH_CUDA
    if (on_cuda_) C10_CUDA_CHECK(cudaEventRecord(copied_[slot], c10::cuda::getCurrentCUDAStream().stream()));
#endif
  }

  // [n_sentences]: the flags of the step before the one recorded last (at least two recorded), once copied.
  const int32_t* previous() {
    TORCH_INTERNAL_ASSERT(recorded_ >= 2, "no previous step recorded");
    const int64_t slot = (recorded_ - 2) % 2;
#ifdef FASTFORMER_WITH_CUDA
    if (on_cuda_) C10_CUDA_CHECK(cudaEventSynchronize(copied_[slot]));
#endif
    return copies_[slot].data_ptr<int32_t>();
  }

 private:
  bool on_cuda_;
  at::Tensor copies_[2];
  int64_t recorded_ = 0;
#ifdef FASTFORMER_WITH_CUDA
  cudaEvent_t copied_[2] = {nullptr, nullptr};
#endif
};

// The steps of the bucketed search, one kind per bucket: on CUDA each bucket's step runs eagerly the first time
// (cuBLAS picks its kernels and allocates its workspace on this stream), is captured as a CUDA graph the second
// time, and is replayed from then on. The graphs share one memory pool: they never run at once, and nothing
// allocated inside one outlives its replay. On the CPU every step runs eagerly.
class BucketSteps {
 public:
  explicit BucketSteps(const at::Device& device) : capture_(device.is_cuda()) {
#ifdef FASTFORMER_WITH_CUDA
    if (capture_) pool_ = at::cuda::graph_pool_handle();
#endif
  }

  // Runs bucket `bucket`'s `step`, which reads and writes only tensors whose addresses stay the same for the bucket
  // (besides its own temporaries).
  void run(int64_t bucket, const std::function<void()>& step) {
    const int previous_runs = runs_[bucket]++;
    if (!capture_ || previous_runs == 0) return step();
#ifdef FASTFORMER_WITH_CUDA
    std::unique_ptr<at::cuda::CUDAGraph>& graph = graphs_[bucket];
    if (!graph) {
      graph = std::make_unique<at::cuda::CUDAGraph>();
      // Thread-local: other threads of the process (a server's, a data loader's) may use CUDA meanwhile.
      graph->capture_begin(pool_, cudaStreamCaptureModeThreadLocal);
      try {
        step();
      } catch (...) {
        cudaGraph_t partial = nullptr;  // end the capture so that the stream is usable again
        cudaStreamEndCapture(c10::cuda::getCurrentCUDAStream().stream(), &partial);
        if (partial) cudaGraphDestroy(partial);
        graph.reset();
        throw;
      }
      graph->capture_end();
    }
    graph->replay();
#endif
  }

 private:
  bool capture_;
  std::map<int64_t, int> runs_;
#ifdef FASTFORMER_WITH_CUDA
  decltype(at::cuda::graph_pool_handle()) pool_{};
  std::map<int64_t, std::unique_ptr<at::cuda::CUDAGraph>> graphs_;
#endif
};

// The power-of-two number of sentences that holds n searching ones, at most n_sentences.
int64_t bucket_size(int64_t n, int64_t n_sentences) {
  int64_t size = 1;
  while (size < n) size *= 2;
  return std::min(size, n_sentences);
}

// shrink = "buckets" (SearchOptions): the rows come in power-of-two buckets of sentences, finished ones skipped by
// beam_step until the next smaller bucket holds the ones still searching, which the host learns a step late.
void search_in_buckets(CachedDecoder& decoder, BeamState& state, const at::Tensor& max_lens,
                       const SearchOptions& options, StepRules& rules) {
  const int64_t n_sentences = state.finished_count.numel();
  const at::Device device = state.sums.device();
  std::vector<int32_t> sentences = every_sentence(n_sentences);
  // Every bucket's rows live until the search ends: a captured graph holds their addresses, and queued replays
  // may still read them when the next bucket takes over.
  std::vector<std::unique_ptr<Rows>> buckets;
  buckets.push_back(std::make_unique<Rows>(sentences, options.beam_size, device));
  BucketSteps steps(device);
  LaggedDoneFlags done(n_sentences, device);
  for (int64_t step = 0; step < decoder.cache_len(); ++step) {
    const Rows& rows = *buckets.back();
    // Step 0 is the first bucket's first run, which runs eagerly on CUDA too: no graph holds its first step.
    steps.run(static_cast<int64_t>(sentences.size()), [&] {
      decode_step(decoder, state, rows, max_lens, options, rules, step == 0);
      state.copy_indirection_back();
      state.step.add_(1);
    });
    done.record(state.done);
    if (step == 0) continue;
    auto [searching, finished] = split_by_done(sentences, done.previous());
    if (searching.empty()) break;  // the sentences outside the bucket finished before it was made
    const int64_t size = bucket_size(static_cast<int64_t>(searching.size()), n_sentences);
    if (size == static_cast<int64_t>(sentences.size())) continue;
    // The new bucket's padding: finished sentences, skipped like those that finish while it runs.
    searching.insert(searching.end(), finished.begin(), finished.begin() + (size - searching.size()));
    sentences = std::move(searching);
    buckets.push_back(std::make_unique<Rows>(sentences, options.beam_size, device));
  }
  // Also waits for the queued steps, before their graphs and rows are freed.
  TORCH_CHECK(state.done.all().item<bool>(), "internal error: the search ended with sentences still searching");
}

// Checks the options StepRules applies against the batch (max_lens: per sentence; vocab: the logits' width), so that
// a bad one fails before any work.
void check_step_rules(const SearchOptions& options, int64_t n_sentences, const std::vector<int64_t>& max_lens,
                      int64_t vocab) {
  TORCH_CHECK(options.sampling_topk >= 0, "sampling_topk must be >= 0, got ", options.sampling_topk);
  TORCH_CHECK(options.sampling_topp > 0 && options.sampling_topp <= 1, "sampling_topp must be in (0, 1], got ",
              options.sampling_topp);
  TORCH_CHECK(options.sampling_temperature > 0, "sampling_temperature must be > 0, got ",
              options.sampling_temperature);
  if (options.sampling_topk != 1) {
    TORCH_CHECK(options.beam_size == 1, "sampling (sampling_topk != 1) needs beam_size 1, got ", options.beam_size);
    TORCH_CHECK(static_cast<int64_t>(options.sampling_keys.size()) == n_sentences, "sampling needs one key per "
                "sentence (", n_sentences, "), got ", options.sampling_keys.size());
  }
  TORCH_CHECK(options.no_repeat_ngram_size >= 0, "no_repeat_ngram_size must be >= 0, got ",
              options.no_repeat_ngram_size);
  TORCH_CHECK(options.repetition_penalty > 0, "repetition_penalty must be > 0, got ", options.repetition_penalty);
  if (!options.target_prefix) return;
  const at::Tensor& prefix = *options.target_prefix;
  TORCH_CHECK(prefix.dim() == 2 && prefix.size(0) == n_sentences && prefix.scalar_type() == at::kInt &&
                  prefix.is_cpu() && prefix.is_contiguous(),
              "target_prefix must be a contiguous [n_sentences=", n_sentences, ", prefix_len] int32 CPU tensor");
  for (int64_t s = 0; s < n_sentences; ++s) {
    const int32_t* ids = prefix.data_ptr<int32_t>() + s * prefix.size(1);
    int64_t length = 0;
    while (length < prefix.size(1) && ids[length] >= 0) {
      const int32_t id = ids[length++];
      TORCH_CHECK(id < vocab && id != options.pad_id && id != options.bos_id && id != options.eos_id,
                  "target_prefix of sentence ", s, " holds id ", id, ": not in [0, vocab=", vocab,
                  ") or pad/bos/eos");
    }
    for (int64_t i = length; i < prefix.size(1); ++i) {
      TORCH_CHECK(ids[i] == -1, "target_prefix of sentence ", s, " must end in -1 padding only");
    }
    TORCH_CHECK(length <= max_lens[s], "target_prefix of sentence ", s, " has ", length,
                " tokens, more than its length limit of ", max_lens[s]);
  }
}

// A shortlist (SearchOptions::vocabulary) must be CPU int64 ids, sorted without repeats, within the vocabulary, and
// hold EOS (which ends every hypothesis).
void check_vocabulary(const SearchOptions& options, const at::Device& device, int64_t vocab) {
  if (!options.vocabulary) return;
  const at::Tensor& ids = *options.vocabulary;
  TORCH_CHECK(device.is_cpu(), "a vocabulary shortlist runs on the CPU only, got a search on ", device);
  TORCH_CHECK(ids.dim() == 1 && ids.numel() >= 1 && ids.scalar_type() == at::kLong && ids.is_cpu(),
              "vocabulary must be a non-empty 1-D int64 CPU tensor of ids, got ", ids.scalar_type(), " ",
              ids.sizes());
  TORCH_CHECK(ids.min().item<int64_t>() >= 0 && ids.max().item<int64_t>() < vocab,
              "vocabulary must hold ids in [0, vocab=", vocab, ")");
  TORCH_CHECK(ids.numel() == 1 || (ids.slice(0, 1) > ids.slice(0, 0, -1)).all().item<bool>(),
              "vocabulary must be sorted without repeats");
  TORCH_CHECK(ids.eq(options.eos_id).any().item<bool>(), "vocabulary must hold EOS (id ", options.eos_id, ")");
}

// Each sentence's finished hypotheses, back-tracked through the history: best score first, ties in finishing
// order, at most n_best. The state's sentence 0 is the batch's sentence first_sentence; src_lengths: [n_sentences]
// the state's sentences' (their attention's width); options: the search's, to say why a sentence has none.
std::vector<Hypotheses> backtrack(const BeamState& state, int64_t beam_size, int64_t n_best, int64_t first_sentence,
                                  const at::Tensor& src_lengths, const SearchOptions& options) {
  const at::Tensor count = state.finished_count.cpu(), scores = state.finished_scores.cpu();
  const at::Tensor steps = state.finished_steps.cpu(), beams = state.finished_beams.cpu();
  const at::Tensor history_tokens = state.history_tokens.cpu(), history_beams = state.history_beams.cpu();
  const bool with_attention = state.history_attention.defined();
  const at::Tensor attention_rows =
      with_attention ? state.history_attention.cpu().view({-1, state.history_attention.size(2)}) : at::Tensor();
  const at::Tensor src_lengths_cpu = with_attention ? src_lengths.to(at::kCPU, at::kLong) : at::Tensor();
  const int32_t* tokens_at = history_tokens.data_ptr<int32_t>();
  const int32_t* beams_at = history_beams.data_ptr<int32_t>();
  const int64_t k = beam_size, n_sentences = count.numel(), n_slots = n_sentences * k;
  std::vector<Hypotheses> results(n_sentences);
  for (int64_t s = 0; s < n_sentences; ++s) {
    const int n_finished = count.data_ptr<int32_t>()[s];
    // Finite scores always finish a hypothesis (EOS is forced at max_len) unless the rules bar every token at a
    // step (n-gram blocking over a small vocabulary or shortlist, with EOS barred before min_len); else none means
    // NaN or inf scores.
    const bool rules_can_bar_all = options.no_repeat_ngram_size > 0 || options.vocabulary.has_value();
    TORCH_CHECK(n_finished > 0, "beam search found no hypothesis for sentence ", first_sentence + s, ": ",
                rules_can_bar_all ? "no_repeat_ngram_size, min_len and the vocabulary (shortlist) left no token to "
                                    "choose at some step, or the model's scores are not finite"
                                  : "the model's scores are not finite (NaN or inf in its weights or activations)");
    std::vector<int> order(n_finished);
    std::iota(order.begin(), order.end(), 0);
    const double* sentence_scores = scores.data_ptr<double>() + s * 2 * k;
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return sentence_scores[a] > sentence_scores[b]; });
    for (int i = 0; i < n_finished && i < n_best; ++i) {
      const int length = steps.data_ptr<int32_t>()[s * 2 * k + order[i]];
      int beam = beams.data_ptr<int32_t>()[s * 2 * k + order[i]];
      std::vector<int64_t> tokens(length);
      // The attention rows of the output tokens, EOS last: the token at `position` was predicted at step `position`
      // by its parent beam, and EOS at step `length` by the finished beam.
      std::vector<int64_t> rows(length + 1);
      rows[length] = length * n_slots + s * k + beam;
      for (int position = length - 1; position >= 0; --position) {
        const int64_t at = position * n_slots + s * k + beam;
        tokens[position] = tokens_at[at];
        beam = beams_at[at];
        rows[position] = position * n_slots + s * k + beam;
      }
      std::optional<at::Tensor> attention;
      if (with_attention) {
        attention = attention_rows.index_select(0, at::tensor(rows, at::kLong))
                        .narrow(1, 0, src_lengths_cpu.data_ptr<int64_t>()[s])
                        .contiguous();
      }
      results[s].emplace_back(std::move(tokens), sentence_scores[order[i]], std::move(attention));
    }
  }
  return results;
}

// Whether the search shrinks its rows in buckets (SearchOptions::shrink).
bool shrinks_in_buckets(const SearchOptions& options) {
  TORCH_CHECK(options.shrink == "auto" || options.shrink == "every_step" || options.shrink == "buckets",
              "shrink must be \"auto\", \"every_step\" or \"buckets\", got \"", options.shrink, "\"");
  // "auto" is every_step on CUDA too until the bucketed search passes the GPU tests on a GPU (docs/gpu.md).
  return options.shrink == "buckets";
}

// The search over the batch's sentences [begin, end) of memory [n_sentences, src_len, d_model]; in_buckets:
// shrinks_in_buckets of its options.
std::vector<Hypotheses> search_sentences(const at::Tensor& memory, const at::Tensor& src_lengths,
                                         const DecoderWeights& weights, const DecoderOptions& decoder_options,
                                         const std::shared_ptr<const DecoderLinears>& linears,
                                         const SearchOptions& search_options, bool in_buckets,
                                         const std::vector<int64_t>& max_lens, int64_t n_best, int64_t begin,
                                         int64_t end) {
  const at::Tensor group_memory = memory.narrow(0, begin, end - begin);
  const std::vector<int64_t> group_max_lens(max_lens.begin() + begin, max_lens.begin() + end);
  const int64_t k = search_options.beam_size;
  const int64_t cache_len = *std::max_element(group_max_lens.begin(), group_max_lens.end()) + 1;
  CachedDecoder decoder(group_memory, src_lengths.narrow(0, begin, end - begin), weights, decoder_options, k,
                        cache_len, linears);
  BeamState state(end - begin, k, cache_len, search_options.bos_id, memory.device());
  if (search_options.return_attention) {
    state.history_attention = at::empty({cache_len, decoder.n_slots(), memory.size(1)},
                                        memory.options().dtype(at::kFloat));
  }
  const at::Tensor max_lens_tensor = at::tensor(group_max_lens, at::kLong).to(memory.device(), at::kInt);
  StepRules rules(search_options, state, begin, end, cache_len, memory.device());
  if (in_buckets) {
    search_in_buckets(decoder, state, max_lens_tensor, search_options, rules);
  } else {
    search_every_step(decoder, state, max_lens_tensor, search_options, rules);
  }
  return backtrack(state, k, n_best, begin, src_lengths.narrow(0, begin, end - begin), search_options);
}

#ifdef FASTFORMER_WITH_CUDA
// The stream this thread's searches run on, on `device`: taken from PyTorch's pool at the thread's first search
// there and kept for every later one. The caching allocator hands a freed block only to allocations on the stream
// that allocated it (and frees no other stream's blocks during a graph capture), so a new stream per search would
// leave each search's blocks reserved: memory growing with every search, and allocations inside a bucket's capture
// failing when it is short. One stream per thread rather than per process keeps the threads of a server apart: a
// capture on a stream would take in another thread's launches on that stream.
c10::cuda::CUDAStream thread_search_stream(c10::DeviceIndex device) {
  thread_local std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  auto found = streams.find(device);
  if (found == streams.end()) {
    found = streams.emplace(device, c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device)).first;
  }
  return found->second;
}

// Puts the search on its thread's search stream for its lifetime (CUDA graphs cannot be captured on the legacy
// default stream), behind the work queued so far on the caller's stream (the encoder's memory). The search ends by
// copying its results to the host, which waits for its stream.
class SearchStream {
 public:
  explicit SearchStream(const at::Device& device)
      : caller_(c10::cuda::getCurrentCUDAStream(device.index())), guard_(thread_search_stream(device.index())) {
    cudaEvent_t queued = nullptr;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&queued, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(queued, caller_.stream()));
    C10_CUDA_CHECK(cudaStreamWaitEvent(guard_.current_stream().stream(), queued, 0));
    C10_CUDA_CHECK(cudaEventDestroy(queued));  // freed once the wait is over
  }

 private:
  c10::cuda::CUDAStream caller_;
  c10::cuda::CUDAStreamGuard guard_;
};
#endif

}  // namespace

int64_t logits_rows_per_block(int64_t vocab) {
  constexpr int64_t kBlockBytes = 30 << 20;
  return std::max<int64_t>(1, kBlockBytes / (std::max<int64_t>(vocab, 1) * static_cast<int64_t>(sizeof(float))));
}

// One group a thread where each group keeps kGroupRowsPerWeightByte rows for every byte of a weight; below that, one
// group whose GEMMs split over the threads. Each group reads every weight at every step, and at few rows a step's
// GEMMs are bound by those reads: one group reads them once. On the 2-core AVX-512 test CPU (base model, 37k
// vocabulary, two threads; one group against two in turn in one process,
// benchmarks/results/2026-11-29-cpu-amd-epyc-2core-i) one group took 0.79-0.96 of two groups' time in float32 at 8-32
// rows a group, 0.78 in bfloat16 at 8 and 0.81 in int8 at 4. Two groups tied at the line and just under it (float32
// at 64 rows 1.00-1.01, bfloat16 at 16 1.01, int8 at 8 0.96 and 1.04) and were faster past it (float32 at 128 rows
// 1.04-1.06, bfloat16 at 32-128 1.03-1.13, int8 at 16-32 1.06-1.26). Capped to AVX2, whose GEMMs take longer for each
// weight they read, one group was within 1.3% of two where this picks it, and 0.96 at 8 rows in float32.
constexpr int64_t kGroupRowsPerWeightByte = 16;

int64_t cpu_sentence_groups(int64_t n_sentences, int64_t rows, ComputeType compute_type, int64_t threads) {
  const int64_t weight_bytes =
      compute_type == ComputeType::kInt8 ? 1 : (compute_type == ComputeType::kBFloat16 ? 2 : 4);
  const int64_t most = std::min(threads, n_sentences);
  return std::max<int64_t>(1, std::min(most, rows / (kGroupRowsPerWeightByte * weight_bytes)));
}

std::vector<Hypotheses> beam_search(const at::Tensor& memory, const at::Tensor& src_lengths, DecoderWeights weights,
                                    const DecoderOptions& decoder_options, const SearchOptions& search_options,
                                    const std::vector<int64_t>& max_lens, int64_t n_best,
                                    std::shared_ptr<const DecoderLinears> linears) {
  c10::InferenceMode inference;
  c10::DeviceGuard guard(memory.device());
  TORCH_CHECK(memory.dim() == 3, "memory must be [n_sentences, src_len, d_model], got ", memory.sizes());
  const int64_t n_sentences = memory.size(0), k = search_options.beam_size;
  TORCH_CHECK(static_cast<int64_t>(max_lens.size()) == n_sentences, "max_lens must have one entry per sentence");
  TORCH_CHECK(n_best >= 1 && n_best <= k, "n_best must be in [1, beam_size]");
  const bool in_buckets = shrinks_in_buckets(search_options);  // checked before any work
  check_step_rules(search_options, n_sentences, max_lens, weights.output_weight.size(0));
  check_vocabulary(search_options, memory.device(), weights.output_weight.size(0));
  if (n_sentences == 0) return {};
#ifdef FASTFORMER_WITH_CUDA
  std::optional<SearchStream> search_stream;
  if (memory.is_cuda()) search_stream.emplace(memory.device());
#endif
  const ComputeType compute_type = linears ? linears->compute_type : ComputeType::kFloat32;  // DecoderLinears' default
  const int64_t n_groups =
      memory.is_cuda() ? 1 : cpu_sentence_groups(n_sentences, n_sentences * k, compute_type, at::get_num_threads());
  const int64_t rows_per_group = (n_sentences + n_groups - 1) / n_groups * k;
  check_decoder_weights(weights, decoder_options, memory.device());
  if (!linears) linears = std::make_shared<const DecoderLinears>(weights, rows_per_group);
  if (search_options.vocabulary) linears = linears->with_output_shortlist(weights, *search_options.vocabulary,
                                                                          rows_per_group);
  if (n_groups == 1) {
    return search_sentences(memory, src_lengths, weights, decoder_options, linears, search_options, in_buckets,
                            max_lens, n_best, 0, n_sentences);
  }
  // On the CPU each thread searches its own group of sentences from start to end: every op of a decoding step is
  // small, and splitting each one across threads costs more in fork/join than it gains. The groups' ops run
  // single-threaded (ATen does not nest parallel regions).
  std::vector<Hypotheses> results(n_sentences);
  at::parallel_for(0, n_groups, 1, [&](int64_t first_group, int64_t end_group) {
    c10::InferenceMode group_inference;  // thread-local: each worker thread sets its own
    for (int64_t group = first_group; group < end_group; ++group) {
      const int64_t begin = group * n_sentences / n_groups, end = (group + 1) * n_sentences / n_groups;
      std::vector<Hypotheses> group_results =
          search_sentences(memory, src_lengths, weights, decoder_options, linears, search_options, in_buckets,
                           max_lens, n_best, begin, end);
      std::move(group_results.begin(), group_results.end(), results.begin() + begin);
    }
  });
  return results;
}

}  // namespace fastformer
