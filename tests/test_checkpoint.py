"""fastformer.checkpoint: atomic saves that a failure cannot half-write, strict loads, pruning, and averaging."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fastformer import checkpoint
from tolerances import FP32


def _state(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"model": {"weight": torch.randn(4, 3, generator=generator), "bias": torch.randn(3, generator=generator),
                      "count": torch.tensor([seed])},
            "config": {"vocab_size": 10}, "step": seed}


def test_save_then_load_round_trips(tmp_path: Path):
    path = checkpoint.checkpoint_path(tmp_path, 12)
    checkpoint.save_checkpoint(_state(12), path)
    loaded = checkpoint.load_checkpoint(path)
    assert loaded["step"] == 12 and loaded["config"] == {"vocab_size": 10}
    for name, tensor in _state(12)["model"].items():
        assert torch.equal(loaded["model"][name], tensor)
    assert os.listdir(tmp_path) == [path.name], "no temp file may be left behind"
    plain = tmp_path.parent / f"{tmp_path.name}.plain"
    plain.write_bytes(b"")
    assert path.stat().st_mode == plain.stat().st_mode, "a checkpoint gets the permissions of any file written"


def test_failed_save_leaves_the_old_checkpoint_intact(tmp_path: Path, monkeypatch):
    path = tmp_path / "checkpoint_00000001.pt"
    checkpoint.save_checkpoint(_state(1), path)
    before = path.read_bytes()
    real_save = torch.save

    def save_half_then_fail(obj, file, *args, **kwargs):
        real_save(obj, file, *args, **kwargs)
        file.truncate(file.tell() // 2)
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", save_half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save_checkpoint(_state(2), path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == [path.name], "the half-written temp file must be removed"
    assert checkpoint.load_checkpoint(path)["step"] == 1


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
    with pytest.raises(ValueError, match=rf"{path} is not a readable checkpoint"):
        checkpoint.load_checkpoint(path)


def test_newer_version_is_refused(tmp_path: Path):
    path = tmp_path / "checkpoint_00000001.pt"
    torch.save({**_state(1), "format": checkpoint.FORMAT, "version": checkpoint.VERSION + 1}, path)
    with pytest.raises(ValueError, match="checkpoint version"):
        checkpoint.load_checkpoint(path)


def test_list_sorts_by_step_and_prune_keeps_the_newest(tmp_path: Path):
    for step in (100, 9, 20, 3):
        checkpoint.save_checkpoint(_state(step), checkpoint.checkpoint_path(tmp_path, step))
    (tmp_path / "checkpoint_average.pt").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("x")
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        "checkpoint_00000003.pt", "checkpoint_00000009.pt", "checkpoint_00000020.pt", "checkpoint_00000100.pt"]
    checkpoint.prune_checkpoints(tmp_path, keep_last=2)
    assert [checkpoint.load_checkpoint(p)["step"] for p in checkpoint.list_checkpoints(tmp_path)] == [20, 100]
    assert (tmp_path / "checkpoint_average.pt").exists() and (tmp_path / "notes.txt").exists()


def test_average_is_the_mean_of_the_parameters(tmp_path: Path):
    paths = [checkpoint.checkpoint_path(tmp_path, step) for step in (1, 2, 3)]
    for step, path in zip((1, 2, 3), paths):
        checkpoint.save_checkpoint({**_state(step), "optimizer": {"state": {}}}, path)
    averaged = checkpoint.average_checkpoints(paths)
    for name in ("weight", "bias"):
        expected = torch.stack([_state(step)["model"][name] for step in (1, 2, 3)]).mean(dim=0)
        torch.testing.assert_close(averaged["model"][name], expected, **FP32)
    assert torch.equal(averaged["model"]["count"], torch.tensor([3])), "integer tensors come from the newest"
    assert "optimizer" not in averaged and averaged["averaged_from"] == [str(p) for p in paths]


def test_average_refuses_mismatched_checkpoints(tmp_path: Path):
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    checkpoint.save_checkpoint(_state(1), a)
    checkpoint.save_checkpoint({**_state(2), "config": {"vocab_size": 11}}, b)
    with pytest.raises(ValueError, match=f"{a} has another model config"):
        checkpoint.average_checkpoints([a, b])
    with pytest.raises(ValueError, match="at least one"):
        checkpoint.average_checkpoints([])
