"""A vocabulary shortlist for translation on the CPU: CTranslate2's vocabulary map (`use_vmap`), Marian's lexical
shortlist. Each source id lists the target ids it is likely to produce; a batch's output projection then computes the
logits of the union of its sources' lists, the target ids always kept and its target prefixes' ids, instead of the
whole vocabulary's (the others are -inf). At small batches a decoding step is bound by reading the weights, and the
output projection is most of them (a 37k vocabulary: 18.1 MiB of int8 of the base model's 39.1 MiB a step).

The lists come from a parallel corpus of ids: each target id's Dice coefficient with each source id over the sentence
pairs they share (2 c(s, t) / (c(s) + c(t)), c counting sentences), the `per_source` best per source id, and the
`always` target ids found in the most sentences.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

FORMAT = "fastformer-shortlist-1"
# Sentence pairs counted together: their (source, target) id pairs held at once.
CHUNK_PAIRS = 20_000


@dataclass(frozen=True)
class Shortlist:
    """candidates: [source_vocab, per_source] int64 target ids per source id, -1 padded; always: [n] int64 target ids
    every batch keeps (EOS among them)."""

    candidates: torch.Tensor
    always: torch.Tensor

    @property
    def vocab_size(self) -> int:
        return self.candidates.shape[0]

    def vocabulary(self, src_tokens: torch.Tensor, src_lengths: torch.Tensor,
                   extra_ids: Iterable[int] = ()) -> torch.Tensor:
        """src_tokens: [batch, src_len] right-padded, src_lengths: [batch] -> the batch's output ids: [n] int64
        sorted, the union of its real source ids' candidates, `always` and extra_ids (a target prefix's)."""
        real = torch.arange(src_tokens.shape[1], device=src_tokens.device)[None, :] < src_lengths[:, None]
        sources = src_tokens[real].cpu()
        outside = sources[(sources < 0) | (sources >= self.vocab_size)]
        if len(outside):
            raise ValueError(f"the shortlist covers source ids [0, {self.vocab_size}); the batch holds id "
                             f"{int(outside[0])}: it was built for another model")
        candidates = self.candidates[sources].flatten()
        ids = torch.cat([candidates[candidates >= 0], self.always, torch.tensor(list(extra_ids), dtype=torch.int64)])
        return torch.unique(ids)

    def save(self, path: str | Path) -> None:
        save_file({"candidates": self.candidates.contiguous(), "always": self.always.contiguous()}, str(path),
                  metadata={"format": FORMAT})

    @classmethod
    def load(cls, path: str | Path, target_vocab_size: int | None = None, eos_id: int | None = None) -> Shortlist:
        """Reads a shortlist `save` wrote; target_vocab_size: the model's (its one vocabulary, both sides'), which its
        rows and ids must fit; eos_id: the model's, which `always` must hold. Anything else is an error naming it."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"shortlist {path} does not exist")
        try:
            tensors = load_file(str(path))
            with safe_open(str(path), "pt") as handle:
                metadata = handle.metadata() or {}
        except Exception as error:  # safetensors raises its own types for a corrupt file
            raise ValueError(f"shortlist {path} is not a readable safetensors file: {error}") from error
        if metadata.get("format") != FORMAT or set(tensors) != {"candidates", "always"}:
            raise ValueError(f"{path} is not a fastformer shortlist (format {metadata.get('format')!r}, tensors "
                             f"{sorted(tensors)})")
        candidates, always = tensors["candidates"], tensors["always"]
        if any(t.dtype not in (torch.int64, torch.int32) for t in (candidates, always)) or candidates.dim() != 2 \
                or always.dim() != 1 or 0 in candidates.shape or len(always) == 0 or int(candidates.min()) < -1 \
                or int(always.min()) < 0:
            raise ValueError(f"shortlist {path} is corrupt: candidates must be [source_vocab, per_source] integer ids "
                             "or -1, always a non-empty list of ids")
        shortlist = cls(candidates.long(), always.long())
        if target_vocab_size is not None:
            if shortlist.vocab_size != target_vocab_size:
                raise ValueError(f"shortlist {path} has rows for {shortlist.vocab_size} source ids, the model's "
                                 f"vocabulary has {target_vocab_size}: it was built for another model")
            largest = max(int(shortlist.candidates.max()), int(shortlist.always.max()))
            if largest >= target_vocab_size:
                raise ValueError(f"shortlist {path} holds target id {largest}, outside the model's vocabulary of "
                                 f"{target_vocab_size}: it was built for another model")
        if eos_id is not None and not bool((shortlist.always == eos_id).any()):
            raise ValueError(f"shortlist {path} does not keep EOS (id {eos_id}) in every batch: it was built for "
                             "another model, or is corrupt")
        return shortlist


