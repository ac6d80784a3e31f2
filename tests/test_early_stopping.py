"""The best checkpoint and early stopping of `fastformer train`: checkpoint_best.pt is the step of the best validation
score, --patience ends a run that stops improving as --max-steps would, and what they need is checked before any
work; a SIGTERM stop and --resume keep the best score, --patience's count and metrics.jsonl exactly."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fastformer import checkpoint
from fastformer.training import run_control
from fastformer.training.metrics import METRICS_FILE, read_records
from fastformer_process import run
from test_train import TRAIN_FLAGS, _assert_same_tensors, _fail, _run, data_dir, measured_records  # noqa: F401

NO_RISE_GUARD = ["--max-loss-rise", "0"]  # --lr-scale 30 sends the train loss up on purpose


def test_the_best_checkpoint_is_the_step_of_the_lowest_validation_loss(data_dir: Path, tmp_path: Path):
    """A run validated after every update with a learning rate high enough that its loss goes up and down: the best
    checkpoint holds the weights of the step whose validation loss was lowest, and every checkpoint counts the
    validations since."""
    out_dir = tmp_path / "run"
    _run(TRAIN_FLAGS + NO_RISE_GUARD + ["--data-dir", str(data_dir), "--out-dir", str(out_dir), "--max-steps", "8",
                                        "--valid-every", "1", "--save-every", "1", "--keep-last", "8", "--best-metric",
                                        "loss", "--lr-scale", "30"])
    losses = {record["step"]: record["valid_nll"] for record in read_records(out_dir / METRICS_FILE)
              if "valid_nll" in record}
    assert sorted(losses) == list(range(1, 9))
    best_step = min(losses, key=lambda step: (losses[step], step))
    assert best_step != 8, f"the loss should rise again after its best: {losses}"
    best = checkpoint.load_checkpoint(checkpoint.best_checkpoint_path(out_dir))
    assert best.step == best_step and best.best == {"metric": "loss", "score": losses[best_step], "step": best_step,
                                                    "stale": 0}
    _assert_same_tensors(best.model, checkpoint.load_checkpoint(checkpoint.checkpoint_path(out_dir, best_step)).model,
                         "checkpoint_best.pt vs the step checkpoint")
    last = checkpoint.load_checkpoint(checkpoint.checkpoint_path(out_dir, 8))
    assert last.best == {**best.best, "stale": 8 - best_step}


def test_patience_ends_a_frozen_run_after_that_many_validations(data_dir: Path, tmp_path: Path):
    """--lr-scale 0: the weights never change, so no validation after the first is better; --patience 3 ends the run
    after validations 2, 3 and 4 (steps 4, 6, 8) with status 0, a final checkpoint and a line saying why."""
    out_dir = tmp_path / "run"
    done = run(TRAIN_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(out_dir), "--max-steps", "1000",
                              "--lr-scale", "0", "--save-every", "0", "--patience", "3"])
    assert done.returncode == 0, done.stderr
    best_path = checkpoint.best_checkpoint_path(out_dir)
    assert (f"fastformer train: stopped at step 8: 3 validations in a row without a better valid bleu (--patience 3); "
            f"best: step 2, valid bleu ") in done.stdout and done.stdout.splitlines()[0].endswith(f", {best_path}")
    assert checkpoint.list_checkpoints(out_dir) == [checkpoint.checkpoint_path(out_dir, 8)]
    final = checkpoint.load_checkpoint(checkpoint.checkpoint_path(out_dir, 8))
    assert final.best["step"] == 2 and final.best["stale"] == 3 and final.best["metric"] == "bleu"
    assert checkpoint.load_checkpoint(best_path).step == 2


def test_what_the_best_checkpoint_and_patience_need_is_checked_before_any_work(data_dir: Path, tmp_path: Path):
    out_dir = tmp_path / "run"
    flags = TRAIN_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(out_dir), "--max-steps", "2"]
    for bad, message in (
            (["--valid-every", "0", "--patience", "2"],
             "--patience 2 counts validations, and --valid-every 0 runs none: set --valid-every"),
            (["--valid-bleu-sentences", "0", "--best-metric", "bleu"],
             "--best-metric bleu needs a validation BLEU, and --valid-bleu-sentences 0 computes none"),
            (["--best-metric", "chrf"], "best_metric must be one of ('bleu', 'loss'), got 'chrf'")):
        stderr = _fail(flags + bad)
        assert message in stderr and stderr.count("\n") == 1, stderr
        assert not out_dir.exists()


def test_a_fresh_run_refuses_an_old_best_checkpoint_and_overwrite_removes_it(data_dir: Path, tmp_path: Path):
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    checkpoint.best_checkpoint_path(out_dir).write_bytes(b"an old run's best")
    flags = TRAIN_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(out_dir), "--max-steps", "1",
                           "--valid-every", "0"]
    assert "already holds checkpoints (checkpoint_best.pt)" in _fail(flags)
    done = run(flags + ["--overwrite"])
    assert done.returncode == 0, done.stderr
    assert not checkpoint.best_checkpoint_path(out_dir).exists()


def test_overwrite_deletes_nothing_when_the_new_run_cannot_start(data_dir: Path, tmp_path: Path):
    """Every option is checked, and --init-from's model read, before --overwrite deletes the old checkpoints."""
    out_dir = tmp_path / "run"
    flags = TRAIN_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(out_dir), "--max-steps", "1",
                           "--valid-every", "0"]
    _run(flags)
    old = {path: path.read_bytes() for path in out_dir.glob("checkpoint_*.pt")}
    newest = checkpoint.list_checkpoints(out_dir)[-1]
    for bad, message in [(["--lr-scale", "-5"], "Invalid learning rate"), (["--max-len", "5000"], "lower --max-len"),
                         (["--batch-tokens", "5"], "below the longest sequence"),
                         (["--init-from", str(newest)], "is one of the checkpoints --overwrite would delete")]:
        assert message in _fail(flags + ["--overwrite"] + bad)
        assert {path: path.read_bytes() for path in out_dir.glob("checkpoint_*.pt")} == old, bad


