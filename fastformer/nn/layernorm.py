"""Drop-in `LayerNorm(residual + Dropout(x))` that runs the fused kernel through the backend switch."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fastformer import dispatch


class ResidualLayerNorm(nn.Module):
    """`nn.LayerNorm`'s parameters (so its state_dict loads) applied to `residual + Dropout(x)` in one kernel."""

    def __init__(self, normalized_shape: int | Sequence[int], eps: float = 1e-5, dropout: float = 0.0,
                 device=None, dtype=None) -> None:
        super().__init__()
        if not isinstance(normalized_shape, int):
            normalized_shape = tuple(normalized_shape)
            if len(normalized_shape) != 1:
                raise ValueError(f"only the last dimension can be normalized, got normalized_shape={normalized_shape}")
            (normalized_shape,) = normalized_shape
        self.normalized_shape = (normalized_shape,)
        self.eps = eps
        self.dropout = dropout
        self.weight = nn.Parameter(torch.ones(normalized_shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(normalized_shape, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                return_sum: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x, residual: [..., d] -> LayerNorm(residual + Dropout(x)) (and the sum, for pre-LN, if return_sum).

        Without a residual this is a plain LayerNorm of x: dropout belongs to the branch being added. Both outputs
        have the dtype of residual + x, or autocast's dtype where autocast is on.
        """
        if x.dim() == 0 or x.shape[-1] != self.normalized_shape[0]:
            raise ValueError(f"x must be [..., {self.normalized_shape[0]}], got shape {tuple(x.shape)}")
        if residual is not None and residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} and x {tuple(x.shape)} must have the same shape")
        dropout_p = self.dropout if self.training and residual is not None else 0.0
        x, residual = _in_autocast_dtype(x), _in_autocast_dtype(residual)
        y, total = dispatch.residual_layer_norm(x, residual, self.weight, self.bias, eps=self.eps, dropout_p=dropout_p)
        return (y, total) if return_sum else y


def _in_autocast_dtype(activation: torch.Tensor | None) -> torch.Tensor | None:
    """activation: [..., d] cast to autocast's dtype where autocast is on for its device (unchanged otherwise).

    Autocast would run a LayerNorm in fp32 and return fp32, and promote an fp32 residual stream plus a low-precision
    sublayer output to fp32; cast first, the residual stream and the normalized output stay in the compute dtype,
    so the next matmul needs no cast. The statistics are still computed in fp32, and the parameters stay as they are.
    Only what autocast itself would cast is cast: floating tensors other than fp64.
    """
    if activation is None or not torch.is_autocast_enabled(activation.device.type):
        return activation
    if not activation.is_floating_point() or activation.dtype == torch.float64:
        return activation
    return activation.to(torch.get_autocast_dtype(activation.device.type))