def build_shortlist(pairs: Iterable[tuple[Sequence[int], Sequence[int]]], source_vocab_size: int,
                    target_vocab_size: int, eos_id: int, excluded_ids: Iterable[int] = (), per_source: int = 20,
                    always: int = 100) -> Shortlist:
    """pairs: (source ids, target ids) of a parallel corpus -> the Shortlist of the module docstring. excluded_ids
    (pad, BOS) are never candidates; EOS is always kept."""
    if per_source < 1 or always < 0:
        raise ValueError(f"per_source must be >= 1 and always >= 0, got {per_source} and {always}")
    excluded = torch.tensor(sorted(set(excluded_ids)), dtype=torch.int64)
    pair_keys, pair_counts = torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
    source_counts = torch.zeros(source_vocab_size, dtype=torch.int64)
    target_counts = torch.zeros(target_vocab_size, dtype=torch.int64)
    chunk: list[torch.Tensor] = []
    n_pairs = 0

    def merge() -> None:
        nonlocal pair_keys, pair_counts
        keys, inverse = torch.unique(torch.cat([pair_keys, *chunk]), return_inverse=True)
        counts = torch.zeros(len(keys), dtype=torch.int64)
        counts.index_add_(0, inverse, torch.cat([pair_counts, torch.ones(len(inverse) - len(pair_counts),
                                                                          dtype=torch.int64)]))
        pair_keys, pair_counts = keys, counts
        chunk.clear()

    for source, target in pairs:
        s = torch.unique(torch.as_tensor(source, dtype=torch.int64))
        t = torch.unique(torch.as_tensor(target, dtype=torch.int64))
        t = t[~torch.isin(t, excluded)]
        if len(s) and (int(s.min()) < 0 or int(s.max()) >= source_vocab_size):
            raise ValueError(f"sentence pair {n_pairs}: a source id outside [0, {source_vocab_size})")
        if len(t) and (int(t.min()) < 0 or int(t.max()) >= target_vocab_size):
            raise ValueError(f"sentence pair {n_pairs}: a target id outside [0, {target_vocab_size})")
        source_counts[s] += 1
        target_counts[t] += 1
        chunk.append((s[:, None] * target_vocab_size + t[None, :]).flatten())
        n_pairs += 1
        if len(chunk) == CHUNK_PAIRS:
            merge()
    if n_pairs == 0:
        raise ValueError("build_shortlist got no sentence pairs")
    merge()
    source_of, target_of = pair_keys // target_vocab_size, pair_keys % target_vocab_size
    dice = 2.0 * pair_counts / (source_counts[source_of] + target_counts[target_of])
    # Within each source id, the best Dice first (ties: the more frequent pair, then the smaller id).
    order = torch.argsort(pair_counts, descending=True, stable=True)
    order = order[torch.argsort(dice[order], descending=True, stable=True)]
    order = order[torch.argsort(source_of[order], stable=True)]
    grouped = source_of[order]
    first_of_group = torch.searchsorted(grouped, grouped)  # the position where each source id's run starts
    rank = torch.arange(len(grouped)) - first_of_group
    kept = order[rank < per_source]
    candidates = torch.full((source_vocab_size, per_source), -1, dtype=torch.int64)
    candidates[source_of[kept], (rank[rank < per_source])] = target_of[kept]
    frequent = torch.argsort(target_counts, descending=True, stable=True)[:always]
    frequent = frequent[target_counts[frequent] > 0]
    return Shortlist(candidates, torch.unique(torch.cat([frequent, torch.tensor([eos_id])])))
