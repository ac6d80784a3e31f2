// ctest: the CPU beam-search ops against brute-force loops in double precision (no torch), in every instruction set
// this CPU runs (each set's loops are separate code: a fault in one would not show in another).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "beam_ops.h"
#include "float32_gemm.h"
#include "int8_gemm.h"

namespace {

int failures = 0;

void expect(bool condition, const char* what, int line) {
  if (!condition) {
    std::fprintf(stderr, "line %d: FAILED %s\n", line, what);
    ++failures;
  }
}
#define EXPECT(condition) expect((condition), #condition, __LINE__)

std::mt19937 rng(1234);
const fastformer::CpuLoops* loops = nullptr;  // the instruction set under test

std::vector<float> random_floats(size_t n, float scale = 1.0f) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

// softmax(q . k_p / sqrt(d)) @ v in double, over the given key/value vectors.
std::vector<double> naive_attention(const float* q, const std::vector<const float*>& keys,
                                    const std::vector<const float*>& values, int head_dim) {
  std::vector<double> scores;
  for (const float* key : keys) {
    double dot = 0;
    for (int d = 0; d < head_dim; ++d) dot += double(q[d]) * key[d];
    scores.push_back(dot / std::sqrt(double(head_dim)));
  }
  const double top = *std::max_element(scores.begin(), scores.end());
  double total = 0;
  for (double& s : scores) total += (s = std::exp(s - top));
  std::vector<double> out(head_dim, 0.0);
  for (size_t p = 0; p < keys.size(); ++p) {
    for (int d = 0; d < head_dim; ++d) out[d] += scores[p] / total * values[p][d];
  }
  return out;
}

// A copy of `values` that starts `offset` floats past a 64-byte boundary (the caches' alignment decides whether their
// new entries are streamed or copied).
struct AlignedFloats {
  AlignedFloats(const std::vector<float>& values, size_t offset) : storage(values.size() + 16 + offset) {
    const auto address = reinterpret_cast<uintptr_t>(storage.data());
    data = storage.data() + (64 - address % 64) % 64 / sizeof(float) + offset;
    std::copy(values.begin(), values.end(), data);
  }
  std::vector<float> storage;
  float* data;
  float& operator[](size_t i) { return data[i]; }
};

// head_dim: one that is a multiple of neither vector width, one of 8 floats only, one of both (whole vectors); the
// caches aligned to 64 bytes (entries streamed where whole vectors) or 4 bytes past (copied).
void test_self_attention_step(int head_dim, size_t cache_offset) {
  const int n_sentences = 2, beam = 3, heads = 2, cache_len = 21, step = 19;
  const int n_slots = n_sentences * beam, d_model = heads * head_dim;
  const size_t cache_size = size_t(n_slots) * heads * cache_len * head_dim;
  const std::vector<float> k_before = random_floats(cache_size), v_before = random_floats(cache_size);
  AlignedFloats k_cache(k_before, cache_offset), v_cache(v_before, cache_offset);
  std::vector<int32_t> indirection(n_slots * cache_len);
  std::uniform_int_distribution<int> any_beam(0, beam - 1);
  for (int32_t& b : indirection) b = any_beam(rng);
  // Rows: beams 2 and 0 of sentence 1, beam 1 of sentence 0 (any subset and order of slots).
  const std::vector<int32_t> row_slots = {5, 3, 1};
  const int n_rows = int(row_slots.size());
  const std::vector<float> qkv = random_floats(size_t(n_rows) * 3 * d_model);
  std::vector<float> out(size_t(n_rows) * d_model);
  loops->self_attention_step({qkv.data(), k_cache.data, v_cache.data, indirection.data(),
                                       row_slots.data(), out.data(), &step, n_rows, heads, head_dim, cache_len,
                                       beam});
  auto at = [&](int slot, int h, int p) { return (size_t(slot * heads + h) * cache_len + p) * head_dim; };
  for (int row = 0; row < n_rows; ++row) {
    const int slot = row_slots[row], first = slot - slot % beam;
    for (int h = 0; h < heads; ++h) {
      const float* q = qkv.data() + size_t(row) * 3 * d_model + h * head_dim;
      std::vector<const float*> keys, values;
      for (int p = 0; p < step; ++p) {
        const int source = first + indirection[slot * cache_len + p];
        keys.push_back(k_before.data() + at(source, h, p));
        values.push_back(v_before.data() + at(source, h, p));
      }
      keys.push_back(q + d_model);
      values.push_back(q + 2 * d_model);
      const std::vector<double> expected = naive_attention(q, keys, values, head_dim);
      for (int d = 0; d < head_dim; ++d) {
        EXPECT(std::fabs(out[size_t(row) * d_model + h * head_dim + d] - expected[d]) < 1e-5);
        EXPECT(k_cache[at(slot, h, step) + d] == q[d_model + d]);
        EXPECT(v_cache[at(slot, h, step) + d] == q[2 * d_model + d]);
      }
    }
  }
  size_t changed = 0;
  for (size_t i = 0; i < cache_size; ++i) changed += k_cache[i] != k_before[i];
  EXPECT(changed == size_t(n_rows) * heads * head_dim);  // only the appended position moved
}

// cross_attention against the naive sum, float32 or float16 keys and values, beams of a sentence in groups of 4, 2
// and 1 (beam 5 and a sentence with 3 rows); each row bitwise as it attends alone (beam_size 1, its sentence's
// keys and values its own); and bitwise the same with q, k and v strided as views of linear layers' outputs.
void test_cross_attention(int head_dim, bool half) {
  const int n_sentences = 3, beam = 5, heads = 2, src_len = 20;
  const int d_model = heads * head_dim;
  const size_t size = size_t(n_sentences) * heads * src_len * head_dim;
  std::vector<float> k = random_floats(size), v = random_floats(size);
  std::vector<_Float16> k_half(size), v_half(size);
  for (size_t i = 0; i < size; ++i) {
    k_half[i] = static_cast<_Float16>(k[i]);
    v_half[i] = static_cast<_Float16>(v[i]);
    if (half) k[i] = static_cast<float>(k_half[i]), v[i] = static_cast<float>(v_half[i]);
  }
  const std::vector<int32_t> src_lengths = {20, 1, 17};  // one key block and more, with a tail
  const std::vector<int32_t> row_slots = {0, 1, 2, 3, 4, 5, 7, 9, 12};  // sentence 0's 5 beams, 1's 3, 2's 1
  const int n_rows = int(row_slots.size());
  const std::vector<float> q = random_floats(size_t(n_rows) * d_model);
  auto attend = [&](const void* keys, const void* values, const int32_t* lengths, const int32_t* slots, int beam_size,
                    std::vector<float>& out) {
    fastformer::CrossAttentionArgs args{q.data(), keys, values, lengths, slots, out.data(), n_rows, heads, head_dim,
                                        src_len, beam_size, d_model, int64_t{heads} * src_len * head_dim,
                                        int64_t{src_len} * head_dim, head_dim};
    args.half_keys_values = half;
    loops->cross_attention(args);
  };
  std::vector<float> out(size_t(n_rows) * d_model);
  attend(half ? static_cast<const void*>(k_half.data()) : k.data(),
         half ? static_cast<const void*>(v_half.data()) : v.data(), src_lengths.data(), row_slots.data(), beam, out);
  // Strided: q's rows inside [n_rows, 3 * d_model] (the encoder's qkv), k and v interleaved as the rows of a
  // [n_sentences * src_len, 2 * d_model] output ([n_sentences, src_len, 2, heads, head_dim]).
  {
    std::vector<float> q_wide(size_t(n_rows) * 3 * d_model, std::nanf("")), kv(2 * size);
    std::vector<_Float16> kv_half(2 * size);
    for (int row = 0; row < n_rows; ++row) {
      std::copy_n(q.begin() + size_t(row) * d_model, d_model, q_wide.begin() + size_t(row) * 3 * d_model);
    }
    for (int s = 0; s < n_sentences; ++s) {
      for (int h = 0; h < heads; ++h) {
        for (int p = 0; p < src_len; ++p) {
          const size_t from = (size_t(s * heads + h) * src_len + p) * head_dim;
          const size_t to = ((size_t(s) * src_len + p) * 2 * heads + h) * head_dim;
          std::copy_n(k.begin() + from, head_dim, kv.begin() + to);
          std::copy_n(v.begin() + from, head_dim, kv.begin() + to + d_model);
          std::copy_n(k_half.begin() + from, head_dim, kv_half.begin() + to);
          std::copy_n(v_half.begin() + from, head_dim, kv_half.begin() + to + d_model);
        }
      }
    }
    std::vector<float> out_strided(out.size());
    const void* keys = half ? static_cast<const void*>(kv_half.data()) : kv.data();
    const void* values = half ? static_cast<const void*>(kv_half.data() + d_model) : kv.data() + d_model;
    fastformer::CrossAttentionArgs args{q_wide.data(), keys, values, src_lengths.data(), row_slots.data(),
                                        out_strided.data(), n_rows, heads, head_dim, src_len, beam,
                                        3 * d_model, int64_t{src_len} * 2 * d_model, head_dim, 2 * d_model};
    args.half_keys_values = half;
    loops->cross_attention(args);
    EXPECT(out_strided == out);
  }
  // Alone: row r is sentence r of beam 1, with a copy of its sentence's keys and values.
  std::vector<float> k_alone, v_alone;
  std::vector<_Float16> k_half_alone, v_half_alone;
  std::vector<int32_t> lengths_alone, slots_alone;
  const size_t per_sentence = size_t(heads) * src_len * head_dim;
  for (int row = 0; row < n_rows; ++row) {
    const int sentence = row_slots[row] / beam;
    const size_t from = sentence * per_sentence;
    k_alone.insert(k_alone.end(), k.begin() + from, k.begin() + from + per_sentence);
    v_alone.insert(v_alone.end(), v.begin() + from, v.begin() + from + per_sentence);
    k_half_alone.insert(k_half_alone.end(), k_half.begin() + from, k_half.begin() + from + per_sentence);
    v_half_alone.insert(v_half_alone.end(), v_half.begin() + from, v_half.begin() + from + per_sentence);
    lengths_alone.push_back(src_lengths[sentence]);
    slots_alone.push_back(row);
  }
  std::vector<float> out_alone(out.size());
  attend(half ? static_cast<const void*>(k_half_alone.data()) : k_alone.data(),
         half ? static_cast<const void*>(v_half_alone.data()) : v_alone.data(), lengths_alone.data(),
         slots_alone.data(), 1, out_alone);
  EXPECT(out == out_alone);
  for (int row = 0; row < n_rows; ++row) {
    const int sentence = row_slots[row] / beam;
    for (int h = 0; h < heads; ++h) {
      std::vector<const float*> keys, values;
      for (int p = 0; p < src_lengths[sentence]; ++p) {
        const size_t offset = (size_t(sentence * heads + h) * src_len + p) * head_dim;
        keys.push_back(k.data() + offset);
        values.push_back(v.data() + offset);
      }
      const std::vector<double> expected =
          naive_attention(q.data() + size_t(row) * d_model + h * head_dim, keys, values, head_dim);
      for (int d = 0; d < head_dim; ++d) {
        EXPECT(std::fabs(out[size_t(row) * d_model + h * head_dim + d] - expected[d]) < 1e-5);
      }
    }
  }
}

// The encoder's self-attention (padded_queries): sentences of 7, 5 and 9 positions in a batch padded to 9. Each
// sentence's rows bitwise as it attends alone and unpadded (its positions in the same groups of 4, 2 and 1 either
// way: none grouped with a padding row), its padding rows zeros, and its rows against the naive sum.
void test_encoder_self_attention(int head_dim) {
  const int n_sentences = 3, heads = 2, src_len = 9;
  const int d_model = heads * head_dim;
  const std::vector<int32_t> lengths = {7, 5, 9};
  const size_t size = size_t(n_sentences) * heads * src_len * head_dim;
  const std::vector<float> k = random_floats(size), v = random_floats(size);
  const std::vector<float> q = random_floats(size_t(n_sentences) * src_len * d_model);
  // q: [sentences * positions, d_model]; keys, values: [sentences, heads, positions, head_dim].
  auto attend = [&](const float* queries, const float* keys, const float* values, const int32_t* sentence_lengths,
                    int sentences, int positions) {
    std::vector<int32_t> slots;
    for (int s = 0; s < sentences; ++s) slots.insert(slots.end(), positions, s);
    std::vector<float> out(size_t(sentences) * positions * d_model, std::nanf(""));
    fastformer::CrossAttentionArgs args{queries, keys, values, sentence_lengths, slots.data(), out.data(),
                                        sentences * positions, heads, head_dim, positions, 1, d_model,
                                        int64_t{heads} * positions * head_dim, int64_t{positions} * head_dim, head_dim};
    args.padded_queries = 1;
    loops->cross_attention(args);
    return out;
  };
  const std::vector<float> out = attend(q.data(), k.data(), v.data(), lengths.data(), n_sentences, src_len);
  for (int s = 0; s < n_sentences; ++s) {
    const int length = lengths[s];
    const auto first_row = out.begin() + std::ptrdiff_t(s) * src_len * d_model;
    std::vector<float> k_alone, v_alone;
    for (int h = 0; h < heads; ++h) {
      const size_t from = size_t(s * heads + h) * src_len * head_dim;
      k_alone.insert(k_alone.end(), k.begin() + from, k.begin() + from + size_t(length) * head_dim);
      v_alone.insert(v_alone.end(), v.begin() + from, v.begin() + from + size_t(length) * head_dim);
    }
    const std::vector<float> alone =
        attend(q.data() + size_t(s) * src_len * d_model, k_alone.data(), v_alone.data(), &length, 1, length);
    EXPECT(std::equal(alone.begin(), alone.end(), first_row));
    EXPECT(std::all_of(first_row + std::ptrdiff_t(length) * d_model, first_row + std::ptrdiff_t(src_len) * d_model,
                       [](float x) { return x == 0.0f; }));
    for (int p = 0; p < length; ++p) {
      for (int h = 0; h < heads; ++h) {
        std::vector<const float*> keys, values;
        for (int key = 0; key < length; ++key) {
          keys.push_back(k.data() + (size_t(s * heads + h) * src_len + key) * head_dim);
          values.push_back(v.data() + (size_t(s * heads + h) * src_len + key) * head_dim);
        }
        const size_t row = size_t(s) * src_len + p;
        const std::vector<double> expected = naive_attention(q.data() + row * d_model + h * head_dim, keys, values,
                                                             head_dim);
        for (int d = 0; d < head_dim; ++d) {
          EXPECT(std::fabs(out[row * d_model + h * head_dim + d] - expected[d]) < 1e-5);
        }
      }
    }
  }
}

// block_attention against the naive sum, causal (a row sees its own position and those before) or over each
// sentence's key length; q_len 7 (a group of 4 rows, then one filled out with copies); q's rows inside wider ones and
// k and v interleaved, as views of linear layers' outputs; and each sentence bitwise as it attends alone, with only its
// own positions (the scorer's batch invariance: a sentence's rows and keys do not depend on the batch's longest).
void test_block_attention(int head_dim, bool causal) {
  const int n_sentences = 3, heads = 2, q_len = 7, k_len = causal ? q_len : 20;
  const int d_model = heads * head_dim;
  const std::vector<int32_t> k_lengths = causal ? std::vector<int32_t>{7, 7, 7} : std::vector<int32_t>{20, 1, 17};
  // A sentence alone: causal, its first real_rows positions (its target's length); else its own key length.
  const std::vector<int> real_rows = causal ? std::vector<int>{7, 3, 5} : std::vector<int>{7, 7, 7};
  const std::vector<float> q = random_floats(size_t(n_sentences) * q_len * 3 * d_model);  // rows 3 * d_model apart
  // [n_sentences, k_len, 2, heads, head_dim]: a key/value projection's rows.
  const std::vector<float> kv = random_floats(size_t(n_sentences) * k_len * 2 * d_model);
  auto run = [&](const float* queries, const float* keys_values, const int32_t* lengths, int n, int rows, int keys) {
    std::vector<float> out(size_t(n) * rows * d_model, std::nanf(""));
    fastformer::BlockAttentionArgs args{queries, keys_values, keys_values + d_model, lengths, out.data(), n, rows,
                                        keys, heads, head_dim, 3 * d_model, int64_t{keys} * 2 * d_model, head_dim,
                                        2 * d_model, causal};
    loops->block_attention(args);
    return out;
  };
  const std::vector<float> out = run(q.data(), kv.data(), k_lengths.data(), n_sentences, q_len, k_len);
  for (int s = 0; s < n_sentences; ++s) {
    for (int i = 0; i < q_len; ++i) {
      const size_t row = size_t(s) * q_len + i;
      const int n_keys = causal ? std::min(i + 1, k_lengths[s]) : k_lengths[s];
      for (int h = 0; h < heads; ++h) {
        std::vector<const float*> keys, values;
        for (int p = 0; p < n_keys; ++p) {
          const size_t at = (size_t(s) * k_len + p) * 2 * d_model + h * head_dim;
          keys.push_back(kv.data() + at);
          values.push_back(kv.data() + at + d_model);
        }
        const std::vector<double> expected = naive_attention(q.data() + row * 3 * d_model + h * head_dim, keys,
                                                             values, head_dim);
        for (int d = 0; d < head_dim; ++d) {
          EXPECT(std::fabs(out[row * d_model + h * head_dim + d] - expected[d]) < 1e-5);
        }
      }
    }
    // Alone: the sentence's own rows and keys only (causal: as many keys as real rows).
    const int rows = real_rows[s], keys = causal ? rows : k_lengths[s];
    std::vector<float> q_alone(q.begin() + size_t(s) * q_len * 3 * d_model,
                               q.begin() + (size_t(s) * q_len + rows) * 3 * d_model);
    std::vector<float> kv_alone(kv.begin() + size_t(s) * k_len * 2 * d_model,
                                kv.begin() + (size_t(s) * k_len + keys) * 2 * d_model);
    const int32_t length_alone = keys;
    const std::vector<float> alone = run(q_alone.data(), kv_alone.data(), &length_alone, 1, rows, keys);
    EXPECT(std::equal(alone.begin(), alone.end(), out.begin() + size_t(s) * q_len * d_model));
  }
}

struct Expected {
  std::vector<int> parents, tokens;
  std::vector<double> sums;
  std::vector<double> finished_scores;
  std::vector<int> finished_beams;
};

// The rules of one step for one sentence, spelled out over every candidate in double precision; forced: the token
// the sentence must take, or -1.
Expected brute_force_step(const float* logits, const float* sums, int beam, int vocab, int step, int min_len,
                          int max_len, int pad, int bos, int eos, double length_penalty, bool gnmt, int forced) {
  struct Scored {
    double score;
    int beam, token;
  };
  std::vector<Scored> all;
  for (int j = 0; j < beam; ++j) {
    const float* row = logits + size_t(j) * vocab;
    double total = 0;
    for (int t = 0; t < vocab; ++t) total += std::exp(double(row[t]));
    for (int t = 0; t < vocab; ++t) {
      const bool allowed = t != pad && t != bos &&
                           (step == max_len ? t == eos : forced >= 0 ? t == forced : (t != eos || step >= min_len));
      if (allowed && std::isfinite(sums[j])) all.push_back({sums[j] + row[t] - std::log(total), j, t});
    }
  }
  std::stable_sort(all.begin(), all.end(), [](const Scored& a, const Scored& b) { return a.score > b.score; });
  Expected e;
  for (int rank = 0; rank < std::min<int>(2 * beam, int(all.size())); ++rank) {
    const Scored& c = all[rank];
    if (c.token == eos) {
      if (rank < beam) {
        const double length = step + 1;  // the real tokens and EOS
        e.finished_scores.push_back(c.score / std::pow(gnmt ? (5.0 + length) / 6.0 : length, length_penalty));
        e.finished_beams.push_back(c.beam);
      }
    } else if (int(e.parents.size()) < beam) {
      e.parents.push_back(c.beam);
      e.tokens.push_back(c.token);
      e.sums.push_back(c.score);
    }
  }
  return e;
}

// The buffers of a beam_step call, and its args pointing at them (the sizes and options are the caller's to set).
struct StepBuffers {
  std::vector<float> logits, sums;
  std::vector<int32_t> active, max_lens, tokens, indirection_in, indirection_out, history_tokens, history_beams;
  std::vector<int32_t> finished_count, finished_steps, finished_beams, done;
  std::vector<double> finished_scores;

