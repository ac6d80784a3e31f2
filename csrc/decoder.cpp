// The incremental decoder, the search's state and step, and the ATen wrappers of the fused ops (see decoder.h); the
// loop over the steps is in search.cpp.
#include "decoder.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>

#include "beam_ops.h"

#ifdef FASTFORMER_WITH_CUDA
#include <c10/cuda/CUDAStream.h>

#include "beam_ops_cuda.h"
#endif

namespace fastformer {
namespace {

// t on `device`, and contiguous where asked.
void check_placed(const at::Tensor& t, const at::Device& device, const char* name, bool contiguous = true) {
  TORCH_CHECK(t.device() == device, name, " is on ", t.device(), ", expected ", device);
  TORCH_CHECK(!contiguous || t.is_contiguous(), name, " must be contiguous");
}

void check_int32(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
  check_placed(t, device, name);
}

// The first `count` values of a contiguous int32 tensor lie in [low, high). On the CPU only: a CUDA tensor is read
// where the search's own kernels wrote it, and reading it here would wait for them.
void check_values_in(const at::Tensor& t, int64_t count, int64_t low, int64_t high, const char* name,
                     int64_t first = 0) {
  if (!t.is_cpu()) return;
  const int32_t* values = t.data_ptr<int32_t>() + first;
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(values[i] >= low && values[i] < high, name, " must lie in [", low, ", ", high, "), got ", values[i],
                " at ", i);
  }
}

void check_like(const at::Tensor& t, const at::Tensor& like, const char* name, bool contiguous = true) {
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), name, " must have dtype ", like.scalar_type(), ", got ",
              t.scalar_type());
  check_placed(t, like.device(), name, contiguous);
}

void check_cpu_float(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, " on the CPU takes float32 tensors, got ", t.scalar_type());
}

// An attention op's keys/values `t` (a cache, or the encoder's) against its float rows `rows`: the rows' dtype, or
// float16 on the CPU (the 16-bit caches of CachedDecoder) -> whether float16. Contiguous where asked.
bool check_keys_values(const at::Tensor& t, const at::Tensor& rows, const char* name, bool contiguous = true) {
  const bool half = t.is_cpu() && t.scalar_type() == at::kHalf && rows.scalar_type() == at::kFloat;
  if (!half) {
    check_like(t, rows, name, contiguous);
    return false;
  }
  check_placed(t, rows.device(), name, contiguous);
  return true;
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

cudaError_t launch_cuda(const SelfAttentionArgs& args, DType dtype, cudaStream_t stream) {
  return self_attention_step_cuda(args, dtype, stream);
}
cudaError_t launch_cuda(const CrossAttentionArgs& args, DType dtype, cudaStream_t stream) {
  return cross_attention_cuda(args, dtype, stream);
}
cudaError_t launch_cuda(const BeamStepArgs& args, DType dtype, cudaStream_t stream) {
  return beam_step_cuda(args, dtype, stream);
}
#endif

// The units (rows or sentences) of an attention op's task on a thread, each unit_work multiply-adds: a task of at
// least 2^17 of them, where fewer cost more in fork/join than they gain. Inside the search's or the scorer's threads
// the ops run inline.
int64_t attention_units_per_task(int64_t unit_work) {
  return std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(1, unit_work));
}

// The rows split across threads where there are enough of them (attention_units_per_task). A row reads only
// positions before `step` and writes only its own slot's entry at `step`, so the rows are independent and the result
// is the same however they are split: one group of sentences on several threads (search.cpp's cpu_sentence_groups)
// spreads them over all of its threads.
void run_cpu(const SelfAttentionArgs& args) {
  const int64_t d_model = static_cast<int64_t>(args.heads) * args.head_dim;
  at::parallel_for(0, args.n_rows, attention_units_per_task(2 * d_model * (*args.step + 1)),
                   [&](int64_t first, int64_t end) {
                     SelfAttentionArgs part = args;
                     part.qkv = static_cast<const float*>(args.qkv) + first * 3 * d_model;
                     part.row_slots = args.row_slots + first;
                     part.out = static_cast<float*>(args.out) + first * d_model;
                     part.n_rows = static_cast<int>(end - first);
                     self_attention_step_cpu(part);
                   });
}

// The rows split across threads where there are enough of them (attention_units_per_task), a task's ends moved to
// where a sentence's rows begin, so that a sentence's rows attend in the same groups whatever the batch and the
// threads.
void run_cpu(const CrossAttentionArgs& args) {
  const int64_t d_model = static_cast<int64_t>(args.heads) * args.head_dim;
  auto sentence_of = [&](int64_t row) { return args.row_slots[row] / args.beam_size; };
  auto sentence_start = [&](int64_t row) {  // the first row at or after `row` that begins a sentence's rows
    while (row > 0 && row < args.n_rows && sentence_of(row) == sentence_of(row - 1)) ++row;
    return row;
  };
  const int64_t grain = attention_units_per_task(2 * d_model * args.src_len);
  at::parallel_for(0, args.n_rows, grain, [&](int64_t first, int64_t end) {
    first = sentence_start(first);
    end = sentence_start(end);
    if (first >= end) return;
    CrossAttentionArgs part = args;
    part.q = static_cast<const float*>(args.q) + first * args.q_row_stride;
    part.out = static_cast<float*>(args.out) + first * d_model;
    part.row_slots = args.row_slots + first;
    part.n_rows = static_cast<int>(end - first);
    cross_attention_cpu(part);
  });
}
void run_cpu(const BeamStepArgs& args) { beam_step_cpu(args); }

