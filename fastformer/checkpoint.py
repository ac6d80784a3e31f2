"""Checkpoints: what one holds (`Checkpoint`), atomic saves, strict loads, keeping the last K, and averaging the last N
(the paper averages 5).

A leaf of the package: a checkpoint file is a plain dict of tensors and Python values, tagged with FORMAT so that a
foreign file is told apart from ours; `Checkpoint` is the one description of its entries, and nothing here knows the
model class.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import torch

FORMAT = "fastformer-checkpoint"
VERSION = 1
_NAME = re.compile(r"checkpoint_(\d+)\.pt")
# The checkpoint of the best validation score so far: never a step checkpoint, so never rotated out.
BEST_NAME = "checkpoint_best.pt"
# save_checkpoint's temp files for step and best checkpoints; one left behind was a save killed before its rename.
_RUN_TEMP_NAME = re.compile(r"\.checkpoint_(\d+|best)\.pt\..+\.tmp")


class DataPosition(TypedDict):
    """Where the training data stream stood, and what fixes its order (a resumed run must match the last three)."""

    epoch: int
    index: int
    seed: int
    batch_tokens: int
    world_size: int


class BestScore(TypedDict):
    """The best validation score of a run so far (`--best-metric`), and what --patience counts."""

    metric: str  # "bleu" (higher is better) or "loss" (lower is better)
    score: float
    step: int  # the step that scored it: the step of checkpoint_best.pt
    stale: int  # validations since, none of them better


class LowestLoss(TypedDict):
    """The lowest train loss a run logged so far, and what the loss-rise guard counts (`--max-loss-rise`)."""

    loss: float  # per target token, over one log interval of all ranks
    step: int  # the log line's step
    risen: int  # log lines in a row since, each more than --max-loss-rise above it


class LogInterval(TypedDict):
    """One rank's training since the last log line on the --log-every grid: a resumed run's first line on the grid
    covers the same updates as a run never stopped."""

    loss_sum: float  # summed label-smoothed loss
    tokens: int  # target tokens
    padded: int  # padded target positions


@dataclass
class Checkpoint:
    """What a checkpoint holds. Every checkpoint has the model; `fastformer train` also writes what resuming needs
    (the fields in RESUME_FIELDS); an averaged checkpoint drops the optimizer, schedule, RNG and data position."""

    model: dict[str, torch.Tensor]  # the model's state_dict, on the CPU
    config: dict  # TransformerConfig.to_dict()
    # The shared sentencepiece model's proto, or (fine-tuned from a Marian model) its tokenizer files by name.
    tokenizer: bytes | dict[str, bytes] | None = None
    step: int | None = None  # optimizer steps taken
    optimizer: dict | None = None  # the optimizer's state_dict
    schedule: dict | None = None  # the learning-rate scheduler's state_dict
    rng: list[dict] | None = None  # every rank's generator states, by rank
    data: DataPosition | None = None
    options: dict | None = None  # the TrainOptions of the run, as a dict
    best: BestScore | None = None  # the run's best validation score and the validations since
    lowest_loss: LowestLoss | None = None  # the run's lowest logged train loss and the risen log lines since
    validation_skipped: bool | None = None  # a signal's stop skipped this step's validation: a resumed run does it
    log_interval: list[LogInterval] | None = None  # every rank's, by rank
    averaged_from: list[str] | None = None  # the files an averaged checkpoint is the mean of

    RESUME_FIELDS = ("step", "optimizer", "schedule", "rng", "data", "tokenizer")

    def missing_for_resume(self) -> list[str]:
        return [name for name in self.RESUME_FIELDS if getattr(self, name) is None]

    def to_file_dict(self) -> dict:
        """-> the dict torch.save writes: the fields that are set, the tokenizer as a uint8 tensor (weights_only
        loading reads tensors), and the FORMAT/VERSION tag."""
        entries = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                   if getattr(self, field.name) is not None}
        if isinstance(self.tokenizer, bytes):
            entries["tokenizer"] = _bytes_tensor(self.tokenizer)
        elif self.tokenizer is not None:
            entries["tokenizer"] = {name: _bytes_tensor(data) for name, data in self.tokenizer.items()}
        return {**entries, "format": FORMAT, "version": VERSION}

    @classmethod
    def from_file_dict(cls, entries: dict, path: Path) -> Checkpoint:
        """The inverse of to_file_dict; a missing model/config or an entry the schema does not know raises an error
        naming path."""
        known = {field.name for field in dataclasses.fields(cls)}
        fields = {key: value for key, value in entries.items() if key not in ("format", "version")}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"{path} holds entries this fastformer does not know: {unknown}")
        for key in ("model", "config"):
            if key not in fields:
                raise ValueError(f"{path} is a fastformer checkpoint without {key!r}")
        if isinstance(fields.get("tokenizer"), torch.Tensor):
            fields["tokenizer"] = fields["tokenizer"].numpy().tobytes()
        elif isinstance(fields.get("tokenizer"), dict):
            fields["tokenizer"] = {name: data.numpy().tobytes() for name, data in fields["tokenizer"].items()}
        return cls(**fields)


def _bytes_tensor(data: bytes) -> torch.Tensor:
    """bytes as a uint8 tensor: what weights_only loading reads back."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class UnreadableCheckpointError(ValueError):
    """A file that torch cannot load at all, or whose weights are not finite: truncated or corrupt (a save killed
    mid-write on another filesystem, a disk error; fastformer never saves NaN or inf weights), as opposed to a
    readable file that is not a fastformer checkpoint."""


