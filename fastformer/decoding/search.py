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

import hashlib
import struct

import torch

from fastformer.decoding.compiled import (COMPUTE_TYPES, CompiledModel, compiled_model, decoder_options, extension,
                                          named_struct, resolve_compute_type)
from fastformer.decoding.rules import (Hypothesis, check_history_arguments, check_sampling_arguments,
                                      check_search_arguments, check_target_prefix, eval_mode, max_target_lengths)
from fastformer.decoding.shortlist import Shortlist

__all__ = ["COMPUTE_TYPES", "Hypothesis", "SHRINK_MODES", "translate", "cached_decoder", "encode"]

SHRINK_MODES = ("auto", "every_step", "buckets")


def translate(model, src_tokens: torch.Tensor, beam_size: int = 4, length_penalty: float = 0.6,
              max_len_a: float = 1.0, max_len_b: int = 50, min_len: int = 1, n_best: int = 1,
              length_penalty_form: str = "gnmt", shrink: str = "auto", compute_type: str | None = None,
              return_scores: bool = True, sampling_topk: int = 1, sampling_topp: float = 1.0,
              sampling_temperature: float = 1.0, seed: int = 0, target_prefix: list[list[int] | None] | None = None,
              no_repeat_ngram_size: int = 0, repetition_penalty: float = 1.0,
              return_attention: bool = False, shortlist: Shortlist | None = None) -> list[list[Hypothesis]]:
    """src_tokens: [batch, src_len] right-padded -> per sentence, up to n_best hypotheses, best first (their scores
    None where return_scores is False, their attention [len(tokens) + 1, src_length] where return_attention).
    Sampling (sampling_topk != 1, beam_size 1): n_best independent samples per sentence, each sentence's random
    stream keyed by (seed, its source ids, the sample's index). shortlist (CPU only): the batch's output vocabulary
    restricted to it (fastformer/decoding/shortlist.py), its scores normalized over that vocabulary."""
    sampling = sampling_topk != 1
    check_search_arguments(beam_size, length_penalty, max_len_a, max_len_b, min_len, n_best, length_penalty_form,
                           sampling=sampling)
    check_sampling_arguments(beam_size, sampling_topk, sampling_topp, sampling_temperature, seed)
    check_history_arguments(no_repeat_ngram_size, repetition_penalty)
    if shrink not in SHRINK_MODES:
        raise ValueError(f"shrink must be one of {SHRINK_MODES}, got {shrink!r}")
    if not isinstance(return_attention, bool):
        raise TypeError(f"return_attention must be a bool, got {return_attention!r}")
    config = model.config
    if shortlist is not None and not isinstance(shortlist, Shortlist):
        raise TypeError(f"shortlist must be a fastformer Shortlist or None, got {type(shortlist).__name__}")
    if shortlist is not None and src_tokens.device.type != "cpu":
        raise ValueError(f"a vocabulary shortlist runs on the CPU only, got src_tokens on {src_tokens.device}")
    if target_prefix is not None:
        src_lengths = model.lengths(src_tokens, "src_tokens")
        target_prefix = check_target_prefix(
            target_prefix, max_target_lengths(src_lengths, max_len_a, max_len_b, config.max_positions),
            config.vocab_size, (config.pad_id, config.bos_id, config.eos_id))
    _C = extension()
    n_samples = n_best if sampling else 1
    with torch.no_grad(), eval_mode(model):
        compiled = model_compiled(model, compute_type)
        memory, src_lengths = encode(model, src_tokens, compiled)
        if memory.shape[0] == 0:
            return []
        max_lens = max_target_lengths(src_lengths, max_len_a, max_len_b, config.max_positions)
        weights = compiled.decoder_weights
        _check_cuda_limits(memory, beam_size, config.head_dim, max(max_lens) + 1)
        search_options = named_struct(_C.SearchOptions(), beam_size=beam_size, length_penalty=float(length_penalty),
                                length_penalty_form=length_penalty_form, min_len=min_len, pad_id=config.pad_id,
                                bos_id=config.bos_id, eos_id=config.eos_id, shrink=shrink,
                                return_scores=return_scores or n_samples > 1, sampling_topk=sampling_topk,
                                sampling_topp=float(sampling_topp), sampling_temperature=float(sampling_temperature),
                                no_repeat_ngram_size=no_repeat_ngram_size,
                                repetition_penalty=float(repetition_penalty), return_attention=return_attention)
        if sampling:
            search_options.sampling_keys = _sampling_keys(src_tokens, src_lengths, seed, n_samples)
        if target_prefix is not None:
            search_options.target_prefix = _prefix_matrix([p for p in target_prefix for _ in range(n_samples)])
        if shortlist is not None:
            search_options.vocabulary = _shortlist_vocabulary(shortlist, src_tokens, src_lengths, target_prefix,
                                                              config.vocab_size)
        if n_samples > 1:  # each sample is a sentence of its own: its memory repeated
            memory, src_lengths = memory.repeat_interleave(n_samples, 0), src_lengths.repeat_interleave(n_samples, 0)
            max_lens = [m for m in max_lens for _ in range(n_samples)]
        results = _C.beam_search(memory.to(weights.embedding.dtype).contiguous(), src_lengths, weights,
                                 decoder_options(model), search_options, max_lens=max_lens,
                                 n_best=1 if sampling else n_best, linears=compiled.decoder_linears)
    if n_samples > 1:  # a sentence's samples, best score first (ties in sample order)
        results = [sorted((h for sample in results[i:i + n_samples] for h in sample), key=lambda h: -h[1])
                   for i in range(0, len(results), n_samples)]
    return [[Hypothesis(list(tokens), score if return_scores else None, attention)
             for tokens, score, attention in sentence]
            for sentence in results]


