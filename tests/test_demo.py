"""The main job, shortened: `python -m fastformer demo` on the bundled corpus must keep reaching a high BLEU.

A fixed number of steps rather than the demo's time budget, so the result does not depend on the machine's speed.
On a GPU machine the same command trains on the GPU (bf16 autocast, the fused kernels) and decodes there.
"""

from __future__ import annotations

import re

import pytest

from fastformer.__main__ import DEMO_STEPS as DEMO_DEFAULT_STEPS
from fastformer.__main__ import build_parser
from fastformer_process import DEMO_STEPS, run

# A broken model, schedule, batching or beam search lands far below this floor (fastformer_process.DEMO_STEPS).
BLEU_FLOOR = 50.0


@pytest.mark.slow
def test_demo_reaches_the_bleu_floor(demo_run):
    _, done = demo_run
    lines = done.stdout.splitlines()
    assert any(line.startswith(f"trained {DEMO_STEPS} steps: ") and "target tokens/s" in line for line in lines)
    bleu_line = next(line for line in lines if line.startswith("BLEU|nrefs:1|case:mixed|eff:no|tok:13a|"))
    bleu = float(bleu_line.split(" = ")[1].split()[0])
    assert bleu > BLEU_FLOOR, done.stdout


def test_demo_is_a_fixed_number_of_updates_not_a_time():
    """The demo's result must not depend on the machine's load: no time limit by default, a fixed update count."""
    args = build_parser().parse_args(["demo"])
    assert args.max_minutes == 0 and args.max_steps == DEMO_DEFAULT_STEPS


def test_demo_shows_a_progress_bar_with_a_total(tmp_path):
    done = run(["demo", "--out-dir", str(tmp_path / "demo"), "--max-steps", "3", "--max-sentences", "2",
                "--valid-every", "0", "--device", "cpu"])
    assert done.returncode == 0, done.stderr
    assert re.search(r"train: 100%\|.*\| 3/3 \[", done.stderr), done.stderr
