"""Drop-in `torch.nn.CrossEntropyLoss` (with label smoothing) that runs the fused kernel through the backend switch."""

from __future__ import annotations

import torch
from torch import nn

from fastformer import dispatch

REDUCTIONS = ("mean", "sum", "none")


class _CrossEntropyOptions(nn.Module):
    """torch.nn.CrossEntropyLoss's options, validated, shared by both losses.

    check_targets=False skips the fused kernel's check of the class ids (one host sync per call), for targets the
    caller has already checked (fastformer.Transformer.loss does, together with its other checks).
    """

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean",
                 check_targets: bool = True) -> None:
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.reduction = reduction
        self.check_targets = check_targets


class LabelSmoothedCrossEntropyLoss(_CrossEntropyOptions):
    """`torch.nn.CrossEntropyLoss(ignore_index, label_smoothing, reduction)` for [N, C] or [B, T, C] logits.

    [B, T, C] logits pair with [B, T] targets (the layout a decoder produces), and reduction "none" then returns
    [B, T]. One deliberate difference: "mean" over targets that are all ignored is 0 (PyTorch gives NaN).
    """

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """logits: [N, C] or [B, T, C], target: [N] or [B, T] -> loss: [] (or target's shape for "none")."""
        if logits.dim() not in (2, 3) or target.shape != logits.shape[:-1]:
            raise ValueError(f"logits [N, C] or [B, T, C] need target [N] or [B, T]; got logits "
                             f"{tuple(logits.shape)} and target {tuple(target.shape)}")
        loss = dispatch.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                     ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
                                     reduction=self.reduction, check_targets=self.check_targets)
        return loss.view(target.shape) if self.reduction == "none" else loss


class LinearCrossEntropyLoss(_CrossEntropyOptions):
    """The output projection and `LabelSmoothedCrossEntropyLoss` in one: the [N, vocab] logits are never held whole.

    Holds no parameters: the projection's weight ([vocab, d]; a tied embedding) is passed to forward.
    """

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [..., d], weight: [vocab, d], target: [...] -> loss of hidden @ weight.T (+ bias): [] or [...]."""
        if target.shape != hidden.shape[:-1] or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
            raise ValueError(f"hidden [..., d] needs weight [vocab, d] and target [...]; got hidden "
                             f"{tuple(hidden.shape)}, weight {tuple(weight.shape)}, target {tuple(target.shape)}")
        loss = dispatch.linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, target.reshape(-1),
                                             bias=bias, ignore_index=self.ignore_index,
                                             label_smoothing=self.label_smoothing, reduction=self.reduction,
                                             check_targets=self.check_targets)
        return loss.view(target.shape) if self.reduction == "none" else loss
