// The incremental decoder, the beam-search loop, and the ATen wrappers of the fused ops (see decoder.h).
#include "decoder.h"

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "beam_ops.h"

#ifdef FASTFORMER_WITH_CUDA
#include <c10/cuda/CUDAStream.h>

#include "beam_ops_cuda.h"
#endif

namespace fastformer {
namespace {

void check_int32(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.device() == device, name, " is on ", t.device(), ", expected ", device);
}

void check_like(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must have dtype ", like.scalar_type(), ", got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == like.device(), name, " is on ", t.device(), ", expected ", like.device());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_cpu_float(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, " on the CPU takes float32 tensors, got ", t.scalar_type());
}

#ifdef FASTFORMER_WITH_CUDA
DType cuda_dtype(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, op, " takes float32, float16 or bfloat16 tensors, got ", t.scalar_type());
  }
}

void check_launch(cudaError_t error, const char* op) {
  TORCH_CHECK(error == cudaSuccess, op, " failed to launch: ", cudaGetErrorString(error));
}
#endif

}  // namespace

at::Tensor self_attention_step(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& indirection, const at::Tensor& row_slots, int64_t beam_size,
                               int64_t step) {
  TORCH_CHECK(k_cache.dim() == 4, "k_cache must be [n_slots, heads, cache_len, head_dim], got ", k_cache.sizes());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache must have k_cache's shape ", k_cache.sizes());
  const int64_t n_slots = k_cache.size(0), heads = k_cache.size(1), cache_len = k_cache.size(2);
  const int64_t head_dim = k_cache.size(3), n_rows = row_slots.numel();
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(0) == n_rows && qkv.size(1) == 3 * heads * head_dim,
              "qkv must be [n_rows=", n_rows, ", ", 3 * heads * head_dim, "], got ", qkv.sizes());
  TORCH_CHECK(indirection.dim() == 2 && indirection.size(0) == n_slots && indirection.size(1) == cache_len,
              "indirection must be [", n_slots, ", ", cache_len, "], got ", indirection.sizes());
  TORCH_CHECK(beam_size >= 1 && n_slots % beam_size == 0, "beam_size must divide n_slots=", n_slots);
  TORCH_CHECK(step >= 0 && step < cache_len, "step must be in [0, cache_len=", cache_len, "), got ", step);
  check_like(qkv, k_cache, "qkv");
  check_like(v_cache, k_cache, "v_cache");
  check_int32(indirection, "indirection", qkv.device());
  check_int32(row_slots, "row_slots", qkv.device());
  at::Tensor out = at::empty({n_rows, heads * head_dim}, qkv.options());
  const SelfAttentionArgs args{qkv.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                               indirection.data_ptr<int32_t>(), row_slots.data_ptr<int32_t>(), out.data_ptr(),
                               static_cast<int>(n_rows), static_cast<int>(heads), static_cast<int>(head_dim),
                               static_cast<int>(cache_len), static_cast<int>(beam_size), static_cast<int>(step)};
  if (qkv.is_cuda()) {
#ifdef FASTFORMER_WITH_CUDA
    c10::DeviceGuard guard(qkv.device());
    check_launch(self_attention_step_cuda(args, cuda_dtype(qkv, "self_attention_step"),
                                          c10::cuda::getCurrentCUDAStream().stream()),
                 "self_attention_step");
#else
    TORCH_CHECK(false, "fastformer._C was built without CUDA");
#endif
  } else {
    check_cpu_float(qkv, "self_attention_step");
    self_attention_step_cpu(args);
  }
  return out;
}