// Runs the fused op `op` of `args` where `data` lives: its CUDA kernels on the current stream, or its fp32 CPU loops.
template <typename Args>
void run_fused_op(const char* op, const at::Tensor& data, const Args& args) {
  if (data.is_cuda()) {
#ifdef FASTFORMER_WITH_CUDA
    c10::DeviceGuard guard(data.device());
    const cudaError_t error = launch_cuda(args, cuda_dtype(data, op), c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(error == cudaSuccess, op, " failed to launch: ", cudaGetErrorString(error));
#else
    TORCH_CHECK(false, "fastformer._C was built without CUDA");
#endif
  } else {
    check_cpu_float(data, op);
    run_cpu(args);
  }
}

// Checks the step tensor ([1] int32 on `device`). Its value is checked where reading it costs no device sync (the
// CPU); the CUDA kernels skip a step out of range instead.
void check_step(const at::Tensor& step, int64_t cache_len, const at::Device& device) {
  check_int32(step, "step", device);
  TORCH_CHECK(step.numel() == 1, "step must hold one position, got ", step.sizes());
  if (step.is_cpu()) {
    const int32_t value = *step.data_ptr<int32_t>();
    TORCH_CHECK(value >= 0 && value < cache_len, "step must be in [0, cache_len=", cache_len, "), got ", value);
  }
}

// Checks of a beam step's inputs against the state's shapes (the state may have room for more rows than active).
// The checks of beam_step's and greedy_step's inputs besides the logits or tokens (on `device`, of width vocab).
void check_beam_step_inputs(const at::Device& device, int64_t vocab, const at::Tensor& active,
                            const at::Tensor& max_lens, const BeamState& state, const SearchOptions& options) {
  const int64_t k = options.beam_size, n_sentences = state.finished_count.numel(), n_slots = n_sentences * k;
  const int64_t n_active = active.numel(), cache_len = state.indirection_in().size(1);
  TORCH_CHECK(k >= 1, "beam_size must be >= 1, got ", k);
  TORCH_CHECK(!device.is_cuda() || k <= kMaxCudaBeamSize, "beam_size must be <= ", kMaxCudaBeamSize,
              " on CUDA, got ", k);
  check_step(state.step, cache_len, device);
  TORCH_CHECK(options.pad_id >= 0 && options.bos_id >= 0 && options.eos_id >= 0 &&
                  std::max({options.pad_id, options.bos_id, options.eos_id}) < vocab,
              "pad_id, bos_id and eos_id must be in [0, vocab)");
  check_int32(active, "active", device);
  check_int32(max_lens, "max_lens", device);
  TORCH_CHECK(max_lens.numel() == n_sentences, "max_lens must have n_sentences=", n_sentences, " entries");
  const std::tuple<const char*, const at::Tensor*, at::ScalarType, int64_t> tensors[] = {
      {"sums", &state.sums, at::kFloat, n_slots},
      {"tokens", &state.tokens, at::kInt, n_slots},
      {"indirection_in", &state.indirection_in(), at::kInt, n_slots * cache_len},
      {"indirection_out", &state.indirection_out(), at::kInt, n_slots * cache_len},
      {"history_tokens", &state.history_tokens, at::kInt, n_slots * cache_len},
      {"history_beams", &state.history_beams, at::kInt, n_slots * cache_len},
      {"finished_count", &state.finished_count, at::kInt, n_sentences},
      {"finished_scores", &state.finished_scores, at::kDouble, n_sentences * 2 * k},
      {"finished_steps", &state.finished_steps, at::kInt, n_sentences * 2 * k},
      {"finished_beams", &state.finished_beams, at::kInt, n_sentences * 2 * k},
      {"done", &state.done, at::kInt, n_sentences},
      {"candidate_scores", &state.candidate_scores, at::kFloat, n_active * k * 2 * k},
      {"candidate_ids", &state.candidate_ids, at::kInt, n_active * k * 2 * k}};
  if (state.forced_tokens.defined()) {
    check_int32(state.forced_tokens, "forced_tokens", device);
    TORCH_CHECK(state.forced_tokens.numel() == n_sentences, "forced_tokens must have n_sentences=", n_sentences,
                " entries");
  }
  for (const auto& [name, tensor, dtype, numel] : tensors) {
    TORCH_CHECK(tensor->scalar_type() == dtype && tensor->is_contiguous() && tensor->device() == device, "beam state ",
                name, " must be a contiguous ", dtype, " tensor on ", device);
    TORCH_CHECK(tensor->numel() >= numel, "beam state ", name, " must hold at least ", numel, " elements, got ",
                tensor->sizes());
  }
}

LengthPenaltyForm parse_length_penalty_form(const std::string& name) {
  if (name == "gnmt") return LengthPenaltyForm::kGnmt;
  if (name == "length") return LengthPenaltyForm::kLength;
  TORCH_CHECK(false, "length_penalty_form must be \"gnmt\" or \"length\", got \"", name, "\"");
}

// logits: [n_active * beam_size, vocab] (null: greedy_tokens instead, BeamStepArgs::greedy_tokens).
BeamStepArgs beam_step_args(const void* logits, int64_t vocab, const at::Tensor& active, const at::Tensor& max_lens,
                            BeamState& state, const SearchOptions& options) {
  BeamStepArgs args{};
  args.logits = logits;
  args.active = active.data_ptr<int32_t>();
  args.max_lens = max_lens.data_ptr<int32_t>();
  args.sums = state.sums.data_ptr<float>();
  args.tokens = state.tokens.data_ptr<int32_t>();
  args.indirection_in = state.indirection_in().data_ptr<int32_t>();
  args.indirection_out = state.indirection_out().data_ptr<int32_t>();
  args.history_tokens = state.history_tokens.data_ptr<int32_t>();
  args.history_beams = state.history_beams.data_ptr<int32_t>();
  args.finished_count = state.finished_count.data_ptr<int32_t>();
  args.finished_scores = state.finished_scores.data_ptr<double>();
  args.finished_steps = state.finished_steps.data_ptr<int32_t>();
  args.finished_beams = state.finished_beams.data_ptr<int32_t>();
  args.done = state.done.data_ptr<int32_t>();
  args.candidate_scores = state.candidate_scores.data_ptr<float>();
  args.candidate_ids = state.candidate_ids.data_ptr<int32_t>();
  args.n_sentences = static_cast<int>(state.finished_count.numel());
  args.n_active = static_cast<int>(active.numel());
  args.vocab = static_cast<int>(vocab);
  args.beam_size = static_cast<int>(options.beam_size);
  args.cache_len = static_cast<int>(state.indirection_in().size(1));
  args.step = state.step.data_ptr<int32_t>();
  args.min_len = static_cast<int>(options.min_len);
  args.pad_id = static_cast<int>(options.pad_id);
  args.bos_id = static_cast<int>(options.bos_id);
  args.eos_id = static_cast<int>(options.eos_id);
  args.with_scores = !greedy_without_scores(options);
  args.length_penalty = options.length_penalty;
  args.length_penalty_form = parse_length_penalty_form(options.length_penalty_form);
  args.forced_tokens = state.forced_tokens.defined() ? state.forced_tokens.data_ptr<int32_t>() : nullptr;
  return args;
}


}  // namespace

