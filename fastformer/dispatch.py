"""The one switch that chooses the kernels, and the dispatch of every fused op to Triton or the reference.

- `"auto"` (the default): Triton on CUDA tensors, the plain-PyTorch reference elsewhere. CUDA inputs a kernel does
  not cover (an arbitrary float `attn_mask`, a head dim of 96, ...) fall back to the reference with a warning, shown
  once per op and reason.
- `"triton"`: Triton on any device (on CPU tensors through Triton's interpreter, which needs TRITON_INTERPRET=1
  before the kernels are imported), and nothing else: inputs a kernel does not cover raise `UnsupportedInputError`,
  naming the input and why, so that whatever runs under "triton" is known to have run the kernels.
- `"reference"`: plain PyTorch everywhere.

Every backend refuses malformed arguments alike (triton_kernels.inputs, which imports no Triton). The kernel modules
are imported lazily, so a machine without a working Triton can still use the reference.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from fastformer import reference
from fastformer.torch_version import major_minor
from triton_kernels import inputs

BACKENDS = ("auto", "triton", "reference")

# The one piece of process-wide state: which kernels run.
_backend = "auto"


class UnsupportedInputError(ValueError):
    """Raised under the "triton" backend for inputs a fused kernel does not take (under "auto" they fall back)."""


def set_backend(name: str) -> None:
    """Choose the kernels for every fused op in this process: "auto", "triton" or "reference"."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    _backend = name


def get_backend() -> str:
    return _backend


@contextmanager
def backend(name: str) -> Iterator[None]:
    """`with fastformer.backend("reference"): ...` runs the block under another backend, then restores the old one."""
    previous = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def _auto_runs_triton(tensor: torch.Tensor) -> bool:
    """Whether the "auto" backend puts an op on `tensor` through Triton: on CUDA tensors only."""
    return tensor.is_cuda


def _check_interpreter(op: str) -> None:
    """Raises where Triton's interpreter cannot run the kernels: before 3.7 it gives a program's ids as 1-element
    arrays, which NumPy >= 2.4 no longer turns into the Python ints that loops over runtime bounds need."""
    import numpy
    import triton

    if major_minor(triton.__version__) < (3, 7) and major_minor(numpy.__version__) >= (2, 4):
        raise RuntimeError(f"backend 'triton' got CPU tensors for {op}, but Triton {triton.__version__}'s interpreter "
                           f"cannot run its kernels with NumPy {numpy.__version__}: use triton >= 3.7 (or NumPy < "
                           "2.4) to interpret them, or backend 'reference'")


def _use_triton(op: str, tensor: torch.Tensor, unsupported_reason) -> bool:
    """Whether `op` runs its Triton kernel on `tensor`; `unsupported_reason()` names inputs the kernel can't take."""
    if _backend == "reference" or (_backend == "auto" and not _auto_runs_triton(tensor)):
        return False
    if _backend == "triton" and not tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"backend 'triton' got CPU tensors for {op}: Triton runs on the CPU only in its interpreter; set "
            "TRITON_INTERPRET=1 before importing fastformer, move the tensors to a GPU, or use backend 'reference'"
        )
    reason = unsupported_reason()
    if reason is None:
        if not tensor.is_cuda:
            _check_interpreter(op)
        return True
    if _backend == "triton":
        raise UnsupportedInputError(f"backend 'triton': the {op} kernel cannot take these inputs: {reason}. Use "
                                  "backend 'auto' to fall back to the reference for them, or backend 'reference'")
    # Python's default warning filter shows this once per message and call site, i.e. once per (op, reason).
    warnings.warn(f"fastformer: {op} falls back to the reference: {reason}", stacklevel=3)
    return False