  fastformer::BeamStepArgs args() {
    fastformer::BeamStepArgs a{};
    a.logits = logits.data();
    a.active = active.data();
    a.max_lens = max_lens.data();
    a.sums = sums.data();
    a.tokens = tokens.data();
    a.indirection_in = indirection_in.data();
    a.indirection_out = indirection_out.data();
    a.history_tokens = history_tokens.data();
    a.history_beams = history_beams.data();
    a.finished_count = finished_count.data();
    a.finished_scores = finished_scores.data();
    a.finished_steps = finished_steps.data();
    a.finished_beams = finished_beams.data();
    a.done = done.data();
    a.n_sentences = static_cast<int>(finished_count.size());
    a.n_active = static_cast<int>(active.size());
    return a;
  }
};

// with_scores false (beam 1 only): the greedy path, which takes the same tokens and leaves the scores uncomputed.
// forced: each sentence's forced token (BeamStepArgs::forced_tokens), or empty for none.
void test_beam_step(int beam, int vocab, int step, int min_len, int max_len,
                    fastformer::LengthPenaltyForm form = fastformer::LengthPenaltyForm::kGnmt,
                    bool with_scores = true, std::vector<int32_t> forced = {}, bool from_best = false) {
  const int n_sentences = 4, pad = 0, bos = 1, eos = 2, cache_len = step + 2;
  const int n_slots = n_sentences * beam;
  const double length_penalty = 0.6;
  // Sentence 3 is not in the rows; sentence 1 is, but done (a bucketed search's padding): both stay untouched.
  StepBuffers b;
  b.active = {2, 1, 0};
  const int n_active = int(b.active.size());
  // A few large logits make EOS and repeated beams likely, so that finishing and reordering both happen.
  b.logits = random_floats(size_t(n_active) * beam * vocab, 2.0f);
  b.sums = random_floats(n_slots, 3.0f);
  if (with_scores) {
    b.sums[2 * beam + beam - 1] = -std::numeric_limits<float>::infinity();  // an empty slot
  } else {
    b.logits[pad] = 10.0f;  // sentence 2's best token is one it may not take: the greedy path looks further
  }
  const std::vector<float> sums_before = b.sums;
  b.tokens.assign(n_slots, -7);
  b.indirection_in.resize(n_slots * cache_len);
  b.indirection_out.resize(n_slots * cache_len);
  for (int slot = 0; slot < n_slots; ++slot) {
    for (int p = 0; p < cache_len; ++p) b.indirection_in[slot * cache_len + p] = (slot + p) % beam;
  }
  b.history_tokens.assign(cache_len * n_slots, -7);
  b.history_beams.assign(cache_len * n_slots, -7);
  b.finished_count = {1, 2, 0, 0};
  b.finished_steps.assign(n_sentences * 2 * beam, -7);
  b.finished_beams.assign(n_sentences * 2 * beam, -7);
  b.done = {0, 1, 0, 0};
  b.finished_scores.assign(n_sentences * 2 * beam, 0.0);
  b.max_lens = {max_len, max_len, max_len, max_len};
  fastformer::BeamStepArgs args = b.args();
  args.vocab = vocab;
  args.beam_size = beam;
  args.cache_len = cache_len;
  args.step = &step;
  args.min_len = min_len;
  args.pad_id = pad;
  args.bos_id = bos;
  args.eos_id = eos;
  args.length_penalty = length_penalty;
  args.length_penalty_form = form;
  args.with_scores = with_scores;
  args.forced_tokens = forced.empty() ? nullptr : forced.data();
  // from_best: the step from each row's best 2 * beam allowed logits, top, log-sum-exp (in double here) and EOS's
  // logit (BeamStepArgs::best, as the int8 output projection's summary gives them), the logits unread.
  std::vector<float> best_values, tops, log_totals, eos_logits;
  std::vector<int64_t> best_ids;
  std::vector<int32_t> finite;
  fastformer::BestLogits best{};
  if (from_best) {
    const int k = 2 * beam;
    for (int r = 0; r < n_active * beam; ++r) {
      const float* row = b.logits.data() + size_t(r) * vocab;
      std::vector<int> allowed;
      for (int t = 0; t < vocab; ++t) {
        if (t != pad && t != bos && (t != eos || step >= min_len)) allowed.push_back(t);
      }
      std::stable_sort(allowed.begin(), allowed.end(), [&](int x, int y) { return row[x] > row[y]; });
      for (int i = 0; i < k; ++i) {
        best_ids.push_back(i < int(allowed.size()) ? allowed[i] : -1);
        best_values.push_back(i < int(allowed.size()) ? row[allowed[i]] : -std::numeric_limits<float>::infinity());
      }
      const float top = *std::max_element(row, row + vocab);
      double total = 0.0;
      for (int t = 0; t < vocab; ++t) total += std::exp(double(row[t]) - top);
      tops.push_back(top);
      log_totals.push_back(float(std::log(total)));
      eos_logits.push_back(row[eos]);
      finite.push_back(1);
    }
    best = {best_values.data(), best_ids.data(), k, tops.data(), log_totals.data(), eos_logits.data(), finite.data()};
    args.logits = nullptr;
    args.best = &best;
  }
  loops->beam_step(args);

  for (int untouched : {1, 3}) {
    EXPECT(b.finished_count[untouched] == (untouched == 1 ? 2 : 0) && b.done[untouched] == (untouched == 1));
    for (int j = 0; j < beam; ++j) {
      const int slot = untouched * beam + j;
      EXPECT(b.tokens[slot] == -7 && b.sums[slot] == sums_before[slot]);
      EXPECT(b.history_tokens[step * n_slots + slot] == -7);
    }
  }
  for (int a = 0; a < n_active; ++a) {
    const int s = b.active[a];
    if (s == 1) continue;
    const int already = s == 0 ? 1 : 0;
    const Expected e = brute_force_step(b.logits.data() + size_t(a) * beam * vocab, sums_before.data() + s * beam,
                                        beam, vocab, step, min_len, max_len, pad, bos, eos, length_penalty,
                                        form == fastformer::LengthPenaltyForm::kGnmt, forced.empty() ? -1 : forced[s]);
    const int n_finished = int(e.finished_scores.size());
    // The greedy path takes the best candidate only: a sentence that finishes keeps no beam (it is done either way).
    const int n_alive = with_scores ? int(e.parents.size()) : n_finished > 0 ? 0 : std::min<int>(1, e.parents.size());
    EXPECT(b.finished_count[s] == already + n_finished);
    EXPECT(b.done[s] == (already + n_finished >= beam || n_alive == 0));
    for (int i = 0; i < n_finished; ++i) {
      const double score = b.finished_scores[s * 2 * beam + already + i];
      EXPECT(with_scores ? std::fabs(score - e.finished_scores[i]) < 1e-4 : std::isnan(score));
      EXPECT(b.finished_beams[s * 2 * beam + already + i] == e.finished_beams[i]);
      EXPECT(b.finished_steps[s * 2 * beam + already + i] == step);
    }
    for (int j = 0; j < beam; ++j) {
      const int slot = s * beam + j;
      const int32_t* indirection = b.indirection_out.data() + slot * cache_len;
      if (j < n_alive) {
        EXPECT(b.tokens[slot] == e.tokens[j]);
        EXPECT(!with_scores || std::fabs(b.sums[slot] - e.sums[j]) < 1e-4);
        EXPECT(b.history_tokens[step * n_slots + slot] == e.tokens[j]);
        EXPECT(b.history_beams[step * n_slots + slot] == e.parents[j]);
        const int parent = s * beam + e.parents[j];
        for (int p = 0; p <= step; ++p) EXPECT(indirection[p] == b.indirection_in[parent * cache_len + p]);
      } else {
        EXPECT(!with_scores || (std::isinf(b.sums[slot]) && b.sums[slot] < 0));
        EXPECT(b.history_tokens[step * n_slots + slot] == -1);
      }
      EXPECT(indirection[step + 1] == j);
    }
  }
}

// The greedy path on a row holding NaN or inf: no hypothesis (the search then says the scores are not finite).
void test_greedy_step_on_a_non_finite_row() {
  for (float poison : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    const int vocab = 37, step = 2, cache_len = 4;
    StepBuffers b;
    b.logits = random_floats(vocab);
    b.logits[vocab - 3] = poison;
    b.sums = {0.0f};
    b.active = {0};
    b.max_lens = {10};
    b.tokens = {-7};
    b.indirection_in.assign(cache_len, 0);
    b.indirection_out.assign(cache_len, 0);
    b.history_tokens.assign(cache_len, -7);
    b.history_beams.assign(cache_len, -7);
    b.finished_count = {0};
    b.finished_steps = {-7, -7};
    b.finished_beams = {-7, -7};
    b.done = {0};
    b.finished_scores = {0.0, 0.0};
    fastformer::BeamStepArgs args = b.args();
    args.vocab = vocab;
    args.beam_size = 1;
    args.cache_len = cache_len;
    args.step = &step;
    args.eos_id = 2;
    args.bos_id = 1;
    loops->beam_step(args);
    EXPECT(b.done[0] == 1 && b.finished_count[0] == 0 && b.history_tokens[step] == -1);
  }
}

// row_absmax_cpu against a scalar loop: widths around the vector width and four of them (the blocks of four chains,
// the single vectors, the tail), negative maxima, and rows holding NaN or inf (anywhere) or only zeros.
void test_row_absmax() {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (int width : {1, 7, 8, 9, 15, 16, 17, 37, 64, 65, 100, 512}) {
    const int rows = 6;
    std::vector<float> x = random_floats(static_cast<size_t>(rows) * width);
    x[0 * width + width - 1] = -50.0f;      // row 0: its maximum is negative, and in the tail when width % 8 != 0
    x[1 * width + width / 2] = nan;         // row 1: NaN
    x[2 * width + width - 1] = -inf;        // row 2: -inf, last
    std::fill(x.begin() + 3 * width, x.begin() + 4 * width, 0.0f);  // row 3: zeros
    std::vector<float> absmax(rows, -1.0f);
    loops->row_absmax(x.data(), rows, width, absmax.data());
    for (int r = 0; r < rows; ++r) {
      float expected = 0.0f;
      bool finite = true;
      for (int i = 0; i < width; ++i) {
        finite &= std::isfinite(x[r * width + i]);
        expected = std::max(expected, std::abs(x[r * width + i]));
      }
      if (finite) {
        EXPECT(absmax[r] == expected);
      } else {
        EXPECT(std::isnan(absmax[r]));
      }
    }
    EXPECT(absmax[0] == 50.0f && std::isnan(absmax[1]) && std::isnan(absmax[2]) && absmax[3] == 0.0f);
  }
}

// The float16 nearest to x (ties to the even significand), widened back: worked out from x's exponent, not by a
// conversion instruction. Float16 holds 11 significant bits down to 2^-14, then steps of 2^-24; |x| past 65504
// rounds to infinity from 65520 on (the midpoint to the next step, 65536, which is out of range).
float nearest_float16(float x) {
  if (!std::isfinite(x) || x == 0.0f) return x;
  int exponent = 0;
  std::frexp(x, &exponent);  // |x| in [2^(exponent - 1), 2^exponent)
  const double step = std::ldexp(1.0, std::max(exponent - 1, -14) - 10);
  const double rounded = std::nearbyint(double(x) / step) * step;  // the default rounding: to nearest, ties to even
  if (std::abs(rounded) > 65504.0) return std::copysign(std::numeric_limits<float>::infinity(), x);
  return static_cast<float>(rounded);
}

// round_to_float16_cpu against nearest_float16: widths around the vector width, rows with a stride (the floats
// between them stay as they were), values at several scales (subnormal float16s, ones near the largest), exact ties,
// overflow, NaN and infinities.
void test_round_to_float16() {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const std::vector<float> special = {1.0f + 0x1p-11f,  1.0f + 3 * 0x1p-11f, -(2.0f + 0x1p-10f), 0x1p-25f,
                                      3 * 0x1p-26f,     65504.0f,            65519.0f,           65520.0f,
                                      -70000.0f,        nan,                 inf,                -inf,
                                      -0.0f,            0x1p-15f + 0x1p-25f};
  for (int width : {1, 7, 8, 9, 16, 17, 37, 64, 100}) {
    const int rows = 4, stride = width + 3;
    for (float scale : {1.0f, 1e-5f, 3e4f}) {
      std::vector<float> x = random_floats(static_cast<size_t>(rows) * stride, scale);
      for (size_t i = 0; i < special.size() && i < static_cast<size_t>(width); ++i) x[stride + i] = special[i];
      const std::vector<float> before = x;
      loops->round_to_float16(x.data(), rows, width, stride);
      for (int r = 0; r < rows; ++r) {
        for (int i = 0; i < stride; ++i) {
          const float was = before[r * stride + i], now = x[r * stride + i];
          const float expected = i < width ? nearest_float16(was) : was;
          EXPECT((std::isnan(expected) && std::isnan(now)) ||
                 (now == expected && std::signbit(now) == std::signbit(expected)));
        }
      }
    }
  }
  EXPECT(nearest_float16(1.0f + 0x1p-11f) == 1.0f && nearest_float16(1.0f + 3 * 0x1p-11f) == 1.0f + 0x1p-9f);
  EXPECT(nearest_float16(65519.0f) == 65504.0f && nearest_float16(65520.0f) == inf);
  EXPECT(nearest_float16(0x1p-25f) == 0.0f && nearest_float16(3 * 0x1p-26f) == 0x1p-24f);
}

// add_layer_norm_cpu against LayerNorm in double precision: widths around the vector width and four of them, with
// and without the residual, written elsewhere and in place; a row far from zero (mean 1000, deviations ~1: where a
// one-pass variance would cancel), a constant row (variance 0: the bias alone) and a row holding NaN (NaN out).
void test_add_layer_norm() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int width : {1, 7, 8, 9, 17, 37, 64, 65, 100, 512}) {
    const int rows = 5;
    const float eps = 1e-5f;
    std::vector<float> x = random_floats(static_cast<size_t>(rows) * width), residual = random_floats(x.size());
    const std::vector<float> gamma = random_floats(width), beta = random_floats(width);
    for (int i = 0; i < width; ++i) x[1 * width + i] += 1000.0f;                      // row 1: far from zero
    std::fill(x.begin() + 2 * width, x.begin() + 3 * width, 3.0f);                     // row 2: constant (with
    std::fill(residual.begin() + 2 * width, residual.begin() + 3 * width, 0.5f);      // its residual too)
    x[3 * width + width / 2] = nan;                                                    // row 3: NaN
    for (bool with_residual : {false, true}) {
      for (bool in_place : {false, true}) {
        std::vector<float> out = in_place ? x : std::vector<float>(x.size(), -7.0f);
        loops->add_layer_norm(in_place ? out.data() : x.data(), with_residual ? residual.data() : nullptr, rows,
                              width, gamma.data(), beta.data(), eps, out.data());
        for (int r = 0; r < rows; ++r) {
          std::vector<double> sum(width);
          double mean = 0.0, variance = 0.0;
          for (int i = 0; i < width; ++i) {
            sum[i] = static_cast<double>(x[r * width + i]) + (with_residual ? residual[r * width + i] : 0.0);
            mean += sum[i] / width;
          }
          for (int i = 0; i < width; ++i) variance += (sum[i] - mean) * (sum[i] - mean) / width;
          for (int i = 0; i < width; ++i) {
            const double expected = (sum[i] - mean) / std::sqrt(variance + eps) * gamma[i] + beta[i];
            const float got = out[r * width + i];
            if (r == 3) {
              EXPECT(std::isnan(got));
            } else {
              // float32 sums of up to 512 terms (a row far from zero loses the bits its mean of 1000 holds)
              const double tolerance = (r == 1 ? 2e-3 : 2e-5) * (1.0 + std::abs(expected));
              EXPECT(std::abs(got - expected) <= tolerance);
            }
          }
        }
      }
    }
  }
}

