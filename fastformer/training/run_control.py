"""Run control of `fastformer train`: a stop asked for by SIGTERM or SIGINT, one run per out-dir (an advisory lock),
and the divergence guards (a non-finite loss, gradient or weight stops the run; so does a finite loss that rose and
stays risen).

Beside checkpoint.py, which it reads: train.py calls these at its hook points (the update's token sum, logging,
saving) and the CLI at its start and end.
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

from fastformer import checkpoint
from fastformer.checkpoint import LowestLoss

# sysexits.h's EX_TEMPFAIL, "a temporary failure; the user is invited to retry": the run is unfinished and resumes
# from the checkpoint it wrote. It differs from 1 (an error to fix) and from 128 + signal (killed, nothing saved), so
# a job script can requeue exactly these runs.
EXIT_STOPPED = 75
LOCK_FILE = "train.lock"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """While entered, the first SIGTERM or SIGINT is only recorded (`received`, its name), for the loop to stop at an
    update boundary. In a process of its own the handler then restores the default actions, so a second signal (a
    second Ctrl-C) ends it at once. A torchrun worker keeps recording: a preemption (SLURM's scancel) signals every
    process, and torchrun forwards its own copy to its workers, so a worker gets two; torchrun's SIGKILL after
    --shutdown-timeout is its hard stop."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._previous: dict[signal.Signals, object] = {}
        self._repeat_ends_process = "TORCHELASTIC_RUN_ID" not in os.environ

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
        self.received = self.received or signal.Signals(number).name
        if self._repeat_ends_process:
            for other in STOP_SIGNALS:
                signal.signal(other, signal.SIG_DFL)

    def vote(self) -> float:
        """1.0 once this process got a signal: summed over the ranks with the update's token count."""
        return float(self.received is not None)


def stopped_message(step: int, path: Path, stopped_by: str, argv: list[str], world_size: int,
                    local_world_size: int) -> str:
    """The one line a stopped run ends with: where it stopped, its checkpoint, and the command (argv: the CLI's
    arguments) that resumes it; on several nodes, what each node's launch runs (its rendezvous options are the
    job's own)."""
    arguments = [arg for arg in argv if arg != "--overwrite"] + ([] if "--resume" in argv else ["--resume"])
    launcher = (["fastformer"] if world_size == 1 else
                ["torchrun", f"--nproc_per_node={local_world_size}", "--no-python", "fastformer"])
    command = shlex.join(launcher + arguments)
    resume = (f"resume with: {command}" if world_size == local_world_size else
              f"resume with the job's launch on each of its {world_size // local_world_size} nodes, running: "
              f"{command} (and the job's --nnodes and rendezvous options)")
    return f"fastformer {argv[0]}: stopped by {stopped_by} after step {step}; checkpoint {path}; {resume}"


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
            f"saved; {newest}. {_restart_advice(lr_scale, warmup)}")


def _restart_advice(lr_scale: float, warmup: int) -> str:
    return (f"Start again with a lower --lr-scale (this run: {lr_scale:g}) or a longer --warmup (this run: {warmup}), "
            f"with --overwrite or in another --out-dir (--resume keeps both options)")


class LossRiseGuard:
    """Stops a run whose loss diverged and stayed finite: a post-LN Transformer whose learning rate is too high can
    climb back towards the unigram loss and stay there, and with --keep-last its good checkpoints would rotate out.
    The run stops when the train loss of RISEN_LOG_LINES log lines in a row is more than max_rise nats above the
    lowest logged before them. Log lines average an interval over all ranks, so every rank stops at the same line;
    the state is part of every checkpoint, so a resumed run goes on counting."""

    RISEN_LOG_LINES = 3

    def __init__(self, max_rise: float, saved: LowestLoss | None = None) -> None:
        self.max_rise = max_rise  # 0: never stop
        self.state: LowestLoss | None = None if saved is None else LowestLoss(**saved)

    def observe(self, step: int, loss: float, out_dir: Path, lr_scale: float, warmup: int) -> None:
        """Takes a log line's train loss per token; raises DivergedError on the RISEN_LOG_LINES-th risen line."""
        if self.state is None or loss < self.state["loss"]:
            self.state = LowestLoss(loss=loss, step=step, risen=0)
            return
        if not self.max_rise or loss <= self.state["loss"] + self.max_rise:
            self.state["risen"] = 0
            return
        self.state["risen"] += 1
        if self.state["risen"] < self.RISEN_LOG_LINES:
            return
        before = checkpoint.list_checkpoints(out_dir, up_to_step=self.state["step"])
        newest = (f"the newest checkpoint of that step or before is {before[-1]}" if before
                  else "no checkpoint of that step or before is left")
        raise DivergedError(
            f"training diverged: the train loss was more than --max-loss-rise {self.max_rise:g} above its lowest, "
            f"{self.state['loss']:.3f} at step {self.state['step']}, for {self.RISEN_LOG_LINES} log lines in a row "
            f"up to step {step} (now {loss:.3f}); {newest}. {_restart_advice(lr_scale, warmup)}")
