"""The rules every beam search in fastformer shares (the compiled one and the reference oracle): its arguments, the
hypotheses it returns, the target length limit and the length penalty.

Defined, with how the peers count |Y|, in fastformer/reference/beam_search.py's docstring.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

LENGTH_PENALTY_FORMS = ("gnmt", "length")


def length_penalty_divisor(length: int, length_penalty: float, form: str = "gnmt") -> float:
    """The divisor of a hypothesis's sum of log-probabilities; length counts its real tokens and EOS."""
    if form == "gnmt":
        return ((5.0 + length) / 6.0) ** length_penalty
    if form == "length":
        return float(length) ** length_penalty
    raise ValueError(f"length_penalty_form must be one of {LENGTH_PENALTY_FORMS}, got {form!r}")


class Hypothesis(NamedTuple):
    tokens: list[int]  # without BOS/EOS
    score: float | None  # sum of log-probabilities (EOS included) / length_penalty_divisor(len(tokens) + 1, ...)
    # [len(tokens) + 1, src_length] float32 on the CPU, one row per output token (EOS last) over the source's real
    # tokens (its EOS included): the last decoder layer's cross-attention averaged over heads; None unless asked for.
    attention: torch.Tensor | None = None


def check_search_arguments(beam_size: int, length_penalty: float, max_len_a: float, max_len_b: int, min_len: int,
                           n_best: int, length_penalty_form: str = "gnmt") -> None:
    """Raises a ValueError/TypeError naming the first bad argument of a beam search."""
    if length_penalty_form not in LENGTH_PENALTY_FORMS:
        raise ValueError(f"length_penalty_form must be one of {LENGTH_PENALTY_FORMS}, got {length_penalty_form!r}")
    for name, value in (("beam_size", beam_size), ("max_len_b", max_len_b), ("min_len", min_len),
                        ("n_best", n_best)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    for name, value in (("length_penalty", length_penalty), ("max_len_a", max_len_a)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    if not 1 <= n_best <= beam_size:
        raise ValueError(f"n_best must be in [1, beam_size={beam_size}], got {n_best}")
    if min_len < 0:
        raise ValueError(f"min_len must be >= 0, got {min_len}")
    if max_len_a < 0 or max_len_b < 0:
        raise ValueError(f"max_len_a and max_len_b must be >= 0, got {max_len_a} and {max_len_b}")


def max_target_lengths(src_lengths: torch.Tensor, max_len_a: float, max_len_b: int, max_positions: int) -> list[int]:
    """src_lengths: [batch] -> per sentence, the most real target tokens before EOS is forced."""
    # The decoder's input at the forced step is [BOS, max_len tokens], which must fit the position table.
    return [min(math.floor(max_len_a * n + max_len_b), max_positions - 1) for n in src_lengths.tolist()]