// clamped_scale_cpu and scale_and_add_cpu against scalar loops, at widths around the vector width.
void test_row_scaling() {
  for (int width : {1, 7, 8, 9, 15, 16, 17, 37}) {
    const std::vector<float> x = random_floats(width), bias = random_floats(width);
    std::vector<float> clamped(width, 5.0f);
    loops->clamped_scale(x.data(), width, 3.0f, clamped.data());
    for (int i = 0; i < width; ++i) EXPECT(clamped[i] == std::clamp(x[i] * 3.0f, -1.0f, 1.0f));
    for (const float* b : {static_cast<const float*>(nullptr), bias.data()}) {
      std::vector<float> y = x;
      loops->scale_and_add(y.data(), width, 0.75f, b);
      // A fused multiply-add may round once where the loop rounds twice.
      for (int i = 0; i < width; ++i) EXPECT(std::abs(y[i] - (x[i] * 0.75f + (b ? b[i] : 0.0f))) <= 1e-6f);
    }
  }
}

// target_log_probs_cpu against log_softmax in double precision: widths around the vector width, the target first,
// last and in between, and rows holding NaN, inf or -inf (NaN out, where a clamped exponential would hide them).
void test_target_log_probs() {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (int width : {1, 7, 8, 9, 15, 16, 17, 37, 300}) {
    const int rows = 6;
    std::vector<float> x = random_floats(static_cast<size_t>(rows) * width, 20.0f);  // the largest dominate the sum
    const std::vector<int64_t> targets = {0, width - 1, width / 2, 0, width - 1, width / 3};
    x[3 * width + width - 1] = nan;  // row 3: NaN, last (in the tail when width % 8 != 0)
    x[4 * width] = inf;              // row 4: inf, first
    x[5 * width + width / 2] = -inf;  // row 5: -inf
    std::vector<float> out(rows, 1.0f);
    loops->target_log_probs(x.data(), rows, width, targets.data(), out.data());
    for (int r = 0; r < 3; ++r) {
      const float* row = x.data() + static_cast<size_t>(r) * width;
      const double top = *std::max_element(row, row + width);
      double total = 0.0;
      for (int i = 0; i < width; ++i) total += std::exp(static_cast<double>(row[i]) - top);
      const double expected = (row[targets[r]] - top) - std::log(total);
      EXPECT(std::abs(out[r] - expected) <= 2e-5 * std::max(1.0, std::abs(expected)));
    }
    EXPECT(std::isnan(out[3]) && std::isnan(out[4]) && std::isnan(out[5]));
  }
}

