"""Plain-PyTorch scaled-dot-product attention with the masks the Transformer needs: the oracle of
triton_kernels/attention.py.

Written out (scores, masks, softmax, weighted sum) rather than calling F.scaled_dot_product_attention, so that a
test against PyTorch's own attention checks something.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def attention(q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
              q_lengths: torch.Tensor | None = None, k_lengths: torch.Tensor | None = None, causal: bool = False,
              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
              dropout_mask: torch.Tensor | None = None) -> torch.Tensor:
    """q: [batch, q_len, heads, head_dim], k/v: [batch, k_len, heads, head_dim] -> [batch, q_len, heads, head_dim].

    Packed forms as the kernel takes them: attention(qkv), qkv: [batch, len, 3, heads, head_dim], and
    attention(q, kv), kv: [batch, k_len, 2, heads, head_dim].

    Keys at or past k_lengths[b] are ignored; query rows at or past q_lengths[b] output zero. `causal` lets query i
    see keys j <= i. attn_mask, broadcastable to [batch, heads, q_len, k_len], is bool (True = ignore) or additive
    float. A row with no visible key outputs zero. dropout_mask ([batch, heads, q_len, k_len] bool, True = keep)
    replaces the random dropout of the probabilities, so a test can reproduce a kernel's mask.
    Math in at least fp32; the result has q's dtype.
    """
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if k is None:
        q, k, v = q.unbind(2)
    elif v is None:
        k, v = k.unbind(2)
    probabilities = attention_weights(q, k, k_lengths, causal, attn_mask)
    if dropout_mask is not None:
        probabilities = probabilities * dropout_mask / (1.0 - dropout_p)
    elif dropout_p > 0.0:
        probabilities = F.dropout(probabilities, dropout_p)
    out = probabilities @ v.transpose(1, 2).to(probabilities.dtype)  # [batch, heads, q_len, head_dim]
    if q_lengths is not None:
        query_positions = torch.arange(q.shape[1], device=q.device)
        padded_query = query_positions[None, :] >= q_lengths.to(q.device)[:, None]  # [batch, q_len]
        out = out.masked_fill(padded_query[:, None, :, None], 0.0)
    return out.transpose(1, 2).to(q.dtype)


def attention_weights(q: torch.Tensor, k: torch.Tensor, k_lengths: torch.Tensor | None = None, causal: bool = False,
                      attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """q: [batch, q_len, heads, head_dim], k: [batch, k_len, heads, head_dim] -> the attention probabilities
    [batch, heads, q_len, k_len] in at least fp32, masked as `attention` masks them (zero rows where no key is
    visible)."""
    batch, q_len, _, head_dim = q.shape
    k_len = k.shape[1]
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    q_, k_ = (t.transpose(1, 2).to(compute_dtype) for t in (q, k))  # [batch, heads, len, head_dim]
    scores = q_ @ k_.transpose(-1, -2) / math.sqrt(head_dim)  # [batch, heads, q_len, k_len]

    hidden = torch.zeros(batch, 1, q_len, k_len, dtype=torch.bool, device=q.device)
    key_positions = torch.arange(k_len, device=q.device)
    query_positions = torch.arange(q_len, device=q.device)
    if k_lengths is not None:
        hidden = hidden | (key_positions[None, :] >= k_lengths.to(q.device)[:, None])[:, None, None, :]
    if causal:
        hidden = hidden | (key_positions[None, :] > query_positions[:, None])[None, None]
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            hidden = hidden | attn_mask
        else:
            scores = scores + attn_mask.to(compute_dtype)
    scores = scores.masked_fill(hidden, float("-inf"))
    # A row that sees no key gets zero weights instead of softmax's NaN.
    visible = torch.isfinite(scores).any(dim=-1, keepdim=True)
    return torch.softmax(scores.masked_fill(~visible, 0.0), dim=-1) * visible
