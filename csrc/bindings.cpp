// fastformer._C: the torch ops fastformer::{self_attention_step, cross_attention} (CPU, CUDA and Meta kernels) and
// the pybind11 module with the whole beam search, teacher-forced scoring, the incremental decoder and their named
// argument structs.
#include <torch/extension.h>
#include <torch/library.h>

#include <optional>
#include <set>
#include <string>
#include <vector>

#include "beam_ops.h"
#include "decoder.h"
#include "encoder.h"
#include "int8_gemm.h"
#include "linear.h"

namespace fastformer {
namespace {

at::Tensor self_attention_step_meta(const at::Tensor& qkv, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const at::Tensor&, int64_t, int64_t) {
  return at::empty({qkv.size(0), qkv.size(1) / 3}, qkv.options());
}

at::Tensor cross_attention_meta(const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, int64_t) {
  return at::empty_like(q);
}

// The op's form of self_attention_step: the step as an int (the compiled search passes a tensor, see decoder.h).
at::Tensor (*const self_attention_step_op)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                           const at::Tensor&, int64_t, int64_t) = &self_attention_step;

// The argument structs of decoder.h as Python classes with named, writable fields (unknown names are rejected).
void bind_structs(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<LayerNormWeights>(m, "LayerNormWeights", "weight and bias [d_model], eps")
      .def(py::init<>())
      .def_readwrite("weight", &LayerNormWeights::weight)
      .def_readwrite("bias", &LayerNormWeights::bias)
      .def_readwrite("eps", &LayerNormWeights::eps);
  py::class_<DecoderLayerWeights> layer(m, "DecoderLayerWeights", "one decoder layer's tensors (decoder.h)");
  layer.def(py::init<>());
#define FASTFORMER_BIND_FIELD(name) layer.def_readwrite(#name, &DecoderLayerWeights::name);
  FASTFORMER_DECODER_LAYER_TENSORS(FASTFORMER_BIND_FIELD)
#undef FASTFORMER_BIND_FIELD
  layer.def_readwrite("norm1", &DecoderLayerWeights::norm1)
      .def_readwrite("norm2", &DecoderLayerWeights::norm2)
      .def_readwrite("norm3", &DecoderLayerWeights::norm3);
  py::class_<DecoderWeights>(m, "DecoderWeights", "the decoder's layers and global tensors (decoder.h)")
      .def(py::init<>())
      .def_readwrite("layers", &DecoderWeights::layers)
      .def_readwrite("embedding", &DecoderWeights::embedding)
      .def_readwrite("positions", &DecoderWeights::positions)
      .def_readwrite("output_weight", &DecoderWeights::output_weight)
      .def_readwrite("output_bias", &DecoderWeights::output_bias)
      .def_readwrite("final_norm", &DecoderWeights::final_norm);
  py::class_<EncoderLayerWeights> encoder_layer(m, "EncoderLayerWeights", "one encoder layer's tensors (encoder.h)");
  encoder_layer.def(py::init<>());
#define FASTFORMER_BIND_FIELD(name) encoder_layer.def_readwrite(#name, &EncoderLayerWeights::name);
  FASTFORMER_ENCODER_LAYER_TENSORS(FASTFORMER_BIND_FIELD)
#undef FASTFORMER_BIND_FIELD
  encoder_layer.def_readwrite("norm1", &EncoderLayerWeights::norm1).def_readwrite("norm2", &EncoderLayerWeights::norm2);
  py::class_<EncoderWeights>(m, "EncoderWeights", "the encoder's layers and final norm (encoder.h)")
      .def(py::init<>())
      .def_readwrite("layers", &EncoderWeights::layers)
      .def_readwrite("final_norm", &EncoderWeights::final_norm);
  py::class_<DecoderOptions>(m, "DecoderOptions", "the decoder's hyperparameters (decoder.h)")
      .def(py::init<>())
      .def_readwrite("n_heads", &DecoderOptions::n_heads)
      .def_readwrite("norm_first", &DecoderOptions::norm_first)
      .def_readwrite("activation", &DecoderOptions::activation)
      .def_readwrite("embedding_scale", &DecoderOptions::embedding_scale);
  py::class_<SearchOptions>(m, "SearchOptions", "the beam search's rules (decoder.h)")
      .def(py::init<>())
      .def_readwrite("beam_size", &SearchOptions::beam_size)
      .def_readwrite("length_penalty", &SearchOptions::length_penalty)
      .def_readwrite("length_penalty_form", &SearchOptions::length_penalty_form)
      .def_readwrite("min_len", &SearchOptions::min_len)
      .def_readwrite("pad_id", &SearchOptions::pad_id)
      .def_readwrite("bos_id", &SearchOptions::bos_id)
      .def_readwrite("eos_id", &SearchOptions::eos_id)
      .def_readwrite("shrink", &SearchOptions::shrink)
      .def_readwrite("return_scores", &SearchOptions::return_scores)
      .def_readwrite("return_attention", &SearchOptions::return_attention)
      .def_readwrite("sampling_topk", &SearchOptions::sampling_topk)
      .def_readwrite("sampling_topp", &SearchOptions::sampling_topp)
      .def_readwrite("sampling_temperature", &SearchOptions::sampling_temperature)
      .def_readwrite("sampling_keys", &SearchOptions::sampling_keys)
      .def_readwrite("target_prefix", &SearchOptions::target_prefix)
      .def_readwrite("vocabulary", &SearchOptions::vocabulary)
      .def_readwrite("no_repeat_ngram_size", &SearchOptions::no_repeat_ngram_size)
      .def_readwrite("repetition_penalty", &SearchOptions::repetition_penalty);
}

// The converted linear layers (linear.h, encoder.h, decoder.h): made once, kept by fastformer/decoding/search.py.
// An undefined tensor as None.
std::optional<at::Tensor> optional_tensor(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

void bind_compiled(pybind11::module_& m) {
  namespace py = pybind11;
  auto compute_type = [](const std::string& name) { return parse_compute_type(name); };
  m.def("output_projection_takes_fbgemm", &output_projection_takes_fbgemm,
        "whether the decoder's int8 output projection may take FBGEMM's GEMM (decoder.h)");
  m.def("int8_gemm_runs", &int8_gemm_runs,
        "whether int8 linear layers run one of fastformer's own GEMMs here: AMX's, AVX512-VNNI's, AVX-VNNI's, or "
        "AVX2's on CPUs without VNNI; FASTFORMER_CPU_ISA caps them (int8_gemm.h)");
  m.def("cpu_has_amx", &cpu_has_amx,
        "whether int8 linear layers in the AVX-512 loops run the AMX GEMM here: the CPU has AMX-INT8, Linux grants "
        "the tile registers, and FASTFORMER_CPU_AMX is not 0 (int8_gemm.h)");
  m.def("int8_activation_max", &int8_activation_max,
        "the int8 activations' steps a side: 127 on CPUs with VNNI, else 63 (linear.h)");
  m.def("logits_rows_per_block", &logits_rows_per_block, py::arg("vocab"),
        "the rows of logits a CPU search or scoring makes and reads at a time for a vocabulary's width (decoder.h)");
  m.def("scoring_summary_rows", &scoring_summary_rows,
        "the target positions CPU scoring summarizes in one call of its output projection's summary (decoder.h)");
  m.def("cpu_sentence_groups", [=](int64_t n_sentences, int64_t rows, const std::string& type, int64_t threads) {
        return cpu_sentence_groups(n_sentences, rows, compute_type(type), threads);
      }, py::arg("n_sentences"), py::arg("rows"), py::arg("compute_type"), py::arg("threads"),
        "the groups of sentences a CPU search or scoring runs side by side, one a thread: rows, its GEMMs' rows a "
        "step (sentences times beams) (decoder.h)");
  m.def("cpu_isa", [] { return std::string(cpu_loops().isa); },
        "the instruction set of the CPU ops' hand-written loops: the widest this CPU runs, or FASTFORMER_CPU_ISA's");
  m.def("cpu_isas", [] {
        std::vector<std::string> names;
        for (const CpuLoops* loops : cpu_isas()) names.emplace_back(loops->isa);
        return names;
      }, "the instruction sets this build has loops for and this CPU runs, widest first (beam_ops.h)");
  py::class_<PackedLinear>(m, "PackedLinear", "y = x W^T + b with W converted once for a compute type (linear.h)")
      .def(py::init([=](const at::Tensor& weight, const std::optional<at::Tensor>& bias, int64_t rows,
                        const std::string& type, bool fbgemm, bool own_gemm) {
             c10::InferenceMode inference;
             return PackedLinear(weight, bias, rows, compute_type(type), fbgemm, own_gemm);
           }),
           py::arg("weight"), py::arg("bias"), py::arg("rows"), py::arg("compute_type"), py::arg("fbgemm") = true,
           py::arg("own_gemm") = true,
           "own_gemm=False: int8 takes FBGEMM's GEMM rather than fastformer's own (int8_gemm.h) where that runs, "
           "float32 oneDNN's rather than fastformer's own (float32_gemm.h); fbgemm=False then: int8 takes oneDNN's, "
           "as where torch has no FBGEMM")
      .def("__call__", [](const PackedLinear& linear, const at::Tensor& x) {
        c10::InferenceMode inference;
        return linear(x);
      }, py::arg("x"), "x [rows, in] float32 -> [rows, out] float32")
      .def("summarize", [](const PackedLinear& linear, const at::Tensor& x, int64_t k,
                           const std::vector<int64_t>& barred, bool log_totals,
                           const std::optional<at::Tensor>& picked_ids) {
        c10::InferenceMode inference;
        const PackedLinear::Summary s = linear.summarize(x, k, barred, log_totals, picked_ids.value_or(at::Tensor()));
        return py::dict(py::arg("values") = s.values, py::arg("ids") = s.ids, py::arg("finite") = s.finite,
                        py::arg("tops") = optional_tensor(s.tops),
                        py::arg("log_totals") = optional_tensor(s.log_totals),
                        py::arg("picked") = optional_tensor(s.picked));
      }, py::arg("x"), py::arg("k"), py::arg("barred") = std::vector<int64_t>{}, py::arg("log_totals") = false,
           py::arg("picked_ids") = std::nullopt,
           "x [rows, in] float32 -> dict of values/ids [rows, k] (each row's k best outputs outside barred), finite, "
           "tops and log_totals (log_softmax = (y - top) - log_total), picked (the output at picked_ids), [rows] "
           "each (None where not asked); the outputs never written (where has_summary: the own int8 routes and "
           "avx512-float32; linear.h)")
      .def_property_readonly("has_summary", &PackedLinear::has_summary)
      .def_property_readonly("route", &PackedLinear::route)
      .def_property_readonly("nbytes", &PackedLinear::nbytes)
      .def_property_readonly("int8_weight_max", &PackedLinear::int8_weight_max);
  py::class_<DecoderLinears, std::shared_ptr<DecoderLinears>>(m, "DecoderLinears",
                                                              "every linear layer of a decoder, converted once")
      .def(py::init([=](const DecoderWeights& weights, int64_t rows, const std::string& type) {
             c10::InferenceMode inference;
             return std::make_shared<DecoderLinears>(weights, rows, compute_type(type));
           }),
           py::arg("weights"), py::arg("rows"), py::arg("compute_type"))
      .def_property_readonly("routes", [](const DecoderLinears& linears) {
        std::set<std::string> routes;
        linears.for_each_linear([&](const PackedLinear& linear) { routes.insert(linear.route()); });
        return routes;
      })
      .def_property_readonly("nbytes", [](const DecoderLinears& linears) {
        int64_t total = 0;
        linears.for_each_linear([&](const PackedLinear& linear) { total += linear.nbytes(); });
        return total;
      });
  py::class_<CompiledEncoder, std::shared_ptr<CompiledEncoder>>(m, "CompiledEncoder",
                                                                "the encoder with its linears converted once")
      .def(py::init([=](EncoderWeights weights, DecoderOptions options, int64_t rows, const std::string& type) {
             c10::InferenceMode inference;
             return std::make_shared<CompiledEncoder>(std::move(weights), std::move(options), rows,
                                                      compute_type(type));
           }),
           py::arg("weights"), py::arg("options"), py::arg("rows"), py::arg("compute_type"))
      .def("__call__", [](const CompiledEncoder& encoder, const at::Tensor& x, const at::Tensor& src_lengths) {
        py::gil_scoped_release no_gil;
        return encoder(x, src_lengths);
      }, py::arg("x"), py::arg("src_lengths"),
         "x [n_sentences, src_len, d_model] embedded sources, src_lengths [n_sentences] -> memory")
      .def_property_readonly("nbytes", &CompiledEncoder::nbytes);
}

}  // namespace
}  // namespace fastformer

