"""Issue 32's "scoring >= 5x faster than beam-4 translation of the same sources" by batch size: cpu_options.py's
score and beam4 systems (int8, the random base model with a 37k vocabulary, 20-token sources, 31 target tokens a
sentence either way) on the first N of its 64 sources, N = 1, 8, 64, on THREADS threads, in one process: each brought
to steady state, then the two called in turn ROUNDS times (bench_utils.calls_in_turn); beam 4's time over
scoring's, median and range of the rounds.

    PYTHONPATH=<a build's checkout> python scoring_by_batch.py THREADS ROUNDS
"""

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import bench_utils  # noqa: E402
import cpu_options  # noqa: E402
from cpu_decoding import steady_call  # noqa: E402

threads, rounds = int(sys.argv[1]), int(sys.argv[2])
model, src = cpu_options.model_and_sources(argparse.Namespace(threads=threads, seed=0, shape="b", vocab=37000))
for n in (1, 8, 64):
    runs = {system: cpu_options.fastformer_run(system, model, src[:n], "int8") for system in ("score", "beam4")}
    for run in runs.values():
        steady_call(lambda _, run=run: run(), src[:n])
    tokens = {system: run() for system, run in runs.items()}
    seconds = bench_utils.calls_in_turn(runs, rounds)
    ratios = [b / s for b, s in zip(seconds["beam4"], seconds["score"])]
    print(f"{n:2d} sentences, {threads} thread(s): scoring {statistics.median(seconds['score']) * 1e3:.1f} ms, beam 4 "
          f"{statistics.median(seconds['beam4']) * 1e3:.1f} ms ({tokens['score']} and {tokens['beam4']} target tokens); "
          f"beam 4 / scoring {statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})", flush=True)