// top_k_row_cpu against sorting the allowed finite floats (and its log-softmax terms against double sums): widths
// around the vector width and its blocks of 8, k from 1 to past the candidates, ties (to the lower id), excluded
// ids, NaN and -inf (never taken), a row of -inf only.
void test_top_k_row() {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const std::vector<int64_t> excluded = {0, 2};
  for (int width : {1, 7, 8, 9, 16, 17, 37, 300}) {
    std::vector<float> row = random_floats(width);
    for (int i = 0; i < width; i += 5) row[i] = std::round(row[i] * 2.0f);  // ties
    if (width > 3) row[3] = nan;
    if (width > 4) row[4] = -inf;
    for (int64_t k : {1, 2, 4, 10, 64}) {
      for (const auto [all_minus_inf, with_totals] : {std::pair{false, false}, std::pair{false, true},
                                                      std::pair{true, false}, std::pair{true, true}}) {
        std::vector<float> x = all_minus_inf ? std::vector<float>(width, -inf) : row;
        if (with_totals && width % 2 == 0 && !all_minus_inf && width > 3) x[3] = 0.0f;  // a finite log_total
        std::vector<std::pair<float, int64_t>> allowed;
        for (int t = 0; t < width; ++t) {
          if (x[t] > -inf && t != 0 && t != 2) allowed.push_back({-x[t], t});  // NaN > -inf is false
        }
        std::sort(allowed.begin(), allowed.end());
        std::vector<float> values(k, 5.0f);
        std::vector<int64_t> ids(k, 5);
        float top = 5.0f, log_total = 5.0f;
        loops->top_k_row(x.data(), width, k, excluded.data(), 2, 7, values.data(), ids.data(),
                         with_totals ? &top : nullptr, &log_total);
        for (int64_t i = 0; i < k; ++i) {
          if (i < static_cast<int64_t>(allowed.size())) {
            EXPECT(values[i] == -allowed[i].first && ids[i] == allowed[i].second);
          } else {
            EXPECT(values[i] == -inf && ids[i] == 7);
          }
        }
        if (!with_totals) {
          EXPECT(top == 5.0f && log_total == 5.0f);
          continue;
        }
        // log_softmax's terms over every float (the excluded too), in double: NaN where the row holds NaN.
        double expected_top = -inf, total = 0.0;
        for (float value : x) expected_top = std::max(expected_top, double(value));
        for (float value : x) total += value > -inf ? std::exp(double(value) - expected_top) : 0.0;
        const bool has_nan = std::any_of(x.begin(), x.end(), [](float value) { return std::isnan(value); });
        if (has_nan || all_minus_inf) {
          EXPECT(std::isnan(log_total));
        } else {
          EXPECT(top == expected_top && std::fabs(log_total - std::log(total)) < 1e-5);
        }
      }
    }
  }
}

}  // namespace