TORCH_LIBRARY(fastformer, m) {
  m.def("self_attention_step(Tensor qkv, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor indirection, "
        "Tensor row_slots, int beam_size, int step) -> Tensor");
  m.def("cross_attention(Tensor q, Tensor k, Tensor v, Tensor src_lengths, Tensor row_slots, int beam_size) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(fastformer, CPU, m) {
  m.impl("self_attention_step", fastformer::self_attention_step_op);
  m.impl("cross_attention", &fastformer::cross_attention);
}

#ifdef FASTFORMER_WITH_CUDA
TORCH_LIBRARY_IMPL(fastformer, CUDA, m) {
  m.impl("self_attention_step", fastformer::self_attention_step_op);
  m.impl("cross_attention", &fastformer::cross_attention);
}
#endif

TORCH_LIBRARY_IMPL(fastformer, Meta, m) {
  m.impl("self_attention_step", &fastformer::self_attention_step_meta);
  m.impl("cross_attention", &fastformer::cross_attention_meta);
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
  fastformer::bind_structs(m);
  fastformer::bind_compiled(m);
  m.def(
      "beam_search",
      [](const at::Tensor& memory, const at::Tensor& src_lengths, fastformer::DecoderWeights weights,
         const fastformer::DecoderOptions& decoder_options, const fastformer::SearchOptions& search_options,
         std::vector<int64_t> max_lens, int64_t n_best, std::shared_ptr<fastformer::DecoderLinears> linears) {
        py::gil_scoped_release no_gil;
        return fastformer::beam_search(memory, src_lengths, std::move(weights), decoder_options, search_options,
                                       max_lens, n_best, std::move(linears));
      },
      "memory [n_sentences, src_len, d_model], src_lengths [n_sentences], max_lens [n_sentences] -> per sentence up "
      "to n_best (tokens, score, attention [len(tokens) + 1, src_length] or None), best first",
      py::arg("memory"), py::arg("src_lengths"), py::arg("weights"), py::arg("decoder_options"),
      py::arg("search_options"), py::arg("max_lens"), py::arg("n_best"), py::arg("linears") = nullptr);
  m.def(
      "score_targets",
      [](const at::Tensor& memory, const at::Tensor& src_lengths, const at::Tensor& decoder_input,
         const at::Tensor& targets, const at::Tensor& tgt_lengths, const fastformer::DecoderWeights& weights,
         const fastformer::DecoderOptions& decoder_options, std::shared_ptr<fastformer::DecoderLinears> linears) {
        py::gil_scoped_release no_gil;
        return fastformer::score_targets(memory, src_lengths, decoder_input, targets, tgt_lengths, weights,
                                         decoder_options, std::move(linears));
      },
      "teacher forcing: memory [n_sentences, src_len, d_model], src_lengths [n_sentences], decoder_input and targets "
      "[n_sentences, tgt_len] int64 (BOS + target, target + EOS; padded), tgt_lengths [n_sentences] -> "
      "[n_sentences, tgt_len] float32 log-probabilities of the targets, 0 at padding",
      py::arg("memory"), py::arg("src_lengths"), py::arg("decoder_input"), py::arg("targets"), py::arg("tgt_lengths"),
      py::arg("weights"), py::arg("decoder_options"), py::arg("linears") = nullptr);
  py::class_<CachedDecoder>(m, "CachedDecoder",
                            "The decoder one position at a time over a preallocated KV cache (decoder.h)")
      .def(py::init<const at::Tensor&, const at::Tensor&, fastformer::DecoderWeights, fastformer::DecoderOptions,
                    int64_t, int64_t, std::shared_ptr<const fastformer::DecoderLinears>>(),
           py::arg("memory"), py::arg("src_lengths"), py::arg("weights"), py::arg("options"), py::arg("beam_size"),
           py::arg("cache_len"), py::arg("linears") = nullptr)
      .def("step",
           static_cast<at::Tensor (CachedDecoder::*)(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                     int64_t)>(&CachedDecoder::step),
           py::arg("tokens"), py::arg("row_slots"), py::arg("indirection"),
           py::arg("step"),
           "tokens [n_rows], row_slots [n_rows] int32, indirection [n_slots, cache_len] int32 -> logits [n_rows, "
           "vocab]")
      .def_property_readonly("n_slots", &CachedDecoder::n_slots)
      .def_property_readonly("cache_len", &CachedDecoder::cache_len);
}