def checkpoint_path(directory: Path, step: int) -> Path:
    return Path(directory) / f"checkpoint_{step:08d}.pt"


def best_checkpoint_path(directory: Path) -> Path:
    return Path(directory) / BEST_NAME


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, quota, no permission); nothing of it is left on disk."""


def save_checkpoint(checkpoint: Checkpoint, path: Path) -> None:
    """Writes checkpoint to path atomically: a temp file in the same directory, fsync, then os.replace, so a crash or
    error mid-save leaves any existing file at path untouched. A failed write removes the temp file and raises
    CheckpointWriteError naming path, the bytes it needs and the bytes free there."""
    path = Path(path)
    entries = checkpoint.to_file_dict()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as error:
        raise _write_error(path, entries, error) from None
    try:
        # mkstemp creates the file private (0600); a checkpoint gets the permissions of any file the user writes.
        os.chmod(temp_name, 0o666 & ~current_umask())
        with os.fdopen(descriptor, "wb") as file:
            torch.save(entries, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp_name, path)
    except BaseException as error:
        os.unlink(temp_name)
        # torch.save reports a failed write as a RuntimeError raised while handling the file's OSError.
        cause = error
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__context__
        if cause is None or isinstance(error, CheckpointWriteError):
            raise
        raise _write_error(path, entries, cause) from None
    # The rename itself is durable only once the directory entry is on disk.
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


class _ByteCounter:
    """A write-only file that keeps only the number of bytes written to it."""

    def __init__(self) -> None:
        self.count = 0

    def write(self, data: bytes) -> int:
        self.count += len(data)
        return len(data)

    def flush(self) -> None:
        pass


def _write_error(path: Path, entries: dict, error: OSError) -> CheckpointWriteError:
    """-> the error of a failed save of entries to path, with the file's exact size (serialized again, to nowhere)."""
    counter = _ByteCounter()
    torch.save(entries, counter)
    existing = next((parent for parent in path.parents if parent.is_dir()), Path("."))
    free = shutil.disk_usage(existing).free
    written = CheckpointWriteError(f"cannot write checkpoint {path}: {error.strerror or error}; it needs "
                                   f"{counter.count:,} bytes and {existing} has {free:,} free; nothing was written, "
                                   f"the checkpoints already there are untouched")
    written.errno = error.errno
    return written


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu", mmap: bool = False) -> Checkpoint:
    """-> the checkpoint saved by save_checkpoint; a missing, corrupt or foreign file raises an error naming it
    (UnreadableCheckpointError for a file torch cannot load). mmap: its tensors are mapped from the file and read
    where used (the check that the weights are finite is then the caller's: check_finite)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory, not a checkpoint file")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        # weights_only: a checkpoint holds tensors and plain values only, so nothing in it can run code on load.
        entries = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint not found: {path} (removed as it was read)") from None
    except Exception as error:
        if "Weights only load failed" in str(error):
            # torch's message suggests weights_only=False: never for a file of unknown origin. Its detail follows
            # "WeightsUnpickler error:".
            detail = [line for line in str(error).partition("WeightsUnpickler error:")[2].splitlines() if line.strip()]
            raise UnreadableCheckpointError(f"{path} is not a fastformer checkpoint: torch.load cannot read it as "
                                            f"tensors and plain values ({detail[0].strip() if detail else 'no detail'})"
                                            ) from None
        raise UnreadableCheckpointError(
            f"{path} is not a readable checkpoint (corrupt or truncated?): "
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from None
    if not isinstance(entries, dict) or entries.get("format") != FORMAT:
        raise ValueError(f"{path} is not a fastformer checkpoint (no {FORMAT!r} tag)")
    if entries.get("version") != VERSION:
        raise ValueError(f"{path} has checkpoint version {entries.get('version')!r}; this fastformer reads {VERSION}")
    loaded = Checkpoint.from_file_dict(entries, path)
    if not mmap:
        check_finite(loaded, path)
    return loaded


def check_finite(loaded: Checkpoint, path: Path) -> None:
    """Raises UnreadableCheckpointError where a checkpoint's weights hold NaN or inf (or are not tensors)."""
    if not all(isinstance(tensor, torch.Tensor) for tensor in loaded.model.values()):
        raise UnreadableCheckpointError(f"{path} is not a fastformer checkpoint: its model holds values that are not "
                                        "tensors")
    name = non_finite_tensor(loaded.model)
    if name is not None:
        raise UnreadableCheckpointError(f"{path} holds values that are not finite (NaN or inf) in {name}: the file is "
                                        "corrupt (fastformer never saves such weights)")


