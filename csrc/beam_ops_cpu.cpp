// fp32 CPU implementations of the beam-search ops (see beam_ops.h): loops on 8-float vectors, torch-free.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "beam_ops.h"

// The entry points are compiled twice, for x86-64-v3 (AVX2 + FMA) and the baseline, and the loader picks the one the
// CPU runs; the helpers they call are inlined into each. Elsewhere they are compiled once, for the baseline.
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define FASTFORMER_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define FASTFORMER_CPU_CLONES
#endif
#define FASTFORMER_INLINE inline __attribute__((always_inline))
// GCC warns that a vector passed by value has another ABI without AVX; every helper taking one is inlined, so no
// vector crosses a call.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace fastformer {
namespace {

constexpr int kLanes = 8;
// kLanes floats as one value (GCC/Clang vector extensions): the ops below are written on whole vectors, so they
// compile to AVX2 in the x86-64-v3 clone and to pairs of SSE instructions in the baseline one.
using Floats = float __attribute__((vector_size(kLanes * sizeof(float))));
using Ints = int32_t __attribute__((vector_size(kLanes * sizeof(int32_t))));

FASTFORMER_INLINE Floats splat(float x) { return Floats{} + x; }

FASTFORMER_INLINE Floats load(const float* x) {
  Floats v;
  std::memcpy(&v, x, sizeof v);
  return v;
}

FASTFORMER_INLINE void store(float* x, Floats v) { std::memcpy(x, &v, sizeof v); }

// The first n < kLanes floats of x, the other lanes `fill`.
FASTFORMER_INLINE Floats load_first(const float* x, int n, float fill) {
  Floats v = splat(fill);
  for (int lane = 0; lane < n; ++lane) v[lane] = x[lane];
  return v;
}

FASTFORMER_INLINE float sum_lanes(Floats v) {
  float total = 0.0f;
  for (int lane = 0; lane < kLanes; ++lane) total += v[lane];
  return total;
}

FASTFORMER_INLINE float max_lanes(Floats v) {
  float top = v[0];
  for (int lane = 1; lane < kLanes; ++lane) top = std::max(top, v[lane]);
  return top;
}

// Lane-wise max that keeps `a` where b is NaN, as std::max(a, b) does.
FASTFORMER_INLINE Floats maximum(Floats a, Floats b) { return a < b ? b : a; }

// Folded in halves (three vector ORs, then one lane read) rather than read lane by lane.
FASTFORMER_INLINE bool any_lane(Ints mask) {
  static_assert(kLanes == 8, "the shuffles below are written for 8 lanes");
  mask |= __builtin_shufflevector(mask, mask, 4, 5, 6, 7, 0, 1, 2, 3);
  mask |= __builtin_shufflevector(mask, mask, 2, 3, 0, 1, 6, 7, 4, 5);
  mask |= __builtin_shufflevector(mask, mask, 1, 0, 3, 2, 5, 4, 7, 6);
  return mask[0] != 0;
}

// e^x for x <= 0 (to ~2 ulp; x < -87 gives ~1e-38 rather than 0): 2^n * e^r with n = round(x / ln 2) and
// |r| <= ln(2) / 2 by a degree-6 polynomial, with ln 2 split in two so that r stays exact.
FASTFORMER_INLINE Floats exp_nonpositive(Floats x) {
  x = maximum(x, splat(-87.0f));
  const Floats magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const Floats n = (x * 1.44269504f + magic) - magic;
  const Floats r = (x - n * 0.693145751953125f) - n * 1.42860677e-6f;
  Floats p = splat(1.38888889e-3f);
  p = p * r + 8.33333333e-3f;
  p = p * r + 4.16666667e-2f;
  p = p * r + 1.66666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const Ints exponent = (__builtin_convertvector(n, Ints) + 127) << 23;
  return p * __builtin_bit_cast(Floats, exponent);
}

// a . b over n floats.
FASTFORMER_INLINE float dot(const float* a, const float* b, int n) {
  Floats partial{};
  int d = 0;
  for (; d + kLanes <= n; d += kLanes) partial += load(a + d) * load(b + d);
  float total = sum_lanes(partial);
  for (; d < n; ++d) total += a[d] * b[d];
  return total;
}

// out[0:n] += w * x[0:n]
FASTFORMER_INLINE void add_scaled(float* out, float w, const float* x, int n) {
  int d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    const Floats sum = load(out + d) + w * load(x + d);
    store(out + d, sum);
  }
  for (; d < n; ++d) out[d] += w * x[d];
}

