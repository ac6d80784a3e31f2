"""fastformer.data.prepared: the corpus prepared once on disk, memory-mapped, keyed by its inputs, never
half-written."""

from __future__ import annotations

import errno
import gzip
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fastformer.data import (BUNDLED_CORPUS, BucketBatchSampler, LengthFilter, TokenBatchSampler, TokenizedCorpus,
                             find_split, read_parallel, train_tokenizer)
from fastformer.data import prepared
from fastformer.data.prepared import PreparedCorpus, PrepareSettings, ensure_prepared
from fastformer_process import run

SETTINGS = PrepareSettings(vocab_size=120, length_filter=LengthFilter(3, 30, 2.0))


def _slice(directory: Path, train: int = 400, valid: int = 20, gz: bool = False) -> Path:
    """The first lines of the bundled corpus as train/valid files (gzipped with gz)."""
    directory.mkdir(parents=True)
    for split, size in (("train", train), ("valid", valid)):
        for lang in ("en", "de"):
            text = "".join((BUNDLED_CORPUS / f"{split}.{lang}").read_text(encoding="utf-8")
                           .splitlines(keepends=True)[:size]).encode()
            if gz:
                (directory / f"{split}.{lang}.gz").write_bytes(gzip.compress(text))
            else:
                (directory / f"{split}.{lang}").write_bytes(text)
    return directory


def _visible(directory: Path) -> list[str]:
    """What a user sees in directory: its entries but the preparations' lock files."""
    return sorted(name for name in os.listdir(directory) if not name.endswith(".lock"))


def _files(data_dir: Path) -> dict:
    return {split: find_split(data_dir, split) for split in ("train", "valid")}


