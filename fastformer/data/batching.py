"""Tokenized corpora, the length filter, and the paper's token-budget batching, sharded across ranks."""

from __future__ import annotations

import array
import bisect
import collections
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
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

    def keeps(self, src_len: int | np.ndarray, tgt_len: int | np.ndarray) -> bool | np.ndarray:
        """Whether the pair is kept; elementwise on arrays of lengths."""
        longer, shorter = np.maximum(src_len, tgt_len), np.minimum(src_len, tgt_len)
        return (shorter >= self.min_len) & (longer <= self.max_len) & (longer <= self.max_ratio * shorter)


@dataclass(frozen=True)
class TokenArrays:
    """One side of a tokenized corpus: every sentence's ids concatenated, in memory or memory-mapped."""

    ids: np.ndarray  # [total] uint16 or int32: the bare ids, no BOS/EOS
    offsets: np.ndarray  # [n + 1] int64: sentence i is ids[offsets[i]:offsets[i + 1]]
    lengths: np.ndarray  # [n] int32: sentence lengths plus 1 (the EOS a source ends in, the BOS of tgt_in)

    @classmethod
    def from_lists(cls, sequences: list[list[int]]) -> TokenArrays:
        lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
        offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = np.fromiter(itertools.chain.from_iterable(sequences), dtype=np.int32, count=int(offsets[-1]))
        return cls(ids, offsets, (lengths + 1).astype(np.int32))

    def rows(self, indices: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        return [self.ids[self.offsets[i]:self.offsets[i + 1]] for i in indices]


class TokenizedCorpus:
    """Sentence pairs as flat id arrays with offsets (TokenArrays): a WMT-sized corpus as Python lists would take
    gigabytes, and a prepared corpus (fastformer.data.prepared) is mapped from disk, shared by every rank.

    Sources get EOS, targets BOS/EOS in `collate`. The special ids are the tokenizer's (`Tokenizer.special_ids`).
    """

    def __init__(self, src: TokenArrays | ConcatenatedSide, tgt: TokenArrays | ConcatenatedSide, pad_id: int,
                 bos_id: int, eos_id: int) -> None:
        if len(src.lengths) != len(tgt.lengths):
            raise ValueError(f"src has {len(src.lengths)} sentences but tgt has {len(tgt.lengths)}")
        self.src, self.tgt = src, tgt
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id

    @classmethod
    def from_lists(cls, src: list[list[int]], tgt: list[list[int]], pad_id: int, bos_id: int,
                   eos_id: int) -> TokenizedCorpus:
        return cls(TokenArrays.from_lists(src), TokenArrays.from_lists(tgt), pad_id, bos_id, eos_id)

    @classmethod
    def encode(cls, tokenizer: Tokenizer, pairs: list[tuple[str, str]],
               length_filter: LengthFilter | None = None) -> TokenizedCorpus:
        """Encodes (source, target) sentences in memory, dropping the pairs length_filter rejects (None keeps all)."""
        src = tokenizer.encode([pair[0] for pair in pairs])
        tgt = tokenizer.encode([pair[1] for pair in pairs])
        if length_filter is not None:
            kept = np.flatnonzero(length_filter.keeps(np.fromiter(map(len, src), np.int64, len(src)),
                                                      np.fromiter(map(len, tgt), np.int64, len(tgt))))
            src, tgt = [src[i] for i in kept], [tgt[i] for i in kept]
        return cls.from_lists(src, tgt, **tokenizer.special_ids)

    def __len__(self) -> int:
        return len(self.src.lengths)

    @property
    def src_lengths(self) -> np.ndarray:
        """[n] int32: source lengths including EOS."""
        return self.src.lengths

    @property
    def tgt_lengths(self) -> np.ndarray:
        """[n] int32: lengths of tgt_in (= of tgt_out): the target plus BOS (or EOS)."""
        return self.tgt.lengths

    def source(self, index: int) -> np.ndarray:
        """The bare source ids of pair `index` (without EOS)."""
        return self.src.ids[self.src.offsets[index]:self.src.offsets[index + 1]]

    def target(self, index: int) -> np.ndarray:
        return self.tgt.ids[self.tgt.offsets[index]:self.tgt.offsets[index + 1]]

    def collate(self, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> src [batch, src_len] (ends in EOS), tgt_in [batch, tgt_len] = [BOS, y], tgt_out = [y, EOS]; all
        right-padded with pad_id, int64."""
        sources, targets = self.src.rows(indices), self.tgt.rows(indices)
        src = self._padded(sources, first=None, last=self.eos_id)
        tgt_in = self._padded(targets, first=self.bos_id, last=None)
        tgt_out = self._padded(targets, first=None, last=self.eos_id)
        return torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out)

    def _padded(self, rows: list[np.ndarray], first: int | None, last: int | None) -> np.ndarray:
        """Each row with `first` before it or `last` after it, right-padded -> [len(rows), longest + 1] int64."""
        out = np.full((len(rows), max(len(row) for row in rows) + 1), self.pad_id, dtype=np.int64)
        begin = 0 if first is None else 1
        for i, row in enumerate(rows):
            out[i, begin:begin + len(row)] = row
            if last is not None:
                out[i, len(row)] = last
        if first is not None:
            out[:, 0] = first
        return out

    def batch(self, indices: Sequence[int] | np.ndarray, vocab_size: int, shape: BucketShape | None = None) -> Batch:
        """`collate(indices)` with its lengths, checked on the CPU so that a training step on a GPU can trust them and
        never wait for a check there. With a shape, every tensor is padded to it; the rows past len(indices) are
        filler: src [EOS], tgt_in [BOS], tgt_out all padding, so they add nothing to a summed loss or its gradient."""
        indices = np.asarray(indices, dtype=np.int64)
        if shape is not None and len(indices) > shape.sentences:
            raise ValueError(f"{len(indices)} sentence pairs do not fit the bucket {shape}")
        src_lengths = torch.from_numpy(self.src_lengths[indices].astype(np.int64))
        tgt_lengths = torch.from_numpy(self.tgt_lengths[indices].astype(np.int64))
        if shape is not None and len(indices) and (int(src_lengths.max()) > shape.src_len
                                                   or int(tgt_lengths.max()) > shape.tgt_len):
            raise ValueError(f"a pair of {int(src_lengths.max())} source / {int(tgt_lengths.max())} target tokens "
                             f"exceeds the bucket {shape}")
        for name, side in (("source", self.src), ("target", self.tgt)):
            rows = side.rows(indices)
            flat = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int32)
            if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= vocab_size):
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

    def _padded_to(self, indices: np.ndarray, shape: BucketShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """collate(indices) padded to shape, with filler rows after the pairs."""
        src = torch.full((shape.sentences, shape.src_len), self.pad_id, dtype=torch.int64)
        tgt_in = torch.full((shape.sentences, shape.tgt_len), self.pad_id, dtype=torch.int64)
        tgt_out = torch.full((shape.sentences, shape.tgt_len), self.pad_id, dtype=torch.int64)
        src[len(indices):, 0] = self.eos_id
        tgt_in[len(indices):, 0] = self.bos_id
        if len(indices):
            collated = self.collate(indices)
            for padded, part in zip((src, tgt_in, tgt_out), collated):
                padded[:len(indices), :part.shape[1]] = part
        return src, tgt_in, tgt_out


class ConcatenatedSide:
    """One side of several corpora in one index space, in place of a TokenArrays (its `lengths` and `rows`): part k
    repeated copies_k times spans copies_k * n_k indices, and its rows start with prefix_k (a tag) when one is given.
    Only `lengths` ([total] int32) is built; rows are read from the parts' own (memory-mapped) arrays."""

    def __init__(self, parts: list[tuple[TokenArrays, int, list[int]]]) -> None:
        self.parts = [(side, np.asarray(prefix, dtype=np.int64)) for side, _, prefix in parts]
        sizes = [len(side.lengths) * copies for side, copies, _ in parts]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.lengths = np.concatenate([np.tile(side.lengths.astype(np.int32) + len(prefix), copies)
                                       for side, copies, prefix in parts])

    def rows(self, indices: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        rows = []
        for index, part in zip(indices, np.searchsorted(self.starts, indices, side="right") - 1):
            side, prefix = self.parts[part]
            local = (index - self.starts[part]) % len(side.lengths)
            row = side.ids[side.offsets[local]:side.offsets[local + 1]]
            rows.append(np.concatenate([prefix, row]) if len(prefix) else row)
        return rows


def mixed_corpus(parts: list[tuple[TokenizedCorpus, int, int | None]]) -> TokenizedCorpus:
    """Corpora sampled together as one: (corpus, times it counts an epoch, a tag id prepended to its sources or
    None). They must share their special ids (one vocabulary)."""
    special = {(corpus.pad_id, corpus.bos_id, corpus.eos_id) for corpus, _, _ in parts}
    if len(special) != 1:
        raise ValueError(f"corpora of different special ids cannot be sampled together: {sorted(special)}")
    source = ConcatenatedSide([(corpus.src, copies, [] if tag is None else [tag]) for corpus, copies, tag in parts])
    target = ConcatenatedSide([(corpus.tgt, copies, []) for corpus, copies, _ in parts])
    pad_id, bos_id, eos_id = special.pop()
    return TokenizedCorpus(source, target, pad_id, bos_id, eos_id)


class Batch(NamedTuple):
    """A collated batch and its lengths, checked on the CPU (TokenizedCorpus.batch)."""

    src: torch.Tensor  # [batch, src_len], ends in EOS
    tgt_in: torch.Tensor  # [batch, tgt_len] = [BOS, y]
    tgt_out: torch.Tensor  # [batch, tgt_len] = [y, EOS]
    src_lengths: torch.Tensor  # [batch] int64
    tgt_lengths: torch.Tensor  # [batch] int64: of tgt_in (tgt_out has as many real tokens, a filler row none)
    target_tokens: int  # real tokens of tgt_out: what a summed loss is divided by


def token_budget_batches(order: Sequence[int] | np.ndarray, sizes: Sequence[int] | np.ndarray,
                         max_tokens: int) -> list[np.ndarray]:
    """The paper's (and fairseq's) grouping: items taken in `order` (sorted by length, so that neighbours pad little)
    into consecutive batches whose padded size, batch size x largest sizes[i], stays within max_tokens. An item
    larger than max_tokens alone gets a batch of its own. -> the batches, views of `order` as an int64 array."""
    order = np.asarray(order, dtype=np.int64)
    ordered_sizes = np.asarray(sizes, dtype=np.int64)[order]
    batches = []
    start = 0
    while start < len(order):
        # A batch starting here holds at most max_tokens // its first size items; within that window the padded
        # size of the first k items, k x their running maximum, grows with k, so the batch is the prefix that fits.
        window = max(1, max_tokens // max(int(ordered_sizes[start]), 1))
        longest = np.maximum.accumulate(ordered_sizes[start:start + window])
        length = max(1, int(np.count_nonzero(longest * np.arange(1, len(longest) + 1) <= max_tokens)))
        batches.append(order[start:start + length])
        start += length
    return batches


def shuffled_range(n: int, rng: random.Random) -> np.ndarray:
    """list(range(n)) shuffled by rng.shuffle, as an int64 array [n]: the same permutation and the same draws from
    rng as shuffling the list, at 8 bytes an item instead of a Python int's 36."""
    order = array.array("q", range(n))
    rng.shuffle(order)
    return np.frombuffer(order, dtype=np.int64)


class TokenBatchSampler:
    """The paper's batching: sentence pairs of similar length grouped so that each batch's padded size
    (batch size x longest sequence) stays within max_tokens on the source and on the target side.

    Every epoch regroups the pairs (ties in length are broken by a seeded shuffle) and shuffles the batch order with
    `seed`; every rank computes the same batch list and takes every world_size-th batch, so ranks are disjoint,
    together cover every pair once, and all get the same number of batches. The lengths may be memory-mapped arrays:
    the sampler holds no per-pair Python objects, and a batch is an int64 array of pair indices.
    """

    def __init__(self, src_lengths: np.ndarray | torch.Tensor, tgt_lengths: np.ndarray | torch.Tensor,
                 max_tokens: int, seed: int = 0, rank: int = 0, world_size: int = 1) -> None:
        self.src_lengths, self.tgt_lengths = _as_array(src_lengths), _as_array(tgt_lengths)
        _check_sampler_arguments(self.src_lengths, self.tgt_lengths, rank, world_size)
        longest = int(np.maximum(self.src_lengths, self.tgt_lengths).max()) if len(self.src_lengths) else 0
        if max_tokens < longest:
            raise ValueError(f"max_tokens={max_tokens} is below the longest sequence ({longest} tokens)")
        self.max_tokens = max_tokens
        self.seed = seed
        self.rank = rank
        self.world_size = world_size

    def all_batches(self, epoch: int) -> list[np.ndarray]:
        """Every rank's batches of `epoch`, in order; this rank's are [rank::world_size]."""
        rng = random.Random(f"{self.seed}:{epoch}")
        order = shuffled_range(len(self.src_lengths), rng)
        src, tgt = self.src_lengths.astype(np.int64), self.tgt_lengths.astype(np.int64)
        # A stable sort keeps the shuffled order among equal (tgt, src) lengths, so batches differ from epoch to epoch.
        order = order[np.argsort(tgt[order] * (int(src.max()) + 1) + src[order], kind="stable")]
        batches = token_budget_batches(order, np.maximum(src, tgt), self.max_tokens)
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

    def batches(self, epoch: int) -> list[np.ndarray]:
        """This rank's batches of `epoch`: int64 arrays of pair indices."""
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

    indices: np.ndarray  # [pairs] int64
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

    def __init__(self, src_lengths: np.ndarray | torch.Tensor, tgt_lengths: np.ndarray | torch.Tensor,
                 max_tokens: int, seed: int = 0, rank: int = 0, world_size: int = 1, grid: list[int] | None = None,
                 max_buckets: int = DEFAULT_MAX_BUCKETS) -> None:
        self.src_lengths, self.tgt_lengths = _as_array(src_lengths), _as_array(tgt_lengths)
        _check_sampler_arguments(self.src_lengths, self.tgt_lengths, rank, world_size)
        longest = max(int(self.src_lengths.max()), int(self.tgt_lengths.max()))
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
        # A pair's cell: its two lengths rounded up to the grid (bisect_left), as src_cell * len(grid) + tgt_cell.
        cell_ids = (np.searchsorted(self.grid, self.src_lengths, side="left").astype(np.int64) * len(self.grid)
                    + np.searchsorted(self.grid, self.tgt_lengths, side="left"))
        ids, counts = np.unique(cell_ids, return_counts=True)
        cells = [divmod(int(cell_id), len(self.grid)) for cell_id in ids]
        # Leftovers flow to a dominating cell, which comes later in this order (its index sum is larger).
        occupied = sorted(cells, key=lambda cell: (cell[0] + cell[1], cell))
        merged_into = self._merge_cells(occupied, collections.Counter(dict(zip(cells, counts.tolist()))),
                                        max_buckets)
        self._order = occupied
        # Each pair's bucket, as its position in self._order.
        position = {cell: index for index, cell in enumerate(occupied)}
        bucket_of_cell = np.array([position[merged_into.get(cell, cell)] for cell in cells], dtype=np.int32)
        self.pair_buckets = bucket_of_cell[np.searchsorted(ids, cell_ids)]
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
        order = shuffled_range(len(self.src_lengths), rng)
        # Each bucket's pairs in shuffled order: a stable sort by bucket keeps it within a bucket.
        grouped = order[np.argsort(self.pair_buckets[order], kind="stable")]
        bounds = np.searchsorted(self.pair_buckets[grouped], np.arange(len(self._order) + 1))
        incoming: dict[tuple[int, int], list[np.ndarray]] = {cell: [] for cell in self._order}
        batches: list[BucketBatch] = []
        for index, cell in enumerate(self._order):
            shape = self._shapes[cell]
            # Leftovers of smaller cells go in front of this cell's own pairs (the latest first), so that they fill
            # its full batches, not its leftovers.
            pool = np.concatenate(incoming[cell][::-1] + [grouped[bounds[index]:bounds[index + 1]]])
            full = len(pool) - len(pool) % shape.sentences
            batches += [BucketBatch(pool[start:start + shape.sentences], shape)
                        for start in range(0, full, shape.sentences)]
            leftover = pool[full:]
            if len(leftover):
                successor = self._successor[cell]
                if successor is None:
                    batches.append(BucketBatch(leftover, shape))
                else:
                    incoming[successor].append(leftover)
        rng.shuffle(batches)
        smallest = min(self._shapes.values(), key=lambda shape: shape.sentences * max(shape[1:]))
        batches += [BucketBatch(np.zeros(0, dtype=np.int64), smallest)] * (-len(batches) % self.world_size)
        return batches

    def batches(self, epoch: int) -> list[BucketBatch]:
        """This rank's batches of `epoch`."""
        return self.all_batches(epoch)[self.rank::self.world_size]


def _as_array(lengths: np.ndarray | torch.Tensor) -> np.ndarray:
    return lengths.numpy() if isinstance(lengths, torch.Tensor) else np.asarray(lengths)


def _check_sampler_arguments(src_lengths: np.ndarray, tgt_lengths: np.ndarray, rank: int, world_size: int) -> None:
    if src_lengths.shape != tgt_lengths.shape or src_lengths.ndim != 1:
        raise ValueError(f"src_lengths and tgt_lengths must be equal-length 1-D tensors, got "
                         f"{tuple(src_lengths.shape)} and {tuple(tgt_lengths.shape)}")
    if not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if len(src_lengths) < world_size:
        raise ValueError(f"{len(src_lengths)} sentence pairs cannot fill a batch on each of {world_size} ranks")
    if len(src_lengths) and min(int(src_lengths.min()), int(tgt_lengths.min())) < 1:
        raise ValueError("every sequence needs at least 1 token (sources end in EOS, targets start with BOS)")