// The sum of e^(x_t - top) over n floats x_t <= top; kInPlace also replaces each x_t by its e^(x_t - top).
template <bool kInPlace>
FASTFORMER_INLINE float sum_exp(std::conditional_t<kInPlace, float*, const float*> x, int n, float top) {
  Floats total{};
  int t = 0;
  for (; t + kLanes <= n; t += kLanes) {
    const Floats e = exp_nonpositive(load(x + t) - top);
    if constexpr (kInPlace) store(x + t, e);
    total += e;
  }
  float sum = sum_lanes(total);
  if (t < n) {
    const Floats tail = exp_nonpositive(load_first(x + t, n - t, top) - top);
    for (int lane = 0; lane < n - t; ++lane) {
      sum += tail[lane];
      if constexpr (kInPlace) x[t + lane] = tail[lane];
    }
  }
  return sum;
}

// A per-thread buffer of at least `size` floats, kept between calls (the ops run once per layer and step).
float* scratch(size_t size) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < size) buffer.resize(size);
  return buffer.data();
}

// Lane i of the result: the sum of v[i]'s lanes (a transpose and three rounds of pairwise sums).
FASTFORMER_INLINE Floats lane_sums(const Floats (&v)[kLanes]) {
  static_assert(kLanes == 8, "the shuffles below are written for 8 lanes");
  Floats pairs[4], quads[2];
  for (int i = 0; i < 4; ++i) {
    pairs[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  }
  for (int i = 0; i < 2; ++i) {
    quads[i] = __builtin_shufflevector(pairs[2 * i], pairs[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(pairs[2 * i], pairs[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  return __builtin_shufflevector(quads[0], quads[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(quads[0], quads[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

// Lane i: q . key_at(first + i) over head_dim floats (a multiple of kLanes), for the n <= kLanes positions from
// `first` (the lanes past n repeat the last). Eight keys at once, so that the products' sums run side by side and
// their lanes are added up once per eight keys rather than once per key.
template <typename KeyAt>
FASTFORMER_INLINE Floats dots_of_block(const float* q, int head_dim, int first, int n, KeyAt key_at) {
  const float* keys[kLanes];
  for (int i = 0; i < kLanes; ++i) keys[i] = key_at(first + std::min(i, n - 1));
  Floats partial[kLanes] = {};
  for (int d = 0; d < head_dim; d += kLanes) {
    const Floats q_part = load(q + d);
    for (int i = 0; i < kLanes; ++i) partial[i] += q_part * load(keys[i] + d);
  }
  return lane_sums(partial);
}

// out[offset : offset + kVectors * kLanes] = scale * sum over p < length of weights[p] * value_at(p)[same range],
// summed in registers.
template <int kVectors, typename ValueAt>
FASTFORMER_INLINE void weighted_values(const float* weights, int length, float scale, ValueAt value_at, int offset,
                                       float* out) {
  Floats sum[kVectors] = {};
  for (int p = 0; p < length; ++p) {
    const float* value = value_at(p) + offset;
    for (int i = 0; i < kVectors; ++i) sum[i] += weights[p] * load(value + i * kLanes);
  }
  for (int i = 0; i < kVectors; ++i) store(out + offset + i * kLanes, sum[i] * scale);
}

// out[0:head_dim] = softmax(q . k_p / sqrt(head_dim)) @ v over positions p < length; key_at(p)/value_at(p) point
// at position p's [head_dim] vectors; weights: [length] scratch. A head_dim that is a multiple of kLanes (every
// model's in practice) runs on whole vectors; any other runs one position at a time.
template <typename KeyAt, typename ValueAt>
FASTFORMER_INLINE void attend_one(const float* q, int head_dim, int length, KeyAt key_at, ValueAt value_at,
                                  float* weights, float* out) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const bool whole_vectors = head_dim % kLanes == 0;
  float max_score = -std::numeric_limits<float>::infinity();
  if (whole_vectors) {
    for (int first = 0; first < length; first += kLanes) {
      const int n = std::min(kLanes, length - first);
      const Floats scores = dots_of_block(q, head_dim, first, n, key_at) * scale;
      for (int i = 0; i < n; ++i) {
        weights[first + i] = scores[i];
        max_score = std::max(max_score, scores[i]);
      }
    }
  } else {
    for (int p = 0; p < length; ++p) {
      weights[p] = dot(q, key_at(p), head_dim) * scale;
      max_score = std::max(max_score, weights[p]);
    }
  }
  const float inverse_total = 1.0f / sum_exp<true>(weights, length, max_score);
  if (!whole_vectors) {
    std::fill(out, out + head_dim, 0.0f);
    for (int p = 0; p < length; ++p) add_scaled(out, weights[p] * inverse_total, value_at(p), head_dim);
    return;
  }
  // The sums in blocks of 8 vectors (half of AVX2's 16 registers), then 4, then 1.
  int offset = 0;
  for (; offset + 8 * kLanes <= head_dim; offset += 8 * kLanes) {
    weighted_values<8>(weights, length, inverse_total, value_at, offset, out);
  }
  if (offset + 4 * kLanes <= head_dim) {
    weighted_values<4>(weights, length, inverse_total, value_at, offset, out);
    offset += 4 * kLanes;
  }
  for (; offset < head_dim; offset += kLanes) weighted_values<1>(weights, length, inverse_total, value_at, offset, out);
}

// Keeps the best `capacity` candidates offered, ranked (ranks_before) best first.
class TopCandidates {
 public:
  explicit TopCandidates(int capacity) : ranked_(capacity) {}
  void clear() { size_ = 0; }
  // The score a new candidate must beat: the worst kept once full, -inf before.
  float bar() const {
    return size_ == static_cast<int>(ranked_.size()) ? ranked_[size_ - 1].score
                                                       : -std::numeric_limits<float>::infinity();
  }
  void offer(Candidate c) {
    const int capacity = static_cast<int>(ranked_.size());
    if (size_ == capacity && !ranks_before(c, ranked_[capacity - 1])) return;
    int at = size_ < capacity ? size_++ : capacity - 1;
    for (; at > 0 && ranks_before(c, ranked_[at - 1]); --at) ranked_[at] = ranked_[at - 1];
    ranked_[at] = c;
  }
  // [capacity] best first, -inf past the candidates offered.
  const Candidate* ranked() {
    std::fill(ranked_.begin() + size_, ranked_.end(), Candidate{-std::numeric_limits<float>::infinity(), 0});
    return ranked_.data();
  }

 private:
  std::vector<Candidate> ranked_;
  int size_ = 0;
};

// max over n floats (NaN is skipped unless first, as std::max does).
FASTFORMER_INLINE float max_of(const float* x, int n) {
  Floats top = splat(-std::numeric_limits<float>::infinity());
  int t = 0;
  for (; t + kLanes <= n; t += kLanes) top = maximum(top, load(x + t));
  if (t < n) top = maximum(top, load_first(x + t, n - t, -std::numeric_limits<float>::infinity()));
  return max_lanes(top);
}

// Offers beam j's tokens of `row` to `candidates`: score = running + ((logit - top) - log_total). The scores rise
// with the logits, so a block of 8 vectors whose lane-wise best logits beat none of the worst kept is passed over
// after one look at its lanes (reading a vector's lanes costs as much as the arithmetic of 8); the vectors of the
// other blocks are computed at once and their lanes looked at one by one only when one beats the worst kept.
FASTFORMER_INLINE void offer_row(const BeamStepArgs& a, int step, const float* row, int j, float running,
                                 float top, float log_total, int max_len, TopCandidates& candidates) {
  constexpr int kBlock = 8 * kLanes;
  for (int block = 0; block < a.vocab; block += kBlock) {
    const int block_end = std::min(block + kBlock, a.vocab);
    if (block_end - block == kBlock) {
      Floats best = load(row + block);
      for (int v = 1; v < 8; ++v) best = maximum(best, load(row + block + v * kLanes));
      if (!any_lane(running + ((best - top) - log_total) > candidates.bar())) continue;
    }
    for (int first = block; first < block_end; first += kLanes) {
      const int n = std::min(kLanes, a.vocab - first);
      const float bar = candidates.bar();
      const Floats logits = n == kLanes ? load(row + first) : load_first(row + first, n, top);
      const Floats scores = running + ((logits - top) - log_total);
      if (!any_lane(scores > bar)) continue;
      for (int lane = 0; lane < n; ++lane) {
        const int t = first + lane;
        if (scores[lane] > -std::numeric_limits<float>::infinity() && token_allowed(a, step, t, max_len)) {
          candidates.offer({scores[lane], j * a.vocab + t});
        }
      }
    }
  }
}

}  // namespace

FASTFORMER_CPU_CLONES void self_attention_step_cpu(const SelfAttentionArgs& a) {
  const int d_model = a.heads * a.head_dim;
  const auto* qkv = static_cast<const float*>(a.qkv);
  auto* k_cache = static_cast<float*>(a.k_cache);
  auto* v_cache = static_cast<float*>(a.v_cache);
  auto* out = static_cast<float*>(a.out);
  const int step = *a.step;
  for (int row = 0; row < a.n_rows; ++row) {
    const int64_t slot = a.row_slots[row];
    const int64_t first_slot_of_sentence = slot - slot % a.beam_size;
    const int32_t* indirection = a.indirection + slot * a.cache_len;
    const float* q = qkv + static_cast<int64_t>(row) * 3 * d_model;
    for (int h = 0; h < a.heads; ++h) {
      // Offset of (slot, head h, position p) in the caches.
      auto at = [&](int64_t cache_slot, int p) {
        return ((cache_slot * a.heads + h) * a.cache_len + p) * a.head_dim;
      };
      std::memcpy(k_cache + at(slot, step), q + d_model + h * a.head_dim, a.head_dim * sizeof(float));
      std::memcpy(v_cache + at(slot, step), q + 2 * d_model + h * a.head_dim, a.head_dim * sizeof(float));
      // Position `step` is the row's own, just appended; earlier ones are wherever the indirection says.
      auto source = [&](int p) { return p == step ? slot : first_slot_of_sentence + indirection[p]; };
      auto key_at = [&](int p) { return k_cache + at(source(p), p); };
      auto value_at = [&](int p) { return v_cache + at(source(p), p); };
      attend_one(q + h * a.head_dim, a.head_dim, step + 1, key_at, value_at, scratch(step + 1),
                 out + static_cast<int64_t>(row) * d_model + h * a.head_dim);
    }
  }
}

FASTFORMER_CPU_CLONES void cross_attention_cpu(const CrossAttentionArgs& a) {
  const int d_model = a.heads * a.head_dim;
  const auto* k = static_cast<const float*>(a.k);
  const auto* v = static_cast<const float*>(a.v);
  auto* out = static_cast<float*>(a.out);
  for (int row = 0; row < a.n_rows; ++row) {
    const int64_t sentence = a.row_slots[row] / a.beam_size;
    for (int h = 0; h < a.heads; ++h) {
      const int64_t head_offset = (sentence * a.heads + h) * a.src_len * a.head_dim;
      auto key_at = [&](int p) { return k + head_offset + static_cast<int64_t>(p) * a.head_dim; };
      auto value_at = [&](int p) { return v + head_offset + static_cast<int64_t>(p) * a.head_dim; };
      attend_one(static_cast<const float*>(a.q) + static_cast<int64_t>(row) * d_model + h * a.head_dim, a.head_dim,
                 a.src_lengths[sentence], key_at, value_at, scratch(a.src_len),
                 out + static_cast<int64_t>(row) * d_model + h * a.head_dim);
    }
  }
}

FASTFORMER_CPU_CLONES void beam_step_cpu(const BeamStepArgs& a) {
  const int k = a.beam_size;
  const auto* logits = static_cast<const float*>(a.logits);
  TopCandidates candidates(2 * k);
  std::vector<int> next_parents(k), next_tokens(k);
  std::vector<float> next_sums(k);
  const int step = *a.step;
  for (int block = 0; block < a.n_active; ++block) {
    const int sentence = a.active[block];
    if (a.done[sentence]) continue;
    const int max_len = a.max_lens[sentence];
    candidates.clear();
    for (int j = 0; j < k; ++j) {
      const float running = a.sums[static_cast<int64_t>(sentence) * k + j];
      if (!(running > -std::numeric_limits<float>::infinity())) continue;  // an empty slot: every score is -inf
      const float* row = logits + (static_cast<int64_t>(block) * k + j) * a.vocab;
      const float top = max_of(row, a.vocab);
      offer_row(a, step, row, j, running, top, std::log(sum_exp<false>(row, a.vocab, top)), max_len, candidates);
    }
    const int n_alive = select_next_beams(a, step, sentence, candidates.ranked(), next_parents.data(),
                                          next_tokens.data(), next_sums.data());
    // Every beam's new state is computed from the old one before any is overwritten (sums are read above).
    for (int j = 0; j < k; ++j) {
      write_next_beam(a, step, sentence, j, n_alive, next_parents.data(), next_tokens.data(), next_sums.data(),
                      /*first_position=*/0, /*position_stride=*/1);
    }
  }
}

FASTFORMER_CPU_CLONES void row_absmax_cpu(const float* x, int64_t n_rows, int64_t width, float* absmax) {
  const Ints magnitude_bits = Ints{} + 0x7fffffff;
  for (int64_t r = 0; r < n_rows; ++r) {
    const float* row = x + r * width;
    // x * 0 is NaN exactly where x is NaN or inf: one sum of those flags a row that is not finite.
    Floats top{}, poison{};
    int64_t i = 0;
    for (; i + kLanes <= width; i += kLanes) {
      const Floats v = load(row + i);
      top = maximum(top, __builtin_bit_cast(Floats, __builtin_bit_cast(Ints, v) & magnitude_bits));
      poison += v * 0.0f;
    }
    float best = max_lanes(top), tail_poison = sum_lanes(poison);
    for (; i < width; ++i) {
      best = std::max(best, std::abs(row[i]));
      tail_poison += row[i] * 0.0f;
    }
    absmax[r] = tail_poison == 0.0f ? best : std::numeric_limits<float>::quiet_NaN();
  }
}

FASTFORMER_CPU_CLONES void clamped_scale_cpu(const float* x, int64_t width, float factor, float* out) {
  int64_t i = 0;
  for (; i + kLanes <= width; i += kLanes) {
    const Floats v = load(x + i) * factor;
    store(out + i, v < -1.0f ? splat(-1.0f) : (v > 1.0f ? splat(1.0f) : v));
  }
  for (; i < width; ++i) out[i] = std::clamp(x[i] * factor, -1.0f, 1.0f);
}

FASTFORMER_CPU_CLONES void scale_and_add_cpu(float* y, int64_t width, float scale, const float* bias) {
  int64_t i = 0;
  for (; i + kLanes <= width; i += kLanes) {
    Floats v = load(y + i) * scale;
    if (bias) v += load(bias + i);
    store(y + i, v);
  }
  for (; i < width; ++i) y[i] = bias ? y[i] * scale + bias[i] : y[i] * scale;
}

}  // namespace fastformer
