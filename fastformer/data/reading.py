"""Reading parallel corpora as users keep them on disk, strictly: a malformed line is an error naming file and line."""

from __future__ import annotations

import contextlib
import gzip
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

BUNDLED_CORPUS = Path(__file__).resolve().parent / "corpus"
# Some editors start a UTF-8 file with one; it is no part of the first sentence.
UTF8_BOM = "\ufeff".encode()
# WMT14 En-De as the paper: newstest2013 to validate, newstest2014 to test.
SPLIT_ALIASES = {"train": ("train",), "valid": ("valid", "newstest2013"), "test": ("test", "newstest2014")}
# sacreBLEU's cache (~/.sacrebleu): <set>/<set>.<src>-<tgt>.src|ref holds the processed plain text.
SACREBLEU_SETS = {"valid": "wmt13", "test": "wmt14"}


def open_binary(path: Path) -> BinaryIO:
    """A corpus file (or a pipe: `<(zcat f.gz)`, /dev/stdin) for reading bytes; a .gz file (as WMT distributes
    them) is decompressed as it is read."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"corpus file not found: {path} (nothing is downloaded: put the text there, one "
                                f"sentence per line)")
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory, not a text file of one sentence per line")
    return gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")


def count_lines(path: Path, progress: Callable[[int], object] | None = None) -> int:
    """The lines of a text file (or .gz), counted in blocks (a last line without its line end counts); progress, if
    given, is called with each block's count."""
    count, last = 0, b"\n"
    with open_binary(path) as file, _gzip_errors(path, "while counting lines"):
        while block := file.read(1 << 22):
            count += block.count(b"\n")
            last = block[-1:]
            if progress is not None:
                progress(block.count(b"\n"))
    return count + (last != b"\n")


@contextlib.contextmanager
def _gzip_errors(path: Path, where: str) -> Iterator[None]:
    """A damaged .gz file as a ValueError naming it."""
    try:
        yield
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:
        raise ValueError(f"{path}: not a readable gzip file ({error}) {where}") from None


def iter_lines(path: Path) -> Iterator[str]:
    """The lines of a UTF-8 text file (or .gz) without their line ends, streamed; an empty or non-UTF-8 line raises
    ValueError naming file and line."""
    with open_binary(path) as file:
        number = 0
        with _gzip_errors(path, "while reading"):
            for number, raw in enumerate(file, start=1):
                yield decode_line(raw.removeprefix(UTF8_BOM) if number == 1 else raw, path, number)


def decode_line(raw: bytes, path: Path, number: int) -> str:
    """Line `number` of a corpus file without its line end; an empty or non-UTF-8 line raises ValueError."""
    try:
        line = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}:{number}: not valid UTF-8 ({error.reason} at byte {error.start})") from None
    if not line.strip():
        raise ValueError(f"{path}:{number}: empty line (every line must hold one sentence)")
    return line


def read_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file (or .gz) without their line ends; empty or non-UTF-8 lines raise ValueError."""
    return list(iter_lines(path))


def iter_parallel(src_path: Path, tgt_path: Path) -> Iterator[tuple[str, str]]:
    """Two line-aligned files -> (source sentence, target sentence), streamed; unequal line counts raise ValueError
    naming both files and counts (once the shorter file ends)."""
    sources, targets = iter_lines(src_path), iter_lines(tgt_path)
    count = 0
    for source in sources:
        target = next(targets, None)
        if target is None:
            check_line_counts(src_path, count + 1 + sum(1 for _ in sources), tgt_path, count)
        count += 1
        yield source, target
    check_line_counts(src_path, count, tgt_path, count + sum(1 for _ in targets))


def check_line_counts(src_path: Path, n_src: int, tgt_path: Path, n_tgt: int) -> None:
    if n_src != n_tgt:
        raise ValueError(f"{src_path} has {n_src} lines but {tgt_path} has {n_tgt}: parallel files must be "
                         f"line-aligned")


def decode_sentences(raw_lines: Iterable[bytes], name: str, first: int = 1) -> list[str]:
    """Lines to translate (a file, stdin) -> their text without line ends. Empty lines are kept, as "", so that
    translations stay line-aligned with the input; a line that is not UTF-8 raises ValueError naming name and line
    (the first of raw_lines being line `first`)."""
    lines = []
    for number, raw in enumerate(raw_lines, start=first):
        if number == 1:
            raw = raw.removeprefix(UTF8_BOM)
        try:
            lines.append(raw.decode("utf-8").rstrip("\r\n"))
        except UnicodeDecodeError as error:
            raise ValueError(f"{name}:{number}: not valid UTF-8 ({error.reason} at byte {error.start})") from None
    return lines


def read_parallel(src_path: Path, tgt_path: Path) -> list[tuple[str, str]]:
    """Two line-aligned files -> [(source sentence, target sentence)]; unequal line counts raise ValueError."""
    return list(iter_parallel(src_path, tgt_path))


@dataclass(frozen=True)
class SplitFiles:
    src: Path
    tgt: Path


def find_split(data_dir: Path | None, split: str, src_lang: str = "en", tgt_lang: str = "de") -> SplitFiles:
    """The files of one split: `<dir>/<name>.<lang>` or `<name>.<lang>.gz` (valid also as newstest2013, test as
    newstest2014) or sacreBLEU's cache layout; data_dir None means the bundled corpus."""
    if split not in SPLIT_ALIASES:
        raise ValueError(f"split must be one of {tuple(SPLIT_ALIASES)}, got {split!r}")
    data_dir = BUNDLED_CORPUS if data_dir is None else Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data directory not found: {data_dir}")
    # Each side may be gzipped or not, independently of the other.
    candidates = [SplitFiles(_plain_or_gz(data_dir / f"{name}.{src_lang}"),
                             _plain_or_gz(data_dir / f"{name}.{tgt_lang}")) for name in SPLIT_ALIASES[split]]
    tried = [f"{data_dir / name}.{src_lang}[.gz] + {data_dir / name}.{tgt_lang}[.gz]" for name in SPLIT_ALIASES[split]]
    if split in SACREBLEU_SETS:
        test_set = SACREBLEU_SETS[split]
        stem = data_dir / test_set / f"{test_set}.{src_lang}-{tgt_lang}"
        candidates.append(SplitFiles(stem.with_name(stem.name + ".src"), stem.with_name(stem.name + ".ref")))
        tried.append(f"{candidates[-1].src} + {candidates[-1].tgt}")
    for files in candidates:
        if files.src.is_file() and files.tgt.is_file():
            return files
    for files in candidates:
        if files.src.is_file() != files.tgt.is_file():
            found, missing = (files.src, files.tgt) if files.src.is_file() else (files.tgt, files.src)
            other = (f"not {missing.name}" if missing.suffix in (".src", ".ref")
                     else f"neither {missing.name} nor {missing.name}.gz")
            raise FileNotFoundError(f"no {split} split in {data_dir}: {found.name} is there, but {other}")
    raise FileNotFoundError(f"no {split} split in {data_dir}: looked for {', '.join(tried)}")


def _plain_or_gz(path: Path) -> Path:
    """path.gz where only it exists, else path."""
    gzipped = path.with_name(path.name + ".gz")
    return gzipped if gzipped.is_file() and not path.is_file() else path
