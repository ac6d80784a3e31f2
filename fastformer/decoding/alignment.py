"""Hard word alignments from a hypothesis's attention (`Hypothesis.attention`), as fairseq's `--print-alignment`
prints them."""

from __future__ import annotations

import torch


def hard_alignment(attention: torch.Tensor, src_tokens_count: int, tgt_tokens_count: int) -> list[tuple[int, int]]:
    """attention: [>= tgt_tokens_count, >= src_tokens_count] (rows: target tokens, columns: source tokens) ->
    fairseq's (i, j) pairs, printed `i-j`: for each target token j < tgt_tokens_count (EOS, the row after them, left
    out), the source position i < src_tokens_count (the source's EOS, the column after them, left out) with the
    highest weight, the first of equal ones. A source of EOS alone (src_tokens_count 0) aligns nothing."""
    if not isinstance(attention, torch.Tensor) or attention.dim() != 2:
        got = tuple(attention.shape) if isinstance(attention, torch.Tensor) else type(attention).__name__
        raise ValueError(f"attention must be a 2-D tensor [target tokens, source tokens], got {got}")
    rows, columns = attention.shape
    if not 0 <= src_tokens_count <= columns:
        raise ValueError(f"src_tokens_count must be in [0, {columns}] (the attention's columns), got "
                         f"{src_tokens_count}")
    if not 0 <= tgt_tokens_count <= rows:
        raise ValueError(f"tgt_tokens_count must be in [0, {rows}] (the attention's rows), got {tgt_tokens_count}")
    if src_tokens_count == 0:
        return []
    sources = attention[:tgt_tokens_count, :src_tokens_count].argmax(dim=1).tolist()
    return [(source, target) for target, source in enumerate(sources)]
