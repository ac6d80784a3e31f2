"""--clip-norm against torch.nn.utils.clip_grad_norm_ on the same gradients: on 1 rank, on 2 gloo ranks (every rank
clips by the same global norm), and on the fp32 master gradients of --precision bf16-master."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fastformer_process import run
from test_train import TESTS, TRAIN_FLAGS, _fail, data_dir  # noqa: F401 (fixture)

CLIP_NORM = 0.2


@pytest.mark.parametrize("ranks, precision", [(1, "auto"), (2, "auto"), (2, "bf16-master")])
def test_clipped_gradients_are_clip_grad_norms(data_dir: Path, tmp_path: Path, ranks: int, precision: str):
    options = {"out_dir": str(tmp_path / "run"), "data_dir": str(data_dir), "vocab_size": 200, "batch_tokens": 200,
               "update_tokens": 800, "warmup": 4, "lr_scale": 4.0, "max_steps": 4, "valid_every": 0,
               "save_every": 0, "quiet": True, "device": "cpu", "clip_norm": CLIP_NORM, "precision": precision,
               "preset": "tiny"}
    done = run([str(TESTS / "clip_recording.py"), json.dumps(options)], ranks=ranks, module=False)
    assert done.returncode == 0, done.stderr
    recorded = [torch.load(tmp_path / "run" / f"clip_rank{rank}.pt") for rank in range(ranks)]
    assert len(recorded[0]) == 4
    for update in recorded[0]:
        parameters = [torch.nn.Parameter(torch.zeros_like(gradient)) for gradient in update["before"]]
        for parameter, gradient in zip(parameters, update["before"]):
            parameter.grad = gradient.clone()
        norm = torch.nn.utils.clip_grad_norm_(parameters, CLIP_NORM)
        torch.testing.assert_close(update["norm"], norm, rtol=1e-6, atol=0)
        assert norm > CLIP_NORM, "every update's norm should be over the limit, so that clipping is tested"
        for parameter, clipped in zip(parameters, update["after"]):
            torch.testing.assert_close(clipped, parameter.grad, rtol=1e-6, atol=1e-9)
    for other in recorded[1:]:
        for ours, theirs in zip(recorded[0], other):
            assert torch.equal(ours["norm"], theirs["norm"]), "every rank clips by the same global norm"
            assert all(torch.equal(a, b) for a, b in zip(ours["after"], theirs["after"]))


def test_a_negative_clip_norm_is_refused_before_any_work(data_dir: Path, tmp_path: Path):
    stderr = _fail(TRAIN_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(tmp_path / "run"), "--clip-norm", "-1"])
    assert "clip_norm must be >= 0, got -1.0" in stderr and stderr.count("\n") == 1
    assert not (tmp_path / "run").exists()
