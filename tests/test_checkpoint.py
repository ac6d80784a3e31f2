"""fastformer.checkpoint: atomic saves that a failure cannot half-write, strict loads, pruning, and averaging."""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastformer import checkpoint
from tolerances import FP32


def _state(seed: int, **fields) -> checkpoint.Checkpoint:
    generator = torch.Generator().manual_seed(seed)
    return checkpoint.Checkpoint(
        model={"weight": torch.randn(4, 3, generator=generator), "bias": torch.randn(3, generator=generator),
               "count": torch.tensor([seed])},
        config={"vocab_size": 10}, step=seed, **fields)


def test_save_then_load_round_trips(tmp_path: Path):
    path = checkpoint.checkpoint_path(tmp_path, 12)
    checkpoint.save_checkpoint(_state(12), path)
    loaded = checkpoint.load_checkpoint(path)
    assert loaded.step == 12 and loaded.config == {"vocab_size": 10}
    for name, tensor in _state(12).model.items():
        assert torch.equal(loaded.model[name], tensor)
    assert os.listdir(tmp_path) == [path.name], "no temp file may be left behind"
    plain = tmp_path.parent / f"{tmp_path.name}.plain"
    plain.write_bytes(b"")
    assert path.stat().st_mode == plain.stat().st_mode, "a checkpoint gets the permissions of any file written"


def test_a_full_disk_names_the_path_and_size_and_leaves_the_old_checkpoint_intact(tmp_path: Path, monkeypatch):
    """Writes fail with ENOSPC once half the new checkpoint is on disk: the error names the path and the bytes the
    file needs (a successful save's file size), the half-written temp file is removed, the old checkpoint loads."""
    path = tmp_path / "checkpoint_00000001.pt"
    checkpoint.save_checkpoint(_state(2), tmp_path / "reference.pt")
    needed = (tmp_path / "reference.pt").stat().st_size
    (tmp_path / "reference.pt").unlink()
    checkpoint.save_checkpoint(_state(1), path)
    before = path.read_bytes()

    class FullDisk(io.FileIO):
        def write(self, data) -> int:
            if self.tell() + len(data) > needed // 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().write(data)

    monkeypatch.setattr(os, "fdopen", lambda descriptor, mode: FullDisk(descriptor, mode))
    with pytest.raises(checkpoint.CheckpointWriteError) as raised:
        checkpoint.save_checkpoint(_state(2), path)
    monkeypatch.undo()
    assert str(raised.value).startswith(f"cannot write checkpoint {path}: No space left on device; it needs "
                                        f"{needed:,} bytes and {tmp_path} has ")
    assert raised.value.errno == errno.ENOSPC
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == [path.name], "the half-written temp file must be removed"
    assert checkpoint.load_checkpoint(path).step == 1


def test_an_unwritable_directory_names_the_path(tmp_path: Path):
    """A checkpoint path under a regular file (no directory can be made there, even for root)."""
    (tmp_path / "file").write_bytes(b"")
    path = tmp_path / "file" / "checkpoint_00000001.pt"
    with pytest.raises(checkpoint.CheckpointWriteError, match=f"cannot write checkpoint {path}: File exists; it needs"):
        checkpoint.save_checkpoint(_state(1), path)
    assert os.listdir(tmp_path) == ["file"]


def test_missing_checkpoint_names_the_path(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "checkpoint_00000003.pt")):
        checkpoint.load_checkpoint(tmp_path / "checkpoint_00000003.pt")


def test_truncated_checkpoint_is_a_clear_error(tmp_path: Path):
    path = tmp_path / "checkpoint_00000001.pt"
    checkpoint.save_checkpoint(_state(1), path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match=rf"{path} is not a readable checkpoint"):
        checkpoint.load_checkpoint(path)