at::Tensor cross_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& src_lengths, const at::Tensor& row_slots, int64_t beam_size) {
  TORCH_CHECK(k.dim() == 4, "k must be [n_sentences, heads, src_len, head_dim], got ", k.sizes());
  TORCH_CHECK(v.sizes() == k.sizes(), "v must have k's shape ", k.sizes());
  const int64_t n_sentences = k.size(0), heads = k.size(1), src_len = k.size(2), head_dim = k.size(3);
  const int64_t n_rows = row_slots.numel();
  TORCH_CHECK(q.dim() == 2 && q.size(0) == n_rows && q.size(1) == heads * head_dim,
              "q must be [n_rows=", n_rows, ", ", heads * head_dim, "], got ", q.sizes());
  TORCH_CHECK(src_lengths.dim() == 1 && src_lengths.size(0) == n_sentences, "src_lengths must be [", n_sentences,
              "], got ", src_lengths.sizes());
  TORCH_CHECK(beam_size >= 1, "beam_size must be >= 1, got ", beam_size);
  check_like(k, q, "k");
  check_like(v, q, "v");
  check_like(q, q, "q");
  check_int32(src_lengths, "src_lengths", q.device());
  check_int32(row_slots, "row_slots", q.device());
  at::Tensor out = at::empty({n_rows, heads * head_dim}, q.options());
  const CrossAttentionArgs args{q.data_ptr(), k.data_ptr(), v.data_ptr(), src_lengths.data_ptr<int32_t>(),
                                row_slots.data_ptr<int32_t>(), out.data_ptr(), static_cast<int>(n_rows),
                                static_cast<int>(heads), static_cast<int>(head_dim), static_cast<int>(src_len),
                                static_cast<int>(beam_size)};
  if (q.is_cuda()) {
#ifdef FASTFORMER_WITH_CUDA
    c10::DeviceGuard guard(q.device());
    check_launch(cross_attention_cuda(args, cuda_dtype(q, "cross_attention"),
                                      c10::cuda::getCurrentCUDAStream().stream()),
                 "cross_attention");
#else
    TORCH_CHECK(false, "fastformer._C was built without CUDA");
#endif
  } else {
    check_cpu_float(q, "cross_attention");
    cross_attention_cpu(args);
  }
  return out;
}

BeamState::BeamState(int64_t n_sentences, int64_t beam_size, int64_t cache_len, int64_t bos_id,
                     const at::Device& device) {
  const int64_t n_slots = n_sentences * beam_size;
  const auto ints = at::TensorOptions().dtype(at::kInt).device(device);
  // Only beam 0 of each sentence starts alive (the others are empty slots), so step 0 ranks one hypothesis.
  sums = at::full({n_sentences, beam_size}, -std::numeric_limits<float>::infinity(),
                  at::TensorOptions().dtype(at::kFloat).device(device));
  sums.select(1, 0).zero_();
  sums = sums.view({n_slots});
  tokens = at::full({n_slots}, bos_id, ints);
  // Every slot starts holding its own history.
  indirection[0] = at::arange(beam_size, ints).repeat({n_sentences}).unsqueeze(1).expand({n_slots, cache_len})
                       .contiguous();
  indirection[1] = at::empty_like(indirection[0]);
  history_tokens = at::empty({cache_len, n_slots}, ints);
  history_beams = at::empty({cache_len, n_slots}, ints);
  finished_count = at::zeros({n_sentences}, ints);
  finished_scores = at::empty({n_sentences, 2 * beam_size}, at::TensorOptions().dtype(at::kDouble).device(device));
  finished_steps = at::empty({n_sentences, 2 * beam_size}, ints);
  finished_beams = at::empty({n_sentences, 2 * beam_size}, ints);
  done = at::zeros({n_sentences}, ints);
  candidate_scores = at::empty({n_slots, 2 * beam_size}, at::TensorOptions().dtype(at::kFloat).device(device));
  candidate_ids = at::empty({n_slots, 2 * beam_size}, ints);
}

std::vector<at::Tensor> BeamState::as_list(int read_indirection) const {
  return {sums, tokens, indirection[read_indirection], indirection[1 - read_indirection], history_tokens,
          history_beams, finished_count, finished_scores, finished_steps, finished_beams, done, candidate_scores,
          candidate_ids};
}

