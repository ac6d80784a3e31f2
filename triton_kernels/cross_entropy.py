"""Label-smoothed cross-entropy over [N, V] logits, and the output projection fused into it (linear + CE).

loss_i = (1 - e) * (-log p_i[target_i]) + e * mean_c(-log p_i[c]), p = softmax(logits_i), PyTorch's definition.
One kernel does all the work, one program per row, in fp32 whatever the logits' dtype: a first sweep over the row
keeps a running max, the sum of exp(x - max) and the sum of x (online softmax), which give the log-sum-exp and the
loss; a second sweep writes the gradient (softmax - (1 - e) * onehot(target) - e / V) times d(total)/d(row loss),
which may be the logits' own buffer. The second sweep re-reads a row the first has just read, so a row that stays in
cache costs one read and one write of the logits. Rows whose target is ignore_index are not read and get zero loss
and gradient.

`cross_entropy` runs both sweeps in forward, in one launch, for an upstream gradient of 1 (the loss itself), when a
gradient will be needed; backward then only scales it by the real upstream gradient, in place, and a row whose scale
is exactly 1 (loss.backward() of a "mean" or "sum" loss) is not touched at all. The gradient goes into a new buffer,
or over the logits themselves with overwrite_logits=True.
`linear_cross_entropy` never holds all N x V logits: it walks chunks of tokens, and for each one a cuBLAS matmul
makes the chunk's logits, the kernel turns them into their gradient in place, and two more matmuls put that chunk's
share of the hidden and weight gradients into their buffers (the weight's summed in place: Liger-Kernel's fused
linear cross-entropy). Those gradients are scaled in place by the incoming gradient in backward; with reduction
"none" that is one scale per token, so forward only computes the losses and backward recomputes the chunks.
A gradient computed in forward is consumed by the first backward: a second one (retain_graph=True) raises.
"""

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from triton_kernels._host import next_power_of_2
from triton_kernels.inputs import check_cross_entropy, check_linear_cross_entropy

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Bytes of logits a program sweeps per step (4096 fp32 or 8192 fp16/bf16 elements): wide enough that a 37k vocab
# takes a handful of steps, narrow enough to stay in registers.
MAX_BLOCK_BYTES = 16384
# Fused linear + CE: a chunk's logits (which become their own gradient) take at most 1/LOGITS_FRACTION of what all
# N x V logits would and at most CHUNK_LOGITS_BYTES, so that with the gradient buffers (the weight's V x d summed in
# fp32) everything stays under a quarter of the unfused logits at transformer-base shapes (N ~ 16-25k, V = 37k,
# d = 512); chunks of 1024+ rows keep the weight gradient's in-place sum (a V x d pass per chunk, in the matmul's
# epilogue) small next to the chunk's three matmuls.
LOGITS_FRACTION = 16
CHUNK_LOGITS_BYTES = 256 * 1024 * 1024
# Chunks of whole 128-row tiles leave no ragged tile in cuBLAS's matmuls.
GEMM_ROW_TILE = 128


