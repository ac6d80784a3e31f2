"""A prepared corpus: the shared vocabulary and every split's token ids as flat arrays on disk, made once and then
memory-mapped by every run and every rank (as fairseq's data-bin or Megatron's .bin/.idx).

The directory holds the tokenizer files (`spm.model`, the shared vocabulary learned from the corpus, or, fine-tuning
a Marian model, its `source.spm`, `target.spm` and `vocab.json`), for each split (train, valid) and side (src, tgt)
`<split>.<side>.ids` (the bare ids: uint16 when the vocabulary fits, else int32), `.offsets` (int64, one more than
the sentences) and `.lengths` (int32: the length plus the EOS or BOS the model adds), and `manifest.json`. The manifest
is written last, so a directory without one is never taken as complete; it keys the preparation by what it depends on
(each input file's path, size and modification time, the vocabulary size or the given tokenizers, the tokenizer's
sample, the length filter, the format version), and a
preparation whose key differs from the inputs' is made anew, saying why. A preparation is built in a temporary
directory beside its destination and renamed into place when complete.

Preparation streams: the lines are counted (both files must agree), the tokenizer learns from at most
TOKENIZER_SAMPLE sentences (pairs drawn at random, seeded, read from the files as sentencepiece asks for them), and
the pairs are encoded in chunks by sentencepiece's threads, each chunk's arrays appended to the files; no more than a
chunk is ever held as Python objects.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from tqdm import tqdm

from fastformer.data.batching import LengthFilter, TokenArrays, TokenizedCorpus
from fastformer.data.reading import (SplitFiles, check_line_counts, count_lines, decode_line, iter_parallel,
                                     open_binary, read_parallel)
from fastformer.data.tokenizer import (MARIAN_FILES, SHARED_FILE, TRAINING_SEED, Tokenizer, Tokenizers,
                                       train_tokenizer)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_FILE = SHARED_FILE
SPLITS = ("train", "valid")
SIDES = ("src", "tgt")
# BPE is learned on at most this many sentences (both languages together: 1M pairs of WMT14's 4.5M).
TOKENIZER_SAMPLE = 2_000_000
CHUNK_PAIRS = 20_000
DEFAULT_BUNDLED_VOCAB = 1000
DEFAULT_VOCAB = 37000  # the paper's shared En-De BPE vocabulary


@dataclass(frozen=True)
class PrepareSettings:
    """What a preparation makes of its input files, besides the files themselves. tokenizers: those of a pretrained
    model to encode with (--init-from), else None: a shared vocabulary of vocab_size is learned from the corpus, with
    the pieces `reserved` kept apart (train_tokenizer's); given tokenizers come with their own reserved pieces."""

    vocab_size: int
    length_filter: LengthFilter
    tokenizer_sample: int = TOKENIZER_SAMPLE
    tokenizers: Tokenizers | None = None
    reserved: tuple[str, ...] = ()

    def to_json(self) -> dict:
        # Only what is set, so that the keys of preparations made before these existed stay as they were.
        given = {} if self.tokenizers is None else {"tokenizers": self.tokenizers.digest}
        reserved = {"reserved": list(self.reserved)} if self.reserved else {}
        return {"vocab_size": self.vocab_size, "tokenizer_sample": self.tokenizer_sample,
                "length_filter": asdict(self.length_filter), **given, **reserved}


def default_vocab_size(data_dir: str | Path | None) -> int:
    return DEFAULT_BUNDLED_VOCAB if data_dir is None else DEFAULT_VOCAB


def cache_root() -> Path:
    """Where preparations go unless --prepared-dir says otherwise: $FASTFORMER_CACHE, else $XDG_CACHE_HOME/fastformer,
    else ~/.cache/fastformer. Never the data directory, which may be read-only."""
    if os.environ.get("FASTFORMER_CACHE"):
        return Path(os.environ["FASTFORMER_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastformer"


def default_prepared_dir(files: dict[str, SplitFiles], settings: PrepareSettings) -> Path:
    """<cache_root>/prepared/<data directory name>-<hash of the input paths and settings>: the same inputs and settings
    always find the same directory, so a changed file is re-prepared there (saying why) rather than beside it."""
    identity = {split: [str(Path(path).resolve()) for path in (pair.src, pair.tgt)] for split, pair in files.items()}
    digest = _digest({"inputs": identity, "settings": settings.to_json(), "format": FORMAT_VERSION})[:16]
    return cache_root() / "prepared" / f"{Path(files['train'].src).resolve().parent.name}-{digest}"


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def preparation_key(files: dict[str, SplitFiles], settings: PrepareSettings) -> dict:
    """Everything a preparation depends on: each input's path, size and modification time, and the settings."""
    inputs = {}
    for split, pair in files.items():
        for side, path in zip(SIDES, (pair.src, pair.tgt)):
            stat = Path(path).stat()
            inputs[f"{split}.{side}"] = {"path": str(Path(path).resolve()), "size": stat.st_size,
                                         "mtime_ns": stat.st_mtime_ns}
    return {"format": FORMAT_VERSION, "inputs": inputs, "settings": settings.to_json()}


def _same_format_and_settings(old: dict, new: dict) -> bool:
    return old.get("format") == new["format"] and old.get("settings") == new["settings"]


def _train_unchanged(old: dict, new: dict) -> bool:
    """Whether a preparation keyed `old` has the training split and tokenizer of one keyed `new`: the same format,
    settings and training inputs (what else differs is validation or test files)."""
    def training(key: dict) -> dict:
        return {name: entry for name, entry in key.get("inputs", {}).items() if name.startswith("train.")}
    return _same_format_and_settings(old, new) and training(old) == training(new)


def stale_reasons(old: dict, new: dict) -> list[str]:
    """Why a preparation keyed `old` is not one for `new`: each input or setting that differs, in words."""
    if old.get("format") != new["format"]:
        return [f"format version {old.get('format')} -> {new['format']}"]
    reasons = []
    for name, now in new["inputs"].items():
        then = old.get("inputs", {}).get(name)
        if then is None or then.get("path") != now["path"]:
            reasons.append(f"{name} is now {now['path']} (was {None if then is None else then.get('path')})")
        elif (then.get("size"), then.get("mtime_ns")) != (now["size"], now["mtime_ns"]):
            reasons.append(f"{now['path']} changed (size {then.get('size')} -> {now['size']} bytes, modified "
                           f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now['mtime_ns'] / 1e9))})")
    old_settings = old.get("settings", {})
    for name in sorted(set(old_settings) | set(new["settings"])):
        if old_settings.get(name) != new["settings"].get(name):
            reasons.append(f"{name} {old_settings.get(name)} -> {new['settings'].get(name)}")
    return reasons


