// The fused ops of the incremental beam search, on raw pointers and free of torch headers, so that CMake/ctest
// build the CPU versions without libtorch and nvcc compiles the CUDA ones standalone.
//
// Layout shared by every op. A batch of n_sentences sentences has n_slots = n_sentences * beam_size hypothesis
// slots; slot s * beam_size + j holds beam j of sentence s for the whole search. Each step only the sentences still
// searching ("active") are computed: compact row a * beam_size + j is slot active[a] * beam_size + j, and
// row_slots maps rows to slots. Beams are reordered through the cache indirection (no key/value moves):
// indirection[slot][p] is the beam of the slot's sentence whose cache slot holds position p of this hypothesis.
//
// The step (the position being decoded) is read through a pointer where the data lives, not passed by value: a CUDA
// graph captures a launch's arguments once, and replays it step after step while the step advances on the device.
// A sentence whose `done` flag is set may still have rows (the bucketed search keeps finished sentences in its
// fixed-size batches until it shrinks them): the ops compute its rows but beam_step leaves its state unchanged.
//
// The scoring rules are those of fastformer/reference/beam_search.py.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__CUDACC__)
#define FASTFORMER_HOST_DEVICE __host__ __device__
#else
#define FASTFORMER_HOST_DEVICE
#endif

namespace fastformer {

// Limits of the CUDA kernels, here (not in the CUDA header) so that the CPU build can export them to Python too.
// The largest beam_size beam_step_cuda takes (its per-thread candidate lists are sized at compile time).
constexpr int kMaxCudaBeamSize = 32;
// The largest head_dim the attention kernels take (one thread per channel of a block).
constexpr int kMaxCudaHeadDim = 128;
// The largest key length the attention kernels take (the scores of one row and head live in shared memory).
constexpr int kMaxCudaKeyLength = 8192;

// Single-query self-attention over the cache. Appends the row's key/value (position `step`) to its own slot first.
struct SelfAttentionArgs {
  const void* qkv;              // [n_rows, 3 * heads * head_dim]: q | k | v of position `step`, heads-major
  void* k_cache;                // [n_slots, heads, cache_len, head_dim]
  void* v_cache;                // [n_slots, heads, cache_len, head_dim]
  const int32_t* indirection;   // [n_slots, cache_len]
  const int32_t* row_slots;     // [n_rows]
  void* out;                    // [n_rows, heads * head_dim]
  const int32_t* step;          // [1]: the position decoded, in [0, cache_len)
  int n_rows, heads, head_dim, cache_len, beam_size;
  // CPU: 1 where the caches hold float16 (the rows and the output stay float32), 0 where float32. CUDA's caches are
  // the data's own type.
  int half_cache = 0;
};

// Single-query cross-attention over the encoder's keys/values, shared by the beams of a sentence.
struct CrossAttentionArgs {
  const void* q;                // [n_rows, heads * head_dim], rows q_row_stride apart
  const void* k;                // [n_sentences, heads, src_len, head_dim], strided as below
  const void* v;                // [n_sentences, heads, src_len, head_dim], strided as k
  const int32_t* src_lengths;   // [n_sentences]: keys at or past the length are padding
  const int32_t* row_slots;     // [n_rows]
  void* out;                    // [n_rows, heads * head_dim]
  int n_rows, heads, head_dim, src_len, beam_size;
  // Strides in elements; a position's head_dim values are contiguous. The keys and values may be views of the
  // linear layer that made them ([n_sentences, src_len, 2, heads, head_dim]), read where they lie, not copied.
  int64_t q_row_stride, kv_sentence_stride, kv_head_stride, kv_position_stride;
  int half_keys_values = 0;     // CPU: 1 where k and v hold float16 (q and out float32), 0 where float32
  // CPU: 1 for the encoder's self-attention (beam_size 1, n_rows = n_sentences * src_len): row r is position
  // r % src_len of its sentence, and the rows at or past the sentence's length are padding, written as zeros.
  int padded_queries = 0;
};

// Many queries a sentence over its own keys and values (teacher-forced scoring's decoder, scorer.cpp): row i of a
// sentence's q_len rows attends to its positions p < k_lengths[sentence], and where `causal` to p <= i as well.
// CPU only, float32.
struct BlockAttentionArgs {
  const float* q;               // [n_sentences * q_len, heads * head_dim], rows q_row_stride apart
  const float* k;               // [n_sentences, heads, k_len, head_dim], strided as below
  const float* v;               // [n_sentences, heads, k_len, head_dim], strided as k
  const int32_t* k_lengths;     // [n_sentences], each in [1, k_len]
  float* out;                   // [n_sentences * q_len, heads * head_dim]
  int n_sentences, q_len, k_len, heads, head_dim;
  // Strides in elements; a position's head_dim values are contiguous.
  int64_t q_row_stride, kv_sentence_stride, kv_head_stride, kv_position_stride;
  int causal = 0;
};

// How a finished hypothesis's sum of log-probabilities is normalized by its length |Y| (real tokens plus EOS):
// GNMT's ((5 + |Y|) / 6) ** alpha, or |Y| ** alpha as fairseq, transformers, CTranslate2 and Marian do.
enum class LengthPenaltyForm : int { kGnmt = 0, kLength = 1 };

// What a step of the CPU search may take instead of the logits: each row's best allowed logits and its log-softmax's
// terms, found as the output projection made the logits (the int8 one's int8_gemm_summary), which it never wrote.
// Rows as the logits' ([n_active * beam_size]).
struct BestLogits {
  const float* values;      // [rows, k]: the row's k highest logits among the tokens allowed (pad and BOS never, EOS
  const int64_t* ids;       // [rows, k]  not before min_len), best first, ties to the lower id; -1 past the finite
  int k;                    //            ones. k >= 2 * beam_size, so that every candidate of the step is there
  const float* tops;        // [rows]: the row's highest logit
  const float* log_totals;  // [rows]: log(sum of e^(logit - top)): log_softmax = (logit - top) - log_total
  const float* eos_logits;  // [rows]: the logit of EOS (forced at max_len, whatever its rank)
  const int32_t* finite;    // [rows]: 0 where the row's logits hold NaN or inf (it then offers no candidate)
};

// One step of the search for every active sentence: log-softmax, running sums, masks, top-2k candidates,
// finished-hypothesis bookkeeping, the next beams (tokens, sums, history, cache indirection).
struct BeamStepArgs {
  const void* logits;           // [n_active * beam_size, vocab]
  const int32_t* active;        // [n_active]: sentence of each active row block
  const int32_t* max_lens;      // [n_sentences]: EOS is forced at step max_lens[s]
  float* sums;                  // [n_slots]: running sums of log-probabilities; -inf marks an empty slot
  int32_t* tokens;              // [n_slots] out: each slot's next input token
  const int32_t* indirection_in;   // [n_slots, cache_len]
  int32_t* indirection_out;        // [n_slots, cache_len] out (a different buffer)
  int32_t* history_tokens;      // [cache_len, n_slots] out at row `step`: each new beam's token
  int32_t* history_beams;       // [cache_len, n_slots] out at row `step`: each new beam's parent beam
  int32_t* finished_count;      // [n_sentences]
  double* finished_scores;      // [n_sentences, 2 * beam_size]: length-penalized scores
  int32_t* finished_steps;      // [n_sentences, 2 * beam_size]: the step that emitted EOS (= real tokens)
  int32_t* finished_beams;      // [n_sentences, 2 * beam_size]: the beam that emitted EOS
  int32_t* done;                // [n_sentences] in/out: 1 once the sentence's search is over (then it is skipped)
  float* candidate_scores;      // [n_active * beam_size, 2 * beam_size] workspace (CUDA only)
  int32_t* candidate_ids;       // [n_active * beam_size, 2 * beam_size] workspace (CUDA only)
  const int32_t* step;          // [1]: the step, in [0, cache_len)
  int n_sentences, n_active, vocab, beam_size, cache_len, min_len, pad_id, bos_id, eos_id;
  // 0 with beam_size 1: each row's allowed argmax, without a log-softmax; the sums and finished scores are then
  // not computed (0 and NaN). The CPU loops take it; CUDA's beam_step computes the scores whatever it says.
  int with_scores;
  double length_penalty;
  LengthPenaltyForm length_penalty_form;
  // [n_sentences] or null: the token each sentence must take at this step (a target prefix's, or the one sampling
  // drew), -1 for none. Forcing EOS at max_len wins over it; a forced token's score is its log-probability.
  const int32_t* forced_tokens;
  // [n_active] or null (CPU only, with_scores 0): each row's allowed argmax found elsewhere (the int8 output
  // projection's, CachedDecoder::summarize; -1 for a row that is not finite), taken instead of reading logits.
  const int32_t* greedy_tokens;
  // Null, or (CPU only, logits null, no forced tokens) each row's best logits found elsewhere, taken instead of
  // reading logits.
  const BestLogits* best;
};

// A candidate of a sentence's step: id = beam * vocab + token.
struct Candidate {
  float score;
  int32_t id;
};

// The search's order: higher running sum first, ties to the lower (beam, token) index.
FASTFORMER_HOST_DEVICE inline bool ranks_before(Candidate a, Candidate b) {
  return a.score > b.score || (a.score == b.score && a.id < b.id);
}

// The token `sentence` must take at `step` (BeamStepArgs::forced_tokens), or -1: none, or EOS is forced instead.
FASTFORMER_HOST_DEVICE inline int forced_token(const BeamStepArgs& args, int step, int sentence, int max_len) {
  return args.forced_tokens && step < max_len ? args.forced_tokens[sentence] : -1;
}

// Whether `token` may follow a hypothesis of `sentence` of `step` real tokens (forcing EOS wins over barring it and
// over a forced token).
FASTFORMER_HOST_DEVICE inline bool token_allowed(const BeamStepArgs& args, int step, int sentence, int token,
                                                 int max_len) {
  if (token == args.pad_id || token == args.bos_id) return false;
  if (step >= max_len) return token == args.eos_id;
  const int forced = forced_token(args, step, sentence, max_len);
  if (forced >= 0) return token == forced;
  return token != args.eos_id || step >= args.min_len;
}

// The divisor of a finished hypothesis's sum of log-probabilities; length counts its real tokens and EOS.
FASTFORMER_HOST_DEVICE inline double length_penalty_divisor(int length, double length_penalty,
                                                            LengthPenaltyForm form) {
  const double base = form == LengthPenaltyForm::kGnmt ? (5.0 + length) / 6.0 : static_cast<double>(length);
  return pow(base, length_penalty);
}

// The next beams of one sentence at `step` from its best 2k candidates (`ranked`, best first; -inf or NaN past the
// finite ones): records finished hypotheses, marks the sentence done, and fills next_* for the n_alive kept beams.
// Returns n_alive.
FASTFORMER_HOST_DEVICE inline int select_next_beams(const BeamStepArgs& args, int step, int sentence,
                                                    const Candidate* ranked, int* next_parents, int* next_tokens,
                                                    float* next_sums) {
  const int k = args.beam_size;
  int n_finished = args.finished_count[sentence];
  int n_alive = 0;
  for (int rank = 0; rank < 2 * k; ++rank) {
    const Candidate c = ranked[rank];
    if (!(c.score > -INFINITY)) break;  // also stops at NaN
    const int beam = c.id / args.vocab, token = c.id % args.vocab;
    if (token == args.eos_id) {
      if (rank < k) {
        const int at = sentence * 2 * k + n_finished++;
        args.finished_scores[at] = c.score / length_penalty_divisor(step + 1, args.length_penalty,
                                                                     args.length_penalty_form);
        args.finished_steps[at] = step;
        args.finished_beams[at] = beam;
      }
    } else if (n_alive < k) {
      next_parents[n_alive] = beam;
      next_tokens[n_alive] = token;
      next_sums[n_alive] = c.score;
      ++n_alive;
    }
  }
  args.finished_count[sentence] = n_finished;
  args.done[sentence] = n_finished >= k || n_alive == 0;
  return n_alive;
}

// Writes beam j of `sentence` after `step`: its sum, token, history and cache indirection (positions
// first_position, first_position + position_stride, ... so that CUDA threads can share the copy). Beams past
// n_alive become empty slots (sum -inf) that keep a valid indirection.
FASTFORMER_HOST_DEVICE inline void write_next_beam(const BeamStepArgs& args, int step, int sentence, int j,
                                                   int n_alive, const int* next_parents, const int* next_tokens,
                                                   const float* next_sums, int first_position, int position_stride) {
  const int k = args.beam_size;
  const int64_t slot = static_cast<int64_t>(sentence) * k + j;
  const bool alive = j < n_alive;
  const int parent = alive ? next_parents[j] : j;
  if (first_position == 0) {
    const int64_t history_at = static_cast<int64_t>(step) * args.n_sentences * k + slot;
    args.sums[slot] = alive ? next_sums[j] : -INFINITY;
    args.tokens[slot] = alive ? next_tokens[j] : args.eos_id;
    args.history_tokens[history_at] = alive ? next_tokens[j] : -1;
    args.history_beams[history_at] = alive ? parent : -1;
  }
  const int32_t* from = args.indirection_in + (static_cast<int64_t>(sentence) * k + parent) * args.cache_len;
  int32_t* to = args.indirection_out + slot * args.cache_len;
  for (int p = first_position; p <= step && p < args.cache_len; p += position_stride) to[p] = from[p];
  if (first_position == 0 && step + 1 < args.cache_len) to[step + 1] = j;
}

// The fp32 CPU loops of one instruction set (beam_ops_cpu.cpp): "avx512" (16-float vectors), "avx2" (8-float
// vectors with FMA) or "baseline" (the build's own target: SSE2 on x86-64).
struct CpuLoops {
  const char* isa;
  // Whether its attention loops widen float16 keys and values a vector at a time (AVX-512 or F16C); the baseline's
  // take one value at a time, slower than reading float32.
  bool vector_float16;
  void (*self_attention_step)(const SelfAttentionArgs& args);
  void (*cross_attention)(const CrossAttentionArgs& args);
  void (*block_attention)(const BlockAttentionArgs& args);
  void (*beam_step)(const BeamStepArgs& args);
  void (*row_absmax)(const float* x, int64_t n_rows, int64_t width, float* absmax);
  void (*add_layer_norm)(const float* x, const float* residual, int64_t n_rows, int64_t width, const float* gamma,
                         const float* beta, float eps, float* out);
  void (*clamped_scale)(const float* x, int64_t width, float factor, float* out);
  void (*scale_and_add)(float* y, int64_t width, float scale, const float* bias);
  void (*round_to_float16)(float* x, int64_t n_rows, int64_t width, int64_t row_stride);
  void (*target_log_probs)(const float* logits, int64_t n_rows, int64_t width, const int64_t* targets, float* out);
  void (*top_k_row)(const float* row, int64_t width, int64_t k, const int64_t* excluded, int64_t n_excluded,
                    int64_t fill_id, float* values, int64_t* ids, float* top, float* log_total);
};
// The instruction sets this build has and this CPU runs, widest first (the tests run each).
std::vector<const CpuLoops*> cpu_isas();
// The loops the ops below use, chosen at the first call: the widest this CPU runs, or the one the environment
// variable FASTFORMER_CPU_ISA names (one of cpu_isas(); another name throws std::invalid_argument saying which).
const CpuLoops& cpu_loops();
// Whether the CPU has VNNI (AVX512-VNNI or AVX-VNNI): int8 dot products summed in int32. Only that of the
// instruction sets cpu_loops() runs counts: under FASTFORMER_CPU_ISA the VNNI of those above the cap does not, and
// FASTFORMER_CPU_VNNI=0 turns it off (an AVX2 CPU's int8 path on a CPU with AVX-VNNI; another value than 0 or 1
// throws std::invalid_argument naming it).
bool cpu_has_vnni();

// Whether the environment's switch `variable` is on: unset, empty or 1; 0 turns it off (`off` says what that does,
// for the error); another value throws std::invalid_argument naming it.
bool cpu_switch_on(const char* variable, const char* off);

// fp32 CPU implementations, in cpu_loops().
void self_attention_step_cpu(const SelfAttentionArgs& args);
void cross_attention_cpu(const CrossAttentionArgs& args);
void block_attention_cpu(const BlockAttentionArgs& args);
void beam_step_cpu(const BeamStepArgs& args);
// absmax[r] <- max |x[r, :]| over the width floats of each of n_rows rows, or NaN where a row holds NaN or inf
// (the int8 linear layers' row scales, linear.cpp). x: [n_rows, width]
void row_absmax_cpu(const float* x, int64_t n_rows, int64_t width, float* absmax);
// out[r] <- LayerNorm(x[r] + residual[r]) * gamma + beta over the width floats of each of n_rows rows (the biased
// variance, as torch's layer_norm); residual may be null (LayerNorm(x[r]) alone) and out may be x. The decoder's and
// encoder's residual adds and layer norms on the CPU (decoder.cpp), one op where ATen's are an add and a layer norm.
// x, residual, out: [n_rows, width], gamma, beta: [width]
void add_layer_norm_cpu(const float* x, const float* residual, int64_t n_rows, int64_t width, const float* gamma,
                        const float* beta, float eps, float* out);
// out[i] <- clamp(x[i] * factor, -1, 1) over width floats (the rows FBGEMM's int8 GEMM takes, linear.cpp).
void clamped_scale_cpu(const float* x, int64_t width, float factor, float* out);
// y[i] <- y[i] * scale + bias[i] over width floats, in place; bias may be null (an int8 GEMM's output row, linear.cpp).
void scale_and_add_cpu(float* y, int64_t width, float scale, const float* bias);
// x[r, :width] <- x[r, :width] rounded to float16 (to nearest, ties to even) and widened back, in place, over n_rows
// rows row_stride floats apart (the scorer's keys and values rounded as the search's float16 caches hold them).
void round_to_float16_cpu(float* x, int64_t n_rows, int64_t width, int64_t row_stride);
// out[r] <- log_softmax(logits[r])[targets[r]], or NaN where the row holds NaN or inf (the scorer's log-probabilities,
// scorer.cpp: one read of the row for its max and one for its sum of exponentials, nothing written but out).
// logits: [n_rows, width], targets: [n_rows] in [0, width)
void target_log_probs_cpu(const float* logits, int64_t n_rows, int64_t width, const int64_t* targets, float* out);
// log_softmax's terms from sums kept in parts (a row's vector lanes): part i summed e^(x - tops[i]) over its floats
// into totals[i]. *top <- the highest of tops; returns log(sum over the parts of e^(x - *top))
// tops, totals: [n]
inline float log_total_of_parts(const float* tops, const float* totals, int n, float* top) {
  float highest = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < n; ++i) highest = std::max(highest, tops[i]);
  float total = 0.0f;
  for (int i = 0; i < n; ++i) total += totals[i] * std::exp(tops[i] - highest);
  *top = highest;
  return std::log(total);
}
// The k largest floats of row among the ids not in excluded (n_excluded of them), best first, ties to the lower id
// -> values[k], ids[k]; past a row's finite candidates, -inf and fill_id (NaN never enters). A block of 8 vectors
// none of whose lanes beats the k-th best so far costs one comparison (sampling's top-k, search.cpp; a beam step's
// candidates). Where top is not null, in the same pass: *top = max(row) and *log_total = log(sum e^(row - top)),
// log_softmax's terms (NaN where the row holds NaN; top +inf where it holds +inf).
// row: [width], excluded: [n_excluded], values: [k], ids: [k]
void top_k_row_cpu(const float* row, int64_t width, int64_t k, const int64_t* excluded, int64_t n_excluded,
                   int64_t fill_id, float* values, int64_t* ids, float* top = nullptr, float* log_total = nullptr);

}  // namespace fastformer
