"""The model as the compiled extension runs it: its weights converted once per compute type and kept with the model.

Compute types, named as CTranslate2 names them:
- CPU: "float32"; "bfloat16" (oneDNN's bfloat16 GEMM where the CPU has AVX512-BF16, AMX or AVX-NE-CONVERT, else
  plain bfloat16 matmuls, correct but several times slower than float32, with a warning); "int8" (int8 weights with
  one scale per output row, activations quantized per row on the fly; oneDNN's int8 GEMM). Only the linear layers
  run in the compute type: attention, layer norms, log-probabilities and beam scores stay float32.
- CUDA: "float32", "float16", "bfloat16" (the model's weights cast; the encoder under autocast).
- "auto": on the CPU "int8" where this torch has oneDNN's int8 linear (x86), else "float32", said in one warning; on
  CUDA "bfloat16" where the GPU supports it, else "float16".
- None: the model's own dtype (a float16 model computes in float32 on the CPU, as the CPU kernels always did).

The converted weights are made on first use and kept on the model (`model._compiled_cache`) with the state of every
parameter they were made from (storage address and version counter): training steps, `load_state_dict`, `.to()`
and in-place edits all change that state, so a changed model is converted again. Two kinds of edit leave the
version counter as it was, and need `forget(model)` (`Transformer.forget_compiled()`) before the next call: edits
through `.data` (`p.data.copy_(q)`, as some averaging code makes them), and edits of tensors made under
`torch.inference_mode()`, which keep no version counter.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, NamedTuple

import torch

__all__ = ["COMPUTE_TYPES", "CompiledModel", "compiled_model", "forget", "resolve_compute_type", "decoder_options",
           "decoder_weights", "extension"]

COMPUTE_TYPES = ("auto", "float32", "float16", "bfloat16", "int8")
CPU_COMPUTE_TYPES = ("float32", "bfloat16", "int8")
CUDA_COMPUTE_TYPES = ("float32", "float16", "bfloat16")
# The rows a call usually has, for oneDNN's choice of blocking: a thread's group of beams in a decoding step, and a
# batch's source positions in the encoder.
DECODER_ROWS, ENCODER_ROWS = 128, 1024


def extension():
    """The compiled extension fastformer._C, or an ImportError saying how to build it (one line from the CLI)."""
    try:
        from fastformer import _C
    except ImportError as error:
        # fastformer/, above decoding/
        raise ImportError(unloadable_extension_message(Path(__file__).resolve().parents[1], error)) from error
    return _C


def unloadable_extension_message(package_dir: Path, error: ImportError) -> str:
    """Why fastformer._C did not import from package_dir (error), and what to do: rebuild one that is there but does
    not load, run the installed package rather than a source checkout, or build one."""
    built = sorted(package_dir.glob("_C*.so"))
    if built:
        return (f"fastformer's compiled extension {built[0]} does not load ({str(error).splitlines()[0]}): it was "
                "built against another torch or Python; rebuild it with `pip install --no-build-isolation .` (in a "
                "checkout, `python setup.py build_ext --inplace`)")
    if (package_dir.parent / "setup.py").is_file():
        return (f"fastformer was imported from the source checkout {package_dir.parent} (e.g. `python -m fastformer` "
                "run from its root), which holds no compiled fastformer._C: run the installed `fastformer` script "
                "(under torchrun: `torchrun --no-python ... fastformer train`) or run from another directory, or "
                "build the extension in place with `python setup.py build_ext --inplace`")
    return "fastformer._C is not built: install with `pip install --no-build-isolation .`"


def has_int8_linear() -> bool:
    """Whether this torch has oneDNN's int8 linear ops (x86 builds)."""
    try:
        return hasattr(torch.ops.onednn, "qlinear_pointwise") and hasattr(torch.ops.onednn, "qlinear_prepack")
    except (AttributeError, RuntimeError):
        return False


def resolve_compute_type(compute_type: str | None, device: torch.device, model_dtype: torch.dtype) -> str:
    """The compute type a translation on `device` runs in (module docstring), or a ValueError naming the valid ones."""
    if compute_type is None:
        name = str(model_dtype).removeprefix("torch.")
        return "float32" if device.type == "cpu" and name not in CPU_COMPUTE_TYPES else name
    if compute_type not in COMPUTE_TYPES:
        raise ValueError(f"compute_type must be one of {', '.join(COMPUTE_TYPES)} (or None: the model's dtype), got "
                         f"{compute_type!r}")
    if device.type == "cuda":
        if compute_type == "auto":
            return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        if compute_type not in CUDA_COMPUTE_TYPES:
            raise ValueError(f"compute_type {compute_type!r} runs on the CPU only; on CUDA use one of "
                             f"{', '.join(CUDA_COMPUTE_TYPES)}")
        if compute_type == "float32" and model_dtype != torch.float32:
            raise ValueError(f"compute_type 'float32' on CUDA needs a float32 model, this one is {model_dtype}: "
                             "cast it with model.float()")
        return compute_type
    if compute_type == "auto":
        if has_int8_linear():
            return "int8"
        warnings.warn("compute_type='auto' runs float32: this torch has no oneDNN int8 linear "
                      "(onednn::qlinear_pointwise)", stacklevel=4)
        return "float32"
    if compute_type not in CPU_COMPUTE_TYPES:
        raise ValueError(f"compute_type {compute_type!r} runs on CUDA only; on the CPU use one of "
                         f"{', '.join(CPU_COMPUTE_TYPES)}")
    return compute_type