def test_garbage_file_is_a_clear_error(tmp_path: Path):
    path = tmp_path / "model.pt"
    path.write_text("hello", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{path} is not a readable checkpoint"):
        checkpoint.load_checkpoint(path)


def test_foreign_checkpoint_is_a_clear_error(tmp_path: Path):
    path = tmp_path / "other.pt"
    torch.save({"state_dict": {"weight": torch.zeros(2)}}, path)
    with pytest.raises(ValueError, match=rf"{path} is not a fastformer checkpoint"):
        checkpoint.load_checkpoint(path)


def test_checkpoint_holding_code_is_refused_unexecuted(tmp_path: Path):
    path = tmp_path / "evil.pt"
    torch.save({"format": checkpoint.FORMAT, "payload": Path("/")}, path)
    with pytest.raises(ValueError, match=rf"{path} is not a fastformer checkpoint: torch.load cannot read it as "
                                         r"tensors and plain values \(.*PosixPath") as raised:
        checkpoint.load_checkpoint(path)
    assert "weights_only" not in str(raised.value)  # torch's advice to load it unsafely is left out


def test_newer_version_is_refused(tmp_path: Path):
    path = tmp_path / "checkpoint_00000001.pt"
    torch.save({**_state(1).to_file_dict(), "version": checkpoint.VERSION + 1}, path)
    with pytest.raises(ValueError, match="checkpoint version"):
        checkpoint.load_checkpoint(path)


def test_list_sorts_by_step_and_prune_keeps_the_newest(tmp_path: Path):
    for step in (100, 9, 20, 3):
        checkpoint.save_checkpoint(_state(step), checkpoint.checkpoint_path(tmp_path, step))
    (tmp_path / "checkpoint_average.pt").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("x")
    # A save in flight (another process's): what translate, evaluate and average list must never include it.
    (tmp_path / ".checkpoint_00000200.pt.a1b2.tmp").write_bytes(b"half a checkpoint")
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        "checkpoint_00000003.pt", "checkpoint_00000009.pt", "checkpoint_00000020.pt", "checkpoint_00000100.pt"]
    checkpoint.prune_checkpoints(tmp_path, keep_last=2)
    assert [checkpoint.load_checkpoint(p).step for p in checkpoint.list_checkpoints(tmp_path)] == [20, 100]
    assert (tmp_path / "checkpoint_average.pt").exists() and (tmp_path / "notes.txt").exists()


def test_average_is_the_mean_of_the_parameters(tmp_path: Path):
    paths = [checkpoint.checkpoint_path(tmp_path, step) for step in (1, 2, 3)]
    for step, path in zip((1, 2, 3), paths):
        checkpoint.save_checkpoint(_state(step, optimizer={"state": {}}, tokenizer=b"spm"), path)
    averaged = checkpoint.average_checkpoints(paths)
    for name in ("weight", "bias"):
        expected = torch.stack([_state(step).model[name] for step in (1, 2, 3)]).mean(dim=0)
        torch.testing.assert_close(averaged.model[name], expected, **FP32)
    assert torch.equal(averaged.model["count"], torch.tensor([3])), "integer tensors come from the newest"
    assert averaged.optimizer is None and averaged.averaged_from == [str(p) for p in paths]
    assert averaged.tokenizer == b"spm" and averaged.missing_for_resume() == ["optimizer", "schedule", "rng", "data"]


def test_average_refuses_mismatched_checkpoints(tmp_path: Path):
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    checkpoint.save_checkpoint(_state(1), a)
    mismatched = _state(2)
    mismatched.config = {"vocab_size": 11}
    checkpoint.save_checkpoint(mismatched, b)
    with pytest.raises(ValueError, match=f"{a} has another model config than {b} \\(vocab_size 10 against 11\\)"):
        checkpoint.average_checkpoints([a, b])
    with pytest.raises(IsADirectoryError, match=f"{tmp_path} is a directory, not a checkpoint file"):
        checkpoint.average_checkpoints([a, tmp_path])
    with pytest.raises(ValueError, match="at least one"):
        checkpoint.average_checkpoints([])
    checkpoint.save_checkpoint(_state(1, tokenizer=b"one run's vocabulary"), a)
    checkpoint.save_checkpoint(_state(2, tokenizer=b"another run's vocabulary"), b)
    with pytest.raises(ValueError, match=f"{a} has another vocabulary"):
        checkpoint.average_checkpoints([a, b])


