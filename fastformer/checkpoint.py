"""Checkpoints: atomic saves, strict loads, keeping the last K, and averaging the last N (the paper averages 5).

A leaf of the package: a checkpoint is a plain dict of tensors and Python values, tagged with FORMAT so that a
foreign file is told apart from ours; nothing here knows the model class.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import torch

FORMAT = "fastformer-checkpoint"
VERSION = 1
_NAME = re.compile(r"checkpoint_(\d+)\.pt")


def checkpoint_path(directory: Path, step: int) -> Path:
    return Path(directory) / f"checkpoint_{step:08d}.pt"


def save_checkpoint(state: dict, path: Path) -> None:
    """Writes state to path atomically: a temp file in the same directory, fsync, then os.replace, so a crash or
    error mid-save leaves any existing file at path untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates the file private (0600); a checkpoint gets the permissions of any file the user writes.
        os.chmod(temp_name, 0o666 & ~_umask())
        with os.fdopen(descriptor, "wb") as file:
            torch.save({**state, "format": FORMAT, "version": VERSION}, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp_name, path)
    except BaseException:
        os.unlink(temp_name)
        raise
    # The rename itself is durable only once the directory entry is on disk.
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict:
    """-> the state dict saved by save_checkpoint; a missing, corrupt or foreign file raises an error naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        # weights_only: a checkpoint holds tensors and plain values only, so nothing in it can run code on load.
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as error:
        raise ValueError(f"{path} is not a readable checkpoint (corrupt or truncated?): "
                         f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a fastformer checkpoint (no {FORMAT!r} tag)")
    if state.get("version") != VERSION:
        raise ValueError(f"{path} has checkpoint version {state.get('version')!r}; this fastformer reads {VERSION}")
    for key in ("model", "config"):
        if key not in state:
            raise ValueError(f"{path} is a fastformer checkpoint without {key!r}")
    return state


def list_checkpoints(directory: Path) -> list[Path]:
    """The step checkpoints in directory, oldest (lowest step) first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(match.group(1)), path) for path in directory.iterdir() if (match := _NAME.fullmatch(path.name))]
    return [path for _, path in sorted(found)]


def prune_checkpoints(directory: Path, keep_last: int) -> None:
    """Deletes all but the newest keep_last step checkpoints."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    for path in list_checkpoints(directory)[:-keep_last]:
        path.unlink()


def average_checkpoints(paths: list[Path]) -> dict:
    """-> a checkpoint whose floating-point model tensors are the mean over paths (accumulated in fp64); other
    entries (config, tokenizer) come from the last path. The result has no optimizer state: it is for inference."""
    if not paths:
        raise ValueError("average_checkpoints needs at least one checkpoint")
    states = [load_checkpoint(path) for path in paths]
    last = states[-1]
    for path, state in zip(paths, states):
        if state["config"] != last["config"]:
            raise ValueError(f"{path} has another model config than {paths[-1]}: cannot average them")
        if state["model"].keys() != last["model"].keys():
            raise ValueError(f"{path} has other parameter names than {paths[-1]}: cannot average them")
    averaged = {}
    for name, tensor in last["model"].items():
        if tensor.is_floating_point():
            total = sum(state["model"][name].double() for state in states)
            averaged[name] = (total / len(states)).to(tensor.dtype)
        else:
            averaged[name] = tensor
    keep = {key: value for key, value in last.items() if key not in ("optimizer", "rng", "data", "format", "version")}
    return {**keep, "model": averaged, "averaged_from": [str(path) for path in paths]}