def _old_token_batches(src: list[int], tgt: list[int], max_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """The token-budget batches as the list-based sampler made them before the corpus was memory-mapped (one rank):
    the oracle that the array-based sampler must reproduce exactly."""
    rng = random.Random(f"{seed}:{epoch}")
    order = list(range(len(src)))
    rng.shuffle(order)
    order.sort(key=lambda i: (tgt[i], src[i]))
    batches, batch, longest = [], [], 0
    for i in order:
        candidate = max(longest, src[i], tgt[i])
        if batch and (len(batch) + 1) * candidate > max_tokens:
            batches.append(batch)
            batch, candidate = [], max(src[i], tgt[i])
        batch.append(i)
        longest = candidate
    batches.append(batch)
    rng.shuffle(batches)
    return batches


def test_mapped_corpus_gives_the_vocabulary_batches_and_tensors_of_the_in_memory_path(tmp_path: Path):
    """The bundled corpus prepared and mapped: the tokenizer is the one the in-memory path trains, the sampler's
    batches are those of the old list-based sampler for the same seed, and collated batches are identical."""
    files = _files(None)
    settings = PrepareSettings(vocab_size=1000, length_filter=LengthFilter())
    corpus = ensure_prepared(files, settings, tmp_path / "prepared", progress=False)
    pairs = read_parallel(files["train"].src, files["train"].tgt)
    tokenizer = train_tokenizer((sentence for pair in pairs for sentence in pair), vocab_size=1000)
    assert corpus.tokenizer.model_proto == tokenizer.model_proto
    in_memory = TokenizedCorpus.encode(tokenizer, pairs, LengthFilter())
    assert isinstance(corpus.train.src.ids, np.memmap) and corpus.train.src.ids.dtype == np.uint16
    assert len(corpus.train) == len(in_memory) > 17_000
    src, tgt = in_memory.src_lengths.tolist(), in_memory.tgt_lengths.tolist()
    for epoch in (0, 1):
        mapped = TokenBatchSampler(corpus.train.src_lengths, corpus.train.tgt_lengths, 1500, seed=3).batches(epoch)
        assert [batch.tolist() for batch in mapped] == _old_token_batches(src, tgt, 1500, seed=3, epoch=epoch)
        for batch in mapped[:20]:
            for a, b in zip(corpus.train.batch(batch, 1000), in_memory.batch(batch.tolist(), 1000)):
                assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    buckets = [BucketBatchSampler(c.src_lengths, c.tgt_lengths, 1500, seed=3, rank=1, world_size=2).batches(0)
               for c in (corpus.train, in_memory)]
    assert [(b.indices.tolist(), b.shape) for b in buckets[0]] == [(b.indices.tolist(), b.shape) for b in buckets[1]]
    mapped_bucket, memory_bucket = buckets[0][3], buckets[1][3]
    for a, b in zip(corpus.train.batch(mapped_bucket.indices, 1000, mapped_bucket.shape),
                    in_memory.batch(memory_bucket.indices.tolist(), 1000, memory_bucket.shape)):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    for i in (0, 5, len(in_memory) - 1):
        assert corpus.train.source(i).tolist() == in_memory.source(i).tolist()


def test_an_unchanged_corpus_is_opened_and_a_changed_file_is_prepared_anew(tmp_path: Path, monkeypatch, capsys):
    data_dir = _slice(tmp_path / "data")
    path = tmp_path / "prepared"
    first = ensure_prepared(_files(data_dir), SETTINGS, path, progress=False)
    made = []
    real_prepare = prepared.prepare
    monkeypatch.setattr(prepared, "prepare", lambda *args, **kwargs: made.append(args) or real_prepare(*args, **kwargs))
    again = ensure_prepared(_files(data_dir), SETTINGS, path, progress=False)
    assert made == [] and again.digest == first.digest and len(again.train) == len(first.train)
    with (data_dir / "train.de").open("a", encoding="utf-8") as file, (data_dir / "train.en").open("a") as other:
        file.write("Der Hund ist sehr alt.\n")
        other.write("The dog is very old.\n")
    changed = ensure_prepared(_files(data_dir), SETTINGS, path, progress=False)
    assert len(made) == 1 and changed.digest != first.digest
    assert f"preparing {path} anew: {data_dir.resolve() / 'train.en'} changed" in capsys.readouterr().err
    assert changed.train.source(len(changed.train) - 1).tolist() == changed.tokenizer.encode(
        ["The dog is very old."])[0]
    # Other settings are another preparation too, and say which.
    ensure_prepared(_files(data_dir), PrepareSettings(100, SETTINGS.length_filter), path, progress=False)
    assert "vocab_size 120 -> 100" in capsys.readouterr().err


def test_a_file_modified_but_holding_the_same_bytes_keeps_the_preparation(tmp_path: Path, monkeypatch, capsys):
    """A copy without its times, a reinstall or a `touch` changes a file's modification time alone: its content
    checked against the digest the preparation took, the preparation is kept (minutes at WMT size), its manifest
    given the new time; a change of the same size is prepared anew."""
    data_dir = _slice(tmp_path / "data")
    path = tmp_path / "prepared"
    first = ensure_prepared(_files(data_dir), SETTINGS, path, progress=False)
    os.utime(data_dir / "train.en", ns=(1, 10**18))
    os.utime(data_dir / "valid.de", ns=(1, 10**18))
    with monkeypatch.context() as patched:
        patched.setattr(prepared, "prepare", None)  # called, it would fail the test
        kept = ensure_prepared(_files(data_dir), SETTINGS, path, progress=False)
        assert f"fastformer: {path} kept: {data_dir.resolve() / 'train.en'} changed" in capsys.readouterr().err
        patched.setattr(prepared, "_file_sha256", None)  # the new times are the manifest's: nothing to hash
        again = ensure_prepared(_files(data_dir), SETTINGS, path, progress=False)
    assert capsys.readouterr().err == ""
    assert kept.manifest == again.manifest == {**first.manifest, "key": kept.manifest["key"]}
    assert kept.manifest["key"]["inputs"]["train.src"]["mtime_ns"] == 10**18
    text = (data_dir / "train.en").read_text(encoding="utf-8")
    (data_dir / "train.en").write_text(text.replace("dog", "cat", 1), encoding="utf-8")
    changed = ensure_prepared(_files(data_dir), SETTINGS, path, progress=False)
    assert changed.digest != first.digest and f"preparing {path} anew" in capsys.readouterr().err
    assert changed.manifest["input_sha256"]["train.src"] != first.manifest["input_sha256"]["train.src"]


def test_a_changed_validation_split_keeps_the_training_split_and_tokenizer(tmp_path: Path, monkeypatch, capsys):
    """At WMT size the tokenizer and the training split take minutes: a new validation file is encoded alone, the
    rest linked from the preparation before, and the result is what a preparation from nothing makes."""
    data_dir = _slice(tmp_path / "data")
    path = tmp_path / "prepared"
    first = ensure_prepared(_files(data_dir), SETTINGS, path, progress=False)
    train_ids = (path / "train.src.ids").stat().st_ino
    for side, line in (("en", "The dog is very old."), ("de", "Der Hund ist sehr alt.")):
        lines = (data_dir / f"valid.{side}").read_text(encoding="utf-8").splitlines()
        (data_dir / f"valid.{side}").write_text("\n".join([line] + lines[1:]) + "\n", encoding="utf-8")
    with monkeypatch.context() as patched:
        patched.setattr(prepared, "_train_tokenizer", None)  # called, it would fail the test
        changed = ensure_prepared(_files(data_dir), SETTINGS, path, progress=False)
    assert f"preparing {path} anew (its training split kept): {data_dir.resolve() / 'valid.en'} changed" in \
        capsys.readouterr().err
    assert (path / "train.src.ids").stat().st_ino == train_ids and changed.digest != first.digest
    assert changed.valid.source(0).tolist() == changed.tokenizer.encode(["The dog is very old."])[0]
    afresh = ensure_prepared(_files(data_dir), SETTINGS, tmp_path / "afresh", progress=False)
    assert changed.manifest == {**afresh.manifest, "key": changed.manifest["key"]}
    assert afresh.manifest["key"]["inputs"] == changed.manifest["key"]["inputs"]
    for name in afresh.manifest["files"]:
        assert (path / name).read_bytes() == (tmp_path / "afresh" / name).read_bytes(), name


def test_a_truncated_preparation_is_made_anew_and_a_foreign_directory_is_refused(tmp_path: Path, capsys):
    data_dir = _slice(tmp_path / "data")
    path = tmp_path / "prepared"
    # A copy: the mapping of a file cut short faults on reading.
    first_ids = np.array(ensure_prepared(_files(data_dir), SETTINGS, path, progress=False).train.tgt.ids)
    ids = path / "train.tgt.ids"
    expected = ids.stat().st_size
    ids.write_bytes(ids.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"{ids} has 100 bytes, its manifest says {expected}: the prepared corpus "
                                         f"is truncated"):
        PreparedCorpus(path)
    again = ensure_prepared(_files(data_dir), SETTINGS, path, progress=False)
    assert "is truncated" in capsys.readouterr().err
    assert np.array_equal(again.train.tgt.ids, first_ids)
    (path / prepared.MANIFEST).unlink()
    with pytest.raises(ValueError, match="holds no manifest.json"):
        PreparedCorpus(path)
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "holiday.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(ValueError, match=f"{foreign} is not a prepared corpus and holds other files \\(holiday.jpg\\)"):
        ensure_prepared(_files(data_dir), SETTINGS, foreign, progress=False)
    assert (foreign / "holiday.jpg").exists()


@pytest.mark.parametrize("case", ["the data directory", "another tool's manifest", "a stale preparation"])
def test_a_directory_holding_other_files_is_never_replaced(tmp_path: Path, case):
    """Only a directory of nothing but a preparation's own files is prepared anew in place."""
    data_dir = _slice(tmp_path / "data")
    path = {"the data directory": data_dir}.get(case, tmp_path / "prepared")
    if case == "another tool's manifest":
        path.mkdir()
        (path / prepared.MANIFEST).write_text('{"name": "my-web-app"}')
        (path / "results.txt").write_text("precious")
    if case == "a stale preparation":
        ensure_prepared(_files(data_dir), SETTINGS, path, progress=False)
        (path / "notes.txt").write_text("precious")
        (data_dir / "train.de").write_text((data_dir / "train.de").read_text().replace("Der", "Die", 1))
    before = sorted(os.listdir(path))
    with pytest.raises(ValueError, match="holds other files"):
        ensure_prepared(_files(data_dir), SETTINGS, path, progress=False)
    assert sorted(os.listdir(path)) == before


def test_a_second_process_waits_for_the_preparation_in_progress(tmp_path: Path, capsys):
    """One process at a time prepares a directory (a lock shared storage passes between hosts); the next waits, then
    opens what the first made."""
    data_dir = _slice(tmp_path / "data")
    path = tmp_path / "prepared"
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(path.parent / f".{path.name}.lock")],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "locked\n"
    started = time.monotonic()
    corpus = ensure_prepared(_files(data_dir), SETTINGS, path, progress=False)
    assert holder.wait() == 0 and time.monotonic() - started >= 1.0
    assert "waiting for another process preparing" in capsys.readouterr().err
    assert len(corpus.train) > 0