class PreparedCorpus:
    """An opened prepared directory: its tokenizers and the train/valid splits as memory-mapped TokenizedCorpus."""

    def __init__(self, path: Path) -> None:
        """Opens and checks `path` (ValueError naming what is wrong: no manifest, a foreign or truncated file)."""
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        # A manifest of before --init-from names the one shared model by its hash alone.
        named = self.manifest.get("tokenizer_files") or {TOKENIZER_FILE: self.manifest["tokenizer_sha256"]}
        files = {}
        for name, digest in named.items():
            if not (self.path / name).is_file():
                raise ValueError(f"{self.path} holds no {name}: not a (complete) prepared corpus")
            files[name] = (self.path / name).read_bytes()
            if hashlib.sha256(files[name]).hexdigest() != digest:
                raise ValueError(f"{self.path / name} is not the tokenizer file its manifest names")
        self.tokenizers = Tokenizers.from_files(files, str(self.path),
                                                tuple(self.manifest["key"]["settings"].get("reserved", ())))
        self.train = self._open_split("train")
        # A corpus prepared to train on beside another (--extra-data) has no validation split of its own.
        self.valid = self._open_split("valid") if "valid" in self.manifest["splits"] else None

    @property
    def tokenizer(self) -> Tokenizer:
        """The shared tokenizer of a corpus prepared with fastformer's own (the source side's, for a Marian model's)."""
        return self.tokenizers.source

    @property
    def digest(self) -> str:
        """Names this preparation's key: ranks check that they opened the one rank 0 prepared."""
        return _digest(self.manifest["key"])

    @cached_property
    def valid_pairs(self) -> list[tuple[str, str]]:
        """The validation sentences as text (for BLEU), read from the input files the manifest names."""
        inputs = self.manifest["key"]["inputs"]
        return read_parallel(Path(inputs["valid.src"]["path"]), Path(inputs["valid.tgt"]["path"]))

    def _open_split(self, split: str) -> TokenizedCorpus:
        sides = [TokenArrays(*(_map(self.path / f"{split}.{side}.{part}", self.manifest["files"])
                               for part in ("ids", "offsets", "lengths"))) for side in SIDES]
        return TokenizedCorpus(*sides, **self.tokenizers.special_ids)


