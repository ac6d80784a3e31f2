"""Training: torchrun data parallelism on CPU (gloo), exact resume, averaging, and clear errors for bad runs.

Every run trains the tiny preset a few steps on a slice of the bundled corpus, small enough that an epoch is a few
steps, so that runs cross epoch boundaries.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fastformer import Transformer, TransformerConfig, checkpoint
from fastformer.data import BUNDLED_CORPUS
from fastformer.data.prepared import DEFAULT_VOCAB
from fastformer.training.metrics import METRICS_FILE, read_records
from fastformer.training.options import TrainOptions, changed_resume_options
from fastformer.training import trainer as trainer_module
from fastformer.training.trainer import inverse_sqrt_schedule
from fastformer_process import run
from tolerances import FP32

TESTS = Path(__file__).resolve().parent
# 4 updates per epoch on 2 ranks: about 16 batches of 200 tokens, 2 micro-batches per rank and update. On the CPU
# (gloo) also where a GPU is present: that is the path under test, and bitwise resume needs deterministic kernels.
TRAIN_FLAGS = ["train", "--device", "cpu", "--preset", "tiny", "--vocab-size", "200", "--batch-tokens", "200",
               "--update-tokens", "800", "--warmup", "4", "--lr-scale", "4", "--log-every", "2", "--save-every", "2", "--keep-last", "3",
               "--valid-every", "2", "--valid-bleu-sentences", "2", "--quiet"]


def _corpus_slice(directory: Path, sizes: dict[str, int]) -> Path:
    directory.mkdir()
    for split, size in sizes.items():
        for lang in ("en", "de"):
            lines = (BUNDLED_CORPUS / f"{split}.{lang}").read_text(encoding="utf-8").splitlines(keepends=True)
            (directory / f"{split}.{lang}").write_text("".join(lines[:size]), encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return _corpus_slice(tmp_path_factory.mktemp("corpus") / "data", {"train": 120, "valid": 8, "test": 8})


def _run(args: list[str], ranks: int = 1) -> None:
    """`python -m fastformer ARGS`, or the same under torchrun with `ranks` processes; fails the test on error."""
    done = run(args, ranks=ranks)
    assert done.returncode == 0, f"fastformer {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"


def _fail(args: list[str]) -> str:
    """`python -m fastformer ARGS` must exit with an error -> its stderr."""
    done = run(args)
    assert done.returncode != 0, f"expected an error from {args}, got:\n{done.stdout}"
    assert "Traceback" not in done.stderr, f"a clear error, not a traceback:\n{done.stderr}"
    return done.stderr


def _assert_same_tensors(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs (max diff "\
            f"{(a[name].double() - b[name].double()).abs().max().item():.3e})"


def measured_records(out_dir: Path) -> list[dict]:
    """out_dir's metrics.jsonl without what depends on the clock (time, tokens/s): what a resumed run must repeat."""
    return [{key: value for key, value in record.items() if key not in ("time", "tokens_per_second")}
            for record in read_records(out_dir / METRICS_FILE)]


def test_torchrun_ranks_hold_identical_parameters(data_dir: Path, tmp_path: Path):
    options = {"out_dir": str(tmp_path / "run"), "data_dir": str(data_dir), "vocab_size": 200, "batch_tokens": 200,
               "update_tokens": 800, "warmup": 4, "lr_scale": 4.0, "max_steps": 5, "valid_every": 0,
               "save_every": 0, "quiet": True, "device": "cpu"}
    done = run([str(TESTS / "ddp_rank_parameters.py"), json.dumps(options)], ranks=2, module=False)
    assert done.returncode == 0, done.stderr
    ranks = [torch.load(tmp_path / "run" / f"rank{rank}.pt") for rank in (0, 1)]
    saved = checkpoint.load_checkpoint(Path(ranks[0]["checkpoint"]))
    assert saved.step == 5
    _assert_same_tensors(ranks[0]["parameters"], ranks[1]["parameters"], "rank 0 vs rank 1")
    _assert_same_tensors(saved.model, ranks[1]["parameters"], "checkpoint vs rank 1")
    # The ranks trained, on different data with different dropout masks, yet stayed equal: not a trivial pass.
    torch.manual_seed(1)
    initial = Transformer(TransformerConfig(**saved.config)).state_dict()
    assert not torch.equal(initial["encoder.layers.0.ffn.linear1.weight"],
                           saved.model["encoder.layers.0.ffn.linear1.weight"])


