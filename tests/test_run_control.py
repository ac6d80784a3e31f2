"""Run control of `fastformer train` against real processes: SIGTERM/SIGINT stop at an update boundary with a checkpoint
that resumes bit-exactly (1 rank and 2 torchrun ranks), one run per out-dir, a diverging run stopped before it saves
non-finite weights, and a checkpoint write that fails for want of space.

The runs reuse test_train.py's tiny preset, corpus slice and flags, with log lines on (the tests wait for one before
signalling, so that the signal lands in the training loop however slow the machine is).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fastformer import checkpoint
from fastformer.training import run_control
from fastformer.training.metrics import METRICS_FILE, read_records
from fastformer_process import run, start
from test_train import (TRAIN_FLAGS, _assert_same_tensors, _fail, _resumed_and_straight, _run, data_dir,  # noqa: F401
                        measured_records)

# Log lines on stdout after every update; everything else as test_train.py trains.
LOGGED_FLAGS = [flag for flag in TRAIN_FLAGS if flag != "--quiet"] + ["--log-every", "1"]
STOPPED_LINE = re.compile(r"fastformer train: stopped by (.+) after step (\d+); checkpoint (\S+); resume with: (.+)")


def _wait_for_log_line(process: subprocess.Popen, prefix: str, stderr: Path) -> None:
    """Reads the process's stdout until a line starts with prefix; its end first fails the test."""
    for line in process.stdout:
        if line.startswith(prefix):
            return
    process.wait()
    pytest.fail(f"the run ended (rc {process.returncode}) before logging {prefix!r}:\n{stderr.read_text()}")


def _stopped_line(stderr: str) -> re.Match:
    matches = [match for line in stderr.splitlines() if (match := STOPPED_LINE.fullmatch(line.split("\r")[-1]))]
    assert len(matches) == 1, f"one stop line expected:\n{stderr}"
    return matches[0]


def _rank_pid(launcher: int, rank: int) -> int:
    """The pid of torchrun's (pid launcher) worker of this rank, found by its parent and its RANK variable."""
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environment = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if parent == launcher and f"RANK={rank}".encode() in environment:
            return int(entry.name)
    raise AssertionError(f"no rank {rank} worker under torchrun (pid {launcher})")


def _assert_resumed_equals_straight(resumed: checkpoint.Checkpoint, straight: checkpoint.Checkpoint) -> None:
    assert resumed.data == straight.data and resumed.schedule == straight.schedule
    assert resumed.best == straight.best, "the best score and the validations since it (--patience's count)"
    _assert_same_tensors(resumed.model, straight.model, "resumed vs straight")
    for index, state in straight.optimizer["state"].items():
        _assert_same_tensors(resumed.optimizer["state"][index], state, f"Adam state of parameter {index}")


def _stopped_and_resumed(flags: list[str], tmp_path: Path, steps: int, ranks: int,
                         send_signal: Callable[[subprocess.Popen], None]) -> tuple:
    """Starts training to `steps` in tmp_path/split, send_signal(process) once it logged step 2, waits for its end,
    then resumes to `steps` and trains `steps` straight in tmp_path/straight (_resumed_and_straight) -> (the
    process's exit status, its stop line's (cause, step, checkpoint, command), the checkpoint it stopped with, the
    resumed and the straight last checkpoints)."""
    split, straight = tmp_path / "split", tmp_path / "straight"
    stopped: dict = {}

    def signalled_leg() -> None:
        process = start(flags + ["--out-dir", str(split), "--max-steps", str(steps)], tmp_path, tmp_path / "err",
                        ranks=ranks)
        _wait_for_log_line(process, "step 2 |", tmp_path / "err")
        send_signal(process)
        process.communicate(timeout=240)
        stopped["returncode"] = process.returncode
        stopped["line"] = _stopped_line((tmp_path / "err").read_text()).groups()
        # Read now: the resumed run's --keep-last rotation removes it.
        stopped["saved"] = checkpoint.load_checkpoint(checkpoint.newest_checkpoint(split))

    resumed, reference = _resumed_and_straight(flags, split, straight, steps, ranks=ranks, first_leg=signalled_leg)
    cause, step, path, command = stopped["line"]
    assert 2 <= int(step) < steps
    assert Path(path) == checkpoint.checkpoint_path(split, int(step)) and stopped["saved"].step == int(step)
    return stopped["returncode"], stopped["line"], resumed, reference