def attention(q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
              q_lengths: torch.Tensor | None = None, k_lengths: torch.Tensor | None = None, causal: bool = False,
              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, check_lengths: bool = True) -> torch.Tensor:
    """q: [batch, q_len, heads, head_dim], k/v: [batch, k_len, heads, head_dim] -> [batch, q_len, heads, head_dim].

    Packed forms: attention(qkv) with qkv: [batch, len, 3, heads, head_dim]; attention(q, kv) with kv:
    [batch, k_len, 2, heads, head_dim] (the kernel then writes their gradients into one buffer).

    check_lengths=False skips the kernel's check of the length values (a host sync) for lengths already checked.
    """
    views = inputs.split_packed(q, k, v)
    inputs.check_attention(*views, q_lengths, k_lengths, dropout_p)

    def unsupported_reason() -> str | None:
        if attn_mask is not None:
            return "an explicit attn_mask (the kernel takes lengths and a causal flag)"
        if q.dtype == torch.bfloat16 and not q.is_cuda:
            return "bfloat16 on the CPU: Triton's interpreter computes bfloat16 dot products wrongly"
        from triton_kernels.attention import unsupported_reason as kernel_reason
        return kernel_reason(q, k, v)

    if _use_triton("attention", q, unsupported_reason):
        from triton_kernels.attention import flash_attention
        return flash_attention(q, k, v, q_lengths=q_lengths, k_lengths=k_lengths, causal=causal, dropout_p=dropout_p,
                               check_lengths=check_lengths)
    if check_lengths:
        inputs.check_length_values(q_lengths, k_lengths, views[0].shape[1], views[1].shape[1])
    return reference.attention(q, k, v, q_lengths=q_lengths, k_lengths=k_lengths, causal=causal,
                               attn_mask=attn_mask, dropout_p=dropout_p)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  label_smoothing: float = 0.0, reduction: str = "mean", check_targets: bool = True) -> torch.Tensor:
    """logits: [N, V], target: [N] -> loss: [] ([N] for reduction "none").

    check_targets=False skips the kernel's check of the class ids (a host sync) for targets already checked.
    """
    inputs.check_cross_entropy(logits, target, ignore_index, label_smoothing, reduction)

    def unsupported_reason() -> str | None:
        from triton_kernels.cross_entropy import unsupported_reason as kernel_reason
        return kernel_reason(logits)

    if _use_triton("cross_entropy", logits, unsupported_reason):
        from triton_kernels.cross_entropy import cross_entropy as kernel
        return kernel(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction,
                      check_targets=check_targets)
    return reference.cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
                                   reduction=reduction)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: torch.Tensor | None = None, ignore_index: int = -100, label_smoothing: float = 0.0,
                         reduction: str = "mean", check_targets: bool = True) -> torch.Tensor:
    """hidden: [N, d], weight: [V, d], target: [N] -> loss of the logits hidden @ weight.T (+ bias)."""
    inputs.check_linear_cross_entropy(hidden, weight, target, bias, ignore_index, label_smoothing, reduction)

    def unsupported_reason() -> str | None:
        from triton_kernels.cross_entropy import unsupported_reason as kernel_reason
        return kernel_reason(hidden)

    if _use_triton("linear_cross_entropy", hidden, unsupported_reason):
        from triton_kernels.cross_entropy import linear_cross_entropy as kernel
        return kernel(hidden, weight, target, bias=bias, ignore_index=ignore_index, label_smoothing=label_smoothing,
                      reduction=reduction, check_targets=check_targets)
    return reference.linear_cross_entropy(hidden, weight, target, bias=bias, ignore_index=ignore_index,
                                          label_smoothing=label_smoothing, reduction=reduction)


def residual_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor,
                        eps: float = 1e-5, dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., d] -> (LayerNorm(residual + dropout(x)), residual + dropout(x))."""
    inputs.check_residual_layer_norm(x, residual, weight, bias, eps, dropout_p)

    def unsupported_reason() -> str | None:
        from triton_kernels.layernorm_residual import unsupported_reason as kernel_reason
        return kernel_reason(x, residual, weight, bias)

    if _use_triton("residual_layer_norm", x, unsupported_reason):
        from triton_kernels.layernorm_residual import residual_layer_norm as kernel
        return kernel(x, residual, weight, bias, eps=eps, dropout_p=dropout_p)
    return reference.residual_layer_norm(x, residual, weight, bias, eps=eps, dropout_p=dropout_p)
