// The incremental decoder, the beam-search loop, and the ATen wrappers of the fused ops (see decoder.h).
#include "decoder.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <tuple>

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

void run_cpu(const SelfAttentionArgs& args) { self_attention_step_cpu(args); }
void run_cpu(const CrossAttentionArgs& args) { cross_attention_cpu(args); }
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

// Checks of a beam step's inputs against the state's shapes (the state may have room for more rows than active).
void check_beam_step_inputs(const at::Tensor& logits, const at::Tensor& active, const at::Tensor& max_lens,
                            const BeamState& state, int64_t step, const SearchOptions& options) {
  const int64_t k = options.beam_size, n_sentences = state.finished_count.numel(), n_slots = n_sentences * k;
  const int64_t n_active = active.numel(), cache_len = state.indirection_in().size(1);
  const at::Device device = logits.device();
  TORCH_CHECK(k >= 1, "beam_size must be >= 1, got ", k);
  TORCH_CHECK(!logits.is_cuda() || k <= kMaxCudaBeamSize, "beam_size must be <= ", kMaxCudaBeamSize,
              " on CUDA, got ", k);
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == n_active * k && logits.is_contiguous(),
              "logits must be a contiguous [n_active * beam_size=", n_active * k, ", vocab], got ", logits.sizes());
  TORCH_CHECK(step >= 0 && step < cache_len, "step must be in [0, cache_len=", cache_len, "), got ", step);
  TORCH_CHECK(options.pad_id >= 0 && options.bos_id >= 0 && options.eos_id >= 0 &&
                  std::max({options.pad_id, options.bos_id, options.eos_id}) < logits.size(1),
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

BeamStepArgs beam_step_args(const at::Tensor& logits, const at::Tensor& active, const at::Tensor& max_lens,
                            BeamState& state, int64_t step, const SearchOptions& options) {
  BeamStepArgs args{};
  args.logits = logits.data_ptr();
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
  args.vocab = static_cast<int>(logits.size(1));
  args.beam_size = static_cast<int>(options.beam_size);
  args.cache_len = static_cast<int>(state.indirection_in().size(1));
  args.step = static_cast<int>(step);
  args.min_len = static_cast<int>(options.min_len);
  args.pad_id = static_cast<int>(options.pad_id);
  args.bos_id = static_cast<int>(options.bos_id);
  args.eos_id = static_cast<int>(options.eos_id);
  args.length_penalty = options.length_penalty;
  args.length_penalty_form = parse_length_penalty_form(options.length_penalty_form);
  return args;
}

Activation parse_activation(const std::string& name) {
  if (name == "relu") return Activation::kRelu;
  if (name == "gelu") return Activation::kGelu;
  if (name == "swish") return Activation::kSwish;
  TORCH_CHECK(false, "the compiled decoder takes activation \"relu\", \"gelu\" or \"swish\", got \"", name, "\"");
}

// The sentences still searching, on the host and the device, and their rows' slots (row a * k + j is slot
// active[a] * k + j).
class ActiveSentences {
 public:
  ActiveSentences(int64_t n_sentences, int64_t beam_size, const at::Device& device)
      : sentences_(n_sentences), beam_size_(beam_size), device_(device) {
    std::iota(sentences_.begin(), sentences_.end(), 0);
    upload();
  }

  bool empty() const { return sentences_.empty(); }
  const at::Tensor& on_device() const { return on_device_; }     // [n_active] int32
  const at::Tensor& row_slots() const { return row_slots_; }     // [n_active * beam_size] int32
  const at::Tensor& row_slots_long() const { return row_slots_long_; }

  // Drops the sentences whose `done` flag is set. The one host sync of a step.
  void drop_done(const at::Tensor& done) {
    const at::Tensor flags = done.index_select(0, on_device_.to(at::kLong)).cpu();
    const int32_t* is_done = flags.data_ptr<int32_t>();
    if (std::none_of(is_done, is_done + sentences_.size(), [](int32_t d) { return d != 0; })) return;
    std::vector<int32_t> still_active;
    for (size_t a = 0; a < sentences_.size(); ++a) {
      if (!is_done[a]) still_active.push_back(sentences_[a]);
    }
    sentences_ = std::move(still_active);
    if (!sentences_.empty()) upload();
  }

 private:
  void upload() {
    on_device_ = at::tensor(sentences_, at::kInt).to(device_);
    row_slots_ = (on_device_.unsqueeze(1) * beam_size_ + at::arange(beam_size_, on_device_.options())).view({-1});
    row_slots_long_ = row_slots_.to(at::kLong);
  }

  std::vector<int32_t> sentences_;
  int64_t beam_size_;
  at::Device device_;
  at::Tensor on_device_, row_slots_, row_slots_long_;
};

// Steps the decoder and the search until every sentence is done.
void run_search(CachedDecoder& decoder, BeamState& state, const at::Tensor& max_lens, const SearchOptions& options) {
  const int64_t n_sentences = state.finished_count.numel();
  ActiveSentences active(n_sentences, options.beam_size, state.sums.device());
  for (int64_t step = 0; step < decoder.cache_len() && !active.empty(); ++step) {
    const at::Tensor logits = decoder.step(state.tokens.index_select(0, active.row_slots_long()),
                                           active.row_slots(), state.indirection_in(), step);
    beam_step(logits, active.on_device(), max_lens, state, step, options);
    state.swap_indirection();
    active.drop_done(state.done);
  }
  TORCH_CHECK(active.empty(), "internal error: the search ended with sentences still searching");
}

// Each sentence's finished hypotheses, back-tracked through the history: best score first, ties in finishing
// order, at most n_best. The state's sentence 0 is the batch's sentence first_sentence.
std::vector<Hypotheses> backtrack(const BeamState& state, int64_t beam_size, int64_t n_best, int64_t first_sentence) {
  const at::Tensor count = state.finished_count.cpu(), scores = state.finished_scores.cpu();
  const at::Tensor steps = state.finished_steps.cpu(), beams = state.finished_beams.cpu();
  const at::Tensor history_tokens = state.history_tokens.cpu(), history_beams = state.history_beams.cpu();
  const int32_t* tokens_at = history_tokens.data_ptr<int32_t>();
  const int32_t* beams_at = history_beams.data_ptr<int32_t>();
  const int64_t k = beam_size, n_sentences = count.numel(), n_slots = n_sentences * k;
  std::vector<Hypotheses> results(n_sentences);
  for (int64_t s = 0; s < n_sentences; ++s) {
    const int n_finished = count.data_ptr<int32_t>()[s];
    // Finite scores always finish a hypothesis (EOS is forced at max_len); none means NaN or inf scores.
    TORCH_CHECK(n_finished > 0, "beam search found no hypothesis for sentence ", first_sentence + s,
                ": the model's scores are not finite (NaN or inf in its weights or activations)");
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
  run_fused_op("self_attention_step", qkv, args);
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
  run_fused_op("cross_attention", q, args);
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
  indirection_[1] = at::empty_like(indirection_[0]);
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

void beam_step(const at::Tensor& logits, const at::Tensor& active, const at::Tensor& max_lens, BeamState& state,
               int64_t step, const SearchOptions& options) {
  check_beam_step_inputs(logits, active, max_lens, state, step, options);
  run_fused_op("beam_step", logits, beam_step_args(logits, active, max_lens, state, step, options));
}

namespace {

// torch's oneDNN linear ops, where this torch build has them (looked up once).
struct OneDnnLinearOps {
  std::optional<c10::OperatorHandle> reorder_weight, linear;
};

const OneDnnLinearOps& onednn_linear_ops() {
  static const OneDnnLinearOps ops{c10::Dispatcher::singleton().findSchema({"mkldnn::_reorder_linear_weight", ""}),
                                   c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""})};
  return ops;
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

at::Tensor apply_activation(at::Tensor x, std::optional<Activation> activation) {
  if (!activation) return x;
  switch (*activation) {
    case Activation::kRelu: return at::relu_(x);
    case Activation::kGelu: return at::gelu(x);
    case Activation::kSwish: return at::silu_(x);
  }
  return x;
}

}  // namespace

DecoderLinear::DecoderLinear(const at::Tensor& weight, const std::optional<at::Tensor>& bias, int64_t rows)
    : weight_(weight), bias_(bias) {
  const OneDnnLinearOps& ops = onednn_linear_ops();
  if (!weight.is_cpu() || weight.scalar_type() != at::kFloat || !ops.reorder_weight || !ops.linear) return;
  std::vector<c10::IValue> stack{weight.contiguous(), rows};
  ops.reorder_weight->callBoxed(stack);
  weight_ = stack[0].toTensor();
  onednn_ = true;
}

at::Tensor DecoderLinear::operator()(const at::Tensor& x, std::optional<Activation> activation) const {
  if (!onednn_) return apply_activation(at::linear(x, weight_, bias_), activation);
  // The activation is not fused: oneDNN's ReLU turns NaN into 0, and a NaN must reach the search's finite check.
  std::vector<c10::IValue> stack{x.contiguous(), weight_, bias_ ? c10::IValue(*bias_) : c10::IValue(),
                                 std::string("none"), c10::List<std::optional<at::Scalar>>(), c10::IValue()};
  onednn_linear_ops().linear->callBoxed(stack);
  return apply_activation(stack[0].toTensor(), activation);
}

DecoderLinears::DecoderLinears(const DecoderWeights& weights, int64_t rows)
    : output(weights.output_weight, weights.output_bias, rows) {
  for (const DecoderLayerWeights& w : weights.layers) {
    layers.push_back({DecoderLinear(w.self_qkv_weight, w.self_qkv_bias, rows),
                      DecoderLinear(w.self_out_weight, w.self_out_bias, rows),
                      DecoderLinear(w.cross_q_weight, w.cross_q_bias, rows),
                      DecoderLinear(w.cross_out_weight, w.cross_out_bias, rows),
                      DecoderLinear(w.linear1_weight, w.linear1_bias, rows),
                      DecoderLinear(w.linear2_weight, w.linear2_bias, rows)});
  }
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
  // Each layer's cross-attention keys/values: [2, n_sentences, heads, src_len, head_dim], computed once.
  std::vector<at::Tensor> keys_values;
  for (const DecoderLayerWeights& layer : weights_.layers) {
    keys_values.push_back(at::linear(memory, layer.cross_kv_weight, layer.cross_kv_bias)
                              .view({n_sentences, src_len, 2, heads, head_dim})
                              .permute({2, 0, 3, 1, 4}));
  }
  cross_keys_values_ = at::stack(keys_values).contiguous();
  k_cache_ = at::empty({n_layers_, n_slots_, heads, cache_len, head_dim}, memory.options());
  v_cache_ = at::empty_like(k_cache_);
  if (!linears_) linears_ = std::make_shared<const DecoderLinears>(weights_, n_slots_);
}


at::Tensor CachedDecoder::layer_norm(const at::Tensor& x, const LayerNormWeights& norm) const {
  return at::layer_norm(x, {d_model_}, norm.weight, norm.bias, norm.eps);
}

at::Tensor CachedDecoder::self_block(const at::Tensor& h, int64_t layer, const at::Tensor& row_slots,
                                     const at::Tensor& indirection, int64_t step) {
  const DecoderLayerLinears& linear = linears_->layers[layer];
  const at::Tensor attended = self_attention_step(linear.self_qkv(h), k_cache_[layer], v_cache_[layer], indirection,
                                                  row_slots, beam_size_, step);
  return linear.self_out(attended);
}

at::Tensor CachedDecoder::cross_block(const at::Tensor& h, int64_t layer, const at::Tensor& row_slots) {
  const DecoderLayerLinears& linear = linears_->layers[layer];
  const at::Tensor keys_values = cross_keys_values_[layer];
  const at::Tensor attended =
      cross_attention(linear.cross_q(h), keys_values[0], keys_values[1], src_lengths_, row_slots, beam_size_);
  return linear.cross_out(attended);
}

at::Tensor CachedDecoder::feed_forward(const at::Tensor& h, int64_t layer) const {
  const DecoderLayerLinears& linear = linears_->layers[layer];
  return linear.linear2(linear.linear1(h, activation_));
}

at::Tensor CachedDecoder::step(const at::Tensor& tokens, const at::Tensor& row_slots, const at::Tensor& indirection,
                               int64_t step) {
  c10::InferenceMode inference;
  c10::DeviceGuard guard(tokens.device());
  TORCH_CHECK(step >= 0 && step < cache_len_, "step must be in [0, cache_len=", cache_len_, "), got ", step);
  TORCH_CHECK(tokens.dim() == 1 && tokens.numel() == row_slots.numel(), "tokens must be [n_rows=",
              row_slots.numel(), "], got ", tokens.sizes());
  // The model's embed(): embedding * embedding_scale + the position's sinusoid, in the same operation order.
  at::Tensor x = at::embedding(weights_.embedding, tokens).mul(options_.embedding_scale).add(weights_.positions[step]);
  for (int64_t layer = 0; layer < n_layers_; ++layer) {
    const DecoderLayerWeights& w = weights_.layers[layer];
    if (options_.norm_first) {
      x = x + self_block(layer_norm(x, w.norm1), layer, row_slots, indirection, step);
      x = x + cross_block(layer_norm(x, w.norm2), layer, row_slots);
      x = x + feed_forward(layer_norm(x, w.norm3), layer);
    } else {
      x = layer_norm(x + self_block(x, layer, row_slots, indirection, step), w.norm1);
      x = layer_norm(x + cross_block(x, layer, row_slots), w.norm2);
      x = layer_norm(x + feed_forward(x, layer), w.norm3);
    }
  }
  if (weights_.final_norm) x = layer_norm(x, *weights_.final_norm);
  return linears_->output(x);
}

namespace {

// The search over the batch's sentences [begin, end) of memory [n_sentences, src_len, d_model].
std::vector<Hypotheses> search_sentences(const at::Tensor& memory, const at::Tensor& src_lengths,
                                         const DecoderWeights& weights, const DecoderOptions& decoder_options,
                                         const std::shared_ptr<const DecoderLinears>& linears,
                                         const SearchOptions& search_options, const std::vector<int64_t>& max_lens,
                                         int64_t n_best, int64_t begin, int64_t end) {
  const at::Tensor group_memory = memory.narrow(0, begin, end - begin);
  const std::vector<int64_t> group_max_lens(max_lens.begin() + begin, max_lens.begin() + end);
  const int64_t k = search_options.beam_size;
  const int64_t cache_len = *std::max_element(group_max_lens.begin(), group_max_lens.end()) + 1;
  CachedDecoder decoder(group_memory, src_lengths.narrow(0, begin, end - begin), weights, decoder_options, k,
                        cache_len, linears);
  BeamState state(end - begin, k, cache_len, search_options.bos_id, memory.device());
  run_search(decoder, state, at::tensor(group_max_lens, at::kLong).to(memory.device(), at::kInt), search_options);
  return backtrack(state, k, n_best, begin);
}

// How many groups of sentences the CPU search runs side by side: one per intra-op thread, each group at least
// kMinSentencesPerGroup sentences so that its GEMMs keep enough rows.
int64_t cpu_sentence_groups(int64_t n_sentences) {
  constexpr int64_t kMinSentencesPerGroup = 4;
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_sentences / kMinSentencesPerGroup));
}

}  // namespace

