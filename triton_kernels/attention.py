"""Fused scaled-dot-product attention, FlashAttention-2 style: softmax(q k^T / sqrt(head_dim) + masks) v.

Layout: q/k/v/out are [batch, len, heads, head_dim] read and written through their strides, so the views that a
fused QKV projection produces (`.view(batch, len, 3, heads, head_dim).unbind(2)`) need no transpose or copy.
Masks: key padding given as per-sequence lengths, causal (query i sees keys j <= i, top-left aligned like torch's
is_causal), both together, and q_len != k_len. Query rows past a sequence's length output zero.

Forward: each program owns BLOCK_M query rows of one (batch, head) and walks the key blocks with an online softmax
in fp32, saving each row's log-sum-exp (base 2) instead of the [q_len, k_len] probabilities. Key blocks past the
sequence's key length, or above the causal diagonal, are never visited (the loop stops there); only the blocks that
straddle a boundary pay for the mask. A query block past the sequence's query length visits no key at all.
Backward recomputes the probabilities from the saved log-sum-exp: a preprocess kernel computes
delta = rowsum(dout * out), one kernel per key block accumulates dk and dv over the query blocks, and one per query
block accumulates dq over the key blocks, so no program writes where another does (no atomics).
Short sequences (both lengths <= SHORT_PATH_MAX_LEN, and the keys' tile within SHORT_PATH_TILE_BYTES) take another
path, chosen in short_path_tiles from the padded lengths: one forward and one backward program per (batch, head)
holds all of its keys and values. The forward's softmax sees every key at once (exact, no online rescaling); the
backward recomputes each query block's probabilities once, computes delta on the spot, and writes that block's dq
and, at the end, dk and dv (no preprocess, no second recompute, no atomics). At WMT lengths the flash tiles were
mostly padding and the backward recomputed the probabilities twice. The short path has not yet run on a GPU
(docs/gpu.md), so compiled launches take it only with FASTFORMER_ATTENTION_SHORT_PATH=1 in the
environment (SHORT_PATH_ON_GPU); the interpreter always does, so that the CPU tests cover both paths.
Gradients are written through their strides, so the packed forms (flash_attention(qkv), flash_attention(q, kv))
get the gradient of the packed projection as one buffer.
Dropout of the probabilities uses Philox keyed by (seed, flat index in [batch, heads, q_len, k_len]), so the mask
does not depend on block sizes, is regenerated identically in backward, and `attention_dropout_mask` can rebuild it.
"""

import math
import os
from collections.abc import Callable
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from triton_kernels._host import cdiv, dropout_scale, next_power_of_2, seed_tensor
from triton_kernels.inputs import check_attention, check_length_values, split_packed

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (32, 64, 128)
LOG2_E = 1.4426950408889634
# Triton's interpreter runs programs one after another: one small fixed tile keeps it quick (autotuning there would
# run every config), and makes the CPU tests cross many block boundaries with short sequences.
INTERPRETER_BLOCK = 16
# Rows per program of the delta = rowsum(dout * out) preprocess on the GPU.
PREPROCESS_BLOCK_M = 64


@triton.jit
def _dropout_keep(seed, offsets, dropout_p):
    """offsets: int64 flat indices into [batch, heads, q_len, k_len] -> bool keep-mask, kept with prob. 1 - p."""
    return tl.rand(seed, offsets) >= dropout_p


@triton.jit
def _sequence_lengths(q_lengths_ptr, k_lengths_ptr, batch_index, q_len, k_len,
                      HAS_Q_LENGTHS: tl.constexpr, HAS_K_LENGTHS: tl.constexpr):
    """-> (queries, keys) of sequence batch_index that are not padding, as int32 scalars.

    Lengths are clamped to [0, len], so lengths whose values were not checked (check_lengths=False) can never make
    a program read or write outside the tensors."""
    seq_q = q_len + 0 * batch_index
    seq_k = k_len + 0 * batch_index
    if HAS_Q_LENGTHS:
        seq_q = tl.minimum(tl.maximum(tl.load(q_lengths_ptr + batch_index).to(tl.int32), 0), q_len)
    if HAS_K_LENGTHS:
        seq_k = tl.minimum(tl.maximum(tl.load(k_lengths_ptr + batch_index).to(tl.int32), 0), k_len)
    return seq_q, seq_k


@triton.jit
def _load_seed(seed_ptr, HAS_DROPOUT: tl.constexpr):
    """-> the Philox seed, read from the device so that a captured CUDA graph draws a new one per replay."""
    seed = 0
    if HAS_DROPOUT:
        seed = tl.load(seed_ptr)
    return seed


@triton.jit
def _row_pointers(ptr, batch_index, head, positions, offs_d, stride_b, stride_m, stride_h, stride_d):
    """-> [len(positions), len(offs_d)] pointers to those rows of (batch_index, head) in a [batch, len, heads, D]
    tensor with the given strides."""
    return (ptr + batch_index.to(tl.int64) * stride_b + head.to(tl.int64) * stride_h + positions[:, None] * stride_m
            + offs_d[None, :] * stride_d)


