"""fastformer.data: strict readers, split lookup, the length filter, collation, and token-budget batching."""

from __future__ import annotations

import gzip
import math
import random
from pathlib import Path

import pytest
import torch

from fastformer.data import (BOS_ID, BUNDLED_CORPUS, EOS_ID, PAD_ID, BucketBatch, BucketBatchSampler, BucketShape,
                             LengthFilter, TokenBatchSampler, TokenizedCorpus, Tokenizer, bucket_length_grid,
                             decode_sentences, find_split, read_lines, read_parallel, token_budget_batches,
                             train_tokenizer)
from fastformer.data import make_corpus
from fastformer.data.batching import DEFAULT_MAX_BUCKETS


@pytest.fixture(scope="module")
def bundled_pairs() -> list[tuple[str, str]]:
    files = find_split(None, "train")
    return read_parallel(files.src, files.tgt)


@pytest.fixture(scope="module")
def tokenizer(bundled_pairs) -> Tokenizer:
    return train_tokenizer((sentence for pair in bundled_pairs for sentence in pair), vocab_size=200)


@pytest.fixture(scope="module")
def corpus(tokenizer, bundled_pairs) -> TokenizedCorpus:
    return TokenizedCorpus.encode(tokenizer, bundled_pairs, LengthFilter())


# --- reading ---------------------------------------------------------------------------------------------------------

def test_read_lines_returns_the_lines_without_line_ends(tmp_path: Path):
    path = tmp_path / "a.en"
    path.write_bytes("Hello world.\r\nÄpfel und Birnen.\nlast line without newline".encode())
    assert read_lines(path) == ["Hello world.", "Äpfel und Birnen.", "last line without newline"]


def test_a_byte_order_mark_is_no_part_of_the_first_sentence(tmp_path: Path):
    """Training text, BLEU references and sentences to translate are read alike: without a leading BOM."""
    path = tmp_path / "valid.de"
    path.write_bytes("\ufeffEin Satz.\nZwei.\n".encode())
    assert read_lines(path) == ["Ein Satz.", "Zwei."]
    assert decode_sentences(path.read_bytes().splitlines(keepends=True), "stdin") == ["Ein Satz.", "Zwei."]
    path.write_bytes("\ufeff\n".encode())
    with pytest.raises(ValueError, match=rf"{path}:1: empty line"):
        read_lines(path)


def test_missing_file_names_the_path(tmp_path: Path):
    missing = tmp_path / "nowhere" / "train.en"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        read_lines(missing)


@pytest.mark.parametrize("content, line", [(b"one\n\ntwo\n", 2), (b"one\n   \n", 2), (b"one\ntwo\n\n", 3)])
def test_empty_line_is_an_error_naming_file_and_line(tmp_path: Path, content: bytes, line: int):
    path = tmp_path / "train.de"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"{path}:{line}: empty line"):
        read_lines(path)


def test_non_utf8_line_is_an_error_naming_file_and_line(tmp_path: Path):
    path = tmp_path / "train.de"
    path.write_bytes("gut\n".encode() + "Gr\u00fc\u00dfe\n".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"{path}:2: not valid UTF-8"):
        read_lines(path)


def test_sentences_to_translate_keep_empty_lines_and_name_a_non_utf8_one():
    raw = [b"Hello.\n", b"\n", b"  \r\n", "Gr\u00fc\u00dfe.".encode()]
    assert decode_sentences(raw, "stdin") == ["Hello.", "", "  ", "Gr\u00fc\u00dfe."]
    with pytest.raises(ValueError, match=r"^stdin:2: not valid UTF-8"):
        decode_sentences([b"ok\n", "Gr\u00fc\u00dfe\n".encode("latin-1")], "stdin")


def test_mismatched_line_counts_name_both_files(tmp_path: Path):
    src, tgt = tmp_path / "train.en", tmp_path / "train.de"
    src.write_text("a b c\nd e f\n", encoding="utf-8")
    tgt.write_text("a b c\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{src} has 2 lines but {tgt} has 1"):
        read_parallel(src, tgt)