std::vector<Hypotheses> beam_search(const at::Tensor& memory, const at::Tensor& src_lengths, DecoderWeights weights,
                                    const DecoderOptions& decoder_options, const SearchOptions& search_options,
                                    const std::vector<int64_t>& max_lens, int64_t n_best) {
  c10::InferenceMode inference;
  c10::DeviceGuard guard(memory.device());
  TORCH_CHECK(memory.dim() == 3, "memory must be [n_sentences, src_len, d_model], got ", memory.sizes());
  const int64_t n_sentences = memory.size(0), k = search_options.beam_size;
  TORCH_CHECK(static_cast<int64_t>(max_lens.size()) == n_sentences, "max_lens must have one entry per sentence");
  TORCH_CHECK(n_best >= 1 && n_best <= k, "n_best must be in [1, beam_size]");
  if (n_sentences == 0) return {};
  const int64_t n_groups = memory.is_cuda() ? 1 : cpu_sentence_groups(n_sentences);
  const int64_t rows_per_group = (n_sentences + n_groups - 1) / n_groups * k;
  check_decoder_weights(weights, decoder_options, memory.device());
  const auto linears = std::make_shared<const DecoderLinears>(weights, rows_per_group);
  if (n_groups == 1) {
    return search_sentences(memory, src_lengths, weights, decoder_options, linears, search_options, max_lens, n_best,
                            0, n_sentences);
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
          search_sentences(memory, src_lengths, weights, decoder_options, linears, search_options, max_lens, n_best,
                           begin, end);
      std::move(group_results.begin(), group_results.end(), results.begin() + begin);
    }
  });
  return results;
}

}  // namespace fastformer