at::Tensor self_attention_step(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& indirection, const at::Tensor& row_slots, int64_t beam_size,
                               const at::Tensor& step) {
  TORCH_CHECK(k_cache.dim() == 4, "k_cache must be [n_slots, heads, cache_len, head_dim], got ", k_cache.sizes());
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache must have k_cache's shape ", k_cache.sizes());
  const int64_t n_slots = k_cache.size(0), heads = k_cache.size(1), cache_len = k_cache.size(2);
  const int64_t head_dim = k_cache.size(3), n_rows = row_slots.numel();
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(0) == n_rows && qkv.size(1) == 3 * heads * head_dim,
              "qkv must be [n_rows=", n_rows, ", ", 3 * heads * head_dim, "], got ", qkv.sizes());
  TORCH_CHECK(indirection.dim() == 2 && indirection.size(0) == n_slots && indirection.size(1) == cache_len,
              "indirection must be [", n_slots, ", ", cache_len, "], got ", indirection.sizes());
  TORCH_CHECK(beam_size >= 1 && n_slots % beam_size == 0, "beam_size must divide n_slots=", n_slots);
  const bool half_cache = check_keys_values(k_cache, qkv, "k_cache");
  check_like(v_cache, k_cache, "v_cache");
  check_like(qkv, qkv, "qkv");
  check_int32(indirection, "indirection", qkv.device());
  check_int32(row_slots, "row_slots", qkv.device());
  check_step(step, cache_len, qkv.device());
  check_values_in(row_slots, n_rows, 0, n_slots, "row_slots");
  if (qkv.is_cpu()) {
    // The cache positions a row reads: its slot's indirection up to the step.
    const int32_t* slots = row_slots.data_ptr<int32_t>();
    const int32_t positions = *step.data_ptr<int32_t>();
    for (int64_t row = 0; row < n_rows; ++row) {
      check_values_in(indirection, positions, 0, beam_size, "indirection", slots[row] * cache_len);
    }
  }
  at::Tensor out = at::empty({n_rows, heads * head_dim}, qkv.options());
  const SelfAttentionArgs args{qkv.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                               indirection.data_ptr<int32_t>(), row_slots.data_ptr<int32_t>(), out.data_ptr(),
                               step.data_ptr<int32_t>(), static_cast<int>(n_rows), static_cast<int>(heads),
                               static_cast<int>(head_dim), static_cast<int>(cache_len), static_cast<int>(beam_size),
                               half_cache};
  run_fused_op("self_attention_step", qkv, args);
  return out;
}

at::Tensor self_attention_step(const at::Tensor& qkv, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& indirection, const at::Tensor& row_slots, int64_t beam_size,
                               int64_t step) {
  const int64_t cache_len = k_cache.dim() == 4 ? k_cache.size(2) : 0;
  TORCH_CHECK(step >= 0 && step < cache_len, "step must be in [0, cache_len=", cache_len, "), got ", step);
  return self_attention_step(qkv, k_cache, v_cache, indirection, row_slots, beam_size, step_tensor(step, qkv.device()));
}

