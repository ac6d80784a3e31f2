"""Drop-in `torch.nn.MultiheadAttention` that runs the fused attention kernel through the backend switch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastformer import dispatch


def _suffix_lengths(key_padding_mask: torch.Tensor) -> torch.Tensor | None:
    """key_padding_mask: [batch, k_len] bool -> lengths [batch] when every row is right-padded, else None."""
    lengths = (~key_padding_mask).sum(dim=1)
    positions = torch.arange(key_padding_mask.shape[1], device=key_padding_mask.device)
    is_suffix = torch.equal(key_padding_mask, positions[None, :] >= lengths[:, None])
    return lengths if is_suffix else None


def _as_4d_mask(attn_mask: torch.Tensor, batch: int, heads: int, q_len: int, k_len: int) -> torch.Tensor:
    """attn_mask: [q_len, k_len] or [batch * heads, q_len, k_len] -> broadcastable [batch|1, heads|1, q_len, k_len]."""
    if attn_mask.shape == (q_len, k_len):
        return attn_mask[None, None]
    if attn_mask.shape == (batch * heads, q_len, k_len):
        return attn_mask.view(batch, heads, q_len, k_len)
    raise ValueError(f"attn_mask must have shape {(q_len, k_len)} or {(batch * heads, q_len, k_len)}, "
                     f"got {tuple(attn_mask.shape)}")


def _merge_key_padding(attn_mask: torch.Tensor | None, key_padding_mask: torch.Tensor) -> torch.Tensor:
    """Fold a [batch, k_len] padding mask (True = ignore) into an attention mask broadcastable to 4-D."""
    padding = key_padding_mask[:, None, None, :]
    if attn_mask is None:
        return padding
    if attn_mask.dtype == torch.bool:
        return attn_mask | padding
    return attn_mask.masked_fill(padding, float("-inf"))


class MultiheadAttention(nn.Module):
    """The parameters and call of `torch.nn.MultiheadAttention` (so its state_dict loads), with a fused QKV projection.
    Its default layout is torch's too: [len, batch, embed_dim] unless batch_first=True.

    Beyond torch's arguments, `query_lengths`/`key_lengths` ([batch] ints) describe right-padded batches directly:
    keys past a length are ignored, and query rows past a length attend to nothing (their output is out_proj's
    bias), so no mask needs building. Their
    values are checked (a host sync per call) unless `check_lengths=False` says they already were.
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 batch_first: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        factory = dict(device=device, dtype=dtype)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory)) if bias else None
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    def _project(self, x: torch.Tensor, part: slice, n_parts: int) -> torch.Tensor:
        """x: [batch, len, embed_dim] -> the fused projection of n_parts inputs, viewed [batch, len, heads, head_dim]
        for one part and [batch, len, n_parts, heads, head_dim] (the attention's packed form) for more."""
        bias = self.in_proj_bias[part] if self.in_proj_bias is not None else None
        projected = F.linear(x, self.in_proj_weight[part], bias)
        parts = () if n_parts == 1 else (n_parts,)
        return projected.view(*x.shape[:2], *parts, self.num_heads, self.head_dim)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_padding_mask: torch.Tensor | None = None, need_weights: bool = False,
                attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True, is_causal: bool = False, *,
                query_lengths: torch.Tensor | None = None, key_lengths: torch.Tensor | None = None,
                check_lengths: bool = True) -> tuple[torch.Tensor, None]:
        """query: [q_len, batch, embed_dim], key/value: [k_len, batch, embed_dim] -> ([q_len, batch, embed_dim], None);
        batch first ([batch, len, embed_dim]) with batch_first=True. average_attn_weights is taken for torch's
        positional order; with no weights returned it changes nothing."""
        if need_weights:
            raise ValueError("need_weights=True is not supported: the fused kernel never forms the attention weights; "
                             "call with need_weights=False (or use torch.nn.MultiheadAttention)")
        # Packed q/k/v reach the kernel as one tensor, so that their gradient is the projection's gradient as it is
        # (separate views would have autograd stack three gradients into it). Transposing makes new tensors: tell
        # first.
        same_kv = key is value
        same_qkv = same_kv and query is key
        if any(t.dim() != 3 for t in (query, key, value)):
            layout = "[batch, len, embed_dim]" if self.batch_first else "[len, batch, embed_dim]"
            raise ValueError(f"query, key and value must be batched, {layout}: got shapes {tuple(query.shape)}, "
                             f"{tuple(key.shape)} and {tuple(value.shape)} (unsqueeze an unbatched input's batch dim)")
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        batch, q_len, _ = query.shape
        k_len = key.shape[1]
        e = self.embed_dim
        if same_qkv:
            q, k, v = self._project(query, slice(0, 3 * e), 3), None, None
        elif same_kv:
            q, k, v = self._project(query, slice(0, e), 1), self._project(key, slice(e, 3 * e), 2), None
        else:
            q = self._project(query, slice(0, e), 1)
            k = self._project(key, slice(e, 2 * e), 1)
            v = self._project(value, slice(2 * e, 3 * e), 1)

        # is_causal is a promise that attn_mask is the causal mask (torch's convention), so the kernel's causal
        # flag replaces it.
        mask = None if attn_mask is None or is_causal else _as_4d_mask(attn_mask, batch, self.num_heads, q_len, k_len)
        if key_padding_mask is not None:
            if key_padding_mask.shape != (batch, k_len) or key_padding_mask.dtype != torch.bool:
                raise ValueError(f"key_padding_mask must be a bool tensor of shape {(batch, k_len)}, "
                                 f"got {key_padding_mask.dtype} {tuple(key_padding_mask.shape)}")
            if key_padding_mask.all(dim=1).any():
                raise ValueError("key_padding_mask masks every key of some batch element; its attention is undefined")
            suffix_lengths = _suffix_lengths(key_padding_mask) if key_lengths is None else None
            if suffix_lengths is not None:
                key_lengths = suffix_lengths
            else:
                mask = _merge_key_padding(mask, key_padding_mask)

        out = dispatch.attention(q, k, v, q_lengths=query_lengths, k_lengths=key_lengths, causal=is_causal,
                                attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                                check_lengths=check_lengths)
        out = self.out_proj(out.reshape(batch, q_len, e))
        return (out if self.batch_first else out.transpose(0, 1)), None
