"""Run control of `fastformer train`: a stop asked for by SIGTERM or SIGINT, one run per out-dir (an advisory lock),
and the divergence guard (a non-finite loss, gradient or weight stops the run).

A leaf beside checkpoint.py: train.py calls these at its hook points (the update's token sum, logging, saving) and the
CLI at its start and end.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shlex
import signal
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch

# sysexits.h's EX_TEMPFAIL, "a temporary failure; the user is invited to retry": the run is unfinished and resumes
# from the checkpoint it wrote. It differs from 1 (an error to fix) and from 128 + signal (killed, nothing saved), so
# a job script can requeue exactly these runs.
EXIT_STOPPED = 75
LOCK_FILE = "train.lock"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """While entered, the first SIGTERM or SIGINT is only recorded (`received`, its name), for the loop to stop at an
    update boundary; its handler then restores the default actions, so a second signal ends the process at once."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[signal.Signals, object] = {}

    def __enter__(self) -> StopSignals:
        # Python runs signal handlers in the main thread only, and only it may install them.
        if threading.current_thread() is threading.main_thread():
            self._previous = {number: signal.signal(number, self._handle) for number in STOP_SIGNALS}
        return self

    def __exit__(self, *exc_info: object) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous = {}

    def _handle(self, number: int, frame: object) -> None:
        self.received = signal.Signals(number).name
        for other in STOP_SIGNALS:
            signal.signal(other, signal.SIG_DFL)

    def vote(self) -> float:
        """1.0 once this process got a signal: summed over the ranks with the update's token count."""
        return float(self.received is not None)


def stopped_message(step: int, path: Path, stopped_by: str, argv: list[str], world_size: int) -> str:
    """The one line a stopped run ends with: where it stopped, its checkpoint, and the command (argv: the CLI's
    arguments) that resumes it."""
    arguments = [arg for arg in argv if arg != "--overwrite"] + ([] if "--resume" in argv else ["--resume"])
    launcher = ["fastformer"] if world_size == 1 else ["torchrun", f"--nproc_per_node={world_size}", "--no-python",
                                                       "fastformer"]
    return (f"fastformer {argv[0]}: stopped by {stopped_by} after step {step}; checkpoint {path}; resume with: "
            f"{shlex.join(launcher + arguments)}")


class OutDirInUseError(OSError):
    """Another live process holds the out-dir's lock."""


@contextlib.contextmanager
def out_dir_lock(out_dir: Path, rank: int) -> Iterator[None]:
    """Rank 0 holds an exclusive flock on out_dir/train.lock for the block, with its pid and host written in the file;
    a lock held by another process is an OutDirInUseError naming it. The OS drops the lock when its holder dies,
    however it dies, so a killed run's lock file never blocks.

    Only rank 0 locks: it is the one process that writes to out_dir, and every other rank reads a checkpoint only
    after joining the process group, which waits for rank 0, which joins only once it holds the lock. A second
    torchrun launch on the same out_dir fails on its rank 0 and torchrun stops its other ranks."""
    if rank != 0:
        yield
        return
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK_FILE
    # No O_TRUNC: the holder's pid and host must survive a refused opener. The file stays after the run: unlinking
    # it would let a third process lock a new file while a second still waits on the old one.
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(descriptor, 256, 0).decode(errors="replace").strip() or "another process"
            raise OutDirInUseError(f"{out_dir} is in use by {holder} (it holds {path}): wait for that run to end or "
                                   f"stop it, or use another --out-dir") from None
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        yield
    finally:
        os.close(descriptor)


class DivergedError(ValueError):
    """The loss, a gradient or a weight became non-finite."""


class DivergenceGuard:
    """Watches for a non-finite loss, gradient or weight without a host sync per step: each update folds isfinite of
    its loss sum and of its gradients' largest magnitude into one boolean on the device, which `check` reads only
    where the loop syncs anyway (logging, validation, checkpointing, the end)."""

    def __init__(self, device: torch.device, checked_step: int) -> None:
        self.finite = torch.ones((), dtype=torch.bool, device=device)
        self.checked_step = checked_step  # the last step a check found finite

    def observe(self, scalar: torch.Tensor | None = None, tensors: Iterable[torch.Tensor] = ()) -> None:
        """scalar: [] (a loss sum, a gradient norm) and tensors (gradients or weights): any shape; queued on their
        device, never read here."""
        if scalar is not None:
            self.finite &= torch.isfinite(scalar)
        tensors = [tensor.detach() for tensor in tensors]
        if tensors:
            # The largest magnitude is non-finite exactly when an element is; a 2-norm could overflow on finite ones.
            self.finite &= torch.isfinite(torch.nn.utils.get_total_norm(tensors, norm_type=float("inf")))

    def check(self, step: int, sum_over_ranks: Callable[[list[float]], list[float]], newest_checkpoint: Path | None,
              lr_scale: float, warmup: int) -> None:
        """Raises DivergedError, on every rank alike, when any rank saw a non-finite value since the last check."""
        if sum_over_ranks([float(not self.finite.item())])[0] == 0:
            self.checked_step = step
            return
        newest = (f"the newest finite checkpoint is {newest_checkpoint}" if newest_checkpoint is not None
                  else "no checkpoint was written")
        steps = (f"at step {step}" if step == self.checked_step + 1
                 else f"between step {self.checked_step + 1} and step {step}")
        raise DivergedError(
            f"training diverged: the loss or a gradient became non-finite (nan/inf) {steps}, so nothing of it was "
            f"saved; {newest}. Start again with a lower "
            f"--lr-scale (this run: {lr_scale:g}) or a longer --warmup (this run: {warmup}), with --overwrite or in "
            f"another --out-dir (--resume keeps both options)")