namespace {

at::Tensor attend_sources(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& src_lengths,
                          const at::Tensor& row_slots, int64_t beam_size, bool padded_queries) {
  TORCH_CHECK(k.dim() == 4, "k must be [n_sentences, heads, src_len, head_dim], got ", k.sizes());
  TORCH_CHECK(v.sizes() == k.sizes(), "v must have k's shape ", k.sizes());
  const int64_t n_sentences = k.size(0), heads = k.size(1), src_len = k.size(2), head_dim = k.size(3);
  const int64_t n_rows = row_slots.numel();
  TORCH_CHECK(q.dim() == 2 && q.size(0) == n_rows && q.size(1) == heads * head_dim,
              "q must be [n_rows=", n_rows, ", ", heads * head_dim, "], got ", q.sizes());
  TORCH_CHECK(src_lengths.dim() == 1 && src_lengths.size(0) == n_sentences, "src_lengths must be [", n_sentences,
              "], got ", src_lengths.sizes());
  TORCH_CHECK(beam_size >= 1, "beam_size must be >= 1, got ", beam_size);
  // On the CPU, views: q's rows and k's and v's positions where the linear layers left them (CrossAttentionArgs).
  // The CUDA kernels read the same strides but take contiguous tensors until they have run on a GPU so.
  const bool views = q.is_cpu();
  const bool half_keys_values = check_keys_values(k, q, "k", !views);
  check_like(v, k, "v", !views);
  check_like(q, q, "q", !views);
  // A dimension of size 1 is never stepped along: its stride may be anything (as is_contiguous() has it).
  auto stride_is = [](const at::Tensor& t, int64_t dim, int64_t stride) {
    return t.size(dim) <= 1 || t.stride(dim) == stride;
  };
  TORCH_CHECK(stride_is(q, 1, 1), "q's rows must be contiguous, got strides ", q.strides());
  bool same_strides = stride_is(k, 3, 1) && stride_is(v, 3, 1);
  for (int64_t dim = 0; dim < 3; ++dim) same_strides = same_strides && stride_is(v, dim, k.stride(dim));
  TORCH_CHECK(same_strides, "k and v must have the same strides with head_dim contiguous, got ", k.strides(),
              " and ", v.strides());
  check_int32(src_lengths, "src_lengths", q.device());
  check_int32(row_slots, "row_slots", q.device());
  check_values_in(src_lengths, n_sentences, 1, src_len + 1, "src_lengths");
  check_values_in(row_slots, n_rows, 0, n_sentences * beam_size, "row_slots");
  at::Tensor out = at::empty({n_rows, heads * head_dim}, q.options());
  const CrossAttentionArgs args{q.data_ptr(), k.data_ptr(), v.data_ptr(), src_lengths.data_ptr<int32_t>(),
                                row_slots.data_ptr<int32_t>(), out.data_ptr(), static_cast<int>(n_rows),
                                static_cast<int>(heads), static_cast<int>(head_dim), static_cast<int>(src_len),
                                static_cast<int>(beam_size), q.stride(0), k.stride(0), k.stride(1), k.stride(2),
                                half_keys_values, padded_queries};
  run_fused_op("cross_attention", q, args);
  return out;
}

}  // namespace

at::Tensor cross_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& src_lengths, const at::Tensor& row_slots, int64_t beam_size) {
  return attend_sources(q, k, v, src_lengths, row_slots, beam_size, /*padded_queries=*/false);
}

at::Tensor encoder_self_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& src_lengths, const at::Tensor& row_slots) {
  TORCH_CHECK(q.dim() == 2 && k.dim() == 4 && q.size(0) == k.size(0) * k.size(2), "q must be [n_sentences * src_len, "
              "d_model] for k of ", k.sizes(), ", got ", q.sizes());
  // The CUDA kernel attends each row on its own, padding rows included.
  return attend_sources(q, k, v, src_lengths, row_slots, /*beam_size=*/1, /*padded_queries=*/q.is_cpu());
}

at::Tensor block_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_lengths,
                           bool causal) {
  TORCH_CHECK(k.dim() == 4 && v.sizes() == k.sizes(), "k and v must be [n_sentences, heads, k_len, head_dim], got ",
              k.sizes(), " and ", v.sizes());
  const int64_t n_sentences = k.size(0), heads = k.size(1), k_len = k.size(2), head_dim = k.size(3);
  const int64_t d_model = heads * head_dim;
  TORCH_CHECK(n_sentences >= 1 && k_len >= 1, "block_attention needs a sentence and a key, got k of ", k.sizes());
  TORCH_CHECK(q.dim() == 2 && q.size(0) % n_sentences == 0 && q.size(1) == d_model, "q must be [n_sentences=",
              n_sentences, " x q_len, ", d_model, "], got ", q.sizes());
  for (const auto& [t, name] : {std::pair{&q, "q"}, std::pair{&k, "k"}, std::pair{&v, "v"}}) {
    TORCH_CHECK(t->is_cpu() && t->scalar_type() == at::kFloat, "block_attention takes float32 CPU tensors, ", name,
                " is ", t->scalar_type(), " on ", t->device());
  }
  TORCH_CHECK(q.stride(1) == 1 && k.stride(3) == 1 && k.strides() == v.strides(), "q's rows and k's and v's head_dim "
              "must be contiguous, k and v strided alike, got strides ", q.strides(), ", ", k.strides(), " and ",
              v.strides());
  check_int32(k_lengths, "k_lengths", q.device());
  TORCH_CHECK(k_lengths.dim() == 1 && k_lengths.size(0) == n_sentences, "k_lengths must be [", n_sentences, "], got ",
              k_lengths.sizes());
  TORCH_CHECK(k_lengths.min().item<int32_t>() >= 1 && k_lengths.max().item<int32_t>() <= k_len,
              "k_lengths must be in [1, k_len=", k_len, "]");
  const int64_t q_len = q.size(0) / n_sentences;
  at::Tensor out = at::empty({q.size(0), d_model}, q.options());
  const BlockAttentionArgs args{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                                k_lengths.data_ptr<int32_t>(), out.data_ptr<float>(), static_cast<int>(n_sentences),
                                static_cast<int>(q_len), static_cast<int>(k_len), static_cast<int>(heads),
                                static_cast<int>(head_dim), q.stride(0), k.stride(0), k.stride(1), k.stride(2),
                                causal ? 1 : 0};
  at::parallel_for(0, n_sentences, attention_units_per_task(2 * q_len * k_len * d_model),
                   [&](int64_t first, int64_t end) {
                     BlockAttentionArgs part = args;
                     part.q = args.q + first * q_len * args.q_row_stride;
                     part.k = args.k + first * args.kv_sentence_stride;
                     part.v = args.v + first * args.kv_sentence_stride;
                     part.k_lengths = args.k_lengths + first;
                     part.out = args.out + first * q_len * d_model;
                     part.n_sentences = static_cast<int>(end - first);
                     block_attention_cpu(part);
                   });
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
  indirection_[0] = at::arange(beam_size, ints).repeat({n_sentences}).unsqueeze(1).expand({n_slots, cache_len})
                        .contiguous();
  // Both valid from the start: the bucketed search reads finished sentences' rows that beam_step no longer writes.
  indirection_[1] = indirection_[0].clone();
  history_tokens = at::empty({cache_len, n_slots}, ints);
  history_beams = at::empty({cache_len, n_slots}, ints);
  finished_count = at::zeros({n_sentences}, ints);
  finished_scores = at::empty({n_sentences, 2 * beam_size}, at::TensorOptions().dtype(at::kDouble).device(device));
  finished_steps = at::empty({n_sentences, 2 * beam_size}, ints);
  finished_beams = at::empty({n_sentences, 2 * beam_size}, ints);
  done = at::zeros({n_sentences}, ints);
  candidate_scores = at::empty({n_slots, 2 * beam_size}, at::TensorOptions().dtype(at::kFloat).device(device));
  candidate_ids = at::empty({n_slots, 2 * beam_size}, ints);
  step = at::zeros({1}, ints);
}