// A GEMM's summaries (gemm_summary.h) of its outputs y [rows, out] (as it computes them, without ReLU; checked
// against brute force by the caller), made by summarize(first_panel, end_panel, summary); finite_rows: the rows
// whose outputs are all finite.
void check_gemm_summaries(
    const std::vector<float>& y, int rows, int out, int64_t half, const std::vector<bool>& finite_rows,
    const std::function<void(int64_t, int64_t, const fastformer::GemmSummary&)>& summarize) {
  const int64_t n_panels = (out + 15) / 16;
  // Each row's k highest outputs of y outside barred, best first, ties to the
  // lower id, -inf and -1 past the allowed ones; its top and log-sum-exp over every output (barred ones too) against
  // double sums; the output at a picked id of each row; the NaN row not finite.
  // Over all panels at once, and (split) over two halves of them merged by merge_gemm_summaries, as threads split
  // the panels of a few rows.
  const std::vector<int64_t> barred{0, out - 1, 20};
  // k 16 and 17: the most the AVX-512 tiles rank in vectors, and one more.
  for (auto [k, split] : {std::pair{0, false}, std::pair{1, false}, std::pair{5, false}, std::pair{16, false},
                          std::pair{17, false}, std::pair{0, true}, std::pair{1, true}, std::pair{5, true},
                          std::pair{16, true}}) {
    if (split && half == 0) continue;
    struct Arrays {
      std::vector<float> values, tops, log_totals, picked;
      std::vector<int64_t> ids;
      std::vector<int32_t> finite;
    };
    std::vector<int64_t> picked_ids(rows);
    for (int r = 0; r < rows; ++r) picked_ids[r] = (7 * r + k) % out;
    auto summary_of = [&](Arrays& a) {
      a = {std::vector<float>(rows * k), std::vector<float>(rows), std::vector<float>(rows), std::vector<float>(rows),
           std::vector<int64_t>(rows * k), std::vector<int32_t>(rows)};
      fastformer::GemmSummary summary;
      summary.k = k;
      summary.barred = barred.data();
      summary.n_barred = static_cast<int>(barred.size());
      summary.values = a.values.data();
      summary.ids = a.ids.data();
      summary.finite = a.finite.data();
      if (k != 1) {  // k 1 as a greedy search asks: best and finite only
        summary.tops = a.tops.data();
        summary.log_totals = a.log_totals.data();
        summary.picked_ids = picked_ids.data();
        summary.picked = a.picked.data();
      }
      return summary;
    };
    Arrays whole, halves[2];
    const fastformer::GemmSummary summary = summary_of(whole);
    if (split) {
      const fastformer::GemmSummary parts[2] = {summary_of(halves[0]), summary_of(halves[1])};
      summarize(0, half, parts[0]);
      summarize(half, n_panels, parts[1]);
      fastformer::merge_gemm_summaries(parts, 2, rows, summary);
    } else {
      summarize(0, n_panels, summary);
    }
    const auto& [values, tops, log_totals, picked, ids, finite] = whole;
    for (int r = 0; r < rows; ++r) {
      EXPECT(finite[r] == finite_rows[r]);
      if (!finite[r]) continue;
      const float* row_y = y.data() + r * out;
      std::vector<int64_t> expected;
      for (int o = 0; o < out; ++o) {
        if (std::find(barred.begin(), barred.end(), o) == barred.end()) expected.push_back(o);
      }
      std::stable_sort(expected.begin(), expected.end(), [&](int64_t a, int64_t b) { return row_y[a] > row_y[b]; });
      for (int i = 0; i < k; ++i) {
        const bool kept = i < static_cast<int>(expected.size());
        EXPECT(ids[r * k + i] == (kept ? expected[i] : -1));
        EXPECT(values[r * k + i] == (kept ? row_y[expected[i]] : -std::numeric_limits<float>::infinity()));
      }
      if (k == 1) continue;
      const float top = *std::max_element(row_y, row_y + out);
      double total = 0.0;
      for (int o = 0; o < out; ++o) total += std::exp(double(row_y[o]) - top);
      EXPECT(tops[r] == top);
      EXPECT(std::fabs(log_totals[r] - std::log(total)) < 1e-5 * (1.0 + std::log(total)));
      EXPECT(picked[r] == row_y[picked_ids[r]]);
    }
  }
}

