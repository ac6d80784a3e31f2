"""The rules every beam search in fastformer shares (the compiled one and the reference oracle): its arguments, the
hypotheses it returns, the target length limit, the length penalty, and eval mode whatever the model's own.

Defined, with how the peers count |Y|, in fastformer/reference/beam_search.py's docstring.
"""

from __future__ import annotations

import math
import operator
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
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


LONGEST_CHECKED_TARGET = 65536  # past any position table the model can have


def _divisor_stays_in_range(length_penalty: float, form: str) -> bool:
    """Whether the divisor is finite and non-zero in double at every length up to LONGEST_CHECKED_TARGET."""
    # Both forms' bases grow with the length from 1, so the longest target is the extreme.
    try:
        divisor = length_penalty_divisor(LONGEST_CHECKED_TARGET, length_penalty, form)
    except OverflowError:
        return False
    return 0.0 < divisor < math.inf


def check_search_arguments(beam_size: int, length_penalty: float, max_len_a: float, max_len_b: int, min_len: int,
                           n_best: int, length_penalty_form: str = "gnmt", sampling: bool = False) -> None:
    """Raises a ValueError/TypeError naming the first bad argument of a beam search (sampling: n_best counts
    independent samples, not beams)."""
    if length_penalty_form not in LENGTH_PENALTY_FORMS:
        raise ValueError(f"length_penalty_form must be one of {LENGTH_PENALTY_FORMS}, got {length_penalty_form!r}")
    for name, value in (("beam_size", beam_size), ("max_len_b", max_len_b), ("min_len", min_len),
                        ("n_best", n_best)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    for name, value in (("length_penalty", length_penalty), ("max_len_a", max_len_a)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r}")
    if not _divisor_stays_in_range(length_penalty, length_penalty_form):
        raise ValueError(f"length_penalty={length_penalty!r} makes the length penalty's divisor overflow to inf or "
                         f"underflow to 0 at {LONGEST_CHECKED_TARGET} tokens, so every score would read 0 or -inf: "
                         "keep it within +-60")
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    if n_best < 1 or (n_best > beam_size and not sampling):
        raise ValueError(f"n_best must be in [1, beam_size={beam_size}], got {n_best}")
    if min_len < 0:
        raise ValueError(f"min_len must be >= 0, got {min_len}")
    if max_len_a < 0 or max_len_b < 0:
        raise ValueError(f"max_len_a and max_len_b must be >= 0, got {max_len_a} and {max_len_b}")


def max_target_lengths(src_lengths: torch.Tensor, max_len_a: float, max_len_b: int, max_positions: int) -> list[int]:
    """src_lengths: [batch] -> per sentence, the most real target tokens before EOS is forced."""
    # The decoder's input at the forced step is [BOS, max_len tokens], which must fit the position table.
    return [min(math.floor(max_len_a * n + max_len_b), max_positions - 1) for n in src_lengths.tolist()]


def check_sampling_arguments(beam_size: int, sampling_topk: int, sampling_topp: float, sampling_temperature: float,
                             seed: int) -> None:
    """Raises a ValueError/TypeError naming the first bad sampling argument (CTranslate2's meanings)."""
    for name, value in (("sampling_topk", sampling_topk), ("seed", seed)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if sampling_topk < 0:
        raise ValueError(f"sampling_topk must be >= 0 (0: the whole vocabulary, 1: no sampling), got {sampling_topk}")
    if not isinstance(sampling_topp, (int, float)) or not 0 < sampling_topp <= 1:
        raise ValueError(f"sampling_topp must be in (0, 1], got {sampling_topp!r}")
    if not isinstance(sampling_temperature, (int, float)) or not sampling_temperature > 0 \
            or not math.isfinite(sampling_temperature):
        raise ValueError(f"sampling_temperature must be a finite number > 0, got {sampling_temperature!r}")
    if sampling_topk != 1 and beam_size != 1:
        raise ValueError(f"sampling (sampling_topk={sampling_topk}) with beam_size={beam_size} would be a stochastic "
                         "beam search, which fastformer does not run: use beam_size=1, and n_best=N for N independent "
                         "samples per sentence")


def check_history_arguments(no_repeat_ngram_size: int, repetition_penalty: float) -> None:
    """Raises a ValueError/TypeError naming a bad no_repeat_ngram_size or repetition_penalty."""
    if not isinstance(no_repeat_ngram_size, int) or isinstance(no_repeat_ngram_size, bool):
        raise TypeError(f"no_repeat_ngram_size must be an int, got {type(no_repeat_ngram_size).__name__}")
    if no_repeat_ngram_size < 0:
        raise ValueError(f"no_repeat_ngram_size must be >= 0 (0: off), got {no_repeat_ngram_size}")
    if not isinstance(repetition_penalty, (int, float)) or not repetition_penalty > 0 \
            or not math.isfinite(repetition_penalty):
        raise ValueError(f"repetition_penalty must be a finite number > 0 (1: off), got {repetition_penalty!r}")


def token_ids(ids, what: str, vocab_size: int, special_ids: tuple[int, ...] = ()) -> list[int]:
    """ids -> [int], or an error naming `what` and its first bad id: each an integer (Python's, NumPy's or a 0-d
    integer tensor; not a bool) in [0, vocab_size) and not one of special_ids (pad, bos and eos where given)."""
    converted = []
    for token in ids:
        try:
            if isinstance(token, bool):
                raise TypeError
            value = operator.index(token)
        except TypeError:
            raise TypeError(f"{what} holds {token!r} ({type(token).__name__}): token ids must be integers") from None
        if not 0 <= value < vocab_size or value in special_ids:
            also = f" and not pad, bos or eos {special_ids}" if special_ids else ""
            raise ValueError(f"{what} holds id {value}: ids must be in [0, vocab_size={vocab_size}){also}")
        converted.append(value)
    return converted


class PrefixTooLongError(ValueError):
    """A target prefix longer than its sentence's length limit; `sentence` is its index in the call's batch, so that
    a caller that batched the sentences can name the one it was given."""

    def __init__(self, sentence: int, problem: str) -> None:
        super().__init__(f"target_prefix of sentence {sentence} {problem}")
        self.sentence, self.problem = sentence, problem


def check_target_prefix(target_prefix: list[list[int] | None], max_lens: list[int], vocab_size: int,
                        special_ids: tuple[int, ...]) -> list[list[int] | None]:
    """-> the prefixes as lists of int, or an error naming the first bad one: per sentence a list of ids (no
    BOS/EOS; token_ids) or None, at most its sentence's length limit (max_lens) long."""
    if len(target_prefix) != len(max_lens):
        raise ValueError(f"target_prefix must have one entry per sentence ({len(max_lens)}), got {len(target_prefix)}")
    checked = []
    for i, (prefix, max_len) in enumerate(zip(target_prefix, max_lens)):
        if prefix is not None:
            prefix = token_ids(prefix, f"target_prefix of sentence {i}", vocab_size, special_ids)
            if len(prefix) > max_len:
                raise PrefixTooLongError(i, f"has {len(prefix)} tokens, more than its length limit of {max_len} "
                                            "(max_len_a * source length + max_len_b)")
        checked.append(prefix)
    return checked


# The models inside an eval_mode block -> (blocks open on it, every module's mode before the first). Threads translate
# one model at once (the search releases the GIL), and their blocks overlap without nesting.
_EVAL_BLOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_EVAL_BLOCKS_LOCK = threading.Lock()


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Puts every module of `model` in eval mode for the block, then gives each back its own mode once no other
    block on `model` is open (a thread's translation while another's runs keeps eval mode to its end)."""
    with _EVAL_BLOCKS_LOCK:
        open_blocks, modes = _EVAL_BLOCKS.get(model, (0, None))
        if not open_blocks:
            modes = [(module, module.training) for module in model.modules()]
            model.eval()
        _EVAL_BLOCKS[model] = (open_blocks + 1, modes)
    try:
        yield
    finally:
        with _EVAL_BLOCKS_LOCK:
            open_blocks, modes = _EVAL_BLOCKS.pop(model)
            if open_blocks > 1:
                _EVAL_BLOCKS[model] = (open_blocks - 1, modes)
            else:
                for module, training in modes:
                    module.training = training