# `fastformer ARGS` whose process sends itself a SIGTERM at the end of update STOP - 1: the stop vote of update STOP
# carries it, so the run stops after update STOP, whatever the machine's speed.
SIGNALLED_RUN = """import os, runpy, signal, sys
from fastformer.training import trainer
update = trainer.Trainer._update
def update_then_signal(self):
    result = update(self)
    if self.step == {stop} - 1:
        os.kill(os.getpid(), signal.SIGTERM)
    return result
trainer.Trainer._update = update_then_signal
sys.argv = ['fastformer'] + sys.argv[1:]
runpy.run_module('fastformer', run_name='__main__')
"""
# The same, the SIGTERM sent during the validation of step STOP instead: validation translates one sentence at a
# time, and the signal comes as the CHUNK-th of the step's 2 translations starts: the first cuts validation short,
# the last lets it end.
SIGNALLED_IN_VALIDATION = """import os, runpy, signal, sys
from fastformer.training import trainer
from fastformer.translation.translator import Translator
trainer.VALID_CHUNK_SENTENCES = 1
translate = Translator.translate
calls = []
def signal_then_translate(self, *args, **kwargs):
    calls.append(None)
    if len(calls) == 2 * ({stop} // 2 - 1) + {chunk}:
        os.kill(os.getpid(), signal.SIGTERM)
    return translate(self, *args, **kwargs)
Translator.translate = signal_then_translate
sys.argv = ['fastformer'] + sys.argv[1:]
runpy.run_module('fastformer', run_name='__main__')
"""