// float32_gemm.h's GEMMs against a double product: rows and out around the tiles (6 rows by a panel of 16, or by 4),
// a row holding NaN; with and without bias and ReLU. Each row alone equals its row in the batch, and every GEMM's
// outputs equal the first's, bitwise: one chain of sums per output. The summaries of those that have them.
void test_float32_gemms(const std::vector<const fastformer::Float32Gemm*>& gemms, int rows, int out, int in,
                        bool with_bias, bool relu) {
  std::vector<float> x = random_floats(rows * in), weight = random_floats(out * in), bias = random_floats(out);
  if (rows > 2) x[in] = std::numeric_limits<float>::quiet_NaN();  // row 1
  const int64_t n_panels = fastformer::gemm_panel_count(out);
  std::vector<float> panels(n_panels * in * 16);
  fastformer::float32_pack_panels(weight.data(), out, in, panels.data());
  std::vector<float> padded_bias(n_panels * 16, 0.0f);
  std::copy(bias.begin(), bias.end(), padded_bias.begin());
  const float* b = with_bias ? padded_bias.data() : nullptr;
  auto packed = [&](const float* first_row, int n_rows) {
    std::vector<float> packed_rows(fastformer::float32_row_tiles(n_rows) * in * 6, -1.0f);
    fastformer::float32_pack_rows(first_row, n_rows, in, packed_rows.data());
    return packed_rows;
  };
  auto same_bits = [](float a, float b) { return std::isnan(a) ? std::isnan(b) : a == b; };
  const std::vector<float> packed_rows = packed(x.data(), rows);
  std::vector<float> first_y;
  for (const fastformer::Float32Gemm* gemm : gemms) {
    // Two calls over the panels, as two threads would split them (at a multiple of the tile's panels).
    std::vector<float> y(rows * out, -1.0f);
    const int64_t half = n_panels / 2 / gemm->tile_panels * gemm->tile_panels;
    for (auto [first, end] : {std::pair{int64_t{0}, half}, std::pair{half, n_panels}}) {
      gemm->gemm(packed_rows.data(), rows, in, panels.data(), b, relu, out, first, end, y.data());
    }
    if (first_y.empty()) first_y = y;
    for (int r = 0; r < rows; ++r) {
      std::vector<float> alone(out, -1.0f);
      gemm->gemm(packed(x.data() + r * in, 1).data(), 1, in, panels.data(), b, relu, out, 0, n_panels, alone.data());
      bool same = true;
      for (int o = 0; o < out; ++o) {
        const float got = y[r * out + o];
        same = same && same_bits(got, alone[o]) && same_bits(got, first_y[r * out + o]);
        double expected = with_bias ? bias[o] : 0.0, magnitude = std::fabs(expected);
        for (int i = 0; i < in; ++i) {
          expected += double(x[r * in + i]) * weight[o * in + i];
          magnitude += std::fabs(double(x[r * in + i]) * weight[o * in + i]);
        }
        if (relu) expected = std::max(expected, 0.0);
        if (rows > 2 && r == 1) {
          EXPECT(std::isnan(got));
        } else if (std::fabs(got - expected) > 1e-6 * (1.0 + magnitude)) {
          std::fprintf(stderr, "%s float32 GEMM rows=%d out=%d in=%d: y[%d, %d] = %g, expected %g\n", gemm->isa,
                       rows, out, in, r, o, got, expected);
          EXPECT(false);
          return;
        }
      }
      EXPECT(same);
    }
    if (relu || !gemm->gemm_summary) continue;  // a summary is of the outputs before any activation
    std::vector<bool> finite_rows(rows, true);
    if (rows > 2) finite_rows[1] = false;
    check_gemm_summaries(y, rows, out, half, finite_rows,
                         [&](int64_t first_panel, int64_t end_panel, const fastformer::GemmSummary& summary) {
                           gemm->gemm_summary(packed_rows.data(), rows, in, panels.data(), b, out, first_panel,
                                              end_panel, summary);
                         });
  }
}