def _resumed_and_straight(flags: list[str], split: Path, straight: Path, steps: int, ranks: int = 2,
                          first_leg: Callable[[], None] | None = None) -> tuple:
    """Trains on `ranks` ranks for steps // 2 steps (or as first_leg() does) then --resume to `steps` in `split`, and
    `steps` straight in `straight` -> both last checkpoints (resumed, straight)."""
    if first_leg is None:
        _run(flags + ["--out-dir", str(split), "--max-steps", str(steps // 2)], ranks=ranks)
    else:
        first_leg()
    _run(flags + ["--out-dir", str(split), "--max-steps", str(steps), "--resume"], ranks=ranks)
    _run(flags + ["--out-dir", str(straight), "--max-steps", str(steps)], ranks=ranks)
    return (checkpoint.load_checkpoint(checkpoint.checkpoint_path(split, steps)),
            checkpoint.load_checkpoint(checkpoint.checkpoint_path(straight, steps)))


def test_resume_is_exact_under_torchrun(data_dir: Path, tmp_path: Path):
    """3 steps, then --resume to 6 (across an epoch boundary, with validation in between) == 6 steps straight."""
    common = TRAIN_FLAGS + ["--data-dir", str(data_dir)]
    split, straight = tmp_path / "split", tmp_path / "straight"
    resumed, reference = _resumed_and_straight(common, split, straight, steps=6)
    assert reference.data["epoch"] >= 1, "the runs should cross an epoch boundary"
    assert resumed.data == reference.data
    _assert_same_tensors(resumed.model, reference.model, "resumed vs straight")
    for index, state in reference.optimizer["state"].items():
        _assert_same_tensors(resumed.optimizer["state"][index], state, f"Adam state of parameter {index}")
    assert resumed.schedule == reference.schedule
    assert resumed.best == reference.best and reference.best["stale"] == 3 - reference.best["step"] // 2
    bests = [checkpoint.load_checkpoint(checkpoint.best_checkpoint_path(out_dir)).model for out_dir in (split, straight)]
    _assert_same_tensors(*bests, "best checkpoints")
    for rank in (0, 1):
        assert torch.equal(resumed.rng[rank]["torch"], reference.rng[rank]["torch"])
    # Step 3's lines end the first run; each rank's checkpoint carries update 3 into the line at 4, as straight.
    assert [record for record in measured_records(split) if record["step"] != 3] == measured_records(straight)
    # Checkpoints 3 and 6 of the split run and 2, 4, 6 of the straight one (keep_last 3).
    assert [p.name for p in checkpoint.list_checkpoints(straight)] == [
        checkpoint.checkpoint_path(straight, step).name for step in (2, 4, 6)]


def test_average_cli_is_the_mean_of_the_last_checkpoints(data_dir: Path, tmp_path: Path):
    out_dir = tmp_path / "run"
    _run(TRAIN_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(out_dir), "--max-steps", "6",
                        "--valid-every", "0", "--save-every", "1", "--keep-last", "6"])
    paths = checkpoint.list_checkpoints(out_dir)
    assert len(paths) == 6
    _run(["average", "--out-dir", str(out_dir), "--last", "2"])
    averaged = checkpoint.load_checkpoint(out_dir / "checkpoint_average.pt")
    states = [torch.load(path, weights_only=True)["model"] for path in paths[-2:]]
    assert states[0].keys() == averaged.model.keys()
    for name, tensor in averaged.model.items():
        torch.testing.assert_close(tensor, (states[0][name] + states[1][name]) / 2, **FP32)
    assert not torch.equal(states[0]["embed_tokens.weight"], states[1]["embed_tokens.weight"])
    # --inputs names the checkpoints to average: every one of them, more than --last's default 5 too; once each.
    inputs = [str(path) for path in paths]
    _run(["average", "--inputs", *inputs, "--output", str(tmp_path / "all.pt")])
    assert checkpoint.load_checkpoint(tmp_path / "all.pt").averaged_from == inputs
    assert f"--inputs names {inputs[1]} twice" in _fail(["average", "--inputs", *inputs[:2], inputs[1]])
    assert "is named as a run's best checkpoint" in _fail(["average", "--out-dir", str(out_dir), "--output",
                                                           str(checkpoint.best_checkpoint_path(out_dir))])
    # An averaged model is for inference: resuming from it is refused by name.
    (out_dir / "checkpoint_average.pt").rename(checkpoint.checkpoint_path(out_dir, 99))
    stderr = _fail(TRAIN_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(out_dir), "--max-steps", "100",
                                  "--resume"])
    assert "checkpoint_00000099.pt has no 'optimizer'" in stderr


def test_inverse_sqrt_schedule_matches_the_paper():
    d_model, warmup, scale = 64, 10, 2.0
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.Adam([parameter], lr=scale * d_model ** -0.5)
    scheduler = inverse_sqrt_schedule(optimizer, warmup)
    seen = []
    for _ in range(30):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = [scale * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5) for step in range(1, 31)]
    assert seen == pytest.approx(expected, rel=1e-12)
    assert max(seen) == seen[warmup - 1]


