"""Plain-PyTorch label-smoothed cross-entropy: the oracle of triton_kernels/cross_entropy.py.

Written out (log-softmax, the NLL of the target, the mean over classes) rather than calling F.cross_entropy, so that
a test against F.cross_entropy checks something.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

REDUCTIONS = ("mean", "sum", "none")


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  label_smoothing: float = 0.0, reduction: str = "mean") -> torch.Tensor:
    """logits: [N, V], target: [N] -> loss: [] in at least fp32, or [N] in logits' dtype for reduction "none".

    loss_i = (1 - e) * (-log p_i[target_i]) + e * mean_c(-log p_i[c]) with p the softmax (PyTorch's definition);
    targets equal to ignore_index contribute 0. "mean" divides by the number of targets not ignored (0 if none).
    Math in at least fp32.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [N, V] with target [N], got {tuple(logits.shape)} and {tuple(target.shape)}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must hold int64 or int32 class ids, got {target.dtype}")
    kept = target != ignore_index
    if bool(((target < 0) | (target >= logits.shape[1]))[kept].any()):
        raise ValueError(f"target holds class ids outside [0, {logits.shape[1]}) that are not ignore_index")
    log_probabilities = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    safe_target = torch.where(kept, target, 0).long()
    nll = -log_probabilities.gather(1, safe_target[:, None])[:, 0]
    loss = (1.0 - label_smoothing) * nll
    # Without smoothing its term is left out, not multiplied by 0: a masked class (a logit of -inf) makes it inf.
    if label_smoothing > 0:
        loss = loss + label_smoothing * -log_probabilities.mean(dim=-1)
    loss = torch.where(kept, loss, 0.0)
    if reduction == "none":
        return loss.to(logits.dtype)
    # Not rounded back to fp16/bf16: a sum over thousands of tokens would lose a few digits.
    return loss.sum() if reduction == "sum" else loss.sum() / kept.sum().clamp(min=1)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, ignore_index: int = -100, label_smoothing: float = 0.0,
                         reduction: str = "mean") -> torch.Tensor:
    """hidden: [N, d], weight: [V, d], bias: [V], target: [N] -> cross_entropy of hidden @ weight.T + bias."""
    return cross_entropy(F.linear(hidden, weight, bias), target, ignore_index=ignore_index,
                         label_smoothing=label_smoothing, reduction=reduction)