def test_find_split_plain_names_aliases_and_sacrebleu_layout(tmp_path: Path):
    for name in ("train.en", "train.de", "newstest2013.en", "newstest2013.de"):
        (tmp_path / name).write_text("x\n", encoding="utf-8")
    cache = tmp_path / "wmt14"
    cache.mkdir()
    for name in ("wmt14.en-de.src", "wmt14.en-de.ref"):
        (cache / name).write_text("x\n", encoding="utf-8")
    assert find_split(tmp_path, "train").src == tmp_path / "train.en"
    assert find_split(tmp_path, "valid").tgt == tmp_path / "newstest2013.de"
    assert find_split(tmp_path, "test").src == cache / "wmt14.en-de.src"
    assert find_split(tmp_path, "test").tgt == cache / "wmt14.en-de.ref"


def test_find_split_takes_each_side_gzipped_or_not_and_names_a_missing_side(tmp_path: Path):
    (tmp_path / "train.en").write_text("a house\nthe dog\n", encoding="utf-8")
    with gzip.open(tmp_path / "train.de.gz", "wt", encoding="utf-8") as file:
        file.write("ein Haus\nder Hund\n")
    files = find_split(tmp_path, "train")
    assert (files.src, files.tgt) == (tmp_path / "train.en", tmp_path / "train.de.gz")
    assert read_parallel(files.src, files.tgt) == [("a house", "ein Haus"), ("the dog", "der Hund")]
    (tmp_path / "valid.en").write_text("x\n", encoding="utf-8")
    with pytest.raises(FileNotFoundError, match=r"^no valid split in .+: valid\.en is there, but neither valid\.de "
                                                r"nor valid\.de\.gz$"):
        find_split(tmp_path, "valid")


def test_find_split_names_what_it_looked_for(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="newstest2014.en"):
        find_split(tmp_path, "test")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "absent")):
        find_split(tmp_path / "absent", "train")
    with pytest.raises(ValueError, match="split must be one of"):
        find_split(tmp_path, "dev")


def test_bundled_corpus_is_what_the_generator_makes():
    """The shipped files are make_corpus's output for its default seed, and the splits share no source sentence."""
    splits = make_corpus.generate(2017)
    for split, pairs in splits.items():
        files = find_split(None, split)
        assert files.src.parent == BUNDLED_CORPUS
        assert read_parallel(files.src, files.tgt) == pairs
        assert len(pairs) == make_corpus.SPLITS[split]
    sources = [set(english for english, _ in pairs) for pairs in splits.values()]
    assert sum(map(len, sources)) == len(set().union(*sources))


# --- tokenizer and corpus --------------------------------------------------------------------------------------------

def test_tokenizer_round_trips_and_has_the_model_special_ids(tokenizer, bundled_pairs):
    sentences = [pair[1] for pair in bundled_pairs[:50]]
    ids = tokenizer.encode(sentences)
    assert tokenizer.decode(ids) == sentences
    assert all(id_ not in (PAD_ID, BOS_ID, EOS_ID) for sentence in ids for id_ in sentence)
    assert tokenizer.vocab_size == 200
    assert Tokenizer(tokenizer.model_proto).encode(sentences) == ids


def test_corpus_and_tokenizer_share_one_set_of_special_ids(corpus, tokenizer):
    assert tokenizer.special_ids == {"pad_id": PAD_ID, "bos_id": BOS_ID, "eos_id": EOS_ID}
    assert (corpus.pad_id, corpus.bos_id, corpus.eos_id) == (PAD_ID, BOS_ID, EOS_ID)


def test_the_same_corpus_gives_the_same_tokenizer_bytes_on_any_core_count(bundled_pairs, monkeypatch):
    """The model file records its training's thread count: a fixed one, so another machine's vocabulary is this
    one's byte for byte (a resumed run compares them)."""
    sentences = [sentence for pair in bundled_pairs[:500] for sentence in pair]
    made = []
    for cores in (2, 64):
        monkeypatch.setattr("os.cpu_count", lambda: cores)
        made.append(train_tokenizer(sentences, vocab_size=150).model_proto)
    assert made[0] == made[1]


def test_tokenizer_rejects_a_file_that_is_no_sentencepiece_model(tmp_path: Path):
    path = tmp_path / "spm.model"
    path.write_bytes(b"not a model")
    with pytest.raises(ValueError, match=str(path)):
        Tokenizer.load(path)


def test_length_filter_bounds_and_ratio():
    keep = LengthFilter(min_len=3, max_len=10, max_ratio=2.0).keeps
    assert keep(3, 3) and keep(10, 5) and keep(5, 10)
    assert not keep(2, 3) and not keep(3, 11) and not keep(11, 11) and not keep(3, 7)
    with pytest.raises(ValueError, match="max_ratio"):
        LengthFilter(max_ratio=0.5)