def test_an_update_that_misses_update_tokens_is_a_warning_naming_a_batch_that_fits(capsys):
    """The paper's 25k tokens on 8 ranks of --batch-tokens 4096 are one micro-batch a rank: 32,768 tokens."""
    options = TrainOptions(update_tokens=25000, batch_tokens=4096)
    trainer_module._warn_of_update_size(options, world_size=8, accumulation=1)
    assert capsys.readouterr().err == ("warning: an update is 1 micro-batch(es) of up to 4,096 tokens on each of 8 "
                                       "rank(s), 32,768 tokens, not --update-tokens 25,000: --batch-tokens 3,125 "
                                       "would fit it\n")
    trainer_module._warn_of_update_size(options, world_size=1, accumulation=6)  # 24,576
    assert capsys.readouterr().err == ""


def test_bad_training_input_is_a_clear_error(data_dir: Path, tmp_path: Path):
    broken = _corpus_slice(tmp_path / "broken", {"train": 20, "valid": 4})
    with (broken / "train.de").open("a", encoding="utf-8") as file:
        file.write("Eine Zeile zu viel.\n")
    flags = TRAIN_FLAGS + ["--max-steps", "1", "--out-dir", str(tmp_path / "run")]
    assert f"{broken / 'train.en'} has 20 lines but {broken / 'train.de'} has 21" in _fail(
        flags + ["--data-dir", str(broken)])
    lines = (data_dir / "train.de").read_bytes().splitlines(keepends=True)[:20]
    lines[4] = b"\xff\n"
    (broken / "train.de").write_bytes(b"".join(lines))
    assert f"{broken / 'train.de'}:5: not valid UTF-8" in _fail(flags + ["--data-dir", str(broken)])
    # --max-len past the preset's positions, before the corpus is prepared.
    prepared = tmp_path / "prepared"
    assert "exceed the tiny preset's max_positions=256: lower --max-len" in _fail(
        flags + ["--data-dir", str(data_dir), "--max-len", "300", "--prepared-dir", str(prepared), "--out-dir",
                 str(tmp_path / "long")])
    assert not prepared.exists() and not (tmp_path / "long").exists()
    # An empty validation split, before the corpus is prepared.
    no_valid = _corpus_slice(tmp_path / "empty_valid", {"train": 20, "valid": 0})
    assert "has no sentence pairs: --valid-every needs some" in _fail(
        flags + ["--data-dir", str(no_valid), "--prepared-dir", str(prepared), "--out-dir", str(tmp_path / "long")])
    assert not prepared.exists() and not (tmp_path / "long").exists()
    empty = _corpus_slice(tmp_path / "empty_train", {"train": 0, "valid": 4})
    assert "are empty: there is nothing to train on" in _fail(flags + ["--data-dir", str(empty)])
    broken = _corpus_slice(tmp_path / "no_valid", {"train": 20, "valid": 4})
    (broken / "valid.de").unlink()
    assert "valid.de" in _fail(flags + ["--data-dir", str(broken)])
    # A mistyped --out-dir is named, and not made (nor a lock file left in it).
    assert f"--resume: no checkpoint_*.pt in {tmp_path / 'typo'} (no such directory)" in _fail(
        flags + ["--data-dir", str(data_dir), "--out-dir", str(tmp_path / "typo"), "--resume"])
    assert not (tmp_path / "typo").exists()