@triton.jit
def _key_block_bounds(query_start, seq_q, seq_k, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """Queries [query_start, query_start + BLOCK_M) -> (unmasked_end, key_end): key blocks in [0, unmasked_end)
    are fully visible to every row; those in [unmasked_end, key_end) need the mask; later ones are never visited."""
    key_end = tl.where(query_start < seq_q, seq_k, 0)
    unmasked_end = seq_k // BLOCK_N * BLOCK_N
    if CAUSAL:
        key_end = tl.minimum(key_end, tl.minimum(query_start + BLOCK_M, seq_q))
        # A key block [n, n + BLOCK_N) is visible to all rows when its last key n + BLOCK_N - 1 <= query_start.
        unmasked_end = tl.minimum(unmasked_end, (query_start + 1) // BLOCK_N * BLOCK_N)
    return tl.minimum(unmasked_end, key_end), key_end


@triton.jit
def _forward_key_blocks(acc, row_sum, row_max, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                        queries, offs_n, offs_d, seq_k, key_start, key_end, qk_scale, rng_rows, dropout_p, seed,
                        CAUSAL: tl.constexpr, MASKED: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                        DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax over the key blocks [key_start, key_end) -> updated (acc, row_sum, row_max)."""
    for start_n in range(key_start, key_end, BLOCK_N):
        keys = start_n + offs_n
        key_valid = keys < seq_k
        if MASKED:
            k_t = tl.load(k_base + keys[None, :] * stride_kn + offs_d[:, None] * stride_kd, mask=key_valid[None, :],
                          other=0.0)
        else:
            k_t = tl.load(k_base + keys[None, :] * stride_kn + offs_d[:, None] * stride_kd)
        scores = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if MASKED:
            visible = key_valid[None, :]
            if CAUSAL:
                visible = visible & (keys[None, :] <= queries[:, None])
            scores = tl.where(visible, scores, float("-inf"))
        # Every row's first block holds key 0, which it always sees, so row_max is finite from then on.
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        p = tl.math.exp2(scores - new_max[:, None])
        correction = tl.math.exp2(row_max - new_max)
        row_sum = row_sum * correction + tl.sum(p, 1)
        acc = acc * correction[:, None]
        if HAS_DROPOUT:
            # The normalizer sums the kept and the dropped probabilities alike: dropout acts after the softmax.
            p = tl.where(_dropout_keep(seed, rng_rows[:, None] + keys[None, :], dropout_p), p, 0.0)
        if MASKED:
            v = tl.load(v_base + keys[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=key_valid[:, None],
                        other=0.0)
        else:
            v = tl.load(v_base + keys[:, None] * stride_vn + offs_d[None, :] * stride_vd)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        row_max = new_max
    return acc, row_sum, row_max


@triton.jit(do_not_specialize=["heads", "q_len", "k_len"])
def _flash_attention_fwd_kernel(
    q_ptr,  # [batch, q_len, heads, HEAD_DIM], any strides
    k_ptr,  # [batch, k_len, heads, HEAD_DIM], any strides
    v_ptr,  # [batch, k_len, heads, HEAD_DIM], any strides
    q_lengths_ptr,  # [batch] ints; not read without HAS_Q_LENGTHS
    k_lengths_ptr,  # [batch] ints; not read without HAS_K_LENGTHS
    out_ptr,  # [batch, q_len, heads, HEAD_DIM], any strides
    lse_ptr,  # [batch, heads, q_len], fp32: log2 of each row's sum of 2^scores; +inf on padded rows
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ob, stride_om, stride_oh, stride_od,
    heads,
    q_len,
    k_len,
    qk_scale,  # log2(e) / sqrt(HEAD_DIM)
    dropout_p,
    dropout_scale,  # 1 / (1 - dropout_p)
    seed_ptr,  # [1] int64 Philox seed; not read without HAS_DROPOUT
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_Q_LENGTHS: tl.constexpr,
    HAS_K_LENGTHS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """q: [batch, q_len, heads, D], k/v: [batch, k_len, heads, D] -> out, lse; BLOCK_M rows of one (batch, head)."""
    batch_head = tl.program_id(0)
    query_start = tl.program_id(1) * BLOCK_M
    batch_index = batch_head // heads
    head = batch_head % heads
    seq_q, seq_k = _sequence_lengths(q_lengths_ptr, k_lengths_ptr, batch_index, q_len, k_len, HAS_Q_LENGTHS,
                                     HAS_K_LENGTHS)
    seed = _load_seed(seed_ptr, HAS_DROPOUT)
    queries = query_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_valid = queries < seq_q
    q_base = q_ptr + batch_index.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
    k_base = k_ptr + batch_index.to(tl.int64) * stride_kb + head.to(tl.int64) * stride_kh
    v_base = v_ptr + batch_index.to(tl.int64) * stride_vb + head.to(tl.int64) * stride_vh
    q = tl.load(q_base + queries[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=row_valid[:, None],
                other=0.0)
    rng_rows = (batch_head * q_len + queries).to(tl.int64) * k_len

    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    row_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    unmasked_end, key_end = _key_block_bounds(query_start, seq_q, seq_k, CAUSAL, BLOCK_M, BLOCK_N)
    acc, row_sum, row_max = _forward_key_blocks(
        acc, row_sum, row_max, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, queries, offs_n,
        offs_d, seq_k, 0, unmasked_end, qk_scale, rng_rows, dropout_p, seed,
        CAUSAL, False, HAS_DROPOUT, DOT_PRECISION, BLOCK_N)
    acc, row_sum, row_max = _forward_key_blocks(
        acc, row_sum, row_max, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, queries, offs_n,
        offs_d, seq_k, unmasked_end, key_end, qk_scale, rng_rows, dropout_p, seed,
        CAUSAL, True, HAS_DROPOUT, DOT_PRECISION, BLOCK_N)

    # Only a block past the query length visited no key (row_sum 0); its rows are zeroed below anyway.
    row_sum = tl.where(row_sum > 0.0, row_sum, 1.0)
    out_scale = 1.0 / row_sum
    if HAS_DROPOUT:
        out_scale = out_scale * dropout_scale
    out = tl.where(row_valid[:, None], acc * out_scale[:, None], 0.0)
    in_tensor = queries < q_len
    out_base = out_ptr + batch_index.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh
    tl.store(out_base + queries[:, None] * stride_om + offs_d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=in_tensor[:, None])
    lse = tl.where(row_valid, row_max + tl.math.log2(row_sum), float("inf"))
    tl.store(lse_ptr + batch_head.to(tl.int64) * q_len + queries, lse, mask=in_tensor)


@triton.jit(do_not_specialize=["heads", "q_len"])
def _flash_attention_bwd_preprocess_kernel(
    out_ptr,  # [batch, q_len, heads, HEAD_DIM], any strides
    dout_ptr,  # [batch, q_len, heads, HEAD_DIM], any strides
    delta_ptr,  # [batch, heads, q_len], fp32
    stride_ob, stride_om, stride_oh, stride_od,
    stride_dob, stride_dom, stride_doh, stride_dod,
    heads,
    q_len,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """out, dout: [batch, q_len, heads, D] -> delta = rowsum(dout * out): [batch, heads, q_len]."""
    batch_head = tl.program_id(0)
    queries = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    batch_index = (batch_head // heads).to(tl.int64)
    head = (batch_head % heads).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    in_tensor = queries < q_len
    out = tl.load(out_ptr + batch_index * stride_ob + head * stride_oh + queries[:, None] * stride_om
                  + offs_d[None, :] * stride_od, mask=in_tensor[:, None], other=0.0).to(tl.float32)
    dout = tl.load(dout_ptr + batch_index * stride_dob + head * stride_doh + queries[:, None] * stride_dom
                   + offs_d[None, :] * stride_dod, mask=in_tensor[:, None], other=0.0).to(tl.float32)
    # Padded rows have out == 0, so their delta is 0 whatever gradient reaches them.
    tl.store(delta_ptr + batch_head.to(tl.int64) * q_len + queries, tl.sum(out * dout, axis=1), mask=in_tensor)


@triton.jit
def _dkdv_query_blocks(dk, dv, k, v, q_base, dout_base, lse_base, delta_base, stride_qm, stride_qd, stride_dom,
                       stride_dod, keys, offs_m, offs_d, seq_q, query_start, query_end, qk_scale, rng_base, k_len,
                       dropout_p, dropout_scale, seed, MASKED: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr):
    """Adds the query blocks [query_start, query_end) to one key block's (dk, dv); MASKED applies the causal mask.

    Rows past the query length read lse = +inf (p = 0) and dout = 0, so they add nothing without a mask.
    """
    for start_m in range(query_start, query_end, BLOCK_M):
        queries = start_m + offs_m
        row_valid = queries < seq_q
        q = tl.load(q_base + queries[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=row_valid[:, None],
                    other=0.0)
        dout = tl.load(dout_base + queries[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                       mask=row_valid[:, None], other=0.0)
        lse = tl.load(lse_base + queries, mask=row_valid, other=float("inf"))
        delta = tl.load(delta_base + queries, mask=row_valid, other=0.0)
        scores_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_N, BLOCK_M]
        p_t = tl.math.exp2(scores_t - lse[None, :])
        if MASKED:
            p_t = tl.where(queries[None, :] >= keys[:, None], p_t, 0.0)
        dp_t = tl.dot(v, tl.trans(dout), input_precision=DOT_PRECISION)
        if HAS_DROPOUT:
            keep_t = _dropout_keep(seed, rng_base + queries[None, :].to(tl.int64) * k_len + keys[:, None], dropout_p)
            dv = tl.dot(tl.where(keep_t, p_t * dropout_scale, 0.0).to(dout.dtype), dout, dv,
                        input_precision=DOT_PRECISION)
            dp_t = tl.where(keep_t, dp_t * dropout_scale, 0.0)
        else:
            dv = tl.dot(p_t.to(dout.dtype), dout, dv, input_precision=DOT_PRECISION)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=["heads", "q_len", "k_len"])
def _flash_attention_bwd_dkdv_kernel(
    q_ptr,  # [batch, q_len, heads, HEAD_DIM], any strides
    k_ptr,  # [batch, k_len, heads, HEAD_DIM], any strides
    v_ptr,  # [batch, k_len, heads, HEAD_DIM], any strides
    dout_ptr,  # [batch, q_len, heads, HEAD_DIM], any strides
    lse_ptr,  # [batch, heads, q_len], fp32, from the forward
    delta_ptr,  # [batch, heads, q_len], fp32
    q_lengths_ptr,  # [batch] ints; not read without HAS_Q_LENGTHS
    k_lengths_ptr,  # [batch] ints; not read without HAS_K_LENGTHS
    dk_ptr,  # [batch, k_len, heads, HEAD_DIM], any strides
    dv_ptr,  # [batch, k_len, heads, HEAD_DIM], dk's strides
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_dob, stride_dom, stride_doh, stride_dod,
    stride_dkb, stride_dkn, stride_dkh, stride_dkd,
    heads,
    q_len,
    k_len,
    qk_scale,  # log2(e) / sqrt(HEAD_DIM)
    sm_scale,  # 1 / sqrt(HEAD_DIM)
    dropout_p,
    dropout_scale,  # 1 / (1 - dropout_p)
    seed_ptr,  # [1] int64 Philox seed; not read without HAS_DROPOUT
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_Q_LENGTHS: tl.constexpr,
    HAS_K_LENGTHS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dk, dv of BLOCK_N keys of one (batch, head), summed over the query blocks that see them."""
    batch_head = tl.program_id(0)
    key_start = tl.program_id(1) * BLOCK_N
    batch_index = batch_head // heads
    head = batch_head % heads
    seq_q, seq_k = _sequence_lengths(q_lengths_ptr, k_lengths_ptr, batch_index, q_len, k_len, HAS_Q_LENGTHS,
                                     HAS_K_LENGTHS)
    seed = _load_seed(seed_ptr, HAS_DROPOUT)
    keys = key_start + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    key_valid = keys < seq_k
    k_base = k_ptr + batch_index.to(tl.int64) * stride_kb + head.to(tl.int64) * stride_kh
    v_base = v_ptr + batch_index.to(tl.int64) * stride_vb + head.to(tl.int64) * stride_vh
    k = tl.load(k_base + keys[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=key_valid[:, None], other=0.0)
    v = tl.load(v_base + keys[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=key_valid[:, None], other=0.0)
    q_base = q_ptr + batch_index.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
    dout_base = dout_ptr + batch_index.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh
    lse_base = lse_ptr + batch_head.to(tl.int64) * q_len
    delta_base = delta_ptr + batch_head.to(tl.int64) * q_len
    rng_base = batch_head.to(tl.int64) * q_len * k_len

    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    # A key block past the key length visits no query.
    query_end = tl.where(key_start < seq_k, seq_q, 0)
    unmasked_start = 0
    if CAUSAL:
        # Query i sees key j only when i >= j: start at the block holding query key_start; blocks from the first one
        # starting at or after the last key on need no mask.
        first_block = key_start // BLOCK_M * BLOCK_M
        unmasked_start = tl.minimum((key_start + BLOCK_N - 1 + BLOCK_M - 1) // BLOCK_M * BLOCK_M, query_end)
        dk, dv = _dkdv_query_blocks(
            dk, dv, k, v, q_base, dout_base, lse_base, delta_base, stride_qm, stride_qd, stride_dom, stride_dod,
            keys, offs_m, offs_d, seq_q, first_block, unmasked_start, qk_scale, rng_base, k_len, dropout_p,
            dropout_scale, seed, True, HAS_DROPOUT, DOT_PRECISION, BLOCK_M)
    dk, dv = _dkdv_query_blocks(
        dk, dv, k, v, q_base, dout_base, lse_base, delta_base, stride_qm, stride_qd, stride_dom, stride_dod,
        keys, offs_m, offs_d, seq_q, unmasked_start, query_end, qk_scale, rng_base, k_len, dropout_p,
        dropout_scale, seed, False, HAS_DROPOUT, DOT_PRECISION, BLOCK_M)

    # Padded keys were read as zeros and picked up stray values; their gradient is zero.
    dk = tl.where(key_valid[:, None], dk * sm_scale, 0.0)
    dv = tl.where(key_valid[:, None], dv, 0.0)
    in_tensor = (keys < k_len)[:, None]
    tl.store(_row_pointers(dk_ptr, batch_index, head, keys, offs_d, stride_dkb, stride_dkn, stride_dkh, stride_dkd),
             dk.to(dk_ptr.dtype.element_ty), mask=in_tensor)
    tl.store(_row_pointers(dv_ptr, batch_index, head, keys, offs_d, stride_dkb, stride_dkn, stride_dkh, stride_dkd),
             dv.to(dv_ptr.dtype.element_ty), mask=in_tensor)


@triton.jit
def _dq_key_blocks(dq, q, dout, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, queries,
                   offs_n, offs_d, seq_k, key_start, key_end, qk_scale, rng_rows, dropout_p, dropout_scale, seed,
                   CAUSAL: tl.constexpr, MASKED: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """Adds the key blocks [key_start, key_end) to one query block's dq (in units of the scaled scores)."""
    for start_n in range(key_start, key_end, BLOCK_N):
        keys = start_n + offs_n
        key_valid = keys < seq_k
        if MASKED:
            k_t = tl.load(k_base + keys[None, :] * stride_kn + offs_d[:, None] * stride_kd, mask=key_valid[None, :],
                          other=0.0)
            v_t = tl.load(v_base + keys[None, :] * stride_vn + offs_d[:, None] * stride_vd, mask=key_valid[None, :],
                          other=0.0)
        else:
            k_t = tl.load(k_base + keys[None, :] * stride_kn + offs_d[:, None] * stride_kd)
            v_t = tl.load(v_base + keys[None, :] * stride_vn + offs_d[:, None] * stride_vd)
        scores = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        p = tl.math.exp2(scores - lse[:, None])
        if MASKED:
            visible = key_valid[None, :]
            if CAUSAL:
                visible = visible & (keys[None, :] <= queries[:, None])
            p = tl.where(visible, p, 0.0)
        dp = tl.dot(dout, v_t, input_precision=DOT_PRECISION)
        if HAS_DROPOUT:
            keep = _dropout_keep(seed, rng_rows[:, None] + keys[None, :], dropout_p)
            dp = tl.where(keep, dp * dropout_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k_t.dtype), tl.trans(k_t), dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit(do_not_specialize=["heads", "q_len", "k_len"])
def _flash_attention_bwd_dq_kernel(
    q_ptr,  # [batch, q_len, heads, HEAD_DIM], any strides
    k_ptr,  # [batch, k_len, heads, HEAD_DIM], any strides
    v_ptr,  # [batch, k_len, heads, HEAD_DIM], any strides
    dout_ptr,  # [batch, q_len, heads, HEAD_DIM], any strides
    lse_ptr,  # [batch, heads, q_len], fp32, from the forward
    delta_ptr,  # [batch, heads, q_len], fp32
    q_lengths_ptr,  # [batch] ints; not read without HAS_Q_LENGTHS
    k_lengths_ptr,  # [batch] ints; not read without HAS_K_LENGTHS
    dq_ptr,  # [batch, q_len, heads, HEAD_DIM], any strides
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_dob, stride_dom, stride_doh, stride_dod,
    stride_dqb, stride_dqm, stride_dqh, stride_dqd,
    heads,
    q_len,
    k_len,
    qk_scale,  # log2(e) / sqrt(HEAD_DIM)
    sm_scale,  # 1 / sqrt(HEAD_DIM)
    dropout_p,
    dropout_scale,  # 1 / (1 - dropout_p)
    seed_ptr,  # [1] int64 Philox seed; not read without HAS_DROPOUT
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_Q_LENGTHS: tl.constexpr,
    HAS_K_LENGTHS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dq of BLOCK_M queries of one (batch, head), summed over the key blocks they see."""
    batch_head = tl.program_id(0)
    query_start = tl.program_id(1) * BLOCK_M
    batch_index = batch_head // heads
    head = batch_head % heads
    seq_q, seq_k = _sequence_lengths(q_lengths_ptr, k_lengths_ptr, batch_index, q_len, k_len, HAS_Q_LENGTHS,
                                     HAS_K_LENGTHS)
    seed = _load_seed(seed_ptr, HAS_DROPOUT)
    queries = query_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_valid = queries < seq_q
    q_base = q_ptr + batch_index.to(tl.int64) * stride_qb + head.to(tl.int64) * stride_qh
    dout_base = dout_ptr + batch_index.to(tl.int64) * stride_dob + head.to(tl.int64) * stride_doh
    k_base = k_ptr + batch_index.to(tl.int64) * stride_kb + head.to(tl.int64) * stride_kh
    v_base = v_ptr + batch_index.to(tl.int64) * stride_vb + head.to(tl.int64) * stride_vh
    q = tl.load(q_base + queries[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=row_valid[:, None],
                other=0.0)
    # Padded rows: lse = +inf makes p = 0 and dout = delta = 0, so their dq is exactly zero.
    dout = tl.load(dout_base + queries[:, None] * stride_dom + offs_d[None, :] * stride_dod, mask=row_valid[:, None],
                   other=0.0)
    lse = tl.load(lse_ptr + batch_head.to(tl.int64) * q_len + queries, mask=row_valid, other=float("inf"))
    delta = tl.load(delta_ptr + batch_head.to(tl.int64) * q_len + queries, mask=row_valid, other=0.0)
    rng_rows = (batch_head * q_len + queries).to(tl.int64) * k_len

    dq = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    unmasked_end, key_end = _key_block_bounds(query_start, seq_q, seq_k, CAUSAL, BLOCK_M, BLOCK_N)
    dq = _dq_key_blocks(dq, q, dout, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, queries,
                        offs_n, offs_d, seq_k, 0, unmasked_end, qk_scale, rng_rows, dropout_p, dropout_scale, seed,
                        CAUSAL, False, HAS_DROPOUT, DOT_PRECISION, BLOCK_N)
    dq = _dq_key_blocks(dq, q, dout, lse, delta, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd, queries,
                        offs_n, offs_d, seq_k, unmasked_end, key_end, qk_scale, rng_rows, dropout_p, dropout_scale,
                        seed, CAUSAL, True, HAS_DROPOUT, DOT_PRECISION, BLOCK_N)

    tl.store(_row_pointers(dq_ptr, batch_index, head, queries, offs_d, stride_dqb, stride_dqm, stride_dqh, stride_dqd),
             (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=(queries < q_len)[:, None])


# ---- short sequences: all keys of a (batch, head) resident in one program ----------------------------------------


@triton.jit
def _short_program_start(q_lengths_ptr, k_lengths_ptr, seed_ptr, k_ptr, v_ptr, lse_ptr, stride_kb, stride_kn,
                         stride_kh, stride_kd, stride_vb, stride_vn, stride_vh, stride_vd, heads, q_len, k_len,
                         HEAD_DIM: tl.constexpr, HAS_Q_LENGTHS: tl.constexpr, HAS_K_LENGTHS: tl.constexpr,
                         HAS_DROPOUT: tl.constexpr, BLOCK_N: tl.constexpr):
    """-> (batch_index, head, seq_q, seed, keys, offs_d, key_valid, k, v, lse_base, rng_base) of this program's
    (batch, head); k/v: [BLOCK_N, HEAD_DIM], all its keys and values, zero past seq_k; lse_base: its [q_len] lse
    row; rng_base: the flat dropout index of its (query 0, key 0)."""
    batch_head = tl.program_id(0)
    batch_index = batch_head // heads
    head = batch_head % heads
    seq_q, seq_k = _sequence_lengths(q_lengths_ptr, k_lengths_ptr, batch_index, q_len, k_len, HAS_Q_LENGTHS,
                                     HAS_K_LENGTHS)
    seed = _load_seed(seed_ptr, HAS_DROPOUT)
    keys = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    key_valid = keys < seq_k
    k = tl.load(_row_pointers(k_ptr, batch_index, head, keys, offs_d, stride_kb, stride_kn, stride_kh, stride_kd),
                mask=key_valid[:, None], other=0.0)
    v = tl.load(_row_pointers(v_ptr, batch_index, head, keys, offs_d, stride_vb, stride_vn, stride_vh, stride_vd),
                mask=key_valid[:, None], other=0.0)
    lse_base = lse_ptr + batch_head.to(tl.int64) * q_len
    rng_base = batch_head.to(tl.int64) * q_len * k_len
    return batch_index, head, seq_q, seed, keys, offs_d, key_valid, k, v, lse_base, rng_base


@triton.jit(do_not_specialize=["heads", "q_len", "k_len"])
def _short_attention_fwd_kernel(
    q_ptr,  # [batch, q_len, heads, HEAD_DIM], any strides
    k_ptr,  # [batch, k_len, heads, HEAD_DIM], any strides
    v_ptr,  # [batch, k_len, heads, HEAD_DIM], any strides
    q_lengths_ptr,  # [batch] ints; not read without HAS_Q_LENGTHS
    k_lengths_ptr,  # [batch] ints; not read without HAS_K_LENGTHS
    out_ptr,  # [batch, q_len, heads, HEAD_DIM], any strides
    lse_ptr,  # [batch, heads, q_len], fp32: log2 of each row's sum of 2^scores; +inf on padded rows
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ob, stride_om, stride_oh, stride_od,
    heads,
    q_len,
    k_len,
    qk_scale,  # log2(e) / sqrt(HEAD_DIM)
    dropout_p,
    dropout_scale,  # 1 / (1 - dropout_p)
    seed_ptr,  # [1] int64 Philox seed; not read without HAS_DROPOUT
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_Q_LENGTHS: tl.constexpr,
    HAS_K_LENGTHS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # >= k_len: every key in one tile
):
    """q: [batch, q_len, heads, D], k/v: [batch, k_len <= BLOCK_N, heads, D] -> out, lse of one (batch, head).

    k and v are loaded once and stay resident while the program walks its query blocks; each block's softmax sees
    every key at once, so it is exact in one pass (no online rescaling)."""
    batch_index, head, seq_q, seed, keys, offs_d, key_valid, k, v, lse_base, rng_base = _short_program_start(
        q_lengths_ptr, k_lengths_ptr, seed_ptr, k_ptr, v_ptr, lse_ptr, stride_kb, stride_kn, stride_kh, stride_kd,
        stride_vb, stride_vn, stride_vh, stride_vd, heads, q_len, k_len, HEAD_DIM, HAS_Q_LENGTHS, HAS_K_LENGTHS,
        HAS_DROPOUT, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)

    for query_start in range(0, seq_q, BLOCK_M):
        queries = query_start + offs_m
        row_valid = queries < seq_q
        q = tl.load(_row_pointers(q_ptr, batch_index, head, queries, offs_d, stride_qb, stride_qm, stride_qh,
                                  stride_qd), mask=row_valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        visible = key_valid[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= queries[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        # -inf only when no key is visible: seq_k clamped to 0 from unchecked lengths. Those rows output zero.
        row_max = tl.max(scores, 1)
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        p = tl.math.exp2(scores - row_max[:, None])
        row_sum = tl.sum(p, 1)
        row_sum = tl.where(row_sum > 0.0, row_sum, 1.0)
        if HAS_DROPOUT:
            # The normalizer sums the kept and the dropped probabilities alike: dropout acts after the softmax.
            keep = _dropout_keep(seed, rng_base + queries[:, None].to(tl.int64) * k_len + keys[None, :], dropout_p)
            p = tl.where(keep, p, 0.0)
        out_scale = 1.0 / row_sum
        if HAS_DROPOUT:
            out_scale = out_scale * dropout_scale
        out = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION) * out_scale[:, None]
        out = tl.where(row_valid[:, None], out, 0.0)
        in_tensor = queries < q_len
        tl.store(_row_pointers(out_ptr, batch_index, head, queries, offs_d, stride_ob, stride_om, stride_oh,
                               stride_od), out.to(out_ptr.dtype.element_ty), mask=in_tensor[:, None])
        tl.store(lse_base + queries, tl.where(row_valid, row_max + tl.math.log2(row_sum), float("inf")),
                 mask=in_tensor)
    # Query rows past the sequence's length: zero output, lse +inf (their probabilities are 0 in backward).
    for query_start in range(tl.cdiv(seq_q, BLOCK_M) * BLOCK_M, q_len, BLOCK_M):
        queries = query_start + offs_m
        in_tensor = queries < q_len
        tl.store(_row_pointers(out_ptr, batch_index, head, queries, offs_d, stride_ob, stride_om, stride_oh,
                               stride_od), tl.zeros((BLOCK_M, HEAD_DIM), dtype=out_ptr.dtype.element_ty),
                 mask=in_tensor[:, None])
        tl.store(lse_base + queries, tl.full((BLOCK_M,), float("inf"), dtype=tl.float32), mask=in_tensor)


@triton.jit(do_not_specialize=["heads", "q_len", "k_len"])
def _short_attention_bwd_kernel(
    q_ptr,  # [batch, q_len, heads, HEAD_DIM], any strides
    k_ptr,  # [batch, k_len, heads, HEAD_DIM], any strides
    v_ptr,  # [batch, k_len, heads, HEAD_DIM], any strides
    out_ptr,  # [batch, q_len, heads, HEAD_DIM], any strides, from the forward
    dout_ptr,  # [batch, q_len, heads, HEAD_DIM], any strides
    lse_ptr,  # [batch, heads, q_len], fp32, from the forward
    q_lengths_ptr,  # [batch] ints; not read without HAS_Q_LENGTHS
    k_lengths_ptr,  # [batch] ints; not read without HAS_K_LENGTHS
    dq_ptr,  # [batch, q_len, heads, HEAD_DIM], any strides
    dk_ptr,  # [batch, k_len, heads, HEAD_DIM], any strides
    dv_ptr,  # [batch, k_len, heads, HEAD_DIM], dk's strides
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_dob, stride_dom, stride_doh, stride_dod,
    stride_dqb, stride_dqm, stride_dqh, stride_dqd,
    stride_dkb, stride_dkn, stride_dkh, stride_dkd,
    heads,
    q_len,
    k_len,
    qk_scale,  # log2(e) / sqrt(HEAD_DIM)
    sm_scale,  # 1 / sqrt(HEAD_DIM)
    dropout_p,
    dropout_scale,  # 1 / (1 - dropout_p)
    seed_ptr,  # [1] int64 Philox seed; not read without HAS_DROPOUT
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_Q_LENGTHS: tl.constexpr,
    HAS_K_LENGTHS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # >= k_len: every key in one tile
):
    """dq, dk, dv of one (batch, head), k_len <= BLOCK_N, in one pass over its query blocks.

    With every key resident, a query block's probabilities are recomputed once and give that block's finished dq
    and its share of dk and dv; delta = rowsum(dout * out) is computed on the spot. No program writes where another
    does, and no preprocess launch is needed."""
    batch_index, head, seq_q, seed, keys, offs_d, key_valid, k, v, lse_base, rng_base = _short_program_start(
        q_lengths_ptr, k_lengths_ptr, seed_ptr, k_ptr, v_ptr, lse_ptr, stride_kb, stride_kn, stride_kh, stride_kd,
        stride_vb, stride_vn, stride_vh, stride_vd, heads, q_len, k_len, HEAD_DIM, HAS_Q_LENGTHS, HAS_K_LENGTHS,
        HAS_DROPOUT, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)

    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    for query_start in range(0, seq_q, BLOCK_M):
        queries = query_start + offs_m
        row_valid = queries < seq_q
        # Rows past the query length read q = dout = 0 and lse = +inf, so p = 0 and they add nothing.
        q = tl.load(_row_pointers(q_ptr, batch_index, head, queries, offs_d, stride_qb, stride_qm, stride_qh,
                                  stride_qd), mask=row_valid[:, None], other=0.0)
        dout = tl.load(_row_pointers(dout_ptr, batch_index, head, queries, offs_d, stride_dob, stride_dom,
                                     stride_doh, stride_dod), mask=row_valid[:, None], other=0.0)
        out = tl.load(_row_pointers(out_ptr, batch_index, head, queries, offs_d, stride_ob, stride_om, stride_oh,
                                    stride_od), mask=row_valid[:, None], other=0.0)
        delta = tl.sum(dout.to(tl.float32) * out.to(tl.float32), axis=1)
        lse = tl.load(lse_base + queries, mask=row_valid, other=float("inf"))
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        visible = key_valid[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= queries[:, None])
        p = tl.where(visible, tl.math.exp2(scores - lse[:, None]), 0.0)
        dp = tl.dot(dout, tl.trans(v), input_precision=DOT_PRECISION)
        if HAS_DROPOUT:
            keep = _dropout_keep(seed, rng_base + queries[:, None].to(tl.int64) * k_len + keys[None, :], dropout_p)
            dv = tl.dot(tl.trans(tl.where(keep, p * dropout_scale, 0.0).to(dout.dtype)), dout, dv,
                        input_precision=DOT_PRECISION)
            dp = tl.where(keep, dp * dropout_scale, 0.0)
        else:
            dv = tl.dot(tl.trans(p.to(dout.dtype)), dout, dv, input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION) * sm_scale
        tl.store(_row_pointers(dq_ptr, batch_index, head, queries, offs_d, stride_dqb, stride_dqm, stride_dqh,
                               stride_dqd), dq.to(dq_ptr.dtype.element_ty), mask=(queries < q_len)[:, None])
        dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=DOT_PRECISION)
    for query_start in range(tl.cdiv(seq_q, BLOCK_M) * BLOCK_M, q_len, BLOCK_M):
        queries = query_start + offs_m
        tl.store(_row_pointers(dq_ptr, batch_index, head, queries, offs_d, stride_dqb, stride_dqm, stride_dqh,
                               stride_dqd), tl.zeros((BLOCK_M, HEAD_DIM), dtype=dq_ptr.dtype.element_ty),
                 mask=(queries < q_len)[:, None])

    # Padded keys were read as zeros and picked up stray values; their gradient is zero.
    dk = tl.where(key_valid[:, None], dk * sm_scale, 0.0)
    dv = tl.where(key_valid[:, None], dv, 0.0)
    in_tensor = (keys < k_len)[:, None]
    tl.store(_row_pointers(dk_ptr, batch_index, head, keys, offs_d, stride_dkb, stride_dkn, stride_dkh, stride_dkd),
             dk.to(dk_ptr.dtype.element_ty), mask=in_tensor)
    tl.store(_row_pointers(dv_ptr, batch_index, head, keys, offs_d, stride_dkb, stride_dkn, stride_dkh, stride_dkd),
             dv.to(dv_ptr.dtype.element_ty), mask=in_tensor)


@triton.jit
def _dropout_mask_kernel(
    keep_ptr,  # [batch, heads, q_len, k_len] uint8 (0/1), contiguous
    n_elements,
    dropout_p,
    seed_ptr,  # [1] int64 Philox seed
    BLOCK: tl.constexpr,
):
    """-> the keep-mask the attention kernels draw, whose flat index is their Philox offset."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = _dropout_keep(tl.load(seed_ptr), offsets, dropout_p)
    tl.store(keep_ptr + offsets, keep.to(tl.uint8), mask=offsets < n_elements)


# Triton adds the tensors' dtypes to the key.
_TUNING_KEY = ["HEAD_DIM", "CAUSAL", "HAS_DROPOUT"]


class _Launch(NamedTuple):
    """How one kernel runs: the kernel, its autotuned wrapper for fp16/bf16 on the GPU, its one tile for fp32 on the
    GPU, and which block size tiles the grid's second axis."""
    kernel: Callable
    tuned: Callable
    fp32_config: triton.Config
    grid_block: str


def _plan(kernel, tuned_configs: list[triton.Config], fp32_config: triton.Config, grid_block: str) -> _Launch:
    return _Launch(kernel, triton.autotune(tuned_configs, key=_TUNING_KEY)(kernel), fp32_config, grid_block)


def _config(block_m: int, block_n: int, num_warps: int, num_stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=num_warps, num_stages=num_stages)


# fp16/bf16 are autotuned once per (head_dim, causal, dropout, dtype) over a few tiles. fp32 is the accuracy path, not
# the speed path: one small tile, which compiles fast and fits fp32 operands at head_dim 128 (larger fp32 tiles
# take minutes to compile and up to all of an H100's shared memory).
_LAUNCHES = {
    "forward": _plan(_flash_attention_fwd_kernel, [_config(128, 64, 4, 3), _config(128, 64, 8, 3),
                                                   _config(64, 64, 4, 3)], _config(64, 32, 4, 2), "BLOCK_M"),
    # dk/dv programs hold a tall key block and stream short query blocks; dq programs the other way round.
    "dkdv": _plan(_flash_attention_bwd_dkdv_kernel, [_config(32, 128, 8, 3), _config(32, 64, 4, 3)],
                  _config(16, 64, 4, 2), "BLOCK_N"),
    "dq": _plan(_flash_attention_bwd_dq_kernel, [_config(128, 32, 8, 3), _config(64, 32, 4, 3)],
                _config(64, 16, 4, 2), "BLOCK_M"),
}


def _interpreted(device: torch.device) -> bool:
    return device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _launch(name: str, q: torch.Tensor, batch_heads: int, length: int, *args, **kwargs) -> None:
    """Runs kernel `name` over (batch_heads, blocks of `length`): one fixed small tile in the interpreter, one fixed
    tile for fp32 on the GPU, else autotuned."""
    launch = _LAUNCHES[name]
    kernel = launch.kernel
    if _interpreted(q.device):
        kernel[(batch_heads, cdiv(length, INTERPRETER_BLOCK))](
            *args, **kwargs, BLOCK_M=INTERPRETER_BLOCK, BLOCK_N=INTERPRETER_BLOCK)
    elif q.dtype == torch.float32:
        config = launch.fp32_config
        kernel[(batch_heads, cdiv(length, config.kwargs[launch.grid_block]))](
            *args, **kwargs, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
    else:
        launch.tuned[lambda meta: (batch_heads, cdiv(length, meta[launch.grid_block]))](*args, **kwargs)


# The short path holds all of a (batch, head)'s keys and values in one program: up to this many keys, and with a
# k (or v) tile of at most SHORT_PATH_TILE_BYTES (fp16/bf16: 128 keys at head_dim 64, 64 at 128; fp32 half that),
# so that k, v, their fp32 gradients and a [BLOCK_M, BLOCK_N] score tile stay within a program's registers.
SHORT_PATH_MAX_LEN = 128
SHORT_PATH_TILE_BYTES = 128 * 64 * 2
# Off on GPUs until the short path passes the GPU tests on one; the long path is the one that passed (at 184540c).
SHORT_PATH_ON_GPU = os.environ.get("FASTFORMER_ATTENTION_SHORT_PATH") == "1"


class ShortPathTiles(NamedTuple):
    """The short path's tiles for one problem: query rows per step of the forward and of the backward, keys (all of
    them, padded to a power of 2), and warps per program."""
    forward_block_m: int
    backward_block_m: int
    block_n: int
    num_warps: int


def short_path_tiles(q_len: int, k_len: int, head_dim: int, dtype: torch.dtype,
                     interpreted: bool = False) -> Optional[ShortPathTiles]:
    """The tiles of the short-sequence path for these sizes, or None when they take the long (flash) path.

    The one place that picks the path: a function of the padded lengths and the dtype only, never of the length
    values, so choosing needs no host sync."""
    block_n = max(16, next_power_of_2(k_len))
    if not (interpreted or SHORT_PATH_ON_GPU):
        return None
    if max(q_len, k_len) > SHORT_PATH_MAX_LEN or block_n * head_dim * dtype.itemsize > SHORT_PATH_TILE_BYTES:
        return None
    if interpreted:
        return ShortPathTiles(INTERPRETER_BLOCK, INTERPRETER_BLOCK, block_n, 4)
    block_q = max(16, next_power_of_2(q_len))
    wide = block_n * head_dim > 64 * 64
    # The backward keeps dk and dv accumulators beside k and v, so it steps through fewer query rows at a time.
    forward_block_m = min(block_q, 64)
    backward_block_m = min(block_q, 32 if wide else 64)
    if dtype == torch.float32:
        forward_block_m, backward_block_m = min(forward_block_m, 32), min(backward_block_m, 16)
    return ShortPathTiles(forward_block_m, backward_block_m, block_n, 8 if wide else 4)


def attention_path(q_len: int, k_len: int, head_dim: int, dtype: torch.dtype) -> str:
    """-> "short" (one forward and one backward kernel per (batch, head)) or "long" (flash tiles) for these sizes,
    on a GPU."""
    return "long" if short_path_tiles(q_len, k_len, head_dim, dtype) is None else "short"


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 products in full precision (not TF32); the choice is moot for fp16/bf16 operands."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.stride())


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lengths: Optional[torch.Tensor],
             k_lengths: Optional[torch.Tensor], causal: bool, dropout_p: float, seed: Optional[torch.Tensor],
             check_lengths: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [batch, q_len, heads, D], k/v: [batch, k_len, heads, D] -> (out: like q, lse: [batch, heads, q_len] fp32)."""
    batch, q_len, heads, head_dim = q.shape
    k_len = k.shape[1]
    if check_lengths:
        check_length_values(q_lengths, k_lengths, q_len, k_len)
    out = torch.empty((batch, q_len, heads, head_dim), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, q_len), dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    args = (q, k, v, q if q_lengths is None else q_lengths, q if k_lengths is None else k_lengths, out, lse,
            *_strides(q), *_strides(k), *_strides(v), *_strides(out), heads, q_len, k_len,
            LOG2_E / math.sqrt(head_dim), dropout_p, dropout_scale(dropout_p), q if seed is None else seed)
    flags = dict(HEAD_DIM=head_dim, CAUSAL=causal, HAS_Q_LENGTHS=q_lengths is not None,
                 HAS_K_LENGTHS=k_lengths is not None, HAS_DROPOUT=seed is not None,
                 DOT_PRECISION=_dot_precision(q.dtype))
    tiles = short_path_tiles(q_len, k_len, head_dim, q.dtype, _interpreted(q.device))
    if tiles is None:
        _launch("forward", q, batch * heads, q_len, *args, **flags)
    else:
        _short_attention_fwd_kernel[(batch * heads,)](*args, **flags, BLOCK_M=tiles.forward_block_m,
                                                       BLOCK_N=tiles.block_n, num_warps=tiles.num_warps)
    return out, lse
    _launch("forward", q, batch * heads, q_len,
            q, k, v, q if q_lengths is None else q_lengths, q if k_lengths is None else k_lengths, out, lse,
            *_strides(q), *_strides(k), *_strides(v), *_strides(out), heads, q_len, k_len,
            LOG2_E / math.sqrt(head_dim), dropout_p, dropout_scale(dropout_p), q if seed is None else seed,
            HEAD_DIM=head_dim, CAUSAL=causal, HAS_Q_LENGTHS=q_lengths is not None,
            HAS_K_LENGTHS=k_lengths is not None, HAS_DROPOUT=seed is not None, DOT_PRECISION=_dot_precision(q.dtype))
    return out, lse


def _backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, q_lengths: Optional[torch.Tensor], k_lengths: Optional[torch.Tensor], causal: bool,
              dropout_p: float, seed: Optional[torch.Tensor], dq: torch.Tensor, dk: torch.Tensor,
              dv: torch.Tensor) -> None:
    """dout: [batch, q_len, heads, D] -> writes dq, dk, dv (shaped like q, k, v, any strides; dk and dv with the
    same strides), so that they can be views of one packed gradient."""
    batch, q_len, heads, head_dim = q.shape
    k_len = k.shape[1]
    if batch * heads == 0 or k_len == 0:
        return
    if q_len == 0:
        dk.zero_()
        dv.zero_()
        return
    lengths = (q if q_lengths is None else q_lengths, q if k_lengths is None else k_lengths)
    scalars = (heads, q_len, k_len, LOG2_E / math.sqrt(head_dim), 1.0 / math.sqrt(head_dim), dropout_p,
               dropout_scale(dropout_p), q if seed is None else seed)
    flags = dict(HEAD_DIM=head_dim, CAUSAL=causal, HAS_Q_LENGTHS=q_lengths is not None,
                 HAS_K_LENGTHS=k_lengths is not None, HAS_DROPOUT=seed is not None,
                 DOT_PRECISION=_dot_precision(q.dtype))
    tiles = short_path_tiles(q_len, k_len, head_dim, q.dtype, _interpreted(q.device))
    if tiles is not None:
        _short_attention_bwd_kernel[(batch * heads,)](
            q, k, v, out, dout, lse, *lengths, dq, dk, dv, *_strides(q), *_strides(k), *_strides(v), *_strides(out),
            *_strides(dout), *_strides(dq), *_strides(dk), *scalars, **flags, BLOCK_M=tiles.backward_block_m,
            BLOCK_N=tiles.block_n, num_warps=tiles.num_warps)
        return
    delta = torch.empty_like(lse)
    preprocess_block = INTERPRETER_BLOCK if _interpreted(q.device) else PREPROCESS_BLOCK_M
    _flash_attention_bwd_preprocess_kernel[(batch * heads, cdiv(q_len, preprocess_block))](
        out, dout, delta, *_strides(out), *_strides(dout), heads, q_len, HEAD_DIM=head_dim, BLOCK_M=preprocess_block)
    inputs = (q, k, v, dout, lse, delta, *lengths)
    input_strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(dout))
    _launch("dkdv", q, batch * heads, k_len, *inputs, dk, dv, *input_strides, *_strides(dk), *scalars, **flags)
    _launch("dq", q, batch * heads, q_len, *inputs, dq, *input_strides, *_strides(dq), *scalars, **flags)


# The length check runs inside the op, so that torch.compile(fullgraph=True) takes it; with check_lengths=False the
# ops never synchronize with the host, and a step made of them can be captured in a CUDA graph.
@torch.library.custom_op("fastformer::flash_attention", mutates_args=())
def _flash_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lengths: Optional[torch.Tensor],
                        k_lengths: Optional[torch.Tensor], causal: bool, dropout_p: float,
                        seed: Optional[torch.Tensor], check_lengths: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [batch, q_len, heads, D], k/v: [batch, k_len, heads, D], seed: [1] int64 or None -> (out: [batch, q_len,
    heads, D], lse: [batch, heads, q_len] fp32)."""
    return _forward(q, k, v, q_lengths, k_lengths, causal, dropout_p, seed, check_lengths)


@_flash_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lengths: Optional[torch.Tensor],
      k_lengths: Optional[torch.Tensor], causal: bool, dropout_p: float, seed: Optional[torch.Tensor],
      check_lengths: bool) -> tuple[torch.Tensor, torch.Tensor]:
    batch, q_len, heads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads, q_len), dtype=torch.float32)


@torch.library.custom_op("fastformer::flash_attention_backward", mutates_args=())
def _flash_attention_backward_op(
        dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
        q_lengths: Optional[torch.Tensor], k_lengths: Optional[torch.Tensor], causal: bool, dropout_p: float,
        seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dout: [batch, q_len, heads, D] -> (dq, dk, dv) shaped like q, k, v (contiguous)."""
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    _backward(dout, q, k, v, out, lse, q_lengths, k_lengths, causal, dropout_p, seed, dq, dk, dv)
    return dq, dk, dv


@_flash_attention_backward_op.register_fake
def _(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
      q_lengths: Optional[torch.Tensor], k_lengths: Optional[torch.Tensor], causal: bool, dropout_p: float,
      seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:
    q, k, v, q_lengths, k_lengths, causal, dropout_p, seed, _ = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, q_lengths, k_lengths, seed)
    ctx.causal, ctx.dropout_p = causal, dropout_p


def _backward_autograd(ctx, dout: torch.Tensor, _lse_grad: Optional[torch.Tensor]) -> tuple:
    q, k, v, out, lse, q_lengths, k_lengths, seed = ctx.saved_tensors
    dq, dk, dv = _flash_attention_backward_op(dout, q, k, v, out, lse, q_lengths, k_lengths, ctx.causal,
                                              ctx.dropout_p, seed)
    return dq, dk, dv, None, None, None, None, None, None


_flash_attention_op.register_autograd(_backward_autograd, setup_context=_setup_context)


def _packed_views(q: Optional[torch.Tensor], packed: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """packed: [batch, len, 3, heads, D] (q None) or [batch, k_len, 2, heads, D] -> (q, k, v) [batch, len, heads, D]."""
    return tuple(packed.unbind(2)) if q is None else (q, *packed.unbind(2))


# Packed inputs (flash-attention's qkvpacked / kvpacked forms): q, k and v are slices of the fused projection's
# output, and the backward writes their gradients into one buffer of the packed shape, which is the projection's
# gradient as it is; separate q, k, v views would have autograd stack three gradients into it, a copy per call.
@torch.library.custom_op("fastformer::flash_attention_packed", mutates_args=())
def _flash_attention_packed_op(q: Optional[torch.Tensor], packed: torch.Tensor, q_lengths: Optional[torch.Tensor],
                               k_lengths: Optional[torch.Tensor], causal: bool, dropout_p: float,
                               seed: Optional[torch.Tensor], check_lengths: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """packed: [batch, len, 3, heads, D] holding q, k, v (q None), or [batch, k_len, 2, heads, D] holding k, v beside
    q: [batch, q_len, heads, D] -> (out: [batch, q_len, heads, D], lse: [batch, heads, q_len] fp32)."""
    return _forward(*_packed_views(q, packed), q_lengths, k_lengths, causal, dropout_p, seed, check_lengths)


@_flash_attention_packed_op.register_fake
def _(q: Optional[torch.Tensor], packed: torch.Tensor, q_lengths: Optional[torch.Tensor],
      k_lengths: Optional[torch.Tensor], causal: bool, dropout_p: float, seed: Optional[torch.Tensor],
      check_lengths: bool) -> tuple[torch.Tensor, torch.Tensor]:
    q = _packed_views(q, packed)[0]
    batch, q_len, heads, head_dim = q.shape
    return (packed.new_empty((batch, q_len, heads, head_dim)),
            packed.new_empty((batch, heads, q_len), dtype=torch.float32))


@torch.library.custom_op("fastformer::flash_attention_packed_backward", mutates_args=())
def _flash_attention_packed_backward_op(
        dout: torch.Tensor, q: Optional[torch.Tensor], packed: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
        q_lengths: Optional[torch.Tensor], k_lengths: Optional[torch.Tensor], causal: bool, dropout_p: float,
        seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """dout: [batch, q_len, heads, D] -> (dq shaped like q, or an empty tensor when q is None; dpacked shaped like
    packed, contiguous)."""
    dpacked = torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)
    if q is None:
        dq_or_none, (dq, dk, dv) = packed.new_empty(0), dpacked.unbind(2)
    else:
        dq_or_none = dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dk, dv = dpacked.unbind(2)
    _backward(dout, *_packed_views(q, packed), out, lse, q_lengths, k_lengths, causal, dropout_p, seed, dq, dk, dv)
    return dq_or_none, dpacked


@_flash_attention_packed_backward_op.register_fake
def _(dout: torch.Tensor, q: Optional[torch.Tensor], packed: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
      q_lengths: Optional[torch.Tensor], k_lengths: Optional[torch.Tensor], causal: bool, dropout_p: float,
      seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return (packed.new_empty(0) if q is None else q.new_empty(q.shape)), packed.new_empty(packed.shape)


def _setup_packed_context(ctx, inputs: tuple, output: tuple) -> None:
    q, packed, q_lengths, k_lengths, causal, dropout_p, seed, _ = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, packed, out, lse, q_lengths, k_lengths, seed)
    ctx.causal, ctx.dropout_p = causal, dropout_p


def _packed_backward_autograd(ctx, dout: torch.Tensor, _lse_grad: Optional[torch.Tensor]) -> tuple:
    q, packed, out, lse, q_lengths, k_lengths, seed = ctx.saved_tensors
    dq, dpacked = _flash_attention_packed_backward_op(dout, q, packed, out, lse, q_lengths, k_lengths, ctx.causal,
                                                      ctx.dropout_p, seed)
    return (None if q is None else dq), dpacked, None, None, None, None, None, None


_flash_attention_packed_op.register_autograd(_packed_backward_autograd, setup_context=_setup_packed_context)


def unsupported_reason(q: torch.Tensor, k: Optional[torch.Tensor] = None,
                       v: Optional[torch.Tensor] = None) -> Optional[str]:
    """Why the kernel cannot take these inputs, well-formed as inputs.check_attention requires (packed forms as in
    flash_attention), or None if it can."""
    q, _, _ = split_packed(q, k, v)
    if q.dtype not in SUPPORTED_DTYPES:
        return f"q has dtype {q.dtype}; the kernel takes float32, float16 and bfloat16"
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"head_dim is {q.shape[-1]}; the kernel takes {', '.join(map(str, SUPPORTED_HEAD_DIMS))}"
    return None


def flash_attention(q: torch.Tensor, k: Optional[torch.Tensor] = None, v: Optional[torch.Tensor] = None,
                    q_lengths: Optional[torch.Tensor] = None, k_lengths: Optional[torch.Tensor] = None,
                    causal: bool = False, dropout_p: float = 0.0, seed: Optional[int] = None,
                    check_lengths: bool = True) -> torch.Tensor:
    """q: [batch, q_len, heads, D], k/v: [batch, k_len, heads, D] (any strides) -> [batch, q_len, heads, D].

    softmax(q k^T / sqrt(D)) v with keys at or past k_lengths[b] ignored, query rows at or past q_lengths[b] output
    as zeros (lengths: int [batch] tensors, None = full), and `causal` letting query i see keys j <= i.
    Packed forms, as a fused projection makes them: flash_attention(qkv) with qkv: [batch, len, 3, heads, D], and
    flash_attention(q, kv) with kv: [batch, k_len, 2, heads, D]; the gradient of qkv (kv) is then one buffer of its
    shape, written by the kernel, so the projection's backward needs no copy.
    Differentiable with respect to q, k and v. The dropout mask of the probabilities is a function of `seed` (drawn
    on q's device from torch's generator when None) and the element's position: `attention_dropout_mask` rebuilds it.
    check_lengths: raise on length values outside [0, q_len] / [1, k_len], at the cost of one host sync. Pass False
    for lengths already checked (fastformer.Transformer checks its batch once per step): then no call synchronizes,
    and the kernel clamps lengths to [0, len].
    Sequences up to SHORT_PATH_MAX_LEN run one forward and one backward kernel per (batch, head) with every key
    resident; longer ones the flash tiles (`attention_path` says which).
    """
    views = split_packed(q, k, v)
    check_attention(*views, q_lengths, k_lengths, dropout_p)
    reason = unsupported_reason(*views)
    if reason is not None:
        raise ValueError(f"flash_attention: {reason}")
    flags = (q_lengths, k_lengths, bool(causal), float(dropout_p), seed_tensor(seed, dropout_p, views[0].device),
             bool(check_lengths))
    if k is None:
        out, _ = _flash_attention_packed_op(None, q, *flags)
    elif v is None:
        out, _ = _flash_attention_packed_op(q, k, *flags)
    else:
        out, _ = _flash_attention_op(q, k, v, *flags)
    return out


def attention_dropout_mask(seed: int, batch: int, heads: int, q_len: int, k_len: int, dropout_p: float,
                           device: torch.device | str = "cpu") -> torch.Tensor:
    """-> keep: [batch, heads, q_len, k_len] bool, the mask flash_attention(..., dropout_p, seed) applies to
    inputs of these sizes (True = kept)."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    keep = torch.empty((batch, heads, q_len, k_len), dtype=torch.uint8, device=device)
    if keep.numel() > 0:
        block = 1024
        _dropout_mask_kernel[(cdiv(keep.numel(), block),)](
            keep, keep.numel(), dropout_p, torch.full((1,), seed, dtype=torch.int64, device=device), BLOCK=block)
    return keep.view(torch.bool)