void beam_step(const at::Tensor& logits, const at::Tensor& active, const at::Tensor& max_lens, BeamState& state,
               const SearchOptions& options) {
  const int64_t rows = active.numel() * options.beam_size;
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == rows && logits.is_contiguous(),
              "logits must be a contiguous [n_active * beam_size=", rows, ", vocab], got ", logits.sizes());
  check_beam_step_inputs(logits.device(), logits.size(1), active, max_lens, state, options);
  run_fused_op("beam_step", logits,
               beam_step_args(logits.data_ptr(), logits.size(1), active, max_lens, state, options));
}

bool greedy_without_scores(const SearchOptions& options) {
  // Blocked n-grams' -inf logits would read as a non-finite row to the greedy path (beam_ops_cpu.inc's greedy_token).
  return options.beam_size == 1 && !options.return_scores && options.no_repeat_ngram_size == 0;
}

void greedy_step(const at::Tensor& greedy_tokens, int64_t vocab, const at::Tensor& active, const at::Tensor& max_lens,
                 BeamState& state, const SearchOptions& options) {
  check_int32(greedy_tokens, "greedy_tokens", at::kCPU);
  TORCH_CHECK(greedy_tokens.numel() == active.numel(), "greedy_tokens must have n_active=", active.numel(),
              " entries, got ", greedy_tokens.numel());
  TORCH_CHECK(greedy_without_scores(options), "greedy_step is a greedy search's without scores");
  check_beam_step_inputs(greedy_tokens.device(), vocab, active, max_lens, state, options);
  BeamStepArgs args = beam_step_args(nullptr, vocab, active, max_lens, state, options);
  args.greedy_tokens = greedy_tokens.data_ptr<int32_t>();
  beam_step_cpu(args);
}

void beam_step_from_best(const PackedLinear::Summary& best, int64_t vocab, const at::Tensor& active,
                         const at::Tensor& max_lens, BeamState& state, const SearchOptions& options) {
  const int64_t rows = active.numel() * options.beam_size;
  TORCH_CHECK(best.values.dim() == 2 && best.values.size(0) == rows && best.values.size(1) >= 2 * options.beam_size,
              "best values must be [n_active * beam_size=", rows, ", k >= 2 * beam_size], got ", best.values.sizes());
  TORCH_CHECK(best.tops.defined() && best.log_totals.defined() && best.picked.defined(),
              "beam_step_from_best needs each row's top, log_total and EOS logit");
  TORCH_CHECK(!state.forced_tokens.defined(), "beam_step_from_best takes no forced tokens");
  check_beam_step_inputs(best.values.device(), vocab, active, max_lens, state, options);
  const at::Tensor values = best.values.contiguous(), ids = best.ids.contiguous(), tops = best.tops.contiguous();
  const at::Tensor log_totals = best.log_totals.contiguous(), eos_logits = best.picked.contiguous();
  const at::Tensor finite = best.finite.to(at::kInt).contiguous();
  const BestLogits best_logits{values.data_ptr<float>(), ids.data_ptr<int64_t>(), static_cast<int>(values.size(1)),
                               tops.data_ptr<float>(), log_totals.data_ptr<float>(), eos_logits.data_ptr<float>(),
                               finite.data_ptr<int32_t>()};
  BeamStepArgs args = beam_step_args(nullptr, vocab, active, max_lens, state, options);
  args.best = &best_logits;
  beam_step_cpu(args);
}

at::Tensor step_tensor(int64_t step, const at::Device& device) {
  return at::full({1}, step, at::TensorOptions().dtype(at::kInt).device(device));
}