WITHOUT_EXTENSION = """import runpy, sys
sys.modules['fastformer._C'] = None  # as where it is not built
sys.argv = ['fastformer'] + sys.argv[1:]
runpy.run_module('fastformer', run_name='__main__')
"""


@pytest.mark.parametrize("command", ["train", "demo"])
def test_without_the_compiled_search_a_run_that_translates_fails_before_training(command: str, data_dir: Path,
                                                                                  tmp_path: Path):
    """Validation's BLEU (and the demo's test translation) need the compiled search: its absence is one line before
    the out-dir is even made, not an error after hours of training; a run that never translates does not need it."""
    out_dir = tmp_path / "run"
    flags = TRAIN_FLAGS[1:] + ["--data-dir", str(data_dir), "--max-steps", "2"] if command == "train" else []
    done = run(["-c", WITHOUT_EXTENSION, command] + flags + ["--out-dir", str(out_dir)], module=False)
    # (Which of unloadable_extension_message's cases depends on where fastformer is imported from.)
    assert done.returncode == 1 and done.stderr.startswith(f"fastformer {command}: error: fastformer") and (
        "_C" in done.stderr) and done.stderr.count("\n") == 1, done.stderr
    assert not out_dir.exists()
    if command == "train":
        done = run(["-c", WITHOUT_EXTENSION, "train"] + flags + ["--out-dir", str(out_dir), "--valid-bleu-sentences",
                                                                 "0"], module=False)
        assert done.returncode == 0, done.stderr


def test_a_validation_split_it_cannot_run_on_is_an_error_before_any_update(tmp_path: Path):
    out_dir = tmp_path / "run"
    flags = TRAIN_FLAGS + ["--max-steps", "4", "--out-dir", str(out_dir)]
    empty = _corpus_slice(tmp_path / "empty", {"train": 20, "valid": 0})
    assert "has no sentence pairs: --valid-every needs some" in _fail(flags + ["--data-dir", str(empty)])
    long = _corpus_slice(tmp_path / "long", {"train": 20, "valid": 4})
    with (long / "valid.en").open("a", encoding="utf-8") as file:
        file.write(" ".join(["Der kleine Hund"] * 200) + "\n")
    with (long / "valid.de").open("a", encoding="utf-8") as file:
        file.write("Der Hund.\n")
    assert "more than the model's max_positions=256" in _fail(flags + ["--data-dir", str(long)])
    assert not checkpoint.list_checkpoints(out_dir)
    _run(flags + ["--data-dir", str(long), "--valid-every", "0"])
    # Without validation, no validation split is needed.
    train_only = _corpus_slice(tmp_path / "train_only", {"train": 20})
    assert "no valid split in" in _fail(flags + ["--data-dir", str(train_only), "--out-dir", str(tmp_path / "a")])
    _run(flags + ["--data-dir", str(train_only), "--valid-every", "0", "--out-dir", str(tmp_path / "b")])
    assert checkpoint.list_checkpoints(tmp_path / "b")


def test_resume_takes_the_default_vocabulary_size_spelled_out():
    saved = {"vocab_size": None, "data_dir": "/data/wmt14", "init_from": None}
    assert changed_resume_options(saved, TrainOptions(data_dir="/data/wmt14", vocab_size=DEFAULT_VOCAB)) == []
    assert changed_resume_options(saved, TrainOptions(data_dir="/data/wmt14", vocab_size=32000)) == [
        f"--vocab-size 32000 (checkpoint: {DEFAULT_VOCAB})"]


