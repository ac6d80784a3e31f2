"""A synthetic WMT14-like parallel corpus, written fast: for timing preparation and training start-up at full size.

Each language has its own lexicon of pseudo-words built from random syllables, drawn with Zipf-like frequencies (as
real text: a few words are most of the tokens, a long tail is rare), so that a BPE vocabulary splits the rare words
into pieces as it does on WMT14. Source lengths are log-normal around `words` words, the target's about 10% longer.
Generation is vectorized: the bytes of a chunk of sentences are gathered from the lexicon with numpy.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

SYLLABLES = [a + b for a in ("b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "w", "z", "st", "ch",
                             "sch", "tr", "br") for b in ("a", "e", "i", "o", "u", "ei", "au", "ie", "en", "er")]
CHUNK_SENTENCES = 200_000


def _lexicon(words: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """-> (flat bytes of every word followed by one space [total] uint8, start of each word [words + 1] int64)."""
    syllables = rng.integers(1, 4, size=words)
    picks = iter(rng.integers(0, len(SYLLABLES), size=int(syllables.sum())).tolist())
    entries = ["".join(SYLLABLES[next(picks)] for _ in range(count)).encode() + b" " for count in syllables.tolist()]
    starts = np.concatenate([[0], np.cumsum([len(entry) for entry in entries])])
    return np.frombuffer(b"".join(entries), dtype=np.uint8), starts


def _zipf_ids(count: int, words: int, rng: np.random.Generator) -> np.ndarray:
    """count word ids in [0, words) with probability ~ 1 / (rank + 10) (a Zipf-Mandelbrot law)."""
    weights = 1.0 / (np.arange(words) + 10.0)
    cumulative = np.cumsum(weights / weights.sum())
    return np.minimum(np.searchsorted(cumulative, rng.random(count)), words - 1)


def _sentences(lengths: np.ndarray, lexicon: tuple[np.ndarray, np.ndarray], rng: np.random.Generator) -> bytes:
    """One line per entry of lengths (words per sentence), space-separated pseudo-words -> the lines' bytes."""
    flat, starts = lexicon
    ids = _zipf_ids(int(lengths.sum()), len(starts) - 1, rng)
    word_bytes = starts[ids + 1] - starts[ids]
    out_starts = np.concatenate([[0], np.cumsum(word_bytes)])
    total = int(out_starts[-1])
    # Byte k of the output is byte (k - out_start[word]) of its word in the lexicon.
    source = np.repeat(starts[ids] - out_starts[:-1], word_bytes) + np.arange(total)
    text = flat[source]
    text[out_starts[np.cumsum(lengths)] - 1] = ord("\n")  # each sentence's last space ends its line
    return text.tobytes()


def write_corpus(directory: Path, pairs: int, words: float = 21.0, lexicon_words: int = 200_000,
                 valid_pairs: int = 3000, gz: bool = False, seed: int = 0) -> dict[str, Path]:
    """Writes train.{en,de} (pairs lines) and valid.{en,de} (valid_pairs lines), gzipped with gz -> {name: path}."""
    rng = np.random.default_rng(seed)
    lexicons = {lang: _lexicon(lexicon_words, rng) for lang in ("en", "de")}
    directory.mkdir(parents=True, exist_ok=True)
    suffix = ".gz" if gz else ""
    paths = {}
    for split, count in (("train", pairs), ("valid", valid_pairs)):
        files = {lang: (gzip.open if gz else open)(directory / f"{split}.{lang}{suffix}", "wb", **(
            {"compresslevel": 1} if gz else {})) for lang in ("en", "de")}
        try:
            for start in range(0, count, CHUNK_SENTENCES):
                n = min(CHUNK_SENTENCES, count - start)
                src = np.clip(np.round(np.exp(rng.normal(np.log(words), 0.5, n))), 1, 120).astype(np.int64)
                tgt = np.clip(np.round(src * np.exp(rng.normal(np.log(1.1), 0.15, n))), 1, 130).astype(np.int64)
                files["en"].write(_sentences(src, lexicons["en"], rng))
                files["de"].write(_sentences(tgt, lexicons["de"], rng))
        finally:
            for file in files.values():
                file.close()
        paths.update({f"{split}.{lang}{suffix}": directory / f"{split}.{lang}{suffix}" for lang in ("en", "de")})
    return paths