// Checks that every tensor of the decoder is there and on `device`, and that the layout is one the decoder runs.
void check_decoder_weights(const DecoderWeights& weights, const DecoderOptions& options, const at::Device& device) {
  TORCH_CHECK(!weights.layers.empty(), "the decoder must have at least one layer");
  TORCH_CHECK(options.norm_first == weights.final_norm.has_value(),
              "a pre-LN decoder (norm_first) needs final_norm and a post-LN one has none");
  auto check = [&](const std::string& name, const at::Tensor& tensor) {
    TORCH_CHECK(tensor.defined(), "decoder weight ", name, " is missing");
    TORCH_CHECK(tensor.device() == device, "decoder weight ", name, " is on ", tensor.device(), ", expected ",
                device);
  };
  for (size_t i = 0; i < weights.layers.size(); ++i) {
    weights.layers[i].for_each_tensor(
        [&](const char* name, const at::Tensor& tensor) { check("layers." + std::to_string(i) + "." + name, tensor); });
  }
  check("embedding", weights.embedding);
  check("positions", weights.positions);
  check("output_weight", weights.output_weight);
  if (weights.output_bias) check("output_bias", *weights.output_bias);
  if (weights.final_norm) {
    check("final_norm.weight", weights.final_norm->weight);
    check("final_norm.bias", weights.final_norm->bias);
  }
}

// At 37k x 512 on the AVX-512 test CPU, single-threaded, oneDNN's int8 GEMM is 1.2x FBGEMM's at 64 and 128 rows and
// 1.9x at 256 (the whole 64-sentence search 1.08-1.3x faster in three paired runs); FBGEMM's is 1.25x faster at 4
// rows (one sentence), and on the AVX2 test CPU it was 1.2x faster at 128 rows too.
bool output_projection_takes_fbgemm() { return !cpu_has_vnni(); }

DecoderLinears::DecoderLinears(const DecoderWeights& weights, int64_t rows, ComputeType compute_type)
    : output(weights.output_weight, weights.output_bias, rows, compute_type, output_projection_takes_fbgemm()),
      compute_type(compute_type) {
  for (const DecoderLayerWeights& w : weights.layers) {
    // cross_kv runs once per search over every source position: a few times a step's rows.
    layers.push_back({PackedLinear(w.self_qkv_weight, w.self_qkv_bias, rows, compute_type),
                      PackedLinear(w.self_out_weight, w.self_out_bias, rows, compute_type),
                      PackedLinear(w.cross_q_weight, w.cross_q_bias, rows, compute_type),
                      PackedLinear(w.cross_kv_weight, w.cross_kv_bias, 8 * rows, compute_type),
                      PackedLinear(w.cross_out_weight, w.cross_out_bias, rows, compute_type),
                      PackedLinear(w.linear1_weight, w.linear1_bias, rows, compute_type),
                      PackedLinear(w.linear2_weight, w.linear2_bias, rows, compute_type)});
  }
}

bool DecoderLinears::float16_caches(const at::Device& device) const {
  return device.is_cpu() && compute_type != ComputeType::kFloat32 && cpu_loops().vector_float16;
}

void DecoderLinears::round_as_caches(const at::Tensor& rows) const {
  // bfloat16's layers give values of 8 significant bits, which float16 holds: only int8's need rounding. In place,
  // a vector at a time: ATen's round trip through a float16 copy took 2.6% of scoring's time (base model, 64
  // sentences, 2 threads, the Intel Xeon test CPU).
  if (compute_type != ComputeType::kInt8 || !float16_caches(rows.device())) return;
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kFloat && rows.stride(1) == 1,
              "round_as_caches takes float32 rows [n, width] with contiguous rows, got ", rows.scalar_type(), " ",
              rows.sizes(), " strided ", rows.strides());
  round_to_float16_cpu(rows.data_ptr<float>(), rows.size(0), rows.size(1), rows.stride(0));
}

std::shared_ptr<const DecoderLinears> DecoderLinears::with_output_shortlist(const DecoderWeights& weights,
                                                                           const at::Tensor& ids, int64_t rows) const {
  auto restricted = std::make_shared<DecoderLinears>(*this);  // the layers' converted weights are shared, not copied
  std::optional<at::Tensor> bias;
  if (weights.output_bias) bias = weights.output_bias->index_select(0, ids);
  restricted->output = PackedLinear(weights.output_weight.index_select(0, ids), bias, rows, compute_type,
                                    output_projection_takes_fbgemm());
  restricted->output_ids = ids;
  return restricted;
}

