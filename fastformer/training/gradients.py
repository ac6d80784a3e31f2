"""Gradient clipping by the global L2 norm (--clip-norm), as torch.nn.utils.clip_grad_norm_ does it, on gradients
that need not belong to parameters: the eager step's, or the one flat buffer of fp32 master gradients that
--precision bf16-master and the captured step update. Nothing here reads a value back to the host."""

from __future__ import annotations

import torch

# clip_grad_norm_'s guard against dividing by a zero norm.
EPSILON = 1e-6


def clip_gradients_(gradients: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scales gradients in place by min(1, max_norm / (total_norm + EPSILON)); total_norm: [], their global L2 norm,
    on their device."""
    torch._foreach_mul_(gradients, torch.clamp(max_norm / (total_norm + EPSILON), max=1.0))