void beam_step(const at::Tensor& logits, const at::Tensor& active, const at::Tensor& max_lens,
               const std::vector<at::Tensor>& state, int64_t step, const SearchOptions& options) {
  TORCH_CHECK(state.size() == BeamState::kListSize, "state must hold ", BeamState::kListSize, " tensors, got ",
              state.size());
  const at::Tensor &sums = state[0], &tokens = state[1], &indirection_in = state[2], &indirection_out = state[3];
  const at::Tensor &history_tokens = state[4], &history_beams = state[5], &finished_count = state[6];
  const at::Tensor &finished_scores = state[7], &finished_steps = state[8], &finished_beams = state[9];
  const at::Tensor &done = state[10], &candidate_scores = state[11], &candidate_ids = state[12];
  const int64_t k = options.beam_size, n_sentences = finished_count.numel(), n_slots = n_sentences * k;
  const int64_t n_active = active.numel(), cache_len = indirection_in.size(1);
  const at::Device device = logits.device();
  TORCH_CHECK(k >= 1, "beam_size must be >= 1, got ", k);
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == n_active * k && logits.is_contiguous(),
              "logits must be a contiguous [n_active * beam_size=", n_active * k, ", vocab], got ", logits.sizes());
  TORCH_CHECK(step >= 0 && step < cache_len, "step must be in [0, cache_len=", cache_len, "), got ", step);
  TORCH_CHECK(options.pad_id >= 0 && options.bos_id >= 0 && options.eos_id >= 0 &&
                  std::max({options.pad_id, options.bos_id, options.eos_id}) < logits.size(1),
              "pad_id, bos_id and eos_id must be in [0, vocab)");
  check_int32(active, "active", device);
  check_int32(max_lens, "max_lens", device);
  TORCH_CHECK(max_lens.numel() == n_sentences, "max_lens must have n_sentences=", n_sentences, " entries");
  TORCH_CHECK(sums.scalar_type() == at::kFloat && sums.numel() == n_slots && sums.is_contiguous() &&
                  sums.device() == device, "sums must be a contiguous float32 [", n_slots, "] on ", device);
  TORCH_CHECK(finished_scores.scalar_type() == at::kDouble && finished_scores.numel() == n_sentences * 2 * k &&
                  finished_scores.device() == device && finished_scores.is_contiguous(),
              "finished_scores must be a contiguous float64 [", n_sentences, ", ", 2 * k, "] on ", device);
  TORCH_CHECK(candidate_scores.scalar_type() == at::kFloat && candidate_scores.numel() >= n_active * k * 2 * k &&
                  candidate_scores.device() == device && candidate_scores.is_contiguous(),
              "candidate_scores must be a contiguous float32 workspace of at least [", n_active * k, ", ", 2 * k,
              "]");
  const std::pair<const at::Tensor*, int64_t> int_tensors[] = {
      {&tokens, n_slots}, {&indirection_in, n_slots * cache_len}, {&indirection_out, n_slots * cache_len},
      {&history_tokens, n_slots * cache_len}, {&history_beams, n_slots * cache_len},
      {&finished_count, n_sentences}, {&finished_steps, n_sentences * 2 * k}, {&finished_beams, n_sentences * 2 * k},
      {&done, n_sentences}, {&candidate_ids, n_active * k * 2 * k}};
  for (const auto& [tensor, numel] : int_tensors) {
    check_int32(*tensor, "every int32 tensor of the beam state", device);
    TORCH_CHECK(tensor->numel() >= numel, "a beam-state tensor is too small: ", tensor->sizes());
  }
  BeamStepArgs args{};
  args.logits = logits.data_ptr();
  args.active = active.data_ptr<int32_t>();
  args.max_lens = max_lens.data_ptr<int32_t>();
  args.sums = sums.data_ptr<float>();
  args.tokens = tokens.data_ptr<int32_t>();
  args.indirection_in = indirection_in.data_ptr<int32_t>();
  args.indirection_out = indirection_out.data_ptr<int32_t>();
  args.history_tokens = history_tokens.data_ptr<int32_t>();
  args.history_beams = history_beams.data_ptr<int32_t>();
  args.finished_count = finished_count.data_ptr<int32_t>();
  args.finished_scores = finished_scores.data_ptr<double>();
  args.finished_steps = finished_steps.data_ptr<int32_t>();
  args.finished_beams = finished_beams.data_ptr<int32_t>();
  args.done = done.data_ptr<int32_t>();
  args.candidate_scores = candidate_scores.data_ptr<float>();
  args.candidate_ids = candidate_ids.data_ptr<int32_t>();
  args.n_sentences = static_cast<int>(n_sentences);
  args.n_active = static_cast<int>(n_active);
  args.vocab = static_cast<int>(logits.size(1));
  args.beam_size = static_cast<int>(k);
  args.cache_len = static_cast<int>(cache_len);
  args.step = static_cast<int>(step);
  args.min_len = static_cast<int>(options.min_len);
  args.pad_id = static_cast<int>(options.pad_id);
  args.bos_id = static_cast<int>(options.bos_id);
  args.eos_id = static_cast<int>(options.eos_id);
  args.length_penalty = options.length_penalty;
  if (logits.is_cuda()) {
#ifdef FASTFORMER_WITH_CUDA
    TORCH_CHECK(k <= kMaxCudaBeamSize, "beam_size must be <= ", kMaxCudaBeamSize, " on CUDA, got ", k);
    c10::DeviceGuard guard(device);
    check_launch(beam_step_cuda(args, cuda_dtype(logits, "beam_step"), c10::cuda::getCurrentCUDAStream().stream()),
                 "beam_step");
#else
    TORCH_CHECK(false, "fastformer._C was built without CUDA");
#endif
  } else {
    check_cpu_float(logits, "beam_step");
    beam_step_cpu(args);
  }
}