def test_fresh_run_refuses_an_old_runs_directory_and_foreign_checkpoints(data_dir: Path, tmp_path: Path):
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    torch.save({"state_dict": {}}, checkpoint.checkpoint_path(out_dir, 5))
    flags = TRAIN_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(out_dir), "--max-steps", "1"]
    assert "--resume" in _fail(flags)
    assert f"{checkpoint.checkpoint_path(out_dir, 5)} is not a fastformer checkpoint" in _fail(flags + ["--resume"])
    checkpoint.checkpoint_path(out_dir, 5).write_bytes(b"\x80\x02garbage")
    assert f"{checkpoint.checkpoint_path(out_dir, 5)} is not a fastformer checkpoint: torch.load cannot read it" in \
        _fail(flags + ["--resume"])


def test_resume_refuses_changed_options_and_names_them(data_dir: Path, tmp_path: Path):
    flags = TRAIN_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(tmp_path / "run")]
    _run(flags + ["--max-steps", "2"])
    stderr = _fail(flags + ["--max-steps", "4", "--resume", "--warmup", "5", "--lr-scale", "3", "--update-tokens",
                            "400", "--label-smoothing", "0.2"])
    for changed in ("--warmup 5 (checkpoint: 4)", "--lr-scale 3.0 (checkpoint: 4.0)",
                    "--update-tokens 400 (checkpoint: 800)", "--label-smoothing 0.2 (checkpoint: 0.1)"):
        assert changed in stderr
    other_data = _corpus_slice(tmp_path / "other", {"train": 120, "valid": 8})
    assert f"--data-dir {other_data} (checkpoint: {data_dir})" in _fail(
        [arg if arg != str(data_dir) else str(other_data) for arg in flags] + ["--max-steps", "4", "--resume"])
    # What only sets this session's budget, logging or checkpointing may change.
    _run(flags + ["--max-steps", "3", "--resume", "--log-every", "1", "--keep-last", "4"])
    assert checkpoint.load_checkpoint(checkpoint.checkpoint_path(tmp_path / "run", 3)).step == 3


def test_resume_falls_back_to_the_newest_readable_checkpoint(data_dir: Path, tmp_path: Path):
    """The newest checkpoint cut short (a crash mid-copy): resuming from the one before, with a message, retrains
    the lost steps exactly; a temp file of a killed save is removed."""
    out_dir = tmp_path / "run"
    flags = TRAIN_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(out_dir)]
    _run(flags + ["--max-steps", "4"])
    newest = checkpoint.checkpoint_path(out_dir, 4)
    straight = checkpoint.load_checkpoint(newest)
    straight_records = measured_records(out_dir)
    straight_bytes = newest.read_bytes()
    newest.write_bytes(straight_bytes[:4096])
    killed_save = out_dir / ".checkpoint_00000006.pt.x1y2z3.tmp"
    killed_save.write_bytes(b"half a checkpoint")
    done = run(flags + ["--max-steps", "4", "--resume"])
    assert done.returncode == 0, done.stderr
    assert f"{newest} is not a readable checkpoint" in done.stderr
    assert f"resuming from {checkpoint.checkpoint_path(out_dir, 2)}" in done.stderr
    _assert_same_tensors(checkpoint.load_checkpoint(newest).model, straight.model, "retrained step 4 vs the lost one")
    # The records of steps 3 and 4, logged after checkpoint 2, were dropped and logged again: none twice.
    assert measured_records(out_dir) == straight_records and [r["step"] for r in straight_records] == [2, 2, 4, 4]
    assert not killed_save.exists()
    assert (out_dir / f"{newest.name}.unreadable").read_bytes() == straight_bytes[:4096]


def test_keep_last_keeps_what_a_resume_past_an_unreadable_checkpoint_saves(data_dir: Path, tmp_path: Path):
    """The unreadable newest checkpoint is renamed out of the way, so --keep-last never counts it as the newest and
    deletes the checkpoints the resumed run saves."""
    out_dir = tmp_path / "run"
    flags = TRAIN_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(out_dir), "--valid-every", "0"]
    _run(flags + ["--max-steps", "4"])
    newest = checkpoint.checkpoint_path(out_dir, 4)
    newest.write_bytes(newest.read_bytes()[:4096])
    _run(flags + ["--max-steps", "3", "--save-every", "1", "--keep-last", "1", "--resume"])
    assert checkpoint.list_checkpoints(out_dir) == [checkpoint.checkpoint_path(out_dir, 3)]
    assert checkpoint.load_checkpoint(checkpoint.checkpoint_path(out_dir, 3)).step == 3


