// fp32 CPU implementations of the beam-search ops (see beam_ops.h): plain loops, torch-free.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "beam_ops.h"

namespace fastformer {
namespace {

// a . b over n floats, in kLanes independent partial sums so that the compiler can keep them in vector registers
// (one running sum is a serial chain of dependent adds).
inline float dot(const float* a, const float* b, int n) {
  constexpr int kLanes = 8;
  float partial[kLanes] = {};
  int d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int lane = 0; lane < kLanes; ++lane) partial[lane] += a[d + lane] * b[d + lane];
  }
  float total = 0.0f;
  for (int lane = 0; lane < kLanes; ++lane) total += partial[lane];
  for (; d < n; ++d) total += a[d] * b[d];
  return total;
}

// A per-thread buffer of at least `size` floats, kept between calls (the ops run once per layer and step).
float* scratch(size_t size) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < size) buffer.resize(size);
  return buffer.data();
}

// out[0:head_dim] = softmax(q . k_p / sqrt(head_dim)) @ v over positions p < length; key_at(p)/value_at(p) point
// at position p's [head_dim] vectors; weights: [length] scratch.
template <typename KeyAt, typename ValueAt>
void attend_one(const float* q, int head_dim, int length, KeyAt key_at, ValueAt value_at, float* weights,
                float* out) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  float max_score = -std::numeric_limits<float>::infinity();
  for (int p = 0; p < length; ++p) {
    weights[p] = dot(q, key_at(p), head_dim) * scale;
    max_score = std::max(max_score, weights[p]);
  }
  float total = 0.0f;
  for (int p = 0; p < length; ++p) {
    weights[p] = std::exp(weights[p] - max_score);
    total += weights[p];
  }
  std::fill(out, out + head_dim, 0.0f);
  for (int p = 0; p < length; ++p) {
    const float* value = value_at(p);
    const float w = weights[p] / total;
    for (int d = 0; d < head_dim; ++d) out[d] += w * value[d];
  }
}

// Keeps the best `capacity` candidates offered, ranked (ranks_before) best first.
class TopCandidates {
 public:
  explicit TopCandidates(int capacity) : ranked_(capacity) {}
  void clear() { size_ = 0; }
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

}  // namespace

void self_attention_step_cpu(const SelfAttentionArgs& a) {
  const int d_model = a.heads * a.head_dim;
  const auto* qkv = static_cast<const float*>(a.qkv);
  auto* k_cache = static_cast<float*>(a.k_cache);
  auto* v_cache = static_cast<float*>(a.v_cache);
  auto* out = static_cast<float*>(a.out);
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
      std::memcpy(k_cache + at(slot, a.step), q + d_model + h * a.head_dim, a.head_dim * sizeof(float));
      std::memcpy(v_cache + at(slot, a.step), q + 2 * d_model + h * a.head_dim, a.head_dim * sizeof(float));
      // Position `step` is the row's own, just appended; earlier ones are wherever the indirection says.
      auto source = [&](int p) { return p == a.step ? slot : first_slot_of_sentence + indirection[p]; };
      auto key_at = [&](int p) { return k_cache + at(source(p), p); };
      auto value_at = [&](int p) { return v_cache + at(source(p), p); };
      attend_one(q + h * a.head_dim, a.head_dim, a.step + 1, key_at, value_at, scratch(a.step + 1),
                 out + static_cast<int64_t>(row) * d_model + h * a.head_dim);
    }
  }
}

void cross_attention_cpu(const CrossAttentionArgs& a) {
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

void beam_step_cpu(const BeamStepArgs& a) {
  const int k = a.beam_size;
  const auto* logits = static_cast<const float*>(a.logits);
  TopCandidates candidates(2 * k);
  std::vector<int> next_parents(k), next_tokens(k);
  std::vector<float> next_sums(k);
  for (int block = 0; block < a.n_active; ++block) {
    const int sentence = a.active[block];
    const int max_len = a.max_lens[sentence];
    candidates.clear();
    for (int j = 0; j < k; ++j) {
      const float* row = logits + (static_cast<int64_t>(block) * k + j) * a.vocab;
      const float running = a.sums[static_cast<int64_t>(sentence) * k + j];
      float max_logit = -std::numeric_limits<float>::infinity();
      for (int t = 0; t < a.vocab; ++t) max_logit = std::max(max_logit, row[t]);
      float total = 0.0f;
      for (int t = 0; t < a.vocab; ++t) total += std::exp(row[t] - max_logit);
      const float log_total = std::log(total);
      for (int t = 0; t < a.vocab; ++t) {
        if (!token_allowed(a, t, max_len)) continue;
        const float score = running + ((row[t] - max_logit) - log_total);
        if (score > -std::numeric_limits<float>::infinity()) candidates.offer({score, j * a.vocab + t});
      }
    }
    const int n_alive = select_next_beams(a, sentence, candidates.ranked(), next_parents.data(), next_tokens.data(),
                                          next_sums.data());
    // Every beam's new state is computed from the old one before any is overwritten (sums are read above).
    for (int j = 0; j < k; ++j) {
      write_next_beam(a, sentence, j, n_alive, next_parents.data(), next_tokens.data(), next_sums.data(), 0, 1);
    }
  }
}

}  // namespace fastformer
