"""One process's times of fastformer systems (cpu_options.py's: base model, 37k vocabulary, 64 sentences, int8,
two threads): each system brought to steady state, then called in turn 5 times; prints the medians as one JSON line
with the package it imported. alternate.sh runs it from two packages in turn."""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
import fastformer  # noqa: E402
from cpu_options import fastformer_run, model_and_sources  # noqa: E402

systems = sys.argv[1].split(",")
model, src = model_and_sources(argparse.Namespace(threads=2, seed=0, shape="b", vocab=37000))
runs = {system: fastformer_run(system, model, src, "int8") for system in systems}
for run in runs.values():
    for _ in range(2):
        run()
seconds = {system: [] for system in systems}
for _ in range(5):
    for system, run in runs.items():
        start = time.perf_counter()
        run()
        seconds[system].append(time.perf_counter() - start)
print(json.dumps({"package": fastformer.__file__, **{s: statistics.median(t) for s, t in seconds.items()}}))