def test_average_outlives_its_files_pruned_once_it_has_opened_them(tmp_path: Path, monkeypatch):
    """A training run's --keep-last deletes checkpoints while `average` reads the same directory: once opened (mapped)
    a file is averaged whole even if deleted."""
    paths = [checkpoint.checkpoint_path(tmp_path, step) for step in (1, 2, 3)]
    for step, path in zip((1, 2, 3), paths):
        checkpoint.save_checkpoint(_state(step), path)
    real = checkpoint.check_finite

    def prune_then_check(loaded, path):
        for each in paths:
            each.unlink(missing_ok=True)
        real(loaded, path)
    monkeypatch.setattr(checkpoint, "check_finite", prune_then_check)
    averaged = checkpoint.average_checkpoints(paths)
    assert not any(path.exists() for path in paths)
    expected = torch.stack([_state(step).model["weight"] for step in (1, 2, 3)]).double().mean(dim=0).float()
    assert torch.equal(averaged.model["weight"], expected)


# Peak resident memory of averaging the first N of 6 checkpoints (ARGV: N, then their paths) in a fresh process, MiB.
AVERAGE_PEAK = """import resource, sys
from pathlib import Path
from fastformer import checkpoint
checkpoint.average_checkpoints([Path(p) for p in sys.argv[2:2 + int(sys.argv[1])]])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def test_average_holds_one_checkpoint_at_a_time_and_never_its_optimizer_state(tmp_path: Path):
    """Six checkpoints of 32 MiB of weights and 64 MiB of Adam state: averaging all six peaks within 40 MiB of
    averaging one (holding them all, as it once did, adds 5 x 96 MiB)."""
    paths = []
    for step in range(1, 7):
        weight = torch.full((8 << 20,), float(step))
        adam = {"state": {0: {"exp_avg": weight.clone(), "exp_avg_sq": weight.clone()}}, "param_groups": []}
        path = checkpoint.checkpoint_path(tmp_path, step)
        checkpoint.save_checkpoint(checkpoint.Checkpoint(model={"weight": weight}, config={"vocab_size": 10},
                                                         step=step, optimizer=adam), path)
        paths.append(str(path))
    peaks = [float(subprocess.run([sys.executable, "-c", AVERAGE_PEAK, str(n), *paths], capture_output=True,
                                  text=True, check=True).stdout) for n in (1, 6)]
    assert peaks[1] - peaks[0] < 40, f"peak resident MiB averaging 1 and 6 checkpoints: {peaks}"


def test_newest_readable_skips_a_file_gone_since_the_listing(tmp_path: Path, monkeypatch):
    """Rank 0 of a resumed run renames an unreadable newest checkpoint while another rank has listed it already."""
    checkpoint.save_checkpoint(_state(1), checkpoint.checkpoint_path(tmp_path, 1))
    gone = checkpoint.checkpoint_path(tmp_path, 2)
    listed = [checkpoint.checkpoint_path(tmp_path, 1), gone]
    monkeypatch.setattr(checkpoint, "list_checkpoints", lambda directory: listed)
    path, loaded, skipped = checkpoint.load_newest_readable(tmp_path)
    assert loaded.step == 1 and [path for path, _ in skipped] == [gone]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_weights_that_are_not_finite_make_a_checkpoint_unreadable(tmp_path: Path, value: float):
    """A corrupt file can hold NaN where the run saved numbers: refused by name on load, skipped by --resume."""
    for step in (1, 2):
        checkpoint.save_checkpoint(_state(step), checkpoint.checkpoint_path(tmp_path, step))
    corrupt = _state(3)
    corrupt.model["bias"][1] = value
    checkpoint.save_checkpoint(corrupt, checkpoint.checkpoint_path(tmp_path, 3))
    with pytest.raises(checkpoint.UnreadableCheckpointError, match=r"not finite \(NaN or inf\) in bias"):
        checkpoint.load_checkpoint(checkpoint.checkpoint_path(tmp_path, 3))
    path, loaded, skipped = checkpoint.load_newest_readable(tmp_path)
    assert loaded.step == 2 and [path for path, _ in skipped] == [checkpoint.checkpoint_path(tmp_path, 3)]
    with pytest.raises(checkpoint.UnreadableCheckpointError, match="not finite"):
        checkpoint.average_checkpoints(checkpoint.list_checkpoints(tmp_path))


def test_a_version_1_file_written_as_a_plain_dict_loads_into_the_schema(tmp_path: Path):
    """Checkpoints written before the Checkpoint class (a dict with these keys, the tokenizer as uint8) still load."""
    path = tmp_path / "checkpoint_00000007.pt"
    model = {"weight": torch.arange(6.0).view(2, 3)}
    data = {"epoch": 1, "index": 3, "seed": 1, "batch_tokens": 200, "world_size": 2}
    torch.save({"model": model, "config": {"vocab_size": 10}, "optimizer": {"state": {}, "param_groups": []},
                "schedule": {"last_epoch": 7}, "step": 7, "rng": [{"torch": torch.get_rng_state()}], "data": data,
                "tokenizer": torch.frombuffer(bytearray(b"\x0aproto"), dtype=torch.uint8), "options": {"seed": 1},
                "format": checkpoint.FORMAT, "version": 1}, path)
    loaded = checkpoint.load_checkpoint(path)
    assert torch.equal(loaded.model["weight"], model["weight"])
    assert loaded.tokenizer == b"\x0aproto" and loaded.data == data and loaded.step == 7
    assert loaded.missing_for_resume() == []


def test_an_entry_the_schema_does_not_know_is_a_clear_error(tmp_path: Path):
    path = tmp_path / "checkpoint_00000001.pt"
    torch.save({**_state(1).to_file_dict(), "ema": {}}, path)
    with pytest.raises(ValueError, match=rf"{path} holds entries this fastformer does not know: \['ema'\]"):
        checkpoint.load_checkpoint(path)


def test_temp_files_of_killed_saves_are_removed_by_the_next_prune(tmp_path: Path):
    """A save killed between mkstemp and rename leaves .checkpoint_<step>.pt.<random>.tmp (as large as a checkpoint)."""
    checkpoint.save_checkpoint(_state(1), checkpoint.checkpoint_path(tmp_path, 1))
    killed = tmp_path / ".checkpoint_00000002.pt.k3j2_x.tmp"
    killed.write_bytes(b"half a checkpoint")
    killed_best = tmp_path / ".checkpoint_best.pt.x9y8.tmp"
    killed_best.write_bytes(b"half the best checkpoint")
    other = tmp_path / ".checkpoint_average.pt.a1b2.tmp"  # another command's save may be in flight: left alone
    other.write_bytes(b"")
    checkpoint.save_checkpoint(_state(3), checkpoint.checkpoint_path(tmp_path, 3))
    checkpoint.prune_checkpoints(tmp_path, keep_last=5)
    assert not killed.exists() and not killed_best.exists() and other.exists()
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        "checkpoint_00000001.pt", "checkpoint_00000003.pt"]


def test_prune_never_removes_the_best_checkpoint(tmp_path: Path):
    checkpoint.save_checkpoint(_state(1), checkpoint.best_checkpoint_path(tmp_path))
    for step in (2, 3, 4):
        checkpoint.save_checkpoint(_state(step), checkpoint.checkpoint_path(tmp_path, step))
    checkpoint.prune_checkpoints(tmp_path, keep_last=1)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint_00000004.pt", "checkpoint_best.pt"]
    assert checkpoint.newest_checkpoint(tmp_path) == checkpoint.checkpoint_path(tmp_path, 4)


def test_newest_readable_skips_corrupt_newer_files_and_says_why(tmp_path: Path):
    for step in (1, 2, 3):
        checkpoint.save_checkpoint(_state(step), checkpoint.checkpoint_path(tmp_path, step))
    checkpoint.checkpoint_path(tmp_path, 3).write_bytes(checkpoint.checkpoint_path(tmp_path, 3).read_bytes()[:300])
    path, loaded, skipped = checkpoint.load_newest_readable(tmp_path)
    assert path == checkpoint.checkpoint_path(tmp_path, 2) and loaded.step == 2
    assert [path for path, _ in skipped] == [checkpoint.checkpoint_path(tmp_path, 3)]
    assert f"{checkpoint.checkpoint_path(tmp_path, 3)} is not a readable checkpoint" in skipped[0][1]
    for step in (1, 2):
        checkpoint.checkpoint_path(tmp_path, step).write_bytes(b"garbage")
    with pytest.raises(checkpoint.UnreadableCheckpointError, match=f"no readable checkpoint in {tmp_path}"):
        checkpoint.load_newest_readable(tmp_path)
    foreign = checkpoint.checkpoint_path(tmp_path, 4)
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(ValueError, match=f"{foreign} is not a fastformer checkpoint"):
        checkpoint.load_newest_readable(tmp_path)
