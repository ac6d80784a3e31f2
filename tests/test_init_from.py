"""--init-from: fine-tuning starts from a Marian (OPUS-MT) directory or a fastformer checkpoint, taking its weights,
its tokenizer(s) and its architecture. With a learning rate of 0 the run's checkpoint must be the model it started
from: it translates exactly as load_translator of the source does. Contradicting options are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastformer import checkpoint
from fastformer.data import BUNDLED_CORPUS, read_lines
from fastformer.translation import marian
from fastformer.translation.translator import load_translator
from fastformer_process import run
from marian_models import write_marian
from test_train import TRAIN_FLAGS, _assert_same_tensors, _fail, _run, data_dir  # noqa: F401 (fixture)

SENTENCES = read_lines(BUNDLED_CORPUS / "test.en")[:6]
def _without(flags: list[str], *names: str) -> list[str]:
    """flags without the options `names` and their values."""
    dropped = {i + offset for i, flag in enumerate(flags) if flag in names for offset in (0, 1)}
    return [flag for i, flag in enumerate(flags) if i not in dropped]


# test_train's flags without the model's size: --init-from's model gives it.
UNSIZED_FLAGS = _without(TRAIN_FLAGS, "--preset", "--vocab-size")
# A learning rate of 0 keeps the weights as they were loaded: Adam's update is lr times a finite step.
FROZEN = ["--lr-scale", "0", "--max-steps", "2", "--valid-every", "2", "--valid-bleu-sentences", "2"]


def _translate(path: Path) -> list[str]:
    """`fastformer translate --checkpoint path` (the CLI, beam 4) of SENTENCES."""
    done = run(["translate", "--device", "cpu", "--checkpoint", str(path)], stdin="".join(s + "\n" for s in SENTENCES))
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_a_run_from_a_marian_directory_translates_as_the_directory_does(data_dir: Path, tmp_path: Path):
    directory = tmp_path / "opus-mt"
    write_marian(directory, activation="swish", seed=0)
    out_dir = tmp_path / "run"
    # The tiny Marian model has 128 positions: --max-len below them.
    _run(UNSIZED_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(out_dir), "--init-from", str(directory),
                          "--max-len", "100"] + FROZEN)
    saved = checkpoint.load_checkpoint(checkpoint.checkpoint_path(out_dir, 2))
    assert saved.tokenizer == {name: (directory / name).read_bytes() for name in ("source.spm", "target.spm",
                                                                                   "vocab.json")}
    model, _, _ = marian.load_marian(directory)
    _assert_same_tensors(saved.model, model.state_dict(), "the run's weights vs the Marian model's")
    expected = load_translator(directory, "cpu").translate(SENTENCES, beam_size=4, length_penalty=0.6)
    assert _translate(checkpoint.checkpoint_path(out_dir, 2)) == expected
    assert len(set(expected)) > 1, "the tiny model's translations should differ from sentence to sentence"


def test_a_run_from_a_checkpoint_starts_from_its_weights_and_refuses_contradicting_options(data_dir: Path,
                                                                                           tmp_path: Path):
    pretrained = tmp_path / "pretrained"
    _run(TRAIN_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(pretrained), "--max-steps", "3",
                        "--valid-every", "0"])
    source = checkpoint.checkpoint_path(pretrained, 3)
    out_dir = tmp_path / "run"
    # --vocab-size 200 and --preset tiny are the pretrained model's: not a contradiction.
    flags = TRAIN_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(out_dir), "--init-from", str(source)]
    _run(flags + FROZEN)
    saved = checkpoint.load_checkpoint(checkpoint.checkpoint_path(out_dir, 2))
    original = checkpoint.load_checkpoint(source)
    _assert_same_tensors(saved.model, original.model, "the run's weights vs the checkpoint's")
    assert saved.tokenizer == original.tokenizer and saved.schedule["last_epoch"] == 2, "a fresh schedule"
    assert _translate(checkpoint.checkpoint_path(out_dir, 2)) == _translate(source)
    fresh = UNSIZED_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(tmp_path / "other"), "--init-from",
                             str(source)] + FROZEN
    for contradiction, message in (
            (["--preset", "base"], f"--preset base (d_model 512, n_heads 8, n_encoder_layers 6, n_decoder_layers 6, "
                                   f"d_ff 2048) contradicts the model of --init-from {source} (d_model "),
            (["--vocab-size", "300"], f"--vocab-size 300 contradicts --init-from {source}, whose vocabulary has ")):
        stderr = _fail(fresh + contradiction)
        assert message in stderr and stderr.count("\n") == 1, stderr
    assert f"--init-from None (checkpoint: {source})" in _fail(
        _without(flags, "--init-from") + FROZEN + ["--max-steps", "3", "--resume"])


@pytest.mark.parametrize("kind", ["missing", "text file", "empty directory"])
def test_init_from_a_path_that_is_neither_is_one_line_before_any_work(data_dir: Path, tmp_path: Path, kind: str):
    path = tmp_path / "model"
    if kind == "text file":
        path.write_text("not a model\n")
    elif kind == "empty directory":
        path.mkdir()
    out_dir = tmp_path / "run"
    stderr = _fail(TRAIN_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(out_dir), "--init-from", str(path),
                                  "--max-steps", "1"])
    assert (f"fastformer train: error: --init-from {path} is neither a fastformer checkpoint nor a Marian (OPUS-MT) "
            f"directory fastformer reads") in stderr and stderr.count("\n") == 1, stderr
    assert not out_dir.exists()