CachedDecoder::CachedDecoder(const at::Tensor& memory, const at::Tensor& src_lengths, std::vector<at::Tensor> weights,
                             DecoderOptions options, int64_t beam_size, int64_t cache_len)
    : weights_(std::move(weights)), options_(std::move(options)), beam_size_(beam_size), cache_len_(cache_len) {
  c10::InferenceMode inference;
  TORCH_CHECK(memory.dim() == 3, "memory must be [n_sentences, src_len, d_model], got ", memory.sizes());
  TORCH_CHECK(weights_.size() > 5 && (weights_.size() - 5) % kTensorsPerLayer == 0, "weights must hold ",
              kTensorsPerLayer, " tensors per layer plus 5, got ", weights_.size());
  TORCH_CHECK(beam_size >= 1 && cache_len >= 1, "beam_size and cache_len must be >= 1");
  n_layers_ = static_cast<int64_t>((weights_.size() - 5) / kTensorsPerLayer);
  TORCH_CHECK(options_.norm_eps.size() == static_cast<size_t>(3 * n_layers_ + 1), "norm_eps must hold ",
              3 * n_layers_ + 1, " values, got ", options_.norm_eps.size());
  const int64_t n_sentences = memory.size(0), src_len = memory.size(1);
  d_model_ = memory.size(2);
  const int64_t heads = options_.n_heads;
  TORCH_CHECK(heads >= 1 && d_model_ % heads == 0, "n_heads must divide d_model=", d_model_);
  const int64_t head_dim = d_model_ / heads;
  const at::Tensor& positions = weights_[n_layers_ * kTensorsPerLayer + 1];
  TORCH_CHECK(cache_len <= positions.size(0), "cache_len=", cache_len, " exceeds max_positions=", positions.size(0));
  for (const at::Tensor& w : weights_) {
    TORCH_CHECK(!w.defined() || w.numel() == 0 || w.device() == memory.device(), "every weight must be on ",
                memory.device());
  }
  TORCH_CHECK(src_lengths.dim() == 1 && src_lengths.size(0) == n_sentences, "src_lengths must be [", n_sentences,
              "], got ", src_lengths.sizes());
  c10::DeviceGuard guard(memory.device());
  src_lengths_ = src_lengths.to(at::kInt).contiguous();
  n_slots_ = n_sentences * beam_size;
  // Each layer's cross-attention keys/values: [2, n_sentences, heads, src_len, head_dim], computed once.
  std::vector<at::Tensor> keys_values;
  for (int64_t layer = 0; layer < n_layers_; ++layer) {
    keys_values.push_back(at::linear(memory, weight(layer, 6), weight(layer, 7))
                              .view({n_sentences, src_len, 2, heads, head_dim})
                              .permute({2, 0, 3, 1, 4}));
  }
  cross_keys_values_ = at::stack(keys_values).contiguous();
  k_cache_ = at::empty({n_layers_, n_slots_, heads, cache_len, head_dim}, memory.options());
  v_cache_ = at::empty_like(k_cache_);
}