CachedDecoder::CachedDecoder(const at::Tensor& memory, const at::Tensor& src_lengths, DecoderWeights weights,
                             DecoderOptions options, int64_t beam_size, int64_t cache_len,
                             std::shared_ptr<const DecoderLinears> linears)
    : weights_(std::move(weights)),
      linears_(std::move(linears)),
      options_(std::move(options)),
      beam_size_(beam_size),
      cache_len_(cache_len) {
  c10::InferenceMode inference;
  TORCH_CHECK(memory.dim() == 3, "memory must be [n_sentences, src_len, d_model], got ", memory.sizes());
  TORCH_CHECK(beam_size >= 1 && cache_len >= 1, "beam_size and cache_len must be >= 1");
  activation_ = parse_activation(options_.activation);
  n_layers_ = static_cast<int64_t>(weights_.layers.size());
  const int64_t n_sentences = memory.size(0), src_len = memory.size(1);
  d_model_ = memory.size(2);
  const int64_t heads = options_.n_heads;
  TORCH_CHECK(heads >= 1 && d_model_ % heads == 0, "n_heads must divide d_model=", d_model_);
  const int64_t head_dim = d_model_ / heads;
  check_decoder_weights(weights_, options_, memory.device());
  TORCH_CHECK(cache_len <= weights_.positions.size(0), "cache_len=", cache_len, " exceeds max_positions=",
              weights_.positions.size(0));
  TORCH_CHECK(src_lengths.dim() == 1 && src_lengths.size(0) == n_sentences, "src_lengths must be [", n_sentences,
              "], got ", src_lengths.sizes());
  c10::DeviceGuard guard(memory.device());
  src_lengths_ = src_lengths.to(at::kInt).contiguous();
  n_slots_ = n_sentences * beam_size;
  if (!linears_) linears_ = std::make_shared<const DecoderLinears>(weights_, n_slots_);
  TORCH_CHECK(static_cast<int64_t>(linears_->layers.size()) == n_layers_, "the decoder's linears have ",
              linears_->layers.size(), " layers, its weights ", n_layers_);
  // Keys and values in float16 where float16_caches: the attention ops read half the bytes (self-attention's caches
  // are the search's largest reads besides the weights).
  const bool half = linears_->float16_caches(memory.device());
  const at::TensorOptions cache_options = half ? memory.options().dtype(at::kHalf) : memory.options();
  // Each layer's cross-attention keys/values, computed once, a head's positions one after another: read at every
  // step, they are faster so than as views of cross_kv's rows (cross_attention at 32 sentences: 5-14% slower), and
  // converted before they are permuted, the permuting pass moves half the bytes.
  const at::Tensor memory_rows = memory.reshape({n_sentences * src_len, d_model_});
  for (const DecoderLayerLinears& layer : linears_->layers) {
    cross_keys_values_.push_back(layer.cross_kv(memory_rows)
                                     .to(cache_options.dtype())
                                     .view({n_sentences, src_len, 2, heads, head_dim})
                                     .permute({2, 0, 3, 1, 4})
                                     .contiguous());
  }
  for (int64_t layer = 0; layer < n_layers_; ++layer) {
    k_cache_.push_back(at::empty({n_slots_, heads, cache_len, head_dim}, cache_options));
    v_cache_.push_back(at::empty_like(k_cache_.back()));
    // The search's first step decodes beam 0 only (search.cpp); a beam still empty after it reads its own slot at
    // position 0, which is then zeros rather than whatever the memory held.
    k_cache_.back().select(2, 0).zero_();
    v_cache_.back().select(2, 0).zero_();
  }
}


at::Tensor add_layer_norm(const at::Tensor& x, const at::Tensor& residual, const LayerNormWeights& norm) {
  auto cpu_float = [](const at::Tensor& t) { return t.is_cpu() && t.scalar_type() == at::kFloat; };
  const bool fused = cpu_float(x) && x.dim() == 2 && (!residual.defined() || (cpu_float(residual) &&
                     residual.sizes() == x.sizes())) && cpu_float(norm.weight) && cpu_float(norm.bias) &&
                     norm.weight.numel() == x.size(1) && norm.bias.numel() == x.size(1);
  if (!fused) {
    const at::Tensor sum = residual.defined() ? x + residual : x;
    return at::layer_norm(sum, {sum.size(-1)}, norm.weight, norm.bias, norm.eps);
  }
  const at::Tensor input = x.contiguous(), added = residual.defined() ? residual.contiguous() : residual;
  const at::Tensor gamma = norm.weight.contiguous(), beta = norm.bias.contiguous();
  at::Tensor out = at::empty_like(input);
  const int64_t rows = input.size(0), width = input.size(1);
  at::parallel_for(0, rows, rows_per_task(width), [&](int64_t first, int64_t end) {
    add_layer_norm_cpu(input.data_ptr<float>() + first * width,
                       added.defined() ? added.data_ptr<float>() + first * width : nullptr, end - first, width,
                       gamma.data_ptr<float>(), beta.data_ptr<float>(), static_cast<float>(norm.eps),
                       out.data_ptr<float>() + first * width);
  });
  return out;
}

at::Tensor decoder_layers(at::Tensor x, const DecoderWeights& weights, const DecoderLinears& linears,
                          const DecoderOptions& options, Activation activation, const DecoderBlock& self_block,
                          const DecoderBlock& cross_block) {
  auto layer_norm = [](const at::Tensor& y, const LayerNormWeights& norm) { return add_layer_norm(y, {}, norm); };
  for (int64_t layer = 0; layer < static_cast<int64_t>(weights.layers.size()); ++layer) {
    const DecoderLayerWeights& w = weights.layers[layer];
    const DecoderLayerLinears& linear = linears.layers[layer];
    auto feed_forward = [&](const at::Tensor& h) { return linear.linear2(linear.linear1(h, activation)); };
    if (options.norm_first) {
      x = x + self_block(layer_norm(x, w.norm1), layer);
      x = x + cross_block(layer_norm(x, w.norm2), layer);
      x = x + feed_forward(layer_norm(x, w.norm3));
    } else {
      x = add_layer_norm(x, self_block(x, layer), w.norm1);
      x = add_layer_norm(x, cross_block(x, layer), w.norm2);
      x = add_layer_norm(x, feed_forward(x), w.norm3);
    }
  }
  return weights.final_norm ? layer_norm(x, *weights.final_norm) : x;
}

