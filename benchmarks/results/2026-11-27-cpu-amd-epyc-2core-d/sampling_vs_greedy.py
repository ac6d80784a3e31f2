"""Sampling (top-k 10) against greedy search in one process, alternating call by call: cpu_options.py's base model
(37k words), 64 sentences of 31 source tokens, int8, the threads of OMP_NUM_THREADS, each system at steady state first.
Prints each system's best and median seconds and the median over pairs of greedy's time over sampling's."""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/

import torch  # noqa: E402

import cpu_options  # noqa: E402
from cpu_decoding import steady_call  # noqa: E402

pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 40
settings = argparse.Namespace(threads=torch.get_num_threads(), seed=0, shape="b", vocab=37000)
model, src = cpu_options.model_and_sources(settings)
runs = {system: cpu_options.fastformer_run(system, model, src, "int8") for system in ("greedy", "sampling")}
for run in runs.values():
    steady_call(lambda _, run=run: run(), src)
seconds: dict[str, list[float]] = {system: [] for system in runs}
for pair in range(pairs):
    order = list(runs) if pair % 2 == 0 else list(reversed(list(runs)))
    for system in order:
        start = time.perf_counter()
        runs[system]()
        seconds[system].append(time.perf_counter() - start)
ratios = [g / s for g, s in zip(seconds["greedy"], seconds["sampling"])]
for system, values in seconds.items():
    print(f"{system}: best {min(values):.4f} s, median {statistics.median(values):.4f} s")
print(f"greedy time / sampling time, median of {pairs} pairs: {statistics.median(ratios):.4f} "
      f"(quartiles {statistics.quantiles(ratios, n=4)[0]:.4f}-{statistics.quantiles(ratios, n=4)[2]:.4f})")