// An int8_gemm.h GEMM against brute force: the quantized rows against the formula of linear.h, the outputs against
// a double product of those rows with the weights (in the GEMM's [-weight_max, weight_max]). rows and out around the
// tiles (AVX512-VNNI's 6 rows by 4 panels of 16, AVX2's 4 rows by 1), in around a group of 4 inputs and AVX2's pairs
// of groups; a row holding NaN and an all-zero row; with and without bias and ReLU. extreme: every weight at
// +-weight_max (by output) and every input 1, the largest sums the tiles add in int16 (AVX2's: 4 * 127 * 64).
void test_int8_gemm(const fastformer::Int8Gemm& gemm, int rows, int out, int in, bool with_bias, bool relu,
                    bool extreme = false) {
  std::uniform_int_distribution<int> weight_values(-gemm.weight_max, gemm.weight_max);
  std::vector<int8_t> weight(out * in);
  for (int8_t& w : weight) w = static_cast<int8_t>(weight_values(rng));
  std::vector<float> x = random_floats(rows * in), w_scales = random_floats(out, 0.01f), bias = random_floats(out);
  if (extreme) {
    for (int o = 0; o < out; ++o) std::fill_n(weight.begin() + o * in, in, o % 2 ? -gemm.weight_max : gemm.weight_max);
    std::fill(x.begin(), x.end(), 1.0f);
  }
  if (rows > 2) {
    x[in] = std::numeric_limits<float>::quiet_NaN();  // row 1
    std::fill(x.begin() + 2 * in, x.begin() + 3 * in, 0.0f);  // row 2
  }
  const int64_t n_panels = fastformer::gemm_panel_count(out), row_bytes = fastformer::int8_input_groups(in) * 4;
  std::vector<int8_t> panels(fastformer::int8_packed_bytes(out, in, gemm.tile_panels));
  std::vector<int32_t> offsets(n_panels * 16);
  fastformer::int8_pack_panels(weight.data(), out, in, gemm.zero_point, gemm.tile_panels, panels.data(),
                               offsets.data());
  // Each row's scale and inverse as linear.cpp's row_scales makes them (absmax / levels: 127 for 8-bit rows, 63 for
  // 7-bit; NaN with inverse 0 for a non-finite row, 1 with inverse 0 for a zero row), the row quantized by the GEMM's
  // quantize_row.
  const int zero_point = gemm.zero_point;
  const float levels = static_cast<float>(zero_point - 1);
  std::vector<uint8_t> x_q(rows * row_bytes);
  std::vector<float> x_scales(rows), absmaxes(rows, 0.0f);
  std::vector<bool> finites(rows, true);
  for (int r = 0; r < rows; ++r) {
    const float* row = x.data() + r * in;
    for (int i = 0; i < in; ++i) {
      absmaxes[r] = std::max(absmaxes[r], std::fabs(row[i]));
      finites[r] = finites[r] && std::isfinite(row[i]);
    }
    const bool usable = finites[r] && absmaxes[r] > 0.0f;
    x_scales[r] = !finites[r] ? std::numeric_limits<float>::quiet_NaN() : usable ? absmaxes[r] / levels : 1.0f;
    gemm.quantize_row(row, in, usable ? levels / absmaxes[r] : 0.0f, x_q.data() + r * row_bytes);
  }
  std::vector<float> padded_scales(n_panels * 16, 0.0f), padded_bias(n_panels * 16, 0.0f);
  std::copy(w_scales.begin(), w_scales.end(), padded_scales.begin());
  std::copy(bias.begin(), bias.end(), padded_bias.begin());
  std::vector<float> y(rows * out, -1.0f);
  // Two calls over the panels, as two threads would split them: at a whole block of the GEMM's tiles.
  const int64_t half = n_panels / 2 / gemm.tile_panels * gemm.tile_panels;
  for (auto [first, end] : {std::pair{int64_t{0}, half}, std::pair{half, n_panels}}) {
    fastformer::int8_gemm(gemm, x_q.data(), x_scales.data(), rows, in, panels.data(), offsets.data(),
                          padded_scales.data(), with_bias ? padded_bias.data() : nullptr, relu, out, first, end,
                          y.data());
  }
  if (gemm.fewer_rows) {  // the GEMM of fewer rows (AMX's: AVX512-VNNI's) gives the same outputs, bit for bit
    std::vector<float> y_fewer(rows * out, -1.0f);
    for (auto [first, end] : {std::pair{int64_t{0}, half}, std::pair{half, n_panels}}) {
      fastformer::int8_gemm(*gemm.fewer_rows, x_q.data(), x_scales.data(), rows, in, panels.data(), offsets.data(),
                            padded_scales.data(), with_bias ? padded_bias.data() : nullptr, relu, out, first, end,
                            y_fewer.data());
    }
    EXPECT(std::memcmp(y.data(), y_fewer.data(), y.size() * sizeof(float)) == 0);
  }
  for (int r = 0; r < rows; ++r) {
    const float* row = x.data() + r * in;
    const float absmax = absmaxes[r];
    const bool finite = finites[r], usable = finite && absmax > 0.0f;
    bool rows_equal = true;
    for (int i = 0; i < row_bytes; ++i) {
      const int expected =
          usable && i < in ? static_cast<int>(std::nearbyint(row[i] * (levels / absmax))) + zero_point : zero_point;
      rows_equal = rows_equal && x_q[r * row_bytes + i] == expected;
    }
    EXPECT(rows_equal);
    for (int o = 0; o < out; ++o) {
      int64_t dot = 0;
      for (int i = 0; i < in; ++i) dot += (int64_t{x_q[r * row_bytes + i]} - zero_point) * weight[o * in + i];
      double expected = double(dot) * w_scales[o] * x_scales[r] + (with_bias ? bias[o] : 0.0);
      if (relu) expected = std::max(expected, 0.0);
      const float got = y[r * out + o];
      if (!finite) {
        EXPECT(std::isnan(got));
      } else if (std::fabs(got - expected) > 1e-5 * (1.0 + std::fabs(expected))) {
        std::fprintf(stderr, "int8_gemm %s rows=%d out=%d in=%d: y[%d, %d] = %g, expected %g\n", gemm.isa, rows, out,
                     in, r, o, got, expected);
        EXPECT(false);
        return;
      }
    }
  }
  if (relu) return;  // gemm_summary summarizes the outputs before any activation
  std::vector<bool> finite_rows(rows);
  for (int r = 0; r < rows; ++r) finite_rows[r] = !std::isnan(x_scales[r]);
  check_gemm_summaries(y, rows, out, half, finite_rows,
                       [&](int64_t first_panel, int64_t end_panel, const fastformer::GemmSummary& summary) {
                         fastformer::int8_gemm_summary(gemm, x_q.data(), x_scales.data(), rows, in, panels.data(),
                                                       offsets.data(), padded_scales.data(),
                                                       with_bias ? padded_bias.data() : nullptr, out, first_panel,
                                                       end_panel, summary);
                       });
}

