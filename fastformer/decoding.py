"""Beam search (placeholder while the compiled decoder is being written; replaced in the beam-search work)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Hypothesis(NamedTuple):
    tokens: list[int]  # without BOS/EOS
    score: float


def translate(model, src_tokens: torch.Tensor, **kwargs) -> list[list[Hypothesis]]:
    raise NotImplementedError("translate is being written")