def _sampling_keys(src_tokens: torch.Tensor, src_lengths: torch.Tensor, seed: int, n_samples: int) -> list[int]:
    """src_tokens: [batch, src_len], src_lengths: [batch] -> per sentence and sample (sentence-major), the key of its
    random stream: a hash of (seed, the sentence's real source ids, the sample's index), never of its batch."""
    keys = []
    for row, length in zip(src_tokens.tolist(), src_lengths.tolist()):
        for sample in range(n_samples):
            data = struct.pack(f"<Qq{length}q", seed % 2**64, sample, *row[:length])
            keys.append(int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True))
    return keys


def _shortlist_vocabulary(shortlist: Shortlist, src_tokens: torch.Tensor, src_lengths: torch.Tensor,
                          target_prefix: list[list[int] | None] | None, vocab_size: int) -> torch.Tensor:
    """-> the batch's output ids ([n] int64 sorted): its shortlist, with its target prefixes' ids, which the search
    must be able to force."""
    prefix_ids = {token for prefix in target_prefix or [] if prefix for token in prefix}
    ids = shortlist.vocabulary(src_tokens, src_lengths, prefix_ids)
    if int(ids[-1]) >= vocab_size:
        raise ValueError(f"the shortlist holds target id {int(ids[-1])}, outside the model's vocabulary of "
                         f"{vocab_size}: it was built for another model")
    return ids


def _prefix_matrix(target_prefix: list[list[int] | None]) -> torch.Tensor:
    """Per sentence a list of ids or None -> [n_sentences, longest] int32, -1 past each prefix."""
    width = max([len(p) for p in target_prefix if p] + [1])
    matrix = torch.full((len(target_prefix), width), -1, dtype=torch.int32)
    for i, prefix in enumerate(target_prefix):
        if prefix:
            matrix[i, :len(prefix)] = torch.tensor(prefix, dtype=torch.int32)
    return matrix


def model_compiled(model, compute_type: str | None) -> CompiledModel:
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


def cached_decoder(model, encoder_out, beam_size: int, cache_len: int, compute_type: str | None = None):
    """The extension's incremental decoder over `encoder_out` (a batch's EncoderOutput) with beam_size slots per
    sentence and room for cache_len positions: `.step(tokens [n_rows], row_slots [n_rows] int32, indirection
    [n_slots, cache_len] int32, step) -> logits [n_rows, vocab]`."""
    compiled = model_compiled(model, compute_type)
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