int main() {
  // Every float32 GEMM this CPU runs, whatever FASTFORMER_CPU_ISA says.
  const std::vector<const fastformer::Float32Gemm*> float32_gemms = fastformer::float32_gemms();
  if (!float32_gemms.empty()) {
    for (int rows : {1, 2, 5, 6, 7, 13, 32}) {  // tiles of every size from 1 to 6 rows
      for (int out : {1, 8, 9, 16, 17, 40, 70, 130}) {  // 1, 2, 3, 5 and 9 panels
        for (int in : {1, 7, 64}) test_float32_gemms(float32_gemms, rows, out, in, out % 2 == 0, /*relu=*/in == 7);
      }
    }
    // 2048 inputs, the rows' tiles in two chunks (a full one and one tile)
    test_float32_gemms(float32_gemms, static_cast<int>(6 * (fastformer::float32_chunk_tiles(2048) + 1)), 17, 2048,
                       true, false);
    for (const fastformer::Float32Gemm* gemm : float32_gemms) std::printf("%s float32 GEMM checked\n", gemm->isa);
  }
  if (float32_gemms.empty()) std::printf("no float32 GEMM checked: this CPU has no AVX2 and FMA\n");
  // Every int8 GEMM this CPU runs, whatever FASTFORMER_CPU_ISA says (it picks the one linear layers take).
  std::string int8_checked;
  for (const fastformer::Int8Gemm* gemm : fastformer::int8_gemms()) {
    for (int rows : {1, 2, 3, 4, 5, 6, 7, 8, 13}) {  // tiles of every size from 1 to 6 rows
      for (int out : {1, 8, 9, 16, 17, 64, 70, 130}) {
        for (int in : {1, 4, 20, 37, 64}) {
          test_int8_gemm(*gemm, rows, out, in, /*with_bias=*/out % 2 == 0, /*relu=*/in == 37);
        }
      }
    }
    // AMX's tiles (from its min_rows on): one block of rows and two, whole steps of 64 inputs and groups past them
    for (int rows : {16, 17, 31, 33, 45}) {
      for (int out : {9, 64, 70, 130}) {
        for (int in : {20, 64, 100, 192}) test_int8_gemm(*gemm, rows, out, in, out % 2 == 0, /*relu=*/out == 70);
      }
    }
    for (int in : {8, 20, 512}) test_int8_gemm(*gemm, 5, 33, in, true, false, /*extreme=*/true);
    test_int8_gemm(*gemm, 40, 33, 512, true, false, /*extreme=*/true);
    int8_checked += std::string(int8_checked.empty() ? "" : ", ") + gemm->isa;
  }
  std::printf("int8 GEMMs checked: %s\n",
              int8_checked.empty() ? "none (no AVX2 or AVX512-VNNI)" : int8_checked.c_str());
  std::string tested;
  for (const fastformer::CpuLoops* isa : fastformer::cpu_isas()) {
    loops = isa;
    const int failures_before = failures;
    test_row_absmax();
    test_round_to_float16();
    test_add_layer_norm();
    test_row_scaling();
    test_target_log_probs();
    test_top_k_row();
    for (int head_dim : {4, 8, 64}) {
      for (size_t cache_offset : {0, 1}) test_self_attention_step(head_dim, cache_offset);
      for (bool half : {false, true}) test_cross_attention(head_dim, half);
      test_encoder_self_attention(head_dim);
    }
    for (int head_dim : {12, 64}) {  // 12: not whole vectors
      for (bool causal : {false, true}) test_block_attention(head_dim, causal);
    }
    for (int beam : {1, 2, 4, 5}) {
      for (bool from_best : {false, true}) {  // from the logits, or from each row's best (BeamStepArgs::best)
        auto check = [&](int vocab, int step, int min_len, int max_len,
                         fastformer::LengthPenaltyForm form = fastformer::LengthPenaltyForm::kGnmt) {
          test_beam_step(beam, vocab, step, min_len, max_len, form, true, {}, from_best);
        };
        check(9, 3, 1, 10);   // EOS allowed
        check(9, 3, 5, 10);   // EOS barred (min_len)
        check(9, 3, 1, 3);    // EOS forced (max_len)
        check(40, 0, 0, 10);  // a larger vocabulary, the first step
        check(300, 3, 1, 10);  // blocks of 8 vectors that the search may pass over, and a tail
        check(9, 3, 1, 10, fastformer::LengthPenaltyForm::kLength);
        check(9, 3, 1, 3, fastformer::LengthPenaltyForm::kLength);
      }
    }
    for (int vocab : {9, 40, 300}) {  // the greedy path, around the vector width
      for (auto [min_len, max_len] : {std::pair{1, 10}, std::pair{5, 10}, std::pair{1, 3}}) {
        test_beam_step(1, vocab, 3, min_len, max_len, fastformer::LengthPenaltyForm::kGnmt, /*with_scores=*/false);
      }
    }
    // Forced tokens (a target prefix's, or sampling's draw): an ordinary token, none, EOS before min_len; each
    // loses to EOS forced at max_len.
    for (const std::vector<int32_t>& forced : {std::vector<int32_t>{5, 7, -1, 7}, std::vector<int32_t>{-1, 7, 2, 7}}) {
      for (int beam : {1, 2, 4}) {
        for (auto [vocab, min_len, max_len] : {std::tuple{9, 1, 10}, std::tuple{300, 5, 10}, std::tuple{40, 1, 3}}) {
          test_beam_step(beam, vocab, 3, min_len, max_len, fastformer::LengthPenaltyForm::kGnmt, true, forced);
          if (beam == 1) {
            test_beam_step(1, vocab, 3, min_len, max_len, fastformer::LengthPenaltyForm::kGnmt, false, forced);
          }
        }
      }
    }
    test_greedy_step_on_a_non_finite_row();
    if (failures > failures_before) {
      std::fprintf(stderr, "in the %s loops: %d failed\n", isa->isa, failures - failures_before);
    }
    tested += std::string(tested.empty() ? "" : ", ") + isa->isa;
  }
  if (failures) {
    std::fprintf(stderr, "%d check(s) failed\n", failures);
    return EXIT_FAILURE;
  }
  std::printf("all CPU op checks passed, in the loops of: %s (the chosen ones: %s)\n", tested.c_str(),
              fastformer::cpu_loops().isa);
  return EXIT_SUCCESS;
}
