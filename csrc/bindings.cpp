// fastformer._C: the torch ops fastformer::{self_attention_step, cross_attention, beam_step} (CPU, CUDA and Meta
// kernels) and the pybind11 module with the whole beam search and the incremental decoder.
#include <torch/extension.h>
#include <torch/library.h>

#include "beam_ops.h"
#include "decoder.h"

namespace fastformer {
namespace {

void beam_step_op(const at::Tensor& logits, const at::Tensor& active, const at::Tensor& max_lens,
                  at::TensorList state, int64_t step, int64_t beam_size, int64_t min_len, int64_t pad_id,
                  int64_t bos_id, int64_t eos_id, double length_penalty) {
  beam_step(logits, active, max_lens, state.vec(), step,
            SearchOptions{beam_size, length_penalty, min_len, pad_id, bos_id, eos_id});
}

at::Tensor self_attention_step_meta(const at::Tensor& qkv, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, int64_t, int64_t) {
  return at::empty({qkv.size(0), qkv.size(1) / 3}, qkv.options());
}

at::Tensor cross_attention_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, int64_t) {
  return at::empty_like(q);
}

void beam_step_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::TensorList, int64_t, int64_t,
                    int64_t, int64_t, int64_t, int64_t, double) {}

}  // namespace
}  // namespace fastformer

TORCH_LIBRARY(fastformer, m) {
  m.def("self_attention_step(Tensor qkv, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor indirection, "
        "Tensor row_slots, int beam_size, int step) -> Tensor");
  m.def("cross_attention(Tensor q, Tensor k, Tensor v, Tensor src_lengths, Tensor row_slots, int beam_size) "
        "-> Tensor");
  m.def("beam_step(Tensor logits, Tensor active, Tensor max_lens, Tensor(a!)[] state, int step, int beam_size, "
        "int min_len, int pad_id, int bos_id, int eos_id, float length_penalty) -> ()");
}

TORCH_LIBRARY_IMPL(fastformer, CPU, m) {
  m.impl("self_attention_step", &fastformer::self_attention_step);
  m.impl("cross_attention", &fastformer::cross_attention);
  m.impl("beam_step", &fastformer::beam_step_op);
}

#ifdef FASTFORMER_WITH_CUDA
TORCH_LIBRARY_IMPL(fastformer, CUDA, m) {
  m.impl("self_attention_step", &fastformer::self_attention_step);
  m.impl("cross_attention", &fastformer::cross_attention);
  m.impl("beam_step", &fastformer::beam_step_op);
}
#endif

TORCH_LIBRARY_IMPL(fastformer, Meta, m) {
  m.impl("self_attention_step", &fastformer::self_attention_step_meta);
  m.impl("cross_attention", &fastformer::cross_attention_meta);
  m.impl("beam_step", &fastformer::beam_step_meta);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using fastformer::CachedDecoder;
  m.doc() = "fastformer's compiled incremental beam search (see csrc/decoder.h)";
  // The CUDA kernels' limits, so that Python rejects an unsupported call up front with a clear error.
  m.attr("max_cuda_beam_size") = fastformer::kMaxCudaBeamSize;
  m.attr("max_cuda_head_dim") = fastformer::kMaxCudaHeadDim;
  m.attr("max_cuda_key_length") = fastformer::kMaxCudaKeyLength;
  m.attr("with_cuda") =
#ifdef FASTFORMER_WITH_CUDA
      true;
#else
      false;
#endif
  m.def(
      "beam_search",
      [](const at::Tensor& memory, const at::Tensor& src_lengths, std::vector<at::Tensor> weights, int64_t n_heads,
         bool norm_first, bool gelu, std::vector<double> norm_eps, int64_t beam_size, double length_penalty,
         std::vector<int64_t> max_lens, int64_t min_len, int64_t n_best, int64_t pad_id, int64_t bos_id,
         int64_t eos_id) {
        py::gil_scoped_release no_gil;
        return fastformer::beam_search(
            memory, src_lengths, std::move(weights),
            fastformer::DecoderOptions{n_heads, norm_first, gelu, std::move(norm_eps)},
            fastformer::SearchOptions{beam_size, length_penalty, min_len, pad_id, bos_id, eos_id}, max_lens, n_best);
      },
      "memory [n_sentences, src_len, d_model], src_lengths [n_sentences], the decoder's weights (decoder.h) -> per "
      "sentence up to n_best (tokens, score), best first",
      py::arg("memory"), py::arg("src_lengths"), py::arg("weights"), py::arg("n_heads"), py::arg("norm_first"),
      py::arg("gelu"), py::arg("norm_eps"), py::arg("beam_size"), py::arg("length_penalty"), py::arg("max_lens"),
      py::arg("min_len"), py::arg("n_best"), py::arg("pad_id"), py::arg("bos_id"), py::arg("eos_id"));
  py::class_<CachedDecoder>(m, "CachedDecoder",
                            "The decoder one position at a time over a preallocated KV cache (decoder.h)")
      .def(py::init([](const at::Tensor& memory, const at::Tensor& src_lengths, std::vector<at::Tensor> weights,
                       int64_t n_heads, bool norm_first, bool gelu, std::vector<double> norm_eps, int64_t beam_size,
                       int64_t cache_len) {
             return new CachedDecoder(memory, src_lengths, std::move(weights),
                                      fastformer::DecoderOptions{n_heads, norm_first, gelu, std::move(norm_eps)},
                                      beam_size, cache_len);
           }),
           py::arg("memory"), py::arg("src_lengths"), py::arg("weights"), py::arg("n_heads"), py::arg("norm_first"),
           py::arg("gelu"), py::arg("norm_eps"), py::arg("beam_size"), py::arg("cache_len"))
      .def("step", &CachedDecoder::step, py::arg("tokens"), py::arg("row_slots"), py::arg("indirection"),
           py::arg("step"),
           "tokens [n_rows], row_slots [n_rows] int32, indirection [n_slots, cache_len] int32 -> logits [n_rows, "
           "vocab]")
      .def_property_readonly("n_slots", &CachedDecoder::n_slots)
      .def_property_readonly("cache_len", &CachedDecoder::cache_len);
}
