"""Tokenized corpora, the length filter, and the paper's token-budget batching, sharded across ranks."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from fastformer.data.tokenizer import Tokenizer


@dataclass(frozen=True)
class LengthFilter:
    """Keeps a pair when both sides have min_len..max_len tokens and neither is over max_ratio times the other."""

    min_len: int = 3
    max_len: int = 150
    max_ratio: float = 2.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got min_len={self.min_len}, max_len={self.max_len}")
        if self.max_ratio < 1.0:
            raise ValueError(f"max_ratio must be >= 1, got {self.max_ratio}")

    def keeps(self, src_len: int, tgt_len: int) -> bool:
        in_range = self.min_len <= src_len <= self.max_len and self.min_len <= tgt_len <= self.max_len
        return in_range and max(src_len, tgt_len) <= self.max_ratio * min(src_len, tgt_len)


class TokenizedCorpus:
    """Sentence pairs as two flat id tensors with offsets (a WMT-sized corpus as Python lists would take gigabytes).

    Sources end with EOS; targets are stored bare and get BOS/EOS in `collate`. The special ids are the tokenizer's
    (`Tokenizer.special_ids`).
    """

    def __init__(self, src: list[list[int]], tgt: list[list[int]], pad_id: int, bos_id: int, eos_id: int) -> None:
        if len(src) != len(tgt):
            raise ValueError(f"src has {len(src)} sentences but tgt has {len(tgt)}")
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        self.src_ids, self.src_offsets = _flatten([ids + [eos_id] for ids in src])
        self.tgt_ids, self.tgt_offsets = _flatten(tgt)

    @classmethod
    def encode(cls, tokenizer: Tokenizer, pairs: list[tuple[str, str]],
               length_filter: LengthFilter | None = None) -> TokenizedCorpus:
        """Encodes (source, target) sentences, dropping the pairs length_filter rejects (None keeps all)."""
        src = tokenizer.encode([pair[0] for pair in pairs])
        tgt = tokenizer.encode([pair[1] for pair in pairs])
        if length_filter is not None:
            kept = [i for i in range(len(src)) if length_filter.keeps(len(src[i]), len(tgt[i]))]
            src, tgt = [src[i] for i in kept], [tgt[i] for i in kept]
        return cls(src, tgt, **tokenizer.special_ids)

    def __len__(self) -> int:
        return len(self.src_offsets) - 1

    @property
    def src_lengths(self) -> torch.Tensor:
        """[n]: source lengths including EOS."""
        return self.src_offsets.diff()

    @property
    def tgt_lengths(self) -> torch.Tensor:
        """[n]: lengths of tgt_in (= of tgt_out): the target plus BOS (or EOS)."""
        return self.tgt_offsets.diff() + 1

    def source(self, index: int) -> torch.Tensor:
        return self.src_ids[self.src_offsets[index]:self.src_offsets[index + 1]]

    def target(self, index: int) -> torch.Tensor:
        return self.tgt_ids[self.tgt_offsets[index]:self.tgt_offsets[index + 1]]

    def collate(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> src [batch, src_len] (ends in EOS), tgt_in [batch, tgt_len] = [BOS, y], tgt_out = [y, EOS]; all
        right-padded with pad_id."""
        sources = [self.source(i) for i in indices]
        targets = [self.target(i) for i in indices]
        src = torch.nn.utils.rnn.pad_sequence(sources, batch_first=True, padding_value=self.pad_id)
        bos, eos = torch.tensor([self.bos_id]), torch.tensor([self.eos_id])
        tgt_in = torch.nn.utils.rnn.pad_sequence([torch.cat([bos, y]) for y in targets], batch_first=True,
                                                 padding_value=self.pad_id)
        tgt_out = torch.nn.utils.rnn.pad_sequence([torch.cat([y, eos]) for y in targets], batch_first=True,
                                                  padding_value=self.pad_id)
        return src.long(), tgt_in.long(), tgt_out.long()


