"""The oldest torch fastformer runs on, checked when fastformer is imported: `pip install --no-deps` (as on a GPU
machine that keeps its own torch) skips setup.py's requirement, and an older torch would fail later, deep inside an
op, with an error that does not say why."""

from __future__ import annotations

import re

# setup.py's install_requires says the same (tests/test_torch_version.py checks that).
MIN_TORCH = (2, 6)


def major_minor(version: str) -> tuple[int, int]:
    """A version text -> its (major, minor): "2.11.0+cu130" -> (2, 11); (0, 0) where it does not start so."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (0, 0) if match is None else (int(match[1]), int(match[2]))


def check_torch_version(version: str) -> None:
    """Raises ImportError naming both versions if `version` (torch.__version__, e.g. "2.11.0+cu130") is older than
    MIN_TORCH."""
    if major_minor(version) < MIN_TORCH:
        minimum = ".".join(map(str, MIN_TORCH))
        raise ImportError(f"fastformer needs torch >= {minimum}; this is torch {version}")
