"""What each fused op takes: the checks of its arguments that every backend makes, the kernels in their launchers and
the plain-PyTorch reference through fastformer's dispatch. Nothing here imports Triton, so the reference keeps its
checks on a machine without it. What only a kernel cannot take (a head dim, a dtype) is each kernel module's
`unsupported_reason`."""

from typing import Optional

import torch

LENGTH_DTYPES = (torch.int32, torch.int64)
REDUCTIONS = ("mean", "sum", "none")


def _check_dropout(dropout_p: float) -> None:
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")


def _check_floating(name: str, tensor: Optional[torch.Tensor], allow_none: bool = False) -> None:
    if tensor is None and allow_none:
        return
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor{' or None' if allow_none else ''}, got "
                        f"{type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {tensor.dtype}")


def _check_same_device(first_name: str, first: torch.Tensor, named: dict[str, Optional[torch.Tensor]]) -> None:
    for name, tensor in named.items():
        if tensor is not None and tensor.device != first.device:
            raise ValueError(f"{name} is on {tensor.device} but {first_name} is on {first.device}")


# ---- attention ---------------------------------------------------------------------------------------------------

def split_packed(q: torch.Tensor, k: Optional[torch.Tensor],
                 v: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v), (qkv, None, None) or (q, kv, None) -> q, k, v views [batch, len, heads, D]; raises for any other
    form. qkv: [batch, len, 3, heads, D]; kv: [batch, k_len, 2, heads, D]."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if (tensor is not None or name == "q") and not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if k is None:
        if v is not None:
            raise ValueError("v given without k: pass q, k, v, or a packed qkv alone, or q and a packed kv")
        if q.dim() != 5 or q.shape[2] != 3:
            raise ValueError(f"packed qkv (k and v None) must be [batch, len, 3, heads, head_dim], got shape "
                             f"{tuple(q.shape)}")
        return tuple(q.unbind(2))
    if v is None:
        if k.dim() != 5 or k.shape[2] != 2:
            raise ValueError(f"packed kv (v None) must be [batch, k_len, 2, heads, head_dim], got shape "
                             f"{tuple(k.shape)}")
        return (q, *k.unbind(2))
    return q, k, v


def _check_lengths_tensor(name: str, lengths: Optional[torch.Tensor], q: torch.Tensor) -> None:
    if lengths is None:
        return
    if not isinstance(lengths, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(lengths).__name__}")
    if lengths.dtype not in LENGTH_DTYPES:
        raise TypeError(f"{name} must have dtype torch.int32 or torch.int64, got {lengths.dtype}")
    if tuple(lengths.shape) != (q.shape[0],):
        raise ValueError(f"{name} must have shape ({q.shape[0]},) (one length per batch element), got "
                         f"{tuple(lengths.shape)}")
    if lengths.device != q.device:
        raise ValueError(f"{name} is on {lengths.device} but q is on {q.device}")


