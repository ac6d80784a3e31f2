"""What a training run measures, for people to look at: OUT_DIR/metrics.jsonl (one JSON object a line, for every log
line and every validation) and, with --tensorboard-logdir, the same scalars as TensorBoard event files.

A resumed run keeps the records up to the step it resumes from and drops the later ones (logged after the
checkpoint it resumes from, and logged again as it retrains those steps), and that step's validation where a stop
skipped it (the resumed run does it first), so no step is recorded twice; TensorBoard's purge_step does the same for
the event files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO

METRICS_FILE = "metrics.jsonl"
# The fields of a record that are not scalars to plot.
RECORD_KEYS = ("step", "epoch", "time")
TENSORBOARD_EXTRA = "pip install 'fastformer[tensorboard]' (or pip install tensorboard)"


def summary_writer_class() -> type:
    """torch's TensorBoard SummaryWriter; without the tensorboard package an ImportError that names the extra."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError(f"--tensorboard-logdir needs the tensorboard package, an optional extra: "
                          f"{TENSORBOARD_EXTRA}") from None
    return SummaryWriter


def read_records(path: Path) -> list[dict]:
    """The records of a metrics.jsonl, in order; a line cut short by a crash mid-write is left out."""
    records = []
    with open(path, encoding="utf-8") as file:
        for line in file:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def _keep_up_to(path: Path, step: int, validation_pending: bool) -> None:
    """Rewrites path (atomically) with only its records of steps up to `step`, less that step's validation where it is
    pending (the checkpoint resumed from skipped it: a record of it comes from a session after that checkpoint)."""
    def kept_record(record: dict) -> bool:
        validation = any(name.startswith("valid_") for name in record)
        return record["step"] < step or (record["step"] == step and not (validation_pending and validation))

    kept = [record for record in read_records(path) if kept_record(record)]
    temp = path.with_name(f".{path.name}.tmp")
    try:
        temp.write_text("".join(json.dumps(record) + "\n" for record in kept), encoding="utf-8")
        os.replace(temp, path)
    except OSError as error:
        temp.unlink(missing_ok=True)
        raise OSError(error.errno, f"cannot rewrite {path} for the resumed run: {error.strerror or error}; it is "
                                   "as it was") from None


class MetricsLog:
    """Rank 0's records of one run session: appended to out_dir/metrics.jsonl (its records past start_step dropped
    first, and start_step's validation where validation_pending) and written to TensorBoard when tensorboard_logdir
    is set. A context manager: closing flushes both."""

    def __init__(self, out_dir: Path, start_step: int, tensorboard_logdir: str | None,
                 validation_pending: bool = False) -> None:
        self.path = Path(out_dir) / METRICS_FILE
        writer_class = None if tensorboard_logdir is None else summary_writer_class()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_file():
            _keep_up_to(self.path, start_step, validation_pending)
        self.file: IO[str] = open(self.path, "a", encoding="utf-8")
        # purge_step: TensorBoard hides the events of the earlier sessions from start_step + 1 on.
        self.writer = None if writer_class is None else writer_class(tensorboard_logdir, purge_step=start_step + 1)

    def write(self, record: dict) -> None:
        """record: step, epoch, time (Unix seconds) and scalars; one line, flushed, so a crash keeps what was
        measured."""
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            for name, value in record.items():
                if name not in RECORD_KEYS and value is not None:
                    self.writer.add_scalar(name, value, record["step"], walltime=record["time"])
            self.writer.flush()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()
