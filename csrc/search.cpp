// The beam-search loop over the compiled decoder (decoder.h's beam_search): groups of sentences on the CPU's
// threads, the batch of rows shrinking as sentences finish (SearchOptions::shrink), the CUDA graphs of the bucketed
// step, and the back-tracking of the finished hypotheses.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
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
  at::Tensor active;          // [n_active] int32
  at::Tensor row_slots;       // [n_active * beam_size] int32
  at::Tensor row_slots_long;  // the same as int64, for index_select
};

// One step of the search over `rows` at state.step: the decoder's logits, then beam_step (the indirection written,
// the step not advanced).
void decode_step(CachedDecoder& decoder, BeamState& state, const Rows& rows, const at::Tensor& max_lens,
                 const SearchOptions& options) {
  const at::Tensor logits = decoder.step(state.tokens.index_select(0, rows.row_slots_long), rows.row_slots,
                                         state.indirection_in(), state.step);
  beam_step(logits, rows.active, max_lens, state, options);
}

// Step 0 of the search: only beam 0 of each sentence holds a hypothesis (BeamState), so only its rows are decoded
// (a beam_size-th of the step's work); beam_step skips the other rows for their -inf sums, and reads zeros there.
void decode_first_step(CachedDecoder& decoder, BeamState& state, const Rows& rows, const at::Tensor& max_lens,
                       const SearchOptions& options) {
  const int64_t k = options.beam_size;
  if (k == 1) return decode_step(decoder, state, rows, max_lens, options);
  const at::Tensor first_beams = rows.row_slots.view({-1, k}).select(1, 0).contiguous();
  const at::Tensor first_logits = decoder.step(state.tokens.index_select(0, first_beams.to(at::kLong)), first_beams,
                                               state.indirection_in(), state.step);
  const int64_t vocab = first_logits.size(1);
  at::Tensor logits = at::zeros({rows.row_slots.numel(), vocab}, first_logits.options());
  logits.view({-1, k, vocab}).select(1, 0).copy_(first_logits);
  beam_step(logits, rows.active, max_lens, state, options);
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
                       const SearchOptions& options) {
  const at::Device device = state.sums.device();
  std::vector<int32_t> searching = every_sentence(state.finished_count.numel());
  Rows rows(searching, options.beam_size, device);
  for (int64_t step = 0; step < decoder.cache_len() && !searching.empty(); ++step) {
    (step == 0 ? decode_first_step : decode_step)(decoder, state, rows, max_lens, options);
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
                       const SearchOptions& options) {
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
    // Step 0 is the first bucket's first run, which runs eagerly on CUDA too: no graph holds decode_first_step.
    steps.run(static_cast<int64_t>(sentences.size()), [&] {
      (step == 0 ? decode_first_step : decode_step)(decoder, state, rows, max_lens, options);
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
  const at::Tensor max_lens_tensor = at::tensor(group_max_lens, at::kLong).to(memory.device(), at::kInt);
  if (in_buckets) {
    search_in_buckets(decoder, state, max_lens_tensor, search_options);
  } else {
    search_every_step(decoder, state, max_lens_tensor, search_options);
  }
  return backtrack(state, k, n_best, begin);
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

// One group per intra-op thread, each group at least kMinSentencesPerGroup sentences so that its GEMMs keep enough
// rows.
int64_t cpu_sentence_groups(int64_t n_sentences) {
  constexpr int64_t kMinSentencesPerGroup = 4;
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_sentences / kMinSentencesPerGroup));
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
  if (n_sentences == 0) return {};
#ifdef FASTFORMER_WITH_CUDA
  std::optional<SearchStream> search_stream;
  if (memory.is_cuda()) search_stream.emplace(memory.device());
#endif
  const int64_t n_groups = memory.is_cuda() ? 1 : cpu_sentence_groups(n_sentences);
  const int64_t rows_per_group = (n_sentences + n_groups - 1) / n_groups * k;
  check_decoder_weights(weights, decoder_options, memory.device());
  if (!linears) linears = std::make_shared<const DecoderLinears>(weights, rows_per_group);
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
