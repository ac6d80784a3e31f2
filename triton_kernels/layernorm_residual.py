"""Fused residual add (+ dropout) + LayerNorm: s = residual + dropout(x), y = LayerNorm(s) * weight + bias.

Forward: each program normalizes a tile of BLOCK_ROWS rows of D elements in one pass, with fp32 statistics, and
writes y, s (pre-LN's running sum, and what backward reads) and each row's mean and rstd.
Backward: each program walks a contiguous run of rows tile by tile, computing ds = dLayerNorm(dy) + ds_out,
dresidual = ds and dx = ds * keep / (1 - p), while summing its rows' share of dweight and dbias in registers; a
second stage adds up the [num_programs, 2, D] partial sums. There are as many programs as the GPU holds at once
(from the compiled kernel's registers and the multiprocessor count): one wave, with every resident program's loads
in flight, and no more partial sums than that.
The dropout mask is never stored: both passes regenerate it with Philox from (seed, row, column), so it does not
depend on how rows are tiled. One Philox call (ten rounds of two 32-bit multiplies) yields four 32-bit numbers,
which decide four adjacent columns: a quarter of the integer work of a call per element, which at 2-byte elements
is comparable to the time their memory traffic takes.

Bytes each launch moves, for n rows of D (e: element size of each tensor; P: backward programs):
- forward: reads x, residual (n*D*e each), weight, bias (D*e); writes y, s (n*D*e each), mean, rstd (4*n each).
- backward: reads dy, s, ds_out if s's gradient arrives (n*D*e each), mean, rstd (4*n each), weight (D*e); writes
  dx, dresidual (n*D*e each) and the fp32 partials (8*P*D).
- partial sums: read the partials (8*P*D), write dweight, dbias (D*e each).
"""

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from triton_kernels._host import cdiv, dropout_scale, next_power_of_2, seed_tensor
from triton_kernels.inputs import check_residual_layer_norm

MAX_D = 8192
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Elements per program tile: one row when D is wide, several rows when D is narrow, so short rows do not leave most
# of a program's lanes idle. 2048 measured fastest on an H100 (backward; forward is indifferent).
TILE_ELEMENTS = 2048
# Triton's interpreter runs programs one after another, so it gets few backward programs: more would only add rows
# of partial sums. (On a GPU, as many as are resident at once: see _resident_backward_programs.)
INTERPRETER_BACKWARD_PROGRAMS = 4
# The second stage: each program sums a strip of SUM_BLOCK_COLS of the [num_programs, 2 * D] partials, narrow so
# that there are many strips (64 at D = 512), loading SUM_BLOCK_PARTIALS rows of it at once (32 KiB), so that the
# few programs still keep enough bytes in flight to read at bandwidth.
SUM_BLOCK_COLS = 16
SUM_BLOCK_PARTIALS = 512
SUM_NUM_WARPS = 8