def test_sigterm_stops_after_an_update_with_a_checkpoint_that_resumes_exactly(data_dir: Path, tmp_path: Path):
    """SIGTERM to a real `fastformer train` once it trains: it finishes the update, saves, prints where it stopped and
    the command that resumes it, exits EXIT_STOPPED; that command trains on to the same weights as a run never
    stopped."""
    flags, steps = LOGGED_FLAGS + ["--data-dir", str(data_dir)], 12
    returncode, (cause, _, _, command), resumed, reference = _stopped_and_resumed(
        flags, tmp_path, steps, ranks=1, send_signal=lambda process: process.send_signal(signal.SIGTERM))
    assert returncode == run_control.EXIT_STOPPED and cause == "SIGTERM"
    # The printed command is the one _resumed_and_straight ran to resume.
    assert command == shlex.join(["fastformer"] + flags + ["--out-dir", str(tmp_path / "split"), "--max-steps",
                                                           str(steps), "--resume"])
    _assert_resumed_equals_straight(resumed, reference)
    # Every step logged once, with the numbers of the run never stopped.
    assert measured_records(tmp_path / "split") == measured_records(tmp_path / "straight")


def test_a_signal_to_one_torchrun_rank_stops_every_rank_after_the_same_update(data_dir: Path, tmp_path: Path):
    """SIGTERM to rank 1 alone: rank 0, never signalled, stops after the same update (the stop vote rides on the
    update's token all-reduce) and writes the checkpoint; resuming on 2 ranks reaches the straight run's weights."""
    flags = LOGGED_FLAGS + ["--data-dir", str(data_dir), "--valid-every", "0"]
    returncode, (cause, _, _, command), resumed, reference = _stopped_and_resumed(
        flags, tmp_path, 8, ranks=2, send_signal=lambda launcher: os.kill(_rank_pid(launcher.pid, 1), signal.SIGTERM))
    assert returncode != 0, "torchrun reports its workers' EXIT_STOPPED as a failure"
    assert cause == "a signal to another rank"
    assert command.startswith("torchrun --nproc_per_node=2 --no-python fastformer train ")
    _assert_resumed_equals_straight(resumed, reference)


def test_a_preemption_signalling_every_process_stops_every_rank_with_a_checkpoint(data_dir: Path, tmp_path: Path):
    """SLURM's preemption signals every process of the job, and torchrun forwards its own SIGTERM to its workers: each
    worker gets two. The second must not kill it mid-update or mid-save: the run stops with its checkpoint and
    resumes to the straight run's weights."""
    flags = LOGGED_FLAGS + ["--data-dir", str(data_dir), "--valid-every", "0"]

    def preempt(launcher: subprocess.Popen) -> None:
        for rank in (0, 1):
            os.kill(_rank_pid(launcher.pid, rank), signal.SIGTERM)
        launcher.send_signal(signal.SIGTERM)

    _, (cause, _, _, _), resumed, reference = _stopped_and_resumed(flags, tmp_path, 8, ranks=2, send_signal=preempt)
    assert cause == "SIGTERM"
    _assert_resumed_equals_straight(resumed, reference)


@pytest.mark.parametrize("torchrun_worker", [False, True])
def test_a_repeated_stop_signal_ends_a_lone_process_and_not_a_torchrun_worker(torchrun_worker: bool):
    """Two SIGTERMs inside StopSignals: a process of its own ends at the second (a second Ctrl-C forces the end); a
    torchrun worker (TORCHELASTIC_RUN_ID set) records the first and lives on to stop at an update boundary."""
    code = ("import os, signal\n"
            "from fastformer.training import run_control\n"
            "with run_control.StopSignals() as signals:\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    print(signals.received)\n")
    environment = {key: value for key, value in os.environ.items() if key != "TORCHELASTIC_RUN_ID"}
    if torchrun_worker:
        environment["TORCHELASTIC_RUN_ID"] = "none"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=120)
    if torchrun_worker:
        assert done.returncode == 0 and done.stdout == "SIGTERM\n", done.stderr
    else:
        assert done.returncode == -signal.SIGINT and done.stdout == ""


