"""Beam search for `Transformer.translate`: the incremental decoder and the search loop of the extension fastformer._C.

The whole loop runs in C++ (csrc/decoder.cpp): a KV cache preallocated once per call, the encoder's keys/values
computed once per layer, fused single-query attention and beam-step ops, and sentences dropped from the batch as
they finish. The rules are those of fastformer/search_rules.py, shared with the reference search (the oracle this
is tested against). Translation is inference whatever the model's mode: the encoder runs in eval mode (no dropout),
and the model's modes are restored afterwards.

How the batch shrinks as sentences finish (`shrink`, the same translations either way): "every_step" drops finished
sentences after each step, which the host learns by waiting for that step; "buckets" decodes power-of-two buckets of
sentences, skipping finished ones until the next smaller bucket holds the rest, with the host reading the done flags
a step late, and on CUDA replays each bucket's step as a CUDA graph, so that the host neither waits for the GPU nor
launches a step's hundred kernels one by one. "auto" picks every_step, on CUDA too until the bucketed search has
passed the GPU tests on a GPU (README, "GPU status"); "buckets" runs it by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from fastformer.search_rules import Hypothesis, check_search_arguments, max_target_lengths

__all__ = ["Hypothesis", "SHRINK_MODES", "translate", "cached_decoder", "decoder_options", "decoder_weights"]

SHRINK_MODES = ("auto", "every_step", "buckets")


def _extension():
    try:
        from fastformer import _C
    except ImportError as error:
        package_dir = Path(__file__).resolve().parent
        if (package_dir.parent / "setup.py").is_file():
            raise RuntimeError(
                f"fastformer was imported from the source checkout {package_dir.parent} (e.g. `python -m fastformer` "
                "run from its root), which holds no compiled fastformer._C: run the installed `fastformer` script "
                "(under torchrun: `torchrun --no-python ... fastformer train`) or run from another directory, or "
                "build the extension in place with `python setup.py build_ext --inplace`") from error
        raise RuntimeError("fastformer._C is not built: install with `pip install --no-build-isolation .`") from error
    return _C


def translate(model, src_tokens: torch.Tensor, beam_size: int = 4, length_penalty: float = 0.6,
              max_len_a: float = 1.0, max_len_b: int = 50, min_len: int = 1, n_best: int = 1,
              length_penalty_form: str = "gnmt", shrink: str = "auto") -> list[list[Hypothesis]]:
    """src_tokens: [batch, src_len] right-padded -> per sentence, up to n_best hypotheses, best first."""
    check_search_arguments(beam_size, length_penalty, max_len_a, max_len_b, min_len, n_best, length_penalty_form)
    if shrink not in SHRINK_MODES:
        raise ValueError(f"shrink must be one of {SHRINK_MODES}, got {shrink!r}")
    config = model.config
    extension = _extension()
    with torch.no_grad(), _eval_mode(model):
        memory, src_lengths = model.encode(src_tokens)
        if memory.shape[0] == 0:
            return []
        max_lens = max_target_lengths(src_lengths, max_len_a, max_len_b, config.max_positions)
        weights = decoder_weights(model, memory.dtype)
        _check_cuda_limits(memory, beam_size, config.head_dim, max(max_lens) + 1)
        search_options = _named(extension.SearchOptions(), beam_size=beam_size, length_penalty=float(length_penalty),
                                length_penalty_form=length_penalty_form, min_len=min_len, pad_id=config.pad_id,
                                bos_id=config.bos_id, eos_id=config.eos_id, shrink=shrink)
        results = extension.beam_search(memory.to(weights.embedding.dtype).contiguous(), src_lengths, weights,
                                        decoder_options(model), search_options, max_lens=max_lens, n_best=n_best)
    return [[Hypothesis(list(tokens), score) for tokens, score in sentence] for sentence in results]


@contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Puts every module of `model` in eval mode for the block, then gives each back its own mode."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def cached_decoder(model, encoder_out, beam_size: int, cache_len: int):
    """The extension's incremental decoder over `encoder_out` (a batch's EncoderOutput) with beam_size slots per
    sentence and room for cache_len positions: `.step(tokens [n_rows], row_slots [n_rows] int32, indirection
    [n_slots, cache_len] int32, step) -> logits [n_rows, vocab]`."""
    weights = decoder_weights(model, encoder_out.memory.dtype)
    return _extension().CachedDecoder(encoder_out.memory.to(weights.embedding.dtype).contiguous(),
                                      encoder_out.src_lengths, weights, decoder_options(model), beam_size=beam_size,
                                      cache_len=cache_len)


def decoder_options(model):
    """The model's decoder hyperparameters as the extension's DecoderOptions (csrc/decoder.h)."""
    config = model.config
    return _named(_extension().DecoderOptions(), n_heads=config.n_heads, norm_first=config.norm_first,
                  activation=config.activation, embedding_scale=float(model.embedding_scale))


def decoder_weights(model, dtype: torch.dtype):
    """The decoder's tensors as the extension's DecoderWeights (csrc/decoder.h), in `dtype`. The CPU kernels
    compute in fp32, so a CPU model in fp16/bf16 is widened."""
    if dtype != torch.float32 and model.output_weight.device.type == "cpu":
        dtype = torch.float32
    extension = _extension()

    def tensor(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(dtype).contiguous()

    def norm(layer_norm):
        return _named(extension.LayerNormWeights(), weight=tensor(layer_norm.weight), bias=tensor(layer_norm.bias),
                      eps=float(layer_norm.eps))

    d = model.config.d_model
    layers = []
    for layer in model.decoder.layers:
        self_attn, cross_attn = layer.self_attn, layer.multihead_attn
        self_bias, cross_bias = _in_proj_bias(self_attn), _in_proj_bias(cross_attn)
        layers.append(_named(
            extension.DecoderLayerWeights(),
            self_qkv_weight=tensor(self_attn.in_proj_weight), self_qkv_bias=tensor(self_bias),
            self_out_weight=tensor(self_attn.out_proj.weight), self_out_bias=tensor(_out_proj_bias(self_attn)),
            cross_q_weight=tensor(cross_attn.in_proj_weight[:d]), cross_q_bias=tensor(cross_bias[:d]),
            cross_kv_weight=tensor(cross_attn.in_proj_weight[d:]), cross_kv_bias=tensor(cross_bias[d:]),
            cross_out_weight=tensor(cross_attn.out_proj.weight), cross_out_bias=tensor(_out_proj_bias(cross_attn)),
            linear1_weight=tensor(layer.ffn.linear1.weight), linear1_bias=tensor(layer.ffn.linear1.bias),
            linear2_weight=tensor(layer.ffn.linear2.weight), linear2_bias=tensor(layer.ffn.linear2.bias),
            norm1=norm(layer.norm1), norm2=norm(layer.norm2), norm3=norm(layer.norm3)))
    final_norm = model.decoder.norm
    return _named(extension.DecoderWeights(), layers=layers, embedding=tensor(model.embed_tokens.weight),
                  positions=tensor(model.positions), output_weight=tensor(model.output_weight),
                  output_bias=tensor(model.output_bias) if model.output_bias is not None else None,
                  final_norm=norm(final_norm) if final_norm is not None else None)


def _named(native, **fields):
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


def _check_cuda_limits(memory: torch.Tensor, beam_size: int, head_dim: int, cache_len: int) -> None:
    if not memory.is_cuda:
        return
    limits = _extension()  # the kernels' own limits (csrc/beam_ops.h)
    if beam_size > limits.max_cuda_beam_size:
        raise ValueError(f"beam_size must be <= {limits.max_cuda_beam_size} on CUDA, got {beam_size}")
    if head_dim > limits.max_cuda_head_dim:
        raise ValueError(f"the CUDA decoder takes head_dim <= {limits.max_cuda_head_dim}, the model has {head_dim}")
    if max(memory.shape[1], cache_len) > limits.max_cuda_key_length:
        raise ValueError(f"the CUDA decoder takes sources and targets of at most {limits.max_cuda_key_length} tokens")
