"""The rules every beam search in fastformer shares (the compiled one and the reference oracle): the length penalty.

Defined, with how the peers count |Y|, in fastformer/reference/beam_search.py's docstring.
"""

from __future__ import annotations

LENGTH_PENALTY_FORMS = ("gnmt", "length")


def length_penalty_divisor(length: int, length_penalty: float, form: str = "gnmt") -> float:
    """The divisor of a hypothesis's sum of log-probabilities; length counts its real tokens and EOS."""
    if form == "gnmt":
        return ((5.0 + length) / 6.0) ** length_penalty
    if form == "length":
        return float(length) ** length_penalty
    raise ValueError(f"length_penalty_form must be one of {LENGTH_PENALTY_FORMS}, got {form!r}")