def check_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lengths: Optional[torch.Tensor],
                    k_lengths: Optional[torch.Tensor], dropout_p: float) -> None:
    """q: [batch, q_len, heads, D], k/v: [batch, k_len, heads, D] (split_packed's views): types, shapes, dtypes,
    devices and options. The length values cost a host sync: check_length_values."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        _check_floating(name, tensor)
        if tensor.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, len, heads, head_dim], got shape {tuple(tensor.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if (k.shape[0], k.shape[2], k.shape[3]) != (q.shape[0], q.shape[2], q.shape[3]):
        raise ValueError(f"k {tuple(k.shape)} must match q {tuple(q.shape)} in batch, heads and head_dim")
    if k.shape[1] == 0:
        raise ValueError("k has no key (k_len 0): attention over no key is undefined")
    for name, tensor in (("k", k), ("v", v)):
        if tensor.dtype != q.dtype:
            raise ValueError(f"{name} has dtype {tensor.dtype} but q has {q.dtype}")
    _check_same_device("q", q, {"k": k, "v": v})
    _check_lengths_tensor("q_lengths", q_lengths, q)
    _check_lengths_tensor("k_lengths", k_lengths, q)
    _check_dropout(dropout_p)


def check_length_values(q_lengths: Optional[torch.Tensor], k_lengths: Optional[torch.Tensor], q_len: int,
                        k_len: int) -> None:
    """Lengths must lie in [0, q_len] for queries and [1, k_len] for keys (one host sync for both)."""
    named = [(name, t) for name, t in (("q_lengths", q_lengths), ("k_lengths", k_lengths)) if t is not None]
    if not named or named[0][1].numel() == 0:
        return
    bounds = torch.stack([torch.stack([t.min(), t.max()]).to(torch.int64) for _, t in named]).tolist()
    for (name, _), (low, high) in zip(named, bounds):
        lowest, highest = (0, q_len) if name == "q_lengths" else (1, k_len)
        if name == "k_lengths" and low == 0:
            raise ValueError("k_lengths has a 0: attention over no key is undefined")
        if low < lowest or high > highest:
            raise ValueError(f"{name} must lie in [{lowest}, {highest}], got values in [{low}, {high}]")


# ---- residual layer norm -----------------------------------------------------------------------------------------

def check_residual_layer_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                              bias: torch.Tensor, eps: float, dropout_p: float) -> None:
    """x, residual: [..., D], weight/bias: [D]."""
    _check_floating("x", x)
    _check_floating("residual", residual, allow_none=True)
    _check_floating("weight", weight)
    _check_floating("bias", bias)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension to normalize, got shape {tuple(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} and x {tuple(x.shape)} must have the same shape")
    n_cols = x.shape[-1]
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tuple(tensor.shape) != (n_cols,):
            raise ValueError(f"{name} must have shape ({n_cols},) to match x's last dimension, got "
                             f"{tuple(tensor.shape)}")
    if weight.dtype != bias.dtype:
        raise TypeError(f"weight ({weight.dtype}) and bias ({bias.dtype}) must have the same dtype")
    _check_same_device("x", x, {"residual": residual, "weight": weight, "bias": bias})
    if not eps > 0.0:
        raise ValueError(f"eps must be positive, got {eps}")
    _check_dropout(dropout_p)


# ---- cross-entropy -----------------------------------------------------------------------------------------------

def _check_cross_entropy_options(ignore_index: int, label_smoothing: float, reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")


def _check_target(target: torch.Tensor, n_rows: int, rows_name: str, device: torch.device) -> None:
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must hold int64 or int32 class ids, got {target.dtype}")
    if tuple(target.shape) != (n_rows,):
        raise ValueError(f"target must have shape ({n_rows},) to match {rows_name}, got {tuple(target.shape)}")
    if target.device != device:
        raise ValueError(f"target is on {target.device} but {rows_name} is on {device}")


def check_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                        reduction: str) -> None:
    """logits: [N, V], target: [N]."""
    _check_floating("logits", logits)
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [N, V] with V >= 1, got shape {tuple(logits.shape)}")
    _check_target(target, logits.shape[0], "logits", logits.device)
    _check_cross_entropy_options(ignore_index, label_smoothing, reduction)


def check_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               bias: Optional[torch.Tensor], ignore_index: int, label_smoothing: float,
                               reduction: str) -> None:
    """hidden: [N, d], weight: [V, d], target: [N], bias: [V] or None."""
    _check_floating("hidden", hidden)
    _check_floating("weight", weight)
    _check_floating("bias", bias, allow_none=True)
    _check_same_device("hidden", hidden, {"weight": weight, "bias": bias})
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [N, d], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1] or weight.shape[0] == 0:
        raise ValueError(f"weight must be [V, {hidden.shape[1]}] with V >= 1 to match hidden [N, "
                         f"{hidden.shape[1]}], got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != weight.shape[:1]:
        raise ValueError(f"bias must have shape ({weight.shape[0]},) to match weight, got {tuple(bias.shape)}")
    _check_target(target, hidden.shape[0], "hidden", hidden.device)
    _check_cross_entropy_options(ignore_index, label_smoothing, reduction)
