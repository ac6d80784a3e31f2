"""What a training run records for people to look at: OUT_DIR/metrics.jsonl, the same scalars as TensorBoard event
files (read back with TensorBoard's own reader), and `fastformer plot`'s PNG (opened with PIL). (metrics.jsonl
across a SIGTERM and --resume is checked with the run-control tests' stopped runs.)"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
from PIL import Image

from fastformer.training import metrics
from fastformer.training.curves import FIGURE_INCHES, DPI
from fastformer.training.metrics import METRICS_FILE, read_records
from fastformer_process import run
from test_train import TRAIN_FLAGS, _fail, _run, data_dir  # noqa: F401 (fixture)

LOG_KEYS = {"step", "epoch", "time", "train_loss", "lr", "grad_norm", "tokens_per_second", "real_token_share"}
VALID_KEYS = {"step", "epoch", "time", "valid_nll", "valid_bleu"}


def test_every_log_line_and_validation_is_a_record_and_a_tensorboard_scalar(data_dir: Path, tmp_path: Path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out_dir, logdir = tmp_path / "run", tmp_path / "tensorboard"
    _run(TRAIN_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(out_dir), "--max-steps", "6", "--log-every",
                        "2", "--valid-every", "3", "--tensorboard-logdir", str(logdir)])
    records = read_records(out_dir / METRICS_FILE)
    logged = [record for record in records if "train_loss" in record]
    validated = [record for record in records if "valid_nll" in record]
    assert [record["step"] for record in logged] == [2, 4, 6] and [record["step"] for record in validated] == [3, 6]
    assert all(record.keys() == LOG_KEYS for record in logged) and all(r.keys() == VALID_KEYS for r in validated)
    assert all(0 < record["real_token_share"] <= 1 and record["grad_norm"] > 0 for record in logged)
    # The rate each line's last update took (the paper's schedule: tiny's d_model 64, --lr-scale 4, --warmup 4).
    assert [record["lr"] for record in logged] == pytest.approx(
        [4 * 64 ** -0.5 * min(update ** -0.5, update * 4 ** -1.5) for update in (2, 4, 6)], rel=1e-12)
    events = EventAccumulator(str(logdir))
    events.Reload()
    for key in LOG_KEYS - {"step", "epoch", "time"} | VALID_KEYS - {"step", "epoch", "time"}:
        expected = [(record["step"], record[key]) for record in records if key in record]
        scalars = [(event.step, event.value) for event in events.Scalars(key)]
        assert scalars == [(step, pytest.approx(value, rel=1e-6)) for step, value in expected], key


def test_without_tensorboard_the_error_names_the_extra_before_any_work(data_dir: Path, tmp_path: Path):
    """The tensorboard package hidden from the import system: one line naming the extra, and no out-dir made."""
    out_dir = tmp_path / "run"
    hidden = ("import runpy, sys\n"
              "sys.modules['tensorboard'] = None\n"
              "sys.argv = ['fastformer'] + sys.argv[1:]\n"
              "runpy.run_module('fastformer', run_name='__main__')\n")
    done = run(["-c", hidden] + TRAIN_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(out_dir), "--max-steps",
                                                "1", "--tensorboard-logdir", str(tmp_path / "tb")], module=False)
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert ("fastformer train: error: --tensorboard-logdir needs the tensorboard package, an optional extra: pip "
            "install 'fastformer[tensorboard]'") in done.stderr
    assert not out_dir.exists()


def test_plot_overlays_runs_into_a_png_of_the_figure_size(data_dir: Path, tmp_path: Path):
    runs = [tmp_path / "first", tmp_path / "second"]
    for out_dir, lr_scale in zip(runs, ("4", "1")):
        _run(TRAIN_FLAGS + ["--data-dir", str(data_dir), "--out-dir", str(out_dir), "--max-steps", "4",
                            "--lr-scale", lr_scale])
    done = run(["plot", "--out-dir", str(runs[0]), "--out-dir", str(runs[1])])
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"drew the curves of 2 runs into {runs[0] / 'curves.png'}\n"
    with Image.open(runs[0] / "curves.png") as image:
        assert image.format == "PNG"
        assert image.size == (round(FIGURE_INCHES[0] * DPI), round(FIGURE_INCHES[1] * DPI))
        # Both runs' colours (matplotlib's C0 blue and C1 orange) are drawn.
        colours = {colour for _, colour in image.convert("RGB").getcolors(maxcolors=1 << 20)}
        assert (31, 119, 180) in colours and (255, 127, 14) in colours
    assert f"{tmp_path / 'absent' / METRICS_FILE} not found" in _fail(["plot", "--out-dir", str(tmp_path / "absent")])
    twice = run(["plot", "--out-dir", str(runs[0]), "--out-dir", str(runs[0])])
    assert twice.stdout == f"drew the curves of 1 run into {runs[0] / 'curves.png'}\n"


def test_a_series_of_one_point_is_drawn_as_a_dot(tmp_path: Path, monkeypatch):
    """A run validated once (a short run, a demo stopped by --minutes) still shows its validation."""
    import json

    from matplotlib.figure import Figure

    from fastformer.training.curves import plot_curves

    out_dir = tmp_path / "run"
    out_dir.mkdir()
    records = [{"step": 10, "train_loss": 5.0}, {"step": 20, "train_loss": 4.0},
               {"step": 20, "valid_nll": 4.2, "valid_bleu": 3.5}]
    (out_dir / METRICS_FILE).write_text("".join(json.dumps(record) + "\n" for record in records))
    drawn = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda figure, *args, **kwargs: drawn.append(figure) or save(
        figure, *args, **kwargs))
    plot_curves([out_dir], out_dir / "curves.png")
    markers = {line.get_label().split()[-1]: line.get_marker() for axis in drawn[0].axes for line in axis.lines}
    assert markers["valid_bleu"] == "o" and markers["valid_nll"] == "o"
    assert markers["train_loss"] in ("None", None, "")


def test_a_resume_that_cannot_rewrite_the_records_names_them_and_leaves_them(tmp_path: Path, monkeypatch):
    """A full disk as --resume drops the records past its step: one error naming metrics.jsonl, the file as it was,
    no temp file left."""
    path = tmp_path / METRICS_FILE
    path.write_text("".join(json.dumps({"step": step, "train_loss": 1.0}) + "\n" for step in (1, 2, 3)))
    before = path.read_bytes()

    def full_disk(*args):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(metrics.os, "replace", full_disk)
    with pytest.raises(OSError, match=f"cannot rewrite {path} for the resumed run: No space left on device"):
        metrics.MetricsLog(tmp_path, 2, None)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [METRICS_FILE]