def test_collate_shifts_targets_and_right_pads(corpus, tokenizer, bundled_pairs):
    kept = [pair for pair in bundled_pairs
            if LengthFilter().keeps(*(len(ids) for ids in tokenizer.encode(list(pair))))]
    indices = [5, 0, 17]
    src, tgt_in, tgt_out = corpus.collate(indices)
    for row, index in enumerate(indices):
        source_ids, target_ids = tokenizer.encode(list(kept[index]))
        n, m = len(source_ids), len(target_ids)
        assert src[row, :n + 1].tolist() == source_ids + [EOS_ID]
        assert tgt_in[row, :m + 1].tolist() == [BOS_ID] + target_ids
        assert tgt_out[row, :m + 1].tolist() == target_ids + [EOS_ID]
        assert (src[row, n + 1:] == PAD_ID).all() and (tgt_in[row, m + 1:] == PAD_ID).all()
        assert (tgt_out[row, m + 1:] == PAD_ID).all()
        assert corpus.src_lengths[index] == n + 1 and corpus.tgt_lengths[index] == m + 1
    assert src.dtype == tgt_in.dtype == tgt_out.dtype == torch.int64


# --- batching --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("max_tokens", [200, 1000])
def test_every_pair_once_per_epoch_across_ranks_within_budget(corpus, world_size: int, max_tokens: int):
    src_lengths, tgt_lengths = corpus.src_lengths, corpus.tgt_lengths
    samplers = [TokenBatchSampler(src_lengths, tgt_lengths, max_tokens, seed=7, rank=rank, world_size=world_size)
                for rank in range(world_size)]
    for epoch in (0, 1):
        per_rank = [sampler.batches(epoch) for sampler in samplers]
        assert len({len(batches) for batches in per_rank}) == 1, "ranks must step in lockstep"
        seen = sorted(i for batches in per_rank for batch in batches for i in batch)
        assert seen == list(range(len(corpus)))
        for batches in per_rank:
            for batch in batches:
                longest = max(max(src_lengths[batch].tolist()), max(tgt_lengths[batch].tolist()))
                assert len(batch) * longest <= max_tokens


def test_padding_is_bounded(corpus):
    """Length bucketing: the padded batches hold under 20% more tokens than the sentences on each side (batches of
    randomly chosen pairs would hold about twice as many on this corpus)."""
    src_lengths, tgt_lengths = corpus.src_lengths, corpus.tgt_lengths
    batches = TokenBatchSampler(src_lengths, tgt_lengths, 1000, seed=3).batches(0)
    for lengths in (src_lengths, tgt_lengths):
        padded = sum(len(batch) * int(lengths[batch].max()) for batch in batches)
        assert padded <= 1.2 * int(lengths.sum())
    shuffled = list(range(len(corpus)))
    random.Random(0).shuffle(shuffled)
    sizes = [len(batch) for batch in batches]
    random_batches, start = [], 0
    for size in sizes:
        random_batches.append(shuffled[start:start + size])
        start += size
    padded_random = sum(len(batch) * int(tgt_lengths[batch].max()) for batch in random_batches)
    padded = sum(len(batch) * int(tgt_lengths[batch].max()) for batch in batches)
    assert padded < padded_random


def test_epochs_are_reshuffled_and_seeded(corpus):
    sampler = TokenBatchSampler(corpus.src_lengths, corpus.tgt_lengths, 1000, seed=1)
    again = TokenBatchSampler(corpus.src_lengths, corpus.tgt_lengths, 1000, seed=1)
    other_seed = TokenBatchSampler(corpus.src_lengths, corpus.tgt_lengths, 1000, seed=2)
    assert _lists(sampler.batches(0)) == _lists(again.batches(0))
    assert _lists(sampler.batches(0)) != _lists(sampler.batches(1))
    assert _lists(sampler.batches(0)) != _lists(other_seed.batches(0))


def _lists(batches: list) -> list:
    """Batches (index arrays, or BucketBatch) as plain lists, to compare."""
    return [(batch.indices.tolist(), batch.shape) if isinstance(batch, BucketBatch) else batch.tolist()
            for batch in batches]


def test_batch_count_is_evened_out_over_ranks():
    lengths = torch.full((7,), 4)
    samplers = [TokenBatchSampler(lengths, lengths, 8, rank=rank, world_size=3) for rank in range(3)]
    batches = [sampler.batches(0) for sampler in samplers]
    assert [len(b) for b in batches] == [len(batches[0])] * 3
    assert sorted(i for rank in batches for batch in rank for i in batch) == list(range(7))


