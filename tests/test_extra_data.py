"""Several corpora: --extra-data corpora (e.g. back-translations) trained on beside the main one, which
--upsample-primary counts N times an epoch, their sources tagged with --tag-extra's reserved token; each corpus
prepared once on its own, and the data position still resuming exactly. Bad input is one line before any work."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest

from fastformer import checkpoint
from fastformer.data import Tokenizer, read_lines
from fastformer.training.options import TrainOptions
from fastformer.training.trainer import Trainer
from test_train import TRAIN_FLAGS, _assert_same_tensors, _corpus_slice, _fail, _resumed_and_straight, _run, \
    data_dir  # noqa: F401 (fixture)

TAG = "<BT>"


@pytest.fixture(scope="module")
def extra_dir(tmp_path_factory) -> Path:
    """40 pairs of the bundled training corpus that the main slice (its first 120) does not hold."""
    directory = tmp_path_factory.mktemp("extra") / "back-translated"
    _corpus_slice(directory, {"train": 160})
    for lang in ("en", "de"):
        path = directory / f"train.{lang}"
        path.write_text("".join(line + "\n" for line in read_lines(path)[120:]), encoding="utf-8")
    return directory


def _rows(tensor, pad_id: int) -> list[tuple[int, ...]]:
    return [tuple(int(token) for token in row if token != pad_id) for row in tensor.tolist()]


def test_an_epoch_holds_the_main_pairs_n_times_and_the_tagged_extra_pairs_once(data_dir: Path, extra_dir: Path,
                                                                                 tmp_path: Path):
    """Every source and target of epoch 0's batches, counted: each main pair 3 times, each extra pair once with the
    tag before its source; the oracle encodes the text files with the run's tokenizer."""
    trainer = Trainer(TrainOptions(out_dir=str(tmp_path / "run"), data_dir=str(data_dir), extra_data=[str(extra_dir)],
                                   upsample_primary=3, tag_extra=TAG, vocab_size=200, batch_tokens=200, quiet=True,
                                   device="cpu"))
    tokenizer, eos = trainer.tokenizers.source, trainer.config.eos_id
    tag = tokenizer.processor.piece_to_id(TAG)
    assert tokenizer.processor.id_to_piece(tag) == TAG, "the vocabulary reserves the tag as one piece"
    sources, targets = collections.Counter(), collections.Counter()
    for indices in trainer.stream.sampler.all_batches(0):
        batch = trainer.train_corpus.batch(np.asarray(indices), trainer.config.vocab_size)
        sources.update(row[:-1] for row in _rows(batch.src, trainer.config.pad_id))  # without EOS
        targets.update(row[1:] for row in _rows(batch.tgt_in, trainer.config.pad_id))  # without BOS
    expected_sources, expected_targets = collections.Counter(), collections.Counter()
    for directory, copies, prefix in ((data_dir, 3, ()), (extra_dir, 1, (tag,))):
        for ids in tokenizer.encode(read_lines(directory / "train.en")):
            expected_sources[prefix + tuple(ids)] += copies
        for ids in tokenizer.encode(read_lines(directory / "train.de")):
            expected_targets[tuple(ids)] += copies
    assert sum(expected_sources.values()) == 3 * 120 + 40
    assert sources == expected_sources and targets == expected_targets
    assert eos not in {token for row in sources for token in row}


def test_extra_data_resumes_exactly_under_torchrun(data_dir: Path, extra_dir: Path, tmp_path: Path):
    """2 steps then --resume to 4 == 4 straight, on 2 ranks, with a tagged extra corpus and the main one upsampled;
    the resumed data position and weights are the straight run's."""
    flags = TRAIN_FLAGS + ["--data-dir", str(data_dir), "--extra-data", str(extra_dir), "--upsample-primary", "2",
                           "--tag-extra", TAG, "--valid-every", "0"]
    resumed, straight = _resumed_and_straight(flags, tmp_path / "split", tmp_path / "straight", steps=4)
    assert resumed.data == straight.data
    _assert_same_tensors(resumed.model, straight.model, "resumed vs straight")
    assert "--upsample-primary 3 (checkpoint: 2)" in _fail(
        [flag if flag != "2" else "3" for flag in flags] + ["--out-dir", str(tmp_path / "split"), "--max-steps", "5",
                                                           "--resume"])


def test_bad_extra_corpora_and_tags_are_one_line_before_any_work(data_dir: Path, extra_dir: Path, tmp_path: Path):
    out_dir, prepared = tmp_path / "run", tmp_path / "prepared"
    flags = TRAIN_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(out_dir), "--max-steps", "1",
                           "--valid-every", "0", "--prepared-dir", str(prepared)]
    uneven = _corpus_slice(tmp_path / "uneven", {"train": 20})
    with (uneven / "train.de").open("a", encoding="utf-8") as file:
        file.write("Eine Zeile zu viel.\n")
    stderr = _fail(flags + ["--extra-data", str(uneven)])
    assert f"{uneven / 'train.en'} has 20 lines but {uneven / 'train.de'} has 21" in stderr
    assert stderr.count("\n") == 1 and not prepared.exists(), "nothing was prepared"
    assert f"data directory not found: {tmp_path / 'absent'}" in _fail(
        flags + ["--extra-data", str(tmp_path / "absent")])
    assert "--upsample-primary and --tag-extra weigh and tag the corpora of --extra-data" in _fail(
        flags + ["--upsample-primary", "2"])
    # A run whose vocabulary reserved the tag: a fine-tuning run from it may tag with it, not with an ordinary piece.
    _run(flags + ["--extra-data", str(extra_dir), "--tag-extra", TAG])
    source = checkpoint.checkpoint_path(out_dir, 1)
    fine, fine_prepared = tmp_path / "fine", tmp_path / "prepared-fine"
    fine_tune = TRAIN_FLAGS[:3] + TRAIN_FLAGS[7:] + [
        "--data-dir", str(data_dir), "--out-dir", str(fine), "--max-steps", "1", "--valid-every", "0",
        "--prepared-dir", str(fine_prepared), "--init-from", str(source), "--extra-data", str(extra_dir)]
    piece = Tokenizer(checkpoint.load_checkpoint(source).tokenizer).processor.id_to_piece(10)
    stderr = _fail(fine_tune + ["--tag-extra", piece])
    assert (f"--tag-extra {piece!r} collides with the vocabulary piece {piece!r} (id 10) of --init-from {source}"
            in stderr and stderr.count("\n") == 1), stderr
    assert f"--tag-extra '<MT>' is not in the vocabulary of --init-from {source}" in _fail(
        fine_tune + ["--tag-extra", "<MT>"])
    for special in ("<pad>", "</s>", "<unk>"):
        assert f"--tag-extra {special!r} is a special token of --init-from {source}" in _fail(
            fine_tune + ["--tag-extra", special])
    assert not fine.exists() and not fine_prepared.exists()
    _run(fine_tune + ["--tag-extra", TAG])