at::Tensor CachedDecoder::layer_norm(const at::Tensor& x, int64_t layer, int64_t which) {
  return at::layer_norm(x, {d_model_}, weight(layer, 14 + 2 * which), weight(layer, 15 + 2 * which),
                        options_.norm_eps[3 * layer + which]);
}

at::Tensor CachedDecoder::self_block(const at::Tensor& h, int64_t layer, const at::Tensor& row_slots,
                                     const at::Tensor& indirection, int64_t step) {
  const at::Tensor qkv = at::linear(h, weight(layer, 0), weight(layer, 1));
  const at::Tensor attended = self_attention_step(qkv, k_cache_[layer], v_cache_[layer], indirection, row_slots,
                                                  beam_size_, step);
  return at::linear(attended, weight(layer, 2), weight(layer, 3));
}

at::Tensor CachedDecoder::cross_block(const at::Tensor& h, int64_t layer, const at::Tensor& row_slots) {
  const at::Tensor q = at::linear(h, weight(layer, 4), weight(layer, 5));
  const at::Tensor keys_values = cross_keys_values_[layer];
  const at::Tensor attended = cross_attention(q, keys_values[0], keys_values[1], src_lengths_, row_slots, beam_size_);
  return at::linear(attended, weight(layer, 8), weight(layer, 9));
}

at::Tensor CachedDecoder::feed_forward(const at::Tensor& h, int64_t layer) {
  at::Tensor hidden = at::linear(h, weight(layer, 10), weight(layer, 11));
  hidden = options_.gelu ? at::gelu(hidden) : at::relu_(hidden);
  return at::linear(hidden, weight(layer, 12), weight(layer, 13));
}

at::Tensor CachedDecoder::step(const at::Tensor& tokens, const at::Tensor& row_slots, const at::Tensor& indirection,
                               int64_t step) {
  c10::InferenceMode inference;
  c10::DeviceGuard guard(tokens.device());
  TORCH_CHECK(step >= 0 && step < cache_len_, "step must be in [0, cache_len=", cache_len_, "), got ", step);
  TORCH_CHECK(tokens.dim() == 1 && tokens.numel() == row_slots.numel(), "tokens must be [n_rows=",
              row_slots.numel(), "], got ", tokens.sizes());
  const int64_t globals = n_layers_ * kTensorsPerLayer;
  const at::Tensor &embedding = weights_[globals], &positions = weights_[globals + 1];
  // The model's embed(): embedding * sqrt(d_model) + the position's sinusoid, in the same operation order.
  at::Tensor x = at::embedding(embedding, tokens).mul(std::sqrt(static_cast<double>(d_model_)))
                     .add(positions[step]);
  for (int64_t layer = 0; layer < n_layers_; ++layer) {
    if (options_.norm_first) {
      x = x + self_block(layer_norm(x, layer, 0), layer, row_slots, indirection, step);
      x = x + cross_block(layer_norm(x, layer, 1), layer, row_slots);
      x = x + feed_forward(layer_norm(x, layer, 2), layer);
    } else {
      x = layer_norm(x + self_block(x, layer, row_slots, indirection, step), layer, 0);
      x = layer_norm(x + cross_block(x, layer, row_slots), layer, 1);
      x = layer_norm(x + feed_forward(x, layer), layer, 2);
    }
  }
  if (options_.norm_first) {
    x = at::layer_norm(x, {d_model_}, weights_[globals + 3], weights_[globals + 4], options_.norm_eps.back());
  }
  return at::linear(x, weights_[globals + 2]);
}