def test_sampler_rejects_what_it_cannot_batch():
    lengths = torch.tensor([3, 9, 4])
    with pytest.raises(ValueError, match="longest sequence"):
        TokenBatchSampler(lengths, lengths, 8)
    with pytest.raises(ValueError, match="each of 4 ranks"):
        TokenBatchSampler(lengths, lengths, 64, rank=0, world_size=4)
    with pytest.raises(ValueError, match="rank"):
        TokenBatchSampler(lengths, lengths, 64, rank=2, world_size=2)
    with pytest.raises(ValueError, match="single-pair batches"):
        TokenBatchSampler(lengths[:1].repeat(3), lengths[:1].repeat(3), 3, rank=0, world_size=2).batches(0)


@pytest.mark.parametrize("max_tokens", [1, 7, 20, 64])
def test_token_budget_batches_are_the_greedy_maximal_runs(max_tokens: int):
    """Against a brute-force oracle: consecutive runs of the order, each as long as the budget allows (the next item
    would break it), an oversized item alone."""
    generator = random.Random(max_tokens)
    sizes = [generator.randint(1, 12) for _ in range(60)]
    order = sorted(range(60), key=lambda i: (sizes[i], i))
    batches = token_budget_batches(order, sizes, max_tokens)
    assert [i for batch in batches for i in batch] == order
    position = 0
    for batch in _lists(batches):
        length = 1
        while (position + length < len(order)
               and (length + 1) * max(sizes[i] for i in order[position:position + length + 1]) <= max_tokens):
            length += 1
        assert batch == order[position:position + length]
        position += length


# --- static-shape (bucketed) batching ---------------------------------------------------------------------------------