class CompiledModel(NamedTuple):
    """The extension's view of a model in one compute type."""
    compute_type: str
    encoder: Any  # _C.CompiledEncoder on the CPU; None on CUDA, where model.encode runs
    decoder_weights: Any  # _C.DecoderWeights
    decoder_linears: Any  # _C.DecoderLinears

    @property
    def nbytes(self) -> int:
        """The bytes of the converted linear layers (the encoder's and the decoder's, the output projection's)."""
        return self.decoder_linears.nbytes + (self.encoder.nbytes if self.encoder is not None else 0)


class CompiledCache:
    """compute type -> (the parameters it was made from, CompiledModel), kept on the model. Copies and pickles of the
    model start empty: the converted tensors are the extension's, and cheap to make again."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[list[torch.Tensor], tuple, CompiledModel]] = {}

    def __deepcopy__(self, memo: dict) -> CompiledCache:
        return CompiledCache()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._entries = {}

    def get(self, model: torch.nn.Module, compute_type: str) -> CompiledModel | None:
        entry = self._entries.get(compute_type)
        if entry is None or entry[1] != _parameter_state(model):
            return None
        return entry[2]

    def put(self, model: torch.nn.Module, compiled: CompiledModel) -> None:
        # The tensors are held so that their storage cannot be freed and its address reused by a new parameter.
        tensors = [t.detach() for t in _state_tensors(model)]
        self._entries[compiled.compute_type] = (tensors, _parameter_state(model), compiled)


def _state_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), model.positions]


def _parameter_state(model: torch.nn.Module) -> tuple:
    # Inference tensors keep no version counter (reading it raises): their storage address alone stands for them.
    return tuple((t.data_ptr(), None if t.is_inference() else t._version, t.dtype, t.device)
                 for t in _state_tensors(model))


# Measured at the base model (37k vocabulary, beam 4): 6.7x float32's time on an AVX2 CPU (64 sentences, 40 s vs 6 s,
# at 0cdeabe), 3.7x float32's and 12x int8's on an AVX-512 CPU capped to AVX2 (16 sentences, 2 threads, at 0097ec4).
BFLOAT16_FALLBACK_WARNING = (
    "compute_type='bfloat16' on a CPU without AVX512-BF16, AMX or AVX-NE-CONVERT: oneDNN's bfloat16 GEMM is "
    "unavailable, so plain bfloat16 matmuls run, expect 4-7x the time of float32 and over 10x that of int8 at the "
    "base model; use compute_type='int8' (or 'auto': the fastest type this CPU has) or 'float32'")


def compiled_model(model: torch.nn.Module, compute_type: str) -> CompiledModel:
    """The model in `compute_type` (resolved already), converted on first use and kept until a parameter changes."""
    cache = model.__dict__.get("_compiled_cache")
    if cache is None:
        cache = model._compiled_cache = CompiledCache()
    compiled = cache.get(model, compute_type)
    if compiled is None:
        compiled = _compile(model, compute_type)
        cache.put(model, compiled)
    return compiled


def forget(model: torch.nn.Module) -> None:
    """Drops the model's converted weights, so that the next call converts its parameters again (module docstring:
    after edits the version counters do not see)."""
    model.__dict__.pop("_compiled_cache", None)


def _compile(model: torch.nn.Module, compute_type: str) -> CompiledModel:
    device = model.output_weight.device
    _C = extension()
    if device.type != "cpu":
        weights = decoder_weights(model, getattr(torch, compute_type))
        return CompiledModel(compute_type, None, weights, _C.DecoderLinears(weights, DECODER_ROWS, "float32"))
    # On the CPU every tensor the fused ops read is float32; the linear layers convert their own copies.
    weights = decoder_weights(model, torch.float32)
    decoder_linears = _C.DecoderLinears(weights, DECODER_ROWS, compute_type)
    encoder = _C.CompiledEncoder(encoder_weights(model), decoder_options(model), ENCODER_ROWS, compute_type)
    if compute_type == "bfloat16" and "aten" in decoder_linears.routes:
        warnings.warn(BFLOAT16_FALLBACK_WARNING, stacklevel=4)
    return CompiledModel(compute_type, encoder, weights, decoder_linears)


def decoder_options(model):
    """The model's hyperparameters as the extension's DecoderOptions (csrc/decoder.h), shared by the encoder."""
    config = model.config
    return named_struct(extension().DecoderOptions(), n_heads=config.n_heads, norm_first=config.norm_first,
                  activation=config.activation, embedding_scale=float(model.embedding_scale))


def _tensor(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.detach().to(dtype).contiguous()


def _norm(layer_norm, dtype: torch.dtype):
    return named_struct(extension().LayerNormWeights(), weight=_tensor(layer_norm.weight, dtype),
                  bias=_tensor(layer_norm.bias, dtype), eps=float(layer_norm.eps))


def encoder_weights(model, dtype: torch.dtype = torch.float32):
    """The encoder's tensors as the extension's EncoderWeights (csrc/encoder.h), in `dtype`."""
    _C = extension()
    layers = []
    for layer in model.encoder.layers:
        attention = layer.self_attn
        layers.append(named_struct(
            _C.EncoderLayerWeights(),
            self_qkv_weight=_tensor(attention.in_proj_weight, dtype),
            self_qkv_bias=_tensor(_in_proj_bias(attention), dtype),
            self_out_weight=_tensor(attention.out_proj.weight, dtype),
            self_out_bias=_tensor(_out_proj_bias(attention), dtype),
            **_feed_forward(layer.ffn, dtype),
            norm1=_norm(layer.norm1, dtype), norm2=_norm(layer.norm2, dtype)))
    final_norm = model.encoder.norm
    return named_struct(_C.EncoderWeights(), layers=layers,
                  final_norm=_norm(final_norm, dtype) if final_norm is not None else None)


def decoder_weights(model, dtype: torch.dtype):
    """The decoder's tensors as the extension's DecoderWeights (csrc/decoder.h), in `dtype`."""
    _C = extension()
    d = model.config.d_model
    layers = []
    for layer in model.decoder.layers:
        self_attn, cross_attn = layer.self_attn, layer.multihead_attn
        self_bias, cross_bias = _in_proj_bias(self_attn), _in_proj_bias(cross_attn)
        layers.append(named_struct(
            _C.DecoderLayerWeights(),
            self_qkv_weight=_tensor(self_attn.in_proj_weight, dtype), self_qkv_bias=_tensor(self_bias, dtype),
            self_out_weight=_tensor(self_attn.out_proj.weight, dtype),
            self_out_bias=_tensor(_out_proj_bias(self_attn), dtype),
            cross_q_weight=_tensor(cross_attn.in_proj_weight[:d], dtype), cross_q_bias=_tensor(cross_bias[:d], dtype),
            cross_kv_weight=_tensor(cross_attn.in_proj_weight[d:], dtype),
            cross_kv_bias=_tensor(cross_bias[d:], dtype),
            cross_out_weight=_tensor(cross_attn.out_proj.weight, dtype),
            cross_out_bias=_tensor(_out_proj_bias(cross_attn), dtype),
            **_feed_forward(layer.ffn, dtype),
            norm1=_norm(layer.norm1, dtype), norm2=_norm(layer.norm2, dtype), norm3=_norm(layer.norm3, dtype)))
    final_norm = model.decoder.norm
    return named_struct(_C.DecoderWeights(), layers=layers, embedding=_tensor(model.embed_tokens.weight, dtype),
                  positions=_tensor(model.positions, dtype), output_weight=_tensor(model.output_weight, dtype),
                  output_bias=_tensor(model.output_bias, dtype) if model.output_bias is not None else None,
                  final_norm=_norm(final_norm, dtype) if final_norm is not None else None)


def _feed_forward(ffn, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A layer's feed-forward block as the extension's linear1_*/linear2_* fields."""
    return {f"{name}_{part}": _tensor(getattr(getattr(ffn, name), part), dtype)
            for name in ("linear1", "linear2") for part in ("weight", "bias")}


def named_struct(native, **fields):
    """Sets each field of an extension struct by name (the struct rejects a name it does not have) -> the struct."""
    for name, value in fields.items():
        setattr(native, name, value)
    return native


def _in_proj_bias(attention) -> torch.Tensor:
    """[3 * d_model]: the attention's q|k|v bias, zeros where it has none (bias=False)."""
    weight = attention.in_proj_weight
    return attention.in_proj_bias if attention.in_proj_bias is not None else weight.new_zeros(weight.shape[0])


def _out_proj_bias(attention) -> torch.Tensor:
    """[d_model]: the attention's output bias, zeros where it has none (bias=False)."""
    out_proj = attention.out_proj
    return out_proj.bias if out_proj.bias is not None else out_proj.weight.new_zeros(out_proj.weight.shape[0])
