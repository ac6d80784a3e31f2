"""Scoring for `Transformer.score`: the log-probability of given targets under teacher forcing, as CTranslate2's
`score_batch` returns it, by the extension fastformer._C.

The decoder runs once over every target position of the batch (csrc/scorer.cpp), with the linear layers of the search
in the same compute type (fastformer/decoding/compiled.py), causal self-attention and the source's padding masked; the
output projection's log-softmax is taken a chunk of rows at a time, so that the batch's logits are never held whole.
"""

from __future__ import annotations

import torch

from fastformer.decoding.compiled import decoder_options, extension
from fastformer.decoding.rules import eval_mode, token_ids
from fastformer.decoding.search import encode, model_compiled

__all__ = ["score", "check_targets", "right_padded"]


def score(model, src_tokens: torch.Tensor, target_tokens: list[list[int]] | torch.Tensor,
          compute_type: str | None = None) -> list[torch.Tensor]:
    """src_tokens: [batch, src_len] right-padded (each ending in EOS); target_tokens: per sentence its ids without
    EOS (or [batch, tgt_len] right-padded) -> per sentence [len(target) + 1] float32 on the CPU: log p of each target
    token, then of EOS."""
    config = model.config
    target_tokens = check_targets(config, len(src_tokens), target_tokens)
    with torch.no_grad(), eval_mode(model):
        compiled = model_compiled(model, compute_type)
        memory, src_lengths = encode(model, src_tokens, compiled)
        if memory.shape[0] == 0:
            return []
        device = memory.device
        decoder_input = right_padded([[config.bos_id] + t for t in target_tokens], config.pad_id, device)
        targets = right_padded([t + [config.eos_id] for t in target_tokens], config.pad_id, device)
        tgt_lengths = torch.tensor([len(t) + 1 for t in target_tokens], device=device)
        weights = compiled.decoder_weights
        scores = extension().score_targets(memory.to(weights.embedding.dtype).contiguous(), src_lengths,
                                           decoder_input, targets, tgt_lengths, weights, decoder_options(model),
                                           linears=compiled.decoder_linears).cpu()
    # Finite logits give finite log-probabilities, however unlikely the token: NaN or inf come from the model.
    not_finite = (~torch.isfinite(scores).all(1)).nonzero()
    if len(not_finite):
        raise RuntimeError(f"score: the log-probabilities of sentence {not_finite[0].item()} are not finite (NaN or "
                           "inf in the model's weights or activations)")
    return [scores[i, :len(t) + 1].clone() for i, t in enumerate(target_tokens)]


def check_targets(config, n_sources: int, target_tokens: list[list[int]] | torch.Tensor) -> list[list[int]]:
    """-> the targets as lists of int, or an error naming the first bad one: a count other than n_sources, an empty
    target, an id that is not an integer in the vocabulary (rules.token_ids; in a list, pad, bos and eos score as any
    token does), or a target longer than max_positions - 1 (its decoder input starts with BOS). A tensor is
    [batch, tgt_len] right-padded, as src_tokens is: its rows' trailing pad ids are padding, not tokens to score."""
    if isinstance(target_tokens, torch.Tensor):
        if target_tokens.dim() != 2:
            raise ValueError(f"target_tokens as a tensor must be [batch, tgt_len] right-padded, got shape "
                             f"{tuple(target_tokens.shape)}")
        lengths = (target_tokens != config.pad_id).flip(1).int().cumsum(1).bool().sum(1)
        target_tokens = [row[:length].tolist() for row, length in zip(target_tokens, lengths.tolist())]
    if len(target_tokens) != n_sources:
        raise ValueError(f"score got {n_sources} sources and {len(target_tokens)} targets: it needs one target per "
                         "source")
    limit = config.max_positions - 1
    checked = []
    for index, target in enumerate(target_tokens):
        target = token_ids(target, f"target {index}", config.vocab_size)
        if len(target) == 0:
            raise ValueError(f"target {index} is empty: a target needs at least one token (EOS is scored after it)")
        if len(target) > limit:
            raise ValueError(f"target {index} has {len(target)} tokens, more than max_positions - 1 = {limit} (its "
                             "decoder input starts with BOS)")
        checked.append(target)
    return checked


def right_padded(rows: list[list[int]], pad_id: int, device: torch.device | str) -> torch.Tensor:
    """-> [len(rows), longest] int64 on `device`, right-padded with pad_id."""
    return torch.nn.utils.rnn.pad_sequence([torch.tensor(row, dtype=torch.int64) for row in rows], batch_first=True,
                                           padding_value=pad_id).to(device)