LOCK_HOLDER = """
import fcntl, sys, time
with open(sys.argv[1], "a") as lock:
    fcntl.lockf(lock, fcntl.LOCK_EX)
    print("locked", flush=True)
    time.sleep(1.5)
"""


def test_mismatched_line_counts_are_one_error_before_any_work(tmp_path: Path):
    data_dir = _slice(tmp_path / "data")
    with (data_dir / "train.de").open("a", encoding="utf-8") as file:
        file.write("Eine Zeile zu viel.\n")
    with pytest.raises(ValueError, match=f"{data_dir / 'train.en'} has 400 lines but {data_dir / 'train.de'} has "
                                         f"401"):
        ensure_prepared(_files(data_dir), SETTINGS, tmp_path / "prepared", progress=False)
    assert _visible(tmp_path) == ["data"]


def test_a_validation_split_short_of_a_line_fails_before_the_tokenizer_is_trained(tmp_path: Path, monkeypatch):
    """At WMT size the tokenizer and the training split's encoding take minutes: a mismatched validation split is
    found first."""
    data_dir = _slice(tmp_path / "data")
    lines = (data_dir / "valid.de").read_bytes().splitlines(keepends=True)
    (data_dir / "valid.de").write_bytes(b"".join(lines[:-1]))
    monkeypatch.setattr(prepared, "_train_tokenizer", None)  # called, it would fail the test
    with pytest.raises(ValueError, match=f"{data_dir / 'valid.en'} has 20 lines but {data_dir / 'valid.de'} has 19"):
        ensure_prepared(_files(data_dir), SETTINGS, tmp_path / "prepared", progress=False)
    assert _visible(tmp_path) == ["data"]