@triton.jit
def _cross_entropy_kernel(
    logits_ptr,  # [n_rows, V], rows logits_row_stride elements apart
    grad_ptr,  # [n_rows, V], rows grad_row_stride apart; may be logits_ptr itself; not written without WRITE_GRAD
    target_ptr,  # [n_rows], int64 or int32
    loss_ptr,  # [n_rows], fp32; not written without COMPUTE_LOSS
    lse_ptr,  # [n_rows], fp32: written with COMPUTE_LOSS, else read
    grad_scale_ptr,  # [n_rows] (grad_scale_stride 1) or [] (stride 0): d(total)/d(row loss); read with WRITE_GRAD
    written_scale_ptr,  # []: with SKIP_WRITTEN, grad already holds the gradient at this scale; rows at it are skipped
    logits_row_stride,
    grad_row_stride,
    grad_scale_stride,
    n_cols,  # V
    ignore_index,
    label_smoothing,
    COMPUTE_LOSS: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    SKIP_WRITTEN: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """logits: [n_rows, V] -> loss, lse: [n_rows] (COMPUTE_LOSS) and/or grad: [n_rows, V] (WRITE_GRAD); one row each."""
    # int64 so that offsets past 2**31 elements (N x V of a large batch) do not wrap.
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(target_ptr + row).to(tl.int64)
    kept = target != ignore_index
    logits_row_ptr = logits_ptr + row * logits_row_stride
    # An ignored row reads nothing, so padding costs no memory traffic.
    n_read = tl.where(kept, n_cols, 0)

    if COMPUTE_LOSS:
        running_max = float("-inf")
        running_sum = 0.0  # of exp(x - running_max)
        logit_sum = 0.0
        for start in range(0, n_read, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            in_row = cols < n_cols
            x = tl.load(logits_row_ptr + cols, mask=in_row, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x, axis=0))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            running_max = new_max
            logit_sum += tl.sum(tl.where(in_row, x, 0.0), axis=0)
        # An ignored row gets lse 0 (not log(0)), and with it a loss of exactly 0.
        lse = tl.where(kept, running_max + tl.log(tl.where(kept, running_sum, 1.0)), 0.0)
        target_logit = tl.load(logits_row_ptr + target, mask=kept, other=0.0).to(tl.float32)
        # -log p[c] = lse - x[c]; its mean over the classes is lse - mean(x).
        # Without smoothing its term is left out, not multiplied by 0: a masked class (a logit of -inf) makes it inf.
        smoothing_term = label_smoothing * tl.where(label_smoothing > 0, lse - logit_sum / n_cols, 0.0)
        loss = (1.0 - label_smoothing) * (lse - target_logit) + smoothing_term
        tl.store(loss_ptr + row, loss)
        tl.store(lse_ptr + row, lse)
    else:
        lse = tl.load(lse_ptr + row)

    if WRITE_GRAD:
        scale = tl.load(grad_scale_ptr + row * grad_scale_stride).to(tl.float32)
        grad_row_ptr = grad_ptr + row * grad_row_stride
        n_write = n_cols
        if SKIP_WRITTEN:
            # Rows whose gradient forward wrote at this very scale (loss.backward() of a "mean" or "sum" loss), and
            # ignored rows (zero), cost no memory traffic.
            n_write = tl.where(kept & (scale != tl.load(written_scale_ptr)), n_cols, 0)
        for start in range(0, n_write, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(logits_row_ptr + cols, mask=cols < n_read, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse) - label_smoothing / n_cols - tl.where(cols == target, 1.0 - label_smoothing, 0.0)
            grad = tl.where(kept, grad * scale, 0.0)
            tl.store(grad_row_ptr + cols, grad.to(grad_ptr.dtype.element_ty), mask=cols < n_cols)


@triton.jit
def _scale_rows_kernel(
    grad_ptr,  # [n_rows, n_cols], rows row_stride elements apart: scaled in place
    scale_ptr,  # [n_rows] (scale_stride 1) or [] (stride 0), fp32
    target_ptr,  # [n_rows]; read with SKIP_IGNORED
    row_stride,
    scale_stride,
    n_cols,
    ignore_index,
    SKIP_IGNORED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """grad[row, block] *= scale[row]; one program per (row, block of columns)."""
    row = tl.program_id(0).to(tl.int64)
    scale = tl.load(scale_ptr + row * scale_stride)
    # A scale of exactly 1 (the usual loss.backward()) and an ignored row's zero gradient cost no memory traffic.
    needed = scale != 1.0
    if SKIP_IGNORED:
        needed = needed & (tl.load(target_ptr + row) != ignore_index)
    if needed:
        cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        in_row = cols < n_cols
        pointers = grad_ptr + row * row_stride + cols
        grad = tl.load(pointers, mask=in_row).to(tl.float32)
        tl.store(pointers, (grad * scale).to(grad_ptr.dtype.element_ty), mask=in_row)


def _block_config(n_cols: int, element_size: int) -> tuple[int, int]:
    """V, bytes per logit -> (BLOCK_V, num_warps)."""
    block_v = min(next_power_of_2(n_cols), max(1, MAX_BLOCK_BYTES // element_size))
    # About 8 logits per thread (one or two 16-byte loads): ~32 registers on sm_90, so that two programs share a
    # multiprocessor and keep enough loads in flight.
    return block_v, min(32, max(4, block_v // 256))


def _cross_entropy_rows(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, ignore_index: int,
                        label_smoothing: float, row_loss: Optional[torch.Tensor] = None,
                        grad: Optional[torch.Tensor] = None, grad_scale: Optional[torch.Tensor] = None,
                        written_scale: Optional[torch.Tensor] = None) -> None:
    """logits: [N, V] (unit column stride), target, lse: [N] -> with row_loss ([N] fp32), each row's loss into it and
    its log-sum-exp into lse, else lse is read; with grad ([N, V], may be logits), the gradient times grad_scale
    ([] or [N]) into it, except in rows whose grad_scale equals written_scale ([]; grad holds them already)."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    compute_loss, write_grad = row_loss is not None, grad is not None
    block_v, num_warps = _block_config(n_cols, logits.element_size())
    _cross_entropy_kernel[(n_rows,)](
        logits, grad if write_grad else logits, target, row_loss if compute_loss else lse, lse,
        grad_scale if write_grad else lse, lse if written_scale is None else written_scale,
        logits.stride(0), grad.stride(0) if write_grad else 0,
        grad_scale.stride(0) if write_grad and grad_scale.dim() == 1 else 0,
        n_cols, ignore_index, label_smoothing,
        COMPUTE_LOSS=compute_loss, WRITE_GRAD=write_grad, SKIP_WRITTEN=written_scale is not None, BLOCK_V=block_v,
        num_warps=num_warps,
    )


def _check_class_ids(target: torch.Tensor, n_classes: int, ignore_index: int) -> None:
    """Out-of-range class ids would read outside the logits; this costs one device-to-host sync per call, which
    check_targets=False skips for targets already checked (the ops then never synchronize with the host)."""
    outside = (target != ignore_index) & ((target < 0) | (target >= n_classes))
    if bool(outside.any()):
        raise ValueError(f"target holds class ids outside [0, {n_classes}) that are not ignore_index "
                         f"({ignore_index})")


def _kept_count(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """-> [] fp32: how many targets are not ignored, at least 1 (so that "mean" over none of them is 0, not NaN)."""
    return (target != ignore_index).sum().clamp(min=1).float()


def _reduce(row_loss: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str,
            dtype: torch.dtype) -> torch.Tensor:
    """row_loss: [N] fp32 -> [N] in dtype for "none", [] fp32 for "mean" and "sum": a sum over a batch's tokens
    rounded to bf16 would be off by up to 1/256 of itself (steps of 512 at a 25k-token batch's ~1e5)."""
    if reduction == "none":
        return row_loss.to(dtype)
    total = row_loss.sum()
    return total / _kept_count(target, ignore_index) if reduction == "mean" else total


def _loss_like(rows: torch.Tensor, reduction: str, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor shaped and typed as _reduce's result for [N, ...] rows (for the ops' fake kernels)."""
    if reduction == "none":
        return rows.new_empty(rows.shape[:1], dtype=dtype)
    return rows.new_empty((), dtype=torch.float32)


def _row_grad_scale(grad_loss: torch.Tensor, target: torch.Tensor, ignore_index: int,
                    reduction: str) -> torch.Tensor:
    """d(total)/d(loss): [] or [N] -> d(total)/d(each row's loss): [] ("mean", "sum") or [N] ("none"), fp32."""
    scale = grad_loss.float()
    return scale / _kept_count(target, ignore_index) if reduction == "mean" else scale


def _scale_rows(grad: torch.Tensor, scale: torch.Tensor, target: Optional[torch.Tensor], ignore_index: int) -> None:
    """grad: [n_rows, n_cols] (unit column stride) *= scale ([] or [n_rows]) in place, rows by row; rows whose
    target ([n_rows], optional) is ignore_index are left as they are (zero)."""
    n_rows, n_cols = grad.shape
    block, num_warps = _block_config(n_cols, grad.element_size())
    scale = scale.float()
    _scale_rows_kernel[(n_rows, triton.cdiv(n_cols, block))](
        grad, scale, grad if target is None else target, grad.stride(0), scale.stride(0) if scale.dim() == 1 else 0,
        n_cols, ignore_index, SKIP_IGNORED=target is not None, BLOCK=block, num_warps=min(num_warps, 8),
    )


@torch.library.custom_op("fastformer::scale_gradient_", mutates_args=("grad",))
def _scale_gradient_op(grad: torch.Tensor, scale: torch.Tensor, target: Optional[torch.Tensor],
                       ignore_index: int) -> None:
    """grad: [n_rows, ...] contiguous past dim 0 (or [n] as one row) *= scale ([] or [n_rows]) in place."""
    if grad.numel() == 0:
        return
    rows = grad.view(1, -1) if grad.dim() == 1 else grad.view(grad.shape[0], -1)
    _scale_rows(rows, scale, target, ignore_index)


@_scale_gradient_op.register_fake
def _(grad: torch.Tensor, scale: torch.Tensor, target: Optional[torch.Tensor], ignore_index: int) -> None:
    return None


def _saved_gradients(ctx, op: str) -> tuple:
    """ctx.saved_tensors, with a clear error where the gradient computed in forward was already consumed."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"{op}: double backward (create_graph=True) is not supported: the gradient is computed "
                           "in forward by a kernel, not by differentiable operations")
    try:
        return ctx.saved_tensors
    except RuntimeError as error:
        if "modified by an inplace operation" not in str(error):
            raise
        raise RuntimeError(f"{op}: its gradient, computed in forward, was already scaled in place by a first "
                           "backward (or changed by the caller); a second backward through the same graph "
                           "(retain_graph=True) is not supported: run forward again") from error


# ---- cross_entropy: the loss and its gradient in one forward launch; backward scales -----------------------------

def _cross_entropy_forward(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                           reduction: str, check_targets: bool,
                           grad: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [N, V] -> (loss, lse: [N] fp32); with grad ([N, V], may be logits), the gradient of the loss (for an
    upstream gradient of 1) written into it by the same launch."""
    if check_targets:
        _check_class_ids(target, logits.shape[1], ignore_index)
    row_loss = logits.new_empty(logits.shape[:1], dtype=torch.float32)
    lse = torch.empty_like(row_loss)
    grad_scale = None
    if grad is not None:
        grad_scale = _row_grad_scale(torch.ones((), device=logits.device), target, ignore_index, reduction)
    _cross_entropy_rows(logits, target, lse, ignore_index, label_smoothing, row_loss=row_loss, grad=grad,
                        grad_scale=grad_scale)
    return _reduce(row_loss, target, ignore_index, reduction, logits.dtype), lse


@torch.library.custom_op("fastformer::cross_entropy", mutates_args=())
def _cross_entropy_op(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                      reduction: str, compute_grad: bool,
                      check_targets: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits: [N, V], target: [N] -> (loss: [] fp32 or [N] in logits' dtype, lse: [N] fp32, with compute_grad the
    gradient of the loss w.r.t. the logits for an upstream gradient of 1: [N, V] in logits' dtype, else [0])."""
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device) if compute_grad else None
    loss, lse = _cross_entropy_forward(logits, target, ignore_index, label_smoothing, reduction, check_targets, grad)
    return loss, lse, logits.new_empty(0) if grad is None else grad


@_cross_entropy_op.register_fake
def _(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float, reduction: str,
      compute_grad: bool, check_targets: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    loss = _loss_like(logits, reduction, logits.dtype)
    grad = logits.new_empty(logits.shape) if compute_grad else logits.new_empty(0)
    return loss, logits.new_empty(logits.shape[:1], dtype=torch.float32), grad


@torch.library.custom_op("fastformer::cross_entropy_backward_", mutates_args=("grad",))
def _cross_entropy_backward_op(grad_loss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor,
                               lse: torch.Tensor, grad: torch.Tensor, ignore_index: int, label_smoothing: float,
                               reduction: str) -> None:
    """grad: [N, V], forward's gradient of the loss for an upstream gradient of 1 -> the gradient for grad_loss
    ([] or [N]), in place: rows whose scale is unchanged are not touched; the others are recomputed from the logits
    at their exact scale (rounded once, where scaling the rounded gradient would round twice)."""
    ones = torch.ones((), device=logits.device)
    _cross_entropy_rows(logits, target, lse, ignore_index, label_smoothing, grad=grad,
                        grad_scale=_row_grad_scale(grad_loss, target, ignore_index, reduction),
                        written_scale=_row_grad_scale(ones, target, ignore_index, reduction))


@_cross_entropy_backward_op.register_fake
def _(grad_loss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor,
      ignore_index: int, label_smoothing: float, reduction: str) -> None:
    return None


def _cross_entropy_setup_context(ctx, inputs: tuple, output: tuple) -> None:
    logits, target, ignore_index, label_smoothing, reduction, *_ = inputs
    _, lse, grad = output
    ctx.mark_non_differentiable(lse, grad)
    ctx.save_for_backward(logits, target, lse, grad)
    ctx.ignore_index, ctx.label_smoothing, ctx.reduction = ignore_index, label_smoothing, reduction


def _cross_entropy_backward(ctx, grad_loss: torch.Tensor, _grad_lse, _grad_grad) -> tuple:
    logits, target, lse, grad_logits = _saved_gradients(ctx, "cross_entropy")
    if grad_logits.shape != logits.shape:
        raise RuntimeError("cross_entropy: backward through a forward run with compute_grad=False")
    _cross_entropy_backward_op(grad_loss, logits, target, lse, grad_logits, ctx.ignore_index, ctx.label_smoothing,
                               ctx.reduction)
    return grad_logits, *(None,) * 6


_cross_entropy_op.register_autograd(_cross_entropy_backward, setup_context=_cross_entropy_setup_context)


@torch.library.custom_op("fastformer::cross_entropy_over_logits", mutates_args=("logits",))
def _cross_entropy_over_logits_op(logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                                  label_smoothing: float, reduction: str,
                                  check_targets: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [N, V] -> (loss, lse: [N] fp32), the logits overwritten with the loss's gradient (upstream 1)."""
    return _cross_entropy_forward(logits, target, ignore_index, label_smoothing, reduction, check_targets, logits)


@_cross_entropy_over_logits_op.register_fake
def _(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float, reduction: str,
      check_targets: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _loss_like(logits, reduction, logits.dtype), logits.new_empty(logits.shape[:1], dtype=torch.float32)


class _CrossEntropyOverLogits(torch.autograd.Function):
    """cross_entropy whose forward turns the logits' own buffer into their gradient (a custom op that mutates an
    input cannot carry an autograd formula itself)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                reduction: str, check_targets: bool) -> torch.Tensor:
        loss, _ = _cross_entropy_over_logits_op(logits, target, ignore_index, label_smoothing, reduction,
                                                check_targets)
        ctx.save_for_backward(logits, target)
        ctx.ignore_index = ignore_index
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor) -> tuple:
        grad_logits, target = _saved_gradients(ctx, "cross_entropy")
        # The logits are gone, so the rounded gradient itself is scaled: exact for a scale of 1 (skipped) or a power
        # of two (a GradScaler's), one more rounding for any other.
        _scale_gradient_op(grad_logits, grad_loss, target, ctx.ignore_index)
        return grad_logits, *(None,) * 5


# ---- linear_cross_entropy: chunks of tokens, gradients in forward ------------------------------------------------

def _chunk_rows(n_rows: int, vocab: int, element_size: int) -> int:
    """How many tokens' logits one chunk of the fused linear + CE holds."""
    rows = min(n_rows // LOGITS_FRACTION, CHUNK_LOGITS_BYTES // (vocab * element_size))
    if rows >= GEMM_ROW_TILE:
        rows -= rows % GEMM_ROW_TILE
    return max(1, rows)


@functools.cache
def _fp32_out_matmul(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch's matmuls on `device` write a `dtype` (fp16/bf16) product straight into an fp32 out, in place:
    torch.mm(a, b, out_dtype=float32, out=out) and torch.addmm(out, a, b, out_dtype=float32, out=out) with out fp32.
    Only CUDA has the kernels. mm/addmm gained out_dtype in torch 2.8 (pytorch#150812), but addmm refused an fp32
    `self` with fp16/bf16 matrices (pytorch#154086) until pytorch#167931 (November 2025) relaxed it. Decided once
    per device, dtype and process by making both calls on 16 x 16 matrices (the shapes do not enter those dtype
    checks), so that a torch on either side of those changes takes the path it supports."""
    a = torch.zeros(16, 16, dtype=dtype, device=device)
    out = torch.zeros(16, 16, dtype=torch.float32, device=device)
    try:
        torch.mm(a, a, out_dtype=torch.float32, out=out)
        torch.addmm(out, a, a, out_dtype=torch.float32, out=out)
    except (TypeError, RuntimeError):  # no out_dtype argument, a refused dtype combination, no kernel (the CPU)
        return False
    return True


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """out (+)= a @ b, in place: an fp16/bf16 product goes straight into an fp32 out, rounded once, where torch's
    matmul can (_fp32_out_matmul); elsewhere (the CPU, an older torch) the product is a temporary in a's dtype,
    accumulated in fp32."""
    if out.dtype == a.dtype:
        if accumulate:
            torch.addmm(out, a, b, out=out)
        else:
            torch.mm(a, b, out=out)
    elif out.dtype == torch.float32 and _fp32_out_matmul(out.device, a.dtype):
        if accumulate:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        else:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
    elif accumulate:
        out += torch.mm(a, b)
    else:
        out.copy_(torch.mm(a, b))


def _linear_cross_entropy_chunks(
        hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
        ignore_index: int, label_smoothing: float, matmul_dtype: torch.dtype, lse: torch.Tensor,
        row_loss: Optional[torch.Tensor] = None, grad_scale: Optional[torch.Tensor] = None,
) -> Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
    """hidden: [N, d], weight: [V, d], bias: [V] -> with row_loss ([N] fp32), each token's loss into it and its
    log-sum-exp into lse ([N] fp32), else lse is read; with grad_scale ([] or [N]: d(total)/d(row loss)), returns
    the gradients of hidden, weight and bias (None without a bias) in fp32.

    fp32 so that each is rounded once to an fp16/bf16 parameter's dtype, after the upstream gradient is applied (as
    F.linear's backward rounds its one fp32-accumulated product; summing a dozen rounded chunks in bf16 would lose
    bits): for fp32 parameters (the trainer's, under autocast) these buffers are the gradients themselves, the
    weight's summed chunk by chunk in place by the matmul, and nothing is copied; an fp16/bf16 parameter pays one
    fp32 buffer. The hidden gradient's chunks are disjoint rows, each written once."""
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    with_grads = grad_scale is not None
    # Cast here as F.linear would under autocast, then run the matmuls with autocast off so that they run in
    # exactly this dtype.
    with torch.autocast(hidden.device.type, enabled=False):
        hidden_mm, weight_mm = hidden.to(matmul_dtype), weight.to(matmul_dtype)
        bias_mm = None if bias is None else bias.to(matmul_dtype)
        if with_grads:
            grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            grad_bias = None if bias is None else torch.zeros(vocab, dtype=torch.float32, device=weight.device)
        rows = _chunk_rows(n_rows, vocab, torch.finfo(matmul_dtype).bits // 8)
        for start in range(0, n_rows, rows):
            chunk = slice(start, min(start + rows, n_rows))
            chunk_scale = None
            if with_grads:
                chunk_scale = grad_scale[chunk] if grad_scale.dim() == 1 else grad_scale
            logits = _chunk_logits(hidden_mm[chunk], weight_mm, bias_mm)
            # With gradients, the kernel turns the chunk's logits into their gradient in place.
            _cross_entropy_rows(logits, target[chunk], lse[chunk], ignore_index, label_smoothing,
                                row_loss=None if row_loss is None else row_loss[chunk],
                                grad=logits if with_grads else None, grad_scale=chunk_scale)
            if with_grads:
                _mm_into(grad_hidden[chunk], logits, weight_mm, accumulate=False)
                _mm_into(grad_weight, logits.T, hidden_mm[chunk], accumulate=True)
                if grad_bias is not None:
                    grad_bias += logits.sum(0, dtype=torch.float32)
            # Freed before the next chunk's logits are made, so that two chunks are never held at once.
            del logits
    return (grad_hidden, grad_weight, grad_bias) if with_grads else None


def _chunk_logits(hidden_chunk: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """hidden_chunk: [rows, d], weight: [V, d], bias: [V] -> [rows, V]."""
    return torch.mm(hidden_chunk, weight.T) if bias is None else torch.addmm(bias, hidden_chunk, weight.T)


@torch.library.custom_op("fastformer::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(
        hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
        ignore_index: int, label_smoothing: float, reduction: str, matmul_dtype: torch.dtype, compute_grads: bool,
        check_targets: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden: [N, d], weight: [V, d], target: [N], bias: [V] -> (loss: [] fp32 or [N] in matmul_dtype, lse: [N] fp32,
    and with compute_grads (reduction "mean" or "sum" only) the gradients of the loss w.r.t. hidden [N, d], weight
    [V, d], bias [V] in fp32, for an upstream gradient of 1; without, and for a missing bias, empty [0] tensors)."""
    if check_targets:
        _check_class_ids(target, weight.shape[0], ignore_index)
    row_loss = hidden.new_empty(hidden.shape[:1], dtype=torch.float32)
    lse = torch.empty_like(row_loss)
    grad_scale = None
    if compute_grads:
        grad_scale = _row_grad_scale(torch.ones((), device=hidden.device), target, ignore_index, reduction)
    grads = _linear_cross_entropy_chunks(hidden, weight, target, bias, ignore_index, label_smoothing, matmul_dtype,
                                         lse, row_loss=row_loss, grad_scale=grad_scale)
    grads = grads if grads is not None else (None, None, None)
    # Distinct empty tensors: a custom op's outputs may not alias one another.
    return (_reduce(row_loss, target, ignore_index, reduction, matmul_dtype), lse,
            *(hidden.new_empty(0) if grad is None else grad for grad in grads))


@_linear_cross_entropy_op.register_fake
def _(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
      ignore_index: int, label_smoothing: float, reduction: str, matmul_dtype: torch.dtype, compute_grads: bool,
      check_targets: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    loss = _loss_like(hidden, reduction, matmul_dtype)
    lse = hidden.new_empty(hidden.shape[:1], dtype=torch.float32)
    if not compute_grads:
        return loss, lse, hidden.new_empty(0), hidden.new_empty(0), hidden.new_empty(0)
    fp32 = dict(dtype=torch.float32)
    return (loss, lse, torch.empty_like(hidden, **fp32), torch.empty_like(weight, **fp32),
            hidden.new_empty(0) if bias is None else torch.empty_like(bias, **fp32))


@torch.library.custom_op("fastformer::linear_cross_entropy_backward", mutates_args=())
def _linear_cross_entropy_backward_op(
        grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
        bias: Optional[torch.Tensor], lse: torch.Tensor, ignore_index: int, label_smoothing: float, reduction: str,
        matmul_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """grad_loss: [] or [N] -> gradients w.r.t. hidden [N, d], weight [V, d], bias [V] ([0] without a bias), by
    recomputing the logits chunk by chunk with forward's log-sum-exps lse: [N]."""
    grad_scale = _row_grad_scale(grad_loss, target, ignore_index, reduction)
    grad_hidden, grad_weight, grad_bias = _linear_cross_entropy_chunks(
        hidden, weight, target, bias, ignore_index, label_smoothing, matmul_dtype, lse, grad_scale=grad_scale)
    return (grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype),
            hidden.new_empty(0) if bias is None else grad_bias.to(bias.dtype))


@_linear_cross_entropy_backward_op.register_fake
def _(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
      bias: Optional[torch.Tensor], lse: torch.Tensor, ignore_index: int, label_smoothing: float, reduction: str,
      matmul_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty_like(hidden), torch.empty_like(weight),
            hidden.new_empty(0) if bias is None else torch.empty_like(bias))


def _linear_cross_entropy_setup_context(ctx, inputs: tuple, output: tuple) -> None:
    hidden, weight, target, bias, ignore_index, label_smoothing, reduction, matmul_dtype, _, _ = inputs
    _, lse, grad_hidden, grad_weight, grad_bias = output
    ctx.mark_non_differentiable(lse, grad_hidden, grad_weight, grad_bias)
    ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
    ctx.ignore_index, ctx.label_smoothing, ctx.reduction = ignore_index, label_smoothing, reduction
    ctx.matmul_dtype = matmul_dtype
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, target, bias, lse)
    else:
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)


def _linear_cross_entropy_backward(ctx, grad_loss: torch.Tensor, *_grads_of_non_differentiable) -> tuple:
    saved = _saved_gradients(ctx, "linear_cross_entropy")
    if ctx.reduction == "none":
        hidden, weight, target, bias, lse = saved
        grads = _linear_cross_entropy_backward_op(grad_loss, hidden, weight, target, bias, lse, ctx.ignore_index,
                                                  ctx.label_smoothing, ctx.reduction, ctx.matmul_dtype)
    else:
        grads = tuple(_scaled_forward_gradient(grad, grad_loss, dtype or grad.dtype)
                      for grad, dtype in zip(saved, ctx.dtypes))
    grad_hidden, grad_weight, grad_bias = grads
    # Without a bias, grad_bias is an empty placeholder.
    return grad_hidden, grad_weight, None, grad_bias if ctx.dtypes[2] else None, *(None,) * 6


def _scaled_forward_gradient(grad: torch.Tensor, grad_loss: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """grad: forward's fp32 gradient for d(loss) = 1 -> times grad_loss ([]), in dtype: in place for fp32 (nothing
    touched for the usual grad_loss of 1), else in one pass into the new fp16/bf16 gradient (rounded once)."""
    if dtype == grad.dtype:
        _scale_gradient_op(grad, grad_loss, None, 0)
        return grad
    return torch.mul(grad, grad_loss.float(), out=torch.empty(grad.shape, dtype=dtype, device=grad.device))


_linear_cross_entropy_op.register_autograd(_linear_cross_entropy_backward,
                                          setup_context=_linear_cross_entropy_setup_context)


# ---- public interface --------------------------------------------------------------------------------------------

def unsupported_reason(tensor: torch.Tensor) -> Optional[str]:
    """Why the kernels cannot take these (well-formed) logits or hidden states, or None if they can."""
    if tensor.dtype not in SUPPORTED_DTYPES:
        return f"dtype {tensor.dtype}; the kernels take float32, float16 and bfloat16"
    return None


def _check_supported(op: str, named: dict[str, Optional[torch.Tensor]]) -> None:
    for name, tensor in named.items():
        reason = None if tensor is None else unsupported_reason(tensor)
        if reason is not None:
            raise ValueError(f"{op}: {name} has {reason}")


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  label_smoothing: float = 0.0, reduction: str = "mean", overwrite_logits: bool = False,
                  check_targets: bool = True) -> torch.Tensor:
    """logits: [N, V], target: [N] -> loss: [] in fp32 ([N] in logits' dtype for reduction "none"); differentiable
    w.r.t. logits.

    PyTorch's label-smoothed cross-entropy, with one deliberate difference: "mean" over targets that are all
    ignore_index is 0 with a zero gradient (PyTorch gives NaN). When a gradient will be needed, forward computes it
    too (one kernel launch), into a new [N, V] buffer; overwrite_logits=True writes it over the logits instead, in
    forward, so the logits are gone once this returns: only for logits that are a temporary nothing else reads (an
    output projection's result; never a leaf tensor). Backward scales that gradient in place, so the graph takes
    one backward (retain_graph=True and a second backward raise), and no double backward. check_targets=False
    skips the check of the class ids (a host sync) for targets already checked; an id outside [0, V) then reads
    outside the logits.
    """
    check_cross_entropy(logits, target, ignore_index, label_smoothing, reduction)
    _check_supported("cross_entropy", {"logits": logits})
    compute_grad = torch.is_grad_enabled() and logits.requires_grad
    if overwrite_logits and compute_grad and logits.is_leaf:
        raise ValueError("overwrite_logits=True needs logits computed from something else (e.g. an output "
                         "projection's result): a leaf tensor's values would be lost")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    options = (target.contiguous(), ignore_index, float(label_smoothing), reduction)
    # Under torch.compile the compiler plans the buffers, so the gradient always gets its own.
    if overwrite_logits and compute_grad and not torch.compiler.is_compiling():
        return _CrossEntropyOverLogits.apply(logits, *options, bool(check_targets))
    loss, *_ = _cross_entropy_op(logits, *options, compute_grad, bool(check_targets))
    return loss


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.dtype:
    """The dtype F.linear(hidden, weight, bias) computes in: autocast's, if on for this device, else the inputs'."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is not None and tensor.dtype != hidden.dtype:
            raise TypeError(f"{name} has dtype {tensor.dtype} but hidden has {hidden.dtype} (outside autocast "
                            "they must match, as for F.linear)")
    return hidden.dtype


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                         bias: Optional[torch.Tensor] = None, ignore_index: int = -100, label_smoothing: float = 0.0,
                         reduction: str = "mean", check_targets: bool = True) -> torch.Tensor:
    """hidden: [N, d], weight: [V, d], target: [N], bias: [V] -> cross_entropy(hidden @ weight.T + bias, target):
    [] in fp32 ([N] in the logits' dtype for "none"); differentiable w.r.t. hidden, weight and bias.

    The N x V logits are never held whole (chunks of tokens, each at most 1/LOGITS_FRACTION of them). Under
    torch.autocast the matmuls run in autocast's dtype, as F.linear's would; the weight gradient is summed in fp32.
    With reduction "mean" or "sum", forward computes the gradients and backward scales them in place (one backward
    per graph, as for cross_entropy). check_targets: as for cross_entropy.
    """
    check_linear_cross_entropy(hidden, weight, target, bias, ignore_index, label_smoothing, reduction)
    _check_supported("linear_cross_entropy", {"hidden": hidden, "weight": weight, "bias": bias})
    matmul_dtype = _matmul_dtype(hidden, weight, bias)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    loss, *_ = _linear_cross_entropy_op(hidden.contiguous(), weight.contiguous(), target.contiguous(), bias,
                                        ignore_index, float(label_smoothing), reduction, matmul_dtype,
                                        needs_grad and reduction != "none", bool(check_targets))
    return loss
