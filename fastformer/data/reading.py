"""Reading parallel corpora as users keep them on disk, strictly: a malformed line is an error naming file and line."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

BUNDLED_CORPUS = Path(__file__).resolve().parent / "corpus"
# WMT14 En-De as the paper: newstest2013 to validate, newstest2014 to test.
SPLIT_ALIASES = {"train": ("train",), "valid": ("valid", "newstest2013"), "test": ("test", "newstest2014")}
# sacreBLEU's cache (~/.sacrebleu): <set>/<set>.<src>-<tgt>.src|ref holds the processed plain text.
SACREBLEU_SETS = {"valid": "wmt13", "test": "wmt14"}


def read_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file without their line ends; empty or non-UTF-8 lines raise ValueError."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"corpus file not found: {path} (nothing is downloaded: put the text there, one "
                                f"sentence per line)")
    lines = []
    with path.open("rb") as file:
        for number, raw in enumerate(file, start=1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}:{number}: not valid UTF-8 ({error.reason} at byte {error.start})") from None
            if not line.strip():
                raise ValueError(f"{path}:{number}: empty line (every line must hold one sentence)")
            lines.append(line)
    return lines


def decode_sentences(raw_lines: Iterable[bytes], name: str) -> list[str]:
    """Lines to translate (a file, stdin) -> their text without line ends. Empty lines are kept, as "", so that
    translations stay line-aligned with the input; a line that is not UTF-8 raises ValueError naming name and line."""
    lines = []
    for number, raw in enumerate(raw_lines, start=1):
        try:
            lines.append(raw.decode("utf-8").rstrip("\r\n"))
        except UnicodeDecodeError as error:
            raise ValueError(f"{name}:{number}: not valid UTF-8 ({error.reason} at byte {error.start})") from None
    return lines


def read_parallel(src_path: Path, tgt_path: Path) -> list[tuple[str, str]]:
    """Two line-aligned files -> [(source sentence, target sentence)]; unequal line counts raise ValueError."""
    sources, targets = read_lines(src_path), read_lines(tgt_path)
    if len(sources) != len(targets):
        raise ValueError(f"{src_path} has {len(sources)} lines but {tgt_path} has {len(targets)}: parallel files "
                         f"must be line-aligned")
    return list(zip(sources, targets))


@dataclass(frozen=True)
class SplitFiles:
    src: Path
    tgt: Path


def find_split(data_dir: Path | None, split: str, src_lang: str = "en", tgt_lang: str = "de") -> SplitFiles:
    """The files of one split: `<dir>/<name>.<lang>` (valid also as newstest2013, test as newstest2014) or
    sacreBLEU's cache layout; data_dir None means the bundled corpus."""
    if split not in SPLIT_ALIASES:
        raise ValueError(f"split must be one of {tuple(SPLIT_ALIASES)}, got {split!r}")
    data_dir = BUNDLED_CORPUS if data_dir is None else Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data directory not found: {data_dir}")
    candidates = [SplitFiles(data_dir / f"{name}.{src_lang}", data_dir / f"{name}.{tgt_lang}")
                  for name in SPLIT_ALIASES[split]]
    if split in SACREBLEU_SETS:
        test_set = SACREBLEU_SETS[split]
        stem = data_dir / test_set / f"{test_set}.{src_lang}-{tgt_lang}"
        candidates.append(SplitFiles(stem.with_name(stem.name + ".src"), stem.with_name(stem.name + ".ref")))
    for files in candidates:
        if files.src.is_file() and files.tgt.is_file():
            return files
    tried = ", ".join(f"{files.src} + {files.tgt}" for files in candidates)
    raise FileNotFoundError(f"no {split} split in {data_dir}: looked for {tried}")