def read_manifest(path: Path) -> dict:
    """The manifest of a complete preparation at path, its files checked against it; ValueError if there is none."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise ValueError(f"{path} holds no {MANIFEST}: not a (complete) prepared corpus")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
        format_version = manifest["key"]["format"]
        manifest["key"]["settings"], manifest["splits"]["train"]  # noqa: B018 (what PreparedCorpus reads)
        manifest.get("tokenizer_files") or manifest["tokenizer_sha256"]  # noqa: B018
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{manifest_path} is not a fastformer prepared-corpus manifest ({error})") from None
    if format_version != FORMAT_VERSION:
        raise ValueError(f"{path} is a prepared corpus of format {format_version}; this fastformer reads format "
                         f"{FORMAT_VERSION}")
    for name, entry in files.items():
        size = (path / name).stat().st_size if (path / name).is_file() else None
        if size != entry["count"] * np.dtype(entry["dtype"]).itemsize:
            raise ValueError(f"{path / name} has {size} bytes, its manifest says "
                             f"{entry['count'] * np.dtype(entry['dtype']).itemsize}: the prepared corpus is truncated")
    return manifest


def _map(path: Path, files: dict) -> np.ndarray:
    entry = files[path.name]
    if entry["count"] == 0:
        return np.zeros(0, dtype=entry["dtype"])
    return np.memmap(path, dtype=entry["dtype"], mode="r", shape=(entry["count"],))


def _prepared_file_names() -> set[str]:
    arrays = {f"{split}.{side}.{part}" for split in SPLITS for side in SIDES for part in ("ids", "offsets", "lengths")}
    return arrays | {MANIFEST, SHARED_FILE, *MARIAN_FILES}


def _refuse_foreign(path: Path, why: str, remedy: str) -> None:
    """Raises, saying `why` a preparation would replace `path`, where it holds what no preparation writes (a file, or
    `path` itself, that is not a preparation's): such a directory is never replaced."""
    known = _prepared_file_names()
    foreign = sorted(entry.name for entry in path.iterdir() if entry.name not in known or not entry.is_file()) \
        if path.is_dir() else [path.name]
    if foreign:
        raise ValueError(f"{path} {why} and holds other files ({', '.join(foreign[:3])}"
                         f"{', ...' if len(foreign) > 3 else ''}): choose another --prepared-dir, or {remedy}")


@contextmanager
def _preparation_lock(path: Path) -> Iterator[None]:
    """Holds the lock file beside `path` (a POSIX lock, which shared storage passes between hosts), so that one
    process at a time checks, prepares and opens it: another waits, then opens what the first made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "a") as lock:
        try:
            fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            print(f"fastformer: waiting for another process preparing {path}", file=sys.stderr)
            fcntl.lockf(lock, fcntl.LOCK_EX)
        yield


def ensure_prepared(files: dict[str, SplitFiles], settings: PrepareSettings, path: Path,
                    progress: bool = True) -> PreparedCorpus:
    """The preparation of `files` at `path`: opened if it is complete and its key matches, else made (anew, with the
    reason on stderr). A directory at `path` holding anything a preparation does not write is refused rather than
    replaced."""
    path = Path(path)
    key = preparation_key(files, settings)
    with _preparation_lock(path):
        if path.exists():
            try:
                corpus = PreparedCorpus(path)
            except ValueError as error:
                _refuse_foreign(path, "is not a prepared corpus", "remove it")
                print(f"fastformer: preparing {path} anew: {error}", file=sys.stderr)
            else:
                reasons = stale_reasons(corpus.manifest["key"], key)
                if reasons and _only_touched(corpus.manifest, key):
                    _rewrite_key(corpus, key)
                    print(f"fastformer: {path} kept: {'; '.join(reasons)}, with the content it was prepared from",
                          file=sys.stderr)
                    return PreparedCorpus(path)
                if not reasons:
                    return corpus
                _refuse_foreign(path, f"needs preparing anew ({'; '.join(reasons)})", "remove them")
                # Only validation or test files changed: the tokenizer and the training split (minutes at WMT size)
                # are those of `corpus`, kept.
                kept = corpus if _train_unchanged(corpus.manifest["key"], key) else None
                print(f"fastformer: preparing {path} anew{' (its training split kept)' if kept else ''}: "
                      + "; ".join(reasons), file=sys.stderr)
                prepare(files, settings, path, progress, kept)
                return PreparedCorpus(path)
        elif progress:
            print(f"fastformer: preparing the corpus in {path} (once: later runs map it)", file=sys.stderr)
        prepare(files, settings, path, progress)
        return PreparedCorpus(path)


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def _input_digests(key: dict, kept: PreparedCorpus | None) -> dict[str, str]:
    """Each input's SHA-256; a kept training split's from its manifest (its files unchanged, and hashing them reads
    the largest inputs again)."""
    known = {} if kept is None else kept.manifest.get("input_sha256", {})
    return {name: known[name] if name.startswith("train.") and name in known else _file_sha256(Path(entry["path"]))
            for name, entry in key["inputs"].items()}


def _only_touched(manifest: dict, key: dict) -> bool:
    """Whether every input that differs from the preparation's key is the same path and size with the same content,
    only modified since (copied without its times, a reinstall, a `touch`), and the settings are the same: the
    preparation is still the inputs', and minutes of it at WMT size need not be made again."""
    old, digests = manifest["key"], manifest.get("input_sha256", {})
    if not _same_format_and_settings(old, key):
        return False
    for name, now in key["inputs"].items():
        then = old.get("inputs", {}).get(name)
        if then == now:
            continue
        if (then is None or (then.get("path"), then.get("size")) != (now["path"], now["size"])
                or name not in digests or _file_sha256(Path(now["path"])) != digests[name]):
            return False
    return set(old.get("inputs", {})) == set(key["inputs"])


def _rewrite_key(corpus: PreparedCorpus, key: dict) -> None:
    """Gives the preparation's manifest the inputs' new modification times (written whole, then renamed over it)."""
    manifest_path = corpus.path / MANIFEST
    temp = manifest_path.with_name(f".{MANIFEST}.tmp-{os.getpid()}")
    with open(temp, "w", encoding="utf-8") as file:
        json.dump({**corpus.manifest, "key": key}, file, indent=1)
        file.flush()
        os.fsync(file.fileno())
    os.replace(temp, manifest_path)


def prepare(files: dict[str, SplitFiles], settings: PrepareSettings, path: Path, progress: bool = True,
            kept: PreparedCorpus | None = None) -> dict:
    """Trains the tokenizer on the training pairs (unless settings give tokenizers) and encodes every split into a new
    directory renamed to `path` when complete (replacing what was there) -> the manifest. kept: a preparation of the
    same training files and settings, whose tokenizer and training split are linked in, not made again."""
    key = preparation_key(files, settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(path)
    temp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    temp.mkdir()
    start = time.perf_counter()
    try:
        # A kept training split is the one its key names, counted and checked when it was made.
        pairs = _count_pairs(files["train"], progress) if kept is None else None
        for split in (split for split in SPLITS if split != "train" and split in files):
            _count_pairs(files[split], progress=False, training=False)
        tokenizers = settings.tokenizers if kept is None else kept.tokenizers
        if tokenizers is None:
            tokenizers = Tokenizers.shared(_train_tokenizer(files["train"], pairs, settings, progress),
                                           settings.reserved)
            if progress:
                print(f"tokenizer: {tokenizers.vocab_size} pieces, {time.perf_counter() - start:.0f}s",
                      file=sys.stderr)
        for name, data in tokenizers.files.items():
            (temp / name).write_bytes(data)
        dtype = np.dtype(np.uint16 if tokenizers.vocab_size <= 1 << 16 else np.int32)
        written: dict[str, dict] = {}
        splits = {}
        if kept is not None:
            splits["train"] = kept.manifest["splits"]["train"]
            for name, entry in kept.manifest["files"].items():
                if name.startswith("train."):
                    try:
                        os.link(kept.path / name, temp / name)
                    except OSError:  # a filesystem without hard links
                        shutil.copyfile(kept.path / name, temp / name)
                    written[name] = entry
        for split in (split for split in SPLITS if split in files and (kept is None or split != "train")):
            length_filter = settings.length_filter if split == "train" else None
            total = pairs if split == "train" else None
            splits[split] = _encode_split(files[split], tokenizers, length_filter, temp, split, dtype, written,
                                          total, progress)
        if splits["train"]["pairs"] == 0:
            raise ValueError(f"no training pair of {files['train'].src} + {files['train'].tgt} passes the length "
                             f"filter {settings.length_filter}")
        manifest = {"key": key, "tokenizer_files": {name: hashlib.sha256(data).hexdigest()
                                                    for name, data in tokenizers.files.items()},
                    "vocab_size": tokenizers.vocab_size, "splits": splits, "files": written,
                    "input_sha256": _input_digests(key, kept)}
        # Written last: its presence marks the directory complete.
        with open(temp / MANIFEST, "w", encoding="utf-8") as file:
            json.dump(manifest, file, indent=1)
            file.flush()
            os.fsync(file.fileno())
        _replace(temp, path)
    except BaseException as error:
        shutil.rmtree(temp, ignore_errors=True)
        if isinstance(error, OSError) and not isinstance(error, FileNotFoundError):
            raise OSError(f"preparing {path} failed, nothing was kept: {error}") from None
        raise
    if progress:
        _summary(path, manifest, time.perf_counter() - start)
    return manifest


def _count_pairs(files: SplitFiles, progress: bool, training: bool = True) -> int:
    """The line count of both files, which must agree, and be more than 0 for the training split (checked before any
    other work: every split's, so that a validation file short of a line fails before minutes of encoding)."""
    with tqdm(desc="counting lines", unit=" lines", disable=not progress, mininterval=1.0) as bar:
        counts = [count_lines(path, bar.update) for path in (files.src, files.tgt)]
    check_line_counts(files.src, counts[0], files.tgt, counts[1])
    if training and counts[0] == 0:
        raise ValueError(f"{files.src} and {files.tgt} are empty: there is nothing to train on")
    return counts[0]


def _train_tokenizer(files: SplitFiles, pairs: int, settings: PrepareSettings, progress: bool) -> Tokenizer:
    """The shared vocabulary, learned from the sentences _tokenizer_sentences reads; a bad line is its own error
    (sentencepiece would wrap an exception raised in the iterator it reads from in a RuntimeError)."""
    errors: list[ValueError] = []
    try:
        tokenizer = train_tokenizer(_tokenizer_sentences(files, pairs, settings.tokenizer_sample, progress, errors),
                                    vocab_size=settings.vocab_size, seed_sentences=settings.tokenizer_sample,
                                    reserved=settings.reserved)
    except RuntimeError:
        if not errors:
            raise
    if errors:
        raise errors[0]
    return tokenizer


def _tokenizer_sentences(files: SplitFiles, pairs: int, sample: int, progress: bool,
                         errors: list[ValueError]) -> Iterator[str]:
    """The sentences the tokenizer learns from, both sides of each pair in turn: every pair when they are at most
    `sample` sentences, else sample // 2 pairs drawn at random (seeded), so that a large corpus is never handed to
    sentencepiece whole. A bad line's ValueError goes to `errors` and ends the iteration."""
    chosen = np.ones(pairs, dtype=np.uint8)
    if 2 * pairs > sample:
        chosen[:] = 0
        chosen[np.random.default_rng(TRAINING_SEED).choice(pairs, sample // 2, replace=False)] = 1
    bar = tqdm(total=int(chosen.sum()), desc="reading for the tokenizer", unit=" pairs", disable=not progress,
               mininterval=1.0)
    with open_binary(files.src) as sources, open_binary(files.tgt) as targets, bar:
        # compress skips the pairs not drawn without decoding them; the encoding pass checks every line.
        for number, (source, target) in itertools.compress(enumerate(zip(sources, targets), start=1),
                                                           chosen.tobytes()):
            try:
                sentences = decode_line(source, files.src, number), decode_line(target, files.tgt, number)
            except ValueError as error:
                errors.append(error)  # said after the bar is closed, not in the middle of it
                return
            yield from sentences
            bar.update()
    if progress:
        print(f"training the tokenizer on {bar.n:,} pairs (sentencepiece BPE)...", file=sys.stderr)


def _encode_split(files: SplitFiles, tokenizers: Tokenizers, length_filter: LengthFilter | None, directory: Path,
                  split: str, dtype: np.dtype, written: dict, total: int | None, progress: bool) -> dict:
    """Encodes a split chunk by chunk, appending each side's ids, offsets and lengths to its files; records each
    file's dtype and count in `written` -> the split's statistics (pairs kept, dropped by each filter, tokens)."""
    names = {(side, part): f"{split}.{side}.{part}" for side in SIDES for part in ("ids", "offsets", "lengths")}
    outputs = {key: open(directory / name, "wb") for key, name in names.items()}
    dropped = {"too_short": 0, "too_long": 0, "ratio": 0}
    kept_pairs, tokens = 0, {side: 0 for side in SIDES}
    try:
        for side in SIDES:
            outputs[side, "offsets"].write(np.zeros(1, dtype=np.int64).tobytes())
        bar = tqdm(total=total, desc=f"encoding {split}", unit=" pairs", disable=not progress, mininterval=1.0)
        for chunk in _chunks(iter_parallel(files.src, files.tgt), CHUNK_PAIRS):
            encoded = [side.encode([pair[i] for pair in chunk]) for i, side in enumerate((tokenizers.source,
                                                                                         tokenizers.target))]
            lengths = [np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)) for ids in encoded]
            keep = np.ones(len(chunk), dtype=bool) if length_filter is None else length_filter.keeps(*lengths)
            if length_filter is not None:
                _count_dropped(dropped, lengths, keep, length_filter)
            kept_pairs += int(keep.sum())
            for side, ids, side_lengths in zip(SIDES, encoded, lengths):
                kept_lengths = side_lengths[keep]
                flat = np.fromiter(itertools.chain.from_iterable(itertools.compress(ids, keep)), dtype=dtype,
                                   count=int(kept_lengths.sum()))
                outputs[side, "ids"].write(flat.tobytes())
                outputs[side, "offsets"].write((tokens[side] + np.cumsum(kept_lengths)).tobytes())
                outputs[side, "lengths"].write((kept_lengths + 1).astype(np.int32).tobytes())
                tokens[side] += len(flat)
            bar.update(len(chunk))
        bar.close()
        for output in outputs.values():
            output.flush()
            os.fsync(output.fileno())
    finally:
        for output in outputs.values():
            output.close()
    for (side, part), name in names.items():
        count = {"ids": tokens[side], "offsets": kept_pairs + 1, "lengths": kept_pairs}[part]
        written[name] = {"dtype": {"ids": dtype.name, "offsets": "int64", "lengths": "int32"}[part], "count": count}
    return {"pairs": kept_pairs, "dropped": dropped, "src_tokens": tokens["src"], "tgt_tokens": tokens["tgt"]}


def _chunks(pairs: Iterator[tuple[str, str]], size: int) -> Iterator[list[tuple[str, str]]]:
    while chunk := list(itertools.islice(pairs, size)):
        yield chunk


def _count_dropped(dropped: dict, lengths: list[np.ndarray], keep: np.ndarray, length_filter: LengthFilter) -> None:
    """Adds the chunk's dropped pairs by the first filter each fails: too short, too long, then the ratio."""
    shorter, longer = np.minimum(*lengths)[~keep], np.maximum(*lengths)[~keep]
    too_short = shorter < length_filter.min_len
    too_long = ~too_short & (longer > length_filter.max_len)
    dropped["too_short"] += int(too_short.sum())
    dropped["too_long"] += int(too_long.sum())
    dropped["ratio"] += int((~too_short & ~too_long).sum())


def _remove_abandoned(path: Path) -> None:
    """Removes what killed preparations of `path` left beside it. Called under _preparation_lock, which every
    preparation holds until it ends, so no temporary directory there is still being written."""
    for temp in path.parent.glob(f".{path.name}.tmp-*"):
        shutil.rmtree(temp, ignore_errors=True)


def _replace(temp: Path, path: Path) -> None:
    """Moves the complete preparation `temp` to `path`: an old one is renamed aside first and removed after (a run
    that still maps its files keeps reading them)."""
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(temp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _summary(path: Path, manifest: dict, seconds: float) -> None:
    train, valid = manifest["splits"]["train"], manifest["splits"].get("valid")
    size = sum(file.stat().st_size for file in path.iterdir())
    dropped = ", ".join(f"{count:,} {name.replace('_', ' ')}" for name, count in train["dropped"].items())
    valid_pairs = "" if valid is None else f"valid {valid['pairs']:,} pairs; "
    print(f"prepared {path} in {seconds:.0f}s: train {train['pairs']:,} pairs kept (dropped: {dropped}), "
          f"{train['src_tokens']:,} + {train['tgt_tokens']:,} tokens; {valid_pairs}vocabulary "
          f"{manifest['vocab_size']:,}; {size / 2 ** 20:,.1f} MiB on disk", file=sys.stderr)