# `fastformer ARGS` that sends itself a SIGTERM as the tokenizer's training starts, minutes into a WMT preparation.
TERMINATED_IN_PREPARATION = """import os, runpy, signal, sys
from fastformer.data import prepared
train = prepared._train_tokenizer
def terminated(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    return train(*args, **kwargs)
prepared._train_tokenizer = terminated
sys.argv = ['fastformer'] + sys.argv[1:]
runpy.run_module('fastformer', run_name='__main__')
"""


@pytest.mark.parametrize(("command", "status"), [("prepare", 143), ("train", 75)])
def test_sigterm_while_preparing_removes_the_half_prepared_corpus_and_says_so(tmp_path: Path, command: str,
                                                                               status: int):
    """A job scheduler's SIGTERM during a preparation: the partial directory goes, one line says so, and train exits
    with its stopped status (75: requeue), prepare with SIGTERM's (143)."""
    data_dir = _slice(tmp_path / "data")
    flags = [command, "--data-dir", str(data_dir), "--prepared-dir", str(tmp_path / "prepared"), "--vocab-size", "120"]
    if command == "train":
        flags += ["--device", "cpu", "--preset", "tiny", "--max-steps", "1", "--out-dir", str(tmp_path / "run")]
    done = run(["-c", TERMINATED_IN_PREPARATION] + flags, module=False)
    assert done.returncode == status, done.stderr
    assert (f"fastformer {command}: stopped by SIGTERM before training (nothing was kept): run the same command "
            "again") in done.stderr
    assert "Traceback" not in done.stderr
    assert [name for name in _visible(tmp_path) if name != "run"] == ["data"]


def test_gzipped_input_prepares_the_same_corpus_as_plain_text(tmp_path: Path):
    plain = ensure_prepared(_files(_slice(tmp_path / "plain")), SETTINGS, tmp_path / "p1", progress=False)
    gz_dir = _slice(tmp_path / "gz", gz=True)
    assert find_split(gz_dir, "train").src == gz_dir / "train.en.gz"
    zipped = ensure_prepared(_files(gz_dir), SETTINGS, tmp_path / "p2", progress=False)
    assert zipped.tokenizer.model_proto == plain.tokenizer.model_proto
    for split in ("train", "valid"):
        for side in ("src", "tgt"):
            a, b = getattr(getattr(plain, split), side), getattr(getattr(zipped, split), side)
            assert np.array_equal(a.ids, b.ids) and np.array_equal(a.offsets, b.offsets)
    assert zipped.valid_pairs == plain.valid_pairs
    (gz_dir / "train.de.gz").write_bytes((gz_dir / "train.de.gz").read_bytes()[:200])
    with pytest.raises(ValueError, match="train.de.gz: not a readable gzip file"):
        ensure_prepared(_files(gz_dir), SETTINGS, tmp_path / "p3", progress=False)