std::vector<Hypotheses> beam_search(const at::Tensor& memory, const at::Tensor& src_lengths,
                                    std::vector<at::Tensor> weights, const DecoderOptions& decoder_options,
                                    const SearchOptions& search_options, const std::vector<int64_t>& max_lens,
                                    int64_t n_best) {
  c10::InferenceMode inference;
  c10::DeviceGuard guard(memory.device());
  const int64_t n_sentences = memory.size(0), k = search_options.beam_size;
  TORCH_CHECK(static_cast<int64_t>(max_lens.size()) == n_sentences, "max_lens must have one entry per sentence");
  TORCH_CHECK(n_best >= 1 && n_best <= k, "n_best must be in [1, beam_size]");
  if (n_sentences == 0) return {};
  const int64_t cache_len = *std::max_element(max_lens.begin(), max_lens.end()) + 1;
  CachedDecoder decoder(memory, src_lengths, std::move(weights), decoder_options, k, cache_len);
  const at::Device device = memory.device();
  BeamState state(n_sentences, k, cache_len, search_options.bos_id, device);
  const at::Tensor max_lens_device = at::tensor(max_lens, at::kLong).to(device, at::kInt);

  // The sentences still searching, and their rows' slots (row a * k + j is slot active[a] * k + j).
  std::vector<int32_t> active(n_sentences);
  std::iota(active.begin(), active.end(), 0);
  at::Tensor active_device, row_slots, row_slots_long;
  auto upload_active = [&] {
    active_device = at::tensor(active, at::kInt).to(device);
    row_slots = (active_device.unsqueeze(1) * k + at::arange(k, active_device.options())).view({-1});
    row_slots_long = row_slots.to(at::kLong);
  };
  upload_active();
  int read_indirection = 0;
  for (int64_t step = 0; step < cache_len && !active.empty(); ++step) {
    const at::Tensor logits = decoder.step(state.tokens.index_select(0, row_slots_long), row_slots,
                                           state.indirection[read_indirection], step);
    beam_step(logits, active_device, max_lens_device, state.as_list(read_indirection), step, search_options);
    read_indirection = 1 - read_indirection;
    // The one host sync of a step: which sentences are done, to drop them from the next step's batch.
    const at::Tensor done = state.done.index_select(0, active_device.to(at::kLong)).cpu();
    const int32_t* done_flags = done.data_ptr<int32_t>();
    if (std::any_of(done_flags, done_flags + active.size(), [](int32_t d) { return d != 0; })) {
      std::vector<int32_t> still_active;
      for (size_t a = 0; a < active.size(); ++a) {
        if (!done_flags[a]) still_active.push_back(active[a]);
      }
      active = std::move(still_active);
      if (!active.empty()) upload_active();
    }
  }
  TORCH_CHECK(active.empty(), "internal error: the search ended with sentences still searching");

  // Back-track each finished hypothesis through the history; best score first, ties in finishing order.
  const at::Tensor count = state.finished_count.cpu(), scores = state.finished_scores.cpu();
  const at::Tensor steps = state.finished_steps.cpu(), beams = state.finished_beams.cpu();
  const at::Tensor history_tokens = state.history_tokens.cpu(), history_beams = state.history_beams.cpu();
  const int32_t* tokens_at = history_tokens.data_ptr<int32_t>();
  const int32_t* beams_at = history_beams.data_ptr<int32_t>();
  const int64_t n_slots = n_sentences * k;
  std::vector<Hypotheses> results(n_sentences);
  for (int64_t s = 0; s < n_sentences; ++s) {
    const int n_finished = count.data_ptr<int32_t>()[s];
    std::vector<int> order(n_finished);
    std::iota(order.begin(), order.end(), 0);
    const double* sentence_scores = scores.data_ptr<double>() + s * 2 * k;
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return sentence_scores[a] > sentence_scores[b]; });
    for (int i = 0; i < n_finished && i < n_best; ++i) {
      const int length = steps.data_ptr<int32_t>()[s * 2 * k + order[i]];
      int beam = beams.data_ptr<int32_t>()[s * 2 * k + order[i]];
      std::vector<int64_t> tokens(length);
      for (int position = length - 1; position >= 0; --position) {
        const int64_t at = position * n_slots + s * k + beam;
        tokens[position] = tokens_at[at];
        beam = beams_at[at];
      }
      results[s].emplace_back(std::move(tokens), sentence_scores[order[i]]);
    }
  }
  return results;
}

}  // namespace fastformer