def test_the_resume_command_of_a_multi_node_run_names_each_nodes_launch():
    argv = ["train", "--out-dir", "runs/big"]
    one_node = run_control.stopped_message(7, Path("c.pt"), "SIGTERM", argv, world_size=8, local_world_size=8)
    assert one_node.endswith("resume with: torchrun --nproc_per_node=8 --no-python fastformer train --out-dir "
                             "runs/big --resume")
    two_nodes = run_control.stopped_message(7, Path("c.pt"), "SIGTERM", argv, world_size=16, local_world_size=8)
    assert two_nodes.endswith("resume with the job's launch on each of its 2 nodes, running: torchrun "
                              "--nproc_per_node=8 --no-python fastformer train --out-dir runs/big --resume (and the "
                              "job's --nnodes and rendezvous options)")


@pytest.mark.parametrize("raised, status, stderr", [
    ("pass", 0, ""),
    ("raise SystemExit(run_control.EXIT_STOPPED)", run_control.EXIT_STOPPED, ""),
    ("raise SystemExit('fastformer train: error: out of space')", 1, "fastformer train: error: out of space\n"),
    ("raise RuntimeError('unexpected')", 1, "RuntimeError: unexpected\n"),
])
def test_a_torchrun_worker_exits_with_pythons_status_and_without_finalizing(raised: str, status: int, stderr: str):
    """_exit_torchrun_worker, called as main() calls it: the status and stderr Python itself would give (a traceback
    for an unexpected error), stdout flushed, and nothing after it: no atexit handler runs, as the interpreter is not
    finalized, so no gloo worker thread can meet a finalizing one."""
    code = "\n".join(["import atexit, sys", "from fastformer.training import run_control",
                      "from fastformer.__main__ import _exit_torchrun_worker",
                      "atexit.register(print, 'finalized')", "print('trained', end='')",
                      "try:", f"    {raised}", "finally:", "    _exit_torchrun_worker(sys.exc_info()[1])"])
    done = run(["-c", code], module=False)
    assert (done.returncode, done.stdout) == (status, "trained")
    assert done.stderr.endswith(stderr) and ("Traceback" in done.stderr) == ("RuntimeError" in raised), done.stderr


def test_the_first_signal_is_recorded_and_a_second_one_kills(tmp_path: Path):
    """In a child process: the first SIGTERM sets `received` and the process lives on; the second ends it at once."""
    code = ("import os, signal, sys, time\n"
            "from fastformer.training.run_control import StopSignals\n"
            "with StopSignals() as signals:\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(0.1)\n"
            "    print(signals.received, flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    time.sleep(60)\n")
    done = run(["-c", code], module=False, timeout=60)
    assert done.stdout == "SIGTERM\n" and done.returncode == -signal.SIGTERM, done.stderr
    previous = signal.getsignal(signal.SIGINT)
    with run_control.StopSignals() as signals:
        assert signal.getsignal(signal.SIGINT) != previous
    assert signal.getsignal(signal.SIGINT) is previous and signals.received is None, "handlers restored on exit"


def test_one_run_per_out_dir_and_a_killed_runs_lock_never_blocks(data_dir: Path, tmp_path: Path):
    """A second torchrun launch on a busy out-dir is refused naming the holder's pid and host; translate reads the
    busy out-dir's checkpoints without the lock; after the holder is SIGKILLed, --resume runs."""
    out_dir = tmp_path / "run"
    flags = LOGGED_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(out_dir), "--save-every", "1",
                            "--valid-every", "0"]
    holder = start(flags + ["--max-steps", "100000"], tmp_path, tmp_path / "err")
    try:
        _wait_for_log_line(holder, "step 2 |", tmp_path / "err")
        refused = run(flags + ["--max-steps", "4", "--resume"], ranks=2)
        assert refused.returncode != 0
        assert (f"fastformer train: error: {out_dir} is in use by pid {holder.pid} on host {socket.gethostname()} "
                f"(it holds {out_dir / run_control.LOCK_FILE})") in refused.stderr, refused.stderr
        translated = run(["translate", "--out-dir", str(out_dir), "--device", "cpu", "--beam", "1"], stdin="Hello.\n")
        assert translated.returncode == 0 and translated.stdout.count("\n") == 1, translated.stderr
    finally:
        holder.kill()
        holder.communicate(timeout=60)
    newest = checkpoint.list_checkpoints(out_dir)[-1]
    step = checkpoint.load_checkpoint(newest).step
    _run(flags + ["--max-steps", str(step + 1), "--resume", "--quiet"])
    assert checkpoint.load_checkpoint(checkpoint.checkpoint_path(out_dir, step + 1)).step == step + 1