def test_default_location_is_the_cache_not_a_read_only_data_dir(tmp_path: Path, monkeypatch):
    data_dir = _slice(tmp_path / "data")
    monkeypatch.setenv("FASTFORMER_CACHE", str(tmp_path / "cache"))
    before = sorted(os.listdir(data_dir))
    data_dir.chmod(0o555)
    try:
        path = prepared.default_prepared_dir(_files(data_dir), SETTINGS)
        corpus = ensure_prepared(_files(data_dir), SETTINGS, path, progress=False)
    finally:
        data_dir.chmod(0o755)
    assert path.parent == tmp_path / "cache" / "prepared" and corpus.path == path
    assert sorted(os.listdir(data_dir)) == before
    assert prepared.default_prepared_dir(_files(data_dir), PrepareSettings(100, SETTINGS.length_filter)) != path


def test_a_full_disk_during_preparation_leaves_nothing_that_looks_complete(tmp_path: Path, monkeypatch):
    data_dir = _slice(tmp_path / "data")
    path = tmp_path / "out" / "prepared"

    class FullDisk:
        """A file that takes 3000 bytes, then fails as a full disk does."""

        def __init__(self, file) -> None:
            self.file, self.written = file, 0

        def write(self, data) -> int:
            self.written += len(data)
            if self.written > 3000:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.file.write(data)

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.file.close()

    monkeypatch.setattr(prepared, "open", lambda *args, **kwargs: FullDisk(open(*args, **kwargs)), raising=False)
    with pytest.raises(OSError, match=rf"preparing {path} failed, nothing was kept: .*No space left on device"):
        ensure_prepared(_files(data_dir), SETTINGS, path, progress=False)
    assert _visible(path.parent) == []
    # What a killed preparation leaves (its process gone) is removed by the next one.
    (path.parent / f".{path.name}.tmp-{2 ** 22 + 1}").mkdir()
    monkeypatch.undo()
    assert len(ensure_prepared(_files(data_dir), SETTINGS, path, progress=False).train) == len(
        ensure_prepared(_files(data_dir), SETTINGS, tmp_path / "elsewhere", progress=False).train)
    assert _visible(path.parent) == ["prepared"]


def test_prepare_cli_then_train_opens_it_without_preparing_again(tmp_path: Path):
    data_dir = _slice(tmp_path / "data")
    path = tmp_path / "prepared"
    common = ["--data-dir", str(data_dir), "--prepared-dir", str(path), "--vocab-size", "120"]
    done = run(["prepare"] + common)
    assert done.returncode == 0, done.stderr
    assert f"prepared corpus: {path}" in done.stdout and "pairs kept (dropped: " in done.stderr
    manifest = (path / prepared.MANIFEST).stat()
    done = run(["train", "--device", "cpu", "--preset", "tiny", "--batch-tokens", "400", "--update-tokens", "400",
                "--max-steps", "1", "--valid-every", "0", "--out-dir", str(tmp_path / "run")] + common)
    assert done.returncode == 0, done.stderr
    assert "encoding" not in done.stderr and "anew" not in done.stderr
    assert (path / prepared.MANIFEST).stat().st_ino == manifest.st_ino


def test_under_torchrun_a_failed_preparation_is_one_line_from_every_rank(tmp_path: Path):
    """Rank 0 prepares and fails (unequal line counts) and prints why; rank 1, waiting for it, exits with status 1
    without printing it again."""
    data_dir = _slice(tmp_path / "data")
    with (data_dir / "train.de").open("a", encoding="utf-8") as file:
        file.write("Eine Zeile zu viel.\n")
    done = run(["train", "--device", "cpu", "--preset", "tiny", "--vocab-size", "120", "--max-steps", "1", "--quiet",
                "--data-dir", str(data_dir), "--out-dir", str(tmp_path / "run")], ranks=2)
    assert done.returncode != 0
    mismatch = f"{data_dir / 'train.en'} has 400 lines but {data_dir / 'train.de'} has 401"
    assert done.stderr.count(mismatch) == 1 and f"fastformer train: error: {mismatch}" in done.stderr
    # The only traceback is torchrun's own, reporting failed children: none passes through fastformer.
    assert "fastformer/training/run_corpus.py" not in done.stderr and "fastformer/data/" not in done.stderr
