"""Label-smoothed cross-entropy over [N, V] logits, and the output projection fused into it (linear + CE).

loss_i = (1 - e) * (-log p_i[target_i]) + e * mean_c(-log p_i[c]), p = softmax(logits_i), PyTorch's definition.
One kernel does all the work, one program per row, in fp32 whatever the logits' dtype: a first sweep over the row
keeps a running max, the sum of exp(x - max) and the sum of x (online softmax), which give the log-sum-exp and the
loss; a second sweep writes the gradient (softmax - (1 - e) * onehot(target) - e / V) times d(total)/d(row loss),
which may be the logits' own buffer. Rows whose target is ignore_index are not read and get zero loss and gradient.

`cross_entropy` runs the first sweep in forward (saving only the log-sum-exps) and the second in backward, where
d(total)/d(row loss) is known, so that nothing V-wide is computed for a loss that is never differentiated.
`linear_cross_entropy` never holds all N x V logits: it walks chunks of tokens, and for each one a cuBLAS matmul
makes the chunk's logits, the kernel turns them into their gradient in place, and two more matmuls give that
chunk's share of the hidden and weight gradients (Liger-Kernel's fused linear cross-entropy). Those gradients are
scaled by the incoming gradient in backward; with reduction "none" that is one scale per token, so forward only
computes the losses and backward recomputes the chunks.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from triton_kernels._host import next_power_of_2

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
REDUCTIONS = ("mean", "sum", "none")
# Bytes of logits a program sweeps per step (4096 fp32 or 8192 fp16/bf16 elements): wide enough that a 37k vocab
# takes a handful of steps, narrow enough to stay in registers.
MAX_BLOCK_BYTES = 16384
# Fused linear + CE: a chunk's logits take at most 1/LOGITS_FRACTION of what all N x V logits would and at most
# CHUNK_LOGITS_BYTES, so that memory stays far below the unfused logits; chunks are large enough that adding each
# chunk's weight gradient into the fp32 sum (a V x d pass) stays small next to its three matmuls.
LOGITS_FRACTION = 8
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
    logits_row_stride,
    grad_row_stride,
    grad_scale_stride,
    n_cols,  # V
    ignore_index,
    label_smoothing,
    COMPUTE_LOSS: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
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
        loss = (1.0 - label_smoothing) * (lse - target_logit) + label_smoothing * (lse - logit_sum / n_cols)
        tl.store(loss_ptr + row, loss)
        tl.store(lse_ptr + row, lse)
    else:
        lse = tl.load(lse_ptr + row)

    if WRITE_GRAD:
        scale = tl.load(grad_scale_ptr + row * grad_scale_stride).to(tl.float32)
        grad_row_ptr = grad_ptr + row * grad_row_stride
        for start in range(0, n_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(logits_row_ptr + cols, mask=cols < n_read, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse) - label_smoothing / n_cols - tl.where(cols == target, 1.0 - label_smoothing, 0.0)
            grad = tl.where(kept, grad * scale, 0.0)
            tl.store(grad_row_ptr + cols, grad.to(grad_ptr.dtype.element_ty), mask=cols < n_cols)


def _block_config(n_cols: int, element_size: int) -> tuple[int, int]:
    """V, bytes per logit -> (BLOCK_V, num_warps)."""
    block_v = min(next_power_of_2(n_cols), max(1, MAX_BLOCK_BYTES // element_size))
    # About 8 logits per thread (one or two 16-byte loads): ~32 registers on sm_90, so that two programs share a
    # multiprocessor and keep enough loads in flight.
    return block_v, min(32, max(4, block_v // 256))


def _cross_entropy_rows(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, ignore_index: int,
                        label_smoothing: float, row_loss: Optional[torch.Tensor] = None,
                        grad: Optional[torch.Tensor] = None, grad_scale: Optional[torch.Tensor] = None) -> None:
    """logits: [N, V] (unit column stride), target, lse: [N] -> with row_loss ([N] fp32), each row's loss into it and
    its log-sum-exp into lse, else lse is read; with grad ([N, V], may be logits), the gradient times grad_scale
    ([] or [N]) into it."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    compute_loss, write_grad = row_loss is not None, grad is not None
    block_v, num_warps = _block_config(n_cols, logits.element_size())
    _cross_entropy_kernel[(n_rows,)](
        logits, grad if write_grad else logits, target, row_loss if compute_loss else lse, lse,
        grad_scale if write_grad else lse,
        logits.stride(0), grad.stride(0) if write_grad else 0,
        grad_scale.stride(0) if write_grad and grad_scale.dim() == 1 else 0,
        n_cols, ignore_index, label_smoothing,
        COMPUTE_LOSS=compute_loss, WRITE_GRAD=write_grad, BLOCK_V=block_v, num_warps=num_warps,
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
    """row_loss: [N] fp32 -> [] ([N] for "none") in dtype."""
    if reduction == "none":
        return row_loss.to(dtype)
    total = row_loss.sum()
    return (total / _kept_count(target, ignore_index) if reduction == "mean" else total).to(dtype)


def _row_grad_scale(grad_loss: torch.Tensor, target: torch.Tensor, ignore_index: int,
                    reduction: str) -> torch.Tensor:
    """d(total)/d(loss): [] or [N] -> d(total)/d(each row's loss): [] ("mean", "sum") or [N] ("none"), fp32."""
    scale = grad_loss.float()
    return scale / _kept_count(target, ignore_index) if reduction == "mean" else scale


# ---- cross_entropy: the loss in forward, the gradient in backward ------------------------------------------------

@torch.library.custom_op("fastformer::cross_entropy", mutates_args=())
def _cross_entropy_op(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float,
                      reduction: str, overwrite_logits: bool,
                      check_targets: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [N, V], target: [N] -> (loss: [] or [N] in logits' dtype, lse: [N] fp32). overwrite_logits only tells
    backward where to write the gradient."""
    if check_targets:
        _check_class_ids(target, logits.shape[1], ignore_index)
    row_loss = logits.new_empty(logits.shape[:1], dtype=torch.float32)
    lse = torch.empty_like(row_loss)
    _cross_entropy_rows(logits, target, lse, ignore_index, label_smoothing, row_loss=row_loss)
    return _reduce(row_loss, target, ignore_index, reduction, logits.dtype), lse


@_cross_entropy_op.register_fake
def _(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float, reduction: str,
      overwrite_logits: bool, check_targets: bool) -> tuple[torch.Tensor, torch.Tensor]:
    loss = logits.new_empty(logits.shape[:1] if reduction == "none" else ())
    return loss, logits.new_empty(logits.shape[:1], dtype=torch.float32)


@torch.library.custom_op("fastformer::cross_entropy_backward", mutates_args=())
def _cross_entropy_backward_op(grad_loss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor,
                               lse: torch.Tensor, ignore_index: int, label_smoothing: float,
                               reduction: str) -> torch.Tensor:
    """grad_loss: [] or [N], logits: [N, V] -> grad_logits: [N, V] in logits' dtype."""
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    _cross_entropy_rows(logits, target, lse, ignore_index, label_smoothing, grad=grad,
                        grad_scale=_row_grad_scale(grad_loss, target, ignore_index, reduction))
    return grad


@_cross_entropy_backward_op.register_fake
def _(grad_loss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, ignore_index: int,
      label_smoothing: float, reduction: str) -> torch.Tensor:
    return logits.new_empty(logits.shape)


@torch.library.custom_op("fastformer::cross_entropy_backward_over_logits", mutates_args=("logits",))
def _cross_entropy_backward_over_logits_op(grad_loss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor,
                                           lse: torch.Tensor, ignore_index: int, label_smoothing: float,
                                           reduction: str) -> None:
    """grad_loss: [] or [N], logits: [N, V] -> logits overwritten with their gradient."""
    _cross_entropy_rows(logits, target, lse, ignore_index, label_smoothing, grad=logits,
                        grad_scale=_row_grad_scale(grad_loss, target, ignore_index, reduction))


@_cross_entropy_backward_over_logits_op.register_fake
def _(grad_loss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, ignore_index: int,
      label_smoothing: float, reduction: str) -> None:
    return None


def _cross_entropy_setup_context(ctx, inputs: tuple, output: tuple) -> None:
    logits, target, ignore_index, label_smoothing, reduction, overwrite_logits, _ = inputs
    _, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(logits, target, lse)
    ctx.ignore_index, ctx.label_smoothing, ctx.reduction = ignore_index, label_smoothing, reduction
    ctx.overwrite_logits = overwrite_logits


def _cross_entropy_backward(ctx, grad_loss: torch.Tensor, _grad_lse: Optional[torch.Tensor]) -> tuple:
    logits, target, lse = ctx.saved_tensors
    args = (grad_loss, logits, target, lse, ctx.ignore_index, ctx.label_smoothing, ctx.reduction)
    if ctx.overwrite_logits:
        _cross_entropy_backward_over_logits_op(*args)
        grad_logits = logits
    else:
        grad_logits = _cross_entropy_backward_op(*args)
    return grad_logits, None, None, None, None, None, None


_cross_entropy_op.register_autograd(_cross_entropy_backward, setup_context=_cross_entropy_setup_context)


# ---- linear_cross_entropy: chunks of tokens, gradients in forward ------------------------------------------------

def _chunk_rows(n_rows: int, vocab: int, element_size: int) -> int:
    """How many tokens' logits one chunk of the fused linear + CE holds."""
    rows = min(n_rows // LOGITS_FRACTION, CHUNK_LOGITS_BYTES // (vocab * element_size))
    if rows >= GEMM_ROW_TILE:
        rows -= rows % GEMM_ROW_TILE
    return max(1, rows)


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32: on CUDA, cuBLAS writes an fp16/bf16 product straight out in fp32 (torch >= 2.8), so that a
    gradient later scaled and cast back to fp16/bf16 is rounded once; the CPU matmul has no such variant."""
    if a.is_cuda and a.dtype in (torch.float16, torch.bfloat16):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a, b).float()


def _add_chunk_gradients(grad_logits: torch.Tensor, hidden_chunk: torch.Tensor, weight_mm: torch.Tensor,
                         grad_hidden_chunk: torch.Tensor, grad_weight: torch.Tensor,
                         grad_bias: Optional[torch.Tensor]) -> None:
    """grad_logits: [rows, V], hidden_chunk: [rows, d] -> grad_hidden_chunk ([rows, d] fp32) set, and the chunk's
    share added to grad_weight ([V, d] fp32) and grad_bias ([V] fp32)."""
    grad_hidden_chunk.copy_(_mm_fp32(grad_logits, weight_mm))
    if grad_logits.dtype == torch.float32:
        grad_weight.addmm_(grad_logits.T, hidden_chunk)
    else:
        # torch's matmuls cannot add an fp16/bf16 product into an fp32 sum. The chunk's product is rounded once
        # (as F.linear's backward rounds its one product) and added in fp32: an fp32 product would double the
        # memory and traffic of this V x d pass, which each chunk pays.
        grad_weight += torch.mm(grad_logits.T, hidden_chunk)
    if grad_bias is not None:
        grad_bias += grad_logits.sum(0, dtype=torch.float32)


def _linear_cross_entropy_chunks(
        hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
        ignore_index: int, label_smoothing: float, matmul_dtype: torch.dtype, lse: torch.Tensor,
        row_loss: Optional[torch.Tensor] = None, grad_scale: Optional[torch.Tensor] = None,
) -> Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
    """hidden: [N, d], weight: [V, d], bias: [V] -> with row_loss ([N] fp32), each token's loss into it and its
    log-sum-exp into lse ([N] fp32), else lse is read; with grad_scale ([] or [N]: d(total)/d(row loss)), returns
    the gradients of hidden, weight and bias (None without a bias) in fp32."""
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
            hidden_chunk = hidden_mm[chunk]
            logits = (torch.mm(hidden_chunk, weight_mm.T) if bias_mm is None
                      else torch.addmm(bias_mm, hidden_chunk, weight_mm.T))
            chunk_scale = None
            if with_grads:
                chunk_scale = grad_scale[chunk] if grad_scale.dim() == 1 else grad_scale
            # With gradients, the kernel turns the chunk's logits into their gradient in place.
            _cross_entropy_rows(logits, target[chunk], lse[chunk], ignore_index, label_smoothing,
                                row_loss=None if row_loss is None else row_loss[chunk],
                                grad=logits if with_grads else None, grad_scale=chunk_scale)
            if with_grads:
                _add_chunk_gradients(logits, hidden_chunk, weight_mm, grad_hidden[chunk], grad_weight, grad_bias)
    return (grad_hidden, grad_weight, grad_bias) if with_grads else None


@torch.library.custom_op("fastformer::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(
        hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor],
        ignore_index: int, label_smoothing: float, reduction: str, matmul_dtype: torch.dtype, compute_grads: bool,
        check_targets: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden: [N, d], weight: [V, d], target: [N], bias: [V] -> (loss: [] or [N] in matmul_dtype, lse: [N] fp32,
    and with compute_grads (reduction "mean" or "sum" only) the gradients of the loss w.r.t. hidden [N, d], weight
    [V, d], bias [V] in fp32, so that backward's scaling rounds them only once; without, and for a missing bias,
    empty [0] tensors)."""
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
    loss = hidden.new_empty(hidden.shape[:1] if reduction == "none" else (), dtype=matmul_dtype)
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
    if ctx.reduction == "none":
        hidden, weight, target, bias, lse = ctx.saved_tensors
        grad_hidden, grad_weight, grad_bias = _linear_cross_entropy_backward_op(
            grad_loss, hidden, weight, target, bias, lse, ctx.ignore_index, ctx.label_smoothing, ctx.reduction,
            ctx.matmul_dtype)
    else:
        # Forward's fp32 gradients for d(loss) = 1. Scaled out of place: torch.compile's partitioner rejects an
        # in-place update of a saved output, and backward is not where this op's memory peaks.
        grad_hidden, grad_weight, grad_bias = ((grad * grad_loss).to(dtype or grad.dtype)
                                               for grad, dtype in zip(ctx.saved_tensors, ctx.dtypes))
    # Without a bias, grad_bias is an empty placeholder.
    return grad_hidden, grad_weight, None, grad_bias if ctx.dtypes[2] else None, *(None,) * 6


_linear_cross_entropy_op.register_autograd(_linear_cross_entropy_backward,
                                          setup_context=_linear_cross_entropy_setup_context)


# ---- public interface --------------------------------------------------------------------------------------------

def unsupported_reason(tensor: torch.Tensor) -> Optional[str]:
    """Why the kernels cannot take these (well-formed) logits or hidden states, or None if they can."""
    if tensor.dtype not in SUPPORTED_DTYPES:
        return f"dtype {tensor.dtype}; the kernels take float32, float16 and bfloat16"
    return None


def _validate_options(ignore_index: int, label_smoothing: float, reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")


def _validate_tensors(op: str, named: dict[str, Optional[torch.Tensor]]) -> None:
    """Types, supported dtypes and one device for the floating-point tensors of `op`."""
    for name, tensor in named.items():
        if tensor is not None and not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        reason = None if tensor is None else unsupported_reason(tensor)
        if reason is not None:
            raise ValueError(f"{op}: {name} has {reason}")
    first_name, first = next(iter(named.items()))
    for name, tensor in named.items():
        if tensor is not None and tensor.device != first.device:
            raise ValueError(f"{name} is on {tensor.device} but {first_name} is on {first.device}")


def _validate_target(target: torch.Tensor, n_rows: int, rows_name: str, device: torch.device) -> None:
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must hold int64 or int32 class ids, got {target.dtype}")
    if tuple(target.shape) != (n_rows,):
        raise ValueError(f"target must have shape ({n_rows},) to match {rows_name}, got {tuple(target.shape)}")
    if target.device != device:
        raise ValueError(f"target is on {target.device} but {rows_name} is on {device}")


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  label_smoothing: float = 0.0, reduction: str = "mean", overwrite_logits: bool = False,
                  check_targets: bool = True) -> torch.Tensor:
    """logits: [N, V], target: [N] -> loss: [] ([N] for reduction "none") in logits' dtype; differentiable w.r.t.
    logits.

    PyTorch's label-smoothed cross-entropy, with one deliberate difference: "mean" over targets that are all
    ignore_index is 0 with a zero gradient (PyTorch gives NaN). overwrite_logits=True lets backward write the
    gradient over the logits' buffer (when their columns are contiguous) instead of a new one: the logits are then
    lost, so nothing else may need them afterwards. check_targets=False skips the check of the class ids (a host
    sync) for targets already checked; an id outside [0, V) then reads outside the logits.
    """
    _validate_tensors("cross_entropy", {"logits": logits})
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [N, V] with V >= 1, got shape {tuple(logits.shape)}")
    _validate_target(target, logits.shape[0], "logits", logits.device)
    _validate_options(ignore_index, label_smoothing, reduction)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    loss, _ = _cross_entropy_op(logits, target.contiguous(), ignore_index, float(label_smoothing), reduction,
                                bool(overwrite_logits), bool(check_targets))
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
    [] ([N] for "none") in the logits' dtype; differentiable w.r.t. hidden, weight and bias.

    The N x V logits are never held whole (chunks of tokens, each at most 1/LOGITS_FRACTION of them). Under
    torch.autocast the matmuls run in autocast's dtype, as F.linear's would; the weight gradient is summed in fp32.
    check_targets: as for cross_entropy.
    """
    _validate_tensors("linear_cross_entropy", {"hidden": hidden, "weight": weight, "bias": bias})
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [N, d], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1] or weight.shape[0] == 0:
        raise ValueError(f"weight must be [V, {hidden.shape[1]}] with V >= 1 to match hidden [N, "
                         f"{hidden.shape[1]}], got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != weight.shape[:1]:
        raise ValueError(f"bias must have shape ({weight.shape[0]},) to match weight, got {tuple(bias.shape)}")
    _validate_target(target, hidden.shape[0], "hidden", hidden.device)
    _validate_options(ignore_index, label_smoothing, reduction)
    matmul_dtype = _matmul_dtype(hidden, weight, bias)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    loss, *_ = _linear_cross_entropy_op(hidden.contiguous(), weight.contiguous(), target.contiguous(), bias,
                                        ignore_index, float(label_smoothing), reduction, matmul_dtype,
                                        needs_grad and reduction != "none", bool(check_targets))
    return loss