def _all_finite(path: Path) -> bool:
    return all(torch.isfinite(tensor).all() for tensor in checkpoint.load_checkpoint(path).model.values()
               if tensor.is_floating_point())


def test_a_diverging_run_stops_naming_the_newest_finite_checkpoint(data_dir: Path, tmp_path: Path):
    """--lr-scale 1e6: the run stops with one line naming the steps, the newest finite checkpoint and the options to
    change; no checkpoint of non-finite weights is written, and --keep-last 1 kept the finite one. (The loss-rise
    guard, off here, would stop the run earlier, on a finite loss.)"""
    out_dir = tmp_path / "run"
    stderr = _fail(TRAIN_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(out_dir), "--lr-scale", "1e6",
                                  "--save-every", "1", "--keep-last", "1", "--valid-every", "0", "--max-steps", "40",
                                  "--max-loss-rise", "0"])
    assert stderr.count("\n") == 1, stderr
    match = re.search(r"became non-finite \(nan/inf\) (?:at|between) step (\d+)(?: and step (\d+))?, so nothing of "
                      r"it was saved; the newest finite checkpoint is (\S+)\. Start again with a lower --lr-scale "
                      r"\(this run: 1e\+06\) or a longer --warmup \(this run: 4\)", stderr)
    assert match, stderr
    first, last, newest = int(match.group(1)), int(match.group(2) or match.group(1)), Path(match.group(3))
    assert first <= last < 40
    assert checkpoint.list_checkpoints(out_dir) == [newest] == [checkpoint.checkpoint_path(out_dir, first - 1)]
    assert _all_finite(newest)


def _first_stop_by_rise(losses: list[float], max_rise: float) -> int | None:
    """Brute force of --max-loss-rise's rule: the first log line ending 3 in a row each more than max_rise above the
    lowest line before them, or None."""
    return next((end for end in range(3, len(losses))
                 if all(loss > min(losses[:end - 2]) + max_rise for loss in losses[end - 2:end + 1])), None)


