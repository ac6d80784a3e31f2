"""`fastformer plot`: the curves of one or more runs, drawn from their metrics.jsonl with matplotlib (an optional
extra) into one PNG: train and validation loss, validation BLEU, learning rate and target tokens/s against the step."""

from __future__ import annotations

from pathlib import Path

from fastformer.training.metrics import METRICS_FILE, read_records

CURVES_FILE = "curves.png"
PLOT_EXTRA = "pip install 'fastformer[plot]' (or pip install matplotlib)"
# (title, y label, [(record key, line style)]) of each panel.
PANELS = (("loss", "loss per target token", [("train_loss", "-"), ("valid_nll", "--")]),
          ("validation BLEU", "BLEU", [("valid_bleu", "-")]),
          ("learning rate", "lr", [("lr", "-")]),
          ("throughput", "target tokens/s", [("tokens_per_second", "-")]))
FIGURE_INCHES, DPI = (12.0, 8.0), 100


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ImportError(f"fastformer plot needs matplotlib, an optional extra: {PLOT_EXTRA}") from None
    matplotlib.use("Agg")  # files only: no display is needed, or used
    import matplotlib.pyplot as pyplot
    return pyplot


def read_runs(out_dirs: list[Path]) -> dict[str, list[dict]]:
    """Each run's records, by its out-dir; a run without records is an error naming its file."""
    runs = {}
    for out_dir in out_dirs:
        path = Path(out_dir) / METRICS_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: plot draws the metrics `fastformer train` writes to its "
                                    f"--out-dir")
        runs[str(out_dir)] = read_records(path)
        if not runs[str(out_dir)]:
            raise ValueError(f"{path} holds no records yet")
    return runs


def plot_curves(out_dirs: list[Path], output: Path) -> Path:
    """Draws the runs of out_dirs (overlaid, one colour a run) into output, a FIGURE_INCHES * DPI pixel PNG."""
    runs = read_runs(out_dirs)
    pyplot = _pyplot()
    figure, axes = pyplot.subplots(2, 2, figsize=FIGURE_INCHES, dpi=DPI)
    for axis, (title, label, series) in zip(axes.flat, PANELS):
        for colour, (name, records) in enumerate(runs.items()):
            for key, style in series:
                points = [(record["step"], record[key]) for record in records if record.get(key) is not None]
                if points:
                    # A line of one point draws nothing: a single validation shows as a dot.
                    axis.plot(*zip(*points), style, color=f"C{colour}", label=f"{name} {key}",
                              marker="o" if len(points) == 1 else None)
        axis.set(title=title, xlabel="step", ylabel=label)
        if axis.has_data():
            axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(output, dpi=DPI)
    pyplot.close(figure)
    return output
