"""python score_calls.py SYSTEMS CALLS [THREADS]: cpu_options.py's systems (base model, 37k vocabulary, 64 sentences,
int8, THREADS threads: 2 unless given), each called 3 times, then CALLS times in turn; prints each call's seconds and
tokens/s. Run under `perf record` for the profiles here."""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/
from cpu_options import fastformer_run, model_and_sources  # noqa: E402

threads = int(sys.argv[3]) if len(sys.argv) > 3 else 2
model, src = model_and_sources(argparse.Namespace(threads=threads, seed=0, shape="b", vocab=37000))
runs = {system: fastformer_run(system, model, src, "int8") for system in sys.argv[1].split(",")}
for run in runs.values():
    for _ in range(3):
        run()
for _ in range(int(sys.argv[2])):
    for system, run in runs.items():
        start = time.perf_counter()
        tokens = run()
        seconds = time.perf_counter() - start
        print(system, f"{seconds:.4f}s", f"{tokens / seconds:.0f} tok/s", flush=True)