def test_missing_data_or_unusable_device_leaves_no_out_dir(tmp_path: Path):
    out_dir = tmp_path / "run"
    flags = TRAIN_FLAGS + ["--out-dir", str(out_dir), "--max-steps", "1"]
    assert f"data directory not found: {tmp_path / 'absent'}" in _fail(flags + ["--data-dir", str(tmp_path / "absent")])
    assert not out_dir.exists()
    done = run(flags + ["--backend", "triton"], unset_env=("TRITON_INTERPRET",))
    assert done.returncode == 1 and "--backend triton on cpu needs a GPU" in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and not out_dir.exists()
    if not torch.cuda.is_available():
        stderr = _fail([arg if arg != "cpu" else "cuda" for arg in flags])
        assert "--device cuda: " in stderr and not out_dir.exists()


def test_a_corpus_on_disk_trains_the_paper_base_model_by_default():
    assert TrainOptions(data_dir="/data/wmt14").preset == "base"
    assert TrainOptions().preset == "tiny", "the bundled toy corpus keeps the tiny model"
    assert TrainOptions(data_dir="/data/wmt14", preset="big").preset == "big"


def test_bf16_master_weights_on_buckets_resume_exactly_under_torchrun(data_dir: Path, tmp_path: Path):
    """--precision bf16-master --batching buckets on 2 gloo ranks (master gradients all-reduced by hand): 2 steps then
    --resume to 4 == 4 straight; the checkpoint holds fp32 weights, and the ranks trained."""
    common = TRAIN_FLAGS + ["--data-dir", str(data_dir), "--precision", "bf16-master", "--batching", "buckets",
                            "--valid-every", "0"]
    split, straight = tmp_path / "split", tmp_path / "straight"
    resumed, reference = _resumed_and_straight(common, split, straight, steps=4)
    assert resumed.data == reference.data
    _assert_same_tensors(resumed.model, reference.model, "resumed vs straight")
    assert all(tensor.dtype == torch.float32 for tensor in reference.model.values() if tensor.is_floating_point())
    first = checkpoint.load_checkpoint(checkpoint.checkpoint_path(split, 2))
    assert not torch.equal(first.model["encoder.layers.0.ffn.linear1.weight"],
                           reference.model["encoder.layers.0.ffn.linear1.weight"])


def test_a_checkpoint_from_before_buckets_resumes_and_keeps_its_batching(data_dir: Path, tmp_path: Path):
    """A checkpoint whose options predate --batching was trained on token batches: resuming it on buckets is refused
    by name, and resuming it under another precision works (checkpoints hold fp32 weights either way)."""
    out_dir = tmp_path / "run"
    flags = TRAIN_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(out_dir), "--valid-every", "0"]
    _run(flags + ["--max-steps", "2"])
    path = checkpoint.checkpoint_path(out_dir, 2)
    old = checkpoint.load_checkpoint(path)
    for name in ("batching", "precision", "step"):
        del old.options[name]
    checkpoint.save_checkpoint(old, path)
    assert "--batching buckets (checkpoint: tokens)" in _fail(flags + ["--max-steps", "3", "--resume", "--batching",
                                                                        "buckets"])
    _run(flags + ["--max-steps", "3", "--resume", "--precision", "bf16-master"])
    assert checkpoint.load_checkpoint(checkpoint.checkpoint_path(out_dir, 3)).step == 3


def test_captured_step_needs_a_gpu_buckets_and_master_weights(data_dir: Path, tmp_path: Path):
    flags = TRAIN_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(tmp_path / "run"), "--max-steps", "1",
                           "--step", "captured"]
    assert "--step captured needs --batching buckets" in _fail(flags)
    if not torch.cuda.is_available():
        stderr = _fail(flags + ["--batching", "buckets", "--precision", "bf16-master"])
        assert "--step captured replays CUDA graphs: it needs a GPU" in stderr
        assert not (tmp_path / "run").exists()
