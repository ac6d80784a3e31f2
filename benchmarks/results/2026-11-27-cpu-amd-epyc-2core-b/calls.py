"""Scoring, greedy search and beam 4 at the headline (base model, 37k vocabulary, 64 sentences of 20 tokens, int8,
2 threads; benchmarks/cpu_options.py's and cpu_decoding.py's calls), each timed 10 times after its steady state in
this process: one JSON line with each one's best and median seconds and the fastformer package timed.

    PYTHONPATH=DIR python calls.py    # DIR's fastformer (ab.sh alternates two packages)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import cpu_decoding as cd  # noqa: E402
import cpu_options as co  # noqa: E402
import fastformer  # noqa: E402


def main() -> None:
    args = argparse.Namespace(threads=2, seed=0, shape="b", vocab=37000)
    model, src = co.model_and_sources(args)
    runs = {"score": co.fastformer_run("score", model, src, "int8"),
            "greedy": co.fastformer_run("greedy", model, src, "int8"),
            "beam4": co.fastformer_run("beam4", model, src, "int8")}
    seconds = {}
    for name, run in runs.items():
        cd.steady_call(lambda _: run(), src)
        timed = []
        for _ in range(10):
            start = time.perf_counter()
            run()
            timed.append(time.perf_counter() - start)
        seconds[name] = {"best": round(min(timed), 4), "median": round(statistics.median(timed), 4)}
    print(json.dumps({"package": str(Path(fastformer.__file__).parent), "threads": torch.get_num_threads(),
                      "seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
