"""Beam search for `Transformer.translate`: the incremental decoder and the search loop of the extension fastformer._C.

The whole loop runs in C++ (csrc/decoder.cpp): a KV cache preallocated once per call, the encoder's keys/values
computed once per layer, fused single-query attention and beam-step ops, and sentences dropped from the batch as
they finish. The rules are those of fastformer/decoding/rules.py, shared with the reference search (the oracle this
is tested against). Translation is inference whatever the model's mode: the encoder runs in eval mode (no dropout),
and the model's modes are restored afterwards.

How the batch shrinks as sentences finish (`shrink`, the same translations either way): "every_step" drops finished
sentences after each step, which the host learns by waiting for that step; "buckets" decodes power-of-two buckets of
sentences, skipping finished ones until the next smaller bucket holds the rest, with the host reading the done flags
a step late, and on CUDA replays each bucket's step as a CUDA graph, so that the host neither waits for the GPU nor
launches a step's hundred kernels one by one. "auto" picks every_step, on CUDA too until the bucketed search has
passed the GPU tests on a GPU (docs/gpu.md); "buckets" runs it by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from fastformer.decoding.compiled import (COMPUTE_TYPES, CompiledModel, compiled_model, decoder_options, extension,
                                          named_struct, resolve_compute_type)
from fastformer.decoding.rules import Hypothesis, check_search_arguments, max_target_lengths

__all__ = ["COMPUTE_TYPES", "Hypothesis", "SHRINK_MODES", "translate", "cached_decoder", "encode"]

SHRINK_MODES = ("auto", "every_step", "buckets")


def translate(model, src_tokens: torch.Tensor, beam_size: int = 4, length_penalty: float = 0.6,
              max_len_a: float = 1.0, max_len_b: int = 50, min_len: int = 1, n_best: int = 1,
              length_penalty_form: str = "gnmt", shrink: str = "auto", compute_type: str | None = None,
              return_scores: bool = True, return_attention: bool = False) -> list[list[Hypothesis]]:
    """src_tokens: [batch, src_len] right-padded -> per sentence, up to n_best hypotheses, best first (their scores
    None where return_scores is False, their attention [len(tokens) + 1, src_length] where return_attention)."""
    check_search_arguments(beam_size, length_penalty, max_len_a, max_len_b, min_len, n_best, length_penalty_form)
    if shrink not in SHRINK_MODES:
        raise ValueError(f"shrink must be one of {SHRINK_MODES}, got {shrink!r}")
    if not isinstance(return_attention, bool):
        raise TypeError(f"return_attention must be a bool, got {return_attention!r}")
    config = model.config
    _C = extension()
    with torch.no_grad(), _eval_mode(model):
        compiled = _compiled(model, compute_type)
        memory, src_lengths = encode(model, src_tokens, compiled)
        if memory.shape[0] == 0:
            return []
        max_lens = max_target_lengths(src_lengths, max_len_a, max_len_b, config.max_positions)
        weights = compiled.decoder_weights
        _check_cuda_limits(memory, beam_size, config.head_dim, max(max_lens) + 1)
        search_options = named_struct(_C.SearchOptions(), beam_size=beam_size, length_penalty=float(length_penalty),
                                length_penalty_form=length_penalty_form, min_len=min_len, pad_id=config.pad_id,
                                bos_id=config.bos_id, eos_id=config.eos_id, shrink=shrink,
                                return_scores=return_scores, return_attention=return_attention)
        results = _C.beam_search(memory.to(weights.embedding.dtype).contiguous(), src_lengths, weights,
                                 decoder_options(model), search_options, max_lens=max_lens, n_best=n_best,
                                 linears=compiled.decoder_linears)
    return [[Hypothesis(list(tokens), score if return_scores else None, attention)
             for tokens, score, attention in sentence]
            for sentence in results]


def _compiled(model, compute_type: str | None) -> CompiledModel:
    weight = model.output_weight
    return compiled_model(model, resolve_compute_type(compute_type, weight.device, weight.dtype))


def encode(model, src_tokens: torch.Tensor, compiled: CompiledModel) -> tuple[torch.Tensor, torch.Tensor]:
    """src_tokens: [batch, src_len] -> (memory [batch, src_len, d_model], src_lengths [batch]) computed as `compiled`
    runs it: by the compiled encoder on the CPU, by model.encode on CUDA (under autocast where the compute type is
    not the model's dtype)."""
    if compiled.encoder is None:
        dtype = getattr(torch, compiled.compute_type)
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != model.output_weight.dtype):
            memory, src_lengths = model.encode(src_tokens)
        return memory, src_lengths
    src_lengths = model.lengths(src_tokens, "src_tokens")
    return compiled.encoder(model.embed(src_tokens).float(), src_lengths), src_lengths


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


def cached_decoder(model, encoder_out, beam_size: int, cache_len: int, compute_type: str | None = None):
    """The extension's incremental decoder over `encoder_out` (a batch's EncoderOutput) with beam_size slots per
    sentence and room for cache_len positions: `.step(tokens [n_rows], row_slots [n_rows] int32, indirection
    [n_slots, cache_len] int32, step) -> logits [n_rows, vocab]`."""
    compiled = _compiled(model, compute_type)
    weights = compiled.decoder_weights
    return extension().CachedDecoder(encoder_out.memory.to(weights.embedding.dtype).contiguous(),
                                     encoder_out.src_lengths, weights, decoder_options(model), beam_size=beam_size,
                                     cache_len=cache_len, linears=compiled.decoder_linears)


def _check_cuda_limits(memory: torch.Tensor, beam_size: int, head_dim: int, cache_len: int) -> None:
    if not memory.is_cuda:
        return
    limits = extension()  # the kernels' own limits (csrc/beam_ops.h)
    if beam_size > limits.max_cuda_beam_size:
        raise ValueError(f"beam_size must be <= {limits.max_cuda_beam_size} on CUDA, got {beam_size}")
    if head_dim > limits.max_cuda_head_dim:
        raise ValueError(f"the CUDA decoder takes head_dim <= {limits.max_cuda_head_dim}, the model has {head_dim}")
    if max(memory.shape[1], cache_len) > limits.max_cuda_key_length:
        raise ValueError(f"the CUDA decoder takes sources and targets of at most {limits.max_cuda_key_length} tokens")