def _flatten(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (all ids concatenated [total] int32, offsets [n + 1] int64)."""
    lengths = torch.tensor([len(ids) for ids in sequences], dtype=torch.int64)
    offsets = torch.zeros(len(sequences) + 1, dtype=torch.int64)
    torch.cumsum(lengths, dim=0, out=offsets[1:])
    flat = torch.tensor([token for ids in sequences for token in ids], dtype=torch.int32)
    return flat, offsets


def token_budget_batches(order: list[int], sizes: list[int], max_tokens: int) -> list[list[int]]:
    """The paper's (and fairseq's) grouping: items taken in `order` (sorted by length, so that neighbours pad little)
    into consecutive batches whose padded size, batch size x largest sizes[i], stays within max_tokens. An item
    larger than max_tokens alone gets a batch of its own."""
    batches: list[list[int]] = []
    batch: list[int] = []
    longest = 0
    for i in order:
        candidate = max(longest, sizes[i])
        if batch and (len(batch) + 1) * candidate > max_tokens:
            batches.append(batch)
            batch, candidate = [], sizes[i]
        batch.append(i)
        longest = candidate
    if batch:
        batches.append(batch)
    return batches


class TokenBatchSampler:
    """The paper's batching: sentence pairs of similar length grouped so that each batch's padded size
    (batch size x longest sequence) stays within max_tokens on the source and on the target side.

    Every epoch regroups the pairs (ties in length are broken by a seeded shuffle) and shuffles the batch order with
    `seed`; every rank computes the same batch list and takes every world_size-th batch, so ranks are disjoint,
    together cover every pair once, and all get the same number of batches.
    """

    def __init__(self, src_lengths: torch.Tensor, tgt_lengths: torch.Tensor, max_tokens: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1) -> None:
        if src_lengths.shape != tgt_lengths.shape or src_lengths.dim() != 1:
            raise ValueError(f"src_lengths and tgt_lengths must be equal-length 1-D tensors, got "
                             f"{tuple(src_lengths.shape)} and {tuple(tgt_lengths.shape)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if len(src_lengths) < world_size:
            raise ValueError(f"{len(src_lengths)} sentence pairs cannot fill a batch on each of {world_size} ranks")
        longest = int(torch.maximum(src_lengths, tgt_lengths).max()) if len(src_lengths) else 0
        if max_tokens < longest:
            raise ValueError(f"max_tokens={max_tokens} is below the longest sequence ({longest} tokens)")
        self.src_lengths = src_lengths.tolist()
        self.tgt_lengths = tgt_lengths.tolist()
        self.max_tokens = max_tokens
        self.seed = seed
        self.rank = rank
        self.world_size = world_size

    def all_batches(self, epoch: int) -> list[list[int]]:
        """Every rank's batches of `epoch`, in order; this rank's are [rank::world_size]."""
        rng = random.Random(f"{self.seed}:{epoch}")
        order = list(range(len(self.src_lengths)))
        rng.shuffle(order)
        # A stable sort keeps the shuffled order among equal lengths, so batches differ from epoch to epoch.
        order.sort(key=lambda i: (self.tgt_lengths[i], self.src_lengths[i]))
        sizes = [max(src, tgt) for src, tgt in zip(self.src_lengths, self.tgt_lengths)]
        batches = token_budget_batches(order, sizes, self.max_tokens)
        rng.shuffle(batches)
        # Halving the largest batches (which only lowers their padded size) evens the count out over ranks.
        while len(batches) % self.world_size:
            largest = max(range(len(batches)), key=lambda b: len(batches[b]))
            if len(batches[largest]) < 2:
                raise ValueError(f"{len(order)} single-pair batches cannot be split evenly over "
                                 f"{self.world_size} ranks")
            half = len(batches[largest]) // 2
            batches[largest:largest + 1] = [batches[largest][:half], batches[largest][half:]]
        return batches

    def batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of `epoch`: lists of pair indices."""
        return self.all_batches(epoch)[self.rank::self.world_size]