def wmt14_like_lengths(pairs: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A length model of WMT14 en-de under a ~37k shared BPE (no network here, so no real corpus): source lengths
    log-normal with median 23 and log-sd 0.62 (mean ~29 subwords, a long right tail), target = source x a log-normal
    ratio with median 1.08 and log-sd 0.18 (German runs ~10% longer); then the usual filter (1..250 tokens, ratio
    <= 2) and EOS/BOS added, as TokenizedCorpus counts them -> (src_lengths, tgt_lengths) [pairs]."""
    generator = torch.Generator().manual_seed(seed)
    src = torch.exp(torch.randn(2 * pairs, generator=generator, dtype=torch.float64) * 0.62 + math.log(23.0))
    ratio = torch.exp(torch.randn(2 * pairs, generator=generator, dtype=torch.float64) * 0.18 + math.log(1.08))
    src_lengths, tgt_lengths = src.round().long(), (src * ratio).round().long()
    longer, shorter = torch.maximum(src_lengths, tgt_lengths), torch.minimum(src_lengths, tgt_lengths)
    kept = (shorter >= 1) & (longer <= 250) & (longer <= 2 * shorter)
    return src_lengths[kept][:pairs] + 1, tgt_lengths[kept][:pairs] + 1


@pytest.fixture(scope="module")
def wmt_lengths() -> tuple[torch.Tensor, torch.Tensor]:
    return wmt14_like_lengths(200_000)


def _real_token_ratios(batches, src_lengths: torch.Tensor, tgt_lengths: torch.Tensor) -> tuple[float, float]:
    """Real tokens over the tokens of the padded batch shapes, on the source and on the target side."""
    indices = [i for batch in batches for i in batch.indices]
    src_padded = sum(batch.shape.sentences * batch.shape.src_len for batch in batches)
    tgt_padded = sum(batch.shape.sentences * batch.shape.tgt_len for batch in batches)
    return int(src_lengths[indices].sum()) / src_padded, int(tgt_lengths[indices].sum()) / tgt_padded


def _check_bucket_batches(batches, sampler: BucketBatchSampler, src_lengths, tgt_lengths, max_tokens: int) -> None:
    """Each batch fits its shape, the shape is one of the sampler's fixed buckets and within the token budget."""
    buckets = set(sampler.buckets)
    for batch in batches:
        assert batch.shape in buckets
        assert len(batch.indices) <= batch.shape.sentences
        assert batch.shape.sentences * max(batch.shape.src_len, batch.shape.tgt_len) <= max_tokens
        if len(batch.indices):
            assert int(src_lengths[batch.indices].max()) <= batch.shape.src_len
            assert int(tgt_lengths[batch.indices].max()) <= batch.shape.tgt_len


@pytest.mark.parametrize("max_tokens", [4096, 8192])
def test_buckets_hold_over_90_percent_real_tokens_at_wmt14_lengths(wmt_lengths, max_tokens: int):
    """200k pairs of the WMT14-like length model: every pair exactly once, at most DEFAULT_MAX_BUCKETS distinct
    shapes, and over 90% of the tokens real on each side (the token-budget sampler's batches, of free shapes, are
    the comparison)."""
    src_lengths, tgt_lengths = wmt_lengths
    assert 27 < float(src_lengths.float().mean()) < 31 and int(torch.maximum(src_lengths, tgt_lengths).max()) > 200
    sampler = BucketBatchSampler(src_lengths, tgt_lengths, max_tokens, seed=5)
    batches = sampler.batches(0)
    assert sorted(i for batch in batches for i in batch.indices) == list(range(len(src_lengths)))
    _check_bucket_batches(batches, sampler, src_lengths, tgt_lengths, max_tokens)
    assert len(sampler.buckets) <= DEFAULT_MAX_BUCKETS
    assert len({batch.shape for batch in batches}) <= DEFAULT_MAX_BUCKETS
    src_ratio, tgt_ratio = _real_token_ratios(batches, src_lengths, tgt_lengths)
    assert src_ratio >= 0.90 and tgt_ratio >= 0.90, (src_ratio, tgt_ratio)
    # Random batches of the same shapes would be mostly padding: the grouping by length is what pays.
    shuffled = torch.randperm(len(src_lengths), generator=torch.Generator().manual_seed(0)).tolist()
    position, random_src_padded = 0, 0
    for batch in batches:
        chunk = shuffled[position:position + len(batch.indices)]
        position += len(chunk)
        random_src_padded += batch.shape.sentences * int(src_lengths[chunk].max()) if chunk else 0
    assert int(src_lengths.sum()) / random_src_padded < 0.5


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("max_tokens", [200, 1000])
def test_buckets_cover_every_pair_once_per_epoch_across_ranks(corpus, world_size: int, max_tokens: int):
    src_lengths, tgt_lengths = corpus.src_lengths, corpus.tgt_lengths
    samplers = [BucketBatchSampler(src_lengths, tgt_lengths, max_tokens, seed=7, rank=rank, world_size=world_size)
                for rank in range(world_size)]
    assert all(sampler.buckets == samplers[0].buckets for sampler in samplers)
    for epoch in (0, 1):
        per_rank = [sampler.batches(epoch) for sampler in samplers]
        assert len({len(batches) for batches in per_rank}) == 1, "ranks must step in lockstep"
        seen = sorted(i for batches in per_rank for batch in batches for i in batch.indices)
        assert seen == list(range(len(corpus)))
        for sampler, batches in zip(samplers, per_rank):
            _check_bucket_batches(batches, sampler, src_lengths, tgt_lengths, max_tokens)
    src_ratio, tgt_ratio = _real_token_ratios(samplers[0].all_batches(0), src_lengths, tgt_lengths)
    assert src_ratio >= 0.90 and tgt_ratio >= 0.90, (src_ratio, tgt_ratio)


def test_bucket_order_is_seeded_reshuffled_and_resumable(corpus):
    """The batches of an epoch are a function of (lengths, seed, epoch) alone: a sampler built anew (a resumed run)
    continues an epoch from any index with exactly the batches the first one had left."""
    make = lambda seed: BucketBatchSampler(corpus.src_lengths, corpus.tgt_lengths, 1000, seed=seed)  # noqa: E731
    sampler = make(1)
    epoch0 = sampler.batches(0)
    assert _lists(make(1).batches(0)[17:]) == _lists(epoch0[17:])
    assert _lists(sampler.batches(1)) != _lists(epoch0) and _lists(make(2).batches(0)) != _lists(epoch0)
    assert sorted(i for batch in sampler.batches(1) for i in batch.indices) == list(range(len(corpus)))


def test_leftovers_move_to_a_larger_bucket_and_only_the_largest_gets_filler_rows():
    """Two cells: 5 short pairs (batches of 4) and 8 long ones (batches of 2). The short cell's fifth pair joins the
    long cell, whose odd one out is padded with a filler row; on 4 ranks, filler-only batches even the count out."""
    src = torch.tensor([4] * 5 + [8] * 8)
    sampler = BucketBatchSampler(src, src, 16, grid=[4, 8])
    assert sampler.buckets == [BucketShape(4, 4, 4), BucketShape(2, 8, 8)]
    batches = sampler.all_batches(0)
    sizes = sorted((batch.shape.sentences, len(batch.indices)) for batch in batches)
    assert sizes == [(2, 1)] + [(2, 2)] * 4 + [(4, 4)]
    assert sorted(i for batch in batches for i in batch.indices) == list(range(13))
    four_ranks = BucketBatchSampler(src, src, 16, grid=[4, 8], world_size=4).all_batches(0)
    assert len(four_ranks) == 8 and [len(batch.indices) for batch in four_ranks[6:]] == [0, 0]
    assert sorted(i for batch in four_ranks for i in batch.indices) == list(range(13))


def test_rare_cells_merge_until_at_most_max_buckets(wmt_lengths):
    src_lengths, tgt_lengths = (lengths[:20_000] for lengths in wmt_lengths)
    for max_buckets in (8, 20):
        sampler = BucketBatchSampler(src_lengths, tgt_lengths, 4096, max_buckets=max_buckets)
        assert len(sampler.buckets) == max_buckets
        batches = sampler.batches(0)
        assert sorted(i for batch in batches for i in batch.indices) == list(range(20_000))
        _check_bucket_batches(batches, sampler, src_lengths, tgt_lengths, 4096)


def test_bucket_length_grid_is_fine_then_geometric():
    grid = bucket_length_grid(250)
    assert grid[0] == 2 and grid[-1] >= 250 > grid[-2]
    steps = [b - a for a, b in zip(grid, grid[1:])]
    assert all(step >= 2 and step % 2 == 0 for step in steps)
    assert all(b <= 1.1 * a + 2 for a, b in zip(grid, grid[1:]))
    assert steps[0] == 2 and steps[-1] > 16, "fine at short lengths, coarse at long ones"


def test_bucket_sampler_rejects_what_it_cannot_batch():
    lengths = torch.tensor([3, 9, 4])
    with pytest.raises(ValueError, match="below the longest sequence"):
        BucketBatchSampler(lengths, lengths, 8)
    with pytest.raises(ValueError, match="grid ends at 8"):
        BucketBatchSampler(lengths, lengths, 64, grid=[4, 8])
    with pytest.raises(ValueError, match="each of 4 ranks"):
        BucketBatchSampler(lengths, lengths, 64, world_size=4)
    with pytest.raises(ValueError, match="at least 1 token"):
        BucketBatchSampler(torch.tensor([3, 0]), torch.tensor([3, 3]), 64)


def test_batch_to_a_bucket_pads_adds_filler_rows_and_checks_ids_on_the_cpu(corpus):
    indices = [3, 11]
    shape = BucketShape(4, int(corpus.src_lengths[indices].max()) + 3, int(corpus.tgt_lengths[indices].max()) + 2)
    batch = corpus.batch(indices, vocab_size=200, shape=shape)
    plain = corpus.collate(indices)
    for padded, part, width in zip(batch[:3], plain, (shape.src_len, shape.tgt_len, shape.tgt_len)):
        assert padded.shape == (4, width) and padded.dtype == torch.int64
        assert torch.equal(padded[:2, :part.shape[1]], part) and (padded[:2, part.shape[1]:] == PAD_ID).all()
    assert batch.src[2:, 0].tolist() == [EOS_ID] * 2 and (batch.src[2:, 1:] == PAD_ID).all()
    assert batch.tgt_in[2:, 0].tolist() == [BOS_ID] * 2 and (batch.tgt_out[2:] == PAD_ID).all()
    assert batch.src_lengths.tolist() == (batch.src != PAD_ID).sum(1).tolist()
    assert batch.tgt_lengths.tolist() == (batch.tgt_in != PAD_ID).sum(1).tolist()
    assert batch.target_tokens == int((batch.tgt_out != PAD_ID).sum())
    unpadded = corpus.batch(indices, vocab_size=200)
    assert all(torch.equal(a, b) for a, b in zip(unpadded[:3], plain))
    with pytest.raises(ValueError, match=r"ids outside \[0, vocab_size=50\)"):
        corpus.batch(indices, vocab_size=50)
    with pytest.raises(ValueError, match="exceeds the bucket"):
        corpus.batch(indices, vocab_size=200, shape=BucketShape(4, 2, 64))
    with pytest.raises(ValueError, match="do not fit the bucket"):
        corpus.batch([1, 2, 3], vocab_size=200, shape=BucketShape(2, 64, 64))