at::Tensor CachedDecoder::self_block(const at::Tensor& h, int64_t layer, const at::Tensor& row_slots,
                                     const at::Tensor& indirection, const at::Tensor& step) {
  const DecoderLayerLinears& linear = linears_->layers[layer];
  const at::Tensor attended = self_attention_step(linear.self_qkv(h), k_cache_[layer], v_cache_[layer], indirection,
                                                  row_slots, beam_size_, step);
  return linear.self_out(attended);
}

at::Tensor CachedDecoder::cross_block(const at::Tensor& h, int64_t layer, const at::Tensor& row_slots,
                                      at::Tensor* query) {
  const DecoderLayerLinears& linear = linears_->layers[layer];
  const at::Tensor keys_values = cross_keys_values_[layer];
  const at::Tensor q = linear.cross_q(h);
  if (query) *query = q;
  const at::Tensor attended = cross_attention(q, keys_values[0], keys_values[1], src_lengths_, row_slots, beam_size_);
  return linear.cross_out(attended);
}

at::Tensor CachedDecoder::last_cross_attention(const at::Tensor& query, const at::Tensor& row_slots) const {
  const at::Tensor keys = cross_keys_values_[n_layers_ - 1][0].to(at::kFloat);  // [n_sentences, heads, src_len, hd]
  const int64_t n_sentences = keys.size(0), heads = keys.size(1), src_len = keys.size(2), head_dim = keys.size(3);
  const at::Tensor slots = row_slots.to(at::kLong);
  // Every slot's query (zero where no row has it), so that one batched product per sentence and head scores its
  // beams against its keys without copying them per row.
  at::Tensor queries = at::zeros({n_slots_, d_model_}, keys.options());
  queries.index_copy_(0, slots, query.to(at::kFloat));
  at::Tensor scores = at::matmul(queries.view({n_sentences, beam_size_, heads, head_dim}).transpose(1, 2),
                                 keys.transpose(2, 3))
                          .div_(std::sqrt(static_cast<double>(head_dim)));  // [n_sentences, heads, k, src_len]
  const at::Tensor padding = at::arange(src_len, src_lengths_.options()).ge(src_lengths_.unsqueeze(1));
  scores.masked_fill_(padding.view({n_sentences, 1, 1, src_len}), -std::numeric_limits<float>::infinity());
  return at::softmax(scores, -1).mean(1).reshape({n_slots_, src_len}).index_select(0, slots);
}

at::Tensor CachedDecoder::step(const at::Tensor& tokens, const at::Tensor& row_slots, const at::Tensor& indirection,
                               int64_t step) {
  TORCH_CHECK(step >= 0 && step < cache_len_, "step must be in [0, cache_len=", cache_len_, "), got ", step);
  return this->step(tokens, row_slots, indirection, step_tensor(step, tokens.device()));
}

at::Tensor CachedDecoder::step(const at::Tensor& tokens, const at::Tensor& row_slots, const at::Tensor& indirection,
                               const at::Tensor& step, at::Tensor* cross_attention) {
  return logits(hidden(tokens, row_slots, indirection, step, cross_attention));
}

at::Tensor CachedDecoder::hidden(const at::Tensor& tokens, const at::Tensor& row_slots,
                                 const at::Tensor& indirection, const at::Tensor& step, at::Tensor* cross_attention) {
  c10::InferenceMode inference;
  c10::DeviceGuard guard(tokens.device());
  check_step(step, cache_len_, tokens.device());
  TORCH_CHECK(tokens.dim() == 1 && tokens.numel() == row_slots.numel(), "tokens must be [n_rows=",
              row_slots.numel(), "], got ", tokens.sizes());
  // The model's embed(): embedding * embedding_scale + the position's sinusoid, in the same operation order. The
  // position is gathered on the device (a graph replays this step at every position).
  at::Tensor x = at::embedding(weights_.embedding, tokens).mul(options_.embedding_scale)
                     .add(at::index_select(weights_.positions, 0, step));
  at::Tensor last_query;
  x = decoder_layers(
      x, weights_, *linears_, options_, activation_,
      [&](const at::Tensor& h, int64_t layer) { return self_block(h, layer, row_slots, indirection, step); },
      [&](const at::Tensor& h, int64_t layer) {
        return cross_block(h, layer, row_slots, cross_attention && layer == n_layers_ - 1 ? &last_query : nullptr);
      });
  if (cross_attention) *cross_attention = last_cross_attention(last_query, row_slots);
  return x;
}

bool CachedDecoder::has_summary() const { return !linears_->output_ids && linears_->output.has_summary(); }

PackedLinear::Summary CachedDecoder::summarize(const at::Tensor& hidden, int64_t k, const std::vector<int64_t>& barred,
                                               bool with_log_totals, const at::Tensor& picked_ids) const {
  TORCH_CHECK(has_summary(), "summarize needs an output projection on a GEMM of fastformer's that summarizes (own "
              "int8, avx512-float32) and no shortlist");
  c10::InferenceMode inference;
  return linears_->output.summarize(hidden, k, barred, with_log_totals, picked_ids);
}

at::Tensor CachedDecoder::logits(const at::Tensor& x) const {
  c10::InferenceMode inference;
  c10::DeviceGuard guard(x.device());
  if (!linears_->output_ids) return linears_->output(x);
  // A shortlist's logits in their vocabulary columns: the search ranks and rules the vocabulary as without one.
  at::Tensor logits = at::full({x.size(0), weights_.output_weight.size(0)}, -std::numeric_limits<float>::infinity(),
                               x.options().dtype(at::kFloat));
  return logits.index_copy_(1, *linears_->output_ids, linears_->output(x));
}

}  // namespace fastformer