@triton.jit
def _dropout_keep(seed, rows, n_cols, dropout_p, BLOCK_D: tl.constexpr):
    """rows: [BLOCK_ROWS] int64 -> bool keep-mask [BLOCK_ROWS, BLOCK_D] of columns 0..BLOCK_D-1, kept with prob. 1 - p.

    Column c of row r takes output c % 4 of Philox call r * ceil(D / 4) + c // 4. The kernels read the seed from the
    device, so that a captured CUDA graph draws a new one per replay."""
    groups = tl.arange(0, BLOCK_D // 4)
    counters = rows[:, None] * tl.cdiv(n_cols, 4) + groups[None, :]
    uniform0, uniform1, uniform2, uniform3 = tl.rand4x(seed, counters)
    # join stacks along a new last axis, so this order puts output j at column 4 * group + j.
    uniform = tl.join(tl.join(uniform0, uniform2), tl.join(uniform1, uniform3))
    return tl.reshape(uniform, (rows.shape[0], BLOCK_D)) >= dropout_p


@triton.jit
def _residual_layer_norm_fwd_kernel(
    x_ptr,  # [n_rows, D]
    residual_ptr,  # [n_rows, D]; not read without HAS_RESIDUAL
    weight_ptr,  # [D]
    bias_ptr,  # [D]
    y_ptr,  # [n_rows, D]
    s_ptr,  # [n_rows, D]
    mean_ptr,  # [n_rows], fp32
    rstd_ptr,  # [n_rows], fp32
    n_rows,
    n_cols,  # D
    eps,
    dropout_p,
    dropout_scale,  # 1 / (1 - dropout_p)
    seed_ptr,  # [1] int64 Philox seed; not read without HAS_DROPOUT
    HAS_RESIDUAL: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """x, residual: [n_rows, D] -> y, s: [n_rows, D], mean, rstd: [n_rows]; one [BLOCK_ROWS, BLOCK_D] tile each."""
    # int64 so that offsets past 2**31 elements (large batches at D = 8192) do not wrap.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    offsets = rows[:, None] * n_cols + cols[None, :]

    s = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        keep = _dropout_keep(tl.load(seed_ptr), rows, n_cols, dropout_p, BLOCK_D)
        s = tl.where(keep, s * dropout_scale, 0.0)
    if HAS_RESIDUAL:
        s += tl.load(residual_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    # Normalize s as stored, so that y is exactly the LayerNorm of the returned s and backward, which reloads s,
    # differentiates the same numbers the forward normalized.
    s = s.to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + offsets, s, mask=mask)
    s = s.to(tl.float32)

    mean = tl.sum(s, axis=1) / n_cols
    centered = tl.where(mask, s - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) / n_cols + eps)
    weight = tl.load(weight_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    y = centered * rstd[:, None] * weight[None, :] + bias[None, :]
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + rows, mean, mask=row_mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_mask)


# Not specialized on the row counts, so that the compile _resident_backward_programs inspects is the one launched.
@triton.jit(do_not_specialize=["n_rows", "rows_per_program"])
def _residual_layer_norm_bwd_kernel(
    dy_ptr,  # [n_rows, D]; not read without HAS_DY
    ds_out_ptr,  # [n_rows, D]: gradient reaching s from its own use (pre-LN); not read without HAS_DS_OUT
    s_ptr,  # [n_rows, D]
    weight_ptr,  # [D]
    mean_ptr,  # [n_rows], fp32
    rstd_ptr,  # [n_rows], fp32
    dx_ptr,  # [n_rows, D]
    dresidual_ptr,  # [n_rows, D]; not written without HAS_RESIDUAL
    partials_ptr,  # [num_programs, 2, D] fp32: each program's sums for dweight, then dbias; not written without HAS_DY
    n_rows,
    n_cols,  # D
    rows_per_program,  # a multiple of BLOCK_ROWS
    dropout_p,
    dropout_scale,  # 1 / (1 - dropout_p)
    seed_ptr,  # [1] int64 Philox seed; not read without HAS_DROPOUT
    HAS_DY: tl.constexpr,
    HAS_DS_OUT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dy, ds_out, s: [n_rows, D] -> dx, dresidual: [n_rows, D], this program's [2, D] of the partials."""
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_mask = cols < n_cols
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dweight = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dbias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    first_row = program * rows_per_program
    end_row = tl.minimum(first_row + rows_per_program, n_rows)
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(seed_ptr)  # once per program, not per tile
    for tile_start in range(first_row, end_row, BLOCK_ROWS):
        # int64 so that offsets past 2**31 elements do not wrap.
        rows = (tile_start + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        row_mask = rows < end_row
        mask = row_mask[:, None] & col_mask[None, :]
        offsets = rows[:, None] * n_cols + cols[None, :]

        ds = tl.zeros((BLOCK_ROWS, BLOCK_D), dtype=tl.float32)
        if HAS_DY:
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
            rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
            s = tl.load(s_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            normalized = tl.where(mask, (s - mean[:, None]) * rstd[:, None], 0.0)
            dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            dnormalized = dy * weight[None, :]
            # LayerNorm's input gradient: rstd * (dn - mean(dn) - n * mean(dn * n)), n the normalized row.
            mean_dnormalized = tl.sum(dnormalized, axis=1) / n_cols
            mean_dnormalized_normalized = tl.sum(dnormalized * normalized, axis=1) / n_cols
            ds = dnormalized - mean_dnormalized[:, None] - normalized * mean_dnormalized_normalized[:, None]
            ds = ds * rstd[:, None]
            dweight += tl.sum(dy * normalized, axis=0)
            dbias += tl.sum(dy, axis=0)
        if HAS_DS_OUT:
            ds += tl.load(ds_out_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            tl.store(dresidual_ptr + offsets, ds.to(dresidual_ptr.dtype.element_ty), mask=mask)
        if HAS_DROPOUT:
            ds = tl.where(_dropout_keep(seed, rows, n_cols, dropout_p, BLOCK_D), ds * dropout_scale, 0.0)
        tl.store(dx_ptr + offsets, ds.to(dx_ptr.dtype.element_ty), mask=mask)

    if HAS_DY:
        partial_ptr = partials_ptr + program.to(tl.int64) * 2 * n_cols + cols
        tl.store(partial_ptr, dweight, mask=col_mask)
        tl.store(partial_ptr + n_cols, dbias, mask=col_mask)


@triton.jit
def _sum_partials_kernel(
    partials_ptr,  # [num_partials, 2, D], fp32
    dweight_ptr,  # [D]
    dbias_ptr,  # [D]
    num_partials,
    n_cols,  # D
    BLOCK_PARTIALS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """partials: [num_partials, 2 * D] -> dweight (its first D columns), dbias (the rest): [D]; one strip of
    BLOCK_COLS of the 2 * D columns each."""
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < 2 * n_cols
    total = tl.zeros((BLOCK_COLS,), dtype=tl.float32)
    for start in range(0, num_partials, BLOCK_PARTIALS):
        partials = (start + tl.arange(0, BLOCK_PARTIALS)).to(tl.int64)
        mask = (partials < num_partials)[:, None] & col_mask[None, :]
        total += tl.sum(tl.load(partials_ptr + partials[:, None] * 2 * n_cols + cols[None, :], mask=mask, other=0.0),
                        axis=0)
    is_dweight = cols < n_cols
    tl.store(dweight_ptr + cols, total.to(dweight_ptr.dtype.element_ty), mask=is_dweight)
    tl.store(dbias_ptr + cols - n_cols, total.to(dbias_ptr.dtype.element_ty), mask=col_mask & ~is_dweight)


def _tile_config(n_cols: int) -> tuple[int, int, int]:
    """D -> (BLOCK_D, BLOCK_ROWS, num_warps) of a program's [BLOCK_ROWS, BLOCK_D] tile."""
    # At least 4 columns: the dropout mask comes in groups of four.
    block_d = max(4, next_power_of_2(n_cols))
    block_rows = max(1, TILE_ELEMENTS // block_d)
    num_warps = min(16, max(4, block_d * block_rows // 512))
    return block_d, block_rows, num_warps


def _resident_programs_per_sm(regs_per_thread: int, shared_bytes: int, num_warps: int, regs_per_sm: int,
                              threads_per_sm: int, shared_per_sm: int) -> int:
    """How many programs of a kernel fit on one multiprocessor at once (at least 1): registers, allocated per thread
    in steps of 8, threads and shared memory each set a limit."""
    threads = 32 * num_warps
    limits = [regs_per_sm // (-(-regs_per_thread // 8) * 8 * threads), threads_per_sm // threads]
    if shared_bytes > 0:
        limits.append(shared_per_sm // shared_bytes)
    return max(1, min(limits))


@functools.lru_cache(maxsize=None)
def _resident_backward_programs(device: torch.device, pointer_dtypes: tuple[torch.dtype, ...], n_cols: int,
                                **constexprs) -> int:
    """How many backward programs with these pointer dtypes (in the kernel's argument order) and constexprs are
    resident at once on all of the GPU's multiprocessors: Triton compiles the kernel (without launching it) to
    report its registers and shared memory."""
    *tensor_dtypes, seed_dtype = pointer_dtypes
    # The kernel is not specialized on n_rows and rows_per_program, so any values give the launched compile.
    compiled = _residual_layer_norm_bwd_kernel.warmup(*tensor_dtypes, 1, n_cols, 1, 0.1, 1.0, seed_dtype,
                                                      grid=(1,), **constexprs)
    compiled._init_handles()
    properties = torch.cuda.get_device_properties(device)
    shared_per_sm = triton.runtime.driver.active.utils.get_device_properties(device.index)["max_shared_mem"]
    per_sm = _resident_programs_per_sm(compiled.n_regs, compiled.metadata.shared, constexprs["num_warps"],
                                       properties.regs_per_multiprocessor,
                                       properties.max_threads_per_multi_processor, shared_per_sm)
    return properties.multi_processor_count * per_sm


def _backward_program_cap(device: torch.device, pointer_dtypes: tuple[torch.dtype, ...], n_cols: int,
                          **constexprs) -> int:
    """How many programs backward launches at most: on a GPU, as many as it holds at once, so that they all run in
    one wave (each then walks its rows with every other program's loads in flight alongside, and none waits for a
    slot at the end); more would add partial sums (8 * D bytes each, written then read) and no residency."""
    if device.type != "cuda":
        return INTERPRETER_BACKWARD_PROGRAMS
    return _resident_backward_programs(device, pointer_dtypes, n_cols, **constexprs)


def _backward_grid(n_rows: int, block_rows: int, program_cap: int) -> tuple[int, int]:
    """-> (rows_per_program, a multiple of block_rows; num_programs): whole tiles split evenly over at most
    program_cap programs, each taking a contiguous run (the last one may have fewer rows)."""
    tiles_per_program = max(1, cdiv(cdiv(n_rows, block_rows), program_cap))
    rows_per_program = tiles_per_program * block_rows
    return rows_per_program, cdiv(n_rows, rows_per_program)


def _output_dtype(x_dtype: torch.dtype, residual_dtype: Optional[torch.dtype]) -> torch.dtype:
    """The dtype of y and s: that of residual + x in PyTorch (ResidualLayerNorm casts both to autocast's dtype)."""
    return x_dtype if residual_dtype is None else torch.promote_types(x_dtype, residual_dtype)


def _forward(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, bias: torch.Tensor, eps: float,
             dropout_p: float,
             seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual: [..., D] -> (y, s: [..., D], mean, rstd: [...] fp32)."""
    n_cols = x.shape[-1]
    x_rows = x.reshape(-1, n_cols).contiguous()
    n_rows = x_rows.shape[0]
    dtype = _output_dtype(x.dtype, None if residual is None else residual.dtype)
    y = torch.empty(x_rows.shape, dtype=dtype, device=x.device)
    s = torch.empty_like(y)
    mean = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    if n_rows > 0:
        block_d, block_rows, num_warps = _tile_config(n_cols)
        residual_rows = x_rows if residual is None else residual.reshape(-1, n_cols).contiguous()
        _residual_layer_norm_fwd_kernel[(cdiv(n_rows, block_rows),)](
            x_rows, residual_rows, weight.contiguous(), bias.contiguous(), y, s, mean, rstd,
            n_rows, n_cols, eps, dropout_p, dropout_scale(dropout_p), x_rows if seed is None else seed,
            HAS_RESIDUAL=residual is not None, HAS_DROPOUT=seed is not None,
            BLOCK_ROWS=block_rows, BLOCK_D=block_d, num_warps=num_warps,
        )
    return y.view(x.shape), s.view(x.shape), mean, rstd


def _backward(dy: Optional[torch.Tensor], ds_out: Optional[torch.Tensor], s: torch.Tensor, weight: torch.Tensor,
              mean: torch.Tensor, rstd: torch.Tensor, dropout_p: float, seed: Optional[torch.Tensor],
              x_dtype: torch.dtype,
              residual_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dy, ds_out, s: [..., D] -> (dx, dresidual: [..., D] ([0] without a residual), dweight, dbias: [D])."""
    n_cols = s.shape[-1]
    s_rows = s.reshape(-1, n_cols)
    n_rows = s_rows.shape[0]
    dx = torch.empty(s.shape, dtype=x_dtype, device=s.device)
    has_residual = residual_dtype is not None
    dresidual = torch.empty(s.shape if has_residual else (0,), dtype=residual_dtype or x_dtype, device=s.device)
    block_d, block_rows, num_warps = _tile_config(n_cols)
    dy_rows = s_rows if dy is None else dy.reshape(-1, n_cols).contiguous()
    ds_out_rows = s_rows if ds_out is None else ds_out.reshape(-1, n_cols).contiguous()
    weight = weight.contiguous()
    dresidual_or_dx = dresidual if has_residual else dx
    seed_or_s = s_rows if seed is None else seed
    constexprs = dict(HAS_DY=dy is not None, HAS_DS_OUT=ds_out is not None, HAS_RESIDUAL=has_residual,
                      HAS_DROPOUT=seed is not None, BLOCK_ROWS=block_rows, BLOCK_D=block_d, num_warps=num_warps)
    pointer_dtypes = tuple(t.dtype for t in (dy_rows, ds_out_rows, s_rows, weight, mean, rstd, dx, dresidual_or_dx))
    program_cap = _backward_program_cap(s.device, (*pointer_dtypes, torch.float32, seed_or_s.dtype), n_cols,
                                        **constexprs)
    rows_per_program, num_programs = _backward_grid(n_rows, block_rows, program_cap)
    # Every program writes its [2, D] of the partial sums, so they need no zeroing.
    partials = torch.empty((num_programs, 2, n_cols), dtype=torch.float32, device=s.device)
    if n_rows > 0:
        _residual_layer_norm_bwd_kernel[(num_programs,)](
            dy_rows, ds_out_rows, s_rows, weight, mean, rstd, dx, dresidual_or_dx, partials,
            n_rows, n_cols, rows_per_program, dropout_p, dropout_scale(dropout_p), seed_or_s, **constexprs,
        )
    if dy is None:
        return dx, dresidual, torch.zeros_like(weight), torch.zeros_like(weight)
    dweight, dbias = torch.empty_like(weight), torch.empty_like(weight)
    _sum_partials_kernel[(cdiv(2 * n_cols, SUM_BLOCK_COLS),)](
        partials, dweight, dbias, num_programs, n_cols, BLOCK_PARTIALS=SUM_BLOCK_PARTIALS, BLOCK_COLS=SUM_BLOCK_COLS,
        num_warps=SUM_NUM_WARPS,
    )
    return dx, dresidual, dweight, dbias


@torch.library.custom_op("fastformer::residual_layer_norm", mutates_args=())
def _residual_layer_norm_op(
        x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, bias: torch.Tensor, eps: float,
        dropout_p: float, seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, residual: [..., D], weight/bias: [D], seed: [1] int64 or None -> (y, s: [..., D], mean, rstd: [...] fp32)."""
    return _forward(x, residual, weight, bias, eps, dropout_p, seed)


@_residual_layer_norm_op.register_fake
def _(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, bias: torch.Tensor, eps: float,
      dropout_p: float, seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    y = x.new_empty(x.shape, dtype=_output_dtype(x.dtype, None if residual is None else residual.dtype))
    mean = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return y, torch.empty_like(y), mean, torch.empty_like(mean)


@torch.library.custom_op("fastformer::residual_layer_norm_backward", mutates_args=())
def _residual_layer_norm_backward_op(
        dy: Optional[torch.Tensor], ds_out: Optional[torch.Tensor], s: torch.Tensor, weight: torch.Tensor,
        mean: torch.Tensor, rstd: torch.Tensor, dropout_p: float, seed: Optional[torch.Tensor], x_dtype: torch.dtype,
        residual_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """dy, ds_out, s: [..., D] -> (dx, dresidual: [..., D] ([0] without a residual), dweight, dbias: [D])."""
    return _backward(dy, ds_out, s, weight, mean, rstd, dropout_p, seed, x_dtype, residual_dtype)


@_residual_layer_norm_backward_op.register_fake
def _(dy: Optional[torch.Tensor], ds_out: Optional[torch.Tensor], s: torch.Tensor, weight: torch.Tensor,
      mean: torch.Tensor, rstd: torch.Tensor, dropout_p: float, seed: Optional[torch.Tensor], x_dtype: torch.dtype,
      residual_dtype: Optional[torch.dtype]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dresidual_shape = s.shape if residual_dtype is not None else (0,)
    dresidual = s.new_empty(dresidual_shape, dtype=residual_dtype or x_dtype)
    return s.new_empty(s.shape, dtype=x_dtype), dresidual, torch.empty_like(weight), torch.empty_like(weight)


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:
    x, residual, weight, _, _, dropout_p, seed = inputs
    _, s, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    # A gradient that never arrives (y unused, or s unused as in post-LN) stays None rather than a tensor of zeros,
    # so the kernel skips reading it.
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(s, weight, mean, rstd, seed)
    ctx.dropout_p = dropout_p
    ctx.x_dtype, ctx.residual_dtype = x.dtype, None if residual is None else residual.dtype


def _backward_autograd(ctx, dy: Optional[torch.Tensor], ds_out: Optional[torch.Tensor], *_stats_grads) -> tuple:
    if dy is None and ds_out is None:
        return (None,) * 7
    s, weight, mean, rstd, seed = ctx.saved_tensors
    dx, dresidual, dweight, dbias = _residual_layer_norm_backward_op(
        dy, ds_out, s, weight, mean, rstd, ctx.dropout_p, seed, ctx.x_dtype, ctx.residual_dtype)
    return dx, None if ctx.residual_dtype is None else dresidual, dweight, dbias, None, None, None


_residual_layer_norm_op.register_autograd(_backward_autograd, setup_context=_setup_context)


def unsupported_reason(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
                       bias: torch.Tensor) -> Optional[str]:
    """Why the kernel cannot take these inputs, well-formed as inputs.check_residual_layer_norm requires, or None if
    it can."""
    for name, tensor in (("x", x), ("residual", residual), ("weight", weight), ("bias", bias)):
        if tensor is not None and tensor.dtype not in SUPPORTED_DTYPES:
            return f"{name} has dtype {tensor.dtype}; the kernel takes float32, float16 and bfloat16"
    if x.shape[-1] > MAX_D:
        return f"x's last dimension is {x.shape[-1]}; the kernel normalizes rows of at most {MAX_D}"
    return None


def residual_layer_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, bias: torch.Tensor,
                        eps: float = 1e-5, dropout_p: float = 0.0,
                        seed: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., D], weight/bias: [D] -> (y, s): [..., D] in the dtype of residual + x.

    s = residual + dropout(x) (dropout(x) alone without a residual), y = LayerNorm(s) * weight + bias; differentiable
    with respect to x, residual, weight and bias. The dropout mask is a function of `seed` (drawn on x's device from
    torch's generator when None) and the element's position.
    """
    check_residual_layer_norm(x, residual, weight, bias, eps, dropout_p)
    reason = unsupported_reason(x, residual, weight, bias)
    if reason is not None:
        raise ValueError(f"residual_layer_norm: {reason}")
    y, s, _, _ = _residual_layer_norm_op(x, residual, weight, bias, float(eps), float(dropout_p),
                                         seed_tensor(seed, dropout_p, x.device))
    return y, s