def state_dict_error_line(error: Exception) -> str:
    """load_state_dict's error (a line per tensor: 63 for a model of another d_ff) -> its first three lines, and how
    many more, as one line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return " ".join(lines[:3]) + (f" (and {len(lines) - 3} more)" if len(lines) > 3 else "")


def non_finite_tensor(state: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor of a state_dict holding NaN or inf, or None."""
    return next((name for name, tensor in state.items()
                 if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())), None)


def is_step_checkpoint_name(path: Path) -> bool:
    """Whether path is named as a training run's step checkpoint (checkpoint_<step>.pt), which --resume takes."""
    return _NAME.fullmatch(Path(path).name) is not None


def list_checkpoints(directory: Path, up_to_step: int | None = None) -> list[Path]:
    """The step checkpoints in directory (of up_to_step or before, when given), oldest (lowest step) first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(match.group(1)), path) for path in directory.iterdir() if (match := _NAME.fullmatch(path.name))]
    return [path for step, path in sorted(found) if up_to_step is None or step <= up_to_step]


def newest_checkpoint(directory: Path) -> Path:
    """The newest step checkpoint in directory; none raises FileNotFoundError."""
    found = list_checkpoints(directory)
    if not found:
        raise FileNotFoundError(f"no checkpoint_*.pt in {directory}")
    return found[-1]


def load_newest_readable(directory: Path) -> tuple[Path, Checkpoint, list[tuple[Path, str]]]:
    """The newest step checkpoint in directory that torch can read -> (path, checkpoint, each newer one skipped and
    why). A file that is readable but foreign, or none readable at all, raises the newest file's error. A file gone
    since the listing (rank 0 of a resumed run renames the unreadable ones while the other ranks look) is skipped."""
    found = list_checkpoints(directory)
    if not found:
        raise FileNotFoundError(f"no checkpoint_*.pt in {directory}")
    skipped: list[tuple[Path, str]] = []
    for path in reversed(found):
        try:
            return path, load_checkpoint(path), skipped
        except (UnreadableCheckpointError, FileNotFoundError) as error:
            skipped.append((path, str(error)))
    raise UnreadableCheckpointError(f"no readable checkpoint in {directory}: " + "; ".join(why for _, why in skipped))


def remove_stale_temp_files(directory: Path) -> list[Path]:
    """Deletes the temp files of step- and best-checkpoint saves killed before their rename -> the deleted paths.
    Call this only in the run that holds the directory's lock (run_control.out_dir_lock), where it is not saving."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    stale = [path for path in directory.iterdir() if _RUN_TEMP_NAME.fullmatch(path.name)]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def prune_checkpoints(directory: Path, keep_last: int) -> None:
    """Deletes all but the newest keep_last step checkpoints, and any temp file a killed save left behind."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    for path in list_checkpoints(directory)[:-keep_last]:
        path.unlink()
    remove_stale_temp_files(directory)


def average_checkpoints(paths: list[Path]) -> Checkpoint:
    """-> a checkpoint whose floating-point model tensors are the mean over paths (accumulated in fp64); config,
    tokenizer, step and options come from the last path. It has no optimizer, schedule, RNG or data position: it is
    for inference."""
    if not paths:
        raise ValueError("average_checkpoints needs at least one checkpoint")
    # Mapped, not read: memory holds one checkpoint's weights at a time beside the sums (never an optimizer's state,
    # twice as large), and a file that a training run prunes meanwhile stays readable through its mapping.
    checkpoints: list[Checkpoint | None] = [load_checkpoint(path, mmap=True) for path in paths]
    last = checkpoints[-1]
    for path, loaded in zip(paths, checkpoints):
        if loaded.config != last.config:
            differing = ", ".join(f"{key} {loaded.config.get(key)} against {last.config.get(key)}"
                                  for key in sorted(loaded.config.keys() | last.config.keys())
                                  if loaded.config.get(key) != last.config.get(key))
            raise ValueError(f"{path} has another model config than {paths[-1]} ({differing}): cannot average them")
        if loaded.model.keys() != last.model.keys():
            raise ValueError(f"{path} has other parameter names than {paths[-1]}: cannot average them")
        if loaded.tokenizer != last.tokenizer:
            raise ValueError(f"{path} has another vocabulary (tokenizer) than {paths[-1]}: their embeddings' rows "
                             "are other tokens, so they cannot be averaged")
    dtypes = {name: tensor.dtype for name, tensor in last.model.items()}
    kept = {name: tensor.clone() for name, tensor in last.model.items() if not tensor.is_floating_point()}
    totals = {name: torch.zeros(tensor.shape, dtype=torch.float64) for name, tensor in last.model.items()
              if tensor.is_floating_point()}
    averaged = Checkpoint(model={}, config=last.config, tokenizer=last.tokenizer, step=last.step,
                          options=last.options, averaged_from=[str(path) for path in paths])
    del last, loaded
    for index, path in enumerate(paths):
        check_finite(checkpoints[index], path)
        for name, total in totals.items():
            total += checkpoints[index].model[name]
        checkpoints[index] = None  # the file's mapping released (its tensors share it)
    averaged.model = {name: kept[name] if name in kept else (totals[name] / len(paths)).to(dtype)
                      for name, dtype in dtypes.items()}
    return averaged