@pytest.mark.parametrize("stop, extra, patience_step, runner", [
    (4, ["--lr-scale", "30", "--best-metric", "loss"] + NO_RISE_GUARD, None, SIGNALLED_RUN),
    (6, ["--lr-scale", "0", "--patience", "2"], 6, SIGNALLED_RUN),
    (4, ["--lr-scale", "30", "--best-metric", "loss"] + NO_RISE_GUARD, None, SIGNALLED_IN_VALIDATION),
])
def test_a_stop_at_a_validation_step_and_resume_keep_the_best_and_the_records_exact(
        data_dir: Path, tmp_path: Path, stop: int, extra: list[str], patience_step: int | None, runner: str):
    """SIGTERM lands on a validation step, whose validation the stop skips (or cuts short: a long one would outlast
    torchrun's --shutdown-timeout); --resume does it first, so the best score, --patience's count,
    checkpoint_best.pt and metrics.jsonl are those of a run never stopped (with --patience 2 on a frozen model, that
    resumed validation is the one that ends the run)."""
    flags = TRAIN_FLAGS + ["--data-dir", str(data_dir), "--max-steps", "8", "--save-every", "4"] + extra
    split, straight = tmp_path / "split", tmp_path / "straight"
    stopped = run(["-c", runner.format(stop=stop, chunk=1)] + flags + ["--out-dir", str(split)], module=False)
    assert stopped.returncode == run_control.EXIT_STOPPED, stopped.stderr
    assert f"stopped by SIGTERM after step {stop};" in stopped.stderr
    assert checkpoint.load_checkpoint(checkpoint.checkpoint_path(split, stop)).validation_skipped
    assert stop not in [record["step"] for record in read_records(split / METRICS_FILE) if "valid_nll" in record]
    if patience_step is None:
        # A session that only does the skipped validation (as one killed before its next checkpoint would) leaves
        # the checkpoint's validation pending: the next session does it again, and records it once.
        again = run(flags[:flags.index("--max-steps") + 1] + [str(stop)] + flags[flags.index("--max-steps") + 2:]
                    + ["--out-dir", str(split), "--resume"])
        assert again.returncode == 0 and "no update to make" in again.stdout, again.stderr
    resumed = run(flags + ["--out-dir", str(split), "--resume"])
    reference = run(flags + ["--out-dir", str(straight)])
    assert resumed.returncode == reference.returncode == 0, resumed.stderr + reference.stderr
    last = patience_step or 8
    if patience_step is not None:
        assert f"fastformer train: stopped at step {patience_step}: 2 validations in a row" in resumed.stdout
    finals = [checkpoint.load_checkpoint(checkpoint.checkpoint_path(out_dir, last)) for out_dir in (split, straight)]
    assert finals[0].best == finals[1].best and not finals[0].validation_skipped
    bests = [checkpoint.load_checkpoint(checkpoint.best_checkpoint_path(out_dir)) for out_dir in (split, straight)]
    assert bests[0].step == bests[1].step == finals[1].best["step"]
    _assert_same_tensors(bests[0].model, bests[1].model, "best checkpoints")
    assert measured_records(split) == measured_records(straight)


def test_updates_since_the_last_log_line_carry_over_a_stop_and_a_crash(data_dir: Path, tmp_path: Path):
    """--log-every 4, checkpoints every 2 updates: a SIGTERM's stop after update 6 logs updates 5-6, and a crash after
    update 7 resumes from step 6 too; either way the resumed run's line at step 8 covers updates 5-8, as a run never
    stopped logs it (the records are that run's, with the stop's own line besides)."""
    flags = TRAIN_FLAGS + ["--data-dir", str(data_dir), "--max-steps", "8", "--log-every", "4", "--valid-every", "4"]
    split, crashed, straight = tmp_path / "split", tmp_path / "crashed", tmp_path / "straight"
    _run(flags + ["--out-dir", str(straight)])
    reference = measured_records(straight)
    lines = [record for record in reference if "train_loss" in record]
    assert [line["step"] for line in lines] == [4, 8]
    stopped = run(["-c", SIGNALLED_RUN.format(stop=6)] + flags + ["--out-dir", str(split)], module=False)
    assert stopped.returncode == run_control.EXIT_STOPPED, stopped.stderr
    shutil.copytree(straight, crashed)
    checkpoint.checkpoint_path(crashed, 8).unlink()
    for out_dir in (split, crashed):
        _run(flags + ["--out-dir", str(out_dir), "--resume"])
    stop_line = [record for record in measured_records(split) if record["step"] == 6]
    assert len(stop_line) == 1 and stop_line[0]["train_loss"] != lines[-1]["train_loss"]
    assert [record for record in measured_records(split) if record["step"] != 6] == reference
    assert measured_records(crashed) == reference


def test_a_signal_during_the_last_validation_chunk_stops_there_with_the_validation_done(data_dir: Path,
                                                                                       tmp_path: Path):
    """A SIGTERM that comes as validation's last chunk starts lets it end, and the run stops at that step (no further
    update): its checkpoint owes no validation, and the metrics hold it once."""
    flags = TRAIN_FLAGS + ["--data-dir", str(data_dir), "--max-steps", "8", "--out-dir", str(tmp_path / "run")]
    stopped = run(["-c", SIGNALLED_IN_VALIDATION.format(stop=4, chunk=2)] + flags, module=False)
    assert stopped.returncode == run_control.EXIT_STOPPED, stopped.stderr
    assert "stopped by SIGTERM after step 4;" in stopped.stderr
    assert checkpoint.list_checkpoints(tmp_path / "run")[-1] == checkpoint.checkpoint_path(tmp_path / "run", 4)
    assert not checkpoint.load_checkpoint(checkpoint.checkpoint_path(tmp_path / "run", 4)).validation_skipped
    assert [record["step"] for record in read_records(tmp_path / "run" / METRICS_FILE) if "valid_nll" in record] == [
        2, 4]