def test_the_loss_rise_guard_stops_where_brute_force_says(tmp_path: Path):
    """Random loss curves (drifting, with spikes): the guard raises at the line brute force picks, naming the newest
    checkpoint of the lowest line's step or before; with max_rise 0 it never raises."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        steps = torch.randint(1, 4, (25,), generator=generator).cumsum(0).tolist()
        losses = (6.0 + torch.randn(25, generator=generator).cumsum(0) * 0.8).tolist()
        out_dir = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        out_dir.mkdir()
        for step in steps[::3]:
            checkpoint.checkpoint_path(out_dir, step).touch()
        expected = _first_stop_by_rise(losses, 2.0)
        guard, never = run_control.LossRiseGuard(2.0), run_control.LossRiseGuard(0.0)
        stopped = None
        for line, (step, loss) in enumerate(zip(steps, losses)):
            never.observe(step, loss, out_dir, 1.0, 4000)
            try:
                guard.observe(step, loss, out_dir, 1.0, 4000)
            except run_control.DivergedError as error:
                stopped, message = line, str(error)
                break
        assert stopped == expected, losses
        if stopped is not None:
            lowest_line = min(range(stopped - 2), key=lambda index: (losses[index], index))
            lowest_step = steps[lowest_line]
            before = [path for path in checkpoint.list_checkpoints(out_dir)
                      if int(path.stem.split("_")[1]) <= lowest_step]
            assert f"{losses[lowest_line]:.3f} at step {lowest_step}, for 3 log lines in a row up to step " \
                   f"{steps[stopped]}" in message
            assert (f"is {before[-1]}." if before else "no checkpoint of that step or before is left") in message


def test_a_loss_that_rises_and_stays_finite_stops_the_run(data_dir: Path, tmp_path: Path):
    """--lr-scale 100 sends the loss far above its first log line without reaching inf: the run stops in one line at
    the third risen line (the metrics say which), before saving that step; the checkpoints carry the guard's state."""
    out_dir = tmp_path / "run"
    flags = [flag for flag in TRAIN_FLAGS if flag not in ("--lr-scale", "4", "--warmup")]
    stderr = _fail(flags + ["--data-dir", str(data_dir), "--out-dir", str(out_dir), "--lr-scale", "100", "--warmup",
                            "10", "--log-every", "5", "--save-every", "5", "--keep-last", "100", "--valid-every",
                            "0", "--max-steps", "200"])
    assert stderr.count("\n") == 1, stderr
    records = read_records(out_dir / METRICS_FILE)
    losses = [record["train_loss"] for record in records]
    stop = _first_stop_by_rise(losses, 2.0)
    assert stop == len(losses) - 1, losses
    lowest = min(range(stop - 2), key=lambda index: (losses[index], index))
    assert (f"training diverged: the train loss was more than --max-loss-rise 2 above its lowest, "
            f"{losses[lowest]:.3f} at step {records[lowest]['step']}, for 3 log lines in a row up to step "
            f"{records[stop]['step']} (now {losses[stop]:.3f}); the newest checkpoint of that step or before is "
            f"{checkpoint.checkpoint_path(out_dir, records[lowest]['step'])}. Start again with a lower --lr-scale "
            f"(this run: 100)") in stderr
    saved = checkpoint.list_checkpoints(out_dir)
    assert saved[-1] == checkpoint.checkpoint_path(out_dir, records[stop - 1]["step"])
    state = checkpoint.load_checkpoint(saved[-1]).lowest_loss
    assert state == {"loss": losses[lowest], "step": records[lowest]["step"], "risen": 2}


def test_a_checkpoint_that_does_not_fit_names_its_size_and_leaves_the_previous_one(data_dir: Path, tmp_path: Path):
    """A resumed run whose file size limit (RLIMIT_FSIZE: a real write error from the kernel, as a full disk gives)
    is below a checkpoint's size: one line naming the path and the bytes it needs; the previous checkpoint loads."""
    out_dir = tmp_path / "run"
    flags = TRAIN_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(out_dir), "--valid-every", "0"]
    _run(flags + ["--max-steps", "2"])
    previous = checkpoint.checkpoint_path(out_dir, 2)
    size = previous.stat().st_size
    limited = ("import resource, runpy, signal, sys\n"
               "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
               f"resource.setrlimit(resource.RLIMIT_FSIZE, ({size // 2}, {size // 2}))\n"
               "sys.argv = ['fastformer'] + sys.argv[1:]\n"
               "runpy.run_module('fastformer', run_name='__main__')\n")
    done = run(["-c", limited] + flags + ["--max-steps", "4", "--resume"], module=False)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    match = re.search(rf"cannot write checkpoint {re.escape(str(checkpoint.checkpoint_path(out_dir, 4)))}: File too "
                      r"large; it needs ([\d,]+) bytes", done.stderr)
    assert match, done.stderr
    assert sorted(path.name for path in out_dir.iterdir()) == [previous.name, METRICS_FILE, run_control.LOCK_FILE]
    assert checkpoint.load_checkpoint(previous).step == 2
    # Without the limit the same resume writes the file the error sized.
    _run(flags + ["--max-steps", "4", "--resume"])
    assert checkpoint.checkpoint_path(out_dir, 4).stat().st_size == int(match.group(1).replace(",", ""))


def test_max_minutes_stops_after_an_update_with_exit_status_0(data_dir: Path, tmp_path: Path):
    """The time budget's vote rides on the same all-reduce as a signal's, but it is a normal end: status 0."""
    out_dir = tmp_path / "run"
    done = run(TRAIN_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(out_dir), "--valid-every", "0",
                              "--max-minutes", "0.02", "--max-steps", "100000"])
    assert done.returncode == 0, done.stderr
    saved = checkpoint.load_checkpoint(checkpoint.list_checkpoints(out_dir)[-1])
    assert 1 <= saved.step < 100000
    assert f"trained {saved.step} steps (of 100000: --max-minutes 0.02 stopped it)" in done.stdout
