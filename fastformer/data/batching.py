"""Tokenized corpora, the length filter, and the paper's token-budget batching, sharded across ranks."""

from __future__ import annotations

import bisect
import collections
import random
from dataclasses import dataclass
from typing import NamedTuple

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


    def batch(self, indices: list[int], vocab_size: int, shape: BucketShape | None = None) -> Batch:
        """`collate(indices)` with its lengths, checked on the CPU so that a training step on a GPU can trust them and
        never wait for a check there. With a shape, every tensor is padded to it; the rows past len(indices) are
        filler: src [EOS], tgt_in [BOS], tgt_out all padding, so they add nothing to a summed loss or its gradient."""
        if shape is not None and len(indices) > shape.sentences:
            raise ValueError(f"{len(indices)} sentence pairs do not fit the bucket {shape}")
        src_lengths = self.src_lengths[indices] if indices else torch.zeros(0, dtype=torch.int64)
        tgt_lengths = self.tgt_lengths[indices] if indices else torch.zeros(0, dtype=torch.int64)
        if shape is not None and indices and (int(src_lengths.max()) > shape.src_len
                                              or int(tgt_lengths.max()) > shape.tgt_len):
            raise ValueError(f"a pair of {int(src_lengths.max())} source / {int(tgt_lengths.max())} target tokens "
                             f"exceeds the bucket {shape}")
        for name, ids in (("source", [self.source(i) for i in indices]), ("target", [self.target(i) for i in indices])):
            flat = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int32)
            if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= vocab_size):
                raise ValueError(f"a {name} sentence of the batch holds ids outside [0, vocab_size={vocab_size})")
        target_tokens = int(tgt_lengths.sum())
        if shape is None:
            src, tgt_in, tgt_out = self.collate(indices)
        else:
            src, tgt_in, tgt_out = self._padded_to(indices, shape)
            fillers = shape.sentences - len(indices)
            src_lengths = torch.cat([src_lengths, torch.ones(fillers, dtype=torch.int64)])
            tgt_lengths = torch.cat([tgt_lengths, torch.ones(fillers, dtype=torch.int64)])
        return Batch(src, tgt_in, tgt_out, src_lengths, tgt_lengths, target_tokens)

    def _padded_to(self, indices: list[int], shape: BucketShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """collate(indices) padded to shape, with filler rows after the pairs."""
        src = torch.full((shape.sentences, shape.src_len), self.pad_id, dtype=torch.int64)
        tgt_in = torch.full((shape.sentences, shape.tgt_len), self.pad_id, dtype=torch.int64)
        tgt_out = torch.full((shape.sentences, shape.tgt_len), self.pad_id, dtype=torch.int64)
        src[len(indices):, 0] = self.eos_id
        tgt_in[len(indices):, 0] = self.bos_id
        if indices:
            collated = self.collate(indices)
            for padded, part in zip((src, tgt_in, tgt_out), collated):
                padded[:len(indices), :part.shape[1]] = part
        return src, tgt_in, tgt_out


class Batch(NamedTuple):
    """A collated batch and its lengths, checked on the CPU (TokenizedCorpus.batch)."""

    src: torch.Tensor  # [batch, src_len], ends in EOS
    tgt_in: torch.Tensor  # [batch, tgt_len] = [BOS, y]
    tgt_out: torch.Tensor  # [batch, tgt_len] = [y, EOS]
    src_lengths: torch.Tensor  # [batch] int64
    tgt_lengths: torch.Tensor  # [batch] int64: of tgt_in (tgt_out has as many real tokens, a filler row none)
    target_tokens: int  # real tokens of tgt_out: what a summed loss is divided by


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
        _check_sampler_arguments(src_lengths, tgt_lengths, rank, world_size)
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


class BucketShape(NamedTuple):
    """A static batch shape: src is [sentences, src_len], tgt_in/tgt_out are [sentences, tgt_len]."""

    sentences: int
    src_len: int
    tgt_len: int


# Buckets (captured graphs) a BucketBatchSampler keeps at most: at WMT14 lengths (benchmarks/bench_utils.wmt_lengths,
# 25k-token batches) 48 left the real share of target tokens at 0.90 (0.899 / 0.901 for two seeds), 64 gives 0.91.
DEFAULT_MAX_BUCKETS = 64


class BucketBatch(NamedTuple):
    """Pair indices padded to `shape`; rows past len(indices) are filler rows that carry no target token."""

    indices: list[int]
    shape: BucketShape


def bucket_length_grid(longest: int, growth: float = 1.1, step: int = 2) -> list[int]:
    """The padded lengths buckets use, up to the first one >= longest: fine for short sentences and coarse for long
    ones, each at most `growth` times the one before (and `step` longer), so that rounding a length up to the grid
    pads it by under (growth - 1) of its length (step / length for short ones)."""
    if longest < 1:
        raise ValueError(f"longest must be >= 1, got {longest}")
    if growth <= 1.0 or step < 1:
        raise ValueError(f"need growth > 1 and step >= 1, got growth={growth}, step={step}")
    grid = [step]
    while grid[-1] < longest:
        grid.append(max(grid[-1] + step, int(grid[-1] * growth) // step * step))
    return grid


class BucketBatchSampler:
    """Batches of static shapes for captured (CUDA-graph) training steps: every batch has one of a small fixed set of
    shapes (`buckets`), (sentences, src_len, tgt_len), so that one graph per shape serves every step.

    A pair belongs to the grid cell of its two lengths rounded up to `grid` (bucket_length_grid by default); a cell's
    batches hold max_tokens // max(src_len, tgt_len) sentences, the same budget as TokenBatchSampler's. The cells
    that the corpus occupies are the buckets, fixed for the sampler's life. Every epoch shuffles the pairs (seeded by
    seed and epoch) and cuts each cell into full batches; the few pairs left over in a cell move on to its nearest
    larger occupied cell, and only a cell with none larger pads its last batch with filler rows. Batch order is then
    shuffled, and every rank takes every world_size-th batch (filler-only batches even the count out), so ranks are
    disjoint, together cover every pair exactly once per epoch, and all take the same number of steps.
    """

    def __init__(self, src_lengths: torch.Tensor, tgt_lengths: torch.Tensor, max_tokens: int, seed: int = 0,
                 rank: int = 0, world_size: int = 1, grid: list[int] | None = None,
                 max_buckets: int = DEFAULT_MAX_BUCKETS) -> None:
        _check_sampler_arguments(src_lengths, tgt_lengths, rank, world_size)
        self.src_lengths = src_lengths.tolist()
        self.tgt_lengths = tgt_lengths.tolist()
        longest = max(max(self.src_lengths), max(self.tgt_lengths))
        self.grid = bucket_length_grid(longest) if grid is None else sorted(grid)
        if self.grid[-1] < longest:
            raise ValueError(f"the bucket grid ends at {self.grid[-1]}, below the longest sequence ({longest} tokens)")
        if max_tokens < self.grid[bisect.bisect_left(self.grid, longest)]:
            raise ValueError(f"max_tokens={max_tokens} is below the longest sequence ({longest} tokens) rounded up to "
                             f"the bucket grid")
        self.max_tokens = max_tokens
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.cells = [(bisect.bisect_left(self.grid, s), bisect.bisect_left(self.grid, t))
                      for s, t in zip(self.src_lengths, self.tgt_lengths)]
        # Leftovers flow to a dominating cell, which comes later in this order (its index sum is larger).
        occupied = sorted(set(self.cells), key=lambda cell: (cell[0] + cell[1], cell))
        merged_into = self._merge_cells(occupied, collections.Counter(self.cells), max_buckets)
        self.cells = [merged_into.get(cell, cell) for cell in self.cells]
        self._order = occupied
        self._shapes = {cell: self._shape(cell) for cell in occupied}
        self._successor = {cell: self._nearest_larger(cell, occupied) for cell in occupied}

    @property
    def buckets(self) -> list[BucketShape]:
        """Every shape a batch of this sampler can have, smallest lengths first."""
        return list(self._shapes.values())

    def _shape(self, cell: tuple[int, int]) -> BucketShape:
        src_len, tgt_len = self.grid[cell[0]], self.grid[cell[1]]
        return BucketShape(self.max_tokens // max(src_len, tgt_len), src_len, tgt_len)

    def _merge_cells(self, occupied: list[tuple[int, int]], counts: collections.Counter,
                     max_buckets: int) -> dict[tuple[int, int], tuple[int, int]]:
        """Merges cells into their nearest larger ones until at most max_buckets are left (one captured graph is kept
        per bucket), cheapest first: the cost of a merge is the padding it adds, (src_len + tgt_len) grown times the
        pairs moved. Removes the merged cells from `occupied` -> where each merged cell's pairs went."""
        def padded(cell: tuple[int, int]) -> int:
            return self.grid[cell[0]] + self.grid[cell[1]]

        target = {cell: self._nearest_larger(cell, occupied) for cell in occupied}
        merged_into: dict[tuple[int, int], tuple[int, int]] = {}
        while len(occupied) > max_buckets:
            movable = [cell for cell in occupied if target[cell] is not None]
            if not movable:
                break
            cell = min(movable, key=lambda c: (counts[c] * (padded(target[c]) - padded(c)), c))
            into = target[cell]
            occupied.remove(cell)
            counts[into] += counts.pop(cell)
            merged_into[cell] = into
            for other in occupied:
                if target[other] == cell:
                    target[other] = self._nearest_larger(other, occupied)
        # A chain c -> d -> e sends c's pairs to e.
        for cell in merged_into:
            while merged_into[cell] in merged_into:
                merged_into[cell] = merged_into[merged_into[cell]]
        return merged_into

    def _nearest_larger(self, cell: tuple[int, int], occupied: list[tuple[int, int]]) -> tuple[int, int] | None:
        """The occupied cell other than `cell` that holds both its lengths with the least padding, if any."""
        larger = [other for other in occupied if other != cell and other[0] >= cell[0] and other[1] >= cell[1]]
        if not larger:
            return None
        return min(larger, key=lambda other: (self.grid[other[0]] + self.grid[other[1]], other))

    def all_batches(self, epoch: int) -> list[BucketBatch]:
        """Every rank's batches of `epoch`, in order; this rank's are [rank::world_size]."""
        rng = random.Random(f"{self.seed}:{epoch}")
        order = list(range(len(self.src_lengths)))
        rng.shuffle(order)
        members: dict[tuple[int, int], list[int]] = {cell: [] for cell in self._order}
        for i in order:
            members[self.cells[i]].append(i)
        batches: list[BucketBatch] = []
        for cell in self._order:
            shape = self._shapes[cell]
            pool = members[cell]
            full = len(pool) - len(pool) % shape.sentences
            batches += [BucketBatch(pool[start:start + shape.sentences], shape)
                        for start in range(0, full, shape.sentences)]
            leftover = pool[full:]
            if leftover:
                successor = self._successor[cell]
                if successor is None:
                    batches.append(BucketBatch(leftover, shape))
                else:
                    # In front of the successor's own pairs, so that they fill its full batches, not its leftovers.
                    members[successor][:0] = leftover
        rng.shuffle(batches)
        smallest = min(self._shapes.values(), key=lambda shape: shape.sentences * max(shape[1:]))
        batches += [BucketBatch([], smallest)] * (-len(batches) % self.world_size)
        return batches

    def batches(self, epoch: int) -> list[BucketBatch]:
        """This rank's batches of `epoch`."""
        return self.all_batches(epoch)[self.rank::self.world_size]


def _check_sampler_arguments(src_lengths: torch.Tensor, tgt_lengths: torch.Tensor, rank: int,
                             world_size: int) -> None:
    if src_lengths.shape != tgt_lengths.shape or src_lengths.dim() != 1:
        raise ValueError(f"src_lengths and tgt_lengths must be equal-length 1-D tensors, got "
                         f"{tuple(src_lengths.shape)} and {tuple(tgt_lengths.shape)}")
    if not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if len(src_lengths) < world_size:
        raise ValueError(f"{len(src_lengths)} sentence pairs cannot fill a batch on each of {world_size} ranks")
    if len(src_lengths) and min(int(src_lengths.min()), int(tgt_lengths.min())) < 1:
        raise ValueError("every sequence needs at least 1 token (sources end in EOS, targets start with BOS)")
