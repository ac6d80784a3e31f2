"""Plain-PyTorch residual add (+ dropout) + LayerNorm: the oracle of triton_kernels/layernorm_residual.py.

Written out (mean, biased variance, rsqrt) rather than calling F.layer_norm, so that a test against F.layer_norm
checks something.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def residual_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                        eps: float = 1e-5, dropout_p: float = 0.0,
                        dropout_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., D], weight/bias: [D], dropout_mask: bool keep-mask like x -> (y, s), both like x.

    s = residual + dropout(x) (dropout(x) alone without a residual), y = LayerNorm(s) * weight + bias over the last
    dimension. The statistics are computed in at least fp32; y and s have the dtype of residual + x.
    """
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_mask is not None:
        if dropout_mask.dtype != torch.bool or dropout_mask.shape != x.shape:
            raise ValueError(f"dropout_mask must be a bool tensor of x's shape {tuple(x.shape)}, got "
                             f"{dropout_mask.dtype} {tuple(dropout_mask.shape)}")
        x = x * dropout_mask / (1.0 - dropout_p)
    elif dropout_p > 0.0:
        x = F.dropout(x, dropout_p)
    s = x if residual is None else residual + x
    compute_dtype = torch.promote_types(s.dtype, torch.float32)
    s_wide = s.to(compute_dtype)
    mean = s_wide.mean(dim=-1, keepdim=True)
    centered = s_wide - mean
    variance = centered.square().mean(dim=-1, keepdim=True)
    normalized = centered * torch.rsqrt(variance + eps)
    y = normalized * weight.to(compute_dtype) + bias.to(compute_dtype)
    return y.to(s.dtype), s
